//! Renewals: one round trip per connection (standalone, Sentinel) or per Cluster hash slot, all groups
//! at once: the group's renew-script calls in pipelines of at most [`RENEWALS_PER_PIPELINE`], sent back
//! to back on the connection without waiting for a reply in between.

use std::collections::BTreeMap;
use std::task::Poll;
use std::time::Duration;

use distlock_core::raw::{Renewal, RenewalId, Renewed};
use distlock_core::{LockKind, Result};
use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::Value;

use crate::backend::RedisLease;
use crate::conn::{Ask, Link, Sent};
use crate::error::{ClusterRefusal, RedisError};
use crate::layout;
use crate::rpc::{int, request_error, server_error};
use crate::RedisBackend;

/// The most renewals sent in one pipeline: a larger group goes as several, back to back on the same
/// connection (see `RedisBackend::renew_group`). 512 renew calls are ≈ 90 KB on the wire.
pub const RENEWALS_PER_PIPELINE: usize = 512;

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
    /// `wait_replicas`, on the renewals' own `WAIT` connection, one batch at a time, in one pipeline.
    ///
    /// A group of more than [`RENEWALS_PER_PIPELINE`] goes as several pipelines sent back to back on
    /// the same connection: each is queued on the connection as soon as it is built, before any reply
    /// is awaited, so the group still takes one round trip (and the server runs the commands in the
    /// same order). What this saves is memory (issue 9): redis-rs packs a pipeline into one buffer and
    /// copies it into the connection's write buffer, which keeps that capacity for as long as the
    /// connection lives: a 10,000-renewal pipeline left ≈ 1.7 MB there for good. In slices, both are
    /// one slice's (≈ 90 KB). The commands themselves live until their slice's replies are in (redis-rs
    /// borrows a pipeline until then), so a batch's peak is about the same. After a `NOSCRIPT` (a
    /// restarted server) each slice loads the scripts again on its own: a few `SCRIPT LOAD`s, once.
    async fn renew_group(&self, group: &[&Renewal<'_, RedisLease>]) -> Outcomes {
        let longest = group.iter().map(|e| e.ttl).max().unwrap_or_default();
        // A renewal answered after half the lease is of little use; fail it and let the core retry.
        let timeout = self
            .request_timeout()
            .min((longest / 2).max(Duration::from_millis(50)));
        if let Some((gate, link)) = &self.inner.durable_renewals {
            // `WAIT` counts the replication of the connection's writes before it: one pipeline, with
            // the `WAIT` last, so its count covers every renewal of the group.
            let _one_at_a_time = gate.lock().await;
            let timeout = timeout + self.config().wait_timeout;
            return self.renew_pipeline(link, group, timeout, true).await;
        }
        let link = &self.inner.link;
        if group.len() <= RENEWALS_PER_PIPELINE {
            return self.renew_pipeline(link, group, timeout, false).await;
        }
        let mut outcomes = Vec::with_capacity(group.len());
        let mut in_flight = FuturesUnordered::new();
        for slice in group.chunks(RENEWALS_PER_PIPELINE) {
            in_flight.push(self.renew_pipeline(link, slice, timeout, false));
            // Polled once now, so this slice is packed and queued on the connection before the next
            // is built: the slices travel back to back (replies already in are taken as they come).
            std::future::poll_fn(|cx| {
                while let Poll::Ready(Some(done)) = in_flight.poll_next_unpin(cx) {
                    outcomes.extend(done);
                }
                Poll::Ready(())
            })
            .await;
        }
        while let Some(done) = in_flight.next().await {
            outcomes.extend(done);
        }
        outcomes
    }

    /// One pipeline of renewals on `link` (with `WAIT` last if `wait`), and each entry's outcome.
    ///
    /// In Cluster, a slot under migration may have some of the group's locks on the target already
    /// (the source answers `ASK` for them) and the others still on the source: the group's pipeline
    /// cannot be sent whole to either node (the target would find no key for the others, and report
    /// them gone). Then every renewal goes on its own, following its own `ASK`, all at once: one more
    /// round trip, while the slot migrates. Likewise after a `TRYAGAIN` (a read hold whose hash and
    /// timeout key the migration split: see [`layout::ELSEWHERE`]), which fails the whole pipeline:
    /// the group's other renewals go through at once, and that one fails for this round
    /// ([`Ask::FollowNoWait`]: the watchdog tries it again at its next look, until its keys are on one
    /// node or its deadline passes).
    async fn renew_pipeline(
        &self,
        link: &Link,
        entries: &[&Renewal<'_, RedisLease>],
        timeout: Duration,
        wait: bool,
    ) -> Outcomes {
        if entries.len() == 1 || !self.inner.target.is_cluster() {
            return self
                .renew_once(link, entries, timeout, wait, Ask::FollowNoWait)
                .await
                .outcomes;
        }
        let outcomes = self
            .renew_once(link, entries, timeout, wait, Ask::Return)
            .await;
        if !outcomes.asked {
            return outcomes.outcomes;
        }
        tracing::debug!(
            renewals = entries.len(),
            "a slot under migration: renewing its locks one by one"
        );
        futures_util::future::join_all(entries.chunks(1).map(|one| async move {
            self.renew_once(link, one, timeout, wait, Ask::FollowNoWait)
                .await
                .outcomes
        }))
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// [`renew_pipeline`](Self::renew_pipeline)'s one pipeline, `ask` saying what to do with an `ASK`.
    async fn renew_once(
        &self,
        link: &Link,
        entries: &[&Renewal<'_, RedisLease>],
        timeout: Duration,
        wait: bool,
        ask: Ask,
    ) -> RenewOutcomes {
        // Each call written straight into its command (`ScriptCall`): a `ScriptInvocation` copies every
        // key and argument into buffers of its own first, 10,000 renewals' worth per tick (issue 9).
        let mut pipe = redis::Pipeline::with_capacity(entries.len() + usize::from(wait));
        for entry in entries {
            pipe.add_command(self.renew_call(entry).into_cmd());
        }
        if wait {
            pipe.add_command(self.wait_cmd());
        }
        let expected = entries.len() + usize::from(wait);
        let values = match self
            .pipeline(link, "renew", timeout, ask, pipe, &mut Sent::default())
            .await
        {
            Ok(values) if values.len() == expected => values,
            Ok(values) => {
                let e = RedisError::Reply {
                    what: "renew",
                    detail: format!("{} replies for {} renewals", values.len(), entries.len()),
                };
                return every_entry(entries, &e).into();
            }
            Err(e) => {
                let asked = matches!(
                    e.cluster_refusal(),
                    Some(ClusterRefusal::Ask(_) | ClusterRefusal::TryAgain)
                );
                return RenewOutcomes {
                    outcomes: every_entry(entries, &e),
                    asked,
                };
            }
        };
        let shortfall = wait.then(|| {
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
        let shortfall = shortfall.flatten();
        entries
            .iter()
            .zip(&values)
            .map(|(entry, value)| {
                (
                    entry.id,
                    self.renew_outcome(entry, value, shortfall.as_ref()),
                )
            })
            .collect::<Outcomes>()
            .into()
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
                reason: match entry.lease.kind {
                    LockKind::Read => "this owner's read hold is gone from the lock on the server (released, or the lock deleted and taken anew)",
                    LockKind::Permit { .. } => "the permit is gone from the semaphore on the server (reclaimed after it expired, or released)",
                    _ => "another owner holds the lock on the server",
                }
                .into(),
            }),
            Some(-1) => Ok(Renewed::Gone {
                reason: "the lock's key is gone from the server (expired, deleted, or the server restarted without it)".into(),
            }),
            Some(-2) => Ok(Renewed::Gone {
                reason: "the lock's key was overwritten with another type".into(),
            }),
            Some(-3) => Ok(Renewed::Gone {
                reason: match entry.lease.kind {
                    LockKind::Permit { .. } => "the permit's expiry passed on the server (any acquire may reclaim it now)",
                    _ => "the read hold's timeout key expired on the server (it no longer counts: another reader's release may delete the lock under it)",
                }
                .into(),
            }),
            _ => Err(RedisError::Reply {
                what: "the renew script",
                detail: format!("{value:?}"),
            }
            .into_core(Some(entry.name))),
        }
    }
}

/// The outcomes of one pipeline of renewals, and whether it failed with an `ASK` (or a `TRYAGAIN`) it
/// did not follow.
struct RenewOutcomes {
    outcomes: Outcomes,
    asked: bool,
}

impl From<Outcomes> for RenewOutcomes {
    fn from(outcomes: Outcomes) -> Self {
        Self {
            outcomes,
            asked: false,
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
