//! Expert-parallel groups of Host processes: the test binary spawns itself
//! as each PE (environment XCALL_EP_TEST_PE = "socket,rank,size,mode"),
//! the PEs meet at a Unix socket and reach each other's heaps in POSIX
//! shared memory. Every output is compared with the plain-loop reference
//! of `common`, as for PEs that are threads; and a PE killed in the middle
//! of a step makes every other PE fail within the world's timeout, naming
//! it, instead of waiting for it.

use std::process::Child;
use std::time::{Duration, Instant};

use xcall_core::testing::{run_threads, wait_children, watchdog};
use xcall_core::{Device, Platform};
use xcall_ep::{EpConfig, EpError, EpGroup, Precision};
use xcall_shmem::{Transport, World, WorldConfig};

mod common;
use common::run::{expert_major, inputs, round, HostMem, Mem, Outputs};
use common::*;

const PE_ENV: &str = "XCALL_EP_TEST_PE";
/// The world's timeout in the killed-peer test: the survivors must fail
/// after about this long, not hang.
const PEER_TIMEOUT: Duration = Duration::from_millis(1500);

fn world(socket: &str, rank: usize, n: usize, heap: usize, timeout: Duration) -> World {
    let mut c = WorldConfig::unix_socket(socket, rank, n, Device::new(Platform::Host, rank as u32));
    c.heap_bytes = Some(heap + (1 << 20));
    c.timeout = timeout;
    let mut w = World::new();
    w.init(&c).unwrap();
    w
}

/// The cases every process count runs: f32 with alignment, bf16, and FP8
/// dispatch, each for two rounds with their backward halves.
fn cases(pes: usize) -> Vec<Case> {
    let cfg = |tokens, hidden, topk, experts, precision| EpConfig {
        precision,
        ..EpConfig::new(tokens, hidden, topk, experts)
    };
    vec![
        Case::new(
            EpConfig {
                align: 8,
                ..cfg(90, 16, 3, 4 * pes, Precision::F32)
            },
            pes,
            Routing::Random,
            21,
        ),
        Case::new(
            cfg(60, 32, 2, 2 * pes, Precision::Bf16),
            pes,
            Routing::Random,
            22,
        ),
        Case::new(
            cfg(40, 256, 2, 2 * pes, Precision::Fp8Dispatch),
            pes,
            Routing::Random,
            23,
        ),
    ]
}

/// Rounds of each case (with their backward halves).
const ROUNDS: u64 = 2;

/// A round's outputs as bytes, each part after its length.
fn encode(o: &Outputs) -> Vec<u8> {
    let probs: Vec<u8> = o.grad_probs.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut b = Vec::new();
    for part in [&o.expert_rows, &o.y, &o.grad_x, &o.grad_expert_out, &probs] {
        b.extend((part.len() as u64).to_le_bytes());
        b.extend(part);
    }
    b
}

/// One PE's rounds of every case on its world (`world(case)`), each
/// checked by `round`, their outputs encoded in (case, round) order.
fn run_cases(n: usize, rank: usize, world: impl Fn(&Case) -> World) -> Vec<Vec<u8>> {
    let mut outputs = Vec::new();
    for case in cases(n) {
        let mut w = world(&case);
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        // Threads pull, processes push.
        let peer = if rank == 0 { 1 } else { 0 };
        let threads = w.transport(peer).unwrap() == Transport::SameProcess;
        assert_eq!(g.pulls(), threads, "PE {rank}");
        let mut m = HostMem::default();
        for r in 0..ROUNDS {
            let c = Case {
                seed: case.seed + r,
                ..case.clone()
            };
            outputs.push(encode(&round(&c, rank, &mut g, &mut m, true)));
        }
        g.destroy(&mut w).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    }
    outputs
}

/// One PE process of the reference test: every case, checked by `round`,
/// its outputs written to `dir` for the threads to compare.
fn reference_pe(socket: &str, rank: usize, n: usize, dir: &str) {
    let outputs = run_cases(n, rank, |case| {
        let heap = case.config.layout(n).unwrap().heap_bytes;
        world(socket, rank, n, heap, Duration::from_secs(20))
    });
    std::fs::write(format!("{dir}/{rank}"), outputs.concat()).unwrap();
}

