//! Break (`distlock break`): the holder's key deleted, checked against the hold `inspect` showed
//! ([`layout::BREAK`]), on every node at once.
//!
//! The hold is told by its whole value (`HolderInfo::hold_id`, which `inspect` fills with the value a
//! quorum of nodes held: `<owner id>#<nonce>`, the nonce new for every acquire), so a later hold of the
//! same owner id (a `Lock` that released and acquired again between the operator's `inspect` and the
//! break) keeps its keys: the break answers `false`. A holder without a `hold_id` (built by hand from an
//! owner id) is matched by its owner alone, any nonce: then such a later hold *is* broken.
//!
//! A quorum system's hold is over once too few nodes hold it for a quorum: the answer is `true`
//! when the script deleted the holder's key on at least one node and more than N − Q nodes no
//! longer hold it (deleted, or absent or another's: no quorum of the holder's keys can remain, so its
//! next renewal is `Gone`, as a release's `NotHeld` and a renewal's `Gone` count), `false` when no node
//! deleted anything and more than N − Q nodes hold none of it (that holder had no quorum any more).
//! Anything else (nodes that did not answer could still make the holder's quorum, or a node's
//! "nothing there" came from a resend that cannot tell whether its first attempt deleted the key) is
//! `Unavailable`, with what was deleted where: the keys on the silent nodes expire with the lease, or a
//! later break deletes them.

use distlock_core::raw::HolderInfo;
use distlock_core::{Error, ErrorKind, Result};

use crate::conn::Sent;
use crate::redlock::backend::RedlockBackend;
use crate::redlock::config::BACKEND;
use crate::redlock::fanout::fan_out;
use crate::redlock::layout;
use crate::rpc::int;

impl RedlockBackend {
    /// `Backend::break_holder`: see the [module](self).
    pub(crate) async fn break_everywhere(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let Some(owner) = holder.owner.as_deref() else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "the holder to break has no owner id: pass the holder inspect showed",
            )
            .with_backend(BACKEND)
            .with_lock(name));
        };
        let hold = holder.hold_id.as_deref();
        if let Some(value) = hold.filter(|value| layout::owner_of(value) != owner) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "the holder to break has owner {owner:?} but hold id {value:?}, which is another owner's: pass the holder inspect showed"
                ),
            )
            .with_backend(BACKEND)
            .with_lock(name));
        }
        let bound = self.config().connection.request_timeout;
        let scripts = self.scripts();
        let key = layout::lock_key(name).to_string();
        // The owner, then (when inspect showed it) the whole value: see `layout::BREAK`.
        let args: Vec<String> = std::iter::once(owner)
            .chain(hold)
            .map(str::to_string)
            .collect();
        let replies = fan_out(self.nodes(), |node| {
            let (scripts, key, args) = (scripts.clone(), key.clone(), args.clone());
            async move {
                let mut sent = Sent::default();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let reply = node
                    .script_recorded(
                        "Redlock break",
                        bound,
                        &scripts.break_holder,
                        &key,
                        &args,
                        &mut sent,
                    )
                    .await;
                (reply, sent.resent)
            }
        })
        .all(self.nodes().len())
        .await;
        let (mut deleted, mut absent, mut unknown, mut failures) = (0, 0, 0, Vec::new());
        for (node, reply) in self.nodes().iter().zip(replies) {
            match reply.map(|(r, resent)| (r.map(|v| int(&v)), resent)) {
                Some((Ok(Some(1)), _)) => deleted += 1,
                Some((Ok(Some(0)), false)) => absent += 1,
                Some((Ok(Some(0)), true)) => unknown += 1,
                Some((Ok(other), _)) => {
                    failures.push(format!("{}: unexpected reply {other:?}", node.shown()))
                }
                Some((Err(e), _)) => failures.push(format!("{}: {e}", node.shown())),
                None => failures.push(format!("{}: no reply", node.shown())),
            }
        }
        let (n, quorum) = (self.nodes().len(), self.config().quorum());
        let not_held = deleted + absent + unknown;
        if not_held > n - quorum {
            if deleted > 0 {
                if !failures.is_empty() {
                    tracing::debug!(lock = name, failures = ?failures, "Redlock break did not reach every node; the holder's keys there expire with its lease");
                }
                return Ok(true);
            }
            if unknown == 0 {
                return Ok(false);
            }
        }
        let mut why = Vec::new();
        if unknown > 0 {
            why.push(format!(
                "{unknown} were sent again after the connection broke before the reply came back and found nothing (the first attempt may have deleted the key)"
            ));
        }
        if !failures.is_empty() {
            why.push(format!(
                "{} did not answer, and with them the holder may still hold a quorum until its lease runs out: {}",
                failures.len(),
                failures.join("; ")
            ));
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "the Redlock break's outcome is unknown: it deleted {owner:?}'s key on {deleted} of {n} nodes and {absent} held none of it, so it cannot tell whether a quorum of {quorum} still holds it; {}; inspect the lock and break again",
                why.join("; ")
            ),
        )
        .with_backend(BACKEND)
        .with_lock(name))
    }
}
