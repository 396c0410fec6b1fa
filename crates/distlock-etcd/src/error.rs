//! The etcd backend's errors, mapped once into [`distlock_core::Error`] (tagged backend `"etcd"`).
//!
//! What a failure means is read from its typed form: the gRPC [`Code`] etcd answered with (etcd sends
//! no error details beyond the code and a message), the request it answered, and, for a connection
//! that failed in the TLS layer, the [`rustls::Error`] in its source chain. The one case where etcd's
//! code alone is ambiguous is isolated in [`anonymous_request_refused`].

use std::fmt;
use std::time::Duration;

use distlock_core::{Error, ErrorKind};
use tonic::{Code, Status};

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "etcd";

/// Everything that can go wrong in the etcd backend.
#[derive(Debug)]
pub(crate) enum EtcdError {
    /// A bad URL or option.
    Config(String),
    /// No endpoint answered at connect time.
    Connect { endpoints: String, source: Status },
    /// A request failed; `action` says which ("acquire txn", "keep-alive", …).
    Rpc {
        action: &'static str,
        source: Status,
    },
    /// A request got no answer in time.
    Timeout {
        action: &'static str,
        after: Duration,
    },
    /// The session lease this acquire queued on is gone (etcd issue 19597: a waiter must not wait on).
    SessionLost(String),
    /// The server answered something the layout does not allow.
    Protocol(String),
    /// A semaphore's stored limit (at `key`) is not the one asked for.
    LimitMismatch {
        key: String,
        stored: u32,
        requested: u32,
    },
}

impl EtcdError {
    pub(crate) fn rpc(action: &'static str) -> impl FnOnce(Status) -> EtcdError {
        move |source| EtcdError::Rpc { action, source }
    }

    /// The error as distlock reports it, tagged with the backend and, when known, the lock name.
    pub(crate) fn into_core(self, lock: Option<&str>) -> Error {
        let error = Error::from(self);
        match lock {
            Some(name) => error.with_lock(name),
            None => error,
        }
    }

    /// Whether the request failed because the lease it names does not exist (revoked or expired):
    /// etcd's only `NotFound` on a KV or lease request is "requested lease not found".
    pub(crate) fn is_lease_not_found(&self) -> bool {
        matches!(self, EtcdError::Rpc { source, .. } if source.code() == Code::NotFound)
    }
}

/// Whether a failed request is worth another attempt: anything but a refusal of the credentials
/// (another attempt is refused the same way).
pub(crate) fn retryable(status: &Status) -> bool {
    rpc_kind(status) != ErrorKind::PermissionDenied
}

/// The kind of a failed request, from its gRPC code.
fn rpc_kind(status: &Status) -> ErrorKind {
    if anonymous_request_refused(status) {
        return ErrorKind::PermissionDenied;
    }
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => ErrorKind::Protocol,
        _ => ErrorKind::Unavailable,
    }
}

/// Whether etcd refused a request sent without a token while authentication is on ("etcdserver: user
/// name is empty"). etcd sends it under `InvalidArgument`, the code it also uses for malformed
/// requests, and with no error details, so its fixed message (etcd's `rpctypes.ErrGRPCUserEmpty`) is
/// the only way to tell it apart.
fn anonymous_request_refused(status: &Status) -> bool {
    status.code() == Code::InvalidArgument && status.message() == "etcdserver: user name is empty"
}

/// Whether a connect failed in the TLS layer (an untrusted certificate, a failed handshake): a
/// [`rustls::Error`] somewhere in the source chain (tokio-rustls hands it up inside an `io::Error`).
fn is_tls_failure(status: &Status) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = next {
        if error.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        next = error.source();
    }
    false
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdError::Config(message) => f.write_str(message),
            EtcdError::Connect { endpoints, source } if is_tls_failure(source) => write!(
                f,
                "cannot reach etcd at {endpoints}: {} (the TLS handshake failed: the server's certificate must be signed by the CA of etcds://…?ca=/path/ca.pem, or by one in the system roots when no CA file is given, and name the host of the URL; a server that wants a client certificate fails this way too)",
                describe(source)
            ),
            EtcdError::Connect { endpoints, source } => write!(
                f,
                "cannot reach etcd at {endpoints}: {} (is etcd running there? `etcdctl --endpoints {endpoints} endpoint health` checks)",
                describe(source)
            ),
            EtcdError::Rpc { action, source } => {
                write!(f, "etcd {action} failed: {}", describe(source))
            }
            EtcdError::Timeout { action, after } => {
                write!(f, "etcd {action} got no answer within {after:?}")
            }
            EtcdError::SessionLost(why) => f.write_str(why),
            EtcdError::Protocol(message) => write!(f, "unexpected etcd reply: {message}"),
            EtcdError::LimitMismatch {
                key,
                stored,
                requested,
            } => write!(
                f,
                "the semaphore has {stored} permits on the server (etcd key {key}); this one asked for {requested} (every user must ask for the same; the limit is kept when every permit is back: to change it, delete the key while no permit is held, `etcdctl del {key}`, and the next permit stores its own)"
            ),
        }
    }
}

/// A status as one line: its code, its message, and the innermost cause of a transport failure.
fn describe(status: &Status) -> String {
    let mut text = format!("{:?}: {}", status.code(), status.message());
    let mut cause = std::error::Error::source(status);
    let mut innermost = None;
    while let Some(error) = cause {
        innermost = Some(error);
        cause = error.source();
    }
    if let Some(error) = innermost {
        let shown = error.to_string();
        if !text.contains(&shown) {
            text.push_str(&format!(" ({shown})"));
        }
    }
    text
}

impl From<EtcdError> for Error {
    fn from(error: EtcdError) -> Self {
        let kind = match &error {
            EtcdError::Config(_) => ErrorKind::InvalidConfig,
            EtcdError::Connect { source, .. } => match rpc_kind(source) {
                ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                _ => ErrorKind::Unavailable,
            },
            EtcdError::Rpc { source, .. } => rpc_kind(source),
            EtcdError::Timeout { .. } | EtcdError::SessionLost(_) => ErrorKind::Unavailable,
            EtcdError::Protocol(_) => ErrorKind::Protocol,
            EtcdError::LimitMismatch {
                stored, requested, ..
            } => ErrorKind::LimitMismatch {
                stored: *stored,
                requested: *requested,
            },
        };
        let message = error.to_string();
        let error = match error {
            EtcdError::Connect { source, .. } | EtcdError::Rpc { source, .. } => {
                Error::new(kind, message).with_source(source)
            }
            _ => Error::new(kind, message),
        };
        error.with_backend(BACKEND)
    }
}
