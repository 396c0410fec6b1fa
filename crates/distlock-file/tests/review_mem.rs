//! Review of h-mem (issue 9) on real files: the release's fast path compares the owner where the hold
//! wrote it; the record is read into 512 bytes first, grown to the 4 KiB limit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::FileExt;

use distlock_core::Locks;
use distlock_file::FileBackend;

fn token(g: &distlock_core::LockGuard) -> u64 {
    match g.token() {
        Some(t) => t.get(),
        None => panic!("no token"),
    }
}

/// An owner id escaped to 768 bytes (the record past the first read's buffer): released as its own,
/// and the file (padded to that length from now on) is read whole by the next acquire.
#[tokio::test]
async fn review_mem_file_escaped_owner_past_512_bytes_is_released_as_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let locks = Locks::new(FileBackend::new(dir.path()).unwrap());
    let owner = "%\u{1}".repeat(128);
    let g = locks
        .lock_as("big", owner.clone())
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let path = FileBackend::new(dir.path()).unwrap().lock_file("big");
    let len = std::fs::metadata(&path).unwrap().len();
    assert!(len > 768, "{len}");
    let t = token(&g);
    g.release().await.expect("its own record");
    // The next holders (a short owner) read the padded file whole.
    for i in 1..=3u64 {
        let g = locks.lock_as("big", "s").unwrap().acquire().await.unwrap();
        assert_eq!(token(&g), t + i);
        g.release().await.expect("its own record");
    }
}

/// Released records padded (blank lines) to 511/512/513/4095/4096 bytes: an acquire reads them, the
/// token goes on, the release is its own. 4097: refused as corrupt.
#[tokio::test]
async fn review_mem_file_records_at_the_buffer_edges() {
    let dir = tempfile::tempdir().unwrap();
    let locks = Locks::new(FileBackend::new(dir.path()).unwrap());
    let backend = FileBackend::new(dir.path()).unwrap();
    for (i, size) in [511usize, 512, 513, 1024, 4095, 4096]
        .into_iter()
        .enumerate()
    {
        let name = format!("edge{i}");
        let g = locks.lock(&name).unwrap().acquire().await.unwrap();
        let t = token(&g);
        g.release().await.unwrap();
        let path = backend.lock_file(&name);
        let mut content = std::fs::read(&path).unwrap();
        assert!(content.len() <= size);
        content.resize(size, b'\n');
        std::fs::write(&path, &content).unwrap();
        let g = locks.lock(&name).unwrap().acquire().await.unwrap();
        assert_eq!(token(&g), t + 1, "{size}");
        assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, size);
        g.release().await.expect("its own record");
        let g = locks.lock(&name).unwrap().acquire().await.unwrap();
        assert_eq!(token(&g), t + 2, "{size}");
        g.release().await.unwrap();
    }
    let name = "edge-over";
    let g = locks.lock(name).unwrap().acquire().await.unwrap();
    g.release().await.unwrap();
    let path = backend.lock_file(name);
    let mut content = std::fs::read(&path).unwrap();
    content.resize(4097, b'\n');
    std::fs::write(&path, &content).unwrap();
    let err = locks
        .lock(name)
        .unwrap()
        .acquire()
        .await
        .expect_err("too long");
    assert!(err.to_string().contains("larger"), "{err}");
}

/// While held, another process rewrites the record naming another owner id of the same length at the
/// same place (same token): the release does not take it for its own, and leaves that record.
#[tokio::test]
async fn review_mem_file_same_length_other_owner_is_not_released() {
    let dir = tempfile::tempdir().unwrap();
    let locks = Locks::new(FileBackend::new(dir.path()).unwrap());
    let g = locks
        .lock_as("x", "ownerA1")
        .unwrap()
        .acquire()
        .await
        .unwrap();
    let path = FileBackend::new(dir.path()).unwrap().lock_file("x");
    let before = std::fs::read(&path).unwrap();
    let text = String::from_utf8(before.clone()).unwrap();
    let after = text.replace("owner=ownerA1\n", "owner=ownerB1\n");
    assert_ne!(after, text);
    assert_eq!(after.len(), before.len());
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(after.as_bytes(), 0).unwrap();
    drop(f);
    assert!(
        g.release().await.is_err(),
        "released another owner's record"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), after);
}
