//! One Redlock node: its own reconnecting connection ([`Link`]) to one standalone master, and requests
//! to it bounded as a whole (connecting included), since a node slower than its bound is a "no" vote.

use std::sync::Arc;
use std::time::Duration;

use distlock_core::url::Endpoint;
use distlock_core::{Error, ErrorKind};
use redis::Value;

use crate::config::RedisConfig;
use crate::conn::{Ask, Conn, Link, Sent, Target};
use crate::error::RedisError;
use crate::redlock::config::{RedlockConfig, BACKEND};
use crate::rpc::request_error;

/// One node and its connection.
pub(crate) struct Node {
    target: Target,
    link: Link,
}

impl Node {
    pub(crate) fn new(addr: &Endpoint, config: &RedlockConfig) -> Arc<Self> {
        let mut node = RedisConfig::new(addr.clone());
        node.connection = config.connection.clone();
        Arc::new(Self {
            target: Target::new(node),
            link: Link::new(),
        })
    }

    /// The node's address, for messages.
    pub(crate) fn shown(&self) -> &str {
        &self.target.shown
    }

    /// Runs `request` on the node's connection, all of it (connecting too) within `bound`.
    pub(crate) async fn run<T, F, Fut>(
        &self,
        what: &'static str,
        bound: Duration,
        request: F,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        self.run_recorded(what, bound, request, &mut Sent::default())
            .await
    }

    /// [`run`](Self::run), recording in `sent` the connection the request went on.
    pub(crate) async fn run_recorded<T, F, Fut>(
        &self,
        what: &'static str,
        bound: Duration,
        request: F,
        sent: &mut Sent,
    ) -> Result<T, RedisError>
    where
        F: FnMut(Conn) -> Fut,
        Fut: std::future::Future<Output = Result<T, redis::RedisError>>,
    {
        let run = self
            .link
            .run(&self.target, what, bound, Ask::Follow, request, sent);
        tokio::time::timeout(bound, run)
            .await
            .unwrap_or_else(|_| Err(self.timed_out(what, bound)))
    }

    fn timed_out(&self, what: &'static str, bound: Duration) -> RedisError {
        RedisError::Timeout {
            what,
            target: self.target.shown.clone(),
            after: bound,
        }
    }

    /// One script call (`EVALSHA`, with redis-rs's `EVAL` fallback after a restart) within `bound`.
    pub(crate) async fn script(
        &self,
        what: &'static str,
        bound: Duration,
        script: &redis::Script,
        key: &str,
        args: &[&str],
    ) -> Result<Value, RedisError> {
        self.script_recorded(what, bound, script, key, args, &mut Sent::default())
            .await
    }

    /// [`script`](Self::script), recording in `sent` the connection the call went on.
    pub(crate) async fn script_recorded(
        &self,
        what: &'static str,
        bound: Duration,
        script: &redis::Script,
        key: &str,
        args: &[&str],
        sent: &mut Sent,
    ) -> Result<Value, RedisError> {
        let invocation = &invocation(script, key, args);
        self.run_recorded(
            what,
            bound,
            |mut c: Conn| async move { invocation.invoke_async::<Value>(&mut c).await },
            sent,
        )
        .await
    }

    /// One script call on `conn`, a connection an earlier request to this node went on: the node runs
    /// it after that request, whenever that one runs. Within `bound`.
    pub(crate) async fn script_on(
        &self,
        mut conn: Conn,
        what: &'static str,
        bound: Duration,
        script: &redis::Script,
        key: &str,
        args: &[&str],
    ) -> Result<Value, RedisError> {
        let call = invocation(script, key, args);
        match tokio::time::timeout(bound, call.invoke_async::<Value>(&mut conn)).await {
            Ok(reply) => reply.map_err(|source| request_error(what, &self.target, source)),
            Err(_) => Err(self.timed_out(what, bound)),
        }
    }
}

/// `script` called with `key` and `args`.
fn invocation<'a>(
    script: &'a redis::Script,
    key: &str,
    args: &[&str],
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.key(key);
    for arg in args {
        invocation.arg(*arg);
    }
    invocation
}

/// Whether the node refused because the key holds another type (a `redis://` lock's hash).
pub(crate) fn is_wrongtype(e: &RedisError) -> bool {
    matches!(e, RedisError::Request { source, .. } if source.code() == Some("WRONGTYPE"))
}

/// The error a `WRONGTYPE` becomes: what the user did, and what to do.
pub(crate) fn wrongtype(name: &str, node: &str) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!(
            "the key {name:?} on Redlock node {node} is not a string: a redis:// lock (Redisson's hash layout) or other data already uses this name there. redis:// and redlock:// locks of one name are different locks; use another name, or the same scheme everywhere"
        ),
    )
    .with_backend(BACKEND)
    .with_lock(name)
}

/// A node's error as distlock reports it, tagged as Redlock's.
pub(crate) fn node_error(e: RedisError, name: Option<&str>) -> Error {
    e.into_core(name).with_backend(BACKEND)
}
