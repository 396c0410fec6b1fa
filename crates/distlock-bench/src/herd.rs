//! `--workload herd` (issue 27): N separate `distlock run` processes contend for one Redis lock, once
//! as the URL says and once in fair mode, and every top-level command they send is counted with
//! `MONITOR` (commands that scripts run are not top-level; the bench's own queries are left out). The
//! processes start one after another, each once the previous one waits (it listens on the release
//! channel, or holds its place in the fair queue), so their arrival order is known; each prints the
//! fencing token it was granted, so the grant order is known too.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use serde::Serialize;
use tokio::io::AsyncReadExt as _;

use crate::engines::{redis_failure, RedisServer};
use crate::Error;

/// Default number of processes (the issue's measurement).
pub const DEFAULT_PROCESSES: usize = 30;

/// How long one process may take to start and begin waiting, and the whole herd to drain.
const START_LIMIT: Duration = Duration::from_secs(20);
const DRAIN_LIMIT: Duration = Duration::from_secs(120);

/// Commands that set a connection up rather than lock anything (counted, and shown apart).
const SETUP: &[&str] = &[
    "hello", "client", "select", "auth", "ping", "readonly", "info",
];

/// The herd workload's figures, one run per mode.
#[derive(Debug, Serialize)]
pub struct HerdSection {
    pub processes: usize,
    pub runs: Vec<HerdRun>,
}

/// One mode's herd.
#[derive(Debug, Serialize)]
pub struct HerdRun {
    /// `default` (the URL as given) or `fair` (`fair=true` added).
    pub mode: String,
    pub handoffs: usize,
    /// Every top-level command from the processes and the first holder, after it held the lock.
    pub commands: u64,
    /// Of them, connection setup (`HELLO`, `CLIENT`, `SELECT`, `AUTH`, `PING`, `READONLY`, `INFO`):
    /// each process's own.
    pub setup_commands: u64,
    /// (commands − setup) / handoffs.
    pub lock_commands_per_handoff: f64,
    /// commands / handoffs.
    pub commands_per_handoff: f64,
    /// Top-level commands by name.
    pub by_command: BTreeMap<String, u64>,
    /// Seconds the processes spent waiting, summed (from their arrival to their exit).
    pub waiting_s: f64,
    /// The issue's budget: 3 lock commands per handoff plus one per waiter per second waited.
    pub budget_commands: f64,
    /// Pairs of processes granted in the other order than they arrived, of all pairs.
    pub inverted_pairs: usize,
    pub pairs: usize,
    /// From the first holder's release to the last process's exit.
    pub drain_s: f64,
}

/// Runs the herd on `url` (a standalone Redis) with `processes` processes, as the URL says and in
/// fair mode; `name` is the run's lock name.
pub(crate) async fn herd(
    server: &RedisServer,
    url: &str,
    name: &str,
    processes: usize,
) -> Result<HerdSection, Error> {
    let asked = distlock_core::url::LockUrl::parse(url)?
        .query("fair")
        .map(|fair| fair == "true");
    let mut runs = Vec::new();
    match asked {
        // The URL chose: that mode alone.
        Some(fair) => runs.push(one(server, url, fair, name, processes).await?),
        None => {
            runs.push(one(server, url, false, name, processes).await?);
            let sep = if url.contains('?') { '&' } else { '?' };
            let fair_url = format!("{url}{sep}fair=true");
            runs.push(one(server, &fair_url, true, name, processes).await?);
        }
    }
    Ok(HerdSection { processes, runs })
}

/// The `distlock` executable to start: `$DISTLOCK_BIN`, else this one (`distlock bench`).
fn distlock_exe() -> Result<std::path::PathBuf, Error> {
    if let Some(path) = std::env::var_os("DISTLOCK_BIN") {
        return Ok(path.into());
    }
    std::env::current_exe()
        .map_err(|e| Error::unavailable(format!("herd: cannot find the distlock executable: {e}")))
}

