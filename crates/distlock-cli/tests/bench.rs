//! `distlock bench` as a script runs it: the real binary, `--json`, short durations. Only the
//! report's structure and mechanism facts are checked (every field of the JSON present with its type,
//! every workload present, counts, ordering of percentiles, fractions in [0, 1], no overlapping holds,
//! the CPU figures and target rows there), never a speed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use distlock_testkit::etcd::EtcdServer;
use distlock_testkit::postgres::PostgresServer;
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

/// Runs a JSON bench with `args`, expects exit 0, and returns the report, its fields checked.
fn bench_report(args: &[&str]) -> Value {
    let out = bench(&[args, &["--json"]].concat());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("json");
    check_fields(&report);
    report
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

// --- the JSON's fields ------------------------------------------------------------------------------

/// What a field holds.
#[derive(Clone, Copy)]
enum Kind {
    Num,
    Str,
    Bool,
    OptNum,
    OptStr,
    /// An object checked by the function.
    Obj(fn(&Value, &str)),
    OptObj(fn(&Value, &str)),
    /// An array of objects checked by the function.
    Arr(fn(&Value, &str)),
}

/// `v` is an object with exactly these fields, each of its kind (recursively).
fn fields(v: &Value, at: &str, expected: &[(&str, Kind)]) {
    let object = v
        .as_object()
        .unwrap_or_else(|| panic!("{at}: not an object: {v}"));
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    let mut want: Vec<&str> = expected.iter().map(|(k, _)| *k).collect();
    keys.sort_unstable();
    want.sort_unstable();
    assert_eq!(keys, want, "{at}: fields differ: {v}");
    for (key, kind) in expected {
        let field = &object[*key];
        let at = format!("{at}.{key}");
        let ok = match kind {
            Kind::Num => field.is_number(),
            Kind::Str => field.is_string(),
            Kind::Bool => field.is_boolean(),
            Kind::OptNum => field.is_number() || field.is_null(),
            Kind::OptStr => field.is_string() || field.is_null(),
            Kind::Obj(check) => {
                check(field, &at);
                true
            }
            Kind::OptObj(check) => {
                if !field.is_null() {
                    check(field, &at);
                }
                true
            }
            Kind::Arr(check) => {
                let items = field
                    .as_array()
                    .unwrap_or_else(|| panic!("{at}: not an array: {field}"));
                for (i, item) in items.iter().enumerate() {
                    check(item, &format!("{at}[{i}]"));
                }
                true
            }
        };
        assert!(ok, "{at}: wrong kind: {field}");
    }
}

fn latency_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("n", Num),
            ("mean_us", Num),
            ("p50_us", Num),
            ("p99_us", Num),
            ("max_us", Num),
            ("histogram", Arr(bucket_fields)),
        ],
    );
}

fn bucket_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[("from_us", Num), ("to_us", OptNum), ("count", Num)],
    );
}

/// The CPU figures every measurement carries: well-formed, a client figure always, the server's
/// where the source names one, and a total whenever the server's is known or there is none.
fn cpu_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("client_us_per_cycle", Num),
            ("server_us_per_cycle", OptNum),
            ("total_us_per_cycle", OptNum),
            ("client_system_share", OptNum),
            ("client_cpu_s", Num),
            ("server_cpu_s", OptNum),
            ("client_source", Str),
            ("server_source", Str),
        ],
    );
    let source = v["server_source"].as_str().unwrap_or_default();
    assert_eq!(
        v["server_us_per_cycle"].is_null(),
        source.starts_with("none:"),
        "{at}: a server figure without a source, or a source without a figure: {v}"
    );
    assert!(
        v["total_us_per_cycle"].is_number() || !source.starts_with("none: in-process"),
        "{at}: {v}"
    );
    for key in ["client_us_per_cycle", "client_cpu_s"] {
        assert!(num(v, key) >= 0.0, "{at}: {v}");
    }
    if let Some(share) = v["client_system_share"].as_f64() {
        assert!((0.0..=1.0).contains(&share), "{at}: {v}");
    }
}

fn probe_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("label", Str),
            ("calls_per_s", Num),
            ("latency", Obj(latency_fields)),
            ("cpu", Obj(cpu_fields)),
        ],
    );
}

fn cycle_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("label", Str),
            ("tasks", Num),
            ("cycles", Num),
            ("elapsed_s", Num),
            ("cycles_per_s", Num),
            ("latency", Obj(latency_fields)),
            ("in_round_trips", OptObj(cycle_ratio_fields)),
            ("cpu", Obj(cpu_fields)),
        ],
    );
}

