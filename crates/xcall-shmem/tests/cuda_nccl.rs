//! CUDA worlds whose pairs all take NCCL (`Pairs::Nccl`, the path of peers
//! on other hosts): a world of one PE exchanging with itself (one GPU, also
//! captured into a graph), every GPU of the machine in one process, one
//! process per GPU on NCCL's network path (`NCCL_P2P_DISABLE=1
//! NCCL_SHM_DISABLE=1`), a process that dies before its exchange (its peer
//! fails within the timeout), and one that dies while its peer replays a
//! graph of their exchange (the peer's world drops and the replay ends).
//! Where the loaded NCCL runs one-sided operations (2.29 and newer), the
//! pairs' puts and put_signals too, in one process and across processes
//! over NVLink. Every receive buffer is poisoned first and every byte
//! checked against data computed on the receiving side.
//!
//! Skips without a GPU or without NCCL unless XCALL_REQUIRE_CUDA=1; the
//! two-GPU tests skip on a one-GPU machine with a SKIP line; the one-sided
//! part skips with a SKIP line where the pairs fall back to two-sided NCCL
//! unless XCALL_REQUIRE_NCCL_ONE_SIDED=1.

use std::ffi::c_void;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaGraph, CudaStream};
use xcall_core::cuda::{CaptureMode, InstantiateFlags, Stream};
use xcall_core::testing::{cuda_devices_or_skip, cuda_required, run_threads, skip, watchdog};
use xcall_core::{Device, Status};
use xcall_shmem::{Cmp, Incoming, Outgoing, Pairs, SignalOp, Transport, World, WorldConfig};

mod common;

/// Set in a child process: "ROLE:RANK:ADDRESS".
const PE_ENV: &str = "XCALL_SHMEM_CUDA_TEST_PE";

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The GPU count (at least `need`) when there is a GPU and NCCL loads;
/// else a SKIP line (a failure under XCALL_REQUIRE_CUDA=1) and `None`.
fn gpus_with_nccl(test: &str, need: usize) -> Option<usize> {
    let n = cuda_devices_or_skip(test)?;
    match xcall_shmem::nccl::library() {
        Ok(lib) => eprintln!("{test}: NCCL {} at {}", lib.version(), lib.path().display()),
        Err(e) if cuda_required() => panic!("{test}: XCALL_REQUIRE_CUDA=1 but {e}"),
        Err(e) => {
            skip(test, &e.to_string());
            return None;
        }
    }
    if n < need {
        skip(test, &format!("needs {need} GPUs, this machine has {n}"));
        return None;
    }
    Some(n)
}

fn config(c: WorldConfig) -> WorldConfig {
    WorldConfig {
        heap_bytes: Some(64 << 20),
        timeout: Duration::from_secs(30),
        pairs: Some(Pairs::Nccl),
        ..c
    }
}

/// PE `rank` of `n` PEs of this process named `name`, on GPU `rank`, every
/// pair through NCCL ([`config`]).
fn nccl_world(name: &str, rank: usize, n: usize) -> World {
    let mut w = World::new();
    w.init(&config(WorldConfig::in_process(
        name,
        rank,
        n,
        Device::cuda(rank as u32),
    )))
    .unwrap();
    w
}

/// Writes `bytes` into this PE's heap at `addr` (a put to itself).
fn write_own(w: &mut World, addr: u64, bytes: &[u8]) {
    let me = w.rank().unwrap();
    // SAFETY: `bytes` is a live slice.
    unsafe { w.put(addr, bytes.as_ptr() as u64, bytes.len(), me) }.unwrap();
}

fn read_own(w: &mut World, addr: u64, bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    let me = w.rank().unwrap();
    // SAFETY: `v` has `bytes` bytes.
    unsafe { w.get(v.as_mut_ptr() as u64, addr, bytes, me) }.unwrap();
    v
}

