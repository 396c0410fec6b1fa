//! The held nodes of one session and the one task that watches them (issue 9: no task and no
//! future of the core's per held lock). Each hold is a record here, made at its grant: its node,
//! czxid, loss report and the deadline of its `max_hold` timer. The session's task (also its runtime
//! sentinel, see `session.rs`) sets an `exists` watch on each new record's node as soon as it is
//! woken by the grant (the watch is set at once: an operator's delete right after the grant reaches
//! the holder from the same delete event as the next waiter, so it is `Lost` with that waiter's
//! grant), keeps the one-shot watches of every held node in one
//! `FuturesUnordered`, and reports into the hold's `LossReport`:
//!
//! * the node missing or deleted → "the lock node X was deleted …"; found with another czxid →
//!   "… replaced by another" (a data change re-arms the watch; a transient error retries it with
//!   backoff);
//! * the session ended for good (`Expired`, `Closed`, `AuthFailed`, from the client's state or a
//!   watch's session event) → every hold of the session at once, and a hold registered afterwards at
//!   its registration;
//! * while the client merely reconnects, nothing (the watches are re-set by the client on reconnect;
//!   the core's deadline covers a session that may have expired meanwhile).
//!
//! A record is keyed by an id unique per hold, so a watch that outlives its hold (released, or
//! reported) never reports another one, even on the same path (a reaped lock path re-created, its
//! sequence restarting). A release (or the lease's drop) removes the record at once; the watch of a
//! released node ends when the release's delete reaches it. The `max_hold` timers are the same task's:
//! at a deadline passed unrenewed it deletes the node (the watch then reports it).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use distlock_core::clock::{self, Instant};
use distlock_core::raw::LossReport;
use distlock_core::retry::Backoff;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::Notify;
use zookeeper_client as zk;

use crate::config::ZkConfig;
use crate::error::session_gone;
use crate::lease::delete_node;
use crate::session::{lock, state_is_terminal, Session};

/// The held nodes of one session.
#[derive(Debug, Default)]
pub(crate) struct HeldNodes {
    state: Mutex<State>,
    /// Wakes the session's task: a node to watch, a deadline to sleep until.
    wake: Notify,
    /// The task's watches in flight (a test hook's figure): a released hold's watch ends when the
    /// release's delete reaches it.
    watching: AtomicUsize,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    records: HashMap<u64, Record>,
    /// Records whose watch the task has not set yet.
    to_watch: Vec<u64>,
    /// The `max_hold` deadlines, by time then id.
    deadlines: BTreeSet<(Instant, u64)>,
    /// The session ended for good, why: a hold registered afterwards is reported at once.
    ended: Option<String>,
}

impl State {
    /// Removes the hold `id`'s record and its deadline.
    fn take(&mut self, id: u64) -> Option<Record> {
        let record = self.records.remove(&id)?;
        if let Some(at) = record.expires {
            self.deadlines.remove(&(at, id));
        }
        Some(record)
    }
}

#[derive(Debug)]
struct Record {
    node: Arc<str>,
    czxid: i64,
    lost: LossReport,
    /// When the lease runs out unrenewed (the node is deleted then); `None` once that happened.
    expires: Option<Instant>,
}

impl HeldNodes {
    /// Records a granted hold (its watch is set by the task, woken now). Returns its id. A session that
    /// ended already reports the hold lost at once.
    pub(crate) fn register(
        &self,
        node: Arc<str>,
        czxid: i64,
        expires: Instant,
        lost: &LossReport,
    ) -> u64 {
        let mut state = lock(&self.state);
        if let Some(reason) = state.ended.clone() {
            drop(state);
            lost.report(reason);
            return 0;
        }
        state.next_id += 1;
        let id = state.next_id;
        state.records.insert(
            id,
            Record {
                node,
                czxid,
                lost: lost.clone(),
                expires: Some(expires),
            },
        );
        state.to_watch.push(id);
        state.deadlines.insert((expires, id));
        drop(state);
        // A permit is kept if the task is not waiting: it takes the record on its next turn.
        self.wake.notify_one();
        id
    }

    /// Pushes a hold's `max_hold` deadline out to `at` (a renewal); never earlier.
    pub(crate) fn extend(&self, id: u64, at: Instant) {
        let mut state = lock(&self.state);
        let state = &mut *state;
        let Some(record) = state.records.get_mut(&id) else {
            return;
        };
        match record.expires {
            Some(old) if at > old => {
                state.deadlines.remove(&(old, id));
                state.deadlines.insert((at, id));
                record.expires = Some(at);
            }
            _ => {}
        }
    }