fn cycle_ratio_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("mean", Num),
            ("p50", Num),
            ("p99", Num),
            ("time_per_cycle", Num),
        ],
    );
}

fn contended_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("label", Str),
            ("acquisitions", Num),
            ("elapsed_s", Num),
            ("acquisitions_per_s", Num),
            ("mean_hold_us", Num),
            ("ceiling_per_s", Num),
            ("handoff", Obj(latency_fields)),
            ("handoff_to_other", Obj(latency_fields)),
            ("wait", Obj(latency_fields)),
            ("per_task_min", Num),
            ("per_task_max", Num),
            ("fairness_min_max", Num),
            ("same_holder_share", Num),
            ("overlaps", Num),
            ("gave_up", Num),
            ("in_round_trips", OptObj(contended_ratio_fields)),
            ("cpu", Obj(cpu_fields)),
        ],
    );
}

fn contended_ratio_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("handoff_p50", Num),
            ("handoff_p99", Num),
            ("to_other_p50", Num),
            ("to_other_p99", Num),
            ("dead_time_per_acquisition", Num),
        ],
    );
}

/// A target row: the wall-clock ratio with its limit and verdict, the CPU ratio where there is one,
/// and which of the two is primary.
fn target_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("what", Str),
            ("value", Num),
            ("limit", Num),
            ("at_most", Bool),
            ("met", Bool),
            ("cpu", OptObj(cpu_target_fields)),
            ("primary", Str),
        ],
    );
    let primary = if v["cpu"].is_object() {
        "cpu"
    } else {
        "wall_clock"
    };
    assert_eq!(v["primary"], primary, "{at}: {v}");
}

fn cpu_target_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[("what", Str), ("value", Num), ("limit", Num), ("met", Bool)],
    );
    assert!(num(v, "limit") > 0.0, "{at}: {v}");
}

fn round_trip_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("reference", OptObj(probe_fields)),
            ("others", Arr(probe_fields)),
            ("note", OptStr),
        ],
    );
}

fn uncontended_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("distlock", OptObj(cycle_fields)),
            ("baselines", Arr(cycle_fields)),
        ],
    );
}

fn many_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("tasks", Num),
            ("shared", OptObj(cycle_fields)),
            ("per_task", OptObj(cycle_fields)),
            ("baselines", Arr(cycle_fields)),
        ],
    );
}

fn kinds_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("permit_limit", Num),
            ("read", Obj(uncontended_fields)),
            ("permit", Obj(uncontended_fields)),
        ],
    );
}

fn contended_section_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("tasks", Num),
            ("hold_us", Num),
            ("distlock", OptObj(contended_fields)),
            ("baselines", Arr(contended_fields)),
        ],
    );
}

/// Every field of the report, recursively, each of its kind; and the statement that CPU per cycle is
/// the primary figure.
fn check_fields(r: &Value) {
    use Kind::*;
    fields(
        r,
        "report",
        &[
            ("url", Str),
            ("backend", Str),
            ("duration_s", Num),
            ("runtime_workers", Num),
            ("primary_figure", Str),
            ("primary_note", Str),
            ("server_cpu_source", Str),
            ("round_trip", Obj(round_trip_fields)),
            ("uncontended", OptObj(uncontended_fields)),
            ("many", OptObj(many_fields)),
            ("contended", OptObj(contended_section_fields)),
            ("kinds", OptObj(kinds_fields)),
            ("sweep", OptObj(sweep_fields)),
            ("hold", OptObj(hold_fields)),
            ("herd", OptObj(herd_fields)),
            ("targets", Arr(target_fields)),
        ],
    );
    assert_eq!(r["primary_figure"], "cpu_us_per_cycle");
    assert!(r["primary_note"]
        .as_str()
        .is_some_and(|n| n.contains("CPU") && n.contains("wall-clock")));
}

/// The target rows whose `what` starts with each of `rows`, every one with a CPU ratio.
fn check_target_rows(r: &Value, rows: &[&str]) {
    let targets = r["targets"].as_array().expect("targets");
    for row in rows {
        let target = targets
            .iter()
            .find(|t| t["what"].as_str().is_some_and(|w| w.starts_with(row)))
            .unwrap_or_else(|| panic!("no target row {row:?}: {r}"));
        assert!(target["cpu"].is_object(), "{row}: no CPU ratio: {target}");
        assert_eq!(target["primary"], "cpu", "{target}");
    }
}

