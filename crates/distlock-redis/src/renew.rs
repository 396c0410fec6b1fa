//! Renewals: one pipeline of renew-script calls per connection (standalone, Sentinel) or per Cluster
//! hash slot, all groups at once.

use std::collections::BTreeMap;
use std::time::Duration;

use distlock_core::raw::{Renewal, RenewalId, Renewed};
use distlock_core::Result;
use redis::Value;

use crate::backend::RedisLease;
use crate::conn::Sent;
use crate::error::RedisError;
use crate::layout;
use crate::rpc::{int, millis, request_error, server_error, ScriptCall};
use crate::RedisBackend;

/// Outcomes of one group of renewals.
type Outcomes = Vec<(RenewalId, Result<Renewed>)>;

impl RedisBackend {
    /// `Backend::renew`.
    pub(crate) async fn renew_batch(&self, batch: &[Renewal<'_, RedisLease>]) -> Outcomes {
        if !self.inner.target.is_cluster() {
            let group: Vec<&Renewal<'_, RedisLease>> = batch.iter().collect();
            return self.renew_group(&group).await;
        }
        // Cluster: one pipeline per slot (a pipeline there must stay in one slot), all at once.
        let mut slots: BTreeMap<u16, Vec<&Renewal<'_, RedisLease>>> = BTreeMap::new();
        for entry in batch {
            slots
                .entry(layout::hash_slot(entry.name.as_bytes()))
                .or_default()
                .push(entry);
        }
        futures_util::future::join_all(slots.values().map(|group| self.renew_group(group)))
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Renews one group (one connection, or one Cluster slot) in one round trip; with
    /// `wait_replicas`, on the renewals' own `WAIT` connection, one batch at a time.
    async fn renew_group(&self, group: &[&Renewal<'_, RedisLease>]) -> Outcomes {
        // Each call written straight into its command (`ScriptCall`): a `ScriptInvocation` copies every
        // key and argument into buffers of its own first, 10,000 renewals' worth per tick (issue 9).
        let mut pipe = redis::Pipeline::with_capacity(group.len() + 1);
        for entry in group {
            let key = layout::lock_key(entry.name);
            let bytes = key.len() + 20 + entry.owner.len();
            let mut call = ScriptCall::new(&self.inner.scripts.renew, 1, 3, bytes);
            call.arg(key).arg(millis(entry.ttl)).arg(entry.owner);
            pipe.add_command(call.into_cmd());
        }
        let longest = group.iter().map(|e| e.ttl).max().unwrap_or_default();
        // A renewal answered after half the lease is of little use; fail it and let the core retry.
        let mut timeout = self
            .request_timeout()
            .min((longest / 2).max(Duration::from_millis(50)));
        let (link, gate) = match &self.inner.durable_renewals {
            Some((gate, link)) => {
                pipe.add_command(self.wait_cmd());
                timeout += self.config().wait_timeout;
                (link, Some(gate))
            }
            None => (&self.inner.link, None),
        };
        let _one_at_a_time = match gate {
            Some(gate) => Some(gate.lock().await),
            None => None,
        };
        let expected = group.len() + usize::from(gate.is_some());
        let values = match self
            .pipeline(link, "renew", timeout, pipe, &mut Sent::default())
            .await
        {
            Ok(values) if values.len() == expected => values,
            Ok(values) => {
                let e = RedisError::Reply {
                    what: "renew",
                    detail: format!("{} replies for {} renewals", values.len(), group.len()),
                };
                return every_entry(group, &e);
            }
            Err(e) => return every_entry(group, &e),
        };
        let shortfall = gate.and_then(|_| {
            let required = self.config().wait_replicas;
            let confirmed = values
                .last()
                .and_then(int)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0);
            (confirmed < required).then_some(RedisError::Replicas {
                confirmed,
                required,
            })
        });
        group
            .iter()
            .zip(&values)
            .map(|(entry, value)| {
                (
                    entry.id,
                    self.renew_outcome(entry, value, shortfall.as_ref()),
                )
            })
            .collect()
    }

    /// What one renew script's reply says about its entry.
    fn renew_outcome(
        &self,
        entry: &Renewal<'_, RedisLease>,
        value: &Value,
        shortfall: Option<&RedisError>,
    ) -> Result<Renewed> {
        if let Some(e) = server_error(value) {
            return Err(request_error("renew", &self.inner.target, e).into_core(Some(entry.name)));
        }
        match int(value) {
            Some(1) => match shortfall {
                Some(e) => Err(e.clone().into_core(Some(entry.name))),
                None => Ok(Renewed::Extended { ttl: entry.ttl }),
            },
            Some(0) => Ok(Renewed::Gone {
                reason: "another owner holds the lock on the server".into(),
            }),
            Some(-1) => Ok(Renewed::Gone {
                reason: "the lock's key is gone from the server (expired, deleted, or the server restarted without it)".into(),
            }),
            Some(-2) => Ok(Renewed::Gone {
                reason: "the lock's key was overwritten with another type".into(),
            }),
            _ => Err(RedisError::Reply {
                what: "the renew script",
                detail: format!("{value:?}"),
            }
            .into_core(Some(entry.name))),
        }
    }
}

/// The same error for every entry of a group.
fn every_entry(group: &[&Renewal<'_, RedisLease>], e: &RedisError) -> Outcomes {
    group
        .iter()
        .map(|g| (g.id, Err(e.clone().into_core(Some(g.name)))))
        .collect()
}