/// The segments of one all-to-all round: PE `a`'s data for `b` at slot
/// `b` of `send`, landing in slot `a` of `recv` on `b`.
fn segments(
    rank: usize,
    n: usize,
    round: usize,
    max: usize,
    (send, recv): (u64, u64),
) -> (Vec<Outgoing>, Vec<Incoming>) {
    let outgoing = (0..n)
        .map(|to| Outgoing {
            pe: to,
            src: send + (to * max) as u64,
            dest: recv + (rank * max) as u64,
            bytes: common::segment_bytes(rank, to, round, max),
        })
        .collect();
    let incoming = (0..n)
        .map(|from| Incoming {
            pe: from,
            dest: recv + (from * max) as u64,
            bytes: common::segment_bytes(from, rank, round, max),
        })
        .collect();
    (outgoing, incoming)
}

/// Fills slot `b` of `send` with this round's data for PE `b` and
/// poisons `recv` (no peer writes it before this PE's exchange: NCCL's
/// receives are this PE's own calls).
fn prepare(w: &mut World, rank: usize, n: usize, round: usize, max: usize, bufs: (u64, u64)) {
    for to in 0..n {
        let bytes = common::segment_bytes(rank, to, round, max);
        let data = common::segment_data(5, rank, to, round, bytes);
        write_own(w, bufs.0 + (to * max) as u64, &data);
    }
    write_own(w, bufs.1, &vec![0xa5; n * max]);
}

fn check(w: &mut World, rank: usize, n: usize, round: usize, max: usize, recv: u64) {
    let got = read_own(w, recv, n * max);
    for from in 0..n {
        let bytes = common::segment_bytes(from, rank, round, max);
        let want = common::segment_data(5, from, rank, round, bytes);
        let slot = &got[from * max..from * max + bytes];
        assert!(
            slot == want.as_slice(),
            "rank {rank}, round {round}: PE {from}'s segment"
        );
        assert!(
            got[from * max + bytes..(from + 1) * max]
                .iter()
                .all(|&b| b == 0xa5),
            "rank {rank}, round {round}: bytes past PE {from}'s segment were written"
        );
    }
}

/// Rounds of all-to-all exchanges, blocking and on a stream of the
/// caller's, every pair through NCCL.
fn rounds(w: &mut World, rank: usize, n: usize) {
    let t = w.transport(rank).unwrap();
    for pe in 0..n {
        // One kind for every pair: NCCL, with one-sided puts or without.
        assert_eq!(w.transport(pe).unwrap(), t);
        assert!(t.is_nccl(), "{t:?}");
    }
    let max = 300_000;
    let bufs = (w.malloc(n * max).unwrap(), w.malloc(n * max).unwrap());
    // A peer's object has no address here; this PE's own has.
    assert_eq!(w.ptr(rank, bufs.1), Some(bufs.1));
    if n > 1 {
        let peer = (rank + 1) % n;
        assert_eq!(w.ptr(peer, bufs.1), None);
        let mut x = [1u8; 8];
        // Without one-sided puts, a put is refused; a get always is.
        if t == Transport::Nccl {
            // SAFETY: `x` has 8 bytes.
            let e = unsafe { w.put(bufs.1, x.as_ptr() as u64, 8, peer) }.unwrap_err();
            assert_eq!(e.status(), Status::Unsupported, "{e}");
            assert!(e.to_string().contains("World::exchange"), "{e}");
        }
        // SAFETY: `x` has 8 bytes.
        let e = unsafe { w.get(x.as_mut_ptr() as u64, bufs.1, 8, peer) }.unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
        assert!(e.to_string().contains("World::exchange"), "{e}");
    }
    let ctx = CudaContext::new(w.device_of(rank).unwrap().ordinal as usize).unwrap();
    let s = ctx.new_stream().unwrap();
    let raw: *mut c_void = s.cu_stream().cast();
    for round in 0..6 {
        prepare(w, rank, n, round, max, bufs);
        w.barrier_all().unwrap();
        let (out, inc) = segments(rank, n, round, max, bufs);
        if round % 2 == 0 {
            // SAFETY: every segment lies in this PE's heap objects.
            unsafe { w.exchange(&out, &inc) }.unwrap();
        } else {
            // SAFETY: as above, and the stream is synchronized below.
            unsafe { w.exchange_on_stream(&out, &inc, raw) }.unwrap();
            s.synchronize().unwrap();
        }
        check(w, rank, n, round, max, bufs.1);
        w.barrier_all().unwrap();
    }
    w.free(bufs.1).unwrap();
    w.free(bufs.0).unwrap();
}