/// The server's CPU figure in every measurement, from the named source.
fn check_server_cpu(r: &Value, source: &str) {
    assert!(
        r["server_cpu_source"]
            .as_str()
            .is_some_and(|s| s.starts_with(source)),
        "{r}"
    );
    let mut cpus = Vec::new();
    for probe in std::iter::once(&r["round_trip"]["reference"])
        .chain(r["round_trip"]["others"].as_array().into_iter().flatten())
    {
        cpus.push(&probe["cpu"]);
    }
    for section in ["uncontended", "many", "contended"] {
        let s = &r[section];
        for key in ["distlock", "shared", "per_task"] {
            if s[key].is_object() {
                cpus.push(&s[key]["cpu"]);
            }
        }
        cpus.extend(
            s["baselines"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| &b["cpu"]),
        );
    }
    let cpus: Vec<&Value> = cpus.into_iter().filter(|c| !c.is_null()).collect();
    assert!(!cpus.is_empty(), "no CPU figure to check in {r}");
    for cpu in cpus {
        assert!(
            cpu["server_source"]
                .as_str()
                .is_some_and(|s| s.starts_with(source)),
            "{cpu}"
        );
        assert!(cpu["total_us_per_cycle"].is_number(), "{cpu}");
    }
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
    check_fields(r);
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

    // The kinds workload: distlock's read-lock and permit cycles where the backend has those kinds
    // (all but etcd's, so far).
    let k = &r["kinds"];
    assert_eq!(k["permit_limit"], 4, "{k}");
    for kind in ["read", "permit"] {
        if backend != "etcd" || !k[kind]["distlock"].is_null() {
            check_cycles(&k[kind]["distlock"], has_rtt);
            assert_eq!(k[kind]["distlock"]["tasks"], 1, "{k}");
        }
        for f in k[kind]["baselines"].as_array().expect("baselines") {
            check_cycles(f, has_rtt);
        }
    }
}

/// The kinds workload's bare loops: one per kind, labelled as expected; and, where the engine has a
/// target for them, the two target rows (distlock / the same-layout bare loop, with the CPU ratio),
/// each a finite positive ratio. Never a speed.
fn check_kinds(r: &Value, read_label: &str, permit_label: &str, target_engine: Option<&str>) {
    let k = &r["kinds"];
    for (kind, label) in [("read", read_label), ("permit", permit_label)] {
        let baselines = k[kind]["baselines"].as_array().expect("baselines");
        assert_eq!(baselines.len(), 1, "{kind}: {k}");
        assert!(
            baselines[0]["label"]
                .as_str()
                .is_some_and(|l| l.contains(label)),
            "{kind}: {k}"
        );
    }
    let Some(engine) = target_engine else {
        return;
    };
    for kind in ["read-lock", "permit"] {
        let row = format!("{engine} (kinds) distlock {kind} cycle");
        check_target_rows(r, &[&row]);
        let target = r["targets"]
            .as_array()
            .expect("targets")
            .iter()
            .find(|t| t["what"].as_str().is_some_and(|w| w.starts_with(&row)))
            .expect("target");
        let value = num(target, "value");
        assert!(value.is_finite() && value > 0.0, "{target}");
        assert_eq!(num(target, "limit"), 1.1, "{target}");
    }
}

#[test]
fn memory_report_has_every_workload() {
    let r = bench_json("memory://", "300ms");
    check_report(&r, "memory", false);
    // No engine: no baseline to run.
    assert_eq!(r["uncontended"]["baselines"], Value::Array(Vec::new()));
    check_server_cpu(&r, "none: in-process");
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
    check_server_cpu(&r, "none: in-process");
    check_target_rows(&r, &["file (a)", "file (b)"]);
    // The reader's floor and a permit slot file's; no kinds target on file.
    check_kinds(&r, "flock LOCK_SH", "slot file: bare flock", None);
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
    check_fields(&r);
    assert!(r["uncontended"].is_null() && r["many"].is_null());
    assert_eq!(r["contended"]["tasks"], 3);
    check_contended(&r["contended"]["distlock"], 3, false);
}

