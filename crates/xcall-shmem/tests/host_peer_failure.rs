//! A PE that leaves without finalize, or whose finalize fails, must not make
//! a peer touch freed memory: the world is failed, and every later
//! transfer, signal, wait and collective on any PE says so
//! (`PeerFailed`) without touching memory. In SPMT worlds (threads) and in
//! multi-process worlds (the test binary spawns itself as the other PE,
//! environment XCALL_SHMEM_FAILURE_PE = "socket,rank,mode").
//!
//! Also here: transfers into freed or straddled blocks, a collective
//! mismatch seen by both sides, the transport and device of every peer,
//! and the Unix-socket bootstrap's handling of what is at its address.

use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use xcall_core::{Device, Platform, Status};
use xcall_shmem::{Cmp, Phase, SignalOp, Transport, World, WorldConfig};

const PE_ENV: &str = "XCALL_SHMEM_FAILURE_PE";
/// No test here may take longer than this to reach any one point.
const WATCHDOG: Duration = Duration::from_secs(60);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn host(rank: usize) -> Device {
    Device::new(Platform::Host, rank as u32)
}

fn spmt_config(group: &str, rank: usize, n: usize, timeout: Duration) -> WorldConfig {
    let mut c = WorldConfig::in_process(group, rank, n, host(rank));
    c.heap_bytes = Some(1 << 20);
    c.timeout = timeout;
    c
}

/// Runs `f(rank)` on `n` threads under the watchdog: a thread that does
/// not finish fails the test naming its rank.
fn run_ranks(n: usize, f: impl Fn(usize) + Send + Sync + 'static) {
    xcall_core::testing::run_threads("ranks", n, WATCHDOG, f);
}

fn status_of<T: std::fmt::Debug>(r: xcall_shmem::Result<T>) -> Status {
    r.expect_err("expected an error").status()
}

/// Every operation that crosses the world fails with `PeerFailed` and
/// touches nothing; `buf` is an object of 64 bytes, `sig` a signal word.
fn assert_world_failed(w: &mut World, buf: u64, sig: u64, n: usize) {
    let data = [7u8; 64];
    let mut back = [0u8; 64];
    for pe in 0..n {
        // SAFETY: `data` and `back` hold 64 bytes.
        unsafe {
            assert_eq!(
                status_of(w.put(buf, data.as_ptr() as u64, 64, pe)),
                Status::PeerFailed
            );
            assert_eq!(
                status_of(w.get(back.as_mut_ptr() as u64, buf, 64, pe)),
                Status::PeerFailed
            );
            assert_eq!(
                status_of(w.put_signal(buf, data.as_ptr() as u64, 64, sig, 1, SignalOp::Set, pe)),
                Status::PeerFailed
            );
        }
    }
    assert_eq!(back, [0u8; 64], "a failed get wrote nothing");
    let t0 = Instant::now();
    assert_eq!(
        status_of(w.wait_until(sig, Cmp::Eq, 12345)),
        Status::PeerFailed
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "wait_until must not wait for a peer that left"
    );
    assert_eq!(status_of(w.barrier_all()), Status::PeerFailed);
    assert_eq!(status_of(w.malloc(64)), Status::PeerFailed);
    // SAFETY: reads this PE's own object: nothing arrived.
    let mine = unsafe { std::slice::from_raw_parts(buf as *const u8, 64) };
    assert!(mine.iter().all(|&b| b == 0), "nothing crossed the world");
    // Finalize releases locally and says why.
    let e = w.finalize().unwrap_err();
    assert_eq!(e.status(), Status::PeerFailed, "{e}");
    assert!(e.to_string().contains("released locally"), "{e}");
    assert_eq!(w.phase(), Phase::Finalized);
}

/// Joins SPMT world `group` as `rank` of `n` and makes its objects.
fn joined(group: &str, rank: usize, n: usize, timeout: Duration) -> (World, u64, u64) {
    let mut w = World::new();
    w.init(&spmt_config(group, rank, n, timeout)).unwrap();
    let (buf, sig) = objects(&mut w);
    (w, buf, sig)
}

/// Makes an object of 64 zero bytes and a zero signal word, collectively.
fn objects(w: &mut World) -> (u64, u64) {
    let buf = w.malloc(64).unwrap();
    let sig = w.malloc(8).unwrap();
    // SAFETY: this PE's own objects.
    unsafe {
        std::ptr::write_bytes(buf as *mut u8, 0, 64);
        (sig as *mut u64).write(0);
    }
    w.barrier_all().unwrap();
    (buf, sig)
}

