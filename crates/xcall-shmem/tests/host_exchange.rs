//! `World::exchange` on Host: SPMT all-to-all rounds against data
//! computed independently on each side (through direct pairs and through
//! TCP pairs), the checks that refuse a bad segment before anything
//! moves, a missing sender timing out, and the transport policy's
//! refusals.

use std::time::{Duration, Instant};

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform, Status};
use xcall_shmem::{Config, Incoming, Outgoing, Pairs, Transport, World};

mod common;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn config(group: &str, rank: usize, n: usize, timeout: Duration) -> Config {
    let mut c = Config::in_process(group, rank, n, Device::new(Platform::Host, rank as u32));
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

#[test]
fn a_sender_that_never_sends_times_out_by_name() {
    let _s = serial();
    let results = run_threads("exchange timeout", 2, watchdog(), |rank| {
        let mut w = World::new();
        // PE 1 times out after 600 ms and only then joins the barrier
        // below, where PE 0 has been waiting since its own exchange
        // returned: PE 0 waits longer, so a loaded machine does not time
        // its barrier out first.
        let timeout = if rank == 1 {
            Duration::from_millis(600)
        } else {
            Duration::from_secs(20)
        };
        w.init(&config("xlate", rank, 2, timeout)).unwrap();
        let buf = w.malloc(64).unwrap();
        let started = Instant::now();
        let r = if rank == 1 {
            // Expects a segment PE 0 never lists.
            // SAFETY: nothing is sent.
            unsafe {
                w.exchange(
                    &[],
                    &[Incoming {
                        pe: 0,
                        dest: buf,
                        bytes: 8,
                    }],
                )
            }
        } else {
            // SAFETY: nothing is sent.
            unsafe { w.exchange(&[], &[]) }
        };
        let took = started.elapsed();
        w.barrier_all().unwrap();
        w.free(buf).unwrap();
        w.finalize().unwrap();
        (r.map_err(|e| (e.status(), e.to_string())), took)
    });
    assert_eq!(results[0].0, Ok(()));
    let (status, msg) = results[1].0.clone().unwrap_err();
    assert_eq!(status, Status::Timeout, "{msg}");
    assert!(msg.contains("PE 0's exchange segments"), "{msg}");
    assert!(results[1].1 < Duration::from_secs(10), "{:?}", results[1].1);
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