/// One-sided puts through NCCL (a world whose pairs report
/// `NcclOneSided`): every PE puts a segment to every other PE with no call
/// on the receiving side, the segment to the right neighbour in two pieces
/// (a put, then a put_signal: NCCL lands them in order), each followed by
/// a signal word set to the round's value, blocking and on a stream of the
/// caller's. The receiver waits for each word and checks the data. A
/// signal add, a destination outside the heap or past its object, an
/// unaligned signal word and a put on a stream capturing a graph are
/// refused, and nothing lands (the spare object stays poisoned).
fn one_sided_puts(w: &mut World, rank: usize, n: usize) {
    for pe in (0..n).filter(|&pe| pe != rank) {
        assert_eq!(w.transport(pe).unwrap(), Transport::NcclOneSided);
    }
    let max = 300_000;
    let (send, recv) = (w.malloc(n * max).unwrap(), w.malloc(n * max).unwrap());
    let (sigs, spare) = (w.malloc(8 * n).unwrap(), w.malloc(4096).unwrap());
    write_own(w, spare, &[0xa5; 4096]);
    w.barrier_all().unwrap();
    let right = (rank + 1) % n;
    let src = send + (right * max) as u64;
    let ctx = CudaContext::new(w.device_of(rank).unwrap().ordinal as usize).unwrap();
    let s = ctx.new_stream().unwrap();
    let raw: *mut c_void = s.cu_stream().cast();
    let refused = |e: xcall_shmem::Result<()>, status: Status, what: &str| {
        let e = e.unwrap_err();
        assert_eq!(e.status(), status, "{what}: {e}");
    };
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put_signal(spare, src, 64, spare + 64, 1, SignalOp::Add, right) };
    refused(e, Status::Unsupported, "a signal add");
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put_signal(spare, src, 64, spare + 4, 1, SignalOp::Set, right) };
    refused(e, Status::InvalidArgument, "an unaligned signal");
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put(spare + 4000, src, 200, right) };
    refused(e, Status::InvalidArgument, "past the object");
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put(0x1000, src, 8, right) };
    refused(e, Status::InvalidArgument, "outside the heap");
    s.begin_capture(CaptureMode::ThreadLocal.driver()).unwrap();
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put_signal_nbi(spare, src, 64, spare + 64, 1, SignalOp::Set, right, raw) };
    refused(e, Status::Unsupported, "a captured put_signal");
    // SAFETY: the source lies in this PE's heap objects.
    let e = unsafe { w.put_nbi(spare, src, 64, right, raw) };
    refused(e, Status::Unsupported, "a captured put");
    // Nothing was captured.
    let device = w.device_of(rank).unwrap();
    // SAFETY: `s` is a live stream of this PE's device.
    let stream = unsafe { Stream::from_raw(device, s.cu_stream()) };
    // The stream's capture ends into a graph, counted and destroyed here.
    let graph = stream.end_capture().unwrap();
    let nodes = graph.node_count(device).unwrap();
    drop(graph);
    assert_eq!(nodes, 0, "the refused puts left work in the graph");
    for round in 0..6 {
        prepare(w, rank, n, round, max, (send, recv));
        write_own(w, sigs, &vec![0; 8 * n]);
        // Nobody puts before every receiver poisoned its slots.
        w.barrier_all().unwrap();
        let value = 1000 + round as u64;
        for q in (0..n).filter(|&q| q != rank) {
            let bytes = common::segment_bytes(rank, q, round, max);
            let (src, dest) = (send + (q * max) as u64, recv + (rank * max) as u64);
            let sig = sigs + 8 * rank as u64;
            let head = if q == right { bytes / 2 } else { 0 };
            let tail = (src + head as u64, dest + head as u64, bytes - head);
            // SAFETY: the sources lie in this PE's `send` object, live and
            // unchanged until the round's barrier (after the stream sync).
            unsafe {
                match round % 2 {
                    0 => {
                        if head > 0 {
                            w.put(dest, src, head, q).unwrap();
                        }
                        w.put_signal(tail.1, tail.0, tail.2, sig, value, SignalOp::Set, q)
                    }
                    _ => {
                        if head > 0 {
                            w.put_nbi(dest, src, head, q, raw).unwrap();
                        }
                        w.put_signal_nbi(tail.1, tail.0, tail.2, sig, value, SignalOp::Set, q, raw)
                    }
                }
            }
            .unwrap();
        }
        // The receivers wait for the words, not for this stream.
        for q in (0..n).filter(|&q| q != rank) {
            let seen = w.wait_until(sigs + 8 * q as u64, Cmp::Eq, value).unwrap();
            assert_eq!(seen, value);
        }
        let got = read_own(w, recv, n * max);
        for q in 0..n {
            // Nobody puts into this PE's own slot.
            let bytes = if q == rank {
                0
            } else {
                common::segment_bytes(q, rank, round, max)
            };
            let want = common::segment_data(5, q, rank, round, bytes);
            let slot = &got[q * max..(q + 1) * max];
            assert!(
                slot[..bytes] == want,
                "rank {rank}, round {round}: PE {q}'s segment"
            );
            assert!(
                slot[bytes..].iter().all(|&b| b == 0xa5),
                "rank {rank}, round {round}: bytes past PE {q}'s segment were written"
            );
        }
        s.synchronize().unwrap();
        w.barrier_all().unwrap();
    }
    assert!(
        read_own(w, spare, 4096).iter().all(|&b| b == 0xa5),
        "rank {rank}: a refused put wrote"
    );
    for o in [spare, sigs, recv, send] {
        w.free(o).unwrap();
    }
}

