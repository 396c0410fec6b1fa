//! distlock's metrics as an operator sees them: the example's Prometheus exporter serves them on a
//! loopback port, and a scrape over HTTP shows the series move as locks on a real Redis are taken,
//! waited for, released and lost.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use distlock_testkit::redis::RedisServer;

#[allow(dead_code)]
#[path = "../examples/metrics.rs"]
mod example;

/// One sample of a scraped page: the series name, its labels and its value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

fn scrape(addr: SocketAddr) -> Vec<Sample> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut page = String::new();
    stream.read_to_string(&mut page).unwrap();
    let (head, body) = page.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|l| !l.is_empty())
                .map(|l| {
                    let (k, v) = l.split_once('=').unwrap();
                    (k.to_string(), v.trim_matches('"').to_string())
                })
                .collect();
            Sample {
                name: name.to_string(),
                labels,
                value: value.parse().unwrap(),
            }
        })
        .collect()
}

/// The value of the one series `name` whose labels include `labels` (0 when there is none yet).
fn value(page: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let matching: Vec<&Sample> = page
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.iter().any(|(sk, sv)| sk == k && sv == v))
        })
        .collect();
    assert!(matching.len() <= 1, "{name} {labels:?}: {matching:?}");
    matching.first().map_or(0.0, |s| s.value)
}

/// Scrapes until `check` holds on the page (within 10 s), and returns that page.
async fn until(addr: SocketAddr, what: &str, check: impl Fn(&[Sample]) -> bool) -> Vec<Sample> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let page = tokio::task::spawn_blocking(move || scrape(addr))
            .await
            .unwrap();
        if check(&page) {
            return page;
        }
        let shown: Vec<&Sample> = page
            .iter()
            .filter(|s| !s.name.ends_with("_bucket"))
            .collect();
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not seen within 10 s in {shown:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_locks_taken_waited_for_released_and_lost() {
    let server = RedisServer::start_or_panic();
    let port = distlock_testkit::ports::reserve().unwrap();
    let addr = port.addr();
    drop(port);
    example::install_prometheus(addr).unwrap();
    let name = format!("metrics-{}", std::process::id());
    let locks = distlock::connect(&server.url())
        .await
        .unwrap()
        .with_name_labels(true);
    let this = [
        ("engine", "redis"),
        ("kind", "mutex"),
        ("name", name.as_str()),
    ];
    let with = |extra: (&'static str, &'static str)| {
        let mut labels = this.to_vec();
        labels.push(extra);
        labels
    };

    // Taken: one acquisition, one hold now.
    let first = locks.lock(&name).unwrap().acquire().await.unwrap();
    let page = until(addr, "the grant", |p| {
        value(p, "distlock_holds", &with(("state", "held"))) == 1.0
    })
    .await;
    let acquired = with(("outcome", "acquired"));
    assert_eq!(value(&page, "distlock_acquisitions_total", &acquired), 1.0);
    assert_eq!(
        value(&page, "distlock_acquire_wait_seconds_count", &acquired),
        1.0
    );

    // Waited for: a second owner is a waiter until the release.
    let second = locks.lock(&name).unwrap();
    let waiter = tokio::spawn(async move { second.acquire().await.map(|g| (second, g)) });
    until(addr, "the waiter", |p| {
        value(p, "distlock_waiters", &this) == 1.0
    })
    .await;
    first.release().await.unwrap();
    let (_second, guard) = waiter.await.unwrap().unwrap();
    let page = until(addr, "the handover", |p| {
        value(p, "distlock_acquisitions_total", &acquired) == 2.0
    })
    .await;
    assert_eq!(value(&page, "distlock_waiters", &this), 0.0);
    assert_eq!(
        value(&page, "distlock_holds", &with(("state", "held"))),
        1.0
    );
    let released = with(("end", "released"));
    assert_eq!(value(&page, "distlock_hold_seconds_count", &released), 1.0);

    // Lost: the key deleted under the holder; the next renewal (here forced by `extend`) finds it gone.
    server.command(&["DEL", &name]).unwrap();
    assert!(guard.extend(Duration::from_secs(30)).await.is_err());
    assert!(guard.loss_reason().is_some());
    let page = until(addr, "the loss", |p| {
        value(p, "distlock_lost_total", &with(("reason", "gone"))) == 1.0
    })
    .await;
    assert_eq!(
        value(&page, "distlock_holds", &with(("state", "held"))),
        0.0
    );
    assert_eq!(
        value(&page, "distlock_renewals_total", &with(("outcome", "gone"))),
        1.0
    );
    assert_eq!(
        value(&page, "distlock_hold_seconds_count", &with(("end", "lost"))),
        1.0
    );
    // Its release afterwards is no second end of the hold.
    assert!(guard.release().await.is_err());
    let page = until(addr, "the release error", |p| {
        value(
            p,
            "distlock_errors_total",
            &[
                ("name", name.as_str()),
                ("op", "release"),
                ("error", "not_held"),
            ],
        ) == 1.0
    })
    .await;
    assert_eq!(value(&page, "distlock_hold_seconds_count", &released), 1.0);

    // Without name labels (the default) the series carry engine and kind only.
    let plain = distlock::connect(&server.url()).await.unwrap();
    let other = format!("{name}-plain");
    let held = plain.lock(&other).unwrap().acquire().await.unwrap();
    let page = until(addr, "the unlabelled grant", |p| {
        p.iter().any(|s| {
            s.name == "distlock_acquisitions_total" && s.labels.iter().all(|(k, _)| k != "name")
        })
    })
    .await;
    assert!(
        page.iter()
            .filter(|s| s.name.starts_with("distlock_"))
            .all(|s| s.labels.iter().all(|(_, v)| v != &other)),
        "a name label without with_name_labels"
    );
    held.release().await.unwrap();
}
