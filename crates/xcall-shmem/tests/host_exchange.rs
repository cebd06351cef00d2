//! `World::exchange` on Host: SPMT all-to-all rounds against data
//! computed independently on each side (through direct pairs and through
//! TCP pairs), the checks that refuse a bad segment before anything
//! moves, lists that disagree failing every PE with nothing written and
//! nothing carried over, a missing PE timing out, and the transport
//! policy's refusals.

use std::time::{Duration, Instant};

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform, Status};
use xcall_shmem::{Incoming, Outgoing, Pairs, Transport, World, WorldConfig};

mod common;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn config(group: &str, rank: usize, n: usize, timeout: Duration) -> WorldConfig {
    let mut c = WorldConfig::in_process(group, rank, n, Device::new(Platform::Host, rank as u32));
    c.heap_bytes = Some(1 << 20);
    c.timeout = timeout;
    c
}

#[test]
fn all_to_all_rounds_between_threads() {
    let _s = serial();
    for n in [1, 2, 5] {
        run_threads(&format!("exchange {n}"), n, watchdog(), move |rank| {
            let mut w = World::new();
            w.init(&config(
                &format!("x2x{n}"),
                rank,
                n,
                Duration::from_secs(20),
            ))
            .unwrap();
            for pe in 0..n {
                assert_eq!(w.transport(pe).unwrap(), Transport::SameProcess);
            }
            common::all_to_all(&mut w, rank, n, 9, 8, 2000);
            assert!(w.finalize().unwrap().leaked.is_empty());
        });
    }
}

/// Every pair but a PE with itself forced onto TCP: the transports say
/// so, a TCP peer has no pointer and refuses put and get by name, and the
/// all-to-all rounds (each PE's own segment a plain copy) arrive intact;
/// one PE alone has no TCP pair at all.
#[test]
fn all_to_all_rounds_through_tcp_pairs() {
    let _s = serial();
    for n in [1, 2, 4] {
        run_threads(&format!("tcp exchange {n}"), n, watchdog(), move |rank| {
            let mut c = config(&format!("xtcp{n}"), rank, n, Duration::from_secs(20));
            c.pairs = Some(Pairs::Tcp);
            let mut w = World::new();
            w.init(&c).unwrap();
            let obj = w.malloc(64).unwrap();
            for pe in 0..n {
                let t = w.transport(pe).unwrap();
                if pe == rank {
                    assert_eq!(t, Transport::SameProcess);
                    assert!(w.ptr(pe, obj).is_some());
                    continue;
                }
                assert_eq!(t, Transport::Tcp);
                assert_eq!(w.ptr(pe, obj), None);
                let src = [1u8; 8];
                // SAFETY: `src` is 8 readable bytes; refused before use.
                let e = unsafe { w.put(obj, src.as_ptr() as u64, 8, pe) }.unwrap_err();
                assert_eq!(e.status(), Status::Unsupported, "{e}");
                assert!(e.to_string().contains("through TCP"), "{e}");
            }
            common::all_to_all(&mut w, rank, n, 19, 6, 70_000);
            w.free(obj).unwrap();
            assert!(w.finalize().unwrap().leaked.is_empty());
        });
    }
}

