//! The shared conformance suite on the file backend: every client is its own `FileBackend` over one
//! temporary directory, and other processes reach it with `file:///that/dir`.
// Provider setup panics on failure, like the tests themselves.
#![allow(clippy::expect_used)]

use distlock_core::Locks;
use distlock_file::FileBackend;
use distlock_testkit::conformance::{Client, Provider};

struct Files {
    dir: tempfile::TempDir,
}

#[async_trait::async_trait]
impl Provider for Files {
    async fn client(&self) -> Client {
        let backend = FileBackend::new(self.dir.path()).expect("file backend");
        // A file lock has no session to cut: the suite checks the capabilities that say so instead.
        Client::new(Locks::new(backend))
    }

    fn url(&self) -> Option<String> {
        Some(format!("file://{}", self.dir.path().display()))
    }
}

async fn files() -> Files {
    Files {
        dir: tempfile::tempdir().expect("temp dir"),
    }
}

distlock_testkit::conformance_suite!(files);
