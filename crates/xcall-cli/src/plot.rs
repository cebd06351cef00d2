//! `xcall plot`: SVG charts from the JSON reports of `xcall bench` and
//! `xcall moe`, for reading a run at a glance and for the figures of
//! docs/BENCHMARKS.md (drawn from the reports kept in docs/data).
//!
//! For a report `NAME.json` it writes, into `--out`:
//! - bench: `NAME-ratios.svg`, each figure's ratio to its reference (the
//!   copy of the same bytes; the graph row's speed-up over eager calls);
//!   `NAME-shmem-sizes.svg`, put and copy bandwidth by message size.
//! - moe: `NAME-phases.svg`, where one step's time goes (each phase's
//!   slowest PE, with the copy-rate floor of its bytes), next to the
//!   step's median.
//!
//! With two or more moe reports, also `moe-steps.svg`: each report's
//! median step time, with its slowest step.

use std::path::{Path, PathBuf};

use clap::Args;
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use crate::bench::size_name;
use crate::report::Failure;

/// Flags of `xcall plot`.
#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// Reports written by `xcall bench --json` or `xcall moe --json`.
    #[arg(required = true, value_name = "REPORT")]
    reports: Vec<PathBuf>,
    /// The folder to write the SVG files to (created if missing; files of
    /// the same names are replaced).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// A chart's file name and its SVG text.
type Chart = (String, String);

const WIDTH: u32 = 900;
const BAR: u32 = 26;
/// The most bars one chart draws (a report with more is refused).
const MAX_BARS: usize = 400;
const BAR_BLUE: RGBColor = RGBColor(52, 101, 164);
const ORANGE: RGBColor = RGBColor(230, 128, 40);
const GREY: RGBColor = RGBColor(120, 120, 120);

/// Runs `xcall plot`.
pub fn run(args: &PlotArgs) -> Result<bool, Failure> {
    let mut reports = Vec::new();
    for path in &args.reports {
        reports.push((path.clone(), read(path).map_err(Failure::Usage)?));
    }
    let mut charts = Vec::new();
    let mut steps = Vec::new();
    for (path, doc) in &reports {
        let stem = path
            .file_stem()
            .map_or_else(|| "report".into(), |s| s.to_string_lossy().into_owned());
        let what = |e: String| Failure::Usage(format!("{}: {e}", path.display()));
        match doc["command"].as_str() {
            Some("bench") => charts.extend(bench_charts(&stem, doc).map_err(what)?),
            Some("moe") => {
                charts.push(moe_phases(&stem, doc).map_err(what)?);
                steps.push(step_of(doc).map_err(what)?);
            }
            other => {
                return Err(Failure::Usage(format!(
                    "{}: a report of `xcall {}`; plot draws bench and moe reports",
                    path.display(),
                    other.unwrap_or("?")
                )))
            }
        }
    }
    if steps.len() >= 2 {
        charts.push(moe_steps(&steps).map_err(Failure::Runtime)?);
    }
    std::fs::create_dir_all(&args.out)
        .map_err(|e| Failure::Usage(format!("--out {}: {e}", args.out.display())))?;
    for (name, svg) in &charts {
        let path = args.out.join(name);
        std::fs::write(&path, svg)
            .map_err(|e| Failure::Usage(format!("{}: {e}", path.display())))?;
        println!("{}", path.display());
    }
    Ok(true)
}

/// The report at `path`, parsed, with its `schema_version` checked.
fn read(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let doc: Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a JSON report: {e}", path.display()))?;
    match doc["schema_version"].as_u64() {
        Some(1) => Ok(doc),
        other => Err(format!(
            "{}: schema_version {} (this xcall reads 1)",
            path.display(),
            other.map_or("missing".into(), |v| v.to_string())
        )),
    }
}

/// `doc[key]` as a number, or an error naming `key`.
fn num(doc: &Value, key: &str) -> Result<f64, String> {
    doc[key]
        .as_f64()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("field {key:?} is missing or not a number"))
}

