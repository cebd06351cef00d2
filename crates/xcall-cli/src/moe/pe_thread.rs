//! The life of one PE's thread: it joins the world, allocates its host
//! buffers, runs every step of the run (drawing inputs and checking
//! outputs, on its thread or beside it), gathers the logs of a launched
//! run and leaves the world.

use xcall_core::Platform;
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::GraphCache;

use super::flags::Run;
use super::gather;
use super::log::{graph_lines, PeLog};
use super::pe::{Pe, Queued, Waits};
use super::progress::Progress;
use super::verify::{self, check_threads, Checks, Job};
use crate::alloc::RunError;

/// What one PE thread ends with: its log, and on a launched run's first
/// PE of each process every PE's log (by rank) through `allgather`.
pub(super) struct PeEnd {
    pub(super) log: PeLog,
    pub(super) world: Option<Vec<PeLog>>,
}

/// Graph replays of the forked step and of the same step in turn per
/// instrumented step (micro-batches on CUDA).
const FORK_ROUNDS: usize = 5;

/// The thread of this process's PE `local`: joins the world, runs, and
/// leaves it.
pub(super) fn pe_thread(
    run: &Run,
    local: usize,
    group: &str,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
) -> Result<PeEnd, RunError> {
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
    let ran = run_and_gather(run, local, rank, &mut pe, cache, progress);
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

/// [`pe_thread`] once its PE is up: the host buffers, the steps, then the
/// logs gathered (all but the PE's finalize).
pub(super) fn run_and_gather(
    run: &Run,
    local: usize,
    rank: usize,
    pe: &mut Pe,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
) -> Result<PeEnd, RunError> {
    let device = run.devices[local];
    let threads = check_threads(run.devices.len());
    // The host buffers used for every step, allocated before the first;
    // every PE learns whether every other has its own, so that none waits
    // for a PE that stopped here.
    let inline = match run.platform {
        Platform::Host => Some(Checks::inline(run.shape, run.seed, rank, threads)),
        Platform::Cuda => None,
    };
    let reserved = pe.reserve_upload().and_then(|()| inline.transpose());
    let all = pe.allgather(&[u8::from(reserved.is_ok())])?;
    let inline = reserved?;
    if let Some(q) = all.iter().position(|r| r[..] != [1]) {
        return Err(format!("PE {q} could not allocate its host buffers").into());
    }
    pe.set_up_buffers()?;
    let mut log = match inline {
        Some(mut checks) => run_steps(run, pe, cache, progress, &mut checks)?,
        None => {
            let drawn = run.verify.drawn(run.total());
            let (inputs, draw_work) = verify::drawer(run.shape, run.seed, rank, drawn, threads);
            let (jobs, check_work) = verify::checker(run.shape, rank, threads);
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
                let mut checks = Checks::Beside {
                    inputs,
                    jobs,
                    shape: run.shape,
                    rank,
                };
                let stepped = run_steps(run, pe, cache, progress, &mut checks);
                drop(checks);
                let drew = drawer.join();
                // A checker that could not allocate stopped the steps.
                let checks = checker
                    .join()
                    .map_err(|_| "the checker thread panicked")??;
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
        // What cannot be read leaves the GPU unnamed (no shared-GPU line)
        // rather than failing this PE between the others' collectives.
        log.gpu = xcall_shmem::host_identity()
            .ok()
            .zip(xcall_core::cuda::device_info(device).ok())
            .map(|(host, info)| format!("{host}/{}", info.pci_address));
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
pub(super) fn run_steps(
    run: &Run,
    pe: &mut Pe,
    cache: &GraphCache<CudaGraphs>,
    progress: &Progress,
    checks: &mut Checks,
) -> Result<PeLog, RunError> {
    let (total, rank) = (run.total(), pe.rank());
    let mut log = PeLog::default();
    let mut current = None;
    let mut dropped = 0;
    let mut link = 0;
    log.sms = pe.sms_used();
    log.kernels = pe.kernels().map(str::to_string);
    // Timed steps run ahead of their times: each waits on the device for
    // its peers (the steps' own protocol and, before its clock starts, a
    // barrier of the PEs' streams), not on the host; their times are read
    // at the next drain.
    let mut queued: Vec<Queued> = Vec::new();
    let settle = |pe: &mut Pe, log: &mut PeLog, queued: &mut Vec<Queued>| -> Result<(), RunError> {
        pe.drain()?;
        for q in queued.drain(..) {
            log.steps.push((q.ms()?, q.outcome));
        }
        Ok(())
    };
    for n in 0..total {
        let checked = run.verify.checks(n, total);
        let fresh = n == 0 || checked;
        if fresh {
            let (d, waited) = checks.inputs(n, current.take())?;
            log.draw_time += d.took;
            log.input_wait += waited;
            // The previous step may still run on the device.
            settle(pe, &mut log, &mut queued)?;
            pe.upload(&d.inputs)?;
            dropped = d.dropped;
            link = d.link_tokens;
            current = Some(d.inputs);
        }
        // Every PE meets on the host where inputs changed, and around
        // the untimed steps.
        if fresh || n > run.steps || n == 1 {
            settle(pe, &mut log, &mut queued)?;
            pe.barrier()?;
        }
        if n == 0 {
            // Warm-up: compiles and autotunes outside any capture; waits on
            // the host so a failing PE times out instead of hanging.
            pe.step(Waits::Host)?;
            pe.drain()?;
            log.memory.0 = pe.memory_in_use()?;
        } else if n <= run.steps {
            queued.push(pe.queue_step(cache)?);
        } else {
            log.phases.push(pe.phase_step()?);
            if let Some((forked, in_turn)) = pe.fork_against_in_turn(cache, FORK_ROUNDS)? {
                log.forked.push([forked, in_turn]);
            }
        }
        log.dropped.push(dropped);
        log.link_tokens.push(link);
        if checked {
            settle(pe, &mut log, &mut queued)?;
            let mut y = checks.output()?;
            pe.download(&mut y)?;
            let inputs = current.clone().ok_or("a checked step without inputs")?;
            let (waited, checked) = checks.submit(Job { step: n, inputs, y })?;
            log.queue_wait += waited;
            log.checks.extend(checked);
        }
        if rank == 0 {
            progress.step(n, run.steps);
        }
    }
    settle(pe, &mut log, &mut queued)?;
    log.memory.1 = pe.memory_in_use()?;
    Ok(log)
}
