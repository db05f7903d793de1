//! The figures of the "walbox and Debezium" section, drawn as SVG from
//! the same medians and ranges as its tables: the latency curve, events/s
//! and CPU per event per backlog, peak RSS, and the duplicates of every
//! kill. Each bar or point is a median, its whisker the range over the
//! runs.

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::peers::{backlog_relays, point_name, CURVE_RELAYS, KILLED_STREAMING, RATES, RELAYS};
use crate::relay::Kind;
use crate::results::Results;
use crate::Scale;

/// A figure: its file name and what the document says of it.
pub(crate) struct Figure {
    pub(crate) file: &'static str,
    pub(crate) alt: &'static str,
}

/// The RSS over time figure, from the `conduit` phase.
pub(crate) const RSS_OVER_TIME: &str = "shapes-rss-over-time.svg";

/// Every figure this module draws, as the sections link them.
pub(crate) const ALL: [Figure; 6] = [
    Figure {
        file: "peers-events-per-second.svg",
        alt: "Events per second draining each backlog, warm relays (higher is better)",
    },
    Figure {
        file: "peers-cpu-per-event.svg",
        alt: "Relay CPU µs per event draining each backlog (lower is better)",
    },
    Figure {
        file: "peers-peak-rss.svg",
        alt: "Peak RSS of each relay, MiB (lower is better)",
    },
    Figure {
        file: "peers-latency.svg",
        alt: "p50 (dashed) and p99 (solid) commit → on the topic at each rate (lower is better)",
    },
    Figure {
        file: "peers-kill-duplicates.svg",
        alt: "Duplicates after each kill -9, one dot per kill",
    },
    Figure {
        file: RSS_OVER_TIME,
        alt: "RSS from launch until the Conduit-shaped backlog is drained (median of the runs)",
    },
];

fn figure(file: &str) -> &'static Figure {
    ALL.iter()
        .find(|f| f.file == file)
        .expect("a figure of ALL")
}

const SIZE: (u32, u32) = (760, 380);

/// One colour per reader, the same in every figure.
fn colour(reader: &str) -> RGBColor {
    match reader {
        "walbox" => RGBColor(0x1f, 0x77, 0xb4),
        "pg_recvlogical" => RGBColor(0x7f, 0x7f, 0x7f),
        r if r.contains("1 ms") || r.contains("256") => RGBColor(0xff, 0xbb, 0x78),
        r if r.contains("512") => RGBColor(0xff, 0x98, 0x96),
        r if r.contains("60 s") => RGBColor(0x8c, 0x56, 0x4b),
        _ => RGBColor(0xd6, 0x27, 0x28),
    }
}

/// How a figure names a relay: shorter than the tables.
fn short(kind: Kind) -> String {
    match kind {
        Kind::Walbox => "walbox".into(),
        Kind::WalboxExactlyOnce => "walbox, exactly-once".into(),
        Kind::Debezium(d) => {
            let mut s = "Debezium".to_owned();
            if d.heap_mib != crate::relay::DEBEZIUM_HEAP_MIB {
                s += &format!(" -Xmx{}M", d.heap_mib);
            }
            if d.poll_ms != crate::relay::DEBEZIUM_POLL_MS {
                s += &format!(", poll {} ms", d.poll_ms);
            }
            if d.flush_ms != crate::relay::DEBEZIUM_FLUSH_MS {
                s += &format!(", flush {} s", d.flush_ms / 1000);
            }
            s
        }
    }
}

/// A bar: its median and range.
struct Bar {
    median: f64,
    low: f64,
    high: f64,
}

fn bar(r: &Results, phase: &str, metric: &str) -> Option<Bar> {
    let v = r.all(phase, metric);
    Some(Bar {
        median: r.median(phase, metric)?,
        low: *v.first()?,
        high: *v.last()?,
    })
}

