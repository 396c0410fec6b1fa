//! The interface for backend authors: the [`Backend`] trait that [`Locks::new`](crate::Locks::new) takes,
//! and the request and reply types it exchanges with the core. A backend crate depends on
//! `distlock-core` and implements it. Users never call it: they use [`Locks`](crate::Locks), [`Lock`]
//! and [`LockGuard`], whose semantics (reentrancy, the local FIFO, validity deadlines, the three states,
//! the watchdog, undoing cancelled acquires) are computed here in the core, once, for every backend.
//!
//! A backend only talks to its engine:
//!
//! * an acquire is a [`Backend::Acquisition`] made by [`begin`](Backend::begin) (no I/O), tried with
//!   [`try_acquire`](Backend::try_acquire) and, while busy, parked in [`wait`](Backend::wait) until a
//!   notification (pub/sub, watch) or the hint says another try is worthwhile;
//! * an acquisition the core gives up on, including one whose future was dropped or whose reply was
//!   lost, is handed to [`abandon`](Backend::abandon), which removes whatever the requests may have left
//!   on the server for this owner (a queued key, an unacknowledged grant);
//! * held locks are renewed in batches: [`renew`](Backend::renew) gets every lease due in one watchdog
//!   tick and sends one round trip per group (connection, slot, session);
//! * [`release`](Backend::release) deletes only what this owner holds, and is safe to retry.
//!
//! [`Lock`]: crate::Lock
//! [`LockGuard`]: crate::LockGuard

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::kinds::LockKind;
use crate::token::FencingToken;

/// One acquire as the backend sees it.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::raw::AcquireRequest;
/// use distlock_core::LockKind;
///
/// // What a backend's own test of its trait impl hands it: the read side of "orders/42".
/// let request = AcquireRequest::new("orders/42", "owner-1", Duration::from_secs(30))
///     .with_kind(LockKind::Read);
/// assert_eq!((request.name.as_str(), request.kind), ("orders/42", LockKind::Read));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireRequest {
    /// The lock name, already validated by the core and the backend.
    pub name: String,
    /// The owner id: `<process uuid>:<n>` or caller-supplied. Unique per [`Lock`](crate::Lock).
    pub owner: String,
    /// The lease to ask the server for (already capped by `max_hold`).
    pub lease: Duration,
    /// What is asked for: a mutex, a side of a read-write lock, or a permit. The core asks only for
    /// kinds the backend's [`Capabilities::kinds`] announce. The two sides of one
    /// [`RwLock`](crate::RwLock) share one owner id, so a backend tells a read hold from a write hold of
    /// one owner by the kind (keep it in the [`Backend::Lease`]).
    pub kind: LockKind,
}

impl AcquireRequest {
    /// A mutex request, as the core makes them; for backends' own tests of their trait impl.
    pub fn new(name: impl Into<String>, owner: impl Into<String>, lease: Duration) -> Self {
        Self {
            name: name.into(),
            owner: owner.into(),
            lease,
            kind: LockKind::Mutex,
        }
    }

    /// The same request for another kind.
    pub fn with_kind(mut self, kind: LockKind) -> Self {
        self.kind = kind;
        self
    }
}

/// How a backend tells the core, with the reason, that a held lock is gone (a session expired, a
/// connection closed, the key was deleted). Backends that learn of a loss only by renewing give none.
///
/// Two kinds, the same to the guard:
/// * [`LossReport::signal`]: the backend keeps the [`LossReport`] and calls
///   [`report`](LossReport::report) from its own task (a watch, a session). It costs one small
///   allocation per hold and no task: the kind for backends that hold many locks (issue 9's memory
///   per held lock).
/// * [`LossSignal::from_future`]: a future that resolves with the reason. The core polls it in a
///   task of its own per hold.
///
/// A signal that never fires (its report dropped, its future pending for ever) reports nothing:
/// what feeds a signal going away is never a loss by itself.
///
/// ```
/// use distlock_core::raw::{Grant, LossSignal};
///
/// // A lock that lives as long as its connection: the connection's task says why it closed.
/// let (closed, closed_reason) = tokio::sync::oneshot::channel::<String>();
/// let loss = LossSignal::from_future(async move {
///     match closed_reason.await {
///         Ok(reason) => reason,
///         Err(_) => std::future::pending().await, // the task went away without a word: no loss
///     }
/// });
/// let grant = Grant::new(()).with_loss(loss);
/// assert!(grant.loss.is_some());
/// # drop(closed);
/// ```
pub struct LossSignal(LossSource);

enum LossSource {
    Future(Pin<Box<dyn Future<Output = String> + Send + 'static>>),
    Reported(Arc<LossSlot>),
}

impl LossSignal {
    /// A signal that fires when `loss` resolves, with its output as the reason. The core polls it in
    /// a task per hold until the hold ends; prefer [`LossReport`] where a task per hold matters.
    pub fn from_future(loss: impl Future<Output = String> + Send + 'static) -> Self {
        Self(LossSource::Future(Box::pin(loss)))
    }

