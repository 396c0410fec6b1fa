//! distlock's metrics for Prometheus: install a recorder (here `metrics-exporter-prometheus`, serving
//! `/metrics` on a loopback port) before making the `Locks`, then take locks as usual. distlock only
//! records through the `metrics` facade; the exporter is the application's choice.
//!
//! `cargo run -p distlock --example metrics [ADDR] [DIR]` (ADDR: 127.0.0.1:9898 by default), then
//! `curl -s http://127.0.0.1:9898/metrics | grep ^distlock_`. Ctrl-C stops it.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Installs the Prometheus recorder with its HTTP listener on `addr` (on the current runtime), with
/// histogram buckets for distlock's `_seconds` series (without them the exporter writes summaries).
pub fn install_prometheus(addr: SocketAddr) -> Result<(), Box<dyn std::error::Error>> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Prefix("distlock_".into()),
            &[0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 60.0, 600.0],
        )?
        .install()?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = match std::env::args().nth(1) {
        Some(addr) => addr.parse()?,
        None => "127.0.0.1:9898".parse()?,
    };
    let dir = match std::env::args().nth(2) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::env::temp_dir().join(format!("distlock-metrics-{}", std::process::id())),
    };
    // First the recorder, then the `Locks`: handles made before a recorder exists record nothing.
    install_prometheus(addr)?;
    let locks = distlock::connect(&format!("file://{}", dir.display())).await?;
    eprintln!("serving http://{addr}/metrics; Ctrl-C stops");
    let lock = locks.lock("example/metrics")?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            guard = lock.acquire() => {
                let guard = guard?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                guard.release().await?;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
