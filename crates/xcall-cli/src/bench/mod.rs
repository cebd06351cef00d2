//! `xcall bench`: one benchmark set over every crate, in one process, each
//! figure next to a reference measured in the same run (a copy of the same
//! bytes on the same device, the peer copy for transfers between GPUs,
//! the eager calls for the graph cache).
//!
//! Every buffer comes from an xcall-shmem world (one PE per device, two
//! when there are two devices), so the same code serves Host and CUDA.
//! GB/s count bytes read plus bytes written once. CUDA times are
//! CUDA-event medians of interleaved rounds after warm-up; Host times are
//! medians of interleaved rounds of the host clock.

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;
use xcall_core::cuda::{Event, Stream};
use xcall_core::{Device, Platform};
use xcall_shmem::{World, WorldConfig};

use crate::layer::{Context, Res};
use crate::moe::PlatformArg;
use crate::report::{Failure, JsonOut};
use indicatif::ProgressStyle;

mod set;
use set::{allocate, measure};

/// Flags of `xcall bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which set: the Host set, or the CUDA set on GPU 0 (and GPU 1 for
    /// transfers between GPUs when there is one).
    #[arg(long, value_enum, default_value_t = PlatformArg::Host)]
    platform: PlatformArg,
    /// Timed rounds per figure.
    #[arg(long, default_value_t = 30)]
    rounds: usize,
    /// Also write the table as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One figure.
struct Row {
    group: &'static str,
    item: String,
    ms: f64,
    /// Bytes read plus written (0: a latency figure).
    bytes: f64,
    /// Index of the reference row; `None` for a reference.
    reference: Option<usize>,
}

/// Puts of growing size next to the plain copy of the same bytes.
struct Sweep {
    /// What the put does ("put GPU 0 -> GPU 1").
    put: &'static str,
    /// The copy it is compared with.
    reference: &'static str,
    points: Vec<SweepPoint>,
}

/// One size of the sweep: medians of interleaved rounds.
struct SweepPoint {
    bytes: u64,
    put_ms: f64,
    reference_ms: f64,
}

/// The layer-shaped problem every figure uses.
#[derive(Clone, Copy)]
struct Problem {
    tokens: u64,
    hidden: u64,
    experts: u64,
    topk: u64,
}

impl Problem {
    fn rows(&self) -> u64 {
        self.tokens * self.topk
    }
}

/// The first error of the timed closures (which cannot return one).
#[derive(Default)]
struct FirstError(RefCell<Option<String>>);

impl FirstError {
    fn keep(&self, r: Res<()>) {
        if let Err(e) = r {
            self.0.borrow_mut().get_or_insert(e);
        }
    }

    fn check(&self) -> Res<()> {
        self.0.borrow_mut().take().map_or(Ok(()), Err)
    }
}

impl Row {
    /// A figure not measured yet (`ms` 0).
    fn new(group: &'static str, item: &str, bytes: f64, reference: Option<usize>) -> Row {
        Row {
            group,
            item: item.into(),
            ms: 0.0,
            bytes,
            reference,
        }
    }
}

