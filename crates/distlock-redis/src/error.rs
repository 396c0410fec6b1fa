//! The Redis backend's errors, mapped once into [`distlock_core::Error`] (tagged backend `"redis"`).

use std::fmt;
use std::time::Duration;

use distlock_core::{Error, ErrorKind, LockKind};

use crate::layout;

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "redis";

/// Everything that can go wrong in the Redis backend.
#[derive(Debug, Clone)]
pub(crate) enum RedisError {
    /// A bad URL or option.
    Config(String),
    /// A valid request this backend cannot honour.
    Unsupported(String),
    /// Connecting to `target` failed.
    Connect {
        target: String,
        source: redis::RedisError,
    },
    /// A request (`what`) to `target` failed.
    Request {
        what: &'static str,
        target: String,
        source: redis::RedisError,
    },
    /// A request did not complete within the bound.
    Timeout {
        what: &'static str,
        target: String,
        after: Duration,
    },
    /// The server answered something the scripts never return.
    Reply { what: &'static str, detail: String },
    /// `WAIT` confirmed fewer replicas than required.
    Replicas { confirmed: u32, required: u32 },
    /// A release was sent twice (the connection broke under the first attempt, its reply lost) and
    /// the second found nothing of this owner's: the first may have deleted the lock, or it had expired.
    ReleaseOutcomeUnknown { target: String },
    /// The undo of this owner's earlier, abandoned acquire of the lock, or its earlier release, may still
    /// be on its way.
    UndoPending { target: String, after: Duration },
    /// The name is in use as another kind of lock (`in_use`: one of `layout::IN_USE_*`) than `asked`.
    KindConflict {
        name: String,
        in_use: i64,
        asked: LockKind,
    },
    /// The semaphore's limit on the server is not the one asked for.
    LimitMismatch {
        name: String,
        stored: u32,
        requested: u32,
    },
}

impl RedisError {
    /// The error as distlock reports it, tagged with the backend and, when known, the lock name.
    pub(crate) fn into_core(self, lock: Option<&str>) -> Error {
        let error = Error::from(self);
        match lock {
            Some(name) => error.with_lock(name),
            None => error,
        }
    }

    fn kind(&self) -> ErrorKind {
        match self {
            RedisError::Config(_) => ErrorKind::InvalidConfig,
            RedisError::Unsupported(_) => ErrorKind::Unsupported,
            RedisError::Connect { source, .. } | RedisError::Request { source, .. } => {
                classify(source)
            }
            RedisError::Timeout { .. }
            | RedisError::ReleaseOutcomeUnknown { .. }
            | RedisError::UndoPending { .. } => ErrorKind::Unavailable,
            RedisError::Reply { .. } => ErrorKind::Protocol,
            RedisError::Replicas {
                confirmed,
                required,
            } => ErrorKind::InsufficientReplicas {
                confirmed: *confirmed,
                required: *required,
            },
            RedisError::KindConflict { .. } => ErrorKind::KindConflict,
            RedisError::LimitMismatch {
                stored, requested, ..
            } => ErrorKind::LimitMismatch {
                stored: *stored,
                requested: *requested,
            },
        }
    }

    /// How a Cluster node refused the request without running it, if it did (see
    /// [`Link::run`](crate::conn::Link::run)).
    pub(crate) fn cluster_refusal(&self) -> Option<ClusterRefusal> {
        let RedisError::Request { source, .. } = self else {
            return None;
        };
        let redis::ErrorKind::Server(kind) = source.kind() else {
            return None;
        };
        match kind {
            redis::ServerErrorKind::Ask => source
                .redirect_node()
                .map(|(address, _slot)| ClusterRefusal::Ask(address.to_string())),
            redis::ServerErrorKind::Moved => Some(ClusterRefusal::Moved),
            redis::ServerErrorKind::TryAgain => Some(ClusterRefusal::TryAgain),
            kind if needs_cluster_action(Some(kind)) => Some(ClusterRefusal::Unsettled),
            _ => None,
        }
    }

    /// The connection failed at once (reset, closed, refused): unlike a timeout, the request did not
    /// linger, and a fresh connection may well succeed.
    pub(crate) fn is_broken_connection(&self) -> bool {
        match self {
            RedisError::Request { source, .. } => {
                (source.is_io_error() || source.is_connection_dropped()) && !source.is_timeout()
            }
            _ => false,
        }
    }

    /// The server answered with an error of its own (a script error, `WRONGTYPE`, `NOPERM`, …): it
    /// ran nothing of the request past the failing call.
    pub(crate) fn is_refusal(&self) -> bool {
        match self {
            RedisError::Request { source, .. } => {
                matches!(source.kind(), redis::ErrorKind::Server(_)) && !self.is_redirect()
            }
            _ => false,
        }
    }