#[test]
fn spmt_a_pe_that_leaves_without_finalize_fails_the_world_for_the_others() {
    let _s = serial();
    let n = 3;
    let (left_tx, left_rx) = mpsc::channel::<()>();
    let left_rx = std::sync::Mutex::new(left_rx);
    run_ranks(n, move |rank| {
        let (mut w, buf, sig) = joined("leave", rank, n, Duration::from_secs(20));
        if rank == 2 {
            drop(w); // leaves without finalize: its heap goes away here
            for _ in 0..n - 1 {
                left_tx.send(()).unwrap();
            }
            return;
        }
        left_rx
            .lock()
            .unwrap()
            .recv_timeout(WATCHDOG)
            .expect("rank 2 left");
        // Rank 2's heap is still mapped for this PE (it holds it): the
        // address ptr() gave stays readable, and nothing writes to it.
        let peer = w.ptr(2, buf).unwrap();
        // SAFETY: a same-process peer's heap, held by this PE's world.
        assert_eq!(unsafe { (peer as *const u8).read_volatile() }, 0);
        // SAFETY: the source is a live 8-byte array.
        let e = unsafe { w.put(buf, [1u8; 8].as_ptr() as u64, 8, 2) }.unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 2 left the world without finalize"),
            "{e}"
        );
        assert_world_failed(&mut w, buf, sig, n);
    });
}

#[test]
fn spmt_a_late_put_after_a_timed_out_finalize_is_refused() {
    let _s = serial();
    let n = 2;
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    run_ranks(n, move |rank| {
        let (mut w, buf, sig) = joined("late", rank, n, Duration::from_millis(300));
        if rank == 0 {
            // Rank 1 never comes to finalize: it times out and fails.
            let e = w.finalize().unwrap_err();
            assert_eq!(e.status(), Status::Timeout, "{e}");
            done_tx.send(()).unwrap();
            return;
        }
        done_rx
            .lock()
            .unwrap()
            .recv_timeout(WATCHDOG)
            .expect("rank 0 finalized");
        // SAFETY: the source is a live 8-byte array.
        let e = unsafe { w.put(buf, [1u8; 8].as_ptr() as u64, 8, 0) }.unwrap_err();
        assert!(e.to_string().contains("rank 0 failed in finalize"), "{e}");
        assert_world_failed(&mut w, buf, sig, n);
    });
}

#[test]
fn transfers_outside_live_blocks_are_refused() {
    let _s = serial();
    let n = 2;
    run_ranks(n, move |rank| {
        let mut w = World::new();
        w.init(&spmt_config("blocks", rank, n, Duration::from_secs(20)))
            .unwrap();
        let a = w.malloc(256).unwrap();
        let b = w.malloc(256).unwrap();
        assert_eq!(b, a + 256, "adjacent objects");
        let data = [9u8; 512];
        let peer = 1 - rank;
        w.barrier_all().unwrap();
        // SAFETY: `data` holds 512 bytes.
        unsafe {
            // Straddles two objects.
            let e = w.put(a + 128, data.as_ptr() as u64, 256, peer).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument);
            assert!(
                e.to_string().contains("not inside one live allocation"),
                "{e}"
            );
            w.put(a, data.as_ptr() as u64, 256, peer).unwrap();
        }
        w.barrier_all().unwrap();
        w.free(a).unwrap();
        // SAFETY: as above.
        unsafe {
            let e = w.put(a, data.as_ptr() as u64, 8, peer).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "{e}");
            assert!(e.to_string().contains("freed already"), "{e}");
            let mut back = [0u8; 8];
            let e = w.get(back.as_mut_ptr() as u64, a, 8, peer).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "{e}");
            let e = w
                .put_signal(b, data.as_ptr() as u64, 8, a, 1, SignalOp::Set, peer)
                .unwrap_err();
            assert_eq!(
                e.status(),
                Status::InvalidArgument,
                "signal in a freed block: {e}"
            );
        }
        w.barrier_all().unwrap();
        w.free(b).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

