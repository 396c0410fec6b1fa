//! `distlock status`: what the lock service knows about a lock, as stable `key: value` lines.
//!
//! Lines, in this order, each only when the engine knows the value: `name`, `backend`, `kind`
//! (`mutex`, `write`, `read`, `semaphore` with `permits: N`; only while held, where the engine tells),
//! `state` (`held` or `free`), then for an exclusive holder `token`, `owner`, `pid`, `host`, `since`
//! (RFC 3339, UTC), `held_for`, `remaining_lease`; for readers and permit holders, per holder a
//! `holder: OWNER` line (and `permit: P`) followed by the same fields; then `last_token`, `waiters` and, for Redlock, one `node: ADDRESS OWNER PTTL`
//! (or `ADDRESS free`, `ADDRESS error …`) per node. Control characters in values are
//! escaped so every record stays one line. With `--json`, the same as one JSON object ([`render_json`]).

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use distlock::LockInfo;

use crate::cli::{self, StatusArgs};
use crate::exit::{Code, Failure};

/// Runs `distlock status`; `Ok` is the exit code (0: the service could tell, held or free).
pub async fn status(args: StatusArgs) -> Result<i32, Failure> {
    distlock_core::name::validate(&args.name)?;
    let url = cli::lock_url(args.url.as_deref())?;
    let locks = distlock::connect(&url).await?;
    let info = locks.inspect(&args.name).await?;
    let text = if args.json {
        render_json(&args.name, locks.backend_kind(), &info, SystemTime::now())
    } else {
        render(&args.name, locks.backend_kind(), &info, SystemTime::now())
    };
    // The one place the CLI writes to stdout.
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        // A reader that stopped early (`| head -1`) got what it wanted.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(Failure::new(
            Code::Unavailable,
            format!("cannot write the status: {e}"),
        )),
    }
}

/// The status text; `now` is only used for `held_for`.
pub fn render(name: &str, backend: &str, info: &LockInfo, now: SystemTime) -> String {
    let mut out = String::new();
    let mut line = |key: &str, value: &str| {
        let _ = writeln!(out, "{key}: {}", one_line(value));
    };
    line("name", name);
    line("backend", backend);
    let (kind, permits) = kind_of(info);
    if let Some(kind) = kind {
        line("kind", kind);
    }
    if let Some(permits) = permits {
        line("permits", &permits.to_string());
    }
    line("state", state_of(info));
    if let Some(holder) = &info.holder {
        holder_lines(&mut line, holder, now);
    }
    // Readers or permit holders: one `holder: …` line each, then its fields as `key: value` under it.
    for holder in &info.holders {
        let who = match (&holder.owner, holder.pid) {
            (Some(owner), _) => owner.clone(),
            (None, Some(pid)) => format!("pid {pid}"),
            (None, None) => "unknown".to_string(),
        };
        line("holder", &who);
        if let Some(permit) = &holder.permit {
            line("permit", permit);
        }
        holder_lines(&mut line, holder, now);
    }
    if let Some(token) = info.last_token {
        line("last_token", &token.to_string());
    }
    if let Some(waiters) = info.waiters {
        line("waiters", &waiters.to_string());
    }
    // Quorum backends (Redlock): one line per node, `node: ADDR OWNER|free [pttl]` or its error.
    for node in &info.nodes {
        let what = match (&node.error, &node.owner) {
            (Some(error), _) => format!("error {error}"),
            (None, Some(owner)) => match node.remaining_lease {
                Some(pttl) => format!("{owner} {}", distlock_core::duration::format(pttl)),
                None => format!("{owner} no-expiry"),
            },
            (None, None) => "free".to_string(),
        };
        line("node", &format!("{} {what}", node.address));
    }
    out
}

