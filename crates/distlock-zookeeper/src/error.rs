//! The ZooKeeper backend's errors, mapped once into [`distlock_core::Error`] (tagged backend
//! `"zookeeper"`). What a failure means is read from the client's typed [`zk::Error`] (ZooKeeper's
//! error codes), never from message text.

use std::fmt;
use std::time::Duration;

use distlock_core::{Error, ErrorKind};
use zookeeper_client as zk;

/// The backend's short name, for errors and logs.
pub(crate) const BACKEND: &str = "zookeeper";

/// Everything that can go wrong in the ZooKeeper backend.
#[derive(Debug)]
pub(crate) enum ZkError {
    /// A bad URL or option.
    Config(String),
    /// No session could be established.
    Connect { servers: String, source: zk::Error },
    /// A request failed; `action` says which ("create", "getChildren", …).
    Request {
        action: &'static str,
        source: zk::Error,
    },
    /// A delete of a held lock's own node got no definite answer (`why`): it may have been applied.
    /// It is sent again once the session is connected (`cleanup`); the release's outcome is unknown.
    DeleteUnanswered { path: String, why: String },
    /// A request got no answer in time.
    Timeout {
        action: &'static str,
        after: Duration,
    },
    /// The session this acquire queued on expired or closed: a waiter never waits on (etcd #19597's
    /// analogue).
    SessionLost(String),
    /// The session's touch by the leader is not proven recent enough for a grant or renewal to be
    /// trusted (issue 10); it may well be alive.
    Unconfirmed(String),
    /// What this backend does not do (TLS).
    Unsupported(String),
    /// The server negotiated a session timeout other than the lease asked for.
    LeaseNotHonoured {
        asked: Duration,
        negotiated: Duration,
    },
    /// A semaphore's limit stored at `path` is another than the one asked for.
    LimitMismatch {
        stored: u32,
        requested: u32,
        path: String,
    },
    /// The name is in use as another kind (the message names it).
    KindConflict(String),
    /// The server said the hold's node is gone (a downgrade of a write lock no longer held).
    NotHeld(String),
    /// A write got no definite answer and may have been applied (an operator's break).
    OutcomeUnknown(String),
}

impl ZkError {
    /// The error as distlock reports it, tagged with the backend and, when known, the lock name.
    pub(crate) fn into_core(self, lock: Option<&str>) -> Error {
        let error = Error::from(self);
        match lock {
            Some(name) => error.with_lock(name),
            None => error,
        }
    }
}

impl ZkError {
    /// Whether the request got no definite answer (the connection was lost or silent, or the server
    /// throttled it): it may have been applied, and may succeed when sent again on the same session.
    pub(crate) fn unanswered(&self) -> bool {
        match self {
            ZkError::Request { source, .. } => retryable(source),
            ZkError::Timeout { .. }
            | ZkError::DeleteUnanswered { .. }
            | ZkError::OutcomeUnknown(_) => true,
            _ => false,
        }
    }
}

/// Whether a failed request may succeed when sent again on the same session: a connection lost
/// mid-request (the client reconnects within the session) or a throttled server.
///
/// `zookeeper-client` fails the requests in flight on a broken connection with the connection's own
/// error, not `ConnectionLoss`: an I/O error (a reset: `Custom`), "no response from connection in …"
/// (a silent server past the connect timeout: `Custom`), or a garbled reply (`UnexpectedError`). None
/// of these is a server's answer: the request may or may not have been applied, and the session
/// reconnects (issue 24: a release interrupted so was reported as a protocol error, and its node stayed
/// for the session's life).
pub(crate) fn retryable(error: &zk::Error) -> bool {
    matches!(
        error,
        zk::Error::ConnectionLoss
            | zk::Error::Timeout
            | zk::Error::Throttled
            | zk::Error::Custom(_)
            | zk::Error::UnexpectedError(_)
    )
}

/// Whether the session behind a failed request is gone for good.
pub(crate) fn session_gone(error: &zk::Error) -> bool {
    matches!(
        error,
        zk::Error::SessionExpired | zk::Error::ClientClosed | zk::Error::AuthFailed
    )
}

