//! What `distlock bench` reports: one structure, printed as text for people or as JSON for scripts.

use std::fmt::Write as _;

use serde::Serialize;

use crate::cpu::CpuFigures;
use crate::harness::{Contended, Cycles};
use crate::stats::{fmt_count, fmt_us, round2, Latency};

/// The whole run.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The lock URL, password redacted.
    pub url: String,
    /// distlock's backend (`redis`, `file`, …), or the URL's scheme with `--baseline-only`.
    pub backend: String,
    pub duration_s: f64,
    pub runtime_workers: usize,
    /// `"cpu_us_per_cycle"`: the figure to judge by on a shared machine (see `primary_note`).
    pub primary_figure: &'static str,
    pub primary_note: &'static str,
    /// Where the server's CPU time is read for this run's measurements ("none: …" when nowhere).
    pub server_cpu_source: String,
    pub round_trip: RoundTrip,
    pub uncontended: Option<Uncontended>,
    pub many: Option<Many>,
    pub contended: Option<ContendedSection>,
    /// The kinds workload (issue 25): read-lock and permit cycles, each beside its same-layout bare
    /// loop.
    pub kinds: Option<KindsSection>,
    /// `--sweep`: (b) at 1 … 64 tasks.
    pub sweep: Option<crate::sweep::Sweep>,
    /// `--workload hold`: N locks held while the watchdog renews them.
    pub hold: Option<crate::hold::HoldSection>,
    /// `--workload herd`: separate `distlock run` processes on one Redis name, default and fair.
    pub herd: Option<crate::herd::HerdSection>,
    /// The issues' targets where they apply, computed from this run; never asserted.
    pub targets: Vec<Target>,
}

/// The figure the report's targets are judged by first.
pub const PRIMARY_FIGURE: &str = "cpu_us_per_cycle";
/// Why, as the report says it.
pub const PRIMARY_NOTE: &str = "CPU time per cycle (client + server) is the primary figure on a shared \
machine: wall-clock ratios swing by ~50 % between runs as the cores are shared; CPU per cycle does not.";

/// The engine's own round trip, measured in the same run; every ratio divides by `reference`'s mean.
#[derive(Debug, Serialize)]
pub struct RoundTrip {
    pub reference: Option<Probe>,
    /// Further probes (etcd: the range beside the put).
    pub others: Vec<Probe>,
    /// Why there is no reference: "no engine round trip" (memory, file) or what was not measured.
    pub note: Option<String>,
}

impl Report {
    /// The report as one pretty-printed JSON object, with a final newline.
    pub fn to_json(&self) -> Result<String, crate::Error> {
        let mut json = serde_json::to_string_pretty(self)
            .map_err(|e| crate::Error::unavailable(format!("cannot encode the report: {e}")))?;
        json.push('\n');
        Ok(json)
    }
}

impl RoundTrip {
    fn mean_us(&self) -> Option<f64> {
        self.reference
            .as_ref()
            .map(|p| p.latency.mean_us)
            .filter(|&m| m > 0.0)
    }
}

/// One round-trip probe.
#[derive(Debug, Serialize)]
pub struct Probe {
    pub label: String,
    pub calls_per_s: f64,
    pub latency: Latency,
    /// CPU time per call.
    pub cpu: CpuFigures,
}

impl Probe {
    pub fn new(label: impl Into<String>, run: &Cycles) -> Self {
        Self {
            label: label.into(),
            calls_per_s: round2(run.per_second()),
            latency: run.latency.summary(),
            cpu: run.cpu.per(run.cycles),
        }
    }
}

/// Figures of a cycles run.
#[derive(Debug, Serialize)]
pub struct CycleFigures {
    pub label: String,
    pub tasks: usize,
    pub cycles: u64,
    pub elapsed_s: f64,
    pub cycles_per_s: f64,
    /// One acquire + release, per cycle.
    pub latency: Latency,
    /// In round trips; absent when the engine has none.
    pub in_round_trips: Option<CycleRatios>,
    /// CPU time per cycle, client and server: the primary figure.
    pub cpu: CpuFigures,
}

/// A cycles run's figures divided by the mean round trip.
#[derive(Debug, Serialize)]
pub struct CycleRatios {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    /// 1 / (cycles/s), in round trips: what one cycle costs in aggregate throughput.
    pub time_per_cycle: f64,
}