fn text<'a>(doc: &'a Value, key: &str) -> Result<&'a str, String> {
    doc[key]
        .as_str()
        .ok_or_else(|| format!("field {key:?} is missing or not a string"))
}

fn array<'a>(doc: &'a Value, key: &str) -> Result<&'a Vec<Value>, String> {
    doc[key]
        .as_array()
        .ok_or_else(|| format!("field {key:?} is missing or not an array"))
}

/// The run's device and shape, for a chart's title.
fn run_title(doc: &Value) -> String {
    let device = doc["device"]
        .as_str()
        .map(str::to_string)
        .or_else(|| doc["devices"][0]["name"].as_str().map(|n| n.to_string()))
        .unwrap_or_else(|| "?".into());
    let date = doc["timestamp"]
        .as_str()
        .map_or("", |t| t.get(..10).unwrap_or(t));
    format!("{device}, {date}")
}

fn shape(doc: &Value) -> String {
    let f = |k: &str| doc[k].as_u64().map_or("?".into(), |v| v.to_string());
    format!(
        "T={} H={} E={} top-{}",
        f("tokens"),
        f("hidden"),
        f("experts"),
        f("topk")
    )
}

/// A moe report's layout and, over more than one PE, its exchange:
/// "dropless", "capacity 1.25", "capacity 1.25, fused".
fn mode(doc: &Value) -> String {
    let mut mode = if doc["dropless"].as_bool() == Some(true) {
        "dropless".to_string()
    } else {
        doc["capacity_factor"]
            .as_f64()
            .map_or("?".into(), |f| format!("capacity {f}"))
    };
    if doc["pes"].as_u64().unwrap_or(0) > 1 {
        if let Some(exchange) = doc["exchange"].as_str() {
            mode = format!("{mode}, {exchange}");
        }
    }
    mode
}

fn drawing<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing the chart failed: {e:?}")
}

/// One horizontal bar per entry (label, value, optional marker), first
/// entry on top; values and markers printed at the bar's end.
struct Bars<'a> {
    title: String,
    axis: &'a str,
    entries: Vec<(String, f64, Option<f64>)>,
    /// A vertical line across the bars (the ratio 1.0).
    rule: Option<f64>,
    /// Colour per entry.
    colour: &'a dyn Fn(usize) -> RGBColor,
    digits: usize,
}

