//! `xcall moe`: an expert-parallel MoE layer step built from every xcall
//! crate, run for a number of steps on Host PEs (threads) or one thread
//! per GPU, every output checked against an f64 reference.
//!
//! Under a launcher (torchrun, Open MPI's `mpirun`, Slurm's `srun`: see
//! `xcall_shmem::launch`) each process runs its own PEs, one thread each,
//! and the world spans the processes through the TCP bootstrap at
//! `MASTER_ADDR:MASTER_PORT`. PE ranks go process by process (process `p`
//! of `n` with `k` PEs holds ranks `p*k .. p*k + k`); every process checks
//! its own PEs' outputs, the logs meet through the world's `allgather`,
//! and process 0 prints the report of the whole world.

mod data;
mod gather;
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
use xcall_shmem::launch::Launch;
use xcall_shmem::{BootstrapKind, MAX_PES};
use xcall_warpspec::HostExecutor;

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

/// How a Host PE runs its experts (the warp-specialized op).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostExecutorArg {
    /// Blocks of elements decoded, computed and encoded over the cores.
    Vectorized,
    /// The pipeline's thread-by-thread model on software mbarriers (the
    /// protocol the CUDA kernels follow; far slower).
    Pipeline,
}

/// Flags of `xcall moe`.
#[derive(Args, Debug, Clone)]
pub struct MoeArgs {
    /// Where the PEs run.
    #[arg(long, value_enum, default_value_t = PlatformArg::Host)]
    platform: PlatformArg,
    /// PEs [default: 4 on Host; on CUDA every visible GPU]. Under a
    /// launcher, the PEs of each process [default: 1 on Host; on CUDA the
    /// process's share of the visible GPUs, `GPUs / local processes`
    /// from `local rank * share`, or one GPU when there are fewer GPUs
    /// than local processes].
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
    /// segments a permute takes), else copy; copy when
    /// `XCALL_SHMEM_TRANSPORT` forces NCCL or TCP].
    #[arg(long, value_enum)]
    exchange: Option<ExchangeArg>,
    /// The CUDA device of each PE, comma-separated and distinct (a world
    /// takes one PE per device) [default: 0, 1, ..]. Sets `--pes` when
    /// that is not given. Under a launcher, this process's devices.
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
    /// How long a PE waits for any other (a PE that stopped, a process
    /// that died) before the run fails naming what it waited for.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Also write the figures as JSON to this file (under a launcher:
    /// process 0 writes it).
    #[arg(long)]
    json: Option<PathBuf>,
    /// How Host PEs run their experts; both write the same bytes. Ignored
    /// on CUDA.
    #[arg(long, value_enum, default_value_t = HostExecutorArg::Vectorized)]
    host_executor: HostExecutorArg,
}

/// A run whose PEs are processes started by a launcher (more than one).
#[derive(Clone, Debug)]
struct Launched {
    /// "torchrun", "mpirun" or "srun".
    launcher: &'static str,
    /// This process's rank among `processes`.
    process: usize,
    /// Processes in the job.
    processes: usize,
    /// Rank 0's `host:port`.
    address: String,
}

/// A checked configuration.
#[derive(Clone, Debug)]
struct Run {
    platform: Platform,
    shape: Shape,
    /// The device of each PE of this process.
    devices: Vec<Device>,
    /// The processes of a launched run; `None`: every PE is a thread of
    /// this process.
    launched: Option<Launched>,
    /// How long a PE waits for another.
    timeout: Duration,
    /// The heap per PE when xcall moe sizes it; `None` when
    /// `XCALL_SHMEM_HEAP_BYTES` gives one at least as large (the world
    /// then reads it).
    heap: Option<usize>,
    steps: usize,
    seed: u64,
    capacity_factor: f64,
    verify: Verify,
    progress_every: Duration,
    /// How Host PEs run their experts.
    host: HostExecutor,
}

impl Run {
    /// Steps of the run: the warm-up, the timed and the instrumented ones.
    fn total(&self) -> usize {
        self.steps + 1 + PHASE_STEPS
    }

    /// The rank of this process's first PE.
    fn first_rank(&self) -> usize {
        self.launched
            .as_ref()
            .map_or(0, |l| l.process * self.devices.len())
    }

