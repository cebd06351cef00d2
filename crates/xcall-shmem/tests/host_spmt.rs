//! SPMT worlds on Host: PEs are threads of this process.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog, XorShift};
use xcall_core::{Device, Platform, Status};
use xcall_shmem::registry::device_slot;
use xcall_shmem::{Cmp, Phase, ShmemError, SignalOp, World, WorldConfig};

/// Tests of this file bind devices (one live PE per device per process):
/// they run one at a time, whatever the harness's thread count.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}
fn host(rank: usize) -> Device {
    Device::new(Platform::Host, rank as u32)
}

/// Runs `f(rank, world)` on `n` threads under the watchdog, each with a
/// live world of group `group`; returns what each returned.
fn spmt<T: Send + 'static>(
    group: &str,
    n: usize,
    heap: usize,
    f: impl Fn(usize, &mut World) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let group = group.to_string();
    run_threads(&format!("spmt {group}"), n, watchdog(), move |rank| {
        let mut w = World::new();
        let mut c = WorldConfig::in_process(&group, rank, n, host(rank));
        c.heap_bytes = Some(heap);
        c.timeout = Duration::from_secs(20);
        w.init(&c).unwrap();
        let out = f(rank, &mut w);
        let report = w.finalize().unwrap();
        assert!(
            report.leaked.is_empty(),
            "rank {rank} leaked {:?}",
            report.leaked
        );
        out
    })
}

/// Every PE puts random data into its right neighbour's object and gets
/// its left neighbour's; the data must arrive intact, at the same offset.
fn ring(n: usize) {
    let results = spmt(&format!("ring{n}"), n, 1 << 20, move |rank, w| {
        let bytes = 10_000;
        let buf = w.malloc(bytes).unwrap();
        let other = w.malloc(64).unwrap();
        let (base, _) = w.heap().unwrap();
        let offset = buf - base;
        let mut g = XorShift::new(100 + rank as u64);
        let data: Vec<u8> = (0..bytes).map(|_| g.next_u64() as u8).collect();
        w.barrier_all().unwrap();
        let right = (rank + 1) % n;
        // SAFETY: `data` is a live vector of `bytes` bytes.
        unsafe { w.put(buf, data.as_ptr() as u64, bytes, right) }.unwrap();
        w.barrier_all().unwrap();
        // What the left neighbour put is in my object.
        let left = (rank + n - 1) % n;
        let mut want = XorShift::new(100 + left as u64);
        // SAFETY: `buf` is this PE's object of `bytes` bytes.
        let mine = unsafe { std::slice::from_raw_parts(buf as *const u8, bytes) };
        assert!(
            mine.iter().all(|&b| b == want.next_u64() as u8),
            "rank {rank}: put data"
        );
        // get the right neighbour's object (holding my data) back.
        let mut back = vec![0u8; bytes];
        // SAFETY: `back` has `bytes` bytes.
        unsafe { w.get(back.as_mut_ptr() as u64, buf, bytes, right) }.unwrap();
        assert_eq!(back, data, "rank {rank}: get");
        // ptr: the peer's address of the same object, offset preserved.
        let peer = w.ptr(right, buf).unwrap();
        assert_eq!(peer - w.ptr(right, base).unwrap(), offset);
        assert_eq!(w.ptr(rank, buf), Some(buf));
        assert_eq!(w.ptr(n, buf), None);
        assert_eq!(w.ptr(right, 0x10), None);
        w.barrier_all().unwrap();
        w.free(other).unwrap();
        w.free(buf).unwrap();
        offset
    });
    assert!(
        results.windows(2).all(|p| p[0] == p[1]),
        "symmetric offsets"
    );
}

#[test]
fn put_get_ring_with_2_4_8_and_64_pes() {
    let _serial = serial();
    for n in [2, 4, 8, 64] {
        ring(n);
    }
}

