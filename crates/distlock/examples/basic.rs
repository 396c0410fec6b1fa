//! Two workers in one process take turns on a lock in a directory, each fencing its writes with the
//! token it was granted; a stale token is refused by the "resource".
//!
//! `cargo run -p distlock --example basic [DIR]`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A resource that remembers the highest token it accepted and refuses lower ones.
#[derive(Default)]
struct FencedStore {
    high_water: AtomicU64,
}

impl FencedStore {
    fn write(&self, token: distlock::FencingToken, what: &str) -> Result<(), String> {
        let previous = self.high_water.fetch_max(token.get(), Ordering::SeqCst);
        if token.get() < previous {
            return Err(format!("refused {what:?}: token {token} < {previous}"));
        }
        eprintln!("accepted {what:?} with token {token}");
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = match std::env::args().nth(1) {
        Some(dir) => std::path::PathBuf::from(dir),
        None => std::env::temp_dir().join(format!("distlock-example-{}", std::process::id())),
    };
    let locks = distlock::connect(&format!("file://{}", dir.display())).await?;
    let store = Arc::new(FencedStore::default());

    let mut workers = Vec::new();
    for worker in 0..2 {
        let lock = locks.lock("example/report")?;
        let store = store.clone();
        workers.push(tokio::spawn(async move {
            for round in 0..2 {
                let guard = lock.options().wait(Duration::from_secs(10)).acquire().await?;
                let token = guard.token().ok_or("the file backend mints tokens")?;
                tokio::select! {
                    written = async {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        store.write(token, &format!("worker {worker}, round {round}"))
                    } => written?,
                    _ = guard.lost() => return Err(format!("lost: {:?}", guard.loss_reason()).into()),
                }
                guard.release().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for worker in workers {
        worker.await?.map_err(|e| e.to_string())?;
    }
    // A holder that was superseded would present an older token: the resource refuses it.
    let stale = distlock::FencingToken::new(1);
    assert!(store.write(stale, "a superseded holder's write").is_err());
    eprintln!("ok: 4 fenced writes accepted, the stale one refused");
    Ok(())
}