/// Times every variant (on CUDA: the work it enqueues on `stream`);
/// medians in ms.
fn medians(
    stream: Option<&Stream>,
    rounds: usize,
    variants: &mut [Box<dyn FnMut() + '_>],
) -> Res<Vec<f64>> {
    match stream {
        Some(s) => stream_medians(s, rounds, variants),
        None => {
            for v in variants.iter_mut() {
                v();
            }
            let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
            for _ in 0..rounds {
                for (v, out) in variants.iter_mut().zip(samples.iter_mut()) {
                    let start = Instant::now();
                    v();
                    out.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok(samples.into_iter().map(median).collect())
        }
    }
}

/// The median of `t`.
fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

/// Times the work each variant enqueues on `stream`, rounds interleaved
/// (variant 1, 2, .., 1, 2, ..: drift affects all alike) after a warm-up
/// of 30 rounds; each variant's median of CUDA events in ms.
fn stream_medians(
    stream: &Stream,
    rounds: usize,
    variants: &mut [Box<dyn FnMut() + '_>],
) -> Res<Vec<f64>> {
    for _ in 0..30 {
        for v in variants.iter_mut() {
            v();
        }
    }
    stream.in_context(|s| s.sync()).context("CUDA stream")?;
    let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
    for _ in 0..rounds {
        for (v, out) in variants.iter_mut().zip(samples.iter_mut()) {
            let device = stream.device();
            let (a, z) = (Event::new(device), Event::new(device));
            let (a, z) = (a.context("CUDA event")?, z.context("CUDA event")?);
            a.record_on(stream).context("CUDA event")?;
            v();
            z.record_on(stream).context("CUDA event")?;
            out.push(z.elapsed_ms_since(&a).context("CUDA event")? as f64);
        }
    }
    Ok(samples.into_iter().map(median).collect())
}

/// Runs `xcall bench`.
pub fn run(args: &BenchArgs) -> Result<bool, Failure> {
    let platform = match args.platform {
        PlatformArg::Host => Platform::Host,
        PlatformArg::Cuda => Platform::Cuda,
    };
    if args.rounds == 0 {
        return Err(Failure::Usage("--rounds must be at least 1".into()));
    }
    crate::layer::world_environment().map_err(Failure::Usage)?;
    let pes = match platform {
        Platform::Host => 2,
        Platform::Cuda => crate::moe::cuda_devices()?.min(2),
    };
    let problem = match platform {
        Platform::Host => Problem {
            tokens: 2048,
            hidden: 1024,
            experts: 8,
            topk: 2,
        },
        Platform::Cuda => Problem {
            tokens: 8192,
            hidden: 4096,
            experts: 8,
            topk: 2,
        },
    };
    let row = problem.hidden * 2;
    let needed = (problem.rows() * row * 3 + problem.tokens * row * 2) as usize + (64 << 20);
    let heap = crate::layer::heap_size(needed, "the bench").map_err(Failure::Usage)?;
    let json = JsonOut::open_optional(args.json.as_ref())?;
    // The stages of the set; drawn on stderr when it is a terminal and no
    // log lines go there.
    let bar = crate::report::progress_bar(set::STAGES.len() as u64).with_style(
        ProgressStyle::with_template("bench: {msg} [{bar:20}] {pos}/{len} {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let group = format!("xcall-bench-{}", std::process::id());
    let config = |rank| {
        let mut c = WorldConfig::in_process(&group, rank, pes, Device::new(platform, rank as u32));
        c.heap_bytes = heap;
        c.timeout = Duration::from_secs(600);
        c
    };
    let rows = std::thread::scope(|scope| {
        // The second PE only lends its heap as the target of peer puts.
        let helper = (pes > 1).then(|| {
            let c = config(1);
            scope.spawn(move || -> Res<()> {
                let mut w = World::new();
                w.init(&c).context("shmem init")?;
                allocate(&mut w, problem)?;
                w.barrier_all().context("shmem barrier")?;
                w.finalize().context("shmem finalize").map(|_| ())
            })
        });
        let measured = measure(platform, &config(0), problem, args.rounds, &bar);
        let helped = helper.map_or(Ok(()), |h| {
            h.join()
                .unwrap_or_else(|_| Err("the helper PE panicked".into()))
        });
        measured.and_then(|r| helped.map(|()| r))
    })?;
    bar.finish_and_clear();
    let (rows, sweep) = rows;
    print_and_write(platform, pes, problem, (&rows, &sweep), json)?;
    Ok(true)
}

/// Device and name for the header line.
fn device_name(platform: Platform) -> String {
    match platform {
        Platform::Host => format!(
            "Host ({} hardware thread(s))",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        Platform::Cuda => xcall_core::cuda::device_info(Device::cuda(0))
            .map_or_else(|e| e.to_string(), |i| format!("{} ({})", i.name, i.arch())),
    }
}

fn print_and_write(
    platform: Platform,
    pes: usize,
    p: Problem,
    (rows, sweep): (&[Row], &Sweep),
    json: Option<JsonOut>,
) -> Res<()> {
    let device = device_name(platform);
    println!(
        "xcall bench: {device}; T={} H={} E={} top-{} bf16; medians of interleaved rounds after warm-up",
        p.tokens, p.hidden, p.experts, p.topk
    );
    println!(
        "{:<10} {:<44} {:>11} {:>9} {:>9}",
        "crate", "item", "time us", "GB/s", "ratio"
    );
    let gbs = |r: &Row| (r.bytes > 0.0).then(|| r.bytes / (r.ms / 1e3) / 1e9);
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let g = gbs(r);
        // Bandwidth figures: GB/s over the reference's GB/s. The graph
        // row: the eager time over the replayed time (a speed-up).
        let ratio = match (r.reference, g) {
            (Some(k), Some(g)) => gbs(&rows[k]).map(|x| g / x),
            _ if r.group == "graph" => Some(rows[i - 1].ms / r.ms),
            _ => None,
        };
        println!(
            "{:<10} {:<44} {:>11.1} {:>9} {:>9}",
            r.group,
            r.item,
            r.ms * 1e3,
            g.map_or("-".into(), |g| format!("{g:.1}")),
            ratio.map_or("ref".into(), |x| format!("{x:.3}")),
        );
        out.push(json!({
            "crate": r.group, "item": r.item, "us": r.ms * 1e3, "bytes": r.bytes,
            "gb_per_s": g, "ratio": ratio,
            "reference": r.reference.map(|k| rows[k].item.clone()),
        }));
    }
    println!("ratio: GB/s over the same device's copy (the peer copy for GPU 0 -> GPU 1); graph: eager time over replayed time");
    println!();
    println!(
        "shmem by message size: {} next to {} (GB/s: message bytes / time)",
        sweep.put, sweep.reference
    );
    println!(
        "{:>10} {:>11} {:>9} {:>11} {:>9} {:>9}",
        "bytes", "put us", "GB/s", "copy us", "GB/s", "ratio"
    );
    let rate = |bytes: u64, ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    let mut points = Vec::new();
    for pt in &sweep.points {
        let (put, copy) = (rate(pt.bytes, pt.put_ms), rate(pt.bytes, pt.reference_ms));
        println!(
            "{:>10} {:>11.1} {:>9.1} {:>11.1} {:>9.1} {:>9.3}",
            size_name(pt.bytes),
            pt.put_ms * 1e3,
            put,
            pt.reference_ms * 1e3,
            copy,
            put / copy
        );
        points.push(json!({
            "bytes": pt.bytes, "put_us": pt.put_ms * 1e3, "put_gb_per_s": put,
            "reference_us": pt.reference_ms * 1e3, "reference_gb_per_s": copy,
            "ratio": put / copy,
        }));
    }
    if let Some(json) = json {
        let doc = json!({
            "platform": platform.name(), "device": device,
            "tokens": p.tokens, "hidden": p.hidden, "experts": p.experts, "topk": p.topk,
            "rows": out,
            "shmem_sizes": {"put": sweep.put, "reference": sweep.reference, "points": points},
        });
        // Host has one device, however many PEs share it.
        let devices: Vec<Device> = match platform {
            Platform::Host => vec![Device::HOST],
            Platform::Cuda => (0..pes as u32).map(Device::cuda).collect(),
        };
        json.write("bench", &devices, doc)?;
    }
    Ok(())
}

/// `4 KiB`, `16 MiB`: a power-of-two byte count in the largest whole unit.
pub(crate) fn size_name(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024 && value % 1024 == 0 && unit + 1 < units.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value} {}", units[unit])
}
