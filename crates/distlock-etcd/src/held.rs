//! The watch on held keys: one etcd watch stream per backend, with one watch (a client-chosen watch id)
//! per held key multiplexed on it, so a key deleted on the server (`etcdctl del`, `etcdctl lease
//! revoke`, a lease expiry) makes its guard `Lost` within one round trip of the delete instead of at the
//! next keep-alive (a third of the session TTL: 20 s at the default 60 s).
//!
//! Each watch filters out puts, so the only event it can see is the delete of that very key (a key
//! recreated later has a newer create_revision and comes after our delete). It is created at the grant
//! (or, for an acquisition that queued, when it queued), and the grant waits for its confirmation: a delete after that reaches this watch as soon as it
//! reaches the next waiter's watch (one pass over etcd's synced watches), so the guard learns of it
//! from the same event as that waiter, with no wait of its own (which of the two processes runs first
//! afterwards is not ordered: the waiter still needs a round trip, the holder a few local hops). It
//! starts at the server's current revision, not at the grant's: a watch starting in the past is
//! "unsynced" in etcd and served by its 100 ms catch-up loop, late enough for the next waiter to be
//! granted first. A delete between the grant's read and the watch is found by re-reading the key
//! when the confirmation's revision shows that the store moved meanwhile (see
//! [`HeldKeys::watch`]). A broken stream is reopened and every watch made again, from the current
//! revision too (a watch made from the grant's revision would be unsynced, and a delete right after
//! the reopen would reach it ~100 ms after the next waiter was granted: two guards `Held`); once it
//! is confirmed, the key is re-read if the store moved since it was last seen, so a delete that
//! happened while disconnected is still reported ([`recheck`]). A watch cancelled by the server (a
//! compaction) re-reads the key too (and is watched again under a new id: etcd refuses a cancelled
//! id on the same stream). A released key's watch is kept for [`LINGER`] (at most
//! [`MAX_LINGERING`] of them) and taken by the next grant of the same key, as a watch made while
//! queued is: a loop of acquire and release on one name creates no watch per cycle and waits for no
//! confirmation (issue 9). The watch then outlives its holds, so a delete reaching it counts only
//! while a hold has it and only if it is later than that hold's create_revision (the release's own
//! delete may arrive after the next grant). The task runs on the runtime
//! of whoever registered a key; if that runtime is gone (its tasks are dropped with it) the next
//! registration or renewal starts it again on the current one.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock_core::retry::Backoff;

use crate::rpc::pb::etcdserverpb::watch_create_request::FilterType;
use crate::rpc::pb::etcdserverpb::{RangeRequest, WatchCreateRequest, WatchResponse};
use crate::rpc::pb::mvccpb::event::EventType;
use crate::rpc::{Client, WatchStream};
use crate::tasks::Task;
use distlock_core::raw::LossReport;
use tokio::sync::{mpsc, oneshot};
use tonic::metadata::AsciiMetadataValue;

/// How long a released key's watch is kept for the next grant of the same key (issue 9): a loop of
/// acquire and release on one name then creates and cancels no watch per cycle and waits for no
/// confirmation. The same period as the core's watchdog lingers.
const LINGER: Duration = Duration::from_secs(1);

/// At most this many released keys' watches are kept at once (the oldest is cancelled first).
const MAX_LINGERING: usize = 64;

#[derive(Clone)]
struct Entry {
    key: Arc<str>,
    /// The revision the current hold of the key began at (its create_revision). A delete at an
    /// earlier revision is a former hold's (this watch outlives its holds, see [`LINGER`]).
    rev: i64,
    /// False while the watch is kept after a release with no hold to report on.
    held: bool,
    /// The latest delete the watch saw while kept (0: none). The next hold of the key may have been
    /// created before it (its create txn's reply still on its way): the grant that takes the watch
    /// must then not trust it (review of the kept watch: that hold stayed `Held` for good).
    deleted_while_kept: i64,
    /// The revision to (re)start the watch from.
    from: i64,
    lost: LossReport,
    /// Its watch was (or is being) created on the current stream: a release must cancel it.
    created: bool,
    /// The revision the server created its watch at on the current stream, once confirmed (reset
    /// when the stream is reopened): every delete after it reaches the watch.
    confirmed_at: Option<i64>,
}

enum Command {
    /// A new entry is to be watched.
    Wake,
    Cancel(i64),
    /// A released key's watch is kept: cancel it after [`LINGER`] unless a grant takes it.
    Linger,
    /// The connection was replaced: reopen the stream on the new one.
    Reopen,
}

