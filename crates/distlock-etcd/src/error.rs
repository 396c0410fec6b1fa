//! The etcd backend's errors, mapped once into [`distlock_core::Error`] (tagged backend `"etcd"`).

use std::fmt;
use std::time::Duration;

use distlock_core::{Error, ErrorKind};

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "etcd";

/// Everything that can go wrong in the etcd backend.
#[derive(Debug)]
pub(crate) enum EtcdError {
    /// A bad URL or option.
    Config(String),
    /// No endpoint answered at connect time.
    Connect {
        endpoints: String,
        source: etcd_client::Error,
    },
    /// A request failed; `action` says which ("acquire txn", "keep-alive", …).
    Rpc {
        action: &'static str,
        source: etcd_client::Error,
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
}

impl EtcdError {
    pub(crate) fn rpc(action: &'static str) -> impl FnOnce(etcd_client::Error) -> EtcdError {
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
}

/// The kind of a failed request: auth problems are not temporary, everything else is.
pub(crate) fn kind_of(source: &etcd_client::Error) -> ErrorKind {
    rpc_kind(source)
}

fn rpc_kind(source: &etcd_client::Error) -> ErrorKind {
    use tonic_code::Code;
    // etcd answers a wrong user or password, and a request without one while auth is on, with
    // InvalidArgument ("etcdserver: authentication failed, invalid user ID or password",
    // "etcdserver: user name is empty").
    let text = source.to_string();
    if [
        "authentication failed",
        "user name is empty",
        "invalid auth token",
    ]
    .iter()
    .any(|w| text.contains(w))
    {
        return ErrorKind::PermissionDenied;
    }
    match source {
        etcd_client::Error::GRpcStatus(status) => match tonic_code::of(status) {
            Code::Unauthenticated | Code::PermissionDenied => ErrorKind::PermissionDenied,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                ErrorKind::Protocol
            }
            Code::Other => ErrorKind::Unavailable,
        },
        etcd_client::Error::InvalidArgs(_) | etcd_client::Error::InvalidUri(_) => {
            ErrorKind::InvalidConfig
        }
        _ => ErrorKind::Unavailable,
    }
}

/// gRPC codes without naming tonic (it is not a direct dependency): read from the status's text form.
mod tonic_code {
    pub(super) enum Code {
        Unauthenticated,
        PermissionDenied,
        InvalidArgument,
        FailedPrecondition,
        OutOfRange,
        Other,
    }

    pub(super) fn of(status: &impl std::fmt::Debug) -> Code {
        let text = format!("{status:?}");
        if text.contains("Unauthenticated") {
            Code::Unauthenticated
        } else if text.contains("PermissionDenied") {
            Code::PermissionDenied
        } else if text.contains("InvalidArgument") {
            Code::InvalidArgument
        } else if text.contains("FailedPrecondition") {
            Code::FailedPrecondition
        } else if text.contains("OutOfRange") {
            Code::OutOfRange
        } else {
            Code::Other
        }
    }
}

/// Whether a connect failed in the TLS layer (an untrusted certificate, a failed handshake).
fn is_tls_failure(source: &etcd_client::Error) -> bool {
    let text = format!("{source:?}");
    ["certificate", "Certificate", "handshake", "tls:"]
        .iter()
        .any(|w| text.contains(w))
}

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdError::Config(message) => f.write_str(message),
            EtcdError::Connect { endpoints, source } if is_tls_failure(source) => write!(
                f,
                "cannot reach etcd at {endpoints}: {source} (the TLS handshake failed: the server's certificate must be signed by a CA in the system roots or in the file of etcds://…?ca=/path/ca.pem, and name the host of the URL; a server that wants a client certificate fails this way too)"
            ),
            EtcdError::Connect { endpoints, source } => write!(
                f,
                "cannot reach etcd at {endpoints}: {source} (is etcd running there? `etcdctl --endpoints {endpoints} endpoint health` checks)"
            ),
            EtcdError::Rpc { action, source } => write!(f, "etcd {action} failed: {source}"),
            EtcdError::Timeout { action, after } => {
                write!(f, "etcd {action} got no answer within {after:?}")
            }
            EtcdError::SessionLost(why) => f.write_str(why),
            EtcdError::Protocol(message) => write!(f, "unexpected etcd reply: {message}"),
        }
    }
}

impl From<EtcdError> for Error {
    fn from(error: EtcdError) -> Self {
        let kind = match &error {
            EtcdError::Config(_) => ErrorKind::InvalidConfig,
            EtcdError::Connect { source, .. } => match rpc_kind(source) {
                ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                ErrorKind::InvalidConfig => ErrorKind::InvalidConfig,
                _ => ErrorKind::Unavailable,
            },
            EtcdError::Rpc { source, .. } => rpc_kind(source),
            EtcdError::Timeout { .. } | EtcdError::SessionLost(_) => ErrorKind::Unavailable,
            EtcdError::Protocol(_) => ErrorKind::Protocol,
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