#[test]
fn one_gpu_exchanges_with_itself_through_nccl() {
    let _s = serial();
    if gpus_with_nccl("shmem nccl one pe", 1).is_none() {
        return;
    }
    let mut w = nccl_world("nccl-one", 0, 1);
    rounds(&mut w, 0, 1);
    // barrier_on_stream needs addressable peers.
    let e = w.barrier_on_stream(std::ptr::null_mut()).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{e}");

    // Captured into a graph and replayed for new data.
    let max = 1 << 20;
    let bufs = (w.malloc(max).unwrap(), w.malloc(max).unwrap());
    let s = CudaContext::new(0).unwrap().new_stream().unwrap();
    let graph = captured_self_exchange(&mut w, bufs, max, &s);
    for replay in 0..3 {
        // Round 100's sizes, fresh data each replay.
        let bytes = common::segment_bytes(0, 0, 100, max);
        let data = common::segment_data(7 + replay, 0, 0, 100, bytes);
        write_own(&mut w, bufs.0, &data);
        write_own(&mut w, bufs.1, &vec![0xa5; max]);
        graph.launch().unwrap();
        s.synchronize().unwrap();
        let got = read_own(&mut w, bufs.1, max);
        assert!(got[..bytes] == data[..], "replay {replay}");
        assert!(got[bytes..].iter().all(|&b| b == 0xa5), "replay {replay}");
    }
    drop(graph);
    w.free(bufs.1).unwrap();
    w.free(bufs.0).unwrap();
    assert!(w.finalize().unwrap().leaked.is_empty());
}

/// Captures `w`'s exchange of `out` and `inc` into a graph on `s`.
fn capture_exchange(
    w: &mut World,
    (out, inc): (&[Outgoing], &[Incoming]),
    s: &Arc<CudaStream>,
) -> CudaGraph {
    let raw: *mut c_void = s.cu_stream().cast();
    s.begin_capture(CaptureMode::ThreadLocal.driver()).unwrap();
    // SAFETY: the callers' segments lie in this PE's objects, alive while
    // the graph is.
    let captured = unsafe { w.exchange_on_stream(out, inc, raw) };
    let graph = s
        .end_capture(
            InstantiateFlags {
                auto_free_on_launch: true,
                ..InstantiateFlags::default()
            }
            .driver(),
        )
        .unwrap();
    captured.unwrap();
    graph.expect("a captured graph")
}