    /// A Cluster `MOVED` or `ASK`: the node refused the request without running it.
    pub(crate) fn is_redirect(&self) -> bool {
        match self {
            RedisError::Request { source, .. } => matches!(
                source.kind(),
                redis::ErrorKind::Server(
                    redis::ServerErrorKind::Moved | redis::ServerErrorKind::Ask
                )
            ),
            _ => false,
        }
    }

    /// Whether the connection the request used should be replaced: its state is unknown (a reply may
    /// still be on its way and would be taken for the next request's), or it points at a server that
    /// is no longer the master.
    pub(crate) fn breaks_connection(&self) -> bool {
        match self {
            RedisError::Timeout { .. } => true,
            RedisError::Request { source, .. } => {
                source.is_io_error()
                    || source.is_connection_dropped()
                    || source.is_timeout()
                    || source.is_unrecoverable_error()
                    || matches!(
                        source.kind(),
                        redis::ErrorKind::Server(
                            redis::ServerErrorKind::ReadOnly | redis::ServerErrorKind::MasterDown
                        )
                    )
            }
            _ => false,
        }
    }
}

/// How a Cluster node refused a request without running any of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ClusterRefusal {
    /// `ASK host:port`: the slot is migrating to that node, which has the request's key already.
    Ask(String),
    /// `MOVED`: the slot lives on another node now.
    Moved,
    /// `TRYAGAIN`: a request on several keys (a script of a lock kind with several keys, see
    /// [`layout::ELSEWHERE`](crate::layout::ELSEWHERE)) that a slot migration split between two
    /// nodes, for the moment.
    TryAgain,
    /// `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY` (a failover under way): for the moment.
    Unsettled,
}

/// The server errors on which redis-rs's Cluster connection acts (a redirect, or wait and try again):
/// it fails a whole pipeline with the first of them.
pub(crate) fn needs_cluster_action(kind: Option<redis::ServerErrorKind>) -> bool {
    use redis::ServerErrorKind as Server;
    matches!(
        kind,
        Some(
            Server::Ask
                | Server::Moved
                | Server::TryAgain
                | Server::ClusterDown
                | Server::MasterDown
                | Server::BusyLoading
                | Server::ReadOnly
        )
    )
}

/// The server's error code (`WRONGTYPE`, `NOAUTH`, …) when the error is a server reply. Codes redis-rs
/// has no [`redis::ServerErrorKind`] for (`WRONGTYPE`, `NOAUTH`, `WRONGPASS`) are compared as the
/// code, the reply's first word, which Redis documents as the error's kind; never the message.
fn code(e: &redis::RedisError) -> Option<&str> {
    e.code()
}

fn classify(e: &redis::RedisError) -> ErrorKind {
    use redis::ServerErrorKind as Server;
    if code(e) == Some("WRONGTYPE") {
        return ErrorKind::Protocol;
    }
    if matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::Server(Server::NoPerm)
    ) || matches!(code(e), Some("NOAUTH" | "WRONGPASS"))
    {
        return ErrorKind::PermissionDenied;
    }
    if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() || e.is_connection_refusal() {
        return ErrorKind::Unavailable;
    }
    match e.kind() {
        redis::ErrorKind::Server(
            Server::ReadOnly
            | Server::MasterDown
            | Server::BusyLoading
            | Server::TryAgain
            | Server::ClusterDown
            | Server::Moved
            | Server::Ask,
        )
        | redis::ErrorKind::MasterNameNotFoundBySentinel
        | redis::ErrorKind::NoValidReplicasFoundBySentinel
        | redis::ErrorKind::ClusterConnectionNotFound => ErrorKind::Unavailable,
        _ if code(e) == Some("BUSY") => ErrorKind::Unavailable,
        redis::ErrorKind::InvalidClientConfig => ErrorKind::InvalidConfig,
        _ => ErrorKind::Protocol,
    }
}

/// The I/O error under a redis-rs error, if any. redis-rs keeps it behind an
/// `Arc<dyn Error + Send + Sync>` and exposes only that `Arc` as the source.
fn io_error(e: &redis::RedisError) -> Option<&std::io::Error> {
    let source = std::error::Error::source(e)?;
    source
        .downcast_ref::<std::sync::Arc<dyn std::error::Error + Send + Sync>>()
        .and_then(|inner| inner.downcast_ref::<std::io::Error>())
        .or_else(|| source.downcast_ref::<std::io::Error>())
}

/// Whether the error came from the TLS layer (a certificate not trusted, a failed handshake, a server
/// that does not speak TLS): tokio-rustls hands rustls' error up inside an I/O error.
fn is_tls_failure(e: &redis::RedisError) -> bool {
    #[cfg(feature = "tls")]
    {
        io_error(e)
            .and_then(std::io::Error::get_ref)
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = io_error(e);
        false
    }
}

