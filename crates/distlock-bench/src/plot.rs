//! `--plot out.svg`: a small line chart of the sweep, written by the bench itself (no plotting
//! crate): one panel per figure (cycles/s, and any other figure a sweep point carries), tasks on a
//! log2 x-axis, axes with ticks, one line per series and a legend.

use std::fmt::Write as _;

use crate::sweep::Sweep;

const WIDTH: f64 = 840.0;
const PANEL_HEIGHT: f64 = 340.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 300.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// One line: `(x, y)` points, x > 0.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One panel: a y-axis title and its lines.
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// The sweep's panels: cycles/s against tasks, and CPU time per cycle (client + server) where the
/// run has it, one series per label of the sweep's figures.
pub fn sweep_panels(sweep: &Sweep) -> Vec<Panel> {
    let mut rate: Vec<Series> = Vec::new();
    let mut cpu: Vec<Series> = Vec::new();
    for point in &sweep.points {
        for f in point.figures() {
            let x = point.tasks as f64;
            add(&mut rate, &f.label, (x, f.cycles_per_s));
            if let Some(total) = f.cpu.total_us_per_cycle {
                add(&mut cpu, &f.label, (x, total));
            }
        }
    }
    let mut panels = vec![Panel {
        title: "cycles/s (all tasks together)".to_string(),
        series: rate,
    }];
    if !cpu.is_empty() {
        panels.push(Panel {
            title: "CPU µs per cycle (client + server)".to_string(),
            series: cpu,
        });
    }
    panels
}

fn add(series: &mut Vec<Series>, label: &str, xy: (f64, f64)) {
    match series.iter_mut().find(|s| s.label == label) {
        Some(s) => s.points.push(xy),
        None => series.push(Series {
            label: label.to_string(),
            points: vec![xy],
        }),
    }
}

/// The sweep as an SVG document.
pub fn sweep_svg(sweep: &Sweep, title: &str) -> String {
    svg(title, &sweep_panels(sweep))
}

/// Panels stacked vertically, sharing the x-axis (tasks, log2).
pub fn svg(title: &str, panels: &[Panel]) -> String {
    let height = TOP + PANEL_HEIGHT * panels.len().max(1) as f64;
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
        WIDTH / 2.0,
        escape(title)
    );
    for (i, panel) in panels.iter().enumerate() {
        draw_panel(&mut o, panel, TOP + PANEL_HEIGHT * i as f64);
    }
    o.push_str("</svg>\n");
    o
}

fn draw_panel(o: &mut String, panel: &Panel, top: f64) {
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (y0, y1) = (top + PANEL_HEIGHT - BOTTOM, top + 10.0);
    let xs: Vec<f64> = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|x| *x > 0.0)
        .collect();
    let (lo, hi) = xs.iter().fold((f64::MAX, f64::MIN), |(lo, hi), &x| {
        (lo.min(x.log2()), hi.max(x.log2()))
    });
    let (lo, hi) = if lo <= hi {
        (lo, hi.max(lo + 1.0))
    } else {
        (0.0, 1.0)
    };
    let y_max = panel
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let (step, top_value) = nice_scale(y_max);
    let px = |x: f64| x0 + (x.max(f64::MIN_POSITIVE).log2() - lo) / (hi - lo) * (x1 - x0);
    let py = |y: f64| y0 - y / top_value * (y0 - y1);

    // Axes, grid and ticks.
    let _ = writeln!(
        o,
        r##"<path d="M{x0},{y1} V{y0} H{x1}" fill="none" stroke="#333"/>"##
    );
    let mut v = 0.0;
    while v <= top_value + step / 2.0 {
        let y = py(v);
        let _ = writeln!(
            o,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            y + 4.0,
            escape(&tick_label(v))
        );
        v += step;
    }
    let mut ticks: Vec<f64> = xs.clone();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    for x in ticks {
        let x_px = px(x);
        let _ = writeln!(
            o,
            r##"<line x1="{x_px:.1}" y1="{y0}" x2="{x_px:.1}" y2="{}" stroke="#333"/><text x="{x_px:.1}" y="{}" text-anchor="middle">{}</text>"##,
            y0 + 5.0,
            y0 + 18.0,
            escape(&tick_label(x))
        );
    }
    let _ = writeln!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">tasks (log2 scale)</text>"#,
        (x0 + x1) / 2.0,
        y0 + 38.0
    );
    let _ = writeln!(
        o,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (y0 + y1) / 2.0,
        escape(&panel.title)
    );

    // Lines, markers and the legend.
    for (i, series) in panel.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<String> = series
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            o,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.join(" ")
        );
        for &(x, y) in &series.points {
            let _ = writeln!(
                o,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = y1 + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            o,
            r#"<line x1="{}" y1="{ly:.1}" x2="{}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/><text x="{}" y="{:.1}">{}</text>"#,
            x1 + 12.0,
            x1 + 32.0,
            x1 + 38.0,
            ly + 4.0,
            escape(&series.label)
        );
    }
}

/// A 1-2-5 step giving about five ticks up to at least `max`, and the top of the axis.
fn nice_scale(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 1.0);
    }
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    (step, (max / step).ceil() * step)
}

/// A tick value: integers as such, thousands as `k`, small fractions with two decimals.
fn tick_label(v: f64) -> String {
    if v >= 1000.0 && (v / 1000.0).fract() == 0.0 {
        format!("{}k", v / 1000.0)
    } else if v.fract() == 0.0 {
        format!("{v}")
    } else {
        format!("{v:.2}")
    }
}

/// Text for SVG content and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_is_well_formed_with_one_polyline_per_series_and_escaped_labels() {
        let series = |label: &str, k: f64| Series {
            label: label.to_string(),
            points: [1.0f64, 2.0, 4.0, 8.0, 16.0, 64.0]
                .iter()
                .map(|&x| (x, k * x.sqrt()))
                .collect(),
        };
        let panels = [
            Panel {
                title: "cycles/s".into(),
                series: vec![
                    series("distlock <shared> & co", 1000.0),
                    series("bare", 900.0),
                ],
            },
            Panel {
                title: "CPU µs per cycle".into(),
                series: vec![series("x", 0.5)],
            },
        ];
        let svg = svg("sweep \"redis\"", &panels);
        assert!(svg.starts_with("<svg "), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(svg.contains("distlock &lt;shared&gt; &amp; co"));
        assert!(svg.contains("sweep &quot;redis&quot;"));
        assert!(!svg.contains("<shared>"));
        // Every element opened is closed: self-closing ones aside, `<text>` and `<svg>` pair up.
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        assert_eq!(svg.matches("<svg").count(), svg.matches("</svg>").count());
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
    }

    #[test]
    fn scales_are_nice() {
        assert_eq!(nice_scale(57_000.0), (20_000.0, 60_000.0));
        assert_eq!(nice_scale(0.0), (1.0, 1.0));
        assert_eq!(tick_label(20_000.0), "20k");
        assert_eq!(tick_label(64.0), "64");
    }
}
