//! `xcall moe`: an expert-parallel MoE layer step built from every xcall
//! crate, run for a number of steps on Host PEs (threads) or one thread
//! per GPU, every output checked against an f64 reference.

mod data;
mod pe;
mod verify;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use xcall_core::{DType, Device, Platform};
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::{Config as CacheConfig, GraphCache, Outcome, Stats};

use data::Check;
pub use data::Shape;
use pe::{Pe, Waits, PHASES};
use verify::{Checked, Checks, Job, Verify};

use crate::report::{Failure, JsonOut};

/// Where the PEs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlatformArg {
    /// Host threads, one per PE.
    Host,
    /// One thread per GPU.
    Cuda,
}

/// Element type of the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
}

/// How rows reach other PEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExchangeArg {
    /// `permute` writes each peer's rows straight into its receive slot
    /// and `unpermute` reads the results from the peers' slots (loads and
    /// stores through peer pointers): no staging copy, only routed rows
    /// cross.
    Fused,
    /// `permute` into local send slots, whole slots copied with
    /// `put_signal` both ways: the path of a transport without load/store
    /// access to peers.
    Copy,
}

/// Flags of `xcall moe`.
#[derive(Args, Debug, Clone)]
pub struct MoeArgs {
    /// Where the PEs run.
    #[arg(long, value_enum, default_value_t = PlatformArg::Host)]
    platform: PlatformArg,
    /// PEs [default: 4 on Host; on CUDA every visible GPU].
    #[arg(long)]
    pes: Option<usize>,
    /// Tokens per PE [default: 1024 on Host, 8192 on CUDA].
    #[arg(long)]
    tokens: Option<usize>,
    /// Hidden size, a multiple of 8 [default: 1024 on Host, 4096 on CUDA].
    #[arg(long)]
    hidden: Option<usize>,
    /// Experts, split evenly over the PEs.
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    topk: usize,
    /// Element type.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    dtype: DtypeArg,
    /// Timed steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Seed of every PE's tokens and router.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Expert capacity per PE as a multiple of the mean load
    /// (`ceil(f * tokens * topk / experts)` rows, at most `tokens`); 0 is
    /// `--dropless` [default: 1.25].
    #[arg(long, allow_negative_numbers = true)]
    capacity_factor: Option<f64>,
    /// No route is dropped: each PE's rows for one destination are packed
    /// densely into a slot sized for the worst case (`tokens * min(topk,
    /// experts per PE)` rows), and the experts read only the rows routed.
    #[arg(long)]
    dropless: bool,
    /// How rows reach other PEs [default: fused up to 32 PEs (the
    /// segments a permute takes), else copy].
    #[arg(long, value_enum)]
    exchange: Option<ExchangeArg>,
    /// The CUDA device of each PE, comma-separated and distinct (a world
    /// takes one PE per device) [default: 0, 1, ..]. Sets `--pes` when
    /// that is not given.
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<u32>>,
    /// Which steps' outputs are checked against the f64 reference:
    /// `every`, `first:N` (the warm-up step and the N - 1 after it),
    /// `sample:K` (every K-th step and the last) or `off`. The checks run
    /// on their own threads beside the PEs [default: every for up to 100
    /// steps, else sample:K checking about 100 of them].
    #[arg(long, value_parser = Verify::parse)]
    verify: Option<Verify>,
    /// Print a progress line to stderr this often when no progress bar is
    /// drawn (stderr not a terminal, or log lines going there).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    progress_every: Duration,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A checked configuration.
#[derive(Clone, Debug)]
struct Run {
    platform: Platform,
    shape: Shape,
    /// The device of each PE.
    devices: Vec<Device>,
    /// The heap per PE when xcall moe sizes it; `None` when
    /// `XCALL_SHMEM_HEAP_BYTES` gives one at least as large (the world
    /// then reads it).
    heap: Option<usize>,
    steps: usize,
    seed: u64,
    capacity_factor: f64,
    verify: Verify,
    progress_every: Duration,
}

impl Run {
    /// Steps of the run: the warm-up, the timed and the instrumented ones.
    fn total(&self) -> usize {
        self.steps + 1 + PHASE_STEPS
    }
}

/// The most Host PEs a run takes.
const MAX_HOST_PES: usize = 64;

/// The CUDA devices `--platform cuda` may use: a machine without one is a
/// runtime error, not a usage error.
pub fn cuda_devices() -> Result<usize, Failure> {
    match xcall_core::cuda::device_count() {
        Ok(0) => Err(Failure::Runtime(
            "--platform cuda: no CUDA device is visible".into(),
        )),
        Ok(n) => Ok(n),
        Err(e) => Err(Failure::Runtime(format!("--platform cuda: {e}"))),
    }
}

/// Checks the flags; `gpus` is the CUDA device count on CUDA. Every error
/// is a usage error.
fn validate(a: &MoeArgs, gpus: usize) -> Result<Run, String> {
    let platform = match a.platform {
        PlatformArg::Host => Platform::Host,
        PlatformArg::Cuda => Platform::Cuda,
    };
    let host = platform == Platform::Host;
    let pes = match (platform, a.pes) {
        (_, Some(0)) => return Err("--pes must be at least 1".into()),
        (Platform::Host, Some(p)) if p > MAX_HOST_PES => {
            return Err(format!(
                "--pes {p}: at most {MAX_HOST_PES} on Host (PEs are threads that spin while they wait for each other; more would only take turns on this machine's cores)"
            ))
        }
        (Platform::Host, p) => p.unwrap_or(4),
        (Platform::Cuda, p) => match (p, &a.devices) {
            (Some(p), Some(d)) if p != d.len() => {
                return Err(format!(
                    "--pes {p} with --devices naming {} device(s): one device per PE",
                    d.len()
                ))
            }
            (_, Some(d)) => d.len(),
            (Some(p), None) if p > gpus => {
                return Err(format!(
                    "--pes {p}: only {gpus} CUDA device(s); one PE per GPU (or name the devices with --devices)"
                ))
            }
            (p, None) => p.unwrap_or(gpus),
        },
    };
    let devices: Vec<Device> = match (platform, &a.devices) {
        (Platform::Host, Some(_)) => {
            return Err("--devices names CUDA devices: use it with --platform cuda".into())
        }
        (Platform::Host, None) => (0..pes as u32).map(|r| Device::new(platform, r)).collect(),
        (Platform::Cuda, Some(d)) => {
            if let Some(bad) = d.iter().find(|&&o| o as usize >= gpus) {
                return Err(format!(
                    "--devices: cuda:{bad} is not one of the {gpus} visible CUDA device(s)"
                ));
            }
            if let Some((i, o)) = d.iter().enumerate().find(|(i, o)| d[..*i].contains(o)) {
                return Err(format!(
                    "--devices: cuda:{o} is named twice (PEs {} and {i}); a world takes one PE per device",
                    d.iter().position(|x| x == o).unwrap_or(0)
                ));
            }
            d.iter().map(|&o| Device::cuda(o)).collect()
        }
        (Platform::Cuda, None) => (0..pes as u32).map(Device::cuda).collect(),
    };
    let tokens = a.tokens.unwrap_or(if host { 1024 } else { 8192 });
    let hidden = a.hidden.unwrap_or(if host { 1024 } else { 4096 });
    let (experts, topk) = (a.experts, a.topk);
    if tokens == 0 || a.steps == 0 {
        return Err("--tokens and --steps must be at least 1".into());
    }
    if hidden == 0 || hidden % 8 != 0 {
        return Err(format!(
            "--hidden {hidden}: must be a positive multiple of 8 (rows of 16-byte multiples)"
        ));
    }
    if experts == 0 || experts % pes != 0 {
        return Err(format!(
            "--experts {experts}: must be a positive multiple of the {pes} PE(s)"
        ));
    }
    if topk == 0 || topk > experts {
        return Err(format!("--topk {topk}: must be in [1, {experts}]"));
    }
    let f = a
        .capacity_factor
        .unwrap_or(if a.dropless { 0.0 } else { 1.25 });
    if !(f.is_finite() && f >= 0.0) {
        return Err(format!(
            "--capacity-factor {f}: must be positive, or 0 for --dropless"
        ));
    }
    let dropless = a.dropless || f == 0.0;
    if a.dropless && f != 0.0 {
        return Err(format!(
            "--dropless with --capacity-factor {f}: a dropless layer has no capacity"
        ));
    }
    let mean = tokens as f64 * topk as f64 / experts as f64;
    // Dropless, an expert may take every token.
    let capacity = if dropless {
        tokens
    } else {
        ((f * mean).ceil() as usize).clamp(1, tokens)
    };
    let dtype = match a.dtype {
        DtypeArg::F32 => DType::F32,
        DtypeArg::Bf16 => DType::Bf16,
    };
    // In f64: the sizes come from the command line and may be anything; the
    // bound below keeps every product the run makes later far from usize's.
    let size = dtype.size_bytes() as f64;
    let slot_rows = if dropless {
        tokens as f64 * topk.min(experts / pes) as f64
    } else {
        (experts / pes) as f64 * capacity as f64
    };
    let max = xcall_permute::call::MAX_SEGMENTS;
    let fused = match a.exchange {
        Some(ExchangeArg::Fused) if pes > max => {
            return Err(format!(
                "--exchange fused: at most {max} PEs (one permute segment per PE), not {pes}; use --exchange copy"
            ))
        }
        Some(x) => x == ExchangeArg::Fused,
        None => pes <= max,
    };
    let slots = if fused { pes } else { 2 * pes - 1 };
    let bytes = slot_rows * slots as f64 * hidden as f64 * size * 2.0
        + tokens as f64 * hidden as f64 * size * 2.0;
    if bytes > 64.0 * (1u64 << 30) as f64 {
        return Err(format!(
            "the buffers of one PE would take {:.1} GiB; reduce --tokens or --hidden",
            bytes / (1u64 << 30) as f64
        ));
    }
    let shape = Shape {
        pes,
        tokens,
        hidden,
        experts,
        topk,
        capacity,
        dropless,
        fused,
        dtype,
    };
    let heap = crate::layer::heap_size(Pe::heap_bytes(&shape), "this shape")?;
    Ok(Run {
        platform,
        shape,
        devices,
        heap,
        steps: a.steps,
        seed: a.seed,
        capacity_factor: f,
        verify: a.verify.unwrap_or(Verify::default_for(a.steps)),
        progress_every: a.progress_every,
    })
}

/// Eager steps after the timed ones with every phase's end marked.
const PHASE_STEPS: usize = 3;

/// What one PE saw.
#[derive(Default)]
struct PeLog {
    /// Per timed step: ms and the cache's outcome.
    steps: Vec<(f64, Outcome)>,
    /// Per instrumented step: each phase's ms ([`PHASES`] order).
    phases: Vec<Vec<f64>>,
    /// The median ms of a copy of the permuted tensor (CUDA).
    copy_ms: Option<f64>,
    /// The checked steps' checks, in step order.
    checks: Vec<Checked>,
    /// Per step of the run: the routes its inputs lose to the capacity.
    dropped: Vec<usize>,
    /// Time the drawer thread spent drawing inputs.
    draw_time: Duration,
    /// Time the PE waited for room in its checker's queue.
    queue_wait: Duration,
    /// Time the PE waited for its drawer's inputs.
    input_wait: Duration,
    /// Memory in use after the warm-up step and after the last step.
    memory: (Option<u64>, Option<u64>),
    /// Some pair of the PE's world took NCCL.
    nccl: bool,
}

/// The progress of a run: the bar when one is drawn, else a line on
/// stderr every `every`.
struct Progress {
    bar: ProgressBar,
    every: Duration,
    start: Instant,
    last: Mutex<Instant>,
    total: usize,
}

impl Progress {
    /// Step `n` (0-based) of the run is done.
    fn step(&self, n: usize, steps: usize) {
        let what = match n {
            0 => "warm-up",
            n if n <= steps => "timed steps",
            _ => "phase steps",
        };
        self.bar.set_message(what);
        self.bar.inc(1);
        if !self.bar.is_hidden() {
            return;
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= self.every {
            *last = Instant::now();
            eprintln!(
                "xcall moe: {}/{} steps done ({what}), {:.1} s",
                n + 1,
                self.total,
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}

/// Threads each PE's checker splits one output's check over.
fn check_threads(pes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / pes).max(1)
}

/// The bytes each phase must move through one PE's memory at the least
/// (reads plus writes, [`PHASES`] order), with `N = P*S` permuted rows (`P`
/// slots of `S` rows): the map reads the routing and writes the map;
/// permute reads the tokens and writes every permuted row; copied,
/// dispatch and combine read the `P - 1` slots for peers and take the
/// `P - 1` slots peers write (a PE's own slot stays in place: nothing on
/// one PE), fused they move nothing (the permute's stores and the
/// unpermute's loads reach the peers' slots); the
/// experts read and write `N` rows with a capacity, dropless only the
/// `T*k` rows routed to them (on average); unpermute reads the map, the
/// probs and the routed rows and writes `y`. Waits move nothing.
fn phase_bytes(s: &Shape) -> [f64; 8] {
    let (t, e, row) = (s.tokens as f64, s.experts as f64, s.row_bytes() as f64);
    let n = (s.pes * s.slot_rows()) as f64;
    let expert_rows = if s.dropless { t * s.topk as f64 } else { n };
    let map = t * (2.0 * e + 1.0) * 4.0;
    // Fused, the permute and the unpermute move the peers' rows themselves.
    let peers = match s.fused {
        true => 0.0,
        false => 2.0 * n * row * (s.pes - 1) as f64 / s.pes as f64,
    };
    [
        t * e + map + (2.0 * e + 1.0) * 8.0,
        t * row + n * row + map,
        peers,
        0.0,
        2.0 * expert_rows * row,
        peers,
        0.0,
        map + t * e * 4.0 + (t * s.topk as f64).min(n) * row + t * row,
    ]
}

fn run_pe(
    run: &Run,
    rank: usize,
    group: &str,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
) -> Result<PeLog, String> {
    let device = run.devices[rank];
    let mut pe = Pe::new(run.shape, run.heap, rank, device, group)?;
    let threads = check_threads(run.shape.pes);
    let mut log = match run.platform {
        Platform::Host => {
            let mut checks = Checks::Inline {
                shape: run.shape,
                seed: run.seed,
                rank,
                threads,
            };
            pe_steps(run, &mut pe, cache, progress, &mut checks)?
        }
        Platform::Cuda => {
            let drawn = run.verify.drawn(run.total());
            let (inputs, draw_work) = verify::drawer(run.shape, run.seed, rank, drawn, threads);
            let (jobs, check_work) = verify::checker(run.shape, threads);
            let spawned =
                |name: &str| std::thread::Builder::new().name(format!("moe-{name}-{rank}"));
            std::thread::scope(|scope| {
                let drawer = spawned("draw")
                    .spawn_scoped(scope, draw_work)
                    .map_err(|e| format!("drawer thread: {e}"))?;
                let checker = spawned("check")
                    .spawn_scoped(scope, check_work)
                    .map_err(|e| format!("checker thread: {e}"))?;
                // Dropping `checks` closes both queues, however the steps end.
                let mut checks = Checks::Beside { inputs, jobs };
                let stepped = pe_steps(run, &mut pe, cache, progress, &mut checks);
                drop(checks);
                let drew = drawer.join();
                let checks = checker.join().map_err(|_| "the checker thread panicked")?;
                drew.map_err(|_| "the drawer thread panicked")?;
                stepped.map(|log| PeLog { checks, ..log })
            })?
        }
    };
    pe.barrier()?;
    log.nccl = pe.nccl();
    log.copy_ms = pe.copy_ms()?;
    pe.barrier()?;
    pe.finish()?;
    Ok(log)
}

/// Every step of the run on `pe`: fresh inputs for the steps that get
/// them, each checked output to `checks` (see [`verify`]); the log holds
/// the checks made on this thread (none when a checker thread makes them).
fn pe_steps(
    run: &Run,
    pe: &mut Pe,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
    checks: &mut Checks,
) -> Result<PeLog, String> {
    let (total, rank) = (run.total(), pe.rank());
    let mut log = PeLog::default();
    let mut current = None;
    let mut dropped = 0;
    for n in 0..total {
        let checked = run.verify.checks(n, total);
        if n == 0 || checked {
            let (d, waited) = checks.inputs(n)?;
            log.draw_time += d.took;
            log.input_wait += waited;
            // The previous step may still run on the device.
            pe.drain()?;
            pe.upload(&d.inputs)?;
            dropped = d.dropped;
            current = Some(d.inputs);
        }
        pe.barrier()?;
        if n == 0 {
            // Warm-up: compiles and autotunes outside any capture; waits on
            // the host so a failing PE times out instead of hanging.
            pe.step(Waits::Host)?;
            pe.drain()?;
            log.memory.0 = pe.memory_in_use()?;
        } else if n <= run.steps {
            log.steps.push(pe.timed_step(cache)?);
        } else {
            log.phases.push(pe.phase_step()?);
        }
        log.dropped.push(dropped);
        if checked {
            let y = pe.download()?;
            let inputs = current.clone().ok_or("a checked step without inputs")?;
            let (waited, checked) = checks.submit(Job { step: n, inputs, y })?;
            log.queue_wait += waited;
            log.checks.extend(checked);
        }
        if rank == 0 {
            progress.step(n, run.steps);
        }
    }
    pe.drain()?;
    log.memory.1 = pe.memory_in_use()?;
    Ok(log)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn stats_json(s: &Stats) -> serde_json::Value {
    json!({
        "hits": s.hits, "captures": s.captures, "updates": s.updates,
        "instantiations": s.instantiations, "entries": s.entries, "nodes": s.nodes,
        "eager_host": s.eager_host,
        "eager_fallbacks": s.eager_disabled + s.eager_caller_capturing
            + s.eager_capture_in_progress + s.eager_not_capturable + s.eager_capture_failed,
    })
}

fn stats_line(s: &Stats) -> String {
    if s.eager_host > 0 {
        return format!("{} run directly (Host has no graphs)", s.eager_host);
    }
    let eager = s.eager_disabled
        + s.eager_caller_capturing
        + s.eager_capture_in_progress
        + s.eager_not_capturable
        + s.eager_capture_failed;
    format!(
        "{} capture(s), {} replay(s), {} instantiation(s), {} eager; {} graph(s) of {} nodes",
        s.captures, s.hits, s.instantiations, eager, s.entries, s.nodes
    )
}

/// Runs `xcall moe`; `Ok(false)` when an output did not match.
pub fn run(args: &MoeArgs) -> Result<bool, Failure> {
    let gpus = match args.platform {
        PlatformArg::Host => 0,
        PlatformArg::Cuda => cuda_devices()?,
    };
    let run = validate(args, gpus).map_err(Failure::Usage)?;
    let json = JsonOut::open_optional(args.json.as_ref())?;
    let s = run.shape;
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).map_err(|e| e.to_string())?;
    let group = format!("xcall-moe-{}", std::process::id());
    // The warm-up step (kernel compilation and autotuning), the timed
    // steps and the instrumented ones; drawn on stderr when it is a
    // terminal and no log lines go there, else a line every few seconds.
    let bar = crate::report::progress_bar(run.total() as u64).with_style(
        ProgressStyle::with_template("moe {prefix}: {msg} [{bar:30}] {pos}/{len} steps {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(format!("{} PE(s)", s.pes));
    bar.set_message("warm-up (compiling kernels)");
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let start = Instant::now();
    let progress = Progress {
        bar,
        every: run.progress_every,
        start,
        last: Mutex::new(start),
        total: run.total(),
    };
    let logs: Vec<Mutex<Option<Result<PeLog, String>>>> =
        (0..s.pes).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for (rank, slot) in logs.iter().enumerate() {
            let (run, group, cache, progress) = (&run, &group, &cache, &progress);
            scope.spawn(move || {
                let r = run_pe(run, rank, group, cache, progress);
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    progress.bar.finish_and_clear();
    let wall = start.elapsed();
    let mut pes = Vec::with_capacity(s.pes);
    let mut errors = Vec::new();
    for (rank, slot) in logs.into_iter().enumerate() {
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(log)) => pes.push(log),
            Some(Err(e)) => errors.push(format!("PE {rank}: {e}")),
            None => errors.push(format!("PE {rank}: its thread panicked")),
        }
    }
    if !errors.is_empty() {
        return Err(Failure::Runtime(errors.join("; ")));
    }
    Ok(report(&run, &pes, &cache, wall, json)?)
}

/// The median of the first and of the last tenth of `times` (at least one
/// value each), to show a drift over a long run.
fn tenths(times: &[f64]) -> (f64, f64) {
    let n = (times.len() / 10).max(1);
    (
        median(&mut times[..n].to_vec()),
        median(&mut times[times.len() - n..].to_vec()),
    )
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("-".to_string(), |b| {
        format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
    })
}

fn report(
    run: &Run,
    pes: &[PeLog],
    cache: &GraphCache<CudaGraphs>,
    wall: Duration,
    json: Option<JsonOut>,
) -> Result<bool, String> {
    let s = run.shape;
    // A step takes as long as its slowest PE (they start together).
    let mut times: Vec<f64> = (0..run.steps)
        .map(|i| pes.iter().map(|p| p.steps[i].0).fold(0.0, f64::max))
        .collect();
    let first = times[0];
    let (first_tenth, last_tenth) = tenths(&times);
    let (min, max) = (
        times.iter().copied().fold(f64::INFINITY, f64::min),
        times.iter().copied().fold(0.0, f64::max),
    );
    let med = median(&mut times);
    let tokens_per_s = (s.pes * s.tokens) as f64 / (med / 1e3);
    let checks: Vec<&Check> = pes
        .iter()
        .flat_map(|p| &p.checks)
        .map(|c| &c.check)
        .collect();
    let bad: usize = checks.iter().map(|c| c.mismatches).sum();
    let dropped: usize = pes.iter().flat_map(|p| &p.dropped).sum();
    let total = run.total();
    let routes = (s.pes * s.tokens * s.topk * total) as f64;
    let fill = (routes - dropped as f64) / ((s.pes * s.pes * s.slot_rows() * total) as f64);
    // Copied, whole slots cross both ways; fused, only the routed rows
    // (the slots' fill on average).
    let slot = Pe::slot_bytes(&s) as f64 * if s.fused { fill } else { 1.0 };
    let between = 2.0 * slot * (s.pes * (s.pes - 1)) as f64;
    let gbps = between / (med / 1e3) / 1e9;
    let checked_steps = pes.first().map_or(0, |p| p.checks.len());
    let check_time: Duration = pes.iter().flat_map(|p| &p.checks).map(|c| c.took).sum();
    let draw_time: Duration = pes.iter().map(|p| p.draw_time).sum();
    let queue_wait = pes.iter().map(|p| p.queue_wait).max().unwrap_or_default();
    let input_wait = pes.iter().map(|p| p.input_wait).max().unwrap_or_default();
    let memory = |f: fn(&PeLog) -> Option<u64>| pes.iter().filter_map(f).max();
    let memory = (memory(|p| p.memory.0), memory(|p| p.memory.1));
    let max_rel = checks.iter().map(|c| c.max_relative).fold(0.0, f64::max);
    let devices: Vec<Device> = match run.platform {
        Platform::Host => vec![Device::HOST],
        Platform::Cuda => {
            let mut d = run.devices.clone();
            d.sort_by_key(|d| d.ordinal);
            d.dedup();
            d
        }
    };
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for p in pes {
        for (_, o) in &p.steps {
            *outcomes.entry(o.name().to_string()).or_default() += 1;
        }
    }
    // Each phase: the median over the instrumented steps per PE, and the
    // slowest PE's; its floor at the PEs' median copy rate (CUDA).
    let per_pe: Vec<Vec<f64>> = (0..PHASES.len())
        .map(|i| {
            pes.iter()
                .map(|p| median(&mut p.phases.iter().map(|v| v[i]).collect::<Vec<_>>()))
                .collect()
        })
        .collect();
    let phase_ms: Vec<f64> = per_pe
        .iter()
        .map(|v| v.iter().copied().fold(0.0, f64::max))
        .collect();
    let mut copies: Vec<f64> = pes.iter().filter_map(|p| p.copy_ms).collect();
    let copied = 2.0 * (s.pes * Pe::slot_bytes(&s)) as f64;
    // Bytes per ms.
    let copy_rate = (!copies.is_empty()).then(|| copied / median(&mut copies));
    let bytes = phase_bytes(&s);
    let floors: Vec<Option<f64>> = bytes.iter().map(|b| copy_rate.map(|r| b / r)).collect();
    let step_floor = copy_rate.map(|r| bytes.iter().sum::<f64>() / r);
    let verdict = match (run.verify, bad) {
        (Verify::Off, _) => "OFF",
        (_, 0) => "PASS",
        _ => "FAIL",
    };
    let platform = run.platform.name();
    println!(
        "xcall moe: {platform}, {} PE(s){}, {} tokens/PE, hidden {}, {} experts ({} per PE), top-{}, {}",
        s.pes,
        if run.platform == Platform::Host { " (threads)" } else { " (one thread per GPU)" },
        s.tokens,
        s.hidden,
        s.experts,
        s.local_experts(),
        s.topk,
        s.dtype
    );
    let heap_mib = Pe::heap_bytes(&s) as f64 / (1u64 << 20) as f64;
    if s.dropless {
        println!(
            "  dropless: slots of {} rows (tokens x min(top-k, experts per PE)) per sender, {heap_mib:.0} MiB of symmetric heap per PE; {} timed steps after 1 warm-up step",
            s.slot_rows(),
            run.steps
        );
    } else {
        println!(
            "  capacity {} rows per expert per PE (factor {}), {heap_mib:.0} MiB of symmetric heap per PE; {} timed steps after 1 warm-up step",
            s.capacity, run.capacity_factor, run.steps
        );
    }
    let memory_kind = match run.platform {
        Platform::Host => "process resident set",
        Platform::Cuda => "device memory in use (most of any GPU)",
    };
    println!();
    println!("  step time      median {med:.3} ms   min {min:.3} ms   max {max:.3} ms   (first timed step {first:.3} ms)");
    println!(
        "  steady state   median of the first tenth of timed steps {first_tenth:.3} ms, of the last tenth {last_tenth:.3} ms; {memory_kind} {} after the warm-up, {} at the end",
        mib(memory.0),
        mib(memory.1)
    );
    println!("  tokens/s       {tokens_per_s:.0}");
    println!(
        "  exchange       {}: {:.1} MB/step between PEs (each PE's own rows stay in place), {gbps:.2} GB/s at the median",
        if s.fused {
            "fused (permute writes the peers' slots, unpermute reads them)"
        } else if pes.iter().any(|l| l.nccl) {
            "copy (whole slots, one World::exchange per phase, through NCCL)"
        } else {
            "copy (whole slots with put_signal)"
        },
        between / 1e6,
    );
    println!(
        "  {:<15}{:.1}% of the permuted rows used, {} route(s) dropped over all steps",
        if s.dropless {
            "slot fill"
        } else {
            "capacity fill"
        },
        fill * 100.0,
        dropped
    );
    for d in &devices {
        println!("  graph cache    {d}: {}", stats_line(&cache.stats(*d)));
    }
    println!(
        "  phases         median of {PHASE_STEPS} eager steps with each phase's end marked, slowest PE{}",
        copy_rate.map_or(String::new(), |r| format!(
            "; floor = its bytes through one PE's memory at the copy rate ({:.0} GB/s)",
            r / 1e6
        ))
    );
    let cell = |f: Option<f64>| f.map_or("-".to_string(), |f| format!("{f:.3}"));
    for ((name, ms), floor) in PHASES.iter().zip(&phase_ms).zip(&floors) {
        println!("    {name:<14} {ms:>8.3} ms   floor {:>7}", cell(*floor));
    }
    println!(
        "    {:<14} {:>8.3} ms   floor {:>7}   (graph step median {med:.3} ms)",
        "sum",
        phase_ms.iter().sum::<f64>(),
        cell(step_floor)
    );
    let per_check = check_time.as_secs_f64() * 1e3 / (checks.len().max(1) as f64);
    println!(
        "  verification   {verdict}: {} PE(s) x {checked_steps} of {total} step(s) (--verify {}) against the f64 reference, {bad} mismatching element(s), max relative error {max_rel:.2e}",
        s.pes, run.verify,
    );
    println!(
        "  check cost     checks {:.2} s ({per_check:.1} ms per checked PE-step on {} thread(s)), draws {:.2} s, {}; the PEs waited {:.2} s for inputs and {:.2} s for the checker queues; wall time {:.2} s",
        check_time.as_secs_f64(),
        check_threads(s.pes),
        draw_time.as_secs_f64(),
        match run.platform {
            Platform::Host => "between the steps (outside their times)",
            Platform::Cuda => "on threads beside the GPU work",
        },
        input_wait.as_secs_f64(),
        queue_wait.as_secs_f64(),
        wall.as_secs_f64()
    );
    if bad > 0 {
        for (rank, p) in pes.iter().enumerate() {
            for c in &p.checks {
                if let Some((t, j, got, want)) = c.check.first {
                    println!(
                        "    PE {rank} step {}: {} mismatch(es), first at token {t} column {j}: {got} vs {want}",
                        c.step, c.check.mismatches
                    );
                }
            }
        }
    }
    if let Some(out) = json {
        let doc = json!({
            "platform": platform,
            "pes": s.pes, "tokens": s.tokens, "hidden": s.hidden, "experts": s.experts,
            "topk": s.topk, "dtype": s.dtype.name(), "capacity": s.capacity,
            "dropless": s.dropless, "exchange": if s.fused { "fused" } else { "copy" },
            "slot_rows": s.slot_rows(), "heap_bytes": Pe::heap_bytes(&s),
            "capacity_factor": run.capacity_factor, "steps": run.steps, "seed": run.seed,
            "step_ms": {"median": med, "min": min, "max": max, "first": first,
                "first_tenth": first_tenth, "last_tenth": last_tenth},
            "memory_bytes": {"kind": if run.platform == Platform::Host { "host_resident" } else { "device_in_use" },
                "after_warmup": memory.0, "at_end": memory.1},
            "wall_s": wall.as_secs_f64(),
            "tokens_per_s": tokens_per_s,
            "exchange_bytes_per_step": between,
            "exchange_gb_per_s": gbps,
            "capacity_fill": fill, "dropped_routes": dropped,
            "phases": PHASES.iter().enumerate().map(|(i, name)| json!({
                "name": name.replace(' ', "_"), "ms": phase_ms[i], "ms_per_pe": per_pe[i],
                "bytes": bytes[i], "floor_ms": floors[i],
            })).collect::<Vec<_>>(),
            "phase_steps": PHASE_STEPS,
            "copy_gb_per_s": copy_rate.map(|r| r / 1e6),
            "step_floor_ms": step_floor,
            "outcomes": outcomes,
            "graph_cache": devices.iter()
                .map(|d| (d.to_string(), stats_json(&cache.stats(*d))))
                .collect::<serde_json::Map<_, _>>(),
            "verification": {"verdict": verdict, "mismatches": bad, "max_relative_error": max_rel,
                "mode": run.verify.to_string(), "checked_steps": checked_steps, "total_steps": total,
                "check_s": check_time.as_secs_f64(), "draw_s": draw_time.as_secs_f64(),
                "wait_s": queue_wait.as_secs_f64(), "input_wait_s": input_wait.as_secs_f64()},
        });
        out.write("moe", &devices, doc)?;
    }
    Ok(bad == 0)
}
