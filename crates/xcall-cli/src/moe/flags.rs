//! The flags of `xcall moe` and the run they describe once checked
//! ([`validate`]): the platform, the shape, the devices of this process's
//! PEs, the processes of a launched run.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use xcall_core::{DType, Device, Platform};
use xcall_shmem::launch::LaunchEnv;
use xcall_shmem::{BootstrapKind, MAX_PES};
use xcall_warpspec::HostExecutor;

use super::data::{EpShape, Shape};
use super::pe::Pe;
use super::verify::Verify;

use crate::report::Failure;

pub use super::values::{DtypeArg, EpKernelsArg, ExchangeArg, HostExecutorArg, PlatformArg};

/// The most micro-batches `--microbatches` takes (each is a group with its
/// own buffers).
const MAX_MICROBATCHES: usize = 8;

/// Flags of `xcall moe`.
#[derive(Args, Debug, Clone)]
pub struct MoeArgs {
    /// Where the PEs run.
    #[arg(long, value_enum, default_value_t = PlatformArg::Host)]
    pub(super) platform: PlatformArg,
    /// PEs [default: 4 on Host; on CUDA every visible GPU]. Under a
    /// launcher, the PEs of each process [default: 1 on Host; on CUDA the
    /// process's share of the visible GPUs, `GPUs / local processes`
    /// from `local rank * share`, or one GPU when there are fewer GPUs
    /// than local processes].
    #[arg(long)]
    pub(super) pes: Option<usize>,
    /// Tokens per PE [default: 1024 on Host, 8192 on CUDA].
    #[arg(long)]
    pub(super) tokens: Option<usize>,
    /// Hidden size, a multiple of 8 [default: 1024 on Host, 4096 on CUDA].
    #[arg(long)]
    pub(super) hidden: Option<usize>,
    /// Experts, split evenly over the PEs.
    #[arg(long, default_value_t = 8)]
    pub(super) experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    pub(super) topk: usize,
    /// Element type.
    #[arg(long, value_enum, default_value_t = DtypeArg::Bf16)]
    pub(super) dtype: DtypeArg,
    /// Timed steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 20)]
    pub(super) steps: usize,
    /// Seed of every PE's tokens and router.
    #[arg(long, default_value_t = 1)]
    pub(super) seed: u64,
    /// Expert capacity per PE as a multiple of the mean load
    /// (`ceil(f * tokens * topk / experts)` rows, at most `tokens`); 0 is
    /// `--dropless` [default: 1.25].
    #[arg(long, allow_negative_numbers = true)]
    pub(super) capacity_factor: Option<f64>,
    /// No route is dropped: each PE's rows for one destination are packed
    /// densely into a slot sized for the worst case (`tokens * min(topk,
    /// experts per PE)` rows), and the experts read only the rows routed.
    #[arg(long)]
    pub(super) dropless: bool,
    /// How rows reach other PEs [default: token; with a capacity, fused
    /// up to 32 PEs (the segments a permute takes), else copy; copy when
    /// `XCALL_SHMEM_TRANSPORT` forces NCCL or TCP].
    #[arg(long, value_enum)]
    pub(super) exchange: Option<ExchangeArg>,
    /// With `--exchange token`: each expert's rows start on a multiple of
    /// this many rows (as grouped GEMMs want) [default: 1].
    #[arg(long)]
    pub(super) align: Option<usize>,
    /// With `--exchange token`: SMs its exchange kernels may occupy on
    /// CUDA (0: as many as help) [default: 0].
    #[arg(long)]
    pub(super) sms: Option<usize>,
    /// With `--exchange token`: which CUDA kernels run it; every choice
    /// writes the same bytes [default: auto].
    #[arg(long, value_enum)]
    pub(super) ep_kernels: Option<EpKernelsArg>,
    /// With `--exchange token`: splits each PE's tokens into this many
    /// micro-batches (at most 8), each with its own expert-parallel group.
    /// On CUDA the step forks: the exchanges still run one after another
    /// (every dispatch, then every combine), while a micro-batch's experts
    /// run beside the next micro-batch's dispatch or the one before's
    /// combine, on the SMs `--sms` leaves (with `--sms 0` the experts take
    /// every SM and little overlaps); on Host the micro-batches run in
    /// turn [default: 1].
    #[arg(long)]
    pub(super) microbatches: Option<usize>,
    /// The CUDA device of each PE, comma-separated and distinct (a world
    /// takes one PE per device) [default: 0, 1, ..]. Sets `--pes` when
    /// that is not given. Under a launcher, this process's devices.
    #[arg(long, value_delimiter = ',')]
    pub(super) devices: Option<Vec<u32>>,
    /// Which steps' outputs are checked against the f64 reference:
    /// `every`, `first:N` (the warm-up step and the N - 1 after it),
    /// `sample:K` (every K-th step and the last) or `off`. The checks run
    /// on their own threads beside the PEs [default: every for up to 100
    /// steps, else sample:K checking about 100 of them].
    #[arg(long, value_parser = Verify::parse)]
    pub(super) verify: Option<Verify>,
    /// Print a progress line to stderr this often when no progress bar is
    /// drawn (stderr not a terminal, or log lines going there).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub(super) progress_every: Duration,
    /// How long a PE waits for any other (a PE that stopped, a process
    /// that died) before the run fails naming what it waited for.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub(super) timeout: Duration,
    /// Also write the figures as JSON to this file (under a launcher:
    /// process 0 writes it).
    #[arg(long)]
    pub(super) json: Option<PathBuf>,
    /// How Host PEs run their experts; both write the same bytes. Ignored
    /// on CUDA.
    #[arg(long, value_enum, default_value_t = HostExecutorArg::Vectorized)]
    pub(super) host_executor: HostExecutorArg,
}

