//! `distlock break`: end another holder's hold of a lock, after showing it and asking, with one audit
//! line.

use std::io::{BufRead as _, IsTerminal as _, Write as _};
use std::time::SystemTime;

use crate::cli::{self, BreakArgs};
use crate::exit::{self, Code, Failure};
use crate::progress::holder_text;

/// Runs `distlock break`; `Ok` is the exit code: 0 when the holder shown was broken (or the lock was
/// free), 75 when the lock is still held (the question was declined, or another holder took it since).
pub async fn break_lock(args: BreakArgs) -> Result<i32, Failure> {
    distlock_core::name::validate(&args.name)?;
    let url = cli::lock_url(args.url.as_deref())?;
    let locks = distlock::connect(&url).await?;
    let name = &args.name;
    let info = locks.inspect(name).await?;
    let Some(holder) = info.holder else {
        if info.holders.is_empty() {
            exit::report(format_args!("lock {name:?} is free: nothing to break"));
            return Ok(0);
        }
        return Err(Failure::new(
            Code::Unavailable,
            format!(
                "lock {name:?} is held by {} shared holders (readers or permits): break ends an exclusive holder only",
                info.holders.len()
            ),
        ));
    };
    // Escaped: an owner id or host comes from the server and could hold terminal control sequences.
    let mut shown = crate::status::one_line(&holder_text(&holder, SystemTime::now()));
    // Where the engine keeps no token with the hold (Redis), the name's last token is the one its
    // grant minted, unless the hold came from a client that mints none: said as what it is.
    if let (None, Some(last)) = (holder.token, info.last_token) {
        shown.push_str(&format!(
            "; last token {last} (the name's: the engine keeps none with the hold)"
        ));
    }
    if !args.yes {
        // The question goes to stderr and the answer comes from stdin: both must be a person's.
        if !std::io::stdin().is_terminal() || !std::io::stderr().is_terminal() {
            return Err(Failure::new(
                Code::Usage,
                format!(
                    "lock {name:?} is held by {shown}; not broken: no terminal to ask on (stdin and stderr must be one; pass --yes)"
                ),
            ));
        }
        if !confirmed(name, &shown).await {
            exit::report(format_args!("lock {name:?} not broken"));
            return Ok(Code::Busy.as_i32());
        }
    }
    let broken = match locks.break_holder(name, &holder).await {
        Ok(broken) => broken,
        Err(error) => {
            if error.kind() == distlock::ErrorKind::Unavailable {
                // The request may have reached the engine: audited as what it may have done.
                exit::report(format_args!(
                    "break of lock {name:?} on {}: outcome unknown, the hold of {shown} may have been ended; by {} at {}",
                    locks.backend_kind(),
                    operator(),
                    now_rfc3339()
                ));
            }
            return Err(error.into());
        }
    };
    if !broken {
        return Err(Failure::new(
            Code::Busy,
            format!(
                "lock {name:?}: the holder shown ({shown}) no longer holds it (released, expired, or another holder took it since): nothing was broken; run `distlock status` to see the holder now"
            ),
        ));
    }
    let owner = holder
        .owner
        .as_deref()
        .map(|o| format!(", owner {}", crate::status::one_line(o)))
        .unwrap_or_default();
    exit::report(format_args!(
        "broke lock {name:?} on {}: ended the hold of {shown}{owner}; by {} at {}",
        locks.backend_kind(),
        operator(),
        now_rfc3339()
    ));
    Ok(0)
}

/// Asks on the terminal; only `y` or `yes` breaks. The answer is read on a blocking thread: the
/// runtime's one thread keeps the connection's keep-alives going while the operator thinks (a slow
/// answer must not expire a ZooKeeper session or an etcd lease of the break's own connection).
async fn confirmed(name: &str, shown: &str) -> bool {
    let mut stderr = std::io::stderr().lock();
    let _ = write!(
        stderr,
        "distlock: lock {name:?} is held by {shown}.\nBreak it? Its work may still be running. [y/N] "
    );
    let _ = stderr.flush();
    drop(stderr);
    let answer = tokio::task::spawn_blocking(|| {
        let mut answer = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut answer)
            .map(|_| answer)
    })
    .await;
    match answer {
        Ok(Ok(answer)) => matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes"),
        _ => false,
    }
}

/// Who broke it: `user@host (pid N)`.
fn operator() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| format!("uid {}", rustix::process::getuid().as_raw()));
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    format!("{user}@{host} (pid {})", std::process::id())
}

/// Now, as RFC 3339 UTC to the second.
fn now_rfc3339() -> String {
    crate::status::rfc3339(SystemTime::now()).unwrap_or_else(|| "an unknown time".into())
}