    /// How the PEs meet: an in-process group named `group`, or the
    /// launcher's TCP address.
    fn bootstrap(&self, group: &str) -> BootstrapKind {
        match &self.launched {
            None => BootstrapKind::InProcess {
                group: group.to_string(),
            },
            Some(l) => BootstrapKind::Tcp {
                address: l.address.clone(),
            },
        }
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

/// The CUDA devices of a launched process that names none: `per` GPUs
/// (`--pes`, else its share of the visible ones) from `local rank * per`;
/// one GPU each wraps when the GPUs are fewer than the local processes
/// (a launcher that gives each process its own GPU shows it as device 0).
fn launched_gpus(l: &Launch, pes: Option<usize>, gpus: usize) -> Result<Vec<u32>, String> {
    let share = match l.local_size {
        Some(n) if gpus >= n => gpus / n,
        _ => 1,
    };
    let per = pes.unwrap_or(share);
    let local = l.local_rank.unwrap_or(0);
    let first = local
        .checked_mul(per)
        // One GPU each, fewer GPUs than processes: they take turns.
        .map(|f| if per == 1 && gpus > 0 { f % gpus } else { f })
        .filter(|f| f.saturating_add(per) <= gpus)
        .ok_or_else(|| {
            format!(
                "--pes {per}: process {} ({} local rank {local}) has no {per} GPU(s) of its own among the {gpus} visible; name them with --devices",
                l.rank, l.launcher
            )
        })?;
    Ok((first..first + per).map(|o| o as u32).collect())
}

/// Whether `XCALL_SHMEM_TRANSPORT` forces every pair onto a transport
/// without peer pointers (NCCL or TCP).
fn forced_remote() -> bool {
    let policy = xcall_core::env::text(xcall_shmem::TRANSPORT_ENV)
        .ok()
        .flatten();
    matches!(
        policy.as_deref().and_then(xcall_shmem::Pairs::parse),
        Some(xcall_shmem::Pairs::Nccl | xcall_shmem::Pairs::Tcp)
    )
}

/// Checks the flags; `gpus` is the CUDA device count on CUDA, `launch`
/// what a launcher told this process. Every error is a usage error.
fn validate(a: &MoeArgs, gpus: usize, launch: Option<&Launch>) -> Result<Run, String> {
    let platform = match a.platform {
        PlatformArg::Host => Platform::Host,
        PlatformArg::Cuda => Platform::Cuda,
    };
    let host = platform == Platform::Host;
    let launched = match launch {
        Some(l) if l.size > 1 => Some(Launched {
            launcher: l.launcher,
            process: l.rank,
            processes: l.size,
            address: l.address.clone().ok_or_else(|| {
                format!(
                    "{} started this process as rank {} of {} but gave no rank 0 address: set MASTER_ADDR and MASTER_PORT",
                    l.launcher, l.rank, l.size
                )
            })?,
        }),
        _ => None,
    };
    // The devices a launched CUDA process takes when it names none.
    let launched_devices = match (platform, launch, &launched, &a.devices) {
        (Platform::Cuda, Some(l), Some(_), None) => Some(launched_gpus(l, a.pes, gpus)?),
        _ => None,
    };
    let devices_arg = a.devices.as_ref().or(launched_devices.as_ref());
    let pes = match (platform, a.pes) {
        (_, Some(0)) => return Err("--pes must be at least 1".into()),
        (Platform::Host, Some(p)) if p > MAX_HOST_PES => {
            return Err(format!(
                "--pes {p}: at most {MAX_HOST_PES} on Host (PEs are threads that spin while they wait for each other; more would only take turns on this machine's cores)"
            ))
        }
        (Platform::Host, p) => p.unwrap_or(if launched.is_some() { 1 } else { 4 }),
        (Platform::Cuda, p) => match (p, devices_arg) {
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
    // The PEs of this process, and of the world.
    let processes = launched.as_ref().map_or(1, |l| l.processes);
    let first = launched.as_ref().map_or(0, |l| l.process * pes);
    let local = pes;
    let pes = pes
        .checked_mul(processes)
        .filter(|&n| n <= MAX_PES)
        .ok_or_else(|| {
            format!(
                "{local} PE(s) in each of {processes} processes pass the limit of {MAX_PES} PEs"
            )
        })?;
    let devices: Vec<Device> = match (platform, devices_arg) {
        (Platform::Host, Some(_)) => {
            return Err("--devices names CUDA devices: use it with --platform cuda".into())
        }
        // A Host PE's ordinal names its slot in this process: its rank.
        (Platform::Host, None) => (first..first + local)
            .map(|r| Device::new(platform, r as u32))
            .collect(),
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
        (Platform::Cuda, None) => (0..local as u32).map(Device::cuda).collect(),
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
        // A policy that forces pairs without pointers takes the copy.
        None => pes <= max && !forced_remote(),
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
    if a.timeout.is_zero() {
        return Err("--timeout must be above zero".into());
    }
    Ok(Run {
        platform,
        shape,
        devices,
        launched,
        timeout: a.timeout,
        heap,
        steps: a.steps,
        seed: a.seed,
        capacity_factor: f,
        verify: a.verify.unwrap_or(Verify::default_for(a.steps)),
        progress_every: a.progress_every,
        host: match a.host_executor {
            HostExecutorArg::Vectorized => HostExecutor::Vectorized,
            HostExecutorArg::Pipeline => HostExecutor::Pipeline,
        },
    })
}

/// How the Host PEs ran their experts (`None` on CUDA).
fn host_executor(run: &Run) -> Option<&'static str> {
    (run.platform == Platform::Host).then_some(match run.host {
        HostExecutor::Vectorized => "vectorized",
        HostExecutor::Pipeline => "pipeline",
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
    /// The transport of the PE's pairs without pointers ("nccl", "tcp"),
    /// when some pair took one.
    remote: Option<&'static str>,
    /// The graph cache lines this PE reports: its device's on CUDA; on
    /// Host, its process's (the first PE of a launched process only).
    graphs: Vec<GraphLine>,
}

/// One device's graph cache as the report shows it.
#[derive(Clone, Debug)]
struct GraphLine {
    /// "cuda:0", or "process 1 cuda:0" in a launched run.
    label: String,
    /// Its stats as a line of text.
    line: String,
    /// Its stats as JSON.
    stats: serde_json::Value,
}

/// The graph caches of this process's `devices` (Host: one), labelled
/// with the process in a launched run.
fn graph_lines(
    cache: &GraphCache<CudaGraphs>,
    devices: &[Device],
    launched: Option<&Launched>,
) -> Vec<GraphLine> {
    let mut devices = devices.to_vec();
    if devices
        .first()
        .is_some_and(|d| d.platform == Platform::Host)
    {
        devices = vec![Device::HOST];
    }
    devices.sort_by_key(|d| d.ordinal);
    devices.dedup();
    devices
        .iter()
        .map(|d| GraphLine {
            label: match launched {
                None => d.to_string(),
                Some(l) => format!("process {} {d}", l.process),
            },
            line: stats_line(&cache.stats(*d)),
            stats: stats_json(&cache.stats(*d)),
        })
        .collect()
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

/// What one PE thread ends with: its log, and on a launched run's first
/// PE of each process every PE's log (by rank) through `allgather`.
struct PeEnd {
    log: PeLog,
    world: Option<Vec<PeLog>>,
}

/// Runs this process's PE `local`.
fn run_pe(
    run: &Run,
    local: usize,
    group: &str,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
) -> Result<PeEnd, String> {
    let device = run.devices[local];
    let rank = run.first_rank() + local;
    let mut pe = Pe::new(
        run.shape,
        run.heap,
        rank,
        device,
        &run.bootstrap(group),
        run.timeout,
    )?
    .with_host_executor(run.host);
    let ran = pe_run(run, local, rank, &mut pe, cache, progress);
    if ran.is_err() && device.platform == Platform::Cuda {
        // A failed step may leave this PE's step graph running, its
        // transfers waiting for a peer that stopped. Destroyed before the
        // world drops (the driver frees it once its kernels end), so the
        // world's NCCL abort ends those kernels and can then free the
        // communicator: nothing waits for the lost peer.
        cache.clear(device);
    }
    let end = ran?;
    pe.finish()?;
    Ok(end)
}

/// [`run_pe`] once its PE is up: the steps, then the reports (all but
/// the PE's finalize).
fn pe_run(
    run: &Run,
    local: usize,
    rank: usize,
    pe: &mut Pe,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
) -> Result<PeEnd, String> {
    let device = run.devices[local];
    let threads = check_threads(run.devices.len());
    let mut log = match run.platform {
        Platform::Host => {
            let mut checks = Checks::Inline {
                shape: run.shape,
                seed: run.seed,
                rank,
                threads,
            };
            pe_steps(run, pe, cache, progress, &mut checks)?
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
                let stepped = pe_steps(run, pe, cache, progress, &mut checks);
                drop(checks);
                let drew = drawer.join();
                let checks = checker.join().map_err(|_| "the checker thread panicked")?;
                drew.map_err(|_| "the drawer thread panicked")?;
                stepped.map(|log| PeLog { checks, ..log })
            })?
        }
    };
    // Every PE's steps are done: the caches' counts are final.
    pe.barrier()?;
    log.remote = pe.remote().map(|t| t.name());
    log.copy_ms = pe.copy_ms()?;
    pe.barrier()?;
    let mut world = None;
    if device.platform == Platform::Cuda {
        // This PE's graphs, reported before they go: NCCL's finalize waits
        // until every graph that captured its transfers is destroyed.
        log.graphs = graph_lines(cache, &[device], run.launched.as_ref());
        cache.clear(device);
    } else if run.launched.is_some() && local == 0 {
        log.graphs = graph_lines(cache, &run.devices, run.launched.as_ref());
    }
    if run.launched.is_some() {
        let mine = serde_json::to_vec(&gather::encode(&log)).map_err(|e| e.to_string())?;
        let all = pe.allgather(&mine)?;
        if local == 0 {
            world = Some(gather::decode_all(&all)?);
        }
    }
    Ok(PeEnd { log, world })
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
    let launch = Launch::from_env().map_err(|e| Failure::Usage(e.to_string()))?;
    let run = validate(args, gpus, launch.as_ref()).map_err(Failure::Usage)?;
    // Process 0 of a launched run writes the report.
    let reports = run.launched.as_ref().is_none_or(|l| l.process == 0);
    let json = match reports {
        true => JsonOut::open_optional(args.json.as_ref())?,
        false => None,
    };
    let s = run.shape;
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).map_err(|e| e.to_string())?;
    let group = format!("xcall-moe-{}", std::process::id());
    // The warm-up step (kernel compilation and autotuning), the timed
    // steps and the instrumented ones; drawn on stderr when it is a
    // terminal and no log lines go there, else a line every few seconds.
    let bar = match reports {
        true => crate::report::progress_bar(run.total() as u64),
        false => ProgressBar::hidden(),
    }
    .with_style(
        ProgressStyle::with_template("moe {prefix}: {msg} [{bar:30}] {pos}/{len} steps {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(match &run.launched {
        None => format!("{} PE(s)", s.pes),
        Some(l) => format!("{} PE(s) in {} processes", s.pes, l.processes),
    });
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
    let ends: Vec<Mutex<Option<Result<PeEnd, String>>>> =
        run.devices.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for (local, slot) in ends.iter().enumerate() {
            let (run, group, cache, progress) = (&run, &group, &cache, &progress);
            scope.spawn(move || {
                let r = run_pe(run, local, group, cache, progress);
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    progress.bar.finish_and_clear();
    let wall = start.elapsed();
    let mut pes = Vec::with_capacity(ends.len());
    let mut world = None;
    let mut errors = Vec::new();
    for (local, slot) in ends.into_iter().enumerate() {
        let rank = run.first_rank() + local;
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(end)) => {
                pes.push(end.log);
                world = world.or(end.world);
            }
            Some(Err(e)) => errors.push(format!("PE {rank}: {e}")),
            None => errors.push(format!("PE {rank}: its thread panicked")),
        }
    }
    if !errors.is_empty() {
        // A failed PE's communicator may still be aborting (NCCL frees it
        // once the step graph, destroyed already, has ended): the process
        // exits after that.
        let left = xcall_shmem::nccl::settle_aborts(std::time::Duration::from_secs(10));
        if left > 0 {
            errors.push(format!(
                "{left} NCCL communicator(s) still aborting at exit"
            ));
        }
        return Err(Failure::Runtime(errors.join("; ")));
    }
    match (&run.launched, world) {
        (None, _) => {
            let graphs = match run.platform {
                Platform::Host => graph_lines(&cache, &run.devices, None),
                Platform::Cuda => pes.iter().flat_map(|p| p.graphs.clone()).collect(),
            };
            Ok(report(&run, &pes, &graphs, wall, json)?)
        }
        (Some(_), Some(world)) if reports => {
            let graphs: Vec<GraphLine> = world.iter().flat_map(|p| p.graphs.clone()).collect();
            Ok(report(&run, &world, &graphs, wall, json)?)
        }
        (Some(l), Some(world)) => {
            let bad: usize = world
                .iter()
                .flat_map(|p| &p.checks)
                .map(|c| c.check.mismatches)
                .sum();
            let first = run.first_rank();
            let mine = match run.devices.len() {
                1 => format!("PE {first}"),
                k => format!("PEs {first}..{}", first + k - 1),
            };
            println!(
                "xcall moe: process {} of {} ({}), {mine} of {} on {}: verification {} over the world, {bad} mismatching element(s); process 0 prints the report",
                l.process,
                l.processes,
                l.launcher,
                s.pes,
                run.devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
                verdict(run.verify, bad),
            );
            Ok(bad == 0)
        }
        (Some(_), None) => Err(Failure::Runtime(
            "the world's logs never reached this process".into(),
        )),
    }
}

/// The run's verdict: OFF when nothing was checked, else PASS or FAIL.
fn verdict(verify: Verify, mismatches: usize) -> &'static str {
    match (verify, mismatches) {
        (Verify::Off, _) => "OFF",
        (_, 0) => "PASS",
        _ => "FAIL",
    }
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
    graphs: &[GraphLine],
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
    let verdict = verdict(run.verify, bad);
    let platform = run.platform.name();
    let remote = pes.iter().find_map(|l| l.remote);
    let layout = match (&run.launched, run.platform) {
        (Some(l), _) => format!(
            " ({} processes under {}, {} PE(s) each, one thread per PE)",
            l.processes,
            l.launcher,
            run.devices.len()
        ),
        (None, Platform::Host) => " (threads)".into(),
        (None, _) => " (one thread per GPU)".into(),
    };
    println!(
        "xcall moe: {platform}, {} PE(s){layout}, {} tokens/PE, hidden {}, {} experts ({} per PE), top-{}, {}",
        s.pes,
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
    if let Some(e) = host_executor(run) {
        println!("  experts        on the Host, {e}");
    }
    println!(
        "  exchange       {}: {:.1} MB/step between PEs (each PE's own rows stay in place), {gbps:.2} GB/s at the median",
        if s.fused {
            "fused (permute writes the peers' slots, unpermute reads them)"
        } else if remote.is_some_and(|r| r.starts_with("nccl")) {
            "copy (whole slots, one World::exchange per phase, through NCCL)"
        } else if remote.is_some() {
            "copy (whole slots, one World::exchange per phase, through TCP)"
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
    for g in graphs {
        println!("  graph cache    {}: {}", g.label, g.line);
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
        check_threads(run.devices.len()),
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
        let mut doc = json!({
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
            "graph_cache": graphs.iter()
                .map(|g| (g.label.clone(), g.stats.clone()))
                .collect::<serde_json::Map<_, _>>(),
            "verification": {"verdict": verdict, "mismatches": bad, "max_relative_error": max_rel,
                "mode": run.verify.to_string(), "checked_steps": checked_steps, "total_steps": total,
                "check_s": check_time.as_secs_f64(), "draw_s": draw_time.as_secs_f64(),
                "wait_s": queue_wait.as_secs_f64(), "input_wait_s": input_wait.as_secs_f64()},
        });
        // Past json!'s recursion limit in one literal.
        doc["remote_transport"] = json!(remote);
        doc["processes"] = json!(run.launched.as_ref().map_or(1, |l| l.processes));
        doc["launcher"] = json!(run.launched.as_ref().map(|l| l.launcher));
        doc["host_executor"] = json!(host_executor(run));
        out.write("moe", &devices, doc)?;
    }
    Ok(bad == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        moe: MoeArgs,
    }

    fn args(flags: &[&str]) -> MoeArgs {
        let mut argv = vec!["moe"];
        argv.extend(flags);
        Cli::parse_from(argv).moe
    }

    fn launch(rank: usize, size: usize, local: Option<(usize, Option<usize>)>) -> Launch {
        Launch {
            launcher: "torchrun",
            rank,
            size,
            local_rank: local.map(|l| l.0),
            local_size: local.and_then(|l| l.1),
            address: Some("127.0.0.1:29500".into()),
        }
    }

    /// A launched process without `--devices` takes its share of the
    /// visible GPUs from its local rank, one GPU (wrapping) when there are
    /// fewer GPUs than local processes, and is refused when `--pes` asks
    /// for GPUs it cannot have.
    #[test]
    fn launched_processes_take_their_share_of_the_gpus() {
        let gpus = |l: &Launch, pes: Option<usize>, n: usize| launched_gpus(l, pes, n);
        assert_eq!(
            gpus(&launch(1, 2, Some((1, Some(2)))), None, 8),
            Ok(vec![4, 5, 6, 7])
        );
        assert_eq!(
            gpus(&launch(0, 2, Some((0, Some(2)))), None, 8),
            Ok(vec![0, 1, 2, 3])
        );
        assert_eq!(
            gpus(&launch(1, 3, Some((1, Some(3)))), None, 8),
            Ok(vec![2, 3])
        );
        // Each process sees its own GPU as device 0.
        assert_eq!(
            gpus(&launch(5, 8, Some((5, Some(8)))), None, 1),
            Ok(vec![0])
        );
        assert_eq!(
            gpus(&launch(1, 2, Some((1, Some(2)))), None, 3),
            Ok(vec![1])
        );
        // No local size (srun): one GPU by local rank, wrapping.
        assert_eq!(gpus(&launch(3, 4, Some((3, None))), None, 2), Ok(vec![1]));
        assert_eq!(gpus(&launch(3, 4, None), None, 2), Ok(vec![0]));
        assert_eq!(
            gpus(&launch(1, 2, Some((1, Some(2)))), Some(2), 8),
            Ok(vec![2, 3])
        );
        for (local, pes, n) in [(2, 3, 8), (0, 9, 8), (1, 2, 3), (4, 2, 8), (0, 1, 0)] {
            let e = gpus(&launch(local, 4, Some((local, Some(4)))), Some(pes), n).unwrap_err();
            assert!(
                e.contains(&format!("--pes {pes}")) && e.contains("--devices"),
                "{e}"
            );
        }
    }

    /// Under a launcher of more than one process, `--pes` counts this
    /// process's PEs, their ranks follow the process's, and the world
    /// meets at the launcher's address; one process is a plain run.
    #[test]
    fn launched_runs_number_their_pes_process_by_process() {
        let run = validate(&args(&[]), 0, Some(&launch(2, 4, Some((2, Some(4)))))).unwrap();
        assert_eq!(run.devices, [Device::new(Platform::Host, 2)]);
        assert_eq!((run.shape.pes, run.first_rank()), (4, 2));
        assert_eq!(
            run.bootstrap("g"),
            BootstrapKind::Tcp {
                address: "127.0.0.1:29500".into()
            }
        );
        let run = validate(&args(&["--pes", "2"]), 0, Some(&launch(2, 4, None))).unwrap();
        assert_eq!(
            run.devices,
            [
                Device::new(Platform::Host, 4),
                Device::new(Platform::Host, 5)
            ]
        );
        assert_eq!((run.shape.pes, run.first_rank()), (8, 4));
        // One process: every PE a thread of it, as without a launcher.
        let run = validate(&args(&[]), 0, Some(&launch(0, 1, None))).unwrap();
        assert!(run.launched.is_none());
        assert_eq!((run.shape.pes, run.devices.len()), (4, 4));
        assert_eq!(
            run.bootstrap("g"),
            BootstrapKind::InProcess { group: "g".into() }
        );
        // CUDA: the process's share of the GPUs, or the ones it names.
        let l = launch(1, 2, Some((1, Some(2))));
        let run = validate(&args(&["--platform", "cuda"]), 4, Some(&l)).unwrap();
        assert_eq!(run.devices, [Device::cuda(2), Device::cuda(3)]);
        assert_eq!((run.shape.pes, run.first_rank()), (4, 2));
        let run = validate(
            &args(&["--platform", "cuda", "--devices", "0"]),
            4,
            Some(&l),
        )
        .unwrap();
        assert_eq!(run.devices, [Device::cuda(0)]);
        assert_eq!(run.shape.pes, 2);

        let mut bare = launch(1, 2, None);
        bare.address = None;
        let e = validate(&args(&[]), 0, Some(&bare)).unwrap_err();
        assert!(e.contains("MASTER_ADDR and MASTER_PORT"), "{e}");
        let e = validate(&args(&["--pes", "64"]), 0, Some(&launch(0, 2000, None))).unwrap_err();
        assert!(e.contains("64 PE(s) in each of 2000 processes"), "{e}");
        let e = validate(&args(&["--timeout", "0s"]), 0, None).unwrap_err();
        assert!(e.contains("--timeout"), "{e}");
    }
}