#[test]
fn put_signal_and_wait_until_deliver_data_before_the_signal() {
    let _serial = serial();
    let n = 4;
    spmt("signals", n, 1 << 20, move |rank, w| {
        let bytes = 4096;
        let slots = w.malloc(bytes * n).unwrap();
        let sig = w.malloc(8 * n).unwrap();
        // SAFETY: zeroes this PE's own signal words.
        unsafe { std::ptr::write_bytes(sig as *mut u8, 0, 8 * n) };
        w.barrier_all().unwrap();
        let mut g = XorShift::new(rank as u64 + 7);
        for round in 1..=20u64 {
            let data: Vec<u8> = (0..bytes).map(|_| g.next_u64() as u8).collect();
            for pe in 0..n {
                // My slot on every PE, then signal word `rank` there += 1.
                // SAFETY: `data` is live for the call.
                unsafe {
                    w.put_signal(
                        slots + (rank * bytes) as u64,
                        data.as_ptr() as u64,
                        bytes,
                        sig + 8 * rank as u64,
                        1,
                        SignalOp::Add,
                        pe,
                    )
                }
                .unwrap();
            }
            for src in 0..n {
                let seen = w.wait_until(sig + 8 * src as u64, Cmp::Ge, round).unwrap();
                assert!(seen >= round);
            }
            w.barrier_all().unwrap();
            // After the barrier every slot holds its writer's round data.
            for src in 0..n {
                let mut want = XorShift::new(src as u64 + 7);
                for _ in 0..(round - 1) * bytes as u64 {
                    want.next_u64();
                }
                // SAFETY: this PE's own slot.
                let got = unsafe {
                    std::slice::from_raw_parts((slots + (src * bytes) as u64) as *const u8, bytes)
                };
                assert!(
                    got.iter().all(|&b| b == want.next_u64() as u8),
                    "rank {rank} slot {src} round {round}"
                );
            }
            w.barrier_all().unwrap();
        }
        // Set, and a wait that times out with a clear message.
        // SAFETY: 8 bytes of this PE's memory.
        unsafe { w.put_signal(slots, slots, 0, sig, 42, SignalOp::Set, rank) }.unwrap();
        assert_eq!(w.wait_until(sig, Cmp::Eq, 42).unwrap(), 42);
        w.free(sig).unwrap();
        w.free(slots).unwrap();
    });
}

#[test]
fn wait_until_times_out_clearly() {
    let _serial = serial();
    let mut w = World::new();
    let mut c = WorldConfig::in_process("waiter", 0, 1, host(900));
    c.heap_bytes = Some(1 << 16);
    c.timeout = Duration::from_millis(200);
    w.init(&c).unwrap();
    let sig = w.malloc(8).unwrap();
    // SAFETY: this PE's own word.
    unsafe { (sig as *mut u64).write(3) };
    let e = w.wait_until(sig, Cmp::Gt, 5).unwrap_err();
    assert_eq!(e.status(), Status::Timeout);
    assert!(e.to_string().contains("holds 3"), "{e}");
    assert!(matches!(
        w.wait_until(sig + 4, Cmp::Eq, 0),
        Err(ShmemError::InvalidArgument(_))
    ));
    assert!(w.barrier_on_stream(std::ptr::null_mut()).is_err());
    w.free(sig).unwrap();
    w.finalize().unwrap();
}

#[test]
fn mismatched_malloc_is_reported_on_every_pe() {
    let _serial = serial();
    let errors = spmt("mismatch", 3, 1 << 20, |rank, w| {
        let a = w.malloc(1024).unwrap();
        let e = w.malloc(if rank == 1 { 4096 } else { 2048 }).unwrap_err();
        // The world is still usable and in step afterwards.
        let b = w.malloc(512).unwrap();
        w.free(b).unwrap();
        let f = w.free(if rank == 2 { b } else { a }).unwrap_err();
        w.free(a).unwrap();
        (e, f)
    });
    for (rank, (e, f)) in errors.iter().enumerate() {
        assert_eq!(e.status(), Status::CollectiveMismatch, "rank {rank}: {e}");
        let m = e.to_string();
        assert!(
            m.contains("rank 1: malloc #1 of 4096 bytes")
                && m.contains("rank 0: malloc #1 of 2048 bytes"),
            "{m}"
        );
        assert_eq!(f.status(), Status::CollectiveMismatch, "rank {rank}: {f}");
    }
}