/// Captures one self-exchange of `w` (a one-PE world on GPU 0, round 100's
/// segments) into a graph on `s`, replays it once, and returns the graph.
fn captured_self_exchange(
    w: &mut World,
    bufs: (u64, u64),
    max: usize,
    s: &Arc<CudaStream>,
) -> CudaGraph {
    let (out, inc) = segments(0, 1, 100, max, bufs);
    let graph = capture_exchange(w, (&out, &inc), s);
    graph.launch().unwrap();
    s.synchronize().unwrap();
    graph
}

/// NCCL neither finishes nor aborts a communicator while a CUDA graph that
/// captured its transfers lives. A PE that still holds one is refused
/// finalize at once, naming the graphs, with its world left live (not a
/// hang, nor a timeout with no reason); once the graph is destroyed the
/// same world finalizes, and so do the next worlds on the GPU.
#[test]
fn finalize_refuses_while_a_graph_holds_nccl_transfers() {
    let _s = serial();
    if gpus_with_nccl("shmem nccl finalize with a live graph", 1).is_none() {
        return;
    }
    run_threads("nccl graph finalize", 1, watchdog(), |_| {
        let max = 1 << 16;
        let stream = CudaContext::new(0).unwrap().new_stream().unwrap();
        let mut w = nccl_world("nccl-graph", 0, 1);
        let bufs = (w.malloc(max).unwrap(), w.malloc(max).unwrap());
        let graph = captured_self_exchange(&mut w, bufs, max, &stream);
        let started = Instant::now();
        let e = w.finalize().unwrap_err();
        eprintln!("finalize with a live graph: {e}");
        assert_eq!(e.status(), Status::InvalidState, "{e}");
        assert!(e.to_string().contains("1 CUDA graph(s)"), "{e}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "refused after {:?}, not at once",
            started.elapsed()
        );
        // Nothing changed: the world is live and still exchanges.
        assert!(w.transport(0).unwrap().is_nccl());
        drop(captured_self_exchange(&mut w, bufs, max, &stream));
        drop(graph);
        w.free(bufs.1).unwrap();
        w.free(bufs.0).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());

        // Destroyed first: finalize goes through, twice over.
        for round in 0..2 {
            let mut w = nccl_world(&format!("nccl-graph-{round}"), 0, 1);
            let bufs = (w.malloc(max).unwrap(), w.malloc(max).unwrap());
            drop(captured_self_exchange(&mut w, bufs, max, &stream));
            w.free(bufs.1).unwrap();
            w.free(bufs.0).unwrap();
            assert!(w.finalize().unwrap().leaked.is_empty(), "round {round}");
        }
    });
}