#[test]
fn a_bad_segment_is_refused_before_anything_moves() {
    let _s = serial();
    let mut w = World::new();
    w.init(&config("xbad", 0, 1, Duration::from_secs(5)))
        .unwrap();
    let buf = w.malloc(256).unwrap();
    let (base, len) = w.heap().unwrap();
    // SAFETY: this PE's object of 256 bytes.
    unsafe { std::ptr::write_bytes(buf as *mut u8, 0xAA, 256) };
    let data = [7u8; 64];
    let good = Outgoing {
        pe: 0,
        src: data.as_ptr() as u64,
        dest: buf,
        bytes: 64,
    };
    let landing = Incoming {
        pe: 0,
        dest: buf,
        bytes: 64,
    };
    let cases: Vec<(&str, Vec<Outgoing>, Vec<Incoming>, Status)> = vec![
        (
            "a destination past the object",
            vec![
                good,
                Outgoing {
                    dest: buf + 200,
                    ..good
                },
            ],
            vec![landing],
            Status::InvalidArgument,
        ),
        (
            "a destination outside the heap",
            vec![
                good,
                Outgoing {
                    dest: base + len as u64,
                    ..good
                },
            ],
            vec![landing],
            Status::InvalidArgument,
        ),
        (
            "a destination in the internal region",
            vec![good, Outgoing { dest: base, ..good }],
            vec![landing],
            Status::InvalidArgument,
        ),
        (
            "a receiver that is not a PE",
            vec![good, Outgoing { pe: 1, ..good }],
            vec![landing],
            Status::InvalidArgument,
        ),
        (
            "a receive outside the heap",
            vec![good],
            vec![
                landing,
                Incoming {
                    dest: base + len as u64 + 8,
                    ..landing
                },
            ],
            Status::InvalidArgument,
        ),
        (
            "a sender that is not a PE",
            vec![good],
            vec![landing, Incoming { pe: 3, ..landing }],
            Status::InvalidArgument,
        ),
    ];
    for (what, out, inc, status) in cases {
        // SAFETY: every src is `data`, 64 bytes.
        let e = unsafe { w.exchange(&out, &inc) }.unwrap_err();
        assert_eq!(e.status(), status, "{what}: {e}");
        // SAFETY: this PE's object of 256 bytes.
        let now = unsafe { std::slice::from_raw_parts(buf as *const u8, 256) };
        assert!(
            now.iter().all(|&b| b == 0xAA),
            "{what}: the good segment moved"
        );
    }
    // The same good segment alone lands.
    // SAFETY: as above.
    unsafe { w.exchange(&[good], &[landing]) }.unwrap();
    // SAFETY: as above.
    let now = unsafe { std::slice::from_raw_parts(buf as *const u8, 256) };
    assert!(now[..64].iter().all(|&b| b == 7) && now[64..].iter().all(|&b| b == 0xAA));
    w.free(buf).unwrap();
    w.finalize().unwrap();
}