impl CycleFigures {
    pub fn new(label: impl Into<String>, run: &Cycles, rtt: &RoundTrip) -> Self {
        let latency = run.latency.summary();
        let rate = run.per_second();
        let in_round_trips = rtt.mean_us().map(|rtt| CycleRatios {
            mean: round2(latency.mean_us / rtt),
            p50: round2(latency.p50_us / rtt),
            p99: round2(latency.p99_us / rtt),
            time_per_cycle: if rate > 0.0 {
                round2(1e6 / rate / rtt)
            } else {
                0.0
            },
        });
        Self {
            label: label.into(),
            tasks: run.tasks,
            cycles: run.cycles,
            elapsed_s: round2(run.elapsed.as_secs_f64()),
            cycles_per_s: round2(rate),
            latency,
            in_round_trips,
            cpu: run.cpu.per(run.cycles),
        }
    }
}

/// (a) one task, one name.
#[derive(Debug, Serialize)]
pub struct Uncontended {
    pub distlock: Option<CycleFigures>,
    /// The bare-client loop (Redis), the peer lock (etcd), the flock floor (file).
    pub baselines: Vec<CycleFigures>,
}

/// The kinds workload: one task, one name for each kind; the baselines are the same-layout bare loops
/// (none on engines without one).
#[derive(Debug, Serialize)]
pub struct KindsSection {
    /// The permits of the semaphore the permit cycles take one of.
    pub permit_limit: u32,
    /// Read-lock cycles (`read_write(name).read()` + release).
    pub read: Uncontended,
    /// Permit cycles (`semaphore(name, permit_limit).acquire()` + release).
    pub permit: Uncontended,
}

/// (b) many tasks, each on its own names.
#[derive(Debug, Serialize)]
pub struct Many {
    pub tasks: usize,
    /// All tasks share one `Locks` (one multiplexed connection where the engine has one).
    pub shared: Option<CycleFigures>,
    /// One `Locks` per task (`connect` per task).
    pub per_task: Option<CycleFigures>,
    pub baselines: Vec<CycleFigures>,
}

/// (c) many tasks on one name.
#[derive(Debug, Serialize)]
pub struct ContendedSection {
    pub tasks: usize,
    pub hold_us: f64,
    pub distlock: Option<ContendedFigures>,
    pub baselines: Vec<ContendedFigures>,
}

/// Figures of a contended run.
#[derive(Debug, Serialize)]
pub struct ContendedFigures {
    pub label: String,
    pub acquisitions: u64,
    pub elapsed_s: f64,
    pub acquisitions_per_s: f64,
    pub mean_hold_us: f64,
    /// 1 / mean hold: the rate with zero-cost handoffs.
    pub ceiling_per_s: f64,
    /// Release called → next acquire returned, over all consecutive acquisitions.
    pub handoff: Latency,
    /// The same where the next holder is another task.
    pub handoff_to_other: Latency,
    /// Acquire called → returned.
    pub wait: Latency,
    pub per_task_min: u64,
    pub per_task_max: u64,
    /// min / max acquisitions per task, in [0, 1]: 1 is perfectly even.
    pub fairness_min_max: f64,
    /// Share of acquisitions that went straight back to the task that had just released, in [0, 1].
    pub same_holder_share: f64,
    /// Acquisitions that returned before the previous holder released: mutual exclusion broken.
    pub overlaps: u64,
    /// Waits that ran out long after the end of the run (stuck waiters).
    pub gave_up: u64,
    pub in_round_trips: Option<ContendedRatios>,
    /// CPU time per acquisition (acquire, hold, release and the handoff), client and server.
    pub cpu: CpuFigures,
}

/// A contended run's latencies divided by the mean round trip.
#[derive(Debug, Serialize)]
pub struct ContendedRatios {
    pub handoff_p50: f64,
    pub handoff_p99: f64,
    pub to_other_p50: f64,
    pub to_other_p99: f64,
    /// (1 / acquisitions/s − mean hold): the dead time each acquisition costs.
    pub dead_time_per_acquisition: f64,
}