/// The status as one JSON object and a newline: every field always present (`null`, or an empty
/// list, where the engine cannot tell), times as RFC 3339 (`since`) and milliseconds (`held_for_ms`,
/// `remaining_lease_ms`).
///
/// ```
/// use std::time::SystemTime;
/// let info = distlock::LockInfo::default();
/// let json = distlock_cli::status::render_json("nightly", "file", &info, SystemTime::now());
/// let v: serde_json::Value = serde_json::from_str(&json).unwrap();
/// assert_eq!(v["name"], "nightly");
/// assert_eq!(v["state"], "free");
/// assert!(v["holder"].is_null() && v["waiters"].is_null());
/// ```
pub fn render_json(name: &str, backend: &str, info: &LockInfo, now: SystemTime) -> String {
    use serde_json::{json, Value};
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let holder = |h: &distlock::HolderInfo| {
        json!({
            "token": h.token.map(|t| t.get()),
            "owner": h.owner,
            "pid": h.pid,
            "host": h.host,
            "permit": h.permit,
            "since": h.since.and_then(rfc3339),
            "held_for_ms": h.since.and_then(|s| now.duration_since(s).ok()).map(millis),
            "remaining_lease_ms": h.remaining_lease.map(millis),
        })
    };
    let (kind, permits) = kind_of(info);
    let nodes: Vec<Value> = info
        .nodes
        .iter()
        .map(|n| {
            json!({
                "address": n.address,
                "owner": n.owner,
                "remaining_lease_ms": n.remaining_lease.map(millis),
                "error": n.error,
            })
        })
        .collect();
    let object = json!({
        "name": name,
        "backend": backend,
        "kind": kind,
        "permits": permits,
        "state": state_of(info),
        "holder": info.holder.as_ref().map(holder),
        "holders": info.holders.iter().map(holder).collect::<Vec<_>>(),
        "last_token": info.last_token.map(|t| t.get()),
        "waiters": info.waiters,
        "nodes": nodes,
    });
    let mut text = object.to_string();
    text.push('\n');
    text
}

/// The kind as `status` names it (a permit's is `semaphore`, with its number of permits).
fn kind_of(info: &LockInfo) -> (Option<&'static str>, Option<u32>) {
    match info.kind {
        Some(distlock::LockKind::Permit { limit }) => (Some("semaphore"), Some(limit)),
        Some(kind) => (Some(kind.as_str()), None),
        None => (None, None),
    }
}

/// `held` while anyone holds the name, else `free`.
fn state_of(info: &LockInfo) -> &'static str {
    if info.holder.is_some() || !info.holders.is_empty() {
        "held"
    } else {
        "free"
    }
}

/// One holder's fields, each only when the engine knows it.
fn holder_lines(line: &mut impl FnMut(&str, &str), holder: &distlock::HolderInfo, now: SystemTime) {
    if let Some(token) = holder.token {
        line("token", &token.to_string());
    }
    if let Some(owner) = &holder.owner {
        line("owner", owner);
    }
    if let Some(pid) = holder.pid {
        line("pid", &pid.to_string());
    }
    if let Some(host) = &holder.host {
        line("host", host);
    }
    if let Some(since) = holder.since {
        if let Some(text) = rfc3339(since) {
            line("since", &text);
        }
        if let Ok(held) = now.duration_since(since) {
            line("held_for", &distlock_core::duration::format(held));
        }
    }
    if let Some(remaining) = holder.remaining_lease {
        line(
            "remaining_lease",
            &distlock_core::duration::format(remaining),
        );
    }
}

/// Escapes control characters (a name may hold a newline) so a value cannot break the line format.
pub(crate) fn one_line(value: &str) -> String {
    value
        .chars()
        .fold(String::with_capacity(value.len()), |mut s, c| {
            if c.is_control() {
                s.extend(c.escape_default());
            } else {
                s.push(c);
            }
            s
        })
}