/// The hidden flags of scripts/callgrind.sh: `--cycles N` measures exactly N cycles per task, and
/// `--only` keeps distlock alone or the first baseline alone, without round-trip probes.
#[test]
fn fixed_cycle_counts_and_one_loop_per_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("file://{}", dir.path().join("locks").display());
    let run = |only: &str| {
        let out = bench(&[
            "--url",
            &url,
            "--workload",
            "uncontended",
            "--cycles",
            "40",
            "--only",
            only,
            "--json",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
        let r: Value = serde_json::from_slice(&out.stdout).expect("json");
        check_fields(&r);
        r
    };
    let r = run("distlock");
    assert_eq!(r["uncontended"]["distlock"]["cycles"], 40, "{r}");
    assert_eq!(r["uncontended"]["baselines"], Value::Array(Vec::new()));
    let r = run("baselines");
    assert!(r["uncontended"]["distlock"].is_null(), "{r}");
    let floors = r["uncontended"]["baselines"].as_array().expect("baselines");
    assert_eq!(floors.len(), 1, "{r}");
    assert_eq!(floors[0]["cycles"], 40, "{r}");
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
    // The header says which figure to judge by, and every row has its CPU per cycle.
    assert!(text.contains("CPU time per cycle"), "{text}");
    assert!(text.contains("primary figure"), "{text}");
    assert!(text.contains("(in-process)"), "{text}");
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
        .any(|l| l.contains("same scripts")));
    assert!(labels("uncontended").iter().any(|l| l.contains("rslock")));
    assert_eq!(labels("many").len(), 5, "{:?}", labels("many"));
    assert!(labels("many").iter().any(|l| l == SAME_SCRIPTS_SHARED));
    // (c): the harness's floor (an in-process mutex whose release is one PING), then rslock.
    assert_eq!(labels("contended").len(), 2, "{:?}", labels("contended"));
    assert_eq!(labels("contended")[0], PING_MUTEX_FLOOR);
    assert!(labels("contended")[1].contains("rslock"));
    let floor = &r["contended"]["baselines"][0];
    assert!(
        num(&floor["in_round_trips"], "to_other_p50") > 0.0,
        "{floor}"
    );
    check_server_cpu(&r, "redis INFO cpu");
    check_target_rows(
        &r,
        &[
            "Redis (a)",
            "Redis (b) one Locks per task",
            "Redis (c)",
            "Redis (b) one shared Locks",
            "Redis (c) the harness floor's handoff p50",
        ],
    );
    let targets: Vec<&str> = r["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .map(|t| t["what"].as_str().expect("what"))
        .collect();
    for peer in ["same-scripts loop", "rslock"] {
        assert!(targets.iter().any(|t| t.contains(peer)), "{targets:?}");
    }
    check_kinds(
        &r,
        "same read scripts as distlock (EVALSHA)",
        "same permit scripts as distlock (EVALSHA)",
        Some("Redis"),
    );
}

/// The Redis kinds loops cost one script call per acquire and one per release, distlock's and the
/// same-layout bare loops' alike: with `--cycles 40` (after 200 warm-up cycles) each of the read and
/// permit loops runs 240 cycles, so the server counts 4 × 240 script calls that ran, in a run of
/// distlock alone and in a run of the bare loops alone.
#[test]
fn redis_kinds_cycles_cost_one_script_call_per_acquire_and_per_release() {
    let server = RedisServer::start_or_panic();
    let run = |only: &str| -> u64 {
        let before = scripts_run(&server);
        let out = bench(&[
            "--url",
            &server.url(),
            "--workload",
            "kinds",
            "--cycles",
            "40",
            "--only",
            only,
            "--json",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
        let r: Value = serde_json::from_slice(&out.stdout).expect("json");
        check_fields(&r);
        for kind in ["read", "permit"] {
            let k = &r["kinds"][kind];
            let measured = if only == "distlock" {
                &k["distlock"]
            } else {
                &k["baselines"][0]
            };
            assert_eq!(measured["cycles"], 40, "{only} {kind}: {k}");
        }
        scripts_run(&server) - before
    };
    assert_eq!(run("baselines"), 4 * 240, "the same-layout bare loops");
    assert_eq!(
        run("distlock"),
        4 * 240,
        "distlock's read and permit cycles"
    );
}

/// `EVALSHA` and `EVAL` calls that ran (`calls` less `failed_calls`: an `EVALSHA` answered `NOSCRIPT`
/// is sent again as `EVAL`).
fn scripts_run(server: &RedisServer) -> u64 {
    let info = server.command(&["INFO", "commandstats"]).expect("INFO");
    let info = info.as_str().unwrap_or_default().to_string();
    let field = |line: &str, name: &str| -> u64 {
        line.split(',')
            .find_map(|f| f.strip_prefix(name))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    ["evalsha", "eval"]
        .iter()
        .map(|command| {
            let prefix = format!("cmdstat_{command}:");
            info.lines()
                .find_map(|line| line.strip_prefix(&prefix))
                .map_or(0, |line| {
                    field(line, "calls=") - field(line, "failed_calls=")
                })
        })
        .sum()
}

/// PostgreSQL in advisory mode (the default): the kinds workload's bare loops (the shared pair with
/// the reader's token read, and the permit's bare statements) beside distlock's read-lock and permit
/// cycles, with their targets.
#[test]
fn postgres_report_has_the_kinds_and_their_bare_loops() {
    let server = PostgresServer::start_or_panic();
    let out = bench(&[
        "--url",
        &server.url(),
        "--workload",
        "kinds",
        "--duration",
        "200ms",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    let r: Value = serde_json::from_slice(&out.stdout).expect("json");
    check_fields(&r);
    assert!(
        r["uncontended"].is_null() && r["contended"].is_null(),
        "{r}"
    );
    let k = &r["kinds"];
    for kind in ["read", "permit"] {
        check_cycles(&k[kind]["distlock"], true);
        check_cycles(&k[kind]["baselines"][0], true);
    }
    check_kinds(
        &r,
        "bare pg_advisory_lock_shared + token read",
        "bare try key shared + slot key + counter bump",
        Some("PostgreSQL"),
    );
}

/// The label of the Redis (c) floor (`measure::PING_MUTEX_FLOOR`).
const PING_MUTEX_FLOOR: &str =
    "floor: in-process tokio Mutex, release = one PING then unlock, one shared connection";

/// The label of the Redis same-scripts loop on one shared connection (`measure::SAME_SCRIPTS_SHARED`).
const SAME_SCRIPTS_SHARED: &str = "same scripts as distlock (EVALSHA), one shared connection";

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
    // (c): the Lock RPC peer, then the harness's floor (an in-process mutex whose release is one put
    // and one range).
    let contended: Vec<&str> = r["contended"]["baselines"]
        .as_array()
        .expect("baselines")
        .iter()
        .map(|b| b["label"].as_str().expect("label"))
        .collect();
    assert_eq!(contended.len(), 2, "{contended:?}");
    assert!(contended[0].contains("Lock RPC"), "{contended:?}");
    assert_eq!(contended[1], PUT_RANGE_MUTEX_FLOOR);
    check_server_cpu(&r, "etcd process_cpu_seconds_total");
    check_target_rows(
        &r,
        &[
            "etcd (a)",
            "etcd (c)",
            "etcd (c) distlock / the harness floor",
        ],
    );
}

/// The label of the etcd (c) floor (`measure::PUT_RANGE_MUTEX_FLOOR`).
const PUT_RANGE_MUTEX_FLOOR: &str =
    "floor: in-process tokio Mutex, release = one put + one range then unlock, one shared client";

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
    check_fields(&r);
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
    // Two series (distlock shared, per task), in two panels: cycles/s and CPU per cycle.
    assert_eq!(svg.matches("<polyline").count(), 4, "{svg}");
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
    check_fields(&r);
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
    // 200 locks fit one pipeline: as many pipelines as round trips.
    assert_eq!(renewals["pipelines"], renewals["round_trips"], "{renewals}");
    assert_eq!(renewals["groups"], 1, "{renewals}");
    assert!(renewals["counted"]
        .as_str()
        .is_some_and(|c| c.contains("INFO commandstats")));
    assert!(h["memory"]["rss_holding_kib"].as_u64().is_some(), "{h}");
    assert!(h["cpu"]["client_ms_per_tick"].is_number(), "{h}");
    assert!(h["cpu"]["server_ms_per_tick"].is_number(), "{h}");
    assert!(h["memory"]["per_lock_bytes"].is_number(), "{h}");
    // The binary's counting allocator sees the held locks: live bytes and blocks grew, and the peak
    // during the hold is at least what is live at its end.
    let memory = &h["memory"];
    assert!(num(memory, "heap_per_lock_bytes") > 0.0, "{memory}");
    assert!(num(memory, "heap_blocks_per_lock") > 0.0, "{memory}");
    assert!(
        num(memory, "heap_peak_per_lock_bytes") >= num(memory, "heap_per_lock_bytes"),
        "{memory}"
    );
    assert!(r["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .any(|t| t["what"]
            .as_str()
            .is_some_and(|w| w.contains("round trips per tick"))));
}

// --- the JSON's fields of --sweep and --workload hold -----------------------------------------------

fn sweep_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[("baseline", OptStr), ("points", Arr(sweep_point_fields))],
    );
}

fn sweep_point_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("tasks", Num),
            ("distlock_shared", OptObj(cycle_fields)),
            ("distlock_per_task", OptObj(cycle_fields)),
            ("baseline", OptObj(cycle_fields)),
        ],
    );
}