impl ContendedFigures {
    pub fn new(label: impl Into<String>, run: &Contended, rtt: &RoundTrip) -> Self {
        let rate = run.per_second();
        let hold_us = run.mean_hold.as_secs_f64() * 1e6;
        let handoff = run.handoff.summary();
        let handoff_to_other = run.to_other.summary();
        let min = run.per_task.iter().copied().min().unwrap_or(0);
        let max = run.per_task.iter().copied().max().unwrap_or(0);
        let in_round_trips = rtt.mean_us().map(|rtt| ContendedRatios {
            handoff_p50: round2(handoff.p50_us / rtt),
            handoff_p99: round2(handoff.p99_us / rtt),
            to_other_p50: round2(handoff_to_other.p50_us / rtt),
            to_other_p99: round2(handoff_to_other.p99_us / rtt),
            dead_time_per_acquisition: if rate > 0.0 {
                round2((1e6 / rate - hold_us).max(0.0) / rtt)
            } else {
                0.0
            },
        });
        Self {
            label: label.into(),
            acquisitions: run.acquisitions,
            elapsed_s: round2(run.elapsed.as_secs_f64()),
            acquisitions_per_s: round2(rate),
            mean_hold_us: round2(hold_us),
            ceiling_per_s: if hold_us > 0.0 {
                round2(1e6 / hold_us)
            } else {
                0.0
            },
            handoff,
            handoff_to_other,
            wait: run.wait.summary(),
            per_task_min: min,
            per_task_max: max,
            fairness_min_max: if max > 0 {
                round2(min as f64 / max as f64)
            } else {
                0.0
            },
            same_holder_share: if run.pairs > 0 {
                round2(run.same_holder as f64 / run.pairs as f64)
            } else {
                0.0
            },
            overlaps: run.overlaps,
            gave_up: run.gave_up,
            in_round_trips,
            cpu: run.cpu.per(run.acquisitions),
        }
    }
}

/// A target from the issues, checked against this run: as the wall-clock ratio the issue states
/// (`value`, `limit`, `met`) and, where the comparison has a CPU analogue and both sides a CPU figure,
/// as the ratio of CPU time per cycle (`cpu`), which is then the primary one.
#[derive(Debug, Serialize)]
pub struct Target {
    pub what: String,
    pub value: f64,
    /// `value <= limit` (`at_most`) or `value >= limit`.
    pub limit: f64,
    pub at_most: bool,
    pub met: bool,
    pub cpu: Option<CpuTarget>,
    /// `"cpu"` when `cpu` is present (the noise-robust figure), else `"wall_clock"`.
    pub primary: &'static str,
}

/// A target's CPU ratio: always distlock's total (client + server) CPU time per cycle over the
/// other's, so lower is better and it is met when `value <= limit`. A throughput target "≥ x" becomes
/// "≤ 1/x" here; a latency target "≤ x" stays "≤ x".
#[derive(Debug, Serialize)]
pub struct CpuTarget {
    pub what: String,
    pub value: f64,
    pub limit: f64,
    pub met: bool,
}

impl Target {
    pub fn at_most(what: impl Into<String>, value: f64, limit: f64) -> Self {
        Self {
            what: what.into(),
            value: round2(value),
            limit,
            at_most: true,
            met: value <= limit,
            cpu: None,
            primary: "wall_clock",
        }
    }

    pub fn at_least(what: impl Into<String>, value: f64, limit: f64) -> Self {
        Self {
            what: what.into(),
            value: round2(value),
            limit,
            at_most: false,
            met: value >= limit,
            cpu: None,
            primary: "wall_clock",
        }
    }

    /// Adds the CPU ratio `ours / theirs` (total µs per cycle) with its limit, when both are known
    /// and `theirs` is positive; it becomes the primary figure.
    pub fn with_cpu(
        mut self,
        what: impl Into<String>,
        ours: Option<f64>,
        theirs: Option<f64>,
        limit: f64,
    ) -> Self {
        if let (Some(ours), Some(theirs)) = (ours, theirs.filter(|t| *t > 0.0)) {
            let value = ours / theirs;
            self.cpu = Some(CpuTarget {
                what: what.into(),
                value: round2(value),
                limit: round2(limit),
                met: value <= limit,
            });
            self.primary = "cpu";
        }
        self
    }
}

// --- text ------------------------------------------------------------------------------------------

const BAR_WIDTH: f64 = 40.0;

