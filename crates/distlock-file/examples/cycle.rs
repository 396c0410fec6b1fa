//! Measures uncontended acquire + release cycles of the file backend, with and without `fdatasync`
//! (DESIGN §8 workload (a)). Run it in release mode, on the file system you care about:
//!
//! ```text
//! cargo run --release -p distlock-file --example cycle -- [DIR] [CYCLES]
//! ```
#![allow(clippy::print_stdout)] // a measuring tool: its output is the point

use std::time::{Duration, Instant};

use distlock_core::Locks;
use distlock_file::{FileBackend, FileConfig};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let temp;
    let dir = match args.next() {
        Some(dir) => std::path::PathBuf::from(dir),
        None => {
            temp = tempfile::tempdir()?;
            temp.path().to_path_buf()
        }
    };
    let cycles: usize = args.next().map_or(Ok(2000), |n| n.parse())?;
    println!("dir {} ({cycles} cycles each)", dir.display());
    for sync in [true, false] {
        let locks = Locks::new(FileBackend::from_config(
            FileConfig::new(&dir).with_sync(sync),
        )?);
        let lock = locks.lock(if sync { "cycle-sync" } else { "cycle-nosync" })?;
        for _ in 0..cycles / 10 {
            lock.acquire().await?.release().await?;
        }
        let mut samples = Vec::with_capacity(cycles);
        let start = Instant::now();
        for _ in 0..cycles {
            let t = Instant::now();
            lock.acquire().await?.release().await?;
            samples.push(t.elapsed());
        }
        let total = start.elapsed();
        samples.sort();
        let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
        println!(
            "fdatasync {:<5}  p50 {:>9}  p99 {:>9}  {:>8.0} cycles/s",
            sync,
            show(pct(0.50)),
            show(pct(0.99)),
            cycles as f64 / total.as_secs_f64()
        );
    }
    Ok(())
}

fn show(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}