struct Watcher {
    commands: mpsc::UnboundedSender<Command>,
    task: Task,
}

struct State {
    /// The backend's connection, replaced when its runtime is dropped.
    client: Client,
    /// The bound of one request (opening the stream, re-reading a key).
    request_timeout: Duration,
    next_id: i64,
    entries: HashMap<i64, Entry>,
    /// Watch ids handed out whose entry moved to a new id (its watch was cancelled by the server and
    /// made again: etcd does not take a cancelled id back on the same stream), old → new.
    moved: HashMap<i64, i64>,
    task: Option<Watcher>,
    /// The grants waiting for their watch's confirmation, by watch id: each gets the revision the
    /// server created the watch at.
    confirmations: HashMap<i64, oneshot::Sender<i64>>,
    /// The watches kept after their key's release ([`HeldKeys::linger`]), by key: watch id and
    /// when it was released.
    lingering: HashMap<Arc<str>, (i64, tokio::time::Instant)>,
}

/// The held keys of one backend and the task that watches them.
pub(crate) struct HeldKeys {
    state: Arc<Mutex<State>>,
}

impl Drop for HeldKeys {
    fn drop(&mut self) {
        if let Ok(state) = self.state.lock() {
            if let Some(task) = &state.task {
                task.task.abort();
            }
        }
    }
}

impl HeldKeys {
    pub(crate) fn new(client: Client, request_timeout: Duration) -> HeldKeys {
        HeldKeys {
            state: Arc::new(Mutex::new(State {
                client,
                request_timeout,
                next_id: 0,
                entries: HashMap::new(),
                moved: HashMap::new(),
                task: None,
                confirmations: HashMap::new(),
                lingering: HashMap::new(),
            })),
        }
    }

    /// Moves the watch to a new connection (the old one died with its runtime).
    pub(crate) fn use_client(&self, client: &Client) {
        if let Ok(mut state) = self.state.lock() {
            state.client = client.clone();
            if let Some(task) = &state.task {
                let _ = task.commands.send(Command::Reopen);
            }
            if !state.entries.is_empty() {
                self.ensure_task(&mut state);
            }
        }
    }

    /// Watches `key` (created at `rev`, known to exist at revision `from - 1`) until
    /// [`unwatch`](Self::unwatch); a delete is reported on `lost`. Returns the watch id and the
    /// confirmation: the revision the server created the watch at (if the stream broke first, that
    /// of the watch made again on the next stream). The watch covers every revision after that one;
    /// whether the key still existed at it is for the caller to find out. A caller that stops waiting
    /// leaves that to the watch task ([`recheck`]).
    pub(crate) fn watch(
        &self,
        key: Arc<str>,
        rev: i64,
        from: i64,
        lost: LossReport,
    ) -> (i64, oneshot::Receiver<i64>) {
        let (confirm, confirmed) = oneshot::channel();
        let Ok(mut state) = self.state.lock() else {
            return (0, confirmed);
        };
        state.next_id += 1;
        let id = state.next_id;
        state.entries.insert(
            id,
            Entry {
                key,
                rev,
                held: true,
                deleted_while_kept: 0,
                from,
                lost,
                created: false,
                confirmed_at: None,
            },
        );
        state.confirmations.insert(id, confirm);
        if !self.ensure_task(&mut state) {
            if let Some(task) = &state.task {
                let _ = task.commands.send(Command::Wake);
            }
        }
        (id, confirmed)
    }

    /// The revision the watch `id` was created at on the current stream, if it is confirmed there
    /// (not if the stream was reopened since and the watch is not confirmed again yet); otherwise a
    /// receiver of the next confirmation. A grant made after a wait uses the watch its acquisition
    /// made while queued: confirmed at or before the grant's read, it covers every later delete,
    /// with no round trip at the grant.
    pub(crate) fn confirmation(&self, id: i64) -> Result<i64, oneshot::Receiver<i64>> {
        let (confirm, confirmed) = oneshot::channel();
        let Ok(mut state) = self.state.lock() else {
            return Err(confirmed);
        };
        let mut id = id;
        while let Some(&moved) = state.moved.get(&id) {
            id = moved;
        }
        match state.entries.get(&id) {
            Some(entry) => {
                if let Some(revision) = entry.confirmed_at {
                    return Ok(revision);
                }
                state.confirmations.insert(id, confirm);
            }
            // Gone (its key was found deleted): the loss is on the entry's channel already; the
            // caller's re-read finds the same.
            None => drop(confirm),
        }
        Err(confirmed)
    }

