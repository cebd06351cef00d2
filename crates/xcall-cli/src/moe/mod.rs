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
//!
//! The parts: [`flags`] (the flags and the checked run), [`pe_thread`]
//! (one PE's thread), [`pe`] (a PE's buffers and step), [`data`] (inputs
//! and the reference), [`verify`] (which steps are checked, and where),
//! [`log`] and [`gather`] (what each PE saw, across processes),
//! [`summary`] (the report).

mod data;
mod flags;
mod gather;
mod log;
mod pe;
mod pe_thread;
mod progress;
mod summary;
mod values;
mod verify;

use std::sync::Mutex;
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use xcall_core::Platform;
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::{CacheConfig, GraphCache};
use xcall_shmem::launch::LaunchEnv;

use flags::validate;
pub use flags::{cuda_devices, MoeArgs, PlatformArg};
use log::{graph_lines, GraphLine};
use pe_thread::{pe_thread, PeEnd};
use progress::Progress;
use summary::{report, verdict};

use crate::alloc::RunError;
use crate::report::{Failure, JsonOut};

/// Runs `xcall moe`; `Ok(false)` when an output did not match.
pub fn run(args: &MoeArgs) -> Result<bool, Failure> {
    let gpus = match args.platform {
        PlatformArg::Host => 0,
        PlatformArg::Cuda => cuda_devices()?,
    };
    let launch = LaunchEnv::from_env().map_err(|e| Failure::Usage(e.to_string()))?;
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
    let ends: Vec<Mutex<Option<Result<PeEnd, RunError>>>> =
        run.devices.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for (local, slot) in ends.iter().enumerate() {
            let (run, group, cache, progress) = (&run, &group, &cache, &progress);
            scope.spawn(move || {
                let r = pe_thread(run, local, group, cache, progress);
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    progress.bar.finish_and_clear();
    let wall = start.elapsed();
    let mut pes = Vec::with_capacity(ends.len());
    let mut world = None;
    let mut errors = Vec::new();
    let mut unallocated = None;
    for (local, slot) in ends.into_iter().enumerate() {
        let rank = run.first_rank() + local;
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(end)) => {
                pes.push(end.log);
                world = world.or(end.world);
            }
            Some(Err(RunError::Alloc(e))) => {
                unallocated.get_or_insert(e);
            }
            Some(Err(RunError::Failed(e))) => errors.push(format!("PE {rank}: {e}")),
            None => errors.push(format!("PE {rank}: its thread panicked")),
        }
    }
    // A buffer that could not be allocated is the whole story: what the
    // other PEs saw follows from it.
    if let Some(e) = unallocated {
        errors = vec![e.to_string()];
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
