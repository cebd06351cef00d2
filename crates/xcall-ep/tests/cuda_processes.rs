//! Expert-parallel groups of processes, a GPU each: the test binary spawns
//! itself as each PE (environment XCALL_EP_TEST_PE =
//! "socket,rank,size,mode,kernels"), the PEs meet at a Unix socket and
//! reach each other's memory through CUDA IPC. Every output is compared
//! with the plain-loop reference of `common` (both kernel choices); and a
//! PE killed between two calls makes the other's next call fail within
//! the world's timeout, naming it, instead of waiting for it. Skips
//! without two GPUs unless XCALL_REQUIRE_CUDA=1.

use std::time::{Duration, Instant};

use xcall_core::testing::wait_children;
use xcall_core::{Device, Status};
use xcall_ep::{EpConfig, EpGroup, EpKernels, Precision};
use xcall_shmem::{World, WorldConfig};

mod common;
use common::cuda::{gpus, CudaMem};
use common::run::{expert_major, inputs, rounds, Mem};
use common::*;

const PE_ENV: &str = "XCALL_EP_TEST_PE";
/// The world's timeout in the killed-peer test: the survivor must fail
/// after about this long, not hang.
const PEER_TIMEOUT: Duration = Duration::from_millis(1500);

fn world(socket: &str, rank: usize, n: usize, heap: usize, timeout: Duration) -> World {
    let mut c = WorldConfig::unix_socket(socket, rank, n, Device::cuda(rank as u32));
    c.heap_bytes = Some(heap + (2 << 20));
    c.timeout = timeout;
    let mut w = World::new();
    w.init(&c).unwrap();
    w
}

fn kernels(name: &str) -> EpKernels {
    match name {
        "steps" => EpKernels::Steps,
        _ => EpKernels::LowLatency,
    }
}

/// One PE process of the reference test: bf16 and FP8 dispatch, two
/// rounds each with their backward halves, checked by `round`.
fn reference_pe(socket: &str, rank: usize, n: usize, k: EpKernels) {
    for (precision, seed) in [(Precision::Bf16, 41), (Precision::Fp8Dispatch, 42)] {
        let case = Case::new(
            EpConfig {
                precision,
                kernels: k,
                align: 4,
                ..EpConfig::new(96, 256, 3, 4 * n)
            },
            n,
            Routing::Random,
            seed,
        );
        let heap = case.config.layout(n).unwrap().heap_bytes;
        let mut w = world(socket, rank, n, heap, Duration::from_secs(30));
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        assert_eq!(g.low_latency(), k == EpKernels::LowLatency);
        rounds(
            &case,
            rank,
            &mut g,
            &mut CudaMem::new(Device::cuda(rank as u32)),
            2,
        );
        g.destroy(&mut w).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    }
}

/// One PE process of the killed-peer test: a dispatch on every PE, then
/// the last PE kills itself (SIGKILL: no unwinding, no goodbye) and the
/// others combine. Their combine must fail with the timeout naming the
/// killed PE, within about the world's timeout.
fn killed_pe(socket: &str, rank: usize, n: usize, k: EpKernels) {
    let case = Case::new(
        EpConfig {
            kernels: k,
            ..EpConfig::new(64, 64, 2, 2 * n)
        },
        n,
        Routing::Random,
        31,
    );
    let c = case.config;
    let heap = c.layout(n).unwrap().heap_bytes;
    let mut w = world(socket, rank, n, heap, PEER_TIMEOUT);
    let mut g = EpGroup::new(&mut w, c).unwrap();
    let mut m = CudaMem::new(Device::cuda(rank as u32));
    let d = data(&case, rank);
    let (x, ids, probs) = inputs(&mut m, &d);
    let out = expert_major(&mut m, &g, false);
    // SAFETY: this PE's buffers, of the sizes the group asked for.
    unsafe { g.dispatch(x, ids, probs, case.sent[rank], &out, m.stream()) }.unwrap();
    m.sync();
    g.check().unwrap();
    if rank == n - 1 {
        // SAFETY: kill(2) on this process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!("SIGKILL returned");
    }
    let rows = c.layout(n).unwrap().expert_rows;
    let expert_out = m.alloc(rows * c.hidden * case.elem());
    let y = m.alloc(c.tokens * c.hidden * case.elem());
    let started = Instant::now();
    // SAFETY: this PE's buffers, of the sizes the group asked for.
    unsafe { g.combine(expert_out, y, m.stream()) }.unwrap();
    m.sync();
    let took = started.elapsed();
    let e = g.check().unwrap_err();
    let dead = format!("for PE {}", n - 1);
    assert!(
        e.status() == Status::Timeout && e.to_string().contains(&dead),
        "PE {rank} ({k:?}): combine with a killed peer: {e}"
    );
    assert!(
        took >= PEER_TIMEOUT && took < PEER_TIMEOUT * 4,
        "PE {rank} ({k:?}): combine failed after {took:?} with a {PEER_TIMEOUT:?} timeout"
    );
    // The group and world cannot be left collectively with a PE gone: the
    // process ends here, as a caller's would.
    std::process::exit(0);
}

/// Two PE processes of `mode` on `kernels`, waited for at most `limit`:
/// whether each exited with success.
fn two_processes(mode: &str, kernels: &str, limit: Duration) -> Vec<bool> {
    let s = socket_path(&format!("cuda-{mode}-{kernels}"));
    let children = (0..2)
        .map(|r| spawn_pe(PE_ENV, format!("{s},{r},2,{mode},{kernels}")))
        .collect();
    wait_children(
        &format!("2 GPU processes, {mode}, {kernels}"),
        children,
        limit,
    )
}

/// The entry of a spawned PE (does nothing when run by the harness).
#[test]
fn pe_process() {
    let Ok(spec) = std::env::var(PE_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (socket, rank, n, mode, k) = (
        parts[0],
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
        parts[3],
        kernels(parts[4]),
    );
    match mode {
        "reference" => reference_pe(socket, rank, n, k),
        "killed" => killed_pe(socket, rank, n, k),
        other => panic!("unknown mode {other}"),
    }
}

#[test]
fn processes_of_a_gpu_each_match_the_reference() {
    if std::env::var(PE_ENV).is_ok() || !gpus("cuda ep processes", 2) {
        return;
    }
    for kernels in ["steps", "low-latency"] {
        let ok = two_processes("reference", kernels, Duration::from_secs(120));
        assert_eq!(ok, [true, true], "{kernels}");
    }
}

#[test]
fn a_killed_gpu_peer_makes_the_other_fail_within_the_timeout() {
    if std::env::var(PE_ENV).is_ok() || !gpus("cuda ep killed peer", 2) {
        return;
    }
    for kernels in ["steps", "low-latency"] {
        let started = Instant::now();
        let ok = two_processes("killed", kernels, Duration::from_secs(60));
        assert_eq!(
            ok,
            [true, false],
            "{kernels}: the survivor passes its checks, the killed PE dies"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{kernels}: the survivor took {:?}",
            started.elapsed()
        );
    }
}