    /// Connects the signal to the hold it was granted with.
    pub(crate) fn attach(self, holding: &Arc<crate::guard::Holding>) {
        match self.0 {
            LossSource::Future(loss) => holding.watch_loss(loss),
            LossSource::Reported(slot) => {
                let reported = {
                    let mut state = crate::sync::lock(&slot.state);
                    match &state.reason {
                        Some(reason) => Some(reason.clone()),
                        None => {
                            state.holdings.attach(Arc::downgrade(holding));
                            None
                        }
                    }
                };
                // Reported before the core had the hold: applied now.
                if let Some(reason) = reported {
                    holding.mark_lost(reason);
                }
            }
        }
    }
}

impl std::fmt::Debug for LossSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            LossSource::Future(_) => "LossSignal::Future",
            LossSource::Reported(_) => "LossSignal::Reported",
        })
    }
}

/// The backend's end of a reported [`LossSignal`]: it reports a held lock's loss straight into the
/// guard, from whatever task learns of it, with no task per hold. Clones report into the same
/// signal; the first reason reported wins and later ones are ignored. Its [`signal`](Self::signal)
/// may go to several grants (a report per session, say): a report reaches every hold it was given
/// to, and a hold granted after the report is `Lost` at its install.
///
/// ```
/// use distlock_core::raw::{Grant, LossReport};
///
/// let report = LossReport::new();
/// let grant = Grant::new(()).with_loss(report.signal());
/// // Later, from the task that sees the key deleted:
/// report.report("the lock's key was deleted");
/// assert_eq!(report.reason().as_deref(), Some("the lock's key was deleted"));
/// # drop(grant);
/// ```
#[derive(Clone, Default)]
pub struct LossReport(Arc<LossSlot>);

#[derive(Default)]
struct LossSlot {
    state: std::sync::Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// The first reason reported.
    reason: Option<String>,
    /// The holds the signal was attached to, until a reason is reported. Weak: a hold that ended is
    /// not kept alive by the backend's record of it.
    holdings: Holdings,
}

/// One hold without an allocation of its own (the usual case: a report per grant), or several.
#[derive(Default)]
enum Holdings {
    #[default]
    None,
    One(std::sync::Weak<crate::guard::Holding>),
    Many(Vec<std::sync::Weak<crate::guard::Holding>>),
}

impl Holdings {
    fn attach(&mut self, holding: std::sync::Weak<crate::guard::Holding>) {
        *self = match std::mem::take(self) {
            Holdings::None => Holdings::One(holding),
            Holdings::One(first) if first.strong_count() == 0 => Holdings::One(holding),
            Holdings::One(first) => Holdings::Many(vec![first, holding]),
            Holdings::Many(mut all) => {
                // Ended holds are dropped as new ones come, so the list follows the live ones.
                all.retain(|h| h.strong_count() > 0);
                all.push(holding);
                Holdings::Many(all)
            }
        };
    }

    fn into_vec(self) -> Vec<std::sync::Weak<crate::guard::Holding>> {
        match self {
            Holdings::None => Vec::new(),
            Holdings::One(one) => vec![one],
            Holdings::Many(all) => all,
        }
    }
}

impl LossReport {
    /// A report with nothing reported yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The signal to give the core with a grant ([`Grant::with_loss`]).
    pub fn signal(&self) -> LossSignal {
        LossSignal(LossSource::Reported(self.0.clone()))
    }

    /// Reports the loss, unless a reason was reported already. Marks the hold `Lost` at once if the
    /// core has it (otherwise when the core installs it). Never blocks on I/O.
    pub fn report(&self, reason: impl Into<String>) {
        let reason = reason.into();
        let holdings = {
            let mut state = crate::sync::lock(&self.0.state);
            if state.reason.is_some() {
                return;
            }
            state.reason = Some(reason.clone());
            std::mem::take(&mut state.holdings)
        };
        for holding in holdings
            .into_vec()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
        {
            holding.mark_lost(reason.clone());
        }
    }

    /// The reason reported, if one was.
    pub fn reason(&self) -> Option<String> {
        crate::sync::lock(&self.0.state).reason.clone()
    }
}

impl std::fmt::Debug for LossReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LossReport")
            .field("reason", &self.reason())
            .finish()
    }
}

/// distlock's background runtime: one worker thread, started on first use and never shut down, where
/// the core moves work whose runtime was dropped. For a backend's own work that must outlive the
/// runtimes it is called from (watching held locks after the runtime that watched them is gone).
/// `None` only if it cannot be started.
pub fn background_runtime() -> Option<tokio::runtime::Handle> {
    crate::locks::background_runtime()
}