    /// Forgets a hold (released or dropped): nothing is reported for it any more and its deadline is
    /// gone.
    pub(crate) fn forget(&self, id: u64) {
        lock(&self.state).take(id);
    }

    /// Whether the hold `id` is still recorded.
    fn holds(&self, id: u64) -> bool {
        lock(&self.state).records.contains_key(&id)
    }

    /// Reports the hold `id` lost (if it is still recorded) and forgets it.
    fn report(&self, id: u64, reason: String) {
        let record = lock(&self.state).take(id);
        if let Some(record) = record {
            record.lost.report(reason);
        }
    }

    /// The session ended for good: every hold is reported lost, and so is every later one.
    fn end(&self, reason: &str) {
        let records = {
            let mut state = lock(&self.state);
            if state.ended.is_some() {
                return;
            }
            state.ended = Some(reason.to_string());
            state.to_watch.clear();
            state.deadlines.clear();
            std::mem::take(&mut state.records)
        };
        for record in records.into_values() {
            record.lost.report(reason);
        }
    }

    /// The task's work: the new records to watch, the nodes whose deadline passed, the next deadline.
    fn take_work(&self, now: Instant) -> Work {
        let mut state = lock(&self.state);
        let state = &mut *state;
        let watch = std::mem::take(&mut state.to_watch)
            .into_iter()
            .filter_map(|id| {
                let record = state.records.get(&id)?;
                Some((id, record.node.clone(), record.czxid))
            })
            .collect();
        let mut expired = Vec::new();
        while let Some(&(at, id)) = state.deadlines.first() {
            if at > now {
                break;
            }
            state.deadlines.pop_first();
            if let Some(record) = state.records.get_mut(&id) {
                record.expires = None;
                expired.push(record.node.clone());
            }
        }
        Work {
            watch,
            expired,
            next: state.deadlines.first().map(|(at, _)| *at),
        }
    }

    /// Holds recorded (a test hook).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn records(&self) -> usize {
        lock(&self.state).records.len()
    }

    /// Watches in flight (a test hook).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn watching(&self) -> usize {
        self.watching.load(Ordering::Relaxed)
    }
}

struct Work {
    watch: Vec<(u64, Arc<str>, i64)>,
    expired: Vec<Arc<str>>,
    next: Option<Instant>,
}

/// What the session's task needs, made before the session (it is the session's runtime sentinel too).
pub(crate) struct Watcher {
    pub(crate) held: Arc<HeldNodes>,
    /// A clone of the session's client: the watches borrow it. The session closes when the task ends
    /// (its `Session` dropped), which drops this last clone.
    pub(crate) client: zk::Client,
    pub(crate) session: Weak<Session>,
    pub(crate) config: ZkConfig,
    /// The session, for messages.
    pub(crate) describe: String,
}

/// The session's task: watches its held nodes, reports their losses, runs their `max_hold` timers.
/// Returns when `stop` fires or is dropped (with the session).
pub(crate) async fn run(watcher: Watcher, mut stop: tokio::sync::oneshot::Receiver<()>) {
    let Watcher {
        held,
        client,
        session,
        config,
        describe,
    } = watcher;
    let held = &*held;
    let mut states = client.state_watcher();
    let mut watches = FuturesUnordered::new();
    let mut deletes = FuturesUnordered::new();
    loop {
        // Also seen here: a state the watcher was made after (the session ended before this task ran).
        let state = client.state();
        if state_is_terminal(state) {
            held.end(&format!("the ZooKeeper {describe} ended ({state:?})"));
        }
        if held_ended(held) {
            // Nothing more to watch or delete: the nodes went with the session.
            drop(watches);
            drop(deletes);
            held.watching.store(0, Ordering::Relaxed);
            let _ = stop.await;
            return;
        }
        let work = held.take_work(clock::now());
        for (id, node, czxid) in work.watch {
            watches.push(watch_node(&client, held, &describe, id, node, czxid));
        }
        if !work.expired.is_empty() {
            if let Some(session) = session.upgrade() {
                for node in work.expired {
                    deletes.push(expire(&config, session.clone(), node));
                }
            }
        }
        held.watching.store(watches.len(), Ordering::Relaxed);
        // With no deadline, a wake-up in a year (a new deadline comes with a wake anyway). On the boot
        // clock: a tokio timer would delete the node as much later as the machine was suspended.
        let until = work
            .next
            .unwrap_or_else(|| clock::now() + Duration::from_secs(365 * 24 * 3600));
        tokio::select! {
            _ = &mut stop => return,
            () = held.wake.notified() => {}
            Some(outcome) = watches.next(), if !watches.is_empty() => match outcome {
                Outcome::Lost(id, reason) => held.report(id, reason),
                Outcome::Ended(reason) => held.end(&reason),
                Outcome::Forgotten => {}
            },
            Some(()) = deletes.next(), if !deletes.is_empty() => {}
            state = states.changed() => {
                if state_is_terminal(state) {
                    held.end(&format!("the ZooKeeper {describe} ended ({state:?})"));
                }
            }
            () = clock::sleep_until(until) => {}
        }
    }
}