    /// Stops watching (the lock was released).
    pub(crate) fn unwatch(&self, id: i64) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let mut id = id;
        state.confirmations.remove(&id);
        while let Some(moved) = state.moved.remove(&id) {
            id = moved;
        }
        if state.entries.remove(&id).is_some_and(|e| e.created) {
            if let Some(task) = &state.task {
                let _ = task.commands.send(Command::Cancel(id));
            }
        }
    }

    /// Keeps the watch of a released key for [`LINGER`], for the next grant of the same key
    /// ([`take_lingering`](Self::take_lingering)): it reports nothing meanwhile (the release's own
    /// delete is ignored). Called before the release's delete is sent.
    pub(crate) fn linger(&self, id: i64) {
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let state = &mut *state;
        let mut id = id;
        state.confirmations.remove(&id);
        while let Some(moved) = state.moved.remove(&id) {
            id = moved;
        }
        let Some(entry) = state.entries.get_mut(&id) else {
            return;
        };
        entry.held = false;
        entry.deleted_while_kept = 0;
        // A fresh channel nobody listens to: the released hold's loss channel is not reported on.
        entry.lost = LossReport::new();
        let key = entry.key.clone();
        let now = tokio::time::Instant::now();
        let mut doomed = Vec::new();
        // (The same id again: a release restarted after its first run kept the watch already.)
        if let Some((old, _)) = state.lingering.insert(key, (id, now)) {
            if old != id {
                doomed.push(old);
            }
        }
        if state.lingering.len() > MAX_LINGERING {
            if let Some(oldest) = state
                .lingering
                .iter()
                .min_by_key(|(_, (_, since))| *since)
                .map(|(key, _)| key.clone())
            {
                if let Some((old, _)) = state.lingering.remove(&oldest) {
                    doomed.push(old);
                }
            }
        }
        let mut cancels = Vec::new();
        for old in doomed {
            if state.entries.remove(&old).is_some_and(|e| e.created) {
                cancels.push(old);
            }
        }
        if let Some(task) = &state.task {
            for old in cancels {
                let _ = task.commands.send(Command::Cancel(old));
            }
            let _ = task.commands.send(Command::Linger);
        }
    }

    /// The watch kept after an earlier release of `key`, now watching for the hold created at
    /// `rev` (known to exist at revision `from - 1`) and reporting on `lost`: its id, to be used as a
    /// watch made while queued ([`confirmation`](Self::confirmation) says whether it covers the
    /// grant). None if no watch of the key is kept.
    pub(crate) fn take_lingering(
        &self,
        key: &str,
        rev: i64,
        from: i64,
        lost: &LossReport,
    ) -> Option<i64> {
        let mut state = self.state.lock().ok()?;
        let (id, _) = state.lingering.remove(key)?;
        let entry = state.entries.get_mut(&id)?;
        if entry.held || &*entry.key != key {
            return None;
        }
        if entry.deleted_while_kept > rev {
            // This hold's key was deleted before the grant took the watch (the event was spent on
            // the kept watch): every key of that name after the delete was created after it, so the
            // hold is gone, and is reported so at once. With the delete's revision unknown (an event
            // without its key), the grant makes a watch of its own, whose confirmation (after the
            // delete) makes it read the key.
            let known = entry.deleted_while_kept != i64::MAX;
            let key = entry.key.clone();
            let created = state.entries.remove(&id).is_some_and(|e| e.created);
            if let (true, Some(task)) = (created, &state.task) {
                let _ = task.commands.send(Command::Cancel(id));
            }
            drop(state);
            if known {
                lost.report(format!("its key {key} was deleted on the server right after the grant (by hand, or its session lease was revoked or expired)"),
                );
            }
            return None;
        }
        entry.held = true;
        entry.rev = rev;
        entry.from = from;
        entry.lost = lost.clone();
        Some(id)
    }

    /// A grant could not read its key after its watch was confirmed at `revision` (later than the
    /// grant's read): the watch task reads it instead, reopening the stream (which makes the watch,
    /// and this read, again) until a read answers. A delete before the watch was created is then
    /// still reported; only logging the failed read left such a hold `Held` for good (review).
    pub(crate) fn recheck_later(&self, id: i64, revision: i64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to read on: the stream's next reopen re-reads every watched key.
            return;
        };
        let Ok(state) = self.state.lock() else {
            return;
        };
        let mut id = id;
        while let Some(&moved) = state.moved.get(&id) {
            id = moved;
        }
        let (client, request_timeout) = (state.client.clone(), state.request_timeout);
        drop(state);
        runtime.spawn(recheck_in_background(
            Arc::downgrade(&self.state),
            client,
            request_timeout,
            id,
            revision,
        ));
    }

    /// Starts the task again if it is gone (its runtime was dropped) while keys are held.
    pub(crate) fn keep_running(&self) {
        if let Ok(mut state) = self.state.lock() {
            if !state.entries.is_empty() {
                self.ensure_task(&mut state);
            }
        }
    }

    /// Spawns the task on the current runtime unless one is alive; true if it spawned one (which
    /// watches every entry from the start).
    fn ensure_task(&self, state: &mut State) -> bool {
        if state
            .task
            .as_ref()
            .is_some_and(|t| t.task.is_alive() && !t.commands.is_closed())
        {
            return false;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let (commands, rx) = mpsc::unbounded_channel();
        let shared = Arc::downgrade(&self.state);
        state.task = Some(Watcher {
            commands,
            task: Task::spawn(&runtime, run(shared, rx)),
        });
        true
    }
}