/// Draws every figure the results allow into `dir`; returns those drawn.
pub(crate) fn draw(r: &Results, scale: Scale, dir: &Path) -> Result<Vec<&'static str>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let mut drawn = Vec::new();
    let backlogs: Vec<_> = scale
        .backlogs()
        .into_iter()
        .filter(|b| r.has(b.phase, "events"))
        .collect();
    if !backlogs.is_empty() {
        let groups: Vec<String> = backlogs.iter().map(|b| b.phase.to_owned()).collect();
        let readers = |with_recvlogical: bool| {
            let mut v: Vec<(String, String)> = Vec::new();
            if with_recvlogical {
                v.push(("pg_recvlogical".into(), "recvlogical".into()));
            }
            for k in backlog_relays() {
                v.push((short(k), k.slot()));
            }
            v
        };
        let table = |metric: &str, with_recvlogical: bool| -> Vec<(String, Vec<Option<Bar>>)> {
            readers(with_recvlogical)
                .into_iter()
                .map(|(name, key)| {
                    let bars = backlogs
                        .iter()
                        .map(|b| bar(r, b.phase, &format!("{key}_{metric}")))
                        .collect::<Vec<_>>();
                    (name, bars)
                })
                .filter(|(_, bars)| bars.iter().any(Option::is_some))
                .collect()
        };
        for (file, metric, recv, y) in [
            ("peers-events-per-second.svg", "eps", true, "events/s"),
            (
                "peers-cpu-per-event.svg",
                "cpu_us",
                false,
                "CPU µs per event",
            ),
            ("peers-peak-rss.svg", "rss_mib", false, "peak RSS, MiB"),
        ] {
            let series = table(metric, recv);
            if series.is_empty() {
                continue;
            }
            bars(&dir.join(file), figure(file).alt, y, &groups, &series)?;
            drawn.push(file);
        }
    }
    if r.has("curve", "walbox_1000_events") {
        let file = "peers-latency.svg";
        latency(&dir.join(file), figure(file).alt, r)?;
        drawn.push(file);
    }
    if r.has("kill", "events") {
        let file = "peers-kill-duplicates.svg";
        kills(&dir.join(file), figure(file).alt, r)?;
        drawn.push(file);
    }
    if r.has("conduit", "events") {
        rss_over_time(&dir.join(RSS_OVER_TIME), figure(RSS_OVER_TIME).alt, r)?;
        drawn.push(RSS_OVER_TIME);
    }
    Ok(drawn)
}

/// A chart over `x` × `y` on a white `root`, titled, its y labels
/// `y_area` pixels wide.
fn canvas<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    title: &str,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    y_area: u32,
) -> Result<Chart<'a, 'b>, String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    ChartBuilder::on(root)
        .caption(title, ("sans-serif", 15))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(y_area)
        .build_cartesian_2d(x, y)
        .map_err(|e| e.to_string())
}

/// The series' legend, boxed, at `at`.
fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, at: SeriesLabelPosition) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// A chart of this module: two axes of `f64`, drawn as SVG.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// An axis label: a whole number, or one decimal below 10.
fn whole(v: f64) -> String {
    if v.abs() < 10.0 && v.fract() != 0.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

/// A category axis's label: `names[x]` where `x` is a whole number, none
/// between.
fn at_whole(names: &[String], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() < 1e-6 && i >= 0.0 {
        names.get(i as usize).cloned().unwrap_or_default()
    } else {
        String::new()
    }
}

fn fail(file: &Path) -> impl Fn(String) -> String + '_ {
    move |e| format!("draw {}: {e}", file.display())
}