/// What a user needs, said when the server refuses one: the ACL rules every command distlock sends (the
/// scripts' commands included: Redis checks each `redis.call` against the caller's ACL). The lock names
/// are the caller's, so the keys are `~*`; the mutex's channels all start with
/// `redisson_lock__channel:`, a read-write lock's with `redisson_rwlock:`, a semaphore's with
/// `redisson_sc:`. In Cluster, `+asking` is for following a migration's `ASK`, and `+hgetall` for
/// `inspect` during a migration (each key read where it is).
const PERMISSION_ADVICE: &str = " (check the user and password in the URL, redis://user:password@host:port, and the user's ACL: it needs the rules ~* &redisson_lock__channel:* +ping +evalsha +eval +script|load +exists +hexists +hset +incr +pexpire +pttl +type +del +publish +subscribe +unsubscribe +hget +hkeys +get +pubsub|numsub +llen; for read-write locks and semaphores also &redisson_rwlock:* &redisson_sc:* +hdel +hlen +hincrby +set +incrby +decrby +zadd +zrem +zscore +zcard +zrange +zrangebyscore +time; with layout=plain also &distlock_lock__channel:* +set; with fair=true also &distlock_fair__channel:* +time +zrangebyscore +zadd +zrem +zscore +rpush +lpos +lindex +lpop +lrem; plus +select with a /db, +wait with wait_replicas, and in Cluster +spublish +ssubscribe +sunsubscribe +cluster|slots +asking +hgetall)";

fn advice(e: &redis::RedisError) -> &'static str {
    match classify(e) {
        ErrorKind::Unavailable if is_tls_failure(e) => {
            " (the TLS handshake failed: the server's certificate must be signed by a CA in the system roots or in the file of rediss://…?ca=/path/ca.pem, and name the host of the URL)"
        }
        ErrorKind::Protocol if code(e) == Some("WRONGTYPE") => {
            " (the lock's key holds another type: something other than a lock — a string someone SET? — uses this name; distlock keeps a hash there for a mutex (a string with ?layout=plain) or read-write lock and an integer (the permit counter) for a semaphore, as Redisson does; every client of a name must use one layout; pick another name or delete the key)"
        }
        ErrorKind::PermissionDenied => PERMISSION_ADVICE,
        ErrorKind::Unavailable => {
            " (check that the server runs at that address, that this host can reach it, and for Sentinel that the Sentinels know the master's name)"
        }
        _ => "",
    }
}

impl fmt::Display for RedisError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedisError::Config(message) | RedisError::Unsupported(message) => f.write_str(message),
            RedisError::Connect { target, source } => {
                write!(f, "cannot connect to {target}: {source}{}", advice(source))
            }
            RedisError::Request {
                what,
                target,
                source,
            } => write!(f, "{what} on {target} failed: {source}{}", advice(source)),
            RedisError::Timeout {
                what,
                target,
                after,
            } => write!(
                f,
                "{what} on {target}: no reply within {}; the connection is replaced",
                distlock_core::duration::format(*after)
            ),
            RedisError::Reply { what, detail } => {
                write!(f, "unexpected reply to {what}: {detail}")
            }
            RedisError::Replicas {
                confirmed,
                required,
            } => write!(
                f,
                "WAIT: {confirmed} of {required} required replicas confirmed the write in time; the grant was undone"
            ),
            RedisError::UndoPending { target, after } => write!(
                f,
                "acquire on {target}: this owner's earlier release of the lock, or the undo of its earlier abandoned acquire, is not confirmed after {}: it may still be queued on a slow connection, and would delete a grant made now; try again",
                distlock_core::duration::format(*after)
            ),
            RedisError::ReleaseOutcomeUnknown { target } => write!(
                f,
                "release on {target}: the outcome is unknown: the connection broke before the reply came back, and the retry found the lock no longer this owner's, so either the first attempt released it or it had already expired (no other owner's lock was touched)"
            ),
            RedisError::KindConflict {
                name,
                in_use,
                asked,
            } => match *in_use {
                layout::IN_USE_SEMAPHORE => write!(
                    f,
                    "the name is a semaphore (its key holds the permit counter of Redisson's RPermitExpirableSemaphore layout), which is kept with its limit even when no permit is held, so it cannot be taken as a {asked}; use another name, or, once no permit is held, delete the keys {:?} and {:?} (a string of digits without expiry is taken for the counter: if another client's lock without a timeout wrote it, wait for that client instead)",
                    layout::lock_key(name),
                    layout::semaphore_timeout_key(name)
                ),
                layout::IN_USE_READ_WRITE => write!(
                    f,
                    "the name is held as a read-write lock (Redisson's RReadWriteLock hash, with a mode field); it cannot be taken as a {asked} until that is released"
                ),
                _ => write!(
                    f,
                    "the name is held as a mutex (Redisson's RLock hash, without a mode field); it cannot be taken as a {asked} until that is released"
                ),
            },
            RedisError::LimitMismatch {
                name,
                stored,
                requested,
            } => write!(
                f,
                "the semaphore has {stored} permits on the server (its counter plus the permits held, as Redisson's getPermits counts them); this one asked for {requested}: every user must ask for the same. To change the limit, delete the keys {:?} and {:?} once no permit is held (or use Redisson's setPermits)",
                layout::lock_key(name),
                layout::semaphore_timeout_key(name)
            ),
        }
    }
}

