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
    // The image's path is tried before the run, so a typo does not cost a whole sweep.
    let plot = match &args.options.plot {
        Some(path) => Some(Plot::create(path)?),
        None => None,
    };
    let report = distlock_bench::bench(url, &args.options).await?;
    if let Some(plot) = plot {
        plot.write(distlock_bench::plot_svg(&report).unwrap_or_default())?;
    }
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

/// The `--plot` file: created (empty) before the run, written after it, removed if the run fails.
struct Plot {
    path: std::path::PathBuf,
    file: Option<std::fs::File>,
    written: bool,
}

impl Plot {
    fn create(path: &std::path::Path) -> Result<Self, Failure> {
        let file = std::fs::File::create(path).map_err(|e| {
            Failure::new(
                Code::Usage,
                format!("cannot write the plot to {}: {e}", path.display()),
            )
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            file: Some(file),
            written: false,
        })
    }

    fn write(mut self, svg: String) -> Result<(), Failure> {
        let written = match self.file.take() {
            Some(mut file) => file
                .write_all(svg.as_bytes())
                .and_then(|()| file.sync_all()),
            None => Ok(()),
        };
        written.map_err(|e| {
            Failure::new(
                Code::Unavailable,
                format!("cannot write the plot to {}: {e}", self.path.display()),
            )
        })?;
        self.written = true;
        Ok(())
    }
}

impl Drop for Plot {
    fn drop(&mut self) {
        if !self.written {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
