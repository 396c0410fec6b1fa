//! The metrics' accounting, read from a recorder of the test's own: every hold ends exactly once, the
//! gauges come back to zero after reentrant acquires, downgrades, handoffs, cancelled waits, Jeopardy
//! and losses, and a lost guard's release is not a second end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use distlock_core::{Locks, MemoryBackend};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

/// Histogram samples.
#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl metrics::HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

/// Every series by `name{label=value,…}` (labels sorted).
#[derive(Default)]
struct Registry {
    counters: Mutex<HashMap<String, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<HashMap<String, Arc<Samples>>>,
}

fn series(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

impl Recorder for &'static Registry {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut counters = self.counters.lock().unwrap();
        Counter::from_arc(counters.entry(series(key)).or_default().clone())
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut gauges = self.gauges.lock().unwrap();
        Gauge::from_arc(gauges.entry(series(key)).or_default().clone())
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut histograms = self.histograms.lock().unwrap();
        Histogram::from_arc(histograms.entry(series(key)).or_default().clone())
    }
}

/// The process's recorder (installed once: tests of one binary may share a process).
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<&'static Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let registry: &'static Registry = Box::leak(Box::default());
        metrics::set_global_recorder(registry).expect("the only recorder");
        registry
    })
}

/// The series of one lock name (each test uses names of its own, with name labels on).
struct Of<'a> {
    name: &'a str,
    kind: &'a str,
}

impl Of<'_> {
    fn key(&self, metric: &str, extra: &[(&str, &str)]) -> String {
        let mut labels = vec![
            format!("engine=memory"),
            format!("kind={}", self.kind),
            format!("name={}", self.name),
        ];
        labels.extend(extra.iter().map(|(k, v)| format!("{k}={v}")));
        labels.sort();
        format!("{metric}{{{}}}", labels.join(","))
    }

    fn counter(&self, metric: &str, extra: &[(&str, &str)]) -> u64 {
        registry()
            .counters
            .lock()
            .unwrap()
            .get(&self.key(metric, extra))
            .map_or(0, |c| c.load(Ordering::SeqCst))
    }

    fn gauge(&self, metric: &str, extra: &[(&str, &str)]) -> f64 {
        registry()
            .gauges
            .lock()
            .unwrap()
            .get(&self.key(metric, extra))
            .map_or(0.0, |g| f64::from_bits(g.load(Ordering::SeqCst)))
    }

    fn samples(&self, metric: &str, extra: &[(&str, &str)]) -> usize {
        registry()
            .histograms
            .lock()
            .unwrap()
            .get(&self.key(metric, extra))
            .map_or(0, |h| h.0.lock().unwrap().len())
    }

    fn held(&self) -> f64 {
        self.gauge("distlock_holds", &[("state", "held")])
    }

    fn in_jeopardy(&self) -> f64 {
        self.gauge("distlock_holds", &[("state", "jeopardy")])
    }

    fn waiters(&self) -> f64 {
        self.gauge("distlock_waiters", &[])
    }
}

fn locks(backend: MemoryBackend) -> Locks {
    registry();
    Locks::new(backend).with_name_labels(true)
}

