//! Helpers shared by the etcd test binaries that run the real `distlock` binary and `etcdctl`.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used)]

use std::time::{Duration, Instant};

/// A unique lock name for one test case.
pub fn name(case: &str) -> String {
    format!(
        "etcd-test/{case}/{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// One key under a prefix as `etcdctl get --prefix P -w fields` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFields {
    pub key: String,
    pub create_revision: u64,
    /// The lease the key hangs on (decimal, as etcdctl prints it).
    pub lease: i64,
}

/// Every key under `prefix`, as etcdctl sees it (`-w fields`: one `"Field" : value` line per field),
/// oldest first (the holder, then the waiters in queue order).
pub fn keys(endpoints: &str, prefix: &str) -> Vec<KeyFields> {
    let out =
        distlock_testkit::etcd::etcdctl(endpoints, &["get", "--prefix", prefix, "-w", "fields"])
            .expect("etcdctl get");
    let mut keys: Vec<KeyFields> = Vec::new();
    for line in out.lines() {
        let Some((field, value)) = line.split_once(" : ") else {
            continue;
        };
        let value = value.trim().trim_matches('"');
        match field.trim_matches('"') {
            "Key" => keys.push(KeyFields {
                key: value.to_string(),
                create_revision: 0,
                lease: 0,
            }),
            "CreateRevision" => {
                keys.last_mut().expect("Key first").create_revision = value.parse().unwrap()
            }
            "Lease" => keys.last_mut().expect("Key first").lease = value.parse().unwrap(),
            _ => {}
        }
    }
    // etcdctl lists keys in key order; the queue order is creation order.
    keys.sort_by_key(|k| k.create_revision);
    keys
}

/// Polls `keys(prefix)` until `pred` holds; panics after `within` with what it last saw.
pub fn wait_keys(
    endpoints: &str,
    prefix: &str,
    within: Duration,
    what: &str,
    pred: impl Fn(&[KeyFields]) -> bool,
) -> Vec<KeyFields> {
    let started = Instant::now();
    loop {
        let seen = keys(endpoints, prefix);
        if pred(&seen) {
            return seen;
        }
        assert!(
            started.elapsed() < within,
            "{what}: not within {within:?}; keys {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A gauge from etcd's `/metrics`: `etcd_debugging_mvcc_watcher_total` (watches on the server) or
/// `etcd_debugging_mvcc_slow_watcher_total` (those served by its 100 ms catch-up loop: "unsynced").
pub async fn watch_gauge(addr: std::net::SocketAddr, gauge: &str) -> u64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(gauge)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}
