//! What a backend can promise.

use crate::kinds::LockKind;

/// How far a backend's fencing tokens can be trusted.
///
/// ```
/// use distlock_core::{Fencing, Locks, MemoryBackend};
///
/// // A resource that needs strict fencing refuses to run on a backend that cannot give it.
/// let locks = Locks::new(MemoryBackend::new());
/// assert_eq!(locks.capabilities().fencing, Fencing::Strict);
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fencing {
    /// Strictly increasing across holders under every fault the backend tolerates (etcd revision,
    /// ZooKeeper czxid, a counter row committed in SQL, a counter in a lock file).
    Strict,
    /// Increasing while the server keeps its data; may repeat after a failover or a restart without
    /// persistence (Redis `INCR`). GUARANTEES.md says when.
    BestEffort,
    /// No token is minted (Redlock); [`LockGuard::token`](crate::LockGuard::token) returns `None`.
    None,
}

/// How a backend's read-write lock orders readers and writers.
///
/// ```
/// use distlock_core::{Locks, MemoryBackend, ReadWriteOrder};
///
/// // Whether a stream of readers can keep a writer out: ask before relying on it.
/// let kinds = Locks::new(MemoryBackend::new()).capabilities().kinds;
/// assert!(kinds.read_write);
/// let writer_may_starve = kinds.read_write_order == ReadWriteOrder::ReadersFirst;
/// # let _ = writer_may_starve;
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ReadWriteOrder {
    /// Readers get in whenever no writer holds the lock, even with writers waiting: a steady stream
    /// of readers can keep a writer out for ever (Redisson's `RReadWriteLock`, `flock`).
    #[default]
    ReadersFirst,
    /// A waiting writer keeps new readers out, so a writer waits at most for the readers holding
    /// when it came (not necessarily first come, first served among writers).
    WritersFirst,
    /// First come, first served across readers and writers (a queue on the server: ZooKeeper,
    /// etcd, PostgreSQL's lock queue).
    Fifo,
}

/// The lock kinds a backend supports.
///
/// How long a crashed holder of any kind (a reader, a permit holder) blocks others is the mutex's:
/// until its process dies where [`Capabilities::frees_on_process_death`], else until its lease or
/// session ends.
///
/// ```
/// use distlock_core::{LockKinds, ReadWriteOrder};
///
/// // What a backend with readers-first read-write locks and semaphores announces.
/// let kinds = LockKinds::mutex_only()
///     .with_read_write(ReadWriteOrder::ReadersFirst)
///     .with_semaphore();
/// assert!(kinds.mutex && kinds.read_write && kinds.semaphore && !kinds.leader_election);
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LockKinds {
    /// Exclusive lock.
    pub mutex: bool,
    /// Shared readers, exclusive writer.
    pub read_write: bool,
    /// N permits, each with its own lease.
    pub semaphore: bool,
    /// First come, first served across processes.
    pub fair: bool,
    /// All-or-nothing over several names.
    pub multi: bool,
    /// Leader election.
    pub leader_election: bool,
    /// How readers and writers are ordered, where `read_write`.
    pub read_write_order: ReadWriteOrder,
    /// A write guard can become a read guard in one step, with no writer in between
    /// ([`LockGuard::downgrade`](crate::LockGuard::downgrade)).
    pub atomic_downgrade: bool,
}

impl LockKinds {
    /// Only the exclusive mutex.
    pub const fn mutex_only() -> Self {
        Self {
            mutex: true,
            read_write: false,
            semaphore: false,
            fair: false,
            multi: false,
            leader_election: false,
            read_write_order: ReadWriteOrder::ReadersFirst,
            atomic_downgrade: false,
        }
    }

    /// Adds the read-write lock, ordered as `order`.
    pub const fn with_read_write(mut self, order: ReadWriteOrder) -> Self {
        self.read_write = true;
        self.read_write_order = order;
        self
    }

    /// Adds the atomic downgrade of a write guard.
    pub const fn with_atomic_downgrade(mut self) -> Self {
        self.atomic_downgrade = true;
        self
    }

