//! Expert-parallel groups of processes on GPUs: the test binary spawns
//! itself as each PE (environment XCALL_EP_TEST_PE =
//! "socket,rank,size,mode,kernels"), the PEs meet at a Unix socket and
//! reach each other's memory through CUDA IPC. PE r takes GPU r mod the
//! machine's GPUs: with fewer GPUs than PEs, processes share a GPU and
//! take turns on it (the default compute mode allows it), so the kernels
//! that run only between PEs (push, signal, reduce, the low-latency
//! kernels' waits) are checked on a machine of one GPU too. Every case of
//! the one-process GPU test runs on 2 and 4 PE processes, each output
//! equal bit for bit to a Host run of the same case and to the plain-loop
//! reference of `common` (both kernel choices); and a PE killed between
//! two calls makes the other's next call fail within the world's timeout,
//! naming it, instead of waiting for it. Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1, and where PEs would share a GPU whose compute
//! mode lets one process hold it at a time.

use std::time::{Duration, Instant};

use xcall_core::testing::{gpus_for_processes, process_gpu, wait_children};
use xcall_core::Status;
use xcall_ep::{EpConfig, EpGroup, EpKernels};
use xcall_shmem::{World, WorldConfig};

mod common;
use common::cuda::CudaMem;
use common::run::{expert_major, inputs, round, Mem};
use common::threads::{host_equal_cases, run, same_outputs};
use common::*;

const PE_ENV: &str = "XCALL_EP_TEST_PE";
/// The world's timeout in the killed-peer test: the survivor must fail
/// after about this long, not hang.
const PEER_TIMEOUT: Duration = Duration::from_millis(1500);

fn world(socket: &str, rank: usize, n: usize, heap: usize, timeout: Duration) -> World {
    let mut c = WorldConfig::unix_socket(socket, rank, n, process_gpu(rank));
    c.heap_bytes = Some(heap + (2 << 20));
    c.timeout = timeout;
    let mut w = World::new();
    w.init(&c).unwrap();
    w
}

fn kernels(name: &str) -> EpKernels {
    match name {
        "steps" => EpKernels::Steps,
        "pull" => EpKernels::Pull,
        _ => EpKernels::LowLatency,
    }
}

/// Rounds of each case (the group kept between them).
const ROUNDS: u64 = 2;

/// One PE process of the Host-equal test: every case of
/// [`host_equal_cases`] on its own world (its socket `socket-i`), each
/// round checked by `round` against the reference and compared with the
/// same round run on Host by threads of this process.
fn host_equal_pe(socket: &str, rank: usize, n: usize, k: EpKernels) {
    for (i, (name, case)) in host_equal_cases(n).into_iter().enumerate() {
        let case = Case {
            config: EpConfig {
                kernels: k,
                ..case.config
            },
            ..case
        };
        let layout = match case.config.layout(n) {
            Ok(l) => l,
            // Past the low-latency kernels' sizes: the steps cover it.
            Err(_) if k == EpKernels::LowLatency => continue,
            Err(e) => panic!("{name}: {e}"),
        };
        let mut w = world(
            &format!("{socket}-{i}"),
            rank,
            n,
            layout.heap_bytes,
            Duration::from_secs(30),
        );
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        assert_eq!(g.low_latency(), k == EpKernels::LowLatency);
        let mut m = CudaMem::new(process_gpu(rank));
        for r in 0..ROUNDS {
            let c = Case {
                seed: case.seed + r,
                ..case.clone()
            };
            let name = format!("processes-{name}-{}-round{r}", k.name());
            let got = round(&c, rank, &mut g, &mut m, true);
            let host = run(&name, &c, false);
            same_outputs(&name, &c, rank, &got, &host[rank]);
        }
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
    let mut m = CudaMem::new(process_gpu(rank));
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

/// `n` PE processes of `mode` on `kernels`, waited for at most `limit`:
/// whether each exited with success.
fn processes(n: usize, mode: &str, kernels: &str, limit: Duration) -> Vec<bool> {
    let s = socket_path(&format!("cuda-{mode}-{kernels}-{n}"));
    let children = (0..n)
        .map(|r| spawn_pe(PE_ENV, format!("{s},{r},{n},{mode},{kernels}")))
        .collect();
    wait_children(
        &format!("{n} GPU processes, {mode}, {kernels}"),
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
        "host-equal" => host_equal_pe(socket, rank, n, k),
        "killed" => killed_pe(socket, rank, n, k),
        other => panic!("unknown mode {other}"),
    }
}

#[test]
fn two_and_four_processes_match_the_host_bit_for_bit() {
    if std::env::var(PE_ENV).is_ok() {
        return;
    }
    for n in [2, 4] {
        if gpus_for_processes("cuda ep processes", n).is_none() {
            return;
        }
        for kernels in ["steps", "low-latency", "pull"] {
            let ok = processes(n, "host-equal", kernels, Duration::from_secs(300));
            assert_eq!(ok, vec![true; n], "{n} PEs, {kernels}");
        }
    }
}

#[test]
fn a_killed_gpu_peer_makes_the_other_fail_within_the_timeout() {
    if std::env::var(PE_ENV).is_ok() || gpus_for_processes("cuda ep killed peer", 2).is_none() {
        return;
    }
    for kernels in ["steps", "low-latency", "pull"] {
        let started = Instant::now();
        let ok = processes(2, "killed", kernels, Duration::from_secs(60));
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