/// A run whose PEs are processes started by a launcher (more than one).
#[derive(Clone, Debug)]
pub(super) struct Launched {
    /// "torchrun", "mpirun" or "srun".
    pub(super) launcher: &'static str,
    /// This process's rank among `processes`.
    pub(super) process: usize,
    /// Processes in the job.
    pub(super) processes: usize,
    /// Rank 0's `host:port`.
    pub(super) address: String,
}

/// A checked configuration.
#[derive(Clone, Debug)]
pub(super) struct Run {
    pub(super) platform: Platform,
    pub(super) shape: Shape,
    /// The device of each PE of this process.
    pub(super) devices: Vec<Device>,
    /// The processes of a launched run; `None`: every PE is a thread of
    /// this process.
    pub(super) launched: Option<Launched>,
    /// How long a PE waits for another.
    pub(super) timeout: Duration,
    /// The heap per PE when xcall moe sizes it; `None` when
    /// `XCALL_SHMEM_HEAP_BYTES` gives one at least as large (the world
    /// then reads it).
    pub(super) heap: Option<usize>,
    pub(super) steps: usize,
    pub(super) seed: u64,
    pub(super) capacity_factor: f64,
    pub(super) verify: Verify,
    pub(super) progress_every: Duration,
    /// How Host PEs run their experts.
    pub(super) host: HostExecutor,
}

impl Run {
    /// Steps of the run: the warm-up, the timed and the instrumented ones.
    pub(super) fn total(&self) -> usize {
        self.steps + 1 + PHASE_STEPS
    }

    /// The rank of this process's first PE.
    pub(super) fn first_rank(&self) -> usize {
        self.launched
            .as_ref()
            .map_or(0, |l| l.process * self.devices.len())
    }