/// A granted lock.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::raw::Grant;
/// use distlock_core::FencingToken;
///
/// // A key-value grant: the key to release is the lease, the counter's value the token, the key's
/// // expiry the ttl (the core's validity deadline counts from before the request was sent).
/// let grant = Grant::new("lock:orders/42".to_string())
///     .with_token(FencingToken::new(7))
///     .with_ttl(Duration::from_secs(30));
/// assert_eq!((grant.token, grant.ttl), (Some(FencingToken::new(7)), Some(Duration::from_secs(30))));
/// ```
#[non_exhaustive]
pub struct Grant<L> {
    /// What the backend needs to renew and release it.
    pub lease: L,
    /// The fencing token, if the backend mints one.
    pub token: Option<FencingToken>,
    /// The time-to-live the server granted; `None` when the lock has no server-side expiry.
    pub ttl: Option<Duration>,
    /// Resolves when the backend learns the lock is gone.
    pub loss: Option<LossSignal>,
    /// A descriptor whose inheritance keeps the lock held (a `flock`ed file); see
    /// [`LockGuard::inheritable_descriptor`](crate::LockGuard::inheritable_descriptor).
    pub descriptor: Option<Arc<std::os::fd::OwnedFd>>,
    /// Which permit a [`LockKind::Permit`] grant holds, as the engine names it (a slot number, a
    /// permit id, a lease node); see [`LockGuard::permit`](crate::LockGuard::permit).
    pub permit: Option<String>,
}

impl<L> Grant<L> {
    /// A grant with no token, no expiry and no loss signal.
    pub fn new(lease: L) -> Self {
        Self {
            lease,
            token: None,
            ttl: None,
            loss: None,
            descriptor: None,
            permit: None,
        }
    }

    /// Sets the fencing token.
    pub fn with_token(mut self, token: FencingToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Sets the granted time-to-live.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets the loss signal.
    pub fn with_loss(mut self, loss: LossSignal) -> Self {
        self.loss = Some(loss);
        self
    }

    /// Sets which permit the grant holds.
    pub fn with_permit(mut self, permit: impl Into<String>) -> Self {
        self.permit = Some(permit.into());
        self
    }

    /// Sets the descriptor whose inheritance keeps the lock held: a duplicate of the descriptor the
    /// backend locked, sharing its open file description (so `flock(LOCK_UN)` through either unlocks).
    pub fn with_descriptor(mut self, descriptor: std::os::fd::OwnedFd) -> Self {
        self.descriptor = Some(Arc::new(descriptor));
        self
    }
}

impl<L> std::fmt::Debug for Grant<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("token", &self.token)
            .field("ttl", &self.ttl)
            .field("loss", &self.loss.is_some())
            .field("descriptor", &self.descriptor)
            .field("permit", &self.permit)
            .finish_non_exhaustive()
    }
}

/// The outcome of one try.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::raw::{Attempt, Grant};
///
/// // A `SET NX PX` reply: granted, or busy with the holder's pttl, which bounds the wait.
/// fn attempt(set: bool, holder_pttl_ms: u64) -> Attempt<()> {
///     if set {
///         Attempt::Acquired(Grant::new(()))
///     } else {
///         Attempt::Busy { retry_after: Some(Duration::from_millis(holder_pttl_ms)) }
///     }
/// }
/// assert!(matches!(attempt(false, 1200), Attempt::Busy { retry_after: Some(d) } if d.as_millis() == 1200));
/// ```
#[non_exhaustive]
#[derive(Debug)]
pub enum Attempt<L> {
    /// The lock is ours.
    Acquired(Grant<L>),
    /// Held elsewhere. `retry_after` is when the holder's lease ends if nobody renews it (Redis pttl):
    /// [`Backend::wait`] need not wait longer than that.
    Busy {
        /// The holder's remaining lease, if known.
        retry_after: Option<Duration>,
    },
}

/// One lease in a renewal batch.
///
/// ```
/// use distlock_core::raw::{Renewal, RenewalId, Renewed};
/// use distlock_core::Result;
///
/// // The engine answered the batch in order (1: extended, else another owner's): one outcome per
/// // entry, under the entry's id.
/// fn outcomes(batch: &[Renewal<'_, String>], replies: &[i64]) -> Vec<(RenewalId, Result<Renewed>)> {
///     batch
///         .iter()
///         .zip(replies)
///         .map(|(entry, reply)| {
///             let outcome = match reply {
///                 1 => Renewed::Extended { ttl: entry.ttl },
///                 _ => Renewed::Gone { reason: format!("{} is no longer ours", entry.name) },
///             };
///             (entry.id, Ok(outcome))
///         })
///         .collect()
/// }
/// assert!(outcomes(&[], &[]).is_empty());
/// ```
#[non_exhaustive]
#[derive(Debug)]
pub struct Renewal<'a, L> {
    /// Which entry of the batch this is: the backend returns its outcome under this id.
    pub id: RenewalId,
    /// The lock name.
    pub name: &'a str,
    /// The owner that holds it.
    pub owner: &'a str,
    /// The backend's record of the held lock.
    pub lease: &'a L,
    /// The time-to-live to ask for (the lease, capped by what is left of `max_hold`).
    pub ttl: Duration,
}