#[test]
fn a_collective_mismatch_is_reported_to_both_sides() {
    let _s = serial();
    let n = 2;
    run_ranks(n, move |rank| {
        let mut w = World::new();
        w.init(&spmt_config("mismatch2", rank, n, Duration::from_secs(20)))
            .unwrap();
        let e = if rank == 0 {
            w.malloc(4096).unwrap_err()
        } else {
            w.barrier_all().unwrap_err()
        };
        assert_eq!(e.status(), Status::CollectiveMismatch, "rank {rank}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("rank 0: malloc #0 of 4096 bytes"),
            "rank {rank}: {m}"
        );
        assert!(m.contains("rank 1: barrier_all #0"), "rank {rank}: {m}");
        assert!(!m.contains('?'), "rank {rank}: unformatted: {m}");
        // The world goes on: the next matching collective works.
        w.barrier_all().unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

#[test]
fn spmt_peers_are_same_process_on_their_own_devices() {
    let _s = serial();
    let n = 4;
    run_ranks(n, move |rank| {
        let mut w = World::new();
        w.init(&spmt_config("transports", rank, n, Duration::from_secs(20)))
            .unwrap();
        for pe in 0..n {
            assert_eq!(w.device_of(pe).unwrap(), host(pe), "rank {rank}: PE {pe}");
            assert_eq!(w.transport(pe).unwrap(), Transport::SameProcess);
        }
        assert_eq!(
            w.device_of(n).unwrap_err().status(),
            Status::InvalidArgument
        );
        w.finalize().unwrap();
    });
}

// ------------------------------------------------------- multi-process

fn socket_path(tag: &str) -> String {
    std::env::temp_dir()
        .join(format!("xcall-failure-{}-{tag}.sock", std::process::id()))
        .to_str()
        .unwrap()
        .to_string()
}

fn mp_config(socket: &str, rank: usize, timeout: Duration) -> WorldConfig {
    let mut c = WorldConfig::unix_socket(socket, rank, 2, host(rank));
    c.heap_bytes = Some(1 << 20);
    c.timeout = timeout;
    c
}

fn spawn(socket: &str, rank: usize, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "multi_process_peer_failure", "--nocapture"])
        .env(PE_ENV, format!("{socket},{rank},{mode}"))
        .spawn()
        .unwrap()
}

/// Waits for `child` under the watchdog; kills it and fails on a hang.
fn wait_child(mut child: Child, what: &str) {
    let deadline = Instant::now() + WATCHDOG;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{what} failed: {status}");
            return;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("watchdog: {what} did not finish within {WATCHDOG:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Rank 1 of the "leave" world: joins, makes the objects, leaves without
/// finalize (the process exits with its world dropped).
fn leaving_pe(socket: &str) {
    let mut w = World::new();
    w.init(&mp_config(socket, 1, Duration::from_secs(20)))
        .unwrap();
    assert_eq!(w.transport(0).unwrap(), Transport::HostSharedMemory);
    assert_eq!(w.transport(1).unwrap(), Transport::SameProcess);
    assert_eq!(w.device_of(0).unwrap(), host(0));
    objects(&mut w);
    drop(w);
}

/// Rank 1 of the "late" world: never comes to finalize; after rank 0's
/// finalize timed out, its puts are refused.
fn late_pe(socket: &str) {
    let mut w = World::new();
    w.init(&mp_config(socket, 1, Duration::from_millis(300)))
        .unwrap();
    let (buf, sig) = objects(&mut w);
    // Rank 0 is in finalize, which times out without this PE: poll until
    // the world says so (a put before then is legal and lands).
    let deadline = Instant::now() + WATCHDOG;
    loop {
        // SAFETY: 8 readable bytes.
        match unsafe { w.put(buf, [1u8; 8].as_ptr() as u64, 8, 0) } {
            Ok(()) => assert!(
                Instant::now() < deadline,
                "watchdog: the world never failed"
            ),
            Err(e) => {
                assert!(e.to_string().contains("rank 0 failed in finalize"), "{e}");
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_world_failed(&mut w, buf, sig, 2);
}

#[test]
fn multi_process_peer_failure() {
    if let Ok(spec) = std::env::var(PE_ENV) {
        let f: Vec<&str> = spec.split(',').collect();
        match f[2] {
            "leave" => leaving_pe(f[0]),
            _ => late_pe(f[0]),
        }
        return;
    }
    let _s = serial();
    // Rank 1 leaves without finalize; rank 0 then finds the world failed.
    let socket = socket_path("leave");
    let child = spawn(&socket, 1, "leave");
    let mut w = World::new();
    w.init(&mp_config(&socket, 0, Duration::from_secs(20)))
        .unwrap();
    assert_eq!(w.transport(1).unwrap(), Transport::HostSharedMemory);
    assert_eq!(w.device_of(1).unwrap(), host(1));
    let (buf, sig) = objects(&mut w);
    wait_child(child, "the leaving PE");
    assert_world_failed(&mut w, buf, sig, 2);

    // Rank 0's finalize times out; rank 1's late puts are refused.
    let socket = socket_path("late");
    let child = spawn(&socket, 1, "late");
    let mut w = World::new();
    w.init(&mp_config(&socket, 0, Duration::from_millis(300)))
        .unwrap();
    objects(&mut w);
    let e = w.finalize().unwrap_err();
    assert_eq!(e.status(), Status::Timeout, "{e}");
    wait_child(child, "the late PE");
}

// ------------------------------------------- what is at the socket path

#[test]
fn the_socket_bootstrap_never_removes_what_is_not_a_stale_socket() {
    let _s = serial();
    // A regular file at the address stays, and the error names it.
    let path = socket_path("file");
    std::fs::write(&path, b"precious").unwrap();
    let mut w = World::new();
    let e = w
        .init(&mp_config(&path, 0, Duration::from_millis(500)))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert!(e.to_string().contains("is not a socket"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    std::fs::remove_file(&path).unwrap();

    // A socket somebody listens on is not taken over.
    let path = socket_path("live");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let e = w
        .init(&mp_config(&path, 0, Duration::from_millis(500)))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidState, "{e}");
    assert!(e.to_string().contains("is listening"), "{e}");
    assert!(std::path::Path::new(&path).exists());
    drop(listener);

    // The same socket with nobody listening is stale: removed, and the
    // world forms (a one-PE world needs no peer), with an owner-only socket
    // while it listens.
    let mut c = WorldConfig::unix_socket(&path, 0, 1, host(0));
    c.heap_bytes = Some(1 << 20);
    w.init(&c).unwrap();
    w.finalize().unwrap();
    assert!(!std::path::Path::new(&path).exists(), "removed after use");
}

/// A rank whose init fails before it joins its in-process group (here a
/// heap too small) fails its peers at once with `PeerFailed` naming it,
/// whether they were already waiting or join after it; they do not wait
/// out their 30 s timeout. Once the failure expires, the name is free.
#[test]
fn a_rank_that_fails_before_joining_fails_its_peers_at_once() {
    let _s = serial();
    let n = 3;
    let timeout = Duration::from_secs(30);
    for (group, late) in [("early-fail-late", true), ("early-fail-first", false)] {
        let started = std::time::Instant::now();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let rx = std::sync::Mutex::new(rx);
        run_ranks(n, move |rank| {
            let mut c = spmt_config(group, rank, n, timeout);
            if rank == 2 {
                if late {
                    std::thread::sleep(Duration::from_millis(300));
                }
                c.heap_bytes = Some(0);
                let e = World::new().init(&c).unwrap_err();
                assert_eq!(e.status(), Status::InvalidArgument, "{e}");
                if !late {
                    // The failure is recorded: let the others start.
                    for _ in 0..2 {
                        tx.send(()).unwrap();
                    }
                }
                return;
            }
            if !late {
                rx.lock().unwrap().recv().unwrap();
            }
            let e = World::new().init(&c).unwrap_err();
            assert_eq!(e.status(), Status::PeerFailed, "rank {rank}: {e}");
            let m = e.to_string();
            assert!(
                m.contains(&format!("group {group:?}: rank 2 failed before joining"))
                    && m.contains("too small"),
                "rank {rank}: {m}"
            );
        });
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{group}: the peers took {:?} to fail",
            started.elapsed()
        );
    }
    // A failed group nobody joined is forgotten after the failing rank's
    // timeout (at least 1 s): the same name then makes a healthy world.
    let mut failing = spmt_config("early-fail-reuse", 1, 2, Duration::from_millis(1));
    failing.heap_bytes = Some(0);
    let e = World::new().init(&failing).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let blocked = World::new()
        .init(&spmt_config(
            "early-fail-reuse",
            0,
            2,
            Duration::from_secs(5),
        ))
        .unwrap_err();
    assert_eq!(blocked.status(), Status::PeerFailed, "{blocked}");
    std::thread::sleep(Duration::from_millis(1100));
    // The failing rank retrying with a good config starts afresh at once.
    let mut retry = spmt_config("early-fail-retry", 0, 1, Duration::from_secs(20));
    retry.heap_bytes = Some(0);
    World::new().init(&retry).unwrap_err();
    retry.heap_bytes = Some(1 << 20);
    let mut w = World::new();
    w.init(&retry).unwrap();
    w.finalize().unwrap();
    run_ranks(2, |rank| {
        let mut w = World::new();
        w.init(&spmt_config(
            "early-fail-reuse",
            rank,
            2,
            Duration::from_secs(20),
        ))
        .unwrap();
        w.barrier_all().unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}
