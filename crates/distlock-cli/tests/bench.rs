//! `distlock bench` as a script runs it: the real binary, `--json`, short durations. Only the
//! report's structure and mechanism facts are checked (every workload present, counts, ordering of
//! percentiles, fractions in [0, 1], no overlapping holds), never a speed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::redis::RedisServer;
use distlock_testkit::tls::TestCa;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_distlock");

fn bench(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .env_remove("DISTLOCK_URL")
        .output()
        .expect("run distlock bench")
}

/// Runs a JSON bench against `url` and returns the report.
fn bench_json(url: &str, duration: &str) -> Value {
    let out = bench(&["--url", url, "--duration", duration, "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    // The progress bar is hidden when stderr is not a terminal.
    assert!(
        !stderr.contains('['),
        "progress bar drawn on a pipe: {stderr}"
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

fn num(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

fn check_latency(l: &Value, what: &str) {
    assert!(num(l, "n") > 0.0, "{what}: no samples: {l}");
    assert!(
        num(l, "p50_us") <= num(l, "p99_us"),
        "{what}: p50 > p99: {l}"
    );
    assert!(
        num(l, "p99_us") <= num(l, "max_us"),
        "{what}: p99 > max: {l}"
    );
    let buckets = l["histogram"].as_array().expect("histogram");
    assert!(!buckets.is_empty(), "{what}: empty histogram");
    let total: f64 = buckets.iter().map(|b| num(b, "count")).sum();
    assert_eq!(total, num(l, "n"), "{what}: histogram does not add up");
}

fn check_cycles(f: &Value, has_rtt: bool) {
    let label = f["label"].as_str().expect("label");
    assert!(num(f, "cycles") > 0.0, "{label}: no cycles");
    assert!(num(f, "cycles_per_s") > 0.0, "{label}: no rate");
    check_latency(&f["latency"], label);
    assert_eq!(f["in_round_trips"].is_object(), has_rtt, "{label}: {f}");
}

fn check_contended(c: &Value, tasks: u64, has_rtt: bool) {
    let label = c["label"].as_str().expect("label");
    assert!(num(c, "acquisitions") > 0.0, "{label}: {c}");
    assert!(num(c, "acquisitions_per_s") > 0.0, "{label}: {c}");
    check_latency(&c["handoff"], label);
    check_latency(&c["wait"], label);
    for key in ["fairness_min_max", "same_holder_share"] {
        let x = num(c, key);
        assert!((0.0..=1.0).contains(&x), "{label}: {key} = {x}");
    }
    let (min, max, n) = (
        num(c, "per_task_min"),
        num(c, "per_task_max"),
        num(c, "acquisitions"),
    );
    assert!(min <= max, "{label}: {c}");
    assert!(
        min * tasks as f64 <= n && n <= max * tasks as f64,
        "{label}: {c}"
    );
    // Mutual exclusion, not speed: no acquisition may return before the previous holder released.
    assert_eq!(num(c, "overlaps"), 0.0, "{label}: holds overlapped: {c}");
    assert_eq!(num(c, "gave_up"), 0.0, "{label}: {c}");
    assert_eq!(c["in_round_trips"].is_object(), has_rtt, "{label}: {c}");
}

/// Every workload present, distlock measured in each, and the baselines' figures well-formed.
fn check_report(r: &Value, backend: &str, has_rtt: bool) {
    assert_eq!(r["backend"], backend, "{r}");
    assert_eq!(r["round_trip"]["reference"].is_object(), has_rtt, "{r}");
    if !has_rtt {
        assert_eq!(r["round_trip"]["note"], "no engine round trip");
    }

    let a = &r["uncontended"];
    check_cycles(&a["distlock"], has_rtt);
    assert_eq!(a["distlock"]["tasks"], 1);

    let b = &r["many"];
    assert_eq!(b["tasks"], 16);
    for variant in ["shared", "per_task"] {
        check_cycles(&b[variant], has_rtt);
        assert_eq!(b[variant]["tasks"], 16);
    }

    let c = &r["contended"];
    assert_eq!(c["tasks"], 8);
    check_contended(&c["distlock"], 8, has_rtt);

    for section in [a, b] {
        for f in section["baselines"].as_array().expect("baselines") {
            check_cycles(f, has_rtt);
        }
    }
    for f in c["baselines"].as_array().expect("baselines") {
        check_contended(f, 8, has_rtt);
    }
    for t in r["targets"].as_array().expect("targets") {
        assert!(t["met"].is_boolean(), "{t}");
    }
}

#[test]
fn memory_report_has_every_workload() {
    let r = bench_json("memory://", "300ms");
    check_report(&r, "memory", false);
    // No engine: no baseline to run.
    assert_eq!(r["uncontended"]["baselines"], Value::Array(Vec::new()));
}

#[test]
fn file_report_has_every_workload_and_the_flock_floor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().join("locks").display());
    let r = bench_json(&url, "300ms");
    check_report(&r, "file", false);
    let floors = r["uncontended"]["baselines"].as_array().expect("baselines");
    assert!(!floors.is_empty(), "{r}");
    assert!(floors[0]["label"]
        .as_str()
        .is_some_and(|l| l.contains("flock")));
}

#[test]
fn one_workload_and_tasks() {
    let out = bench(&[
        "--url",
        "memory://",
        "--duration",
        "200ms",
        "--workload",
        "contended",
        "--tasks",
        "3",
        "--hold",
        "0s",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(r["uncontended"].is_null() && r["many"].is_null());
    assert_eq!(r["contended"]["tasks"], 3);
    check_contended(&r["contended"]["distlock"], 3, false);
}

#[test]
fn text_report_shows_histograms_and_no_ratio() {
    let out = bench(&[
        "--url",
        "memory://",
        "--duration",
        "100ms",
        "--workload",
        "uncontended",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("(a) uncontended"), "{text}");
    assert!(text.contains("no engine round trip"), "{text}");
    assert!(text.contains('#') && text.contains('%'), "{text}");
}

#[test]
fn bad_flags_exit_64() {
    for args in [
        &["--workload", "sideways"][..],
        &["--duration", "5x"],
        &["--duration", "0s"],
        &["--tasks", "0"],
        &["--tasks", "many"],
        &["--hold", "soon"],
        &["--bogus"],
        &["--url", "gopher://x"],
    ] {
        let out = bench(args);
        assert_eq!(
            out.status.code(),
            Some(64),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn unreachable_server_exits_69() {
    // A port nothing listens on (bound, then closed).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let out = bench(&[
        "--url",
        &format!("redis://127.0.0.1:{port}"),
        "--duration",
        "100ms",
    ]);
    assert_eq!(
        out.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn redis_report_has_ratios_and_the_bare_loop() {
    let server = RedisServer::start_or_panic();
    let r = bench_json(&server.url(), "200ms");
    check_report(&r, "redis", true);
    assert!(r["round_trip"]["reference"]["label"]
        .as_str()
        .is_some_and(|l| l.contains("PING")));
    // The bare loop, the same-scripts loop and rslock in (a); in (b) the bare loop and the
    // same-scripts loop, each on a connection per task and one shared, and rslock; rslock in (c).
    let labels = |section: &str| -> Vec<String> {
        r[section]["baselines"]
            .as_array()
            .expect("baselines")
            .iter()
            .map(|b| b["label"].as_str().expect("label").to_string())
            .collect()
    };
    assert_eq!(
        labels("uncontended").len(),
        3,
        "{:?}",
        labels("uncontended")
    );
    assert!(labels("uncontended")
        .iter()
        .any(|l| l.contains("same-scripts")));
    assert!(labels("uncontended").iter().any(|l| l.contains("rslock")));
    assert_eq!(labels("many").len(), 5, "{:?}", labels("many"));
    assert_eq!(labels("contended").len(), 1, "{:?}", labels("contended"));
    let targets: Vec<&str> = r["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .map(|t| t["what"].as_str().expect("what"))
        .collect();
    for peer in ["same-scripts loop on one shared connection", "rslock"] {
        assert!(targets.iter().any(|t| t.contains(peer)), "{targets:?}");
    }
}

/// The baselines connect as the Redis backend does, from its own config: TLS, trusting only the
/// URL's CA (before, `rediss://` was not measured at all).
#[test]
fn rediss_report_has_the_round_trip_and_the_bare_loop_over_tls() {
    let ca = TestCa::new_or_panic();
    let server = RedisServer::builder().tls(&ca).start_or_panic();
    let url = format!(
        "{}?ca={}",
        server.tls_url().expect("TLS listener"),
        ca.ca_cert().display()
    );
    let r = bench_json(&url, "200ms");
    check_report(&r, "redis", true);
    assert!(r["round_trip"]["reference"]["label"]
        .as_str()
        .is_some_and(|l| l.contains("PING")));
    // rslock too connects through the baselines' client, with the URL's CA.
    assert_eq!(r["many"]["baselines"].as_array().map(Vec::len), Some(5));
}

#[test]
fn etcd_report_has_put_and_range_and_the_peer_lock() {
    let server = EtcdServer::start_or_panic();
    let r = bench_json(&server.url(), "200ms");
    check_report(&r, "etcd", true);
    assert_eq!(r["round_trip"]["others"].as_array().map(Vec::len), Some(1));
    assert_eq!(
        r["contended"]["baselines"].as_array().map(Vec::len),
        Some(1)
    );
}

/// `--sweep` runs (b) at 1, 2, 4, 8, 16 and 64 tasks (six points, distlock twice at each); `--plot`
/// writes the SVG. Structure only, never a value.
#[test]
fn sweep_reports_six_points_and_plots_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let svg_path = dir.path().join("sweep.svg");
    let out = bench(&[
        "--url",
        "memory://",
        "--duration",
        "100ms",
        "--sweep",
        "--plot",
        svg_path.to_str().expect("utf-8 path"),
        "--json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(r["uncontended"].is_null() && r["many"].is_null() && r["contended"].is_null());
    let points = r["sweep"]["points"].as_array().expect("sweep points");
    let tasks: Vec<u64> = points
        .iter()
        .map(|p| p["tasks"].as_u64().expect("tasks"))
        .collect();
    assert_eq!(tasks, [1, 2, 4, 8, 16, 64]);
    for p in points {
        for series in ["distlock_shared", "distlock_per_task"] {
            check_cycles(&p[series], false);
            assert_eq!(p[series]["tasks"], p["tasks"], "{p}");
        }
    }
    let svg = std::fs::read_to_string(&svg_path).expect("the plot was written");
    assert!(svg.starts_with("<svg"), "{svg}");
    assert_eq!(svg.matches("<polyline").count(), 2, "{svg}");
}

#[test]
fn plot_needs_sweep_and_a_writable_path() {
    for args in [
        &["--url", "memory://", "--plot", "/tmp/x.svg"][..],
        &["--url", "memory://", "--sweep", "--workload", "many"],
        &["--url", "memory://", "--sweep", "--tasks", "4"],
        &["--url", "memory://", "--workload", "hold", "--locks", "0"],
        &[
            "--url",
            "memory://",
            "--workload",
            "hold",
            "--lease",
            "soon",
        ],
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(64), "{args:?}");
    }
    let out = bench(&[
        "--url",
        "memory://",
        "--duration",
        "10ms",
        "--sweep",
        "--plot",
        "/nonexistent-dir/x.svg",
    ]);
    assert_eq!(out.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent-dir/x.svg"), "{stderr}");
    assert!(out.stdout.is_empty());
}

/// The hold workload against a real Redis server: every lock stays held, the watchdog's renewals are
/// counted (on the client and by the server), memory is read. Counts and facts, never a speed.
#[test]
fn hold_counts_renewals_and_loses_no_lock() {
    let server = RedisServer::start_or_panic();
    let out = bench(&[
        "--url",
        &server.url(),
        "--workload",
        "hold",
        "--locks",
        "200",
        "--lease",
        "600ms",
        "--duration",
        "1s",
        "--json",
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    let h = &r["hold"];
    assert_eq!(h["locks"], 200, "{h}");
    assert_eq!(h["not_held"], 0, "{h}");
    assert_eq!(h["lost"], 0, "{h}");
    let renewals = &h["renewals"];
    // A 600 ms lease is renewed every 200 ms: a 1 s hold sees renewals, whatever the machine's speed.
    assert!(num(renewals, "renewals") > 0.0, "{renewals}");
    assert!(num(renewals, "round_trips") > 0.0, "{renewals}");
    assert!(num(renewals, "server_commands") > 0.0, "{renewals}");
    assert!(num(renewals, "round_trips_per_tick") > 0.0, "{renewals}");
    assert_eq!(renewals["groups"], 1, "{renewals}");
    assert!(renewals["counted"]
        .as_str()
        .is_some_and(|c| c.contains("INFO commandstats")));
    assert!(h["memory"]["rss_holding_kib"].as_u64().is_some(), "{h}");
    assert!(h["memory"]["per_lock_bytes"].is_number(), "{h}");
    for t in r["targets"].as_array().expect("targets") {
        assert!(t["met"].is_boolean(), "{t}");
    }
    assert!(r["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .any(|t| t["what"]
            .as_str()
            .is_some_and(|w| w.contains("round trips per tick"))));
}