/// The report as text.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let o = &mut out;
    let _ = writeln!(
        o,
        "distlock bench: {} (backend {}), {} per measurement, tokio multi-thread runtime with {} workers",
        report.url,
        report.backend,
        fmt_us(report.duration_s * 1e6),
        report.runtime_workers
    );
    let _ = writeln!(o, "{}", PRIMARY_NOTE);
    let _ = writeln!(
        o,
        "CPU columns: µs per cycle, client (this process, user + sys of every thread) + server ({}) = \
         total.",
        report.server_cpu_source
    );
    render_round_trip(o, &report.round_trip);
    let has_rtt = report.round_trip.reference.is_some();
    if let Some(a) = &report.uncontended {
        render_uncontended(o, a, has_rtt);
    }
    if let Some(b) = &report.many {
        render_many(o, b, has_rtt);
    }
    if let Some(c) = &report.contended {
        let _ = writeln!(
            o,
            "\n(c) contended: {} tasks, one name, hold {} (thread sleep)",
            c.tasks,
            fmt_us(c.hold_us)
        );
        for f in c.distlock.iter().chain(&c.baselines) {
            contended(o, f);
        }
    }
    if let Some(k) = &report.kinds {
        let _ = writeln!(
            o,
            "\n(kinds) read lock: 1 task, one name, read acquire + release"
        );
        render_cycles_with_ratio(o, &k.read, has_rtt);
        let _ = writeln!(
            o,
            "\n(kinds) permit: 1 task, one name, a semaphore of {} permits, acquire + release",
            k.permit_limit
        );
        render_cycles_with_ratio(o, &k.permit, has_rtt);
    }
    if let Some(sweep) = &report.sweep {
        render_sweep(o, sweep);
    }
    if let Some(herd) = &report.herd {
        crate::herd::render(o, herd);
    }
    if let Some(hold) = &report.hold {
        render_hold(o, hold);
    }
    render_targets(o, &report.targets);
    out
}

fn render_hold(o: &mut String, h: &crate::hold::HoldSection) {
    let _ = writeln!(
        o,
        "\nhold: one Locks, {} locks, lease {}; acquired in {:.2} s ({} in flight), held {:.2} s, released in {:.2} s",
        fmt_count(h.locks as f64),
        fmt_us(h.lease_ms * 1e3),
        h.acquire_s,
        h.acquire_concurrency,
        h.held_s,
        h.release_s
    );
    let r = &h.renewals;
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}"));
    let count = |v: Option<u64>| v.map_or_else(|| "n/a".to_string(), |v| fmt_count(v as f64));
    let _ = writeln!(
        o,
        "  renewals: {} in {} batches = {} ticks (lease / 3 cadence: {:.2}); round trips {} = {} per tick; server renew commands {} = {} per tick",
        count(r.renewals),
        count(r.batches),
        opt(r.ticks),
        r.expected_ticks,
        count(r.round_trips),
        opt(r.round_trips_per_tick),
        count(r.server_commands),
        opt(r.server_commands_per_tick)
    );
    let _ = writeln!(o, "  counted: {}", r.counted);
    let _ = writeln!(
        o,
        "  CPU per tick: client {} ms, server {} ms ({} µs + {} µs per renewal; server: {})",
        opt(h.cpu.client_ms_per_tick),
        opt(h.cpu.server_ms_per_tick),
        h.cpu.per_renewal.client_us_per_cycle,
        opt(h.cpu.per_renewal.server_us_per_cycle),
        h.cpu.per_renewal.server_source
    );
    let m = &h.memory;
    let _ = writeln!(
        o,
        "  resident memory: {} KiB before, {} KiB holding = {} bytes per held lock (an upper bound: RSS growth, allocator slack included)",
        count(m.rss_before_kib),
        count(m.rss_holding_kib),
        opt(m.per_lock_bytes)
    );
    let _ = writeln!(
        o,
        "  live heap: {} bytes in {} blocks per held lock; peak during the hold {} bytes per lock ({})",
        opt(m.heap_per_lock_bytes),
        opt(m.heap_blocks_per_lock),
        opt(m.heap_peak_per_lock_bytes),
        m.heap_counted
    );
    let _ = writeln!(
        o,
        "  tokio tasks: {} before, {} holding = {} per held lock",
        m.tasks_before,
        m.tasks_holding,
        opt(m.tasks_per_lock)
    );
    let _ = writeln!(
        o,
        "  not Held at the end: {} (lost {}){}",
        h.not_held,
        h.lost,
        h.loss_reason
            .as_ref()
            .map_or_else(String::new, |r| format!("; first reason: {r}"))
    );
}