#[tokio::test]
async fn a_reentrant_hold_is_one_hold_and_ends_once() {
    let locks = locks(MemoryBackend::new());
    let of = Of {
        name: "reentrant",
        kind: "mutex",
    };
    let lock = locks.lock(of.name).unwrap();
    let outer = lock.acquire().await.unwrap();
    let inner = lock.acquire().await.unwrap();
    assert_eq!(of.held(), 1.0);
    assert_eq!(
        of.counter("distlock_acquisitions_total", &[("outcome", "acquired")]),
        2
    );
    inner.release().await.unwrap();
    assert_eq!(of.held(), 1.0, "the hold lives on in the outer guard");
    outer.release().await.unwrap();
    assert_eq!(of.held(), 0.0);
    assert_eq!(
        of.samples("distlock_hold_seconds", &[("end", "released")]),
        1
    );
    // A `Lock` made per acquire (the usual `lock(name)?.acquire()`) shares the series.
    for _ in 0..3 {
        locks
            .lock(of.name)
            .unwrap()
            .acquire()
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    assert_eq!(
        of.samples("distlock_hold_seconds", &[("end", "released")]),
        4
    );
}

#[tokio::test]
async fn a_cancelled_wait_and_a_busy_try_leave_no_waiter() {
    let locks = locks(MemoryBackend::new());
    let of = Of {
        name: "cancelled",
        kind: "mutex",
    };
    let held = locks.lock(of.name).unwrap().acquire().await.unwrap();
    assert!(locks
        .lock(of.name)
        .unwrap()
        .try_acquire()
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        of.counter("distlock_acquisitions_total", &[("outcome", "busy")]),
        1
    );
    let waiter = locks.lock(of.name).unwrap();
    let waiting = tokio::time::timeout(Duration::from_millis(100), waiter.acquire()).await;
    assert!(waiting.is_err(), "held above");
    assert_eq!(of.waiters(), 0.0, "the dropped wait is no waiter");
    assert_eq!(
        of.counter("distlock_acquisitions_total", &[("outcome", "cancelled")]),
        1
    );
    held.release().await.unwrap();
    assert_eq!(of.held(), 0.0);
}

#[tokio::test]
async fn a_downgrade_ends_the_write_hold_and_starts_a_read_hold() {
    let locks = locks(MemoryBackend::new());
    let (write, read) = (
        Of {
            name: "downgrade",
            kind: "write",
        },
        Of {
            name: "downgrade",
            kind: "read",
        },
    );
    let rw = locks.read_write(write.name).unwrap();
    let mut guard = rw.write().await.unwrap();
    assert_eq!(write.held(), 1.0);
    guard.downgrade().await.unwrap();
    assert_eq!((write.held(), read.held()), (0.0, 1.0));
    guard.release().await.unwrap();
    assert_eq!((write.held(), read.held()), (0.0, 0.0));
    assert_eq!(
        write.samples("distlock_hold_seconds", &[("end", "released")]),
        1
    );
    assert_eq!(
        read.samples("distlock_hold_seconds", &[("end", "released")]),
        1
    );
}

#[tokio::test]
async fn a_handed_off_grant_is_counted_as_the_waiters_hold() {
    let backend = MemoryBackend::new();
    backend.enable_hand_off();
    let locks = locks(backend.clone());
    let of = Of {
        name: "handoff",
        kind: "mutex",
    };
    let first = locks.lock(of.name).unwrap().acquire().await.unwrap();
    let next = locks.lock(of.name).unwrap();
    let waiting = tokio::spawn(async move { next.acquire().await.map(|g| (next, g)) });
    while of.waiters() < 1.0 {
        tokio::task::yield_now().await;
    }
    first.release().await.unwrap();
    let (_next, second) = waiting.await.unwrap().unwrap();
    assert_eq!(backend.hand_offs(), 1);
    assert_eq!((of.held(), of.waiters()), (1.0, 0.0));
    second.release().await.unwrap();
    assert_eq!(of.held(), 0.0);
    assert_eq!(
        of.samples("distlock_hold_seconds", &[("end", "released")]),
        2
    );
}

#[tokio::test]
async fn jeopardy_then_loss_ends_the_hold_once_and_its_release_is_no_second_end() {
    let backend = MemoryBackend::new();
    let locks = locks(backend.clone());
    let of = Of {
        name: "lost",
        kind: "mutex",
    };
    let guard = locks
        .lock(of.name)
        .unwrap()
        .options()
        .lease(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    backend.freeze();
    tokio::time::timeout(Duration::from_secs(5), guard.jeopardy())
        .await
        .unwrap();
    assert_eq!((of.held(), of.in_jeopardy()), (0.0, 1.0));
    assert_eq!(of.counter("distlock_jeopardy_total", &[]), 1);
    tokio::time::timeout(Duration::from_secs(5), guard.lost())
        .await
        .unwrap();
    backend.unfreeze();
    assert_eq!((of.held(), of.in_jeopardy()), (0.0, 0.0));
    assert_eq!(
        of.counter("distlock_lost_total", &[("reason", "expired")]),
        1
    );
    assert!(of.counter("distlock_renewals_total", &[("outcome", "failed")]) >= 1);
    assert!(
        of.counter(
            "distlock_errors_total",
            &[("op", "renew"), ("error", "unavailable")]
        ) >= 1
    );
    // The store's own expiry comes a moment after the guard's deadline (which is 1 % early).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(guard.release().await.is_err(), "lost: the release says so");
    assert_eq!((of.held(), of.in_jeopardy()), (0.0, 0.0));
    assert_eq!(of.samples("distlock_hold_seconds", &[("end", "lost")]), 1);
    assert_eq!(
        of.samples("distlock_hold_seconds", &[("end", "released")]),
        0
    );
    assert_eq!(
        of.counter(
            "distlock_errors_total",
            &[("op", "release"), ("error", "not_held")]
        ),
        1
    );
}