/// One PE process of the killed-peer test: a dispatch on every PE, then
/// the last PE kills itself (SIGKILL: no unwinding, no goodbye) and the
/// others combine. Their combine must fail with the timeout naming the
/// killed PE, within about the world's timeout.
fn killed_pe(socket: &str, rank: usize, n: usize) {
    let case = Case::new(EpConfig::new(64, 32, 2, 2 * n), n, Routing::Random, 31);
    let c = case.config;
    let heap = c.layout(n).unwrap().heap_bytes;
    let mut w = world(socket, rank, n, heap, PEER_TIMEOUT);
    let mut g = EpGroup::new(&mut w, c).unwrap();
    let mut m = HostMem::default();
    let d = data(&case, rank);
    let (x, ids, probs) = inputs(&mut m, &d);
    let out = expert_major(&mut m, &g, false);
    let tokens = case.sent[rank];
    // SAFETY: this PE's buffers, of the sizes the group asked for.
    unsafe { g.dispatch(x, ids, probs, tokens, &out, m.stream()) }.unwrap();
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
    let e = unsafe { g.combine(expert_out, y, m.stream()) }.unwrap_err();
    let took = started.elapsed();
    let dead = format!("PE {}", n - 1);
    assert!(
        matches!(&e, EpError::Timeout(msg) if msg.contains(&dead)),
        "PE {rank}: combine with a killed peer: {e}"
    );
    assert!(
        took >= PEER_TIMEOUT && took < PEER_TIMEOUT * 4,
        "PE {rank}: combine failed after {took:?} with a {PEER_TIMEOUT:?} timeout"
    );
    // The group and world cannot be left collectively with a PE gone: the
    // process ends here, as a caller's would.
    std::process::exit(0);
}

fn spawn(socket: &str, rank: usize, n: usize, mode: &str) -> Child {
    spawn_pe(PE_ENV, format!("{socket},{rank},{n},{mode}"))
}

fn socket(name: &str) -> String {
    socket_path(name)
}

/// The entry of a spawned PE (does nothing when run by the harness).
#[test]
fn pe_process() {
    let Ok(spec) = std::env::var(PE_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (socket, rank, n, mode) = (
        parts[0],
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
        parts[3],
    );
    match mode {
        "reference" => reference_pe(socket, rank, n, parts[4]),
        "killed" => killed_pe(socket, rank, n),
        other => panic!("unknown mode {other}"),
    }
}

/// PE processes (which store each token into its peers) match the
/// reference, and PEs of one process (threads, which read their peers'
/// rows where they are: `xcall_ep::host_pull`) write the very same bytes
/// as the processes, every output of every round.
#[test]
fn processes_match_the_reference_and_threads_byte_for_byte() {
    if std::env::var(PE_ENV).is_ok() {
        return;
    }
    let _s = serial();
    for n in [2, 3, 4] {
        let s = socket(&format!("ref{n}"));
        let dir = std::env::temp_dir().join(format!("xcall-ep-ref{n}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.to_str().unwrap().to_string();
        let children = (0..n)
            .map(|r| spawn(&s, r, n, &format!("reference,{d}")))
            .collect();
        let ok = wait_children(
            &format!("{n} PE processes"),
            children,
            Duration::from_secs(120),
        );
        assert!(ok.iter().all(|&o| o), "{n} PE processes: exits {ok:?}");
        let group = format!("ep-threads{n}-{}", std::process::id());
        let threads = run_threads("PEs as threads", n, watchdog(), move |rank| {
            run_cases(n, rank, |case| {
                let heap = case.config.layout(n).unwrap().heap_bytes;
                let device = Device::new(Platform::Host, rank as u32);
                let mut c = WorldConfig::in_process(&group, rank, n, device);
                c.heap_bytes = Some(heap + (1 << 20));
                c.timeout = Duration::from_secs(20);
                let mut w = World::new();
                w.init(&c).unwrap();
                w
            })
        });
        for (rank, outputs) in threads.iter().enumerate() {
            let processes = std::fs::read(dir.join(rank.to_string())).unwrap();
            assert!(
                processes == outputs.concat(),
                "{n} PEs: PE {rank}'s outputs differ between processes and threads"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_killed_peer_makes_the_others_fail_within_the_timeout() {
    if std::env::var(PE_ENV).is_ok() {
        return;
    }
    let _s = serial();
    let n = 3;
    let s = socket("killed");
    let started = Instant::now();
    let children = (0..n).map(|r| spawn(&s, r, n, "killed")).collect();
    let ok = wait_children("a killed PE's peers", children, Duration::from_secs(60));
    assert_eq!(
        ok,
        [true, true, false],
        "the survivors pass their checks, the killed PE dies"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the survivors took {:?}",
        started.elapsed()
    );
}
