//! The progress bar on stderr: one bar over all measurements, advanced by time (a measurement runs
//! for a fixed duration), hidden when stderr is not a terminal.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// The bar and the measurement under way.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    step: Arc<Mutex<Step>>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

#[derive(Debug)]
struct Step {
    index: u64,
    started: Instant,
}

impl Progress {
    /// A bar over `steps` measurements of `per_step` each (plus their warm-ups, which the bar
    /// absorbs).
    pub fn new(steps: usize, per_step: Duration) -> Self {
        let per_step_ms = u64::try_from(per_step.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let total = per_step_ms.saturating_mul(steps as u64);
        let bar = if std::io::stderr().is_terminal() {
            ProgressBar::new(total)
        } else {
            ProgressBar::hidden()
        };
        if let Ok(style) =
            ProgressStyle::with_template("{prefix:>7} [{bar:30}] {elapsed_precise} {msg}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        let step = Arc::new(Mutex::new(Step {
            index: 0,
            started: Instant::now(),
        }));
        let ticker = (!bar.is_hidden()).then(|| {
            let bar = bar.clone();
            let step = step.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tick.tick().await;
                    let Ok(step) = step.lock() else { return };
                    let elapsed = u64::try_from(step.started.elapsed().as_millis())
                        .unwrap_or(u64::MAX)
                        .min(per_step_ms);
                    bar.set_position(step.index.saturating_mul(per_step_ms) + elapsed);
                }
            })
        });
        Self { bar, step, ticker }
    }

    /// Announces the next measurement.
    pub fn step(&self, index: usize, total: usize, label: &str) {
        if let Ok(mut step) = self.step.lock() {
            step.index = index as u64;
            step.started = Instant::now();
        }
        self.bar.set_prefix(format!("{}/{}", index + 1, total));
        self.bar.set_message(label.to_string());
    }

    /// Removes the bar before the report is printed.
    pub fn finish(&mut self) {
        if let Some(ticker) = self.ticker.take() {
            ticker.abort();
        }
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