/// The kind of a failed request, from ZooKeeper's error code.
fn request_kind(error: &zk::Error) -> ErrorKind {
    match error {
        zk::Error::NoAuth | zk::Error::AuthFailed | zk::Error::InvalidAcl => {
            ErrorKind::PermissionDenied
        }
        zk::Error::BadArguments(_) | zk::Error::NoChildrenForEphemerals => ErrorKind::InvalidName,
        zk::Error::ConnectionLoss
        | zk::Error::Timeout
        | zk::Error::NoHosts
        | zk::Error::SessionExpired
        | zk::Error::SessionMoved
        | zk::Error::ClientClosed
        | zk::Error::Throttled
        | zk::Error::NotReadOnly
        | zk::Error::Custom(_)
        | zk::Error::UnexpectedError(_) => ErrorKind::Unavailable,
        _ => ErrorKind::Protocol,
    }
}

fn hint(error: &zk::Error) -> &'static str {
    match error {
        zk::Error::NoAuth => " (the node's ACL refuses this client: give the digest credentials allowed to create under the lock path as zk://user:password@…)",
        zk::Error::AuthFailed => " (the server refused the credentials)",
        zk::Error::NoChildrenForEphemerals => " (a parent of the lock path is an ephemeral node: pick another name)",
        _ => "",
    }
}

impl fmt::Display for ZkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZkError::Config(message) => f.write_str(message),
            ZkError::Connect { servers, source } => write!(
                f,
                "cannot reach ZooKeeper at {servers}: {source}{} (is it running there? `echo srvr | nc HOST PORT` checks)",
                hint(source)
            ),
            ZkError::Request { action, source } => {
                write!(f, "ZooKeeper {action} failed: {source}{}", hint(source))
            }
            ZkError::Timeout { action, after } => {
                write!(f, "ZooKeeper {action} got no answer within {after:?}")
            }
            ZkError::SessionLost(why)
            | ZkError::Unconfirmed(why)
            | ZkError::Unsupported(why)
            | ZkError::KindConflict(why)
            | ZkError::NotHeld(why)
            | ZkError::OutcomeUnknown(why) => f.write_str(why),
            ZkError::LimitMismatch { stored, requested, path } => write!(
                f,
                "the semaphore has {stored} permits on the server ({path}); this one asked for {requested} (every user must ask for the same; to change it, delete {path} while no permit is held: `zkCli.sh delete {path}`)"
            ),
            ZkError::DeleteUnanswered { path, why } => write!(
                f,
                "the delete of the lock node {path} got no answer ({why}): the outcome is unknown (it may have been applied); it is sent again on the same session once connected, else the node goes when the server expires the session"
            ),
            ZkError::LeaseNotHonoured { asked, negotiated } => write!(
                f,
                "the lease {asked:?} needs a ZooKeeper session timeout of {asked:?}, but the server negotiated {negotiated:?} (its minSessionTimeout/maxSessionTimeout bound it; the default is 2 to 20 ticks): use a lease the server accepts, or leave the lease out to use the session timeout"
            ),
        }
    }
}

impl From<ZkError> for Error {
    fn from(error: ZkError) -> Self {
        let kind = match &error {
            ZkError::Config(_) | ZkError::LeaseNotHonoured { .. } => ErrorKind::InvalidConfig,
            ZkError::Unsupported(_) => ErrorKind::Unsupported,
            ZkError::LimitMismatch {
                stored, requested, ..
            } => ErrorKind::LimitMismatch {
                stored: *stored,
                requested: *requested,
            },
            ZkError::KindConflict(_) => ErrorKind::KindConflict,
            ZkError::NotHeld(_) => ErrorKind::NotHeld,
            ZkError::Connect { source, .. } => match request_kind(source) {
                ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                _ => ErrorKind::Unavailable,
            },
            ZkError::Request { source, .. } => request_kind(source),
            ZkError::Timeout { .. }
            | ZkError::SessionLost(_)
            | ZkError::Unconfirmed(_)
            | ZkError::DeleteUnanswered { .. }
            | ZkError::OutcomeUnknown(_) => ErrorKind::Unavailable,
        };
        let message = error.to_string();
        let error = match error {
            ZkError::Connect { source, .. } | ZkError::Request { source, .. } => {
                Error::new(kind, message).with_source(source)
            }
            _ => Error::new(kind, message),
        };
        error.with_backend(BACKEND)
    }
}