/// Which entry of a renewal batch an outcome is for. Made by the core; a backend hands it back with the
/// entry's outcome, in any order (a backend that renews per server or per slot answers as the replies
/// come). An entry left without an outcome counts as unanswered (Jeopardy, retried).
///
/// ```
/// use distlock_core::raw::{Renewal, RenewalId};
///
/// // A backend that renews per connection answers as each group's reply comes: it keeps the ids.
/// fn ids(group: &[Renewal<'_, ()>]) -> Vec<RenewalId> {
///     group.iter().map(|entry| entry.id).collect()
/// }
/// assert!(ids(&[]).is_empty());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RenewalId(pub(crate) usize);

/// The outcome of renewing one lease. An `Err` means "unknown" (the guard goes to Jeopardy).
///
/// ```
/// use std::time::Duration;
/// use distlock_core::raw::Renewed;
///
/// // A renewal script's answer: extended, or gone with the reason the guard's loss reports.
/// fn renewed(answer: i64, ttl: Duration) -> Renewed {
///     match answer {
///         1 => Renewed::Extended { ttl },
///         0 => Renewed::Gone { reason: "another owner holds the lock".into() },
///         _ => Renewed::Gone { reason: "the lock's key expired".into() },
///     }
/// }
/// assert_eq!(renewed(-1, Duration::ZERO), Renewed::Gone { reason: "the lock's key expired".into() });
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Renewed {
    /// The server extended the lease by `ttl`.
    Extended {
        /// The time-to-live granted.
        ttl: Duration,
    },
    /// The server says the lock is no longer this owner's: expired, deleted, or someone else's.
    Gone {
        /// What the server said, for the guard's loss reason.
        reason: String,
    },
}

/// The outcome of a release.
///
/// ```
/// use distlock_core::raw::Released;
///
/// // A compare-and-delete that deleted nothing is "not ours any more", not an error: so a resent
/// // release stays idempotent.
/// fn released(deleted: i64) -> Released {
///     if deleted == 1 { Released::Released } else { Released::NotHeld }
/// }
/// assert_eq!(released(0), Released::NotHeld);
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// This owner's lock was deleted.
    Released,
    /// Nothing of this owner's was there (expired, taken over, or already released).
    NotHeld,
}

/// The outcome of [`Backend::hand_off`].
///
/// ```
/// use distlock_core::raw::{Grant, HandOff, Released};
///
/// // One script released the holder's key and set the next owner's, or found a waiter queued on
/// // the server first and only released.
/// fn handed(next_got_it: bool) -> HandOff<()> {
///     if next_got_it {
///         HandOff::Handed(Grant::new(()))
///     } else {
///         HandOff::Released(Released::Released)
///     }
/// }
/// assert!(matches!(handed(false), HandOff::Released(Released::Released)));
/// ```
#[non_exhaustive]
#[derive(Debug)]
pub enum HandOff<L> {
    /// The releaser's hold ended and the next owner holds the lock, in one request: the core gives
    /// this grant to the next waiter without a try of its own.
    Handed(Grant<L>),
    /// The lock could not be handed on (someone queued on the server first, the hold was gone): it
    /// was released as by [`Backend::release`], and the next waiter acquires as usual.
    Released(Released),
}

/// What `status` shows about a lock.
///
/// ```
/// use distlock_core::{LockKind, Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let guard = locks.lock("nightly")?.acquire().await?;
/// let info = locks.inspect("nightly").await?;
/// assert_eq!(info.kind, Some(LockKind::Mutex));
/// assert_eq!(info.holder.and_then(|h| h.token), guard.token());
/// # guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LockInfo {
    /// What the name is in use as, where the engine can tell: [`LockKind::Mutex`] (or
    /// [`LockKind::Write`] where the engine tells a write lock from a mutex) with a `holder`,
    /// [`LockKind::Read`] with `holders`, [`LockKind::Permit`] with its stored limit and `holders`.
    /// `None` when nothing is held (or the backend cannot tell).
    pub kind: Option<LockKind>,
    /// The exclusive holder (mutex or writer), if the lock is held so.
    pub holder: Option<HolderInfo>,
    /// The shared holders: readers, or permit holders (each with its permit).
    pub holders: Vec<HolderInfo>,
    /// Processes or clients waiting, where the engine can tell.
    pub waiters: Option<usize>,
    /// The last fencing token minted for this name, where the engine keeps it.
    pub last_token: Option<FencingToken>,
    /// What each node says, for backends over independent nodes (Redlock); empty for the others.
    pub nodes: Vec<NodeInfo>,
}