/// The watch of one held key: deletes only, under the client-chosen id `id`, always from the server's
/// current revision (a watch starting in the past is "unsynced" in etcd: a delete reaches it only
/// through etcd's 100 ms catch-up loop, after the next waiter's synced watch). The revisions between
/// the key's last known-alive one and the watch's creation are covered by re-reading the key once
/// the creation is confirmed ([`recheck`]; at a grant, by the grant).
fn options(id: i64, entry: &Entry) -> WatchCreateRequest {
    WatchCreateRequest {
        key: entry.key.as_bytes().to_vec(),
        start_revision: 0,
        filters: vec![FilterType::Noput as i32],
        watch_id: id,
        ..WatchCreateRequest::default()
    }
}

type Shared = std::sync::Weak<Mutex<State>>;

/// Applies `change` to every watched entry (none once the backend is gone).
fn for_each_entry(shared: &Shared, mut change: impl FnMut(&mut Entry)) {
    if let Some(state) = shared.upgrade() {
        if let Ok(mut s) = state.lock() {
            s.entries.values_mut().for_each(&mut change);
        }
    }
}

/// The connection to create watches on, the request timeout, and the entries to watch.
type Taken = (Client, Duration, Vec<(i64, Entry)>);

/// Marks the entries without a watch that `pick` chooses as created, and returns them with the
/// connection to create their watches on.
fn take_entries(shared: &Shared, pick: impl Fn(&Entry) -> bool) -> Option<Taken> {
    let state = shared.upgrade()?;
    let mut state = state.lock().ok()?;
    let mut taken = Vec::new();
    for (id, entry) in state.entries.iter_mut() {
        if !entry.created && pick(entry) {
            taken.push((*id, entry.clone()));
            entry.created = true;
        }
    }
    Some((state.client.clone(), state.request_timeout, taken))
}

/// Hands a new watch's creation revision to the grant waiting for it; false when none waits (the
/// watch was made again, or the grant stopped waiting): the task then re-reads the key itself.
fn confirm(shared: &Shared, id: i64, revision: i64) -> bool {
    let Some(state) = shared.upgrade() else {
        return true;
    };
    let confirm = match state.lock() {
        Ok(mut s) => {
            if let Some(entry) = s.entries.get_mut(&id) {
                entry.confirmed_at = Some(revision);
            }
            s.confirmations.remove(&id)
        }
        Err(_) => None,
    };
    confirm.is_some_and(|confirm| confirm.send(revision).is_ok())
}