/// The sweep as one table: a row per task count and series.
fn render_sweep(o: &mut String, sweep: &crate::sweep::Sweep) {
    let _ = writeln!(
        o,
        "\n(b) sweep: each task on its own name, at {} tasks",
        crate::sweep::SWEEP_TASKS.map(|n| n.to_string()).join(", ")
    );
    let width = sweep
        .points
        .iter()
        .flat_map(|p| p.figures())
        .map(|f| f.label.chars().count())
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        o,
        "  {:>5}  {:<width$} {:>10} {:>9} {:>9}  CPU per cycle: client + server = total",
        "tasks", "", "cycles/s", "p50", "p99"
    );
    for point in &sweep.points {
        for f in point.figures() {
            let cpu = &f.cpu;
            let server = cpu
                .server_us_per_cycle
                .map_or_else(|| "n/a".to_string(), fmt_us);
            let total = cpu
                .total_us_per_cycle
                .map_or_else(|| "n/a".to_string(), fmt_us);
            let _ = writeln!(
                o,
                "  {:>5}  {:<width$} {:>10} {:>9} {:>9}  {} + {} = {}",
                point.tasks,
                f.label,
                fmt_count(f.cycles_per_s),
                fmt_us(f.latency.p50_us),
                fmt_us(f.latency.p99_us),
                fmt_us(cpu.client_us_per_cycle),
                server,
                total,
            );
        }
    }
}

fn render_round_trip(o: &mut String, rtt: &RoundTrip) {
    match &rtt.reference {
        Some(probe) => {
            let _ = writeln!(
                o,
                "engine round trip (ratios below are to its mean, as ×RTT):"
            );
            for p in std::iter::once(probe).chain(&rtt.others) {
                let l = &p.latency;
                let _ = writeln!(
                    o,
                    "  {:<44} mean {:>9}  p50 {:>9}  p99 {:>9}  {:>9}/s  CPU {}",
                    p.label,
                    fmt_us(l.mean_us),
                    fmt_us(l.p50_us),
                    fmt_us(l.p99_us),
                    fmt_count(p.calls_per_s),
                    fmt_cpu(&p.cpu)
                );
            }
        }
        None => {
            let _ = writeln!(
                o,
                "engine round trip: {}",
                rtt.note.as_deref().unwrap_or("none")
            );
        }
    }
}

fn render_uncontended(o: &mut String, a: &Uncontended, has_rtt: bool) {
    let _ = writeln!(o, "\n(a) uncontended: 1 task, one name, acquire + release");
    render_cycles_with_ratio(o, a, has_rtt);
}

/// distlock's row and the baselines', distlock's mean cycle as a ratio to the first baseline's, and
/// the histograms.
fn render_cycles_with_ratio(o: &mut String, a: &Uncontended, has_rtt: bool) {
    cycle_table(o, a.distlock.iter().chain(&a.baselines), has_rtt);
    if let (Some(d), Some(b)) = (&a.distlock, a.baselines.first()) {
        if b.latency.mean_us > 0.0 {
            let _ = writeln!(
                o,
                "  distlock's mean cycle = {:.2}× {}'s{}",
                d.latency.mean_us / b.latency.mean_us,
                b.label,
                cpu_ratio(&d.cpu, &b.cpu)
            );
        }
    }
    for f in a.distlock.iter().chain(&a.baselines) {
        histogram(o, &format!("{} cycle", f.label), &f.latency);
    }
}

fn render_many(o: &mut String, b: &Many, has_rtt: bool) {
    let _ = writeln!(
        o,
        "\n(b) many names: {} tasks, each on its own name",
        b.tasks
    );
    cycle_table(
        o,
        b.shared.iter().chain(&b.per_task).chain(&b.baselines),
        has_rtt,
    );
    if let Some(base) = b.baselines.first().filter(|f| f.cycles_per_s > 0.0) {
        for f in b.shared.iter().chain(&b.per_task) {
            let _ = writeln!(
                o,
                "  {}: {:.2}× {}'s cycles/s{}",
                f.label,
                f.cycles_per_s / base.cycles_per_s,
                base.label,
                cpu_ratio(&f.cpu, &base.cpu)
            );
        }
    }
    for f in b.shared.iter().chain(&b.per_task) {
        histogram(o, &format!("{} cycle", f.label), &f.latency);
    }
}