impl Bars<'_> {
    fn draw(&self) -> Result<String, String> {
        let n = self.entries.len();
        if n == 0 {
            return Err("nothing to draw".into());
        }
        if n > MAX_BARS {
            return Err(format!(
                "{n} bars are more than one chart shows ({MAX_BARS})"
            ));
        }
        // Both bounded: labels by the half width, bars by MAX_BARS.
        let longest = self.entries.iter().map(|e| e.0.len()).max().unwrap_or(0);
        let label_width = (longest.min(WIDTH as usize) as u32 * 7 + 16).min(WIDTH / 2);
        let height = (90 + BAR * n as u32).max(200);
        let top = self
            .entries
            .iter()
            .flat_map(|e| [Some(e.1), e.2])
            .flatten()
            .chain(self.rule)
            .fold(0.0f64, f64::max);
        let x_max = if top > 0.0 { top * 1.18 } else { 1.0 };
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
            root.fill(&WHITE).map_err(drawing)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(&self.title, ("sans-serif", 15))
                .margin(10)
                .x_label_area_size(36)
                .y_label_area_size(label_width)
                .build_cartesian_2d(0.0..x_max, (0..n - 1).into_segmented())
                .map_err(drawing)?;
            let labels: Vec<&str> = self.entries.iter().rev().map(|e| e.0.as_str()).collect();
            chart
                .configure_mesh()
                .disable_y_mesh()
                .light_line_style(TRANSPARENT)
                .label_style(("sans-serif", 12))
                .axis_desc_style(("sans-serif", 12))
                .y_labels(n)
                .y_label_formatter(&|v| match v {
                    SegmentValue::CenterOf(i) => labels.get(*i).copied().unwrap_or("").into(),
                    _ => String::new(),
                })
                .x_desc(self.axis)
                .draw()
                .map_err(drawing)?;
            // Entry k is drawn in segment n - 1 - k: the first on top.
            let at = |k: usize| n - 1 - k;
            chart
                .draw_series(self.entries.iter().enumerate().map(|(k, e)| {
                    let mut bar = Rectangle::new(
                        [
                            (0.0, SegmentValue::Exact(at(k))),
                            (e.1, SegmentValue::Exact(at(k) + 1)),
                        ],
                        (self.colour)(k).filled(),
                    );
                    bar.set_margin(4, 4, 0, 0);
                    bar
                }))
                .map_err(drawing)?;
            let value_text = |k: usize, e: &(String, f64, Option<f64>)| {
                let end = e.2.map_or(e.1, |m| m.max(e.1));
                Text::new(
                    format!(" {:.*}", self.digits, e.1),
                    (end, SegmentValue::CenterOf(at(k))),
                    TextStyle::from(("sans-serif", 11).into_font())
                        .pos(Pos::new(HPos::Left, VPos::Center)),
                )
            };
            chart
                .draw_series(
                    self.entries
                        .iter()
                        .enumerate()
                        .map(|(k, e)| value_text(k, e)),
                )
                .map_err(drawing)?;
            let markers: Vec<(usize, f64)> = self
                .entries
                .iter()
                .enumerate()
                .filter_map(|(k, e)| e.2.map(|m| (k, m)))
                .collect();
            if !markers.is_empty() {
                chart
                    .draw_series(markers.iter().map(|&(k, m)| {
                        PathElement::new(
                            vec![
                                (m, SegmentValue::Exact(at(k))),
                                (m, SegmentValue::Exact(at(k) + 1)),
                            ],
                            BLACK.stroke_width(3),
                        )
                    }))
                    .map_err(drawing)?;
            }
            if let Some(x) = self.rule {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x, SegmentValue::Exact(0)), (x, SegmentValue::Exact(n))],
                        GREY.stroke_width(1),
                    )))
                    .map_err(drawing)?;
            }
            root.present().map_err(drawing)?;
        }
        Ok(svg)
    }
}

/// The bench report's charts.
fn bench_charts(stem: &str, doc: &Value) -> Result<Vec<Chart>, String> {
    let mut entries = Vec::new();
    for row in array(doc, "rows")? {
        if row["reference"].is_null() && row["crate"] != "graph" {
            continue;
        }
        let ratio = num(row, "ratio")?;
        let item = text(row, "item")?;
        let label = if row["crate"] == "graph" {
            format!("graph: {item}, speed-up")
        } else {
            format!("{}: {item}", text(row, "crate")?)
        };
        entries.push((label, ratio, None));
    }
    let ratios = Bars {
        title: format!(
            "xcall bench: ratio to the same bytes' copy, {}; {}",
            run_title(doc),
            shape(doc)
        ),
        axis: "GB/s over the copy's GB/s (graph: eager time over replayed time)",
        entries,
        rule: Some(1.0),
        colour: &|_| BAR_BLUE,
        digits: 3,
    }
    .draw()?;
    let mut charts = vec![(format!("{stem}-ratios.svg"), ratios)];
    if !doc["shmem_sizes"].is_null() {
        charts.push((format!("{stem}-shmem-sizes.svg"), shmem_sizes(doc)?));
    }
    Ok(charts)
}