fn herd_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(v, at, &[("processes", Num), ("runs", Arr(herd_run_fields))]);
}

fn herd_run_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("mode", Str),
            ("handoffs", Num),
            ("commands", Num),
            ("setup_commands", Num),
            ("lock_commands_per_handoff", Num),
            ("commands_per_handoff", Num),
            ("by_command", Obj(|_, _| {})),
            ("waiting_s", Num),
            ("budget_commands", Num),
            ("inverted_pairs", Num),
            ("pairs", Num),
            ("drain_s", Num),
        ],
    );
}

/// `--workload herd` on a Redis server: separate `distlock run` processes, once as the URL says and
/// once in fair mode; in fair mode they are granted in the order they arrived (no pair inverted), and
/// each sent at least its join, its take and its release (commands counted by MONITOR).
#[test]
fn herd_counts_the_processes_commands_and_fair_mode_keeps_arrival_order() {
    let server = RedisServer::start_or_panic();
    let report = bench_report(&["--url", &server.url(), "--workload", "herd", "--tasks", "4"]);
    let runs = report["herd"]["runs"].as_array().expect("runs");
    let modes: Vec<&str> = runs.iter().filter_map(|r| r["mode"].as_str()).collect();
    assert_eq!(modes, ["default", "fair"]);
    for run in runs {
        assert_eq!(num(run, "handoffs"), 4.0);
        assert_eq!(num(run, "pairs"), 6.0);
        assert!(num(run, "inverted_pairs") <= 6.0);
        assert!(num(run, "commands") >= num(run, "setup_commands"));
    }
    let fair = &runs[1];
    assert_eq!(num(fair, "inverted_pairs"), 0.0, "{fair}");
    assert!(num(&fair["by_command"], "evalsha") >= 12.0, "{fair}");
    // Not on an engine without MONITOR.
    let out = bench(&["--url", "memory://", "--workload", "herd"]);
    assert_eq!(out.status.code(), Some(64));
}

