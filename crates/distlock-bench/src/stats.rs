//! Latency recording (HDR histograms in nanoseconds) and the summaries the report shows.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// The longest latency recorded exactly; longer ones are clamped (a minute is far past any stall worth
/// telling apart).
const MAX_NANOS: u64 = 60_000_000_000;

/// Latencies of one measurement, in nanoseconds.
#[derive(Debug, Clone)]
pub struct Recorder {
    histogram: Histogram<u64>,
}

impl Recorder {
    // Three significant digits over 1 ns..60 s. hdrhistogram only refuses bounds like low < 1,
    // high < 2 × low or more than 5 digits; these are constants that satisfy all three.
    #[allow(clippy::expect_used)]
    pub fn new() -> Self {
        let histogram =
            Histogram::new_with_bounds(1, MAX_NANOS, 3).expect("constant, valid histogram bounds");
        Self { histogram }
    }

    pub fn record(&mut self, latency: Duration) {
        let nanos = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.histogram.saturating_record(nanos.clamp(1, MAX_NANOS));
    }

    /// Adds another recorder's samples (both share the bounds, so nothing is lost).
    pub fn merge(&mut self, other: &Recorder) {
        if self.histogram.add(&other.histogram).is_err() {
            // Cannot happen with equal bounds; re-recording value by value loses nothing either way.
            for v in other.histogram.iter_recorded() {
                self.histogram
                    .saturating_record_n(v.value_iterated_to(), v.count_at_value());
            }
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> u64 {
        self.histogram.len()
    }

    /// The summary, with the text histogram's buckets.
    pub fn summary(&self) -> Latency {
        let h = &self.histogram;
        let us = |nanos: f64| round2(nanos / 1000.0);
        if h.is_empty() {
            return Latency::default();
        }
        Latency {
            n: h.len(),
            mean_us: us(h.mean()),
            p50_us: us(h.value_at_quantile(0.50) as f64),
            p99_us: us(h.value_at_quantile(0.99) as f64),
            max_us: us(h.max() as f64),
            histogram: self.buckets(),
        }
    }

    /// Counts per 1-2-5 bucket, from the first non-empty bucket to the last.
    fn buckets(&self) -> Vec<Bucket> {
        let bounds = bucket_bounds();
        let mut counts = vec![0u64; bounds.len()];
        for v in self.histogram.iter_recorded() {
            // Bucket i holds [bounds[i-1], bounds[i]); the last one is open-ended.
            let value = self.histogram.highest_equivalent(v.value_iterated_to());
            let i = bounds
                .iter()
                .position(|&b| value < b)
                .unwrap_or(bounds.len() - 1);
            counts[i] += v.count_at_value();
        }
        let Some(first) = counts.iter().position(|&c| c > 0) else {
            return Vec::new();
        };
        let last = counts.iter().rposition(|&c| c > 0).unwrap_or(first);
        (first..=last)
            .map(|i| Bucket {
                from_us: if i == 0 {
                    0.0
                } else {
                    bounds[i - 1] as f64 / 1000.0
                },
                to_us: (i + 1 < bounds.len()).then(|| bounds[i] as f64 / 1000.0),
                count: counts[i],
            })
            .collect()
    }
}

/// 100 ns, 200 ns, 500 ns, 1 µs, … 50 s: the upper bounds of the text histogram's buckets.
fn bucket_bounds() -> Vec<u64> {
    let mut bounds = Vec::new();
    let mut decade = 100u64;
    while decade <= 10_000_000_000 {
        for m in [1, 2, 5] {
            bounds.push(decade * m);
        }
        decade *= 10;
    }
    bounds
}

/// A latency distribution, in microseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Latency {
    pub n: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub histogram: Vec<Bucket>,
}

/// One bar of the text histogram: samples in `[from_us, to_us)` (`to_us` absent for the last,
/// open-ended bucket).
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    pub from_us: f64,
    pub to_us: Option<f64>,
    pub count: u64,
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// `812 ns`, `83.2 µs`, `1.23 ms`, `2.5 s`.
pub fn fmt_us(us: f64) -> String {
    if us < 1.0 {
        format!("{:.0} ns", us * 1000.0)
    } else if us < 100.0 {
        format!("{us:.1} µs")
    } else if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 10_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else if us < 100_000.0 {
        format!("{:.1} ms", us / 1000.0)
    } else if us < 1_000_000.0 {
        format!("{:.0} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1_000_000.0)
    }
}

/// `11,843`: whole numbers with thousands separators.
pub fn fmt_count(x: f64) -> String {
    let whole = format!("{:.0}", x.max(0.0));
    let mut out = String::with_capacity(whole.len() + whole.len() / 3);
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_and_buckets() {
        let mut r = Recorder::new();
        for us in [50u64, 60, 70, 80, 3000] {
            r.record(Duration::from_micros(us));
        }
        let s = r.summary();
        assert_eq!(s.n, 5);
        assert!(s.p50_us >= 69.0 && s.p50_us <= 71.0, "{s:?}");
        assert!(s.p50_us <= s.p99_us && s.p99_us <= s.max_us);
        let total: u64 = s.histogram.iter().map(|b| b.count).sum();
        assert_eq!(total, 5);
        assert_eq!(s.histogram[0].from_us, 50.0);
        assert_eq!(s.histogram.last().map(|b| b.count), Some(1));
    }

    #[test]
    fn merge_keeps_every_sample() {
        let mut a = Recorder::new();
        let mut b = Recorder::new();
        a.record(Duration::from_micros(1));
        b.record(Duration::from_millis(1));
        a.merge(&b);
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn formats() {
        assert_eq!(fmt_us(0.5), "500 ns");
        assert_eq!(fmt_us(83.24), "83.2 µs");
        assert_eq!(fmt_us(1234.0), "1.23 ms");
        assert_eq!(fmt_count(11843.4), "11,843");
        assert_eq!(fmt_count(999.0), "999");
        assert_eq!(fmt_count(1_000_000.0), "1,000,000");
    }
}