/// `allgather` hands every PE every PE's bytes by rank, of any length
/// (empty included), round after round; a PE offering more than the
/// limit, or a PE in another collective, fails the call on every PE
/// naming it, and the world stays in step.
#[test]
fn allgather_gives_every_pe_every_pes_bytes_and_refuses_on_all() {
    let _serial = serial();
    // Rank r's data of round k: (r * 7 + k) % 5 * 1000 + r bytes, from a
    // seed of its own.
    let data = |r: usize, k: u64| {
        let mut g = XorShift::new(r as u64 * 131 + k + 1);
        (0..((r * 7 + k as usize) % 5) * 1000 + r)
            .map(|_| g.next_u64() as u8)
            .collect::<Vec<u8>>()
    };
    let n = 5;
    let errors = spmt("allgather", n, 1 << 20, move |rank, w| {
        for k in 0..4 {
            let all = w.allgather(&data(rank, k)).unwrap();
            assert_eq!(all.len(), n);
            for (r, d) in all.iter().enumerate() {
                assert_eq!(*d, data(r, k), "rank {rank} round {k}: rank {r}'s bytes");
            }
        }
        let big = vec![7u8; xcall_shmem::MAX_GATHER_BYTES + usize::from(rank == 3)];
        let too_big = w.allgather(&big).unwrap_err();
        let mismatch = match rank {
            1 => w.barrier_all().unwrap_err(),
            _ => w.allgather(b"x").unwrap_err(),
        };
        // Still in step: the next round gathers.
        let all = w.allgather(&[rank as u8]).unwrap();
        assert_eq!(all, (0..n as u8).map(|r| vec![r]).collect::<Vec<_>>());
        // allgather_offered: data that does not hold what it offers is
        // refused before the collective (on every PE here, so all stay in
        // step); past the limit the data is not read (rank 2 offers
        // u64::MAX bytes with none) and every PE fails naming it.
        let short = w.allgather_offered(3, b"ab").unwrap_err();
        assert_eq!(short.status(), Status::InvalidArgument, "{short}");
        assert!(
            short.to_string().contains("offers 3 bytes with 2"),
            "{short}"
        );
        let offered = if rank == 2 { u64::MAX } else { 1 };
        let data: &[u8] = if rank == 2 { &[] } else { b"z" };
        let huge = w.allgather_offered(offered, data).unwrap_err();
        let all = w.allgather_offered(1, &[rank as u8 + 10]).unwrap();
        assert_eq!(all, (0..n as u8).map(|r| vec![r + 10]).collect::<Vec<_>>());
        (too_big, mismatch, huge)
    });
    for (rank, (too_big, mismatch, huge)) in errors.iter().enumerate() {
        assert_eq!(
            huge.status(),
            Status::InvalidArgument,
            "rank {rank}: {huge}"
        );
        assert!(
            huge.to_string()
                .contains(&format!("rank 2 offered {} bytes", u64::MAX)),
            "rank {rank}: {huge}"
        );
        assert_eq!(
            too_big.status(),
            Status::InvalidArgument,
            "rank {rank}: {too_big}"
        );
        assert!(
            too_big.to_string().contains(&format!(
                "rank 3 offered {} bytes",
                xcall_shmem::MAX_GATHER_BYTES + 1
            )),
            "rank {rank}: {too_big}"
        );
        assert_eq!(
            mismatch.status(),
            Status::CollectiveMismatch,
            "rank {rank}: {mismatch}"
        );
        let m = mismatch.to_string();
        assert!(
            m.contains("rank 1: barrier_all #")
                && m.contains("rank 0: allgather #")
                && m.contains("of 1 bytes"),
            "rank {rank}: {m}"
        );
    }
}

#[test]
fn a_missing_pe_times_out_on_every_other_pe() {
    let _serial = serial();
    let n = 4;
    let results = run_threads("missing PE", n - 1, watchdog(), move |rank| {
        let mut w = World::new();
        let mut c = WorldConfig::in_process("missing", rank, n, host(100 + rank));
        c.heap_bytes = Some(1 << 16);
        c.timeout = Duration::from_millis(300);
        let t0 = std::time::Instant::now();
        let e = w.init(&c).unwrap_err();
        (e, t0.elapsed(), w.phase())
    });
    for (e, took, phase) in results {
        assert_eq!(e.status(), Status::Timeout, "{e}");
        assert!(e.to_string().contains("[3]"), "names the missing rank: {e}");
        assert!(took < Duration::from_secs(5));
        assert_eq!(phase, Phase::New);
    }
    // Nothing left behind: the group and the device bindings are gone.
    assert!(!xcall_shmem::bootstrap::group_alive("missing"));
    for r in 0..n - 1 {
        assert_eq!(device_slot(host(100 + r)).lock().unwrap().bound, None);
    }
}