fn render_targets(o: &mut String, targets: &[Target]) {
    if targets.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "\ntargets (from the issues; measured, never asserted). Each row: the wall-clock ratio, then \
         the CPU ratio\n(distlock's total CPU per cycle / the other's, lower is better), which is the \
         primary one where present:"
    );
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    for t in targets {
        let mark = |figure: &str| if t.primary == figure { "*" } else { " " };
        let _ = writeln!(
            o,
            "  {:<66} {}wall {:>7.2} {} {:<5} {:<6}",
            t.what,
            mark("wall_clock"),
            t.value,
            if t.at_most { "≤" } else { "≥" },
            t.limit,
            verdict(t.met)
        );
        if let Some(cpu) = &t.cpu {
            let _ = writeln!(
                o,
                "    {:<64} {}CPU  {:>7.2} ≤ {:<5} {:<6}",
                cpu.what,
                mark("cpu"),
                cpu.value,
                cpu.limit,
                verdict(cpu.met)
            );
        }
    }
    let _ = writeln!(o, "  (* the primary figure of the row)");
}

/// `; CPU per cycle 1.05×` (ours / theirs), when both totals are known.
fn cpu_ratio(ours: &CpuFigures, theirs: &CpuFigures) -> String {
    match (ours.total_us_per_cycle, theirs.total_us_per_cycle) {
        (Some(a), Some(b)) if b > 0.0 => format!("; CPU per cycle {:.2}×", a / b),
        _ => String::new(),
    }
}

/// `12.3 + 45.6 = 57.9 µs` (client + server = total), `12.3 µs in-process`, or `12.3 + ? µs`.
fn fmt_cpu(cpu: &CpuFigures) -> String {
    match (cpu.server_us_per_cycle, cpu.total_us_per_cycle) {
        (Some(server), Some(total)) => format!(
            "{:.1} + {:.1} = {:.1} µs",
            cpu.client_us_per_cycle, server, total
        ),
        (None, Some(total)) => format!("{total:.1} µs (in-process)"),
        _ => format!("{:.1} + ? µs", cpu.client_us_per_cycle),
    }
}

fn cycle_table<'a>(o: &mut String, rows: impl Iterator<Item = &'a CycleFigures>, has_rtt: bool) {
    let rows: Vec<&CycleFigures> = rows.collect();
    let width = rows
        .iter()
        .map(|f| f.label.chars().count())
        .max()
        .unwrap_or(0);
    let _ = writeln!(
        o,
        "  {:<width$} {:>10} {:>9} {:>9} {:>9}  {:<32} {}",
        "",
        "cycles/s",
        "mean",
        "p50",
        "p99",
        "CPU/cycle client + server",
        if has_rtt {
            "×RTT mean / p50 / p99 / per cycle"
        } else {
            ""
        }
    );
    for f in rows {
        let l = &f.latency;
        let ratios = match &f.in_round_trips {
            Some(r) => format!(
                "{:.2} / {:.2} / {:.2} / {:.2}",
                r.mean, r.p50, r.p99, r.time_per_cycle
            ),
            None => "no engine round trip".to_string(),
        };
        let _ = writeln!(
            o,
            "  {:<width$} {:>10} {:>9} {:>9} {:>9}  {:<32} {}",
            f.label,
            fmt_count(f.cycles_per_s),
            fmt_us(l.mean_us),
            fmt_us(l.p50_us),
            fmt_us(l.p99_us),
            fmt_cpu(&f.cpu),
            ratios
        );
    }
}