/// Put and copy bandwidth by message size, both axes logarithmic.
fn shmem_sizes(doc: &Value) -> Result<String, String> {
    let sizes = &doc["shmem_sizes"];
    let (put, reference) = (text(sizes, "put")?, text(sizes, "reference")?);
    let mut series: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for p in array(sizes, "points")? {
        let bytes = num(p, "bytes")?;
        if bytes < 1.0 {
            return Err(format!("a point of {bytes} bytes"));
        }
        series[0].push((bytes.log2(), num(p, "put_gb_per_s")?));
        series[1].push((bytes.log2(), num(p, "reference_gb_per_s")?));
    }
    let all = || series.iter().flatten();
    let (Some(x0), Some(x1)) = (
        all().map(|p| p.0).reduce(f64::min),
        all().map(|p| p.0).reduce(f64::max),
    ) else {
        return Err("no points in shmem_sizes".into());
    };
    let positive = all().map(|p| p.1).filter(|v| *v > 0.0);
    let y0 = positive.clone().fold(f64::INFINITY, f64::min);
    let y1 = positive.fold(0.0, f64::max);
    if !(y0.is_finite() && y1 > 0.0) {
        return Err("no positive bandwidth in shmem_sizes".into());
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("xcall bench: shmem put by message size, {}", run_title(doc)),
                ("sans-serif", 15),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(x0 - 0.5..x1 + 0.5, (y0 / 1.5..y1 * 1.5).log_scale())
            .map_err(drawing)?;
        chart
            .configure_mesh()
            .light_line_style(TRANSPARENT)
            .label_style(("sans-serif", 12))
            .axis_desc_style(("sans-serif", 12))
            .x_labels(((x1 - x0) as usize + 2).min(24))
            .x_label_formatter(&|v| {
                let rounded = v.round();
                if (v - rounded).abs() < 1e-9 && (0.0..63.0).contains(&rounded) {
                    size_name(1u64 << rounded as u32)
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|v| format!("{v:.0}"))
            .x_desc("message size")
            .y_desc("GB/s (message bytes / time)")
            .draw()
            .map_err(drawing)?;
        for (points, name, colour) in [(&series[1], reference, GREY), (&series[0], put, ORANGE)] {
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    colour.stroke_width(2),
                ))
                .map_err(drawing)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))
                .map_err(drawing)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(GREY)
            .draw()
            .map_err(drawing)?;
        root.present().map_err(drawing)?;
    }
    Ok(svg)
}

/// Where a moe step's time goes.
fn moe_phases(stem: &str, doc: &Value) -> Result<Chart, String> {
    let step = &doc["step_ms"];
    let mut entries = vec![("step (median)".to_string(), num(step, "median")?, None)];
    for phase in array(doc, "phases")? {
        let floor = phase["floor_ms"].as_f64();
        entries.push((text(phase, "name")?.to_string(), num(phase, "ms")?, floor));
    }
    let floors = entries.iter().any(|e| e.2.is_some());
    let title = format!(
        "xcall moe: one step and its phases (slowest PE), {}; {}, {}, {} PE(s), {}",
        run_title(doc),
        shape(doc),
        mode(doc),
        doc["pes"].as_u64().unwrap_or(0),
        doc["dtype"].as_str().unwrap_or("?")
    );
    let svg = Bars {
        title,
        axis: if floors {
            "ms (black tick: the phase's bytes at the copy rate)"
        } else {
            "ms"
        },
        entries,
        rule: None,
        colour: &|k| if k == 0 { ORANGE } else { BAR_BLUE },
        digits: 3,
    }
    .draw()?;
    Ok((format!("{stem}-phases.svg"), svg))
}

/// A moe report's label and step times (median, slowest).
fn step_of(doc: &Value) -> Result<(String, f64, f64), String> {
    let step = &doc["step_ms"];
    let label = format!(
        "{}, {}, {} PE(s) {}",
        shape(doc),
        mode(doc),
        doc["pes"].as_u64().unwrap_or(0),
        doc["platform"].as_str().unwrap_or("?")
    );
    Ok((label, num(step, "median")?, num(step, "max")?))
}

/// Every moe report's median step, its slowest step as the marker.
fn moe_steps(steps: &[(String, f64, f64)]) -> Result<Chart, String> {
    let entries = steps
        .iter()
        .map(|(label, median, max)| (label.clone(), *median, Some(*max)))
        .collect();
    let svg = Bars {
        title: "xcall moe: median step time by run".into(),
        axis: "ms (black tick: the slowest step)",
        entries,
        rule: None,
        colour: &|_| BAR_BLUE,
        digits: 3,
    }
    .draw()?;
    Ok(("moe-steps.svg".into(), svg))
}
