//! Runs the contended workload of DESIGN §8 (c) alone — TASKS tasks (default 8) of one `Locks` on one
//! name, each holding it HOLD_MS (default 1) with a thread sleep, ACQUISITIONS in all (default 2000) —
//! so that the server's request counters can be read around it (issue 9: requests per acquisition;
//! diff `curl -s http://HOST:PORT/metrics | grep grpc_server_started_total` before and after).
//!
//! ```text
//! cargo run --release -p distlock-etcd --example contended -- etcd://127.0.0.1:2379 [ACQUISITIONS] [TASKS] [HOLD_MS] [per-task]
//! ```
//!
//! With `per-task`, each task has a backend (session) and `Locks` of its own, so the tasks queue on
//! the server (etcd's key-per-waiter queue) instead of in one `Locks`'s local gate.
#![allow(clippy::print_stdout)] // a measuring tool: its output is the point

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock_core::url::LockUrl;
use distlock_core::Locks;
use distlock_etcd::EtcdBackend;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = args
        .first()
        .ok_or("usage: URL [ACQUISITIONS] [TASKS] [HOLD_MS]")?;
    let total: usize = args.get(1).map_or(Ok(2000), |n| n.parse())?;
    let tasks: usize = args.get(2).map_or(Ok(8), |n| n.parse())?;
    let hold = Duration::from_millis(args.get(3).map_or(Ok(1), |n| n.parse())?);
    let per_task = args.get(4).is_some_and(|a| a == "per-task");
    let url = LockUrl::parse(url)?;
    let connect = || async {
        let backend = EtcdBackend::connect(&url).await?;
        Ok::<_, BoxError>(Arc::new(Locks::with_defaults(
            backend.clone(),
            backend.default_options(),
        )))
    };
    let shared = connect().await?;
    let name = format!("contended-{}", std::process::id());
    let start = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let locks = if per_task {
            connect().await?
        } else {
            shared.clone()
        };
        let name = name.clone();
        handles.push(tokio::spawn(async move {
            let lock = locks.lock(&name)?;
            for _ in 0..total / tasks {
                let guard = lock.acquire().await?;
                std::thread::sleep(hold);
                guard.release().await?;
            }
            Ok::<_, BoxError>(())
        }));
    }
    for handle in handles {
        handle.await??;
    }
    let done = total / tasks * tasks;
    println!(
        "{done} acquisitions in {:.2} s: {:.0}/s",
        start.elapsed().as_secs_f64(),
        done as f64 / start.elapsed().as_secs_f64()
    );
    Ok(())
}