    /// How the PEs meet: an in-process group named `group`, or the
    /// launcher's TCP address.
    pub(super) fn bootstrap(&self, group: &str) -> BootstrapKind {
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
pub(super) const MAX_HOST_PES: usize = 64;

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
pub(super) fn launched_gpus(
    l: &LaunchEnv,
    pes: Option<usize>,
    gpus: usize,
) -> Result<Vec<u32>, String> {
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
/// without peer pointers (NCCL or TCP); a malformed variable of the world
/// is an error naming it.
pub(super) fn forced_remote() -> Result<bool, String> {
    Ok(matches!(
        crate::layer::world_environment()?,
        Some(xcall_shmem::Pairs::Nccl | xcall_shmem::Pairs::Tcp)
    ))
}

/// Checks the flags; `gpus` is the CUDA device count on CUDA, `launch`
/// what a launcher told this process. Every error is a usage error.
pub(super) fn validate(
    a: &MoeArgs,
    gpus: usize,
    launch: Option<&LaunchEnv>,
) -> Result<Run, String> {
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
    let forced_remote = forced_remote()?;
    // The token-once exchange unless a capacity is asked for (it is
    // dropless) or the transport policy takes pointers away.
    let exchange = match a.exchange {
        Some(x) => x,
        None if a.capacity_factor.is_some_and(|f| f != 0.0) || forced_remote => {
            if pes <= xcall_permute::call::MAX_SEGMENTS && !forced_remote {
                ExchangeArg::Fused
            } else {
                ExchangeArg::Copy
            }
        }
        None => ExchangeArg::Token,
    };
    let token = exchange == ExchangeArg::Token;
    if !token
        && (a.align.is_some()
            || a.sms.is_some()
            || a.ep_kernels.is_some()
            || a.microbatches.is_some()
            || a.dtype == DtypeArg::Fp8)
    {
        return Err(format!(
            "--align, --sms, --ep-kernels, --microbatches and --dtype fp8 are for --exchange token, not --exchange {}",
            if exchange == ExchangeArg::Fused {
                "fused"
            } else {
                "copy"
            }
        ));
    }
    if token && a.capacity_factor.is_some_and(|f| f != 0.0) {
        return Err(
            "--exchange token is dropless: leave --capacity-factor out, or pick --exchange fused or copy"
                .into(),
        );
    }
    if a.align == Some(0) {
        return Err("--align must be at least 1".into());
    }
    let microbatches = a.microbatches.unwrap_or(1);
    if !(1..=MAX_MICROBATCHES).contains(&microbatches) || microbatches > tokens {
        return Err(format!(
            "--microbatches {microbatches}: must be 1 to {MAX_MICROBATCHES} and at most --tokens ({tokens}): each micro-batch takes at least one token"
        ));
    }
    let f = a
        .capacity_factor
        .unwrap_or(if a.dropless || token { 0.0 } else { 1.25 });
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
        DtypeArg::Bf16 | DtypeArg::Fp8 => DType::Bf16,
    };
    if a.dtype == DtypeArg::Fp8 && hidden % 128 != 0 {
        return Err(format!(
            "--dtype fp8 scales blocks of 128 elements; --hidden {hidden} is not a multiple of 128"
        ));
    }
    if a.ep_kernels == Some(EpKernelsArg::LowLatency)
        && (tokens > xcall_ep::LL_MAX_TOKENS || experts > xcall_ep::LL_MAX_EXPERTS)
    {
        return Err(format!(
            "--ep-kernels low-latency: the low-latency kernels take at most {} tokens per PE and {} experts (got --tokens {tokens}, --experts {experts})",
            xcall_ep::LL_MAX_TOKENS,
            xcall_ep::LL_MAX_EXPERTS
        ));
    }
    // In f64: the sizes come from the command line and may be anything; the
    // bound below keeps every product the run makes later far from usize's.
    let size = dtype.size_bytes() as f64;
    let slot_rows = if dropless {
        tokens as f64 * topk.min(experts / pes) as f64
    } else {
        (experts / pes) as f64 * capacity as f64
    };
    let max = xcall_permute::call::MAX_SEGMENTS;
    if exchange == ExchangeArg::Fused && pes > max {
        return Err(format!(
            "--exchange fused: at most {max} PEs (one permute segment per PE), not {pes}; use --exchange copy"
        ));
    }
    let fused = exchange == ExchangeArg::Fused;
    let slots = if fused || token { pes } else { 2 * pes - 1 };
    // Token-once: expert-major rows in and out ([P*T*min(k, L)] each) and
    // the group's received rows and partials ([P*T] each).
    let bytes = match token {
        true => 2.0 * (slot_rows + tokens as f64) * pes as f64 * hidden as f64 * size,
        false => slot_rows * slots as f64 * hidden as f64 * size * 2.0,
    } + tokens as f64 * hidden as f64 * size * 2.0;
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
        ep: token.then_some(EpShape {
            fp8: a.dtype == DtypeArg::Fp8,
            align: a.align.unwrap_or(1),
            sms: a.sms.unwrap_or(0),
            kernels: match a.ep_kernels.unwrap_or(EpKernelsArg::Auto) {
                EpKernelsArg::Auto => xcall_ep::EpKernels::Auto,
                EpKernelsArg::Steps => xcall_ep::EpKernels::Steps,
                EpKernelsArg::LowLatency => xcall_ep::EpKernels::LowLatency,
                EpKernelsArg::Pull => xcall_ep::EpKernels::Pull,
            },
            microbatches,
        }),
    };
    let needed = Pe::heap_bytes(&shape).ok_or_else(|| {
        "the buffers of one PE would pass the address space; reduce --tokens, --hidden or --experts"
            .to_string()
    })?;
    let heap = crate::layer::heap_size(needed, "this shape")?;
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
pub(super) fn host_executor(run: &Run) -> Option<&'static str> {
    (run.platform == Platform::Host).then_some(match run.host {
        HostExecutor::Vectorized => "vectorized",
        HostExecutor::Pipeline => "pipeline",
    })
}

/// Eager steps after the timed ones with every phase's end marked.
pub(super) const PHASE_STEPS: usize = 3;

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

    fn launch(rank: usize, size: usize, local: Option<(usize, Option<usize>)>) -> LaunchEnv {
        LaunchEnv {
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
        let gpus = |l: &LaunchEnv, pes: Option<usize>, n: usize| launched_gpus(l, pes, n);
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
