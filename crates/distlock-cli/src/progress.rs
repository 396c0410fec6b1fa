//! The progress line of a long wait: on a terminal, `distlock run` says whom it waits for and for how
//! long, in one line rewritten in place; without a terminal it prints nothing extra.

use std::fmt::Write as _;
use std::future::Future;
use std::io::{IsTerminal, Write as _};
use std::time::{Duration, SystemTime};

use distlock::{HolderInfo, LockInfo, Locks};

/// How long a wait goes before the line appears: quick acquires print nothing.
const FIRST_SHOWN: Duration = Duration::from_secs(1);
/// The line is rewritten this often (its seconds count up).
const REDRAW: Duration = Duration::from_secs(1);
/// The holder is looked up again this often (one read on the engine; the wait itself is woken by the
/// engine's notification, not by this).
const LOOK_AGAIN: Duration = Duration::from_secs(3);
/// A look-up slower than this is dropped (the line then says nothing of the holder).
const LOOK_LIMIT: Duration = Duration::from_secs(2);

/// Runs the acquire `wait`, showing the progress line on standard error while it lasts if that is a
/// terminal; the line is erased when the wait ends.
pub async fn while_waiting<F: Future>(locks: &Locks, name: &str, wait: F) -> F::Output {
    if !std::io::stderr().is_terminal() {
        return wait.await;
    }
    let mut wait = std::pin::pin!(wait);
    let started = tokio::time::Instant::now();
    let mut redraw = tokio::time::interval_at(started + FIRST_SHOWN, REDRAW);
    let mut holder: Option<LockInfo> = None;
    let mut next_look = started + FIRST_SHOWN;
    // Erases the line when the wait ends, also when this future is dropped (a signal ended the wait).
    let mut shown = Shown(false);
    loop {
        tokio::select! {
            out = &mut wait => return out,
            _ = redraw.tick() => {}
        }
        let now = tokio::time::Instant::now();
        if now >= next_look {
            next_look = now + LOOK_AGAIN;
            // Raced with the wait, so a grant is not held up by the look-up.
            tokio::select! {
                out = &mut wait => return out,
                looked = tokio::time::timeout(LOOK_LIMIT, locks.inspect(name)) => {
                    holder = looked.ok().and_then(Result::ok);
                }
            }
        }
        draw(&line(
            name,
            now - started,
            holder.as_ref(),
            SystemTime::now(),
        ));
        shown.0 = true;
    }
}

/// Whether the line is on the terminal: dropped, it erases it.
struct Shown(bool);

impl Drop for Shown {
    fn drop(&mut self) {
        if self.0 {
            let mut stderr = std::io::stderr().lock();
            let _ = write!(stderr, "\r\x1b[K");
            let _ = stderr.flush();
        }
    }
}

/// The line: `distlock: waiting 12s for "NAME": held by pid 42 on HOST (token 7, for 3m05s, lease 20s
/// left)`, with what the engine told of the holder (its owner id where it tells no pid).
///
/// ```
/// use std::time::{Duration, SystemTime};
/// let mut info = distlock::LockInfo::default();
/// let mut holder = distlock::HolderInfo::default();
/// holder.owner = Some("7f0c:1".into());
/// holder.token = Some(distlock::FencingToken::new(7));
/// holder.pid = Some(42);
/// info.holder = Some(holder);
/// let text = distlock_cli::progress::line("nightly", Duration::from_secs(12), Some(&info), SystemTime::now());
/// assert_eq!(text, "distlock: waiting 12s for \"nightly\": held by pid 42 (token 7)");
/// ```
pub fn line(name: &str, waited: Duration, info: Option<&LockInfo>, now: SystemTime) -> String {
    let mut out = format!("distlock: waiting {} for {name:?}", short(waited));
    let Some(info) = info else {
        return out;
    };
    if let Some(holder) = &info.holder {
        let _ = write!(out, ": held by {}", holder_text(holder, now));
    } else if !info.holders.is_empty() {
        let _ = write!(out, ": held by {} shared holders", info.holders.len());
    }
    if let Some(waiters) = info.waiters.filter(|w| *w > 0) {
        let _ = write!(out, "; {waiters} waiting");
    }
    out
}

/// Who a holder is and what the engine told of it: `pid 42 on HOST (token 7, for 3m05s, lease 20s
/// left)`; its owner id where the engine tells no pid (a pid and host say more to a person than an
/// owner id `<uuid>:<n>`, and are shorter).
pub fn holder_text(holder: &HolderInfo, now: SystemTime) -> String {
    let mut out = match (holder.pid, &holder.host, &holder.owner) {
        (Some(pid), Some(host), _) => format!("pid {pid} on {host}"),
        (Some(pid), None, _) => format!("pid {pid}"),
        (None, Some(host), Some(owner)) => format!("{owner} on {host}"),
        (None, None, Some(owner)) => owner.clone(),
        (None, Some(host), None) => format!("a process on {host}"),
        (None, None, None) => "another owner".into(),
    };
    let mut details = Vec::new();
    if let Some(token) = holder.token {
        details.push(format!("token {token}"));
    }
    if let Some(held) = holder
        .since
        .and_then(|since| now.duration_since(since).ok())
    {
        details.push(format!("for {}", short(held)));
    }
    if let Some(remaining) = holder.remaining_lease {
        details.push(format!("lease {} left", short(remaining)));
    }
    if !details.is_empty() {
        let _ = write!(out, " ({})", details.join(", "));
    }
    out
}

/// Rewrites the terminal line with `text`, cut to the terminal's width (a wrapped line could not be
/// rewritten in place). Control characters of a name are escaped.
fn draw(text: &str) {
    let width = width().unwrap_or(80).saturating_sub(1).max(20);
    let shown: String = text
        .chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .take(width)
        .collect();
    let mut stderr = std::io::stderr().lock();
    let _ = write!(stderr, "\r\x1b[K{shown}");
    let _ = stderr.flush();
}

/// The terminal's width in columns, if standard error is one that says.
fn width() -> Option<usize> {
    // SAFETY: an all-zero `winsize` is valid; TIOCGWINSZ only writes one into it.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: the ioctl reads the descriptor's window size into `size`, which outlives the call.
    let done = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut size) };
    (done == 0 && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

/// Whole seconds, minutes or hours: `45s`, `3m05s`, `2h03m`.
fn short(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_what_the_engine_told() {
        let now = SystemTime::now();
        let waited = Duration::from_millis(65_400);
        assert_eq!(
            line("n", waited, None, now),
            "distlock: waiting 1m05s for \"n\""
        );
        let mut info = LockInfo::default();
        let mut holder = distlock::HolderInfo::default();
        holder.pid = Some(9);
        holder.host = Some("build-3".into());
        holder.since = now.checked_sub(Duration::from_secs(90));
        holder.remaining_lease = Some(Duration::from_millis(20_900));
        info.holder = Some(holder);
        info.waiters = Some(2);
        assert_eq!(
            line("n", waited, Some(&info), now),
            "distlock: waiting 1m05s for \"n\": held by pid 9 on build-3 (for 1m30s, lease 20s left); 2 waiting"
        );
        let mut readers = LockInfo::default();
        readers.holders = vec![distlock::HolderInfo::default(); 3];
        assert_eq!(
            line("n", waited, Some(&readers), now),
            "distlock: waiting 1m05s for \"n\": held by 3 shared holders"
        );
    }
}