#[test]
fn lifecycle_errors_are_clear() {
    let _serial = serial();
    let mut w = World::new();
    let e = w.malloc(8).unwrap_err();
    assert_eq!(e.status(), Status::InvalidState);
    assert!(e.to_string().contains("call init first"), "{e}");
    let mut c = WorldConfig::in_process("life", 0, 1, host(500));
    c.heap_bytes = Some(1 << 16);
    w.init(&c).unwrap();
    let e = w.init(&c).unwrap_err();
    assert_eq!(e.status(), Status::InvalidState);
    assert!(e.to_string().contains("finalize it first"), "{e}");
    // A second world on the same device is refused, naming the holder.
    let mut other = World::new();
    let mut c2 = WorldConfig::in_process("life2", 0, 1, host(500));
    c2.heap_bytes = Some(1 << 16);
    let e = other.init(&c2).unwrap_err();
    assert!(e.to_string().contains("already bound to rank 0"), "{e}");
    // Leaks are reported and freed.
    let a = w.malloc(100).unwrap();
    let b = w.malloc(300).unwrap();
    w.free(a).unwrap();
    // b lies right after a (100 bytes rounded up to the heap's 256-byte
    // alignment); its 300 bytes take 512.
    let leaked = (b - w.heap().unwrap().0) as usize;
    assert_eq!(b, a + 256);
    let report = w.finalize().unwrap();
    assert_eq!(report.leaked, vec![(leaked, 512)]);
    assert!(w.malloc(8).unwrap_err().to_string().contains("finalized"));
    assert!(w.finalize().is_err());
    // Bad configs.
    let mut bad = WorldConfig::in_process("bad", 2, 2, host(501));
    assert!(matches!(w.init(&bad), Err(ShmemError::InvalidArgument(_))));
    bad.rank = 0;
    bad.size = 1;
    bad.heap_bytes = Some(100);
    assert!(w.init(&bad).unwrap_err().to_string().contains("too small"));
    // Bad ranges.
    w.init(&c).unwrap();
    let x = w.malloc(64).unwrap();
    let src = [0u8; 128];
    // SAFETY: `src` has 128 bytes.
    let e = unsafe { w.put(x + (1 << 16), src.as_ptr() as u64, 8, 0) }.unwrap_err();
    assert!(
        e.to_string().contains("not inside the symmetric heap"),
        "{e}"
    );
    // SAFETY: as above.
    assert!(unsafe { w.put(x, src.as_ptr() as u64, 8, 1) }.is_err());
    assert!(w.free(x + 8).is_err());
    w.free(x).unwrap();
    w.finalize().unwrap();
}

#[test]
fn heap_exhaustion_and_coalescing_through_the_world() {
    let _serial = serial();
    spmt("exhaust", 2, 64 * 1024, |_, w| {
        let (_, len) = w.heap().unwrap();
        let a = w.malloc(16 * 1024).unwrap();
        let b = w.malloc(16 * 1024).unwrap();
        let c = w.malloc(16 * 1024).unwrap();
        let e = w.malloc(len).unwrap_err();
        assert_eq!(e.status(), Status::OutOfMemory);
        w.free(a).unwrap();
        w.free(c).unwrap();
        let e = w.malloc(40 * 1024).unwrap_err();
        assert!(e.to_string().contains("fragmented"), "{e}");
        w.free(b).unwrap();
        let big = w.malloc(40 * 1024).unwrap();
        assert_eq!(big, a, "freed neighbours coalesce");
        w.free(big).unwrap();
    });
}

#[test]
fn holding_the_own_device_slot_across_a_barrier_does_not_deadlock() {
    let _serial = serial();
    // The public bug: a process-global lock held across a barrier. Here
    // every PE holds its own device's slot while in barrier_all.
    let n = 8;
    let go = Arc::new(Barrier::new(n));
    let results = spmt("slots", n, 1 << 16, move |rank, w| {
        go.wait();
        let guard = device_slot(host(rank)).lock().unwrap();
        for _ in 0..10 {
            w.barrier_all().unwrap();
        }
        let bound = guard.bound.clone();
        drop(guard);
        bound
    });
    for (rank, b) in results.iter().enumerate() {
        assert_eq!(
            b.as_ref().map(|x| x.1),
            Some(rank),
            "registry knows the rank"
        );
    }
}