/// A watch made again (after a broken stream or a compaction), confirmed as created at `revision`:
/// it covers the revisions after that one. If the key is not known to exist at `revision` (the store
/// moved since the last read that saw it), reads it, and reports a loss if it is gone. Without this,
/// a watch made from the key's last known revision would be "unsynced" and see a delete only through
/// etcd's 100 ms catch-up loop: late enough for the next waiter to be granted first. True when the
/// key was found gone (its watch is then to be cancelled: nothing cancels it later).
async fn recheck(
    shared: &Shared,
    client: &Client,
    request_timeout: Duration,
    id: i64,
    revision: i64,
) -> Result<bool, tonic::Status> {
    let Some(entry) = entry_of(shared, id) else {
        return Ok(false);
    };
    // A kept watch of a released key has no hold to check (a grant that takes it checks its own).
    if !entry.held || revision < entry.from {
        return Ok(false);
    }
    let own = RangeRequest {
        key: entry.key.as_bytes().to_vec(),
        ..RangeRequest::default()
    };
    let read = match tokio::time::timeout(request_timeout, client.range(own)).await {
        Ok(read) => read?,
        Err(_) => {
            return Err(tonic::Status::deadline_exceeded(
                "re-reading a held key timed out",
            ))
        }
    };
    if read
        .kvs
        .first()
        .is_some_and(|kv| kv.create_revision == entry.rev)
    {
        if let (Some(state), Some(header)) = (shared.upgrade(), read.header.as_ref()) {
            if let Ok(mut s) = state.lock() {
                if let Some(e) = s.entries.get_mut(&id) {
                    e.from = e.from.max(header.revision + 1);
                }
            }
        }
        return Ok(false);
    }
    // Only the hold that was read: the watch may have been released and taken by the key's next hold
    // while the read was under way (that grant checks its own hold).
    Ok(lose_if(
        shared,
        id,
        entry.rev,
        format!(
            "its key {} was deleted on the server (by hand, or its session lease was revoked or expired)",
            entry.key
        ),
    ))
}

/// [`recheck`] beside the task: a key found gone has its watch cancelled, a failed read reopens the
/// stream (which makes the watch, and this check, again).
async fn recheck_in_background(
    shared: Shared,
    client: Client,
    request_timeout: Duration,
    id: i64,
    revision: i64,
) {
    let command = match recheck(&shared, &client, request_timeout, id, revision).await {
        Ok(false) => return,
        Ok(true) => Command::Cancel(id),
        Err(_) => Command::Reopen,
    };
    if let Some(state) = shared.upgrade() {
        if let Ok(s) = state.lock() {
            if let Some(task) = &s.task {
                let _ = task.commands.send(command);
            }
        }
    }
}