/// `2024-05-01T12:34:56Z`, without a date-time dependency.
pub(crate) fn rfc3339(time: SystemTime) -> Option<String> {
    let secs = time.duration_since(UNIX_EPOCH).ok()?.as_secs();
    let days = i64::try_from(secs / 86_400).ok()?;
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use distlock::FencingToken;
    use distlock::HolderInfo;

    use super::*;

    #[test]
    fn free_lock() {
        let mut info = LockInfo::default();
        info.last_token = Some(FencingToken::new(4));
        let text = render("a\nb", "file", &info, SystemTime::now());
        assert_eq!(
            text,
            "name: a\\nb\nbackend: file\nstate: free\nlast_token: 4\n"
        );
    }

    #[test]
    fn held_lock() {
        let since = UNIX_EPOCH + Duration::from_secs(1_714_566_896);
        let mut holder = HolderInfo::default();
        holder.token = Some(FencingToken::new(5));
        holder.pid = Some(42);
        holder.since = Some(since);
        holder.remaining_lease = Some(Duration::from_millis(1500));
        let mut info = LockInfo::default();
        info.holder = Some(holder);
        info.waiters = Some(2);
        let text = render("x", "memory", &info, since + Duration::from_secs(3));
        assert_eq!(
            text,
            "name: x\nbackend: memory\nstate: held\ntoken: 5\npid: 42\nsince: 2024-05-01T12:34:56Z\n\
             held_for: 3s\nremaining_lease: 1.5s\nwaiters: 2\n"
        );
    }

    #[test]
    fn redlock_nodes() {
        let mut info = LockInfo::default();
        let mut held = distlock::NodeInfo::new("h1:1");
        held.owner = Some("o".into());
        held.remaining_lease = Some(Duration::from_millis(2500));
        let mut down = distlock::NodeInfo::new("h3:3");
        down.error = Some("refused".into());
        info.nodes = vec![held, distlock::NodeInfo::new("h2:2"), down];
        let text = render("x", "redlock", &info, SystemTime::now());
        assert_eq!(
            text,
            "name: x\nbackend: redlock\nstate: free\nnode: h1:1 o 2.5s\nnode: h2:2 free\nnode: h3:3 error refused\n"
        );
    }

    #[test]
    fn json_of_a_held_lock_and_of_redlock_nodes() {
        let since = UNIX_EPOCH + Duration::from_secs(1_714_566_896);
        let mut holder = HolderInfo::default();
        holder.token = Some(FencingToken::new(5));
        holder.owner = Some("o:1".into());
        holder.since = Some(since);
        holder.remaining_lease = Some(Duration::from_millis(1500));
        let mut info = LockInfo::default();
        info.kind = Some(distlock::LockKind::Mutex);
        info.holder = Some(holder);
        info.waiters = Some(2);
        info.last_token = Some(FencingToken::new(5));
        let mut down = distlock::NodeInfo::new("h3:3");
        down.error = Some("refused".into());
        info.nodes = vec![down];
        let json = render_json("x\ny", "redis", &info, since + Duration::from_secs(3));
        assert!(json.ends_with('\n') && json.lines().count() == 1, "{json}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["name"], "x\ny");
        assert_eq!(
            (v["kind"].as_str(), v["state"].as_str()),
            (Some("mutex"), Some("held"))
        );
        assert_eq!(v["holder"]["token"], 5);
        assert_eq!(v["holder"]["owner"], "o:1");
        assert_eq!(v["holder"]["since"], "2024-05-01T12:34:56Z");
        assert_eq!(v["holder"]["held_for_ms"], 3000);
        assert_eq!(v["holder"]["remaining_lease_ms"], 1500);
        assert!(v["holder"]["pid"].is_null());
        assert_eq!(
            (v["waiters"].as_u64(), v["last_token"].as_u64()),
            (Some(2), Some(5))
        );
        assert_eq!(v["nodes"][0]["error"], "refused");
        let mut permits = LockInfo::default();
        permits.kind = Some(distlock::LockKind::Permit { limit: 4 });
        let v: serde_json::Value =
            serde_json::from_str(&render_json("p", "file", &permits, SystemTime::now())).unwrap();
        assert_eq!(
            (v["kind"].as_str(), v["permits"].as_u64()),
            (Some("semaphore"), Some(4))
        );
        assert_eq!(v["holders"], serde_json::json!([]));
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)).as_deref(),
            Some("2000-02-29T00:00:00Z")
        );
    }
}