#[test]
fn no_pe_releases_its_heap_before_every_peer_let_go_of_it() {
    use xcall_shmem::world::{set_finalize_hook, FinalizeStep};
    let _serial = serial();
    static LOG: std::sync::Mutex<Vec<(usize, FinalizeStep)>> = std::sync::Mutex::new(Vec::new());
    fn hook(rank: usize, step: FinalizeStep) {
        // The last PE is slow to let go of its peers' heaps: a finalize that
        // did not wait for it would let the others release theirs meanwhile.
        if (rank, step) == (3, FinalizeStep::PeersReleased) {
            std::thread::sleep(Duration::from_millis(300));
        }
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rank, step));
    }
    spmt("finalize-order", 4, 1 << 16, |_, w| {
        let a = w.malloc(4096).unwrap();
        w.free(a).unwrap();
        set_finalize_hook(Some(hook));
    });
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let of = |step| log.iter().filter(|(_, s)| *s == step).count();
    assert_eq!(
        (
            of(FinalizeStep::PeersReleased),
            of(FinalizeStep::HeapReleasing)
        ),
        (4, 4),
        "{log:?}"
    );
    let last_let_go = log
        .iter()
        .rposition(|(_, s)| *s == FinalizeStep::PeersReleased)
        .unwrap();
    let first_heap = log
        .iter()
        .position(|(_, s)| *s == FinalizeStep::HeapReleasing)
        .unwrap();
    assert!(
        last_let_go < first_heap,
        "a PE released its heap while a peer still held it: {log:?}"
    );
}

#[test]
fn init_and_finalize_log_their_steps_and_each_peers_transport() {
    use xcall_core::log::{capture, LogLevel};
    let _s = serial();
    let n = 2;
    let per_rank = run_threads("logged world", n, watchdog(), move |rank| {
        capture("xcall_shmem=debug", || {
            let mut w = World::new();
            let mut c = WorldConfig::in_process("logged", rank, n, host(rank));
            c.heap_bytes = Some(1 << 20);
            c.timeout = Duration::from_secs(20);
            w.init(&c).unwrap();
            let x = w.malloc(64).unwrap();
            w.finalize().map(|r| (r.leaked.len(), x)).unwrap()
        })
    });
    for (rank, ((leaked, _), lines)) in per_rank.into_iter().enumerate() {
        assert_eq!(leaked, 1);
        let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
        let starts: Vec<&str> = texts
            .iter()
            .map(|t| {
                t.split(" bootstrap=")
                    .next()
                    .unwrap()
                    .split(" rank=")
                    .next()
                    .unwrap()
            })
            .collect();
        assert_eq!(
            starts,
            [
                "init: bootstrap joined",
                "init: identities exchanged",
                "init: peer mapped",
                "init: peer mapped",
                "shmem world up",
                "shmem world finalized",
            ],
            "rank {rank}: {texts:#?}"
        );
        for pe in 0..n {
            let mapped = format!(
                "init: peer mapped rank={rank} pe={pe} device=host:{rank} peer_device=host:{pe} transport=same_process"
            );
            assert_eq!(texts[2 + pe], mapped);
        }
        let up = format!("shmem world up bootstrap=\"group logged\" rank={rank} size=2 device=host:{rank} heap_bytes=1048576 ms=");
        assert!(texts[4].starts_with(&up), "{}", texts[4]);
        assert_eq!(
            texts[5],
            format!("shmem world finalized bootstrap=\"group logged\" rank={rank} size=2 leaked=1")
        );
        let levels: Vec<LogLevel> = lines.iter().map(|l| l.level).collect();
        use LogLevel::{Debug, Info};
        assert_eq!(levels, [Debug, Debug, Debug, Debug, Info, Info]);
    }
}

#[test]
fn a_bootstrap_timeout_is_logged_as_a_warning_naming_the_missing_rank() {
    use xcall_core::log::{capture, LogLevel};
    let _s = serial();
    let (e, lines) = capture("xcall_shmem=warn", || {
        let mut w = World::new();
        let mut c = WorldConfig::in_process("logged-alone", 0, 2, host(0));
        c.heap_bytes = Some(1 << 20);
        c.timeout = Duration::from_millis(200);
        w.init(&c).unwrap_err()
    });
    assert_eq!(e.status(), Status::Timeout, "{e}");
    assert!(!lines.is_empty() && lines.iter().all(|l| l.level == LogLevel::Warn));
    let last = &lines.last().unwrap().text;
    assert!(
        last.starts_with("shmem init failed rank=0 size=2 error="),
        "{last}"
    );
    assert!(last.contains("[1]"), "names the missing rank: {last}");
}