/// One herd on `url` (`fair` when it asks for fair mode), on a name of its own under `name`.
async fn one(
    server: &RedisServer,
    url: &str,
    fair: bool,
    name: &str,
    processes: usize,
) -> Result<HerdRun, Error> {
    let mode = if fair { "fair" } else { "default" };
    let name = &format!("{name}/{mode}");
    let exe = distlock_exe()?;
    let mut conn = server.connect().await?;
    // The bench's own connection: its queries are not the herd's.
    let own: String = redis::cmd("CLIENT")
        .arg("INFO")
        .query_async(&mut conn)
        .await
        .map_err(redis_failure)?;
    let own_addr = own
        .split_whitespace()
        .find_map(|field| field.strip_prefix("addr="))
        .unwrap_or_default()
        .to_string();
    let holder = distlock::connect(url).await?;
    let held = holder.lock(name)?.acquire().await?;

    let mut monitor = server
        .client()
        .get_async_monitor()
        .await
        .map_err(redis_failure)?
        .into_on_message::<String>();
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let collector = tokio::spawn(async move {
        let mut lines = Vec::new();
        loop {
            tokio::select! {
                line = monitor.next() => match line {
                    Some(line) => lines.push(line),
                    None => break,
                },
                _ = &mut stopped => break,
            }
        }
        lines
    });

    let mut children = Vec::with_capacity(processes);
    for i in 0..processes {
        let child = tokio::process::Command::new(&exe)
            .args([
                "run",
                "--url",
                url,
                name,
                "--",
                "sh",
                "-c",
                "echo $DISTLOCK_TOKEN",
            ])
            .env_remove("DISTLOCK_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                Error::unavailable(format!("herd: cannot start {}: {e}", exe.display()))
            })?;
        children.push((child, Instant::now()));
        let started = Instant::now();
        while waiting(&mut conn, name, fair).await? < i + 1 {
            if started.elapsed() > START_LIMIT {
                return Err(Error::unavailable(format!(
                    "herd: process {} did not begin to wait within {START_LIMIT:?}",
                    i + 1
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if let Some((_, arrived)) = children.last_mut() {
            *arrived = Instant::now();
        }
    }
    let released = Instant::now();
    held.release().await?;
    // Each process's token and when it ended, read side by side (they end in grant order, which is
    // not the order they were started in unless the mode is fair).
    let ended = futures_util::future::join_all(children.into_iter().map(
        |(mut child, arrived)| async move {
            let mut out = String::new();
            if let Some(mut stdout) = child.stdout.take() {
                let _ = stdout.read_to_string(&mut out).await;
            }
            let status = child
                .wait()
                .await
                .map_err(|e| Error::unavailable(format!("herd: waiting for a process: {e}")))?;
            let waited = arrived.elapsed().as_secs_f64();
            match out.trim().parse::<u64>() {
                Ok(token) if status.success() => Ok((token, waited)),
                _ => Err(Error::unavailable(format!(
                    "herd: a process ended with {status} and printed {out:?}, not its token"
                ))),
            }
        },
    ));
    let ended = tokio::time::timeout(DRAIN_LIMIT, ended)
        .await
        .map_err(|_| {
            Error::unavailable(format!(
                "herd: the processes did not all finish within {DRAIN_LIMIT:?}"
            ))
        })?;
    let mut tokens = Vec::with_capacity(processes);
    let mut waiting_s = 0.0;
    for outcome in ended {
        let (token, waited) = outcome?;
        tokens.push(token);
        waiting_s += waited;
    }
    let drain_s = released.elapsed().as_secs_f64();
    // The last commands reach the monitor after the processes' exit.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = stop.send(());
    let lines = collector
        .await
        .map_err(|e| Error::unavailable(format!("herd: the monitor task: {e}")))?;
    drop(holder);

    let mut by_command: BTreeMap<String, u64> = BTreeMap::new();
    for line in &lines {
        let Some((source, command)) = parse_monitor(line) else {
            continue;
        };
        if source == "lua" || source == own_addr {
            continue;
        }
        *by_command.entry(command).or_default() += 1;
    }
    let commands: u64 = by_command.values().sum();
    let setup_commands: u64 = SETUP.iter().filter_map(|c| by_command.get(*c)).sum();
    let pairs = processes * processes.saturating_sub(1) / 2;
    let inverted_pairs = (0..processes)
        .flat_map(|i| (i + 1..processes).map(move |j| (i, j)))
        .filter(|&(i, j)| tokens[i] > tokens[j])
        .count();
    let handoffs = processes.max(1);
    Ok(HerdRun {
        mode: mode.to_string(),
        handoffs,
        commands,
        setup_commands,
        lock_commands_per_handoff: (commands - setup_commands) as f64 / handoffs as f64,
        commands_per_handoff: commands as f64 / handoffs as f64,
        by_command,
        waiting_s,
        budget_commands: 3.0 * handoffs as f64 + waiting_s,
        inverted_pairs,
        pairs,
        drain_s,
    })
}

/// How many processes wait now: in the fair queue, or listening on the release channel.
async fn waiting(
    conn: &mut redis::aio::MultiplexedConnection,
    name: &str,
    fair: bool,
) -> Result<usize, Error> {
    if fair {
        let len: usize = redis::cmd("LLEN")
            .arg(distlock::redis::layout::queue_key(name))
            .query_async(conn)
            .await
            .map_err(redis_failure)?;
        return Ok(len);
    }
    let counts: Vec<(String, usize)> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(distlock::redis::layout::channel(name))
        .arg(distlock::redis::layout::plain_channel(name))
        .query_async(conn)
        .await
        .map_err(redis_failure)?;
    Ok(counts.iter().map(|(_, n)| n).sum())
}

/// A `MONITOR` line, `1700000000.123456 [0 127.0.0.1:50000] "EVALSHA" "…" …`: the client's address
/// (`lua` for a script's own commands) and the command's name, lowercased.
fn parse_monitor(line: &str) -> Option<(String, String)> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let source = line[open + 1..close].split_whitespace().nth(1)?.to_string();
    let rest = line[close + 1..].trim_start().strip_prefix('"')?;
    let command = rest.split('"').next()?.to_ascii_lowercase();
    Some((source, command))
}

/// The report's text for the herd.
pub(crate) fn render(o: &mut String, h: &HerdSection) {
    use std::fmt::Write as _;
    let _ = writeln!(
        o,
        "\nherd: {} separate `distlock run` processes on one name, top-level commands counted with MONITOR",
        h.processes
    );
    for r in &h.runs {
        let commands: Vec<String> = r
            .by_command
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect();
        let _ = writeln!(
            o,
            "  {:<7} {:.1} lock commands per handoff ({:.1} with connection setup); {} of {} pairs granted out of arrival order; waited {:.1} process-s; drained in {:.2} s",
            r.mode,
            r.lock_commands_per_handoff,
            r.commands_per_handoff,
            r.inverted_pairs,
            r.pairs,
            r.waiting_s,
            r.drain_s,
        );
        let _ = writeln!(
            o,
            "          budget (3 per handoff + 1 per waiter-second): {:.0} commands, used {} ({}); {}",
            r.budget_commands,
            r.commands - r.setup_commands,
            if ((r.commands - r.setup_commands) as f64) <= r.budget_commands {
                "within"
            } else {
                "over"
            },
            commands.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::parse_monitor;

    #[test]
    fn monitor_lines_give_their_source_and_command() {
        assert_eq!(
            parse_monitor(r#"1700000000.123456 [0 127.0.0.1:50000] "EVALSHA" "abc" "4""#),
            Some(("127.0.0.1:50000".into(), "evalsha".into()))
        );
        assert_eq!(
            parse_monitor(r#"1700000000.123456 [0 lua] "incr" "redisson_lock_token:{x}""#),
            Some(("lua".into(), "incr".into()))
        );
        assert_eq!(parse_monitor("OK"), None);
    }
}