    /// Adds the semaphore.
    pub const fn with_semaphore(mut self) -> Self {
        self.semaphore = true;
        self
    }

    /// Whether `kind` is among these.
    pub fn supports(&self, kind: LockKind) -> bool {
        match kind {
            LockKind::Mutex => self.mutex,
            LockKind::Read | LockKind::Write => self.read_write,
            LockKind::Permit { .. } => self.semaphore,
        }
    }

    /// The kinds, for messages: `mutex, read-write lock, semaphore`.
    pub fn describe(&self) -> String {
        let kinds: Vec<&str> = [
            (self.mutex, "mutex"),
            (self.read_write, "read-write lock"),
            (self.semaphore, "semaphore"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        kinds.join(", ")
    }
}

/// What a backend can promise; behaviours that differ between backends are decided from this, never
/// from the backend's name.
///
/// ```
/// use distlock_core::{Capabilities, Locks, MemoryBackend};
///
/// let caps: Capabilities = Locks::new(MemoryBackend::new()).capabilities();
/// // A lock that must not outlive a crashed holder by more than its lease needs a server TTL.
/// assert!(caps.server_ttl && caps.kinds.mutex);
/// assert!(!caps.shared_across_processes); // memory:// is one process's
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// The server expires a lock whose holder stops renewing it (a lease). Without it the lock is held
    /// until the holding process or connection ends, and the guard has no validity deadline.
    pub server_ttl: bool,
    /// How far fencing tokens can be trusted.
    pub fencing: Fencing,
    /// Waiters in different processes are served first come, first served.
    pub fifo: bool,
    /// Waiters are woken by the engine (pub/sub, watch, in-server wait), not by polling.
    pub notify_wait: bool,
    /// The lock is freed at once when the holding process dies (not only after its lease).
    pub frees_on_process_death: bool,
    /// Two processes on one machine can contend (false only for the in-process memory backend).
    pub shared_across_processes: bool,
    /// Another holder's exclusive hold can be ended by an operator
    /// ([`Locks::break_holder`](crate::Locks::break_holder), `distlock break`).
    pub breaks_holders: bool,
    /// The lock kinds supported.
    pub kinds: LockKinds,
}

impl Capabilities {
    /// A starting point for a backend's description: a mutex with nothing else promised.
    pub const fn mutex() -> Self {
        Self {
            server_ttl: false,
            fencing: Fencing::None,
            fifo: false,
            notify_wait: false,
            frees_on_process_death: false,
            shared_across_processes: true,
            breaks_holders: false,
            kinds: LockKinds::mutex_only(),
        }
    }

    /// Sets [`server_ttl`](Self::server_ttl).
    pub const fn with_server_ttl(mut self, on: bool) -> Self {
        self.server_ttl = on;
        self
    }

    /// Sets [`fencing`](Self::fencing).
    pub const fn with_fencing(mut self, fencing: Fencing) -> Self {
        self.fencing = fencing;
        self
    }

    /// Sets [`fifo`](Self::fifo).
    pub const fn with_fifo(mut self, on: bool) -> Self {
        self.fifo = on;
        self
    }

    /// Sets [`notify_wait`](Self::notify_wait).
    pub const fn with_notify_wait(mut self, on: bool) -> Self {
        self.notify_wait = on;
        self
    }

    /// Sets [`frees_on_process_death`](Self::frees_on_process_death).
    pub const fn with_frees_on_process_death(mut self, on: bool) -> Self {
        self.frees_on_process_death = on;
        self
    }

    /// Sets [`shared_across_processes`](Self::shared_across_processes).
    pub const fn with_shared_across_processes(mut self, on: bool) -> Self {
        self.shared_across_processes = on;
        self
    }

    /// Sets [`breaks_holders`](Self::breaks_holders).
    pub const fn with_breaks_holders(mut self, on: bool) -> Self {
        self.breaks_holders = on;
        self
    }

    /// Sets [`kinds`](Self::kinds).
    pub const fn with_kinds(mut self, kinds: LockKinds) -> Self {
        self.kinds = kinds;
        self
    }
}
