//! The conformance suite on the in-memory reference backend: each client is its own handle (with its own
//! link, which a cut freezes) on one private store.

use distlock_core::Locks;
use distlock_core::MemoryBackend;
use distlock_testkit::conformance::{Client, Provider};
use std::time::Duration;

struct Memory {
    store: MemoryBackend,
}

#[async_trait::async_trait]
impl Provider for Memory {
    async fn client(&self) -> Client {
        let backend = self.store.another_client();
        let (cut, heal) = (backend.clone(), backend.clone());
        Client::new(Locks::new(backend))
            .with_cut(move || {
                cut.freeze();
                Box::pin(async {})
            })
            .with_heal(move || {
                heal.unfreeze();
                Box::pin(async {})
            })
    }

    fn url(&self) -> Option<String> {
        None
    }

    fn short_lease(&self) -> Duration {
        Duration::from_millis(300)
    }
}

async fn memory() -> Memory {
    Memory {
        store: MemoryBackend::new(),
    }
}

distlock_testkit::conformance_suite!(memory);
