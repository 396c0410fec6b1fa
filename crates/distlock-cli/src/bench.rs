//! `distlock bench`: the measuring lives in the `distlock-bench` crate; this is the command's part
//! (the URL, the runtime, the output and the exit code).

use std::io::Write as _;

use crate::cli::{self, BenchArgs};
use crate::exit::{Code, Failure};

/// The runtime `distlock bench` runs on (the shape its peers were measured with).
pub fn runtime_builder() -> tokio::runtime::Builder {
    distlock_bench::runtime_builder()
}

/// Runs `distlock bench`; `Ok` is the exit code.
pub async fn bench(args: BenchArgs) -> Result<i32, Failure> {
    if args.options.duration.is_zero() {
        return Err(Failure::new(Code::Usage, "--duration must be more than 0"));
    }
    let url = cli::lock_url(args.url.as_deref())?;
    let report = distlock_bench::bench(url, &args.options).await?;
    let text = if args.options.json {
        report.to_json()?
    } else {
        distlock_bench::render(&report)
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(Failure::new(
            Code::Unavailable,
            format!("cannot write the report: {e}"),
        )),
    }
}