fn contended(o: &mut String, f: &ContendedFigures) {
    let _ = writeln!(
        o,
        "  {}: {} acquisitions/s ({} in {:.2} s; ceiling 1 / mean hold {} = {}/s)",
        f.label,
        fmt_count(f.acquisitions_per_s),
        fmt_count(f.acquisitions as f64),
        f.elapsed_s,
        fmt_us(f.mean_hold_us),
        fmt_count(f.ceiling_per_s)
    );
    let r = f.in_round_trips.as_ref();
    let line = |o: &mut String, what: &str, l: &Latency, p50: Option<f64>, p99: Option<f64>| {
        let ratios = match (p50, p99) {
            (Some(a), Some(b)) => format!("  = {a:.2} / {b:.2} ×RTT"),
            _ => String::new(),
        };
        let _ = writeln!(
            o,
            "    {:<40} n {:>7}  p50 {:>9}  p99 {:>9}  mean {:>9}{}",
            what,
            fmt_count(l.n as f64),
            fmt_us(l.p50_us),
            fmt_us(l.p99_us),
            fmt_us(l.mean_us),
            ratios
        );
    };
    line(
        o,
        "handoff (release → next grant)",
        &f.handoff,
        r.map(|r| r.handoff_p50),
        r.map(|r| r.handoff_p99),
    );
    line(
        o,
        "handoff to another task",
        &f.handoff_to_other,
        r.map(|r| r.to_other_p50),
        r.map(|r| r.to_other_p99),
    );
    line(o, "wait (acquire called → returned)", &f.wait, None, None);
    let _ = writeln!(
        o,
        "    CPU per acquisition (client + server)      {}",
        fmt_cpu(&f.cpu)
    );
    let _ = writeln!(
        o,
        "    fairness min/max per task {}/{} = {:.2}; same-holder share {:.2}; overlaps {}; gave up {}",
        f.per_task_min,
        f.per_task_max,
        f.fairness_min_max,
        f.same_holder_share,
        f.overlaps,
        f.gave_up
    );
    match r {
        Some(r) => {
            let _ = writeln!(
                o,
                "    dead time per acquisition (1 / rate − hold) = {:.2} ×RTT",
                r.dead_time_per_acquisition
            );
        }
        None => {
            let _ = writeln!(o, "    (no engine round trip: absolute figures only)");
        }
    }
    histogram(o, &format!("{} handoff", f.label), &f.handoff);
}

/// A text histogram: one bar per 1-2-5 bucket.
fn histogram(o: &mut String, title: &str, l: &Latency) {
    if l.histogram.is_empty() {
        return;
    }
    let _ = writeln!(o, "  {title} latency:");
    let peak = l
        .histogram
        .iter()
        .map(|b| b.count)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let total = l.n.max(1) as f64;
    for b in &l.histogram {
        let range = match b.to_us {
            Some(to) => format!("{} – {}", fmt_us(b.from_us), fmt_us(to)),
            None => format!("≥ {}", fmt_us(b.from_us)),
        };
        let width = if b.count == 0 {
            0
        } else {
            ((b.count as f64 / peak * BAR_WIDTH).ceil() as usize).max(1)
        };
        let _ = writeln!(
            o,
            "    {:>21} {:<40} {:>9} {:>6.2}%",
            range,
            "#".repeat(width),
            fmt_count(b.count as f64),
            b.count as f64 / total * 100.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuSpent;
    use std::time::Duration;

    fn spent(client_ms: u64, server_ms: u64) -> CpuSpent {
        CpuSpent {
            client: Duration::from_millis(client_ms),
            client_system_share: None,
            server: Some(Duration::from_millis(server_ms)),
            in_process: false,
            server_source: "redis INFO cpu".to_string(),
        }
    }

    /// A throughput target "≥ 0.9" is "≤ 1/0.9" in CPU per cycle: ours / theirs, lower is better.
    #[test]
    fn cpu_ratio_of_a_throughput_target_is_ours_over_theirs() {
        let ours = spent(30, 30).per(1000); // 60 µs per cycle
        let theirs = spent(25, 25).per(1000); // 50 µs per cycle
        let t = Target::at_least("rate", 1.2, 0.9).with_cpu(
            "cpu",
            ours.total_us_per_cycle,
            theirs.total_us_per_cycle,
            1.0 / 0.9,
        );
        let cpu = t.cpu.as_ref().expect("a CPU ratio");
        assert_eq!((cpu.value, cpu.met, t.primary), (1.2, false, "cpu"));
    }

    /// A run that did nothing (every contended wait gave up) meets no target: before, its CPU per
    /// acquisition was 0 µs, a CPU ratio of 0, "met", and the primary figure of the row.
    #[test]
    fn nothing_done_meets_no_cpu_target() {
        let nothing = spent(5, 5).per(0);
        let theirs = spent(25, 25).per(1000);
        let t = Target::at_least("acquisitions/s / floor", 0.0, 0.9).with_cpu(
            "cpu",
            nothing.total_us_per_cycle,
            theirs.total_us_per_cycle,
            1.0 / 0.9,
        );
        assert!(t.cpu.is_none(), "{:?}", t.cpu);
        assert_eq!((t.primary, t.met), ("wall_clock", false));
    }
}