fn hold_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("locks", Num),
            ("lease_ms", Num),
            ("acquire_s", Num),
            ("acquire_concurrency", Num),
            ("held_s", Num),
            ("release_s", Num),
            ("renewals", Obj(hold_renewal_fields)),
            ("cpu", Obj(hold_cpu_fields)),
            ("memory", Obj(hold_memory_fields)),
            ("not_held", Num),
            ("lost", Num),
            ("loss_reason", OptStr),
        ],
    );
}

fn hold_renewal_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("batches", OptNum),
            ("renewals", OptNum),
            ("ticks", OptNum),
            ("expected_ticks", Num),
            ("round_trips", OptNum),
            ("round_trips_per_tick", OptNum),
            ("pipelines", OptNum),
            ("pipelines_per_tick", OptNum),
            ("groups", OptNum),
            ("server_commands", OptNum),
            ("server_commands_per_tick", OptNum),
            ("counted", Str),
        ],
    );
}

fn hold_cpu_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("client_ms_per_tick", OptNum),
            ("server_ms_per_tick", OptNum),
            ("per_renewal", Obj(cpu_fields)),
        ],
    );
}

fn hold_memory_fields(v: &Value, at: &str) {
    use Kind::*;
    fields(
        v,
        at,
        &[
            ("rss_before_kib", OptNum),
            ("rss_holding_kib", OptNum),
            ("per_lock_bytes", OptNum),
            ("heap_per_lock_bytes", OptNum),
            ("heap_blocks_per_lock", OptNum),
            ("heap_peak_per_lock_bytes", OptNum),
            ("heap_counted", Str),
            ("allocator_in_use_per_lock_bytes", OptNum),
            ("allocator_free_per_lock_bytes", OptNum),
            ("allocator_system_per_lock_bytes", OptNum),
            ("tasks_before", Num),
            ("tasks_holding", Num),
            ("tasks_per_lock", OptNum),
        ],
    );
}