async fn run(shared: Shared, mut commands: mpsc::UnboundedReceiver<Command>) {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut refusals = Refusals::default();
    loop {
        // Kept watches already due are dropped before the open, not made again on the new stream
        // (nothing would cancel them there).
        let _ = prune_lingering(&shared, tokio::time::Instant::now());
        // (Re)open: every entry is watched at once, from its start revision.
        for_each_entry(&shared, |entry| {
            entry.created = false;
            entry.confirmed_at = None;
        });
        let Some((client, request_timeout, entries)) = take_entries(&shared, |_| true) else {
            return;
        };
        let Some(((first_id, first), rest)) = entries.split_first() else {
            if wait_for_a_key(&shared, &mut commands).await {
                continue;
            }
            return;
        };
        // etcd checks every watch created on the stream against the token it was opened with.
        let opened_with = client.token();
        let opened =
            tokio::time::timeout(request_timeout, client.watch(options(*first_id, first))).await;
        let mut stream = match opened {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "etcd: opening the held-keys watch failed; retrying");
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
        };
        let mut active: HashSet<i64> = HashSet::from([*first_id]);
        // Creates sent on this stream and not confirmed yet: the backoff starts again only once all
        // are, so a stream whose creates are refused is not reopened at the first delay forever.
        let mut unconfirmed = entries.len();
        let mut refused = false;
        let mut broken = false;
        // When the oldest kept watch of a released key is due to be cancelled.
        let mut prune_at = prune_lingering(&shared, tokio::time::Instant::now()).1;
        for (id, entry) in rest {
            if stream.watch(options(*id, entry)).await.is_err() {
                broken = true;
                break;
            }
            active.insert(*id);
        }
        while !broken {
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Wake) => {
                        let Some((_, _, taken)) = take_entries(&shared, |_| true) else { return };
                        for (id, entry) in taken {
                            if stream.watch(options(id, &entry)).await.is_err() {
                                broken = true;
                                break;
                            }
                            unconfirmed += 1;
                            active.insert(id);
                        }
                    }
                    Some(Command::Cancel(id)) => {
                        if active.remove(&id) && stream.cancel(id).await.is_err() {
                            broken = true;
                        }
                    }
                    Some(Command::Linger) => {
                        if prune_at.is_none() {
                            prune_at = Some(tokio::time::Instant::now() + LINGER);
                        }
                    }
                    Some(Command::Reopen) => broken = true,
                },
                () = sleep_until(prune_at) => {
                    let (cancels, next) = prune_lingering(&shared, tokio::time::Instant::now());
                    prune_at = next;
                    for id in cancels {
                        if active.remove(&id) && stream.cancel(id).await.is_err() {
                            broken = true;
                            break;
                        }
                    }
                }
                message = stream.message() => match message {
                    // A create the server refused (etcd answers it created and cancelled, under id -1):
                    // which key it was is unknown, so the stream is reopened and every key watched
                    // again from its start revision.
                    Ok(Some(resp)) if resp.created && resp.canceled => {
                        tracing::debug!(reason = %resp.cancel_reason, "etcd: a held-key watch was refused; reopening the stream");
                        refused = true;
                        broken = true;
                    }
                    Ok(Some(resp)) => {
                        if resp.created {
                            let revision = resp.header.as_ref().map_or(0, |h| h.revision);
                            if !confirm(&shared, resp.watch_id, revision) {
                                // Off the loop: after a reopen every held key may need its read, and
                                // the other watches' deletes must not wait for them.
                                tokio::spawn(recheck_in_background(
                                    shared.clone(),
                                    client.clone(),
                                    request_timeout,
                                    resp.watch_id,
                                    revision,
                                ));
                            }
                            unconfirmed = unconfirmed.saturating_sub(1);
                            if unconfirmed == 0 {
                                backoff.reset();
                            }
                        }
                        match handle(&shared, &client, request_timeout, &mut stream, &mut active, resp).await {
                            Ok(rewatched) => unconfirmed += usize::from(rewatched),
                            Err(_) => broken = true,
                        }
                    }
                    Ok(None) | Err(_) => broken = true,
                },
            }
        }
        tracing::debug!("etcd: the held-keys watch stream broke; reopening it");
        // No watch is on a live stream now: a confirmation from the broken one must not let a grant
        // skip its check during the backoff below (the reopen's top does this again for its own).
        for_each_entry(&shared, |entry| entry.confirmed_at = None);
        if refused {
            refusals
                .refused(&client, opened_with, request_timeout)
                .await;
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Sleeps until `at`, or for ever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// What the held-keys watch did about creates the server refused.
#[derive(Default)]
struct Refusals {
    /// The token the last refusal authenticated again for (or found already replaced).
    tried: Option<AsciiMetadataValue>,
}

impl Refusals {
    /// A create on a stream opened with `opened_with` was refused. The usual cause is that token:
    /// refused since (expired, or etcd's auth turned off and on) while the requests that noticed it
    /// authenticated again, or nothing did (the stream's requests are not answered `Unauthenticated`
    /// but refused one by one). So authenticate again, unless another request did already, and only
    /// once per token: a refusal on a token obtained for the previous refusal is about something else
    /// (permissions), which authenticating again would not mend (the stream is reopened with
    /// backoff meanwhile).
    async fn refused(
        &mut self,
        client: &Client,
        opened_with: Option<AsciiMetadataValue>,
        timeout: Duration,
    ) {
        if opened_with.is_some() && self.tried == opened_with {
            tracing::warn!("etcd: the server refuses to watch a held key with a fresh auth token (permissions?); retrying with backoff");
            return;
        }
        match tokio::time::timeout(timeout, client.refresh_token(opened_with)).await {
            Ok(Ok(())) => self.tried = client.token(),
            Ok(Err(e)) => tracing::debug!(error = %e, "etcd: authenticating again failed"),
            Err(_) => tracing::debug!("etcd: authenticating again timed out"),
        }
    }
}

/// Nothing held: waits for a key, whose `watch` sends a wake (checked under the lock it inserts
/// under, so none is missed). False when the task is to end (the backend is gone).
async fn wait_for_a_key(shared: &Shared, commands: &mut mpsc::UnboundedReceiver<Command>) -> bool {
    let idle = match shared.upgrade() {
        Some(state) => match state.lock() {
            Ok(s) if s.entries.is_empty() => true,
            Ok(_) => false,
            Err(_) => return false,
        },
        None => return false,
    };
    if !idle {
        return true;
    }
    commands.recv().await.is_some()
}

/// Forgets the kept watches released [`LINGER`] ago or more. Returns the ids whose watches are to be
/// cancelled, and when the next kept one is due, if any is left.
fn prune_lingering(
    shared: &Shared,
    now: tokio::time::Instant,
) -> (Vec<i64>, Option<tokio::time::Instant>) {
    let Some(state) = shared.upgrade() else {
        return (Vec::new(), None);
    };
    let Ok(mut state) = state.lock() else {
        return (Vec::new(), None);
    };
    let state = &mut *state;
    let mut due = Vec::new();
    let mut next: Option<tokio::time::Instant> = None;
    state.lingering.retain(|_, (id, since)| {
        let at = *since + LINGER;
        if at <= now {
            due.push(*id);
            false
        } else {
            next = Some(next.map_or(at, |n| n.min(at)));
            true
        }
    });
    let mut cancels = Vec::new();
    for id in due {
        // Only a watch still kept: one a grant took meanwhile is held again.
        if state.entries.get(&id).is_some_and(|e| !e.held)
            && state.entries.remove(&id).is_some_and(|e| e.created)
        {
            cancels.push(id);
        }
    }
    (cancels, next)
}

/// Forgets a kept watch (its key's lingering ended some other way: the server cancelled it).
fn forget_lingering(shared: &Shared, id: i64) {
    if let Some(state) = shared.upgrade() {
        if let Ok(mut s) = state.lock() {
            if s.entries.get(&id).is_some_and(|e| !e.held) {
                s.entries.remove(&id);
            }
        }
    }
}

fn entry_of(shared: &Shared, id: i64) -> Option<Entry> {
    let state = shared.upgrade()?;
    let state = state.lock().ok()?;
    state.entries.get(&id).cloned()
}

/// Forgets a watch whose key is gone, and reports the loss, if the watch still has the hold created
/// at `rev` (a watch outlives its holds: see [`LINGER`]). True if it did.
fn lose_if(shared: &Shared, id: i64, rev: i64, reason: String) -> bool {
    let Some(state) = shared.upgrade() else {
        return false;
    };
    let entry = match state.lock() {
        Ok(mut s) => match s.entries.get(&id) {
            Some(e) if e.held && e.rev == rev => s.entries.remove(&id),
            _ => None,
        },
        Err(_) => None,
    };
    match entry {
        Some(entry) => {
            tracing::debug!(key = %entry.key, "etcd: a held key was deleted on the server");
            entry.lost.report(reason);
            true
        }
        None => false,
    }
}

/// What deletes seen by a watch mean.
enum Deleted {
    /// Its hold's key is gone: the watch was forgotten and the loss reported; cancel it.
    Lost,
    /// A former hold's delete, or one seen while the watch is kept (recorded for the grant that
    /// takes it): the watch stays.
    Kept,
    /// No such watch any more: cancel it.
    Unknown,
}

/// Decides, under the state lock (so that a grant taking a kept watch cannot slip between the
/// decision and the record), what the deletes at `revisions` seen by watch `id` mean.
fn deleted(shared: &Shared, id: i64, revisions: &[i64]) -> Deleted {
    let Some(state) = shared.upgrade() else {
        return Deleted::Unknown;
    };
    let Ok(mut s) = state.lock() else {
        return Deleted::Unknown;
    };
    let latest = revisions.iter().copied().max().unwrap_or(i64::MAX);
    let Some(entry) = s.entries.get_mut(&id) else {
        return Deleted::Unknown;
    };
    if !entry.held {
        entry.deleted_while_kept = entry.deleted_while_kept.max(latest);
        return Deleted::Kept;
    }
    // A former hold's delete reaching the watch after the key's next hold took it.
    if latest < entry.rev {
        return Deleted::Kept;
    }
    let Some(entry) = s.entries.remove(&id) else {
        return Deleted::Unknown;
    };
    drop(s);
    tracing::debug!(key = %entry.key, "etcd: a held key was deleted on the server");
    entry.lost.report(format!(
            "its key {} was deleted on the server (by hand, or its session lease was revoked or expired)",
            entry.key
        ),
    );
    Deleted::Lost
}

async fn handle(
    shared: &Shared,
    client: &Client,
    request_timeout: Duration,
    stream: &mut WatchStream,
    active: &mut HashSet<i64>,
    resp: WatchResponse,
) -> Result<bool, tonic::Status> {
    let id = resp.watch_id;
    // The revisions of the deletes in this message (an event without its key counts as the latest).
    let deletes: Vec<i64> = resp
        .events
        .iter()
        .filter(|e| e.r#type == EventType::Delete as i32)
        .map(|e| e.kv.as_ref().map_or(i64::MAX, |kv| kv.mod_revision))
        .collect();
    if !deletes.is_empty() {
        if let Deleted::Kept = deleted(shared, id, &deletes) {
            return Ok(false);
        }
        if active.remove(&id) {
            stream.cancel(id).await?;
        }
        return Ok(false);
    }
    if !resp.canceled {
        return Ok(false);
    }
    // Cancelled by the server (its start revision was compacted, or a cancel we sent): if the key is
    // still held, read it, and watch again from that read.
    active.remove(&id);
    if resp.compact_revision > 0 {
        // The server keeps the compacted watch (and its id) on the stream until told to drop it.
        stream.cancel(id).await?;
    }
    // A kept watch of a released key is just dropped.
    forget_lingering(shared, id);
    let Some(entry) = entry_of(shared, id) else {
        return Ok(false);
    };
    let own = RangeRequest {
        key: entry.key.as_bytes().to_vec(),
        ..RangeRequest::default()
    };
    let read = tokio::time::timeout(request_timeout, client.range(own)).await;
    let read = match read {
        Ok(Ok(read)) => read,
        // Unknown: reopen the stream, which retries the watch from its start revision.
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(tonic::Status::deadline_exceeded(
                "re-reading a held key timed out",
            ))
        }
    };
    // Released and taken by the key's next hold during the read: what was read is not that hold's.
    // Reopened, every watch is made again and checked.
    let Some(now) = entry_of(shared, id) else {
        // Released meanwhile.
        return Ok(false);
    };
    if !now.held || now.rev != entry.rev {
        return Err(tonic::Status::aborted(
            "a held key's hold changed while it was re-read",
        ));
    }
    let alive = read
        .kvs
        .first()
        .is_some_and(|kv| kv.create_revision == entry.rev);
    if !alive {
        lose_if(
            shared,
            id,
            entry.rev,
            format!(
                "its key {} was deleted on the server (by hand, or its session lease was revoked or expired)",
                entry.key
            ),
        );
        return Ok(false);
    }
    let from = read.header.as_ref().map_or(entry.from, |h| h.revision + 1);
    // Watched again under a new id: etcd keeps a cancelled (compacted) watch's id reserved on its
    // stream until the client cancels it, and refuses a new watch with it ("duplicate watch ID",
    // answered under id -1), which would leave the key unwatched for good.
    let Some(state) = shared.upgrade() else {
        return Ok(false);
    };
    let new_id = {
        let Ok(mut s) = state.lock() else {
            return Ok(false);
        };
        let Some(mut entry) = s.entries.remove(&id) else {
            // Released meanwhile.
            return Ok(false);
        };
        s.next_id += 1;
        let new_id = s.next_id;
        entry.from = from;
        entry.created = true;
        entry.confirmed_at = None;
        s.entries.insert(new_id, entry);
        s.moved.insert(id, new_id);
        new_id
    };
    let mut entry = entry;
    entry.from = from;
    stream.watch(options(new_id, &entry)).await?;
    active.insert(new_id);
    Ok(true)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use crate::rpc::pb::etcdserverpb::PutRequest;
    use crate::EtcdConfig;
    use distlock_testkit::etcd::EtcdServer;

    /// A grant after a wait trusts the confirmation of its queued watch only while that watch is on a
    /// live stream. Once the stream is found broken, the confirmation is void at once, not only after
    /// the backoff before the reopen (50–100 ms in which a grant would skip its check while no watch
    /// covers the key).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_confirmation_is_void_as_soon_as_its_stream_breaks() {
        let server = EtcdServer::start_or_panic();
        let client = Client::connect(&EtcdConfig::new([server.endpoints()]))
            .await
            .unwrap();
        let put = client
            .put(PutRequest {
                key: b"confirmation/key".to_vec(),
                value: b"x".to_vec(),
                ..PutRequest::default()
            })
            .await
            .unwrap();
        let rev = put.header.unwrap().revision;
        let held = HeldKeys::new(client, Duration::from_secs(5));
        let lost: LossReport = LossReport::new();
        let (id, first) = held.watch("confirmation/key".into(), rev, rev + 1, lost);
        let created = first.await.unwrap();
        assert_eq!(held.confirmation(id).ok(), Some(created));
        {
            let state = held.state.lock().unwrap();
            let task = state.task.as_ref().unwrap();
            task.commands.send(Command::Reopen).unwrap();
        }
        // The task breaks the stream as soon as it runs; the reopen waits 50 ms at least.
        let start = std::time::Instant::now();
        let mut void = false;
        while start.elapsed() < Duration::from_millis(40) {
            if held.confirmation(id).is_err() {
                void = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(
            void,
            "the stream was broken and the watch not made again, yet its old confirmation still counted"
        );
    }
}