impl From<RedisError> for Error {
    fn from(error: RedisError) -> Self {
        let kind = error.kind();
        let message = error.to_string();
        let error = match error {
            RedisError::Connect { source, .. } | RedisError::Request { source, .. } => {
                Error::new(kind, message).with_source(source)
            }
            _ => Error::new(kind, message),
        };
        error.with_backend(BACKEND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(source: redis::RedisError) -> RedisError {
        RedisError::Request {
            what: "acquire",
            target: "127.0.0.1:6379".into(),
            source,
        }
    }

    fn server(code: &str) -> RedisError {
        request(redis::make_extension_error(
            code.to_string(),
            Some("refused".into()),
        ))
    }

    fn io(kind: std::io::ErrorKind) -> RedisError {
        request(std::io::Error::from(kind).into())
    }

    #[test]
    fn refusals_by_the_server_are_not_retried() {
        let no_perm: redis::RedisError = (
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            "no permission",
        )
            .into();
        for e in [
            server("WRONGTYPE"),
            server("NOAUTH"),
            server("WRONGPASS"),
            request(no_perm),
        ] {
            assert!(!e.is_broken_connection(), "{e}");
            assert_eq!(e.cluster_refusal(), None, "{e}");
        }
        assert_eq!(server("WRONGTYPE").kind(), ErrorKind::Protocol);
        assert_eq!(server("WRONGPASS").kind(), ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_broken_connection_is_retried_a_timeout_is_not() {
        for kind in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = io(kind);
            assert!(e.is_broken_connection(), "{e}");
            assert!(e.breaks_connection(), "{e}");
        }
        let timed_out = io(std::io::ErrorKind::TimedOut);
        assert!(!timed_out.is_broken_connection(), "{timed_out}");
        assert!(timed_out.breaks_connection(), "{timed_out}");
        let elapsed = RedisError::Timeout {
            what: "acquire",
            target: "127.0.0.1:6379".into(),
            after: Duration::from_secs(1),
        };
        assert!(!elapsed.is_broken_connection() && elapsed.breaks_connection());
    }

    #[test]
    fn a_cluster_refusal_is_told_by_its_kind() {
        let refusal = |kind, detail: &str| {
            let e: redis::RedisError = (
                redis::ErrorKind::Server(kind),
                "refused",
                detail.to_string(),
            )
                .into();
            request(e).cluster_refusal()
        };
        use redis::ServerErrorKind as Server;
        assert_eq!(
            refusal(Server::Ask, "3999 127.0.0.1:7001"),
            Some(ClusterRefusal::Ask("127.0.0.1:7001".into()))
        );
        assert_eq!(
            refusal(Server::Moved, "3999 127.0.0.1:7001"),
            Some(ClusterRefusal::Moved)
        );
        assert_eq!(
            refusal(
                Server::TryAgain,
                "Multiple keys request during rehashing of slot"
            ),
            Some(ClusterRefusal::TryAgain)
        );
        assert_eq!(
            refusal(Server::ClusterDown, "The cluster is down"),
            Some(ClusterRefusal::Unsettled)
        );
        assert_eq!(refusal(Server::NoScript, "No matching script"), None);
        // An `ASK` without a node to go to is not followed.
        assert_eq!(refusal(Server::Ask, "garbled"), None);
        let moved = request(
            (
                redis::ErrorKind::Server(Server::Moved),
                "moved",
                "3999 127.0.0.1:7001".to_string(),
            )
                .into(),
        );
        assert!(!moved.is_refusal() && !moved.is_broken_connection());
    }

    #[cfg(feature = "tls")]
    #[test]
    fn a_tls_failure_is_told_by_its_type_not_its_text() {
        let tls = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        assert!(is_tls_failure(&tls.into()));
        // The same words without a rustls error under them are not a TLS failure.
        let words = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "TLS handshake: certificate unknown",
        );
        assert!(!is_tls_failure(&words.into()));
    }
}