/// Grouped bars: one group per backlog, one bar per reader, whiskers for
/// the range.
fn bars(
    file: &Path,
    title: &str,
    y: &str,
    groups: &[String],
    series: &[(String, Vec<Option<Bar>>)],
) -> Result<(), String> {
    let err = fail(file);
    let top = series
        .iter()
        .flat_map(|(_, b)| b.iter().flatten().map(|b| b.high))
        .fold(0.0, f64::max)
        * 1.4;
    let root = SVGBackend::new(file, SIZE).into_drawing_area();
    let mut chart = canvas(
        &root,
        title,
        0.0..groups.len() as f64,
        0.0..top.max(1.0),
        60,
    )
    .map_err(&err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 1e-6 && i < groups.len() {
                groups[i].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| whole(*v))
        .y_desc(y)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let width = 0.8 / series.len() as f64;
    for (j, (name, values)) in series.iter().enumerate() {
        let c = colour(name);
        let x0 = |i: usize| i as f64 + 0.1 + j as f64 * width;
        chart
            .draw_series(values.iter().enumerate().filter_map(|(i, b)| {
                let b = b.as_ref()?;
                Some(Rectangle::new(
                    [(x0(i), 0.0), (x0(i) + width * 0.9, b.median)],
                    c.filled(),
                ))
            }))
            .map_err(|e| err(e.to_string()))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
        chart
            .draw_series(values.iter().enumerate().filter_map(|(i, b)| {
                let b = b.as_ref()?;
                let mid = x0(i) + width * 0.45;
                Some(PathElement::new(vec![(mid, b.low), (mid, b.high)], BLACK))
            }))
            .map_err(|e| err(e.to_string()))?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperRight).map_err(&err)?;
    root.present().map_err(|e| err(e.to_string()))
}

/// The latency curve: p50 (dashed) and p99 (solid) per relay over the
/// asked rates.
fn latency(file: &Path, title: &str, r: &Results) -> Result<(), String> {
    let err = fail(file);
    let points: Vec<String> = RATES
        .iter()
        .map(|rate| rate.map_or("max".into(), |r| format!("{r}/s")))
        .collect();
    // Per relay: its name, its p50s and its p99s, (point, ms).
    type Curve = (String, Vec<(f64, f64)>, Vec<(f64, f64)>);
    let mut lines: Vec<Curve> = Vec::new();
    for kind in CURVE_RELAYS {
        let (mut p50, mut p99) = (Vec::new(), Vec::new());
        for (i, rate) in RATES.iter().enumerate() {
            let k = |m: &str| format!("{}_{}_{m}", kind.slot(), point_name(*rate));
            if let (Some(a), Some(b)) = (
                r.median("curve", &k("p50_ms")),
                r.median("curve", &k("p99_ms")),
            ) {
                p50.push((i as f64, a));
                p99.push((i as f64, b));
            }
        }
        if !p99.is_empty() {
            lines.push((short(kind), p50, p99));
        }
    }
    let top = lines
        .iter()
        .flat_map(|(_, _, p99)| p99.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(file, SIZE).into_drawing_area();
    let x = -0.3..points.len() as f64 - 0.7;
    let mut chart = canvas(&root, title, x, 0.0..top.max(1.0), 50).map_err(&err)?;
    chart
        .configure_mesh()
        .x_labels(points.len())
        .x_label_formatter(&|x| at_whole(&points, *x))
        .x_desc("asked rate (events/s, one per transaction)")
        .y_desc("ms, commit → on the topic")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (name, p50, p99) in &lines {
        let c = colour(name);
        chart
            .draw_series(LineSeries::new(p99.clone(), c.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{name} p99"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        chart
            .draw_series(DashedLineSeries::new(p50.clone(), 4, 3, c.stroke_width(1)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{name} p50"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(1)));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(&err)?;
    root.present().map_err(|e| err(e.to_string()))
}

/// Every kill's duplicates, one dot each, per relay (a log scale would
/// hide walbox's zeros: the axis is linear).
fn kills(file: &Path, title: &str, r: &Results) -> Result<(), String> {
    let err = fail(file);
    let relays: Vec<(String, Vec<f64>)> = RELAYS
        .into_iter()
        .chain([KILLED_STREAMING])
        .map(|k| (short(k), r.all("kill", &format!("{}_duplicates", k.slot()))))
        .filter(|(_, v)| !v.is_empty())
        .collect();
    let top = relays
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(file, SIZE).into_drawing_area();
    let names: Vec<String> = relays.iter().map(|(n, _)| n.clone()).collect();
    let x = -0.5..relays.len() as f64 - 0.5;
    let mut chart = canvas(&root, title, x, 0.0..top.max(10.0), 60).map_err(&err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(relays.len())
        .x_label_formatter(&|x| at_whole(&names, *x))
        .y_label_formatter(&|v| whole(*v))
        .y_desc("duplicates after the restart")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, values)) in relays.iter().enumerate() {
        let c = colour(name);
        let n = values.len().max(1) as f64;
        chart
            .draw_series(values.iter().enumerate().map(|(j, v)| {
                // Spread the dots a little, so equal values stay countable.
                let x = i as f64 - 0.2 + 0.4 * j as f64 / n;
                Circle::new((x, *v), 4, c.filled())
            }))
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))
}

/// Each relay's RSS from its launch until it drained the `conduit`
/// backlog: at each half second, the median over the runs that were still
/// draining then.
fn rss_over_time(file: &Path, title: &str, r: &Results) -> Result<(), String> {
    let err = fail(file);
    let step = crate::shapes::SAMPLE.as_secs_f64();
    let lines: Vec<(String, Vec<(f64, f64)>)> = RELAYS
        .into_iter()
        .map(|k| {
            let points = (0..)
                .map_while(|i| {
                    r.median("conduit", &crate::shapes::rss_sample(&k.slot(), i))
                        .map(|mib| (i as f64 * step, mib))
                })
                .collect::<Vec<_>>();
            (short(k), points)
        })
        .filter(|(_, p)| !p.is_empty())
        .collect();
    let right = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.0))
        .fold(0.0, f64::max)
        .max(1.0);
    let top = lines
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(file, SIZE).into_drawing_area();
    let mut chart = canvas(&root, title, 0.0..right, 0.0..top.max(10.0), 60).map_err(&err)?;
    chart
        .configure_mesh()
        .x_label_formatter(&|x| whole(*x))
        .y_label_formatter(&|v| whole(*v))
        .x_desc("seconds since the relay was launched")
        .y_desc("RSS, MiB")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (name, points) in &lines {
        let c = colour(name);
        chart
            .draw_series(LineSeries::new(points.clone(), c.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(&err)?;
    root.present().map_err(|e| err(e.to_string()))
}