/// A PE that never reaches the exchange: its peer's exchange times out
/// naming it (the lists are agreed on before anything moves, so the wait
/// is there), well within the watchdog.
#[test]
fn a_pe_that_never_reaches_the_exchange_times_out_by_name() {
    let _s = serial();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let results = run_threads("exchange timeout", 2, watchdog(), move |rank| {
        let timeout = if rank == 1 {
            Duration::from_millis(600)
        } else {
            Duration::from_secs(20)
        };
        let mut w = World::new();
        w.init(&config("xlate", rank, 2, timeout)).unwrap();
        let buf = w.malloc(64).unwrap();
        if rank == 0 {
            // Never calls exchange; leaves once PE 1 gave up.
            let deadline = Instant::now() + watchdog();
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                assert!(Instant::now() < deadline, "watchdog: PE 1 never gave up");
                std::thread::sleep(Duration::from_millis(10));
            }
            return None;
        }
        let started = Instant::now();
        // SAFETY: nothing is sent.
        let r = unsafe {
            w.exchange(
                &[],
                &[Incoming {
                    pe: 0,
                    dest: buf,
                    bytes: 8,
                }],
            )
        };
        done.store(true, std::sync::atomic::Ordering::Release);
        let e = r.unwrap_err();
        Some((e.status(), e.to_string(), started.elapsed()))
    });
    let (status, msg, took) = results[1].clone().unwrap();
    assert_eq!(status, Status::Timeout, "{msg}");
    assert!(msg.contains("rank(s) [0]"), "{msg}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}

/// The ways a Host pair of two threads is set up: (name, TCP bootstrap,
/// TCP pairs).
const SETUPS: [(&str, bool, bool); 4] = [
    ("in-process, same-process pairs", false, false),
    ("TCP bootstrap, same-process pairs", true, false),
    ("in-process, TCP pairs", false, true),
    ("TCP bootstrap, TCP pairs", true, true),
];

fn free_address() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// Rank 0 sends 64 bytes to rank 1, which lists `listed` bytes (`None`:
/// nothing) from rank 0, on every Host setup. Both PEs fail with the same
/// COLLECTIVE_MISMATCH naming the ranks and sizes; rank 1's buffer is
/// untouched (nothing past what it listed, nothing at all); and the next
/// exchange, which agrees and whose sender comes 300 ms late, returns the
/// new bytes, never the disagreeing call's.
fn disagreeing_lists(listed: Option<usize>, tag: &str) {
    let _s = serial();
    let mut failures = Vec::new();
    for (what, tcp_boot, tcp_pairs) in SETUPS {
        let address = free_address();
        let group = format!("xdis-{tag}-{tcp_boot}-{tcp_pairs}");
        let results = run_threads(what, 2, watchdog(), move |rank| {
            let mut c = match tcp_boot {
                true => {
                    WorldConfig::tcp(&address, rank, 2, Device::new(Platform::Host, rank as u32))
                }
                false => config(&group, rank, 2, Duration::from_secs(20)),
            };
            c.heap_bytes = Some(1 << 20);
            c.timeout = Duration::from_secs(20);
            if tcp_pairs {
                c.pairs = Some(Pairs::Tcp);
            }
            let mut w = World::new();
            w.init(&c).unwrap();
            let want = if tcp_pairs {
                Transport::Tcp
            } else {
                Transport::SameProcess
            };
            assert_eq!(w.transport(1 - rank).unwrap(), want, "{what}");
            common::disagreeing_pe(&mut w, rank, listed)
        });
        let results: Vec<_> = results.into_iter().enumerate().collect();
        failures.extend(common::disagreement_failures(what, listed, &results));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Rank 1 lists nothing from rank 0, which sends it 64 bytes.
#[test]
fn a_segment_its_receiver_does_not_list_fails_every_pe_and_nothing_carries_over() {
    disagreeing_lists(None, "none");
}

/// Rank 1 lists 32 bytes from rank 0, which sends it 64.
#[test]
fn sizes_that_disagree_fail_every_pe_and_write_nothing() {
    disagreeing_lists(Some(32), "size");
}

/// A PE whose own segment is refused fails the exchange on every PE with
/// its error (the others name it), and nothing moves anywhere.
#[test]
fn a_segment_refused_on_one_pe_fails_the_exchange_on_every_pe() {
    let _s = serial();
    let results = run_threads("exchange refused", 2, watchdog(), |rank| {
        let mut w = World::new();
        w.init(&config("xrefused", rank, 2, Duration::from_secs(20)))
            .unwrap();
        let buf = w.malloc(64).unwrap();
        // SAFETY: this PE's object of 64 bytes.
        unsafe { std::ptr::write_bytes(buf as *mut u8, 0xAA, 64) };
        w.barrier_all().unwrap();
        let data = [5u8; 64];
        let to = 1 - rank;
        // Rank 1's segment lands in the internal region.
        let dest = if rank == 1 { w.heap().unwrap().0 } else { buf };
        let out = Outgoing {
            pe: to,
            src: data.as_ptr() as u64,
            dest,
            bytes: 64,
        };
        let inc = Incoming {
            pe: to,
            dest: buf,
            bytes: 64,
        };
        // SAFETY: `data` holds 64 bytes.
        let e = unsafe { w.exchange(&[out], &[inc]) }.unwrap_err();
        // SAFETY: as above.
        let now = unsafe { std::slice::from_raw_parts(buf as *const u8, 64) }.to_vec();
        w.barrier_all().unwrap();
        w.free(buf).unwrap();
        w.finalize().unwrap();
        (e.status(), e.to_string(), now)
    });
    for (rank, (status, msg, now)) in results.iter().enumerate() {
        assert_eq!(*status, Status::InvalidArgument, "rank {rank}: {msg}");
        assert!(msg.contains("exchange destination"), "rank {rank}: {msg}");
        assert!(now.iter().all(|&b| b == 0xAA), "rank {rank}: {now:?}");
    }
    assert!(results[0].1.contains("rank 1:"), "{}", results[0].1);
}

#[test]
fn nccl_is_refused_on_host_and_policies_parse() {
    let _s = serial();
    let mut c = config("xnccl", 0, 1, Duration::from_secs(5));
    c.pairs = Some(Pairs::Nccl);
    let e = World::new().init(&c).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(e.to_string().contains("CUDA worlds only"), "{e}");
    let mut g = c.clone();
    g.device = Device::cuda(0);
    g.pairs = Some(Pairs::Tcp);
    let e = World::new().init(&g).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(e.to_string().contains("Host worlds only"), "{e}");
    assert_eq!(Pairs::parse("nccl"), Some(Pairs::Nccl));
    assert_eq!(Pairs::parse("Tcp"), Some(Pairs::Tcp));
    assert_eq!(Pairs::parse(" AUTO "), Some(Pairs::Auto));
    assert_eq!(Pairs::parse("ib"), None);
    // The same world with the default policy comes up.
    c.pairs = Some(Pairs::Auto);
    let mut w = World::new();
    w.init(&c).unwrap();
    w.finalize().unwrap();
}
