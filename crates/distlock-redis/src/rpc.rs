//! Scripts and pipelines on a [`Link`], and reading their replies.

use std::time::Duration;

use distlock_core::retry::RetryPolicy;
use redis::{Cmd, Pipeline, Script, ToRedisArgs, Value};

use crate::conn::{Ask, Conn, Link, Sent, Target};
use crate::error::RedisError;
use crate::RedisBackend;

/// After a `NOSCRIPT` (a restarted server, a failover) the scripts are loaded and the request is sent
/// once more, at once: the load is what the retry waited for.
const NOSCRIPT_RELOAD: RetryPolicy = RetryPolicy::new(1, Duration::ZERO, Duration::ZERO);

/// `d` in whole milliseconds, at least 1 (`PEXPIRE 0` would delete the key).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A `PTTL` reply: `None` for "no expiry" (-1) and "no key" (-2).
pub(crate) fn pttl(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

pub(crate) fn server_error(v: &Value) -> Option<redis::RedisError> {
    match v {
        Value::ServerError(e) => Some(e.clone().into()),
        _ => None,
    }
}

pub(crate) fn request_error(
    what: &'static str,
    target: &Target,
    source: redis::RedisError,
) -> RedisError {
    RedisError::Request {
        what,
        target: target.shown.clone(),
        source,
    }
}

/// Whether the server had not seen a script: a standalone server answers `NOSCRIPT` in the pipeline's
/// values; a Cluster pipeline fails as a whole with it.
fn is_noscript(result: &Result<Vec<Value>, RedisError>) -> bool {
    let noscript = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
    match result {
        Ok(values) => values
            .iter()
            .any(|v| server_error(v).is_some_and(|e| e.kind() == noscript)),
        Err(RedisError::Request { source, .. }) => source.kind() == noscript,
        Err(_) => false,
    }
}

impl RedisBackend {
    /// `WAIT wait_replicas wait_timeout`.
    pub(crate) fn wait_cmd(&self) -> redis::Cmd {
        let config = self.config();
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(config.wait_replicas)
            .arg(millis(config.wait_timeout));
        cmd
    }

    /// Runs a pipeline (with replies as values, errors included), recording where it went in `sent`;
    /// loads the scripts and sends it again if the server had not seen one (`NOSCRIPT`). `ask`: what
    /// to do with a Cluster `ASK` (see [`Ask`]): [`Ask::Follow`] only for a pipeline about one lock.
    pub(crate) async fn pipeline(
        &self,
        link: &Link,
        what: &'static str,
        timeout: Duration,
        ask: Ask,
        mut pipe: Pipeline,
        sent: &mut Sent,
    ) -> Result<Vec<Value>, RedisError> {
        let target = &self.inner.target;
        pipe.ignore_errors();
        // Borrowed by every attempt, not cloned: a renewal batch's pipeline is 10,000 commands (issue 9).
        let pipe = &pipe;
        let mut reloads = NOSCRIPT_RELOAD.start(None);
        loop {
            let result = link
                .run(
                    target,
                    what,
                    timeout,
                    ask,
                    |mut c: Conn| async move { pipe.query_async::<Vec<Value>>(&mut c).await },
                    sent,
                )
                .await;
            if !is_noscript(&result) || !reloads.wait().await {
                return result;
            }
            match &sent.conn {
                // The target of a slot migration, which the Cluster connection may not know: the
                // scripts are loaded there.
                Some(Conn::Asking(conn)) => {
                    self.load_scripts_on(Conn::Asking(conn.clone())).await?
                }
                _ => self.load_scripts(link).await?,
            }
        }
    }

    /// Loads every script on `conn`.
    async fn load_scripts_on(&self, mut conn: Conn) -> Result<(), RedisError> {
        for script in self.inner.scripts.all() {
            tokio::time::timeout(self.request_timeout(), script.load_async(&mut conn))
                .await
                .map_err(|_| RedisError::Timeout {
                    what: "SCRIPT LOAD",
                    target: self.inner.target.shown.clone(),
                    after: self.request_timeout(),
                })?
                .map_err(|e| request_error("SCRIPT LOAD", &self.inner.target, e))?;
        }
        Ok(())
    }

    /// One `SCRIPT LOAD` command per script, not a pipeline: a keyless pipeline goes to one arbitrary
    /// Cluster node, while the command is routed to every node.
    async fn load_scripts(&self, link: &Link) -> Result<(), RedisError> {
        let scripts = &self.inner.scripts;
        link.run(
            &self.inner.target,
            "SCRIPT LOAD",
            self.request_timeout(),
            Ask::Follow,
            |mut c: Conn| async move {
                for script in scripts.all() {
                    script.load_async(&mut c).await?;
                }
                Ok(())
            },
            &mut Sent::default(),
        )
        .await
    }

    /// One script call, `EVALSHA`, recording where it went in `sent`. On `NOSCRIPT` the script is
    /// loaded and the call sent once more on the same connection, as redis-rs's
    /// `ScriptInvocation::invoke_async` does.
    pub(crate) async fn script(
        &self,
        link: &Link,
        what: &'static str,
        call: ScriptCall<'_>,
        sent: &mut Sent,
    ) -> Result<Value, RedisError> {
        let call = &call;
        link.run(
            &self.inner.target,
            what,
            self.request_timeout(),
            // One script call is about one lock, whose keys Redis moves or refuses together.
            Ask::Follow,
            |mut c: Conn| async move { call.query_on(&mut c).await },
            sent,
        )
        .await
    }
}

/// `EVALSHA sha numkeys key… arg…` of one script, written straight into one command. redis-rs's
/// `ScriptInvocation` copies every key and argument into a `Vec` of its own first, then into the
/// command: about a dozen allocations per acquire and release cycle that this saves (issue 9).
pub(crate) struct ScriptCall<'a> {
    script: &'a Script,
    cmd: Cmd,
}

impl<'a> ScriptCall<'a> {
    /// A call with `numkeys` keys and `args` arguments in all (keys included) to add, about `bytes`
    /// long in all.
    pub(crate) fn new(script: &'a Script, numkeys: usize, args: usize, bytes: usize) -> Self {
        let hash = script.get_hash();
        let mut cmd = Cmd::with_capacity(3 + args, "EVALSHA".len() + hash.len() + 4 + bytes);
        cmd.arg("EVALSHA").arg(hash).arg(numkeys);
        Self { script, cmd }
    }

    /// Adds the next key or argument (keys first, in order).
    pub(crate) fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// The command, for a pipeline (whose `NOSCRIPT` [`RedisBackend::pipeline`] handles).
    pub(crate) fn into_cmd(self) -> Cmd {
        self.cmd
    }

    /// Sends the call on `conn` (no retry, no bound: the caller's), loading the script and sending it
    /// once more on the same connection after a `NOSCRIPT`, as `ScriptInvocation::invoke_async` does.
    pub(crate) async fn query_on(&self, conn: &mut Conn) -> redis::RedisResult<Value> {
        match self.cmd.query_async::<Value>(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                self.cmd.query_async::<Value>(conn).await
            }
            other => other,
        }
    }
}
