//! Background tasks that must notice when they are gone. A task spawned on a runtime is dropped
//! with that runtime, without running to its end; the backend outlives runtimes (a `Locks` may be
//! used from one runtime after another), so each of its tasks carries a flag that turns false when
//! its future is dropped, however that happens, and the backend starts it again on the current
//! runtime when it finds the flag false.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::task::AbortHandle;

/// Turns its flag false when dropped (with the future that owns it).
struct AliveFlag(Arc<AtomicBool>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// A spawned background task: whether its future still exists, and how to stop it.
#[derive(Debug)]
pub(crate) struct Task {
    alive: Arc<AtomicBool>,
    abort: AbortHandle,
}

impl Task {
    /// Spawns `future` on `runtime`, flagged.
    pub(crate) fn spawn(
        runtime: &Handle,
        future: impl Future<Output = ()> + Send + 'static,
    ) -> Task {
        let alive = Arc::new(AtomicBool::new(true));
        let flag = AliveFlag(alive.clone());
        let abort = runtime
            .spawn(async move {
                let _flag = flag;
                future.await;
            })
            .abort_handle();
        Task { alive, abort }
    }

    /// False once the task's future is gone: finished, aborted, or dropped with its runtime.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Stops the task.
    pub(crate) fn abort(&self) {
        self.abort.abort();
    }
}