fn held_ended(held: &HeldNodes) -> bool {
    lock(&held.state).ended.is_some()
}

enum Outcome {
    Lost(u64, String),
    Ended(String),
    /// The hold was released (or reported) meanwhile.
    Forgotten,
}

/// Watches one held node until it is deleted or replaced, the session ends, or the hold is forgotten.
async fn watch_node(
    client: &zk::Client,
    held: &HeldNodes,
    describe: &str,
    id: u64,
    node: Arc<str>,
    czxid: i64,
) -> Outcome {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        if !held.holds(id) {
            return Outcome::Forgotten;
        }
        match client.check_and_watch_stat(&node).await {
            Ok((None, _)) => return Outcome::Lost(id, format!("the lock node {node} was deleted")),
            Ok((Some(stat), _)) if stat.czxid != czxid => {
                return Outcome::Lost(id, format!("the lock node {node} was replaced by another"))
            }
            Ok((Some(_), watcher)) => {
                backoff.reset();
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => {
                        return Outcome::Lost(
                            id,
                            format!("the lock node {node} was deleted (by an operator, or with its session)"),
                        )
                    }
                    zk::EventType::Session if state_is_terminal(event.session_state) => {
                        return Outcome::Ended(format!(
                            "the ZooKeeper {describe} ended ({:?})",
                            event.session_state
                        ))
                    }
                    _ => {}
                }
            }
            Err(e) if session_gone(&e) => {
                return Outcome::Ended(format!("the ZooKeeper {describe} ended ({e})"))
            }
            Err(_) => tokio::time::sleep(backoff.next_delay()).await,
        }
    }
}

/// Deletes a node whose lease ran out unrenewed: the watchdog stops renewing at `max_hold`, but the
/// session keeps itself alive with pings, so without it the node would outlive the hold.
async fn expire(config: &ZkConfig, session: Arc<Session>, node: Arc<str>) {
    tracing::debug!(%node, "lease ran out unrenewed; deleting the lock node");
    if let Err(e) = delete_node(config, &session, &node).await {
        tracing::warn!(%node, error = %e, "could not delete an expired lock node; it goes with its session");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch outliving its hold (released, then the same path granted again on the session: a reaped
    /// lock path re-created restarts its sequence) reports nothing into the new hold: records are keyed
    /// by hold, not by path.
    #[test]
    fn a_former_holds_report_never_reaches_the_next_hold_of_the_same_path() {
        let held = HeldNodes::default();
        let at = clock::now() + Duration::from_secs(60);
        let node: Arc<str> = "/a/_c_x-lock-0000000000".into();
        let (first, second) = (LossReport::new(), LossReport::new());
        let old = held.register(node.clone(), 10, at, &first);
        held.forget(old);
        let new = held.register(node, 20, at, &second);
        held.report(old, "the lock node was deleted".into());
        assert_eq!(second.reason(), None);
        assert_eq!(first.reason(), None, "a released hold is reported nothing");
        assert_eq!(held.records(), 1);
        held.report(new, "the lock node was deleted".into());
        assert!(second.reason().is_some());
        assert_eq!(held.records(), 0);
    }

    /// A session that ended reports every hold on it, and a hold registered afterwards at once.
    #[test]
    fn an_ended_session_reports_every_hold_and_each_later_one() {
        let held = HeldNodes::default();
        let at = clock::now() + Duration::from_secs(60);
        let reports: Vec<LossReport> = (0..3).map(|_| LossReport::new()).collect();
        for (i, lost) in reports.iter().enumerate() {
            held.register(format!("/n{i}").into(), 1, at, lost);
        }
        held.end("the ZooKeeper session 0x1 ended (Expired)");
        assert!(reports.iter().all(|r| r.reason().is_some()));
        let late = LossReport::new();
        held.register("/late".into(), 2, at, &late);
        assert!(late.reason().is_some());
        assert_eq!(held.records(), 0);
    }
}