/// What one node of a quorum backend (Redlock) holds for a lock.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::raw::NodeInfo;
///
/// // A Redlock backend's `inspect` reports each node: one holds the key, one did not answer.
/// let mut holding = NodeInfo::new("127.0.0.1:6379");
/// holding.owner = Some("7f0c…:1".into());
/// holding.remaining_lease = Some(Duration::from_secs(12));
/// let mut down = NodeInfo::new("127.0.0.1:6380");
/// down.error = Some("connection refused".into());
/// assert!(holding.error.is_none() && down.owner.is_none());
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// The node's address.
    pub address: String,
    /// The owner whose key the node holds, if any.
    pub owner: Option<String>,
    /// The key's remaining time-to-live on that node.
    pub remaining_lease: Option<Duration>,
    /// Why the node could not be asked, if it could not.
    pub error: Option<String>,
}

impl NodeInfo {
    /// A node that holds nothing for the lock (set the fields to say more).
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            ..Self::default()
        }
    }
}

/// What is known of a lock's holder; every field is optional because engines record different things.
///
/// ```
/// use distlock_core::{Locks, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(MemoryBackend::new());
/// let lock = locks.lock("nightly")?;
/// let guard = lock.acquire().await?;
/// let holder = locks.inspect("nightly").await?.holder.expect("held");
/// assert_eq!(holder.owner.as_deref(), Some(lock.owner()));
/// # guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HolderInfo {
    /// The owner id.
    pub owner: Option<String>,
    /// The holder's fencing token.
    pub token: Option<FencingToken>,
    /// Time left on the lease on the server.
    pub remaining_lease: Option<Duration>,
    /// The holder's process id.
    pub pid: Option<u32>,
    /// Where the holder runs, as the engine tells it: its host name, or (PostgreSQL) the session's
    /// client address and `application_name`.
    pub host: Option<String>,
    /// When the hold began.
    pub since: Option<SystemTime>,
    /// The permit held, for a semaphore's holder.
    pub permit: Option<String>,
    /// The engine's identity of this one hold, where it has one beyond the owner id and token (a
    /// Redlock value with its nonce, the fencing counter a Redis grant minted, a row lock's
    /// transaction): what [`Locks::break_holder`](crate::Locks::break_holder) compares, so that a later
    /// hold of the same owner (a `Lock` that released and acquired again, a pooled session) is never
    /// broken. Opaque: only the engine that showed it reads it.
    pub hold_id: Option<String>,
}

