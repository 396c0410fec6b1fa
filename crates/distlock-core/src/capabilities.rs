//! What a backend can promise.

/// How far a backend's fencing tokens can be trusted.
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

/// The lock kinds a backend supports. Only `mutex` is built so far.
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
        }
    }
}

/// What a backend can promise; behaviours that differ between backends are decided from this, never
/// from the backend's name.
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
}