#[test]
fn every_gpu_one_process_through_nccl() {
    let _s = serial();
    let Some(n) = gpus_with_nccl("shmem nccl spmt", 2) else {
        return;
    };
    eprintln!("shmem nccl spmt: {n} GPUs, one thread each");
    run_threads("nccl spmt", n, watchdog(), move |rank| {
        let mut w = nccl_world("nccl-spmt", rank, n);
        rounds(&mut w, rank, n);
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

/// Set to 1 where the loaded NCCL must run one-sided puts among the
/// machine's GPUs (NCCL 2.29 or newer, GPUs with peer access): a world
/// that falls back to two-sided NCCL then fails the test instead of
/// skipping it.
const REQUIRE_ONE_SIDED: &str = "XCALL_REQUIRE_NCCL_ONE_SIDED";

/// Whether the world's pairs have one-sided puts; else a SKIP line (a
/// failure under [`REQUIRE_ONE_SIDED`]) and `false`.
fn one_sided_or_skip(test: &str, w: &World, rank: usize) -> bool {
    let peer = (rank + 1) % w.size().unwrap();
    if w.transport(peer).unwrap() == Transport::NcclOneSided {
        return true;
    }
    let lib = xcall_shmem::nccl::library().unwrap();
    let why = match lib.one_sided() {
        false => format!(
            "NCCL {} has no one-sided operations (2.29 and newer)",
            lib.version()
        ),
        true => format!(
            "NCCL {} runs no one-sided operations among these GPUs",
            lib.version()
        ),
    };
    if xcall_core::testing::required(REQUIRE_ONE_SIDED) {
        panic!("{test}: {REQUIRE_ONE_SIDED}=1 but {why}");
    }
    if rank == 0 {
        skip(test, &why);
    }
    false
}

/// Every GPU in one process (a thread each), every pair through NCCL: one-
/// sided puts where the loaded NCCL runs them, then exchanges on the same
/// world.
#[test]
fn one_sided_puts_through_nccl_on_every_gpu() {
    let _s = serial();
    let test = "shmem nccl one-sided";
    let Some(n) = gpus_with_nccl(test, 2) else {
        return;
    };
    run_threads("nccl one-sided", n, watchdog(), move |rank| {
        let mut w = nccl_world("nccl-one-sided", rank, n);
        if one_sided_or_skip(test, &w, rank) {
            one_sided_puts(&mut w, rank, n);
        }
        rounds(&mut w, rank, n);
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

/// A process of the test, on NCCL's network path unless `nvlink`.
fn spawn_on(
    test: &str,
    role: &str,
    (rank, size): (usize, usize),
    address: &str,
    nvlink: bool,
) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(PE_ENV, format!("{role}:{rank}:{size}:{address}"));
    if !nvlink {
        c.env("NCCL_P2P_DISABLE", "1").env("NCCL_SHM_DISABLE", "1");
    }
    c.spawn().unwrap()
}

fn spawn(test: &str, role: &str, rank: usize, size: usize, address: &str) -> Child {
    spawn_on(test, role, (rank, size), address, false)
}

/// Waits for the children under the watchdog; returns their success.
fn wait_all(what: &str, children: Vec<Child>) -> Vec<bool> {
    xcall_core::testing::wait_children(what, children, watchdog())
}

fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A child's part: "ROLE:RANK:SIZE:ADDRESS" from [`PE_ENV`].
fn child(spec: &str) {
    let mut parts = spec.splitn(4, ':');
    let (role, rank, size, address) = (
        parts.next().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
        parts.next().unwrap().parse::<usize>().unwrap(),
        parts.next().unwrap(),
    );
    let mut c = config(WorldConfig::tcp(
        address,
        rank,
        size,
        Device::cuda(rank as u32),
    ));
    if role == "dies" {
        c.timeout = Duration::from_secs(10);
    }
    let mut w = World::new();
    w.init(&c).unwrap();
    match role {
        "rounds" => {
            eprintln!(
                "rank {rank}: pairs through {}",
                w.transport(rank).unwrap().name()
            );
            rounds(&mut w, rank, size);
            assert!(w.finalize().unwrap().leaked.is_empty());
        }
        "puts" => {
            if one_sided_or_skip("shmem nccl one-sided processes", &w, rank) {
                one_sided_puts(&mut w, rank, size);
            }
            assert!(w.finalize().unwrap().leaked.is_empty());
        }
        "graph" => graph_waits_for_a_peer_that_left(w, rank),
        _ if rank == 1 => {
            // Leaves without a word once the world is up and the buffer
            // allocated (malloc is a collective rank 0 must not wait in).
            w.malloc(1 << 20).unwrap();
            w.barrier_all().unwrap();
            std::process::exit(0);
        }
        _ => {
            let buf = w.malloc(1 << 20).unwrap();
            w.barrier_all().unwrap();
            // Two slots of 256 KiB to send from, two to receive into.
            let (out, inc) = segments(0, 2, 0, 1 << 18, (buf, buf + (1 << 19)));
            let started = Instant::now();
            // SAFETY: the segments lie in `buf`.
            let r = unsafe { w.exchange(&out, &inc) };
            let e = r.expect_err("rank 1 is gone");
            assert!(
                matches!(
                    e.status(),
                    Status::Timeout | Status::PeerFailed | Status::System
                ),
                "{e}"
            );
            assert!(started.elapsed() < Duration::from_secs(40), "{e}");
            eprintln!("rank 0 after rank 1 died: {e}");
            // Only finalize remains, and it does not hang.
            let e2 = w.finalize().unwrap_err();
            eprintln!("rank 0 finalize: {e2}");
        }
    }
}

/// Both ranks exchange once (NCCL connects the pair) and capture the
/// exchange into a graph (its lists are agreed on while it is captured),
/// then rank 1 leaves. Rank 0 replays its graph: its kernels wait for
/// rank 1 forever. Dropping the world with that graph alive and running
/// returns (the communicator is aborted on a thread of its own), the abort
/// ends the graph's kernels so the stream drains, and the process exits.
fn graph_waits_for_a_peer_that_left(mut w: World, rank: usize) {
    let buf = w.malloc(1 << 20).unwrap();
    let (out, inc) = segments(rank, 2, 0, 1 << 18, (buf, buf + (1 << 19)));
    // SAFETY: the segments lie in `buf`.
    unsafe { w.exchange(&out, &inc) }.unwrap();
    let stream = CudaContext::new(rank).unwrap().new_stream().unwrap();
    // The graph is destroyed before the stream.
    let graph = capture_exchange(&mut w, (&out, &inc), &stream);
    w.barrier_all().unwrap();
    if rank == 1 {
        std::process::exit(0);
    }
    graph.launch().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: a live stream of device 0, outliving `polled`.
    let polled = unsafe { Stream::from_raw(xcall_core::Device::cuda(0), stream.cu_stream()) };
    let busy = polled
        .is_idle()
        .map(|idle| if idle { "idle" } else { "running" });
    // NCCL does not end the kernels itself when its peer's connection
    // drops: the replay waits (this line shows the case is the one meant).
    eprintln!("rank 0's replay, 500 ms after rank 1 left: {busy:?}");
    let started = Instant::now();
    drop(w);
    eprintln!("rank 0 dropped its world in {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(15));
    drop(graph);
    // The abort ended the graph's kernels: the stream drains.
    let drained = Instant::now();
    while matches!(polled.is_idle(), Ok(false)) {
        assert!(
            drained.elapsed() < Duration::from_secs(15),
            "the aborted communicator's kernels are still running"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!(
        "rank 0's stream drained {:?} after the drop",
        started.elapsed()
    );
    // With the graph gone, NCCL finishes the abort and frees the
    // communicator; the process exits only after that.
    assert_eq!(
        xcall_shmem::nccl::settle_aborts(Duration::from_secs(15)),
        0,
        "the communicator's abort did not finish once the graph was destroyed"
    );
    eprintln!(
        "rank 0's communicator freed {:?} after the drop",
        started.elapsed()
    );
}

#[test]
fn a_process_per_gpu_on_nccls_network_path() {
    let _s = serial();
    if let Ok(spec) = std::env::var(PE_ENV) {
        child(&spec);
        return;
    }
    let Some(n) = gpus_with_nccl("shmem nccl processes", 2) else {
        return;
    };
    let test = "a_process_per_gpu_on_nccls_network_path";
    let address = free_address();
    let children = (0..n)
        .map(|r| spawn(test, "rounds", r, n, &address))
        .collect();
    assert_eq!(
        wait_all(&format!("{n} processes through NCCL"), children),
        vec![true; n]
    );
    // One-sided puts between processes, over NVLink (NCCL's network path
    // has none).
    let address = free_address();
    let children = (0..n)
        .map(|r| spawn_on(test, "puts", (r, n), &address, true))
        .collect();
    assert_eq!(
        wait_all(&format!("{n} processes putting through NCCL"), children),
        vec![true; n]
    );
    // Rank 1 dies after init: rank 0 fails with an error, never hangs.
    let address = free_address();
    let started = Instant::now();
    let children = (0..2)
        .map(|r| spawn(test, "dies", r, 2, &address))
        .collect();
    assert_eq!(wait_all("a peer that dies", children), [true, true]);
    eprintln!("the failure took {:?}", started.elapsed());
    // Rank 1 dies while rank 0's graph waits for it: dropping the world
    // returns and the graph's kernels end.
    let address = free_address();
    let children = (0..2)
        .map(|r| spawn(test, "graph", r, 2, &address))
        .collect();
    assert_eq!(
        wait_all("a graph waiting for a peer that left", children),
        [true, true]
    );
}