/// The engine side of a lock service. See the [module docs](self) for the contract.
///
/// Every method may be called concurrently for different locks. The core never calls two methods for
/// the same acquisition at once.
///
/// A whole backend, in-process, to show the contract's shape: a table of owners as the "engine", a
/// counter for tokens, a notification for waiters. The core does the rest (reentrancy, the local
/// queue, deadlines, the watchdog, undoing cancelled acquires).
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Mutex;
/// use std::time::Duration;
///
/// use async_trait::async_trait;
/// use distlock_core::raw::{
///     AcquireRequest, Attempt, Backend, Grant, Released, Renewal, RenewalId, Renewed,
/// };
/// use distlock_core::{Capabilities, Fencing, FencingToken, Locks, Result};
///
/// #[derive(Default)]
/// struct Table {
///     owners: Mutex<(HashMap<String, String>, u64)>, // name -> owner, last token
///     released: tokio::sync::Notify,
/// }
///
/// #[async_trait]
/// impl Backend for Table {
///     type Lease = (); // the owner id is all a release needs here
///     type Acquisition = ();
///
///     fn kind(&self) -> &'static str { "table" }
///     fn capabilities(&self) -> Capabilities {
///         Capabilities::mutex().with_fencing(Fencing::Strict).with_notify_wait(true)
///     }
///     fn begin(&self, _: &AcquireRequest) -> Result<()> { Ok(()) }
///     async fn try_acquire(&self, _: &mut (), request: &AcquireRequest) -> Result<Attempt<()>> {
///         let mut table = self.owners.lock().unwrap();
///         if table.0.contains_key(&request.name) {
///             return Ok(Attempt::Busy { retry_after: None });
///         }
///         table.0.insert(request.name.clone(), request.owner.clone());
///         table.1 += 1;
///         Ok(Attempt::Acquired(Grant::new(()).with_token(FencingToken::new(table.1))))
///     }
///     async fn wait(&self, _: &mut (), _: &AcquireRequest, _: Option<Duration>) -> Result<()> {
///         self.released.notified().await; // woken, never polled (the core bounds the wait)
///         Ok(())
///     }
///     async fn abandon(&self, _: (), _: &AcquireRequest) {} // a try leaves nothing behind
///     async fn renew(&self, batch: &[Renewal<'_, ()>]) -> Vec<(RenewalId, Result<Renewed>)> {
///         let ttl = Duration::MAX; // nothing expires here; the core renews only server_ttl locks
///         batch.iter().map(|r| (r.id, Ok(Renewed::Extended { ttl }))).collect()
///     }
///     async fn release(&self, _: &(), name: &str, owner: &str) -> Result<Released> {
///         let mut table = self.owners.lock().unwrap();
///         if table.0.get(name).map(String::as_str) != Some(owner) {
///             return Ok(Released::NotHeld); // owner-only, and idempotent
///         }
///         table.0.remove(name);
///         self.released.notify_waiters();
///         Ok(Released::Released)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> distlock_core::Result<()> {
/// let locks = Locks::new(Table::default());
/// let first = locks.lock("report")?.acquire().await?;
/// assert!(locks.lock("report")?.try_acquire().await?.is_none()); // another owner
/// first.release().await?;
/// let second = locks.lock("report")?.acquire().await?;
/// assert_eq!(second.token(), Some(FencingToken::new(2)));
/// # second.release().await?;
/// # Ok(())
/// # }
/// ```
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// What the backend keeps for a held lock (a key and revision, an open file, a znode path).
    type Lease: Send + Sync + 'static;
    /// What the backend keeps while an acquire is under way (a subscription, a queued key).
    type Acquisition: Send + 'static;

    /// The backend's short name for errors and logs: `"memory"`, `"file"`, `"redis"`.
    fn kind(&self) -> &'static str;

    /// What this backend promises.
    fn capabilities(&self) -> Capabilities;

    /// Backend-specific name rules beyond the shared ones (non-empty UTF-8, at most 1024 bytes, no NUL),
    /// which the core has already checked with `distlock_core::name::validate`.
    fn validate_name(&self, _name: &str) -> Result<()> {
        Ok(())
    }

    /// Starts an acquire. No I/O.
    fn begin(&self, request: &AcquireRequest) -> Result<Self::Acquisition>;

    /// One try. May leave state on the server for `abandon` to clean up (a queued key).
    ///
    /// # Cancel safety
    /// The core may drop this future; it then calls [`abandon`](Self::abandon) with the acquisition.
    async fn try_acquire(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<Self::Lease>>;

    /// Waits until another try is worthwhile: a release notification, the `retry_after` hint, or a
    /// backoff for engines that cannot notify. May return early; the core bounds it by its deadline.
    async fn wait(
        &self,
        acquisition: &mut Self::Acquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()>;

    /// Undoes whatever the acquisition may have left on the server for `request.owner`, including a
    /// grant whose reply never arrived. Must not touch another owner's lock. Errors are the backend's to
    /// log.
    async fn abandon(&self, acquisition: Self::Acquisition, request: &AcquireRequest);

    /// Renews every lease in `batch`, one round trip per group, and returns one outcome per entry in
    /// the same order.
    ///
    /// # Cancel safety
    /// Each entry has its own time limit (half the time left before its hold's deadline). The core
    /// keeps polling this future after some entries' limits passed: those count as unconfirmed, their
    /// holds may be renewed again (another call, or an `extend`) while this one is still in flight, and
    /// their outcomes in this call's result are ignored unless they are [`Renewed::Gone`]. The future is
    /// dropped when the last entry's limit passes. So the same lease may be in two calls at once, and
    /// whatever a late reply updates inside the backend must not let it trust a lease longer than the
    /// newest confirmed renewal proves (an older send time only proves less; ZooKeeper's `extend_to`
    /// counts from its request's send time, etcd's expiry is capped by the session's TTL).
    async fn renew(&self, batch: &[Renewal<'_, Self::Lease>]) -> Vec<(RenewalId, Result<Renewed>)>;

    /// Releases a held lock if, and only if, it is still this owner's. Safe to retry.
    async fn release(&self, lease: &Self::Lease, name: &str, owner: &str) -> Result<Released>;

    /// Whether a release whose future has been polled once (and is not finished) is already queued on
    /// the connection every later acquire of this backend goes out on, so that the engine runs any such
    /// acquire after the release. The core then passes a name's local queue on at that point instead of
    /// at the release's reply, and a handoff between two waiters of one [`Locks`](crate::Locks) takes
    /// one round trip instead of two (the next acquire travels right behind the release). Only speed
    /// depends on it: an acquire that overtakes a release finds the lock held and waits for it as usual.
    /// The same owner's next acquire still waits for the reply (a release resent on a fresh connection
    /// would delete that owner's new grant). Default `false`: the queue moves on at the reply.
    fn release_orders_next_acquire(&self) -> bool {
        false
    }

    /// Whether [`hand_off`](Self::hand_off) can pass a lock on in one request. The core then calls it,
    /// instead of [`release`](Self::release), when a hold ends with another owner of the same
    /// [`Locks`](crate::Locks) first in the name's local queue, also where
    /// [`release_orders_next_acquire`](Self::release_orders_next_acquire) holds (the early pass is then
    /// used only when no handoff is tried). Default `false`.
    fn supports_hand_off(&self) -> bool {
        false
    }

    /// Releases a held lock (if, and only if, it is still this owner's) and grants it to `next`
    /// together, where the engine can do both in one request without passing over anyone queued on
    /// the server; otherwise only releases it. `next` is the next local waiter's acquire; the grant
    /// is installed as a grant of [`try_acquire`](Self::try_acquire) would be (its validity deadline
    /// counts from when this call began). If the core cannot deliver the grant (the waiter gave up
    /// meanwhile) it releases it with [`release`](Self::release) and `next.owner`.
    ///
    /// # Cancel safety
    /// The core may drop this future; it then releases the old hold again (owner-guarded). A grant
    /// the engine may have made for `next` must then be undone by the backend.
    async fn hand_off(
        &self,
        lease: &Self::Lease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<Self::Lease>> {
        // The default cannot grant: it only releases.
        let _ = next;
        Ok(HandOff::Released(self.release(lease, name, owner).await?))
    }

    /// What the server knows about a lock, for `distlock status`.
    async fn inspect(&self, _name: &str) -> Result<LockInfo> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "this backend cannot inspect locks",
        ))
    }

    /// Ends `holder`'s exclusive hold of `name` against its will, for `distlock break`: `holder` is what
    /// [`inspect`](Self::inspect) reported, and the hold is ended only if that same holder still holds
    /// the lock, checked on the server in the same step, so a new holder is never broken by mistake.
    /// `Ok(true)`: that hold is gone (waiters may take the lock); `Ok(false)`: that holder no longer
    /// holds it (released, expired, or another holder now), and nothing was touched. The broken
    /// holder's guard goes `Lost` when its engine tells it (a watch, a closed session) or at its next
    /// renewal. Backends that set [`Capabilities::breaks_holders`] implement it; the default is
    /// `Unsupported`.
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        let _ = (name, holder);
        Err(Error::new(
            ErrorKind::Unsupported,
            "this backend cannot end another holder's hold",
        ))
    }

    /// Turns `owner`'s write hold (`lease`, a [`LockKind::Write`] grant) into a read hold of the same
    /// owner in one step, so that no writer can get in between: `read` is the read side's request
    /// (same name and owner, [`LockKind::Read`], the lease to ask for). On success the write hold is
    /// gone and the returned grant is the read hold, installed as a grant of
    /// [`try_acquire`](Self::try_acquire) would be (its validity deadline counts from when this call
    /// began); its token is the write grant's. Called only where
    /// [`LockKinds::atomic_downgrade`](crate::LockKinds::atomic_downgrade) is announced.
    ///
    /// On an error, nothing of a read hold may be left on the server for `read.owner` (undo it as
    /// [`abandon`](Self::abandon) would); the core then releases the write hold as usual.
    ///
    /// # Cancel safety
    /// The core does not drop this future before it completes.
    async fn downgrade(
        &self,
        _lease: &Self::Lease,
        _read: &AcquireRequest,
    ) -> Result<Grant<Self::Lease>> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "this backend cannot turn a write lock into a read lock in one step",
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Type erasure: the core holds `Arc<dyn DynBackend>` and never names a backend's types.

pub(crate) type ErasedLease = Arc<dyn Any + Send + Sync>;
pub(crate) type ErasedAcquisition = Box<dyn Any + Send>;

#[async_trait]
pub(crate) trait DynBackend: Send + Sync + 'static {
    fn kind(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;
    fn validate_name(&self, name: &str) -> Result<()>;
    fn begin(&self, request: &AcquireRequest) -> Result<ErasedAcquisition>;
    async fn try_acquire(
        &self,
        acquisition: &mut ErasedAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<ErasedLease>>;
    async fn wait(
        &self,
        acquisition: &mut ErasedAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()>;
    async fn abandon(&self, acquisition: ErasedAcquisition, request: &AcquireRequest);
    async fn renew(&self, batch: &[Renewal<'_, ErasedLease>]) -> Vec<(RenewalId, Result<Renewed>)>;
    async fn release(&self, lease: &ErasedLease, name: &str, owner: &str) -> Result<Released>;
    fn release_orders_next_acquire(&self) -> bool;
    fn supports_hand_off(&self) -> bool;
    async fn hand_off(
        &self,
        lease: &ErasedLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<ErasedLease>>;
    async fn inspect(&self, name: &str) -> Result<LockInfo>;
    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool>;
    async fn downgrade(
        &self,
        lease: &ErasedLease,
        read: &AcquireRequest,
    ) -> Result<Grant<ErasedLease>>;
}

fn mismatch(what: &str) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("internal error: {what} belongs to another backend"),
    )
}

fn erase<L: Send + Sync + 'static>(grant: Grant<L>) -> Grant<ErasedLease> {
    Grant {
        lease: Arc::new(grant.lease) as ErasedLease,
        token: grant.token,
        ttl: grant.ttl,
        loss: grant.loss,
        descriptor: grant.descriptor,
        permit: grant.permit,
    }
}

#[async_trait]
impl<B: Backend> DynBackend for B {
    fn kind(&self) -> &'static str {
        Backend::kind(self)
    }

    fn capabilities(&self) -> Capabilities {
        Backend::capabilities(self)
    }

    fn validate_name(&self, name: &str) -> Result<()> {
        Backend::validate_name(self, name)
    }

    fn begin(&self, request: &AcquireRequest) -> Result<ErasedAcquisition> {
        Ok(Box::new(Backend::begin(self, request)?))
    }

    async fn try_acquire(
        &self,
        acquisition: &mut ErasedAcquisition,
        request: &AcquireRequest,
    ) -> Result<Attempt<ErasedLease>> {
        let acquisition = acquisition
            .downcast_mut::<B::Acquisition>()
            .ok_or_else(|| mismatch("an acquisition"))?;
        Ok(
            match Backend::try_acquire(self, acquisition, request).await? {
                Attempt::Acquired(grant) => Attempt::Acquired(erase(grant)),
                Attempt::Busy { retry_after } => Attempt::Busy { retry_after },
            },
        )
    }

    async fn wait(
        &self,
        acquisition: &mut ErasedAcquisition,
        request: &AcquireRequest,
        retry_after: Option<Duration>,
    ) -> Result<()> {
        let acquisition = acquisition
            .downcast_mut::<B::Acquisition>()
            .ok_or_else(|| mismatch("an acquisition"))?;
        Backend::wait(self, acquisition, request, retry_after).await
    }

    async fn abandon(&self, acquisition: ErasedAcquisition, request: &AcquireRequest) {
        match acquisition.downcast::<B::Acquisition>() {
            Ok(acquisition) => Backend::abandon(self, *acquisition, request).await,
            Err(_) => tracing::error!("internal error: abandoned acquisition of another backend"),
        }
    }

    async fn renew(&self, batch: &[Renewal<'_, ErasedLease>]) -> Vec<(RenewalId, Result<Renewed>)> {
        let mut typed = Vec::with_capacity(batch.len());
        let mut mismatched = Vec::new();
        for entry in batch {
            match entry.lease.downcast_ref::<B::Lease>() {
                Some(lease) => typed.push(Renewal {
                    id: entry.id,
                    name: entry.name,
                    owner: entry.owner,
                    lease,
                    ttl: entry.ttl,
                }),
                None => mismatched.push((entry.id, Err(mismatch("a lease")))),
            }
        }
        let mut outcomes = Backend::renew(self, &typed).await;
        outcomes.extend(mismatched);
        outcomes
    }

    async fn release(&self, lease: &ErasedLease, name: &str, owner: &str) -> Result<Released> {
        let lease = lease
            .downcast_ref::<B::Lease>()
            .ok_or_else(|| mismatch("a lease"))?;
        Backend::release(self, lease, name, owner).await
    }

    fn release_orders_next_acquire(&self) -> bool {
        Backend::release_orders_next_acquire(self)
    }

    fn supports_hand_off(&self) -> bool {
        Backend::supports_hand_off(self)
    }

    async fn hand_off(
        &self,
        lease: &ErasedLease,
        name: &str,
        owner: &str,
        next: &AcquireRequest,
    ) -> Result<HandOff<ErasedLease>> {
        let lease = lease
            .downcast_ref::<B::Lease>()
            .ok_or_else(|| mismatch("a lease"))?;
        Ok(
            match Backend::hand_off(self, lease, name, owner, next).await? {
                HandOff::Handed(grant) => HandOff::Handed(erase(grant)),
                HandOff::Released(released) => HandOff::Released(released),
            },
        )
    }

    async fn inspect(&self, name: &str) -> Result<LockInfo> {
        Backend::inspect(self, name).await
    }

    async fn break_holder(&self, name: &str, holder: &HolderInfo) -> Result<bool> {
        Backend::break_holder(self, name, holder).await
    }

    async fn downgrade(
        &self,
        lease: &ErasedLease,
        read: &AcquireRequest,
    ) -> Result<Grant<ErasedLease>> {
        let lease = lease
            .downcast_ref::<B::Lease>()
            .ok_or_else(|| mismatch("a lease"))?;
        Ok(erase(Backend::downgrade(self, lease, read).await?))
    }
}
