//! The expert-parallel group's C handle from several threads: each PE's
//! handle is its own, and a call that meets another thread inside one is
//! refused at once instead of waiting behind it.

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xcall::*;
use xcall_core::testing::{run_threads, watchdog};
use xcall_core::Status;

fn config() -> xcall_ep_config {
    xcall_ep_config {
        tokens: 4,
        hidden: 4,
        topk: 1,
        experts: 2,
        align: 1,
        capacity: 0,
        precision: EpPrecisionCode(EpPrecision::F32 as u32),
        num_sms: 0,
    }
}

/// Polls `done` until it holds; fails the test after 10 s.
fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "waited 10 s for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// While PE 0 is inside a dispatch waiting for PE 1 (Host), another
/// thread's call on PE 0's group is refused at once with `Busy`
/// instead of waiting behind it, PE 0's world stays free for that
/// thread, and PE 1's group runs: each PE's handle is its own.
#[test]
fn a_call_on_a_group_inside_a_dispatch_is_busy_and_waits_for_nothing() {
    let address = CString::new(format!("ffi-ep-busy-{}", std::process::id())).unwrap();
    let (group0, world0) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let busy_seen = Arc::new(AtomicBool::new(false));
    let c = config();
    let mut sizes = xcall_ep_sizes::default();
    assert_eq!(xcall_ep_layout(&c, 2, &mut sizes), Status::Ok);
    run_threads("ep busy", 3, watchdog(), move |rank| {
        if rank == 2 {
            // The prober: PE 0's group is busy while its dispatch waits.
            until("PE 0's group", || group0.load(Ordering::Acquire) != 0);
            let g = group0.load(Ordering::Acquire) as *mut xcall_ep_group;
            until("PE 0 to be inside its dispatch", || {
                xcall_ep_check(g) == Status::Busy
            });
            let w = world0.load(Ordering::Acquire) as *mut xcall_shmem_world;
            let (mut r, mut n) = (9, 9);
            assert_eq!(xcall_shmem_rank(w, &mut r, &mut n), Status::Ok);
            assert_eq!((r, n), (0, 2));
            busy_seen.store(true, Ordering::Release);
            return;
        }
        let mut w = std::ptr::null_mut();
        assert_eq!(xcall_shmem_world_new(&mut w), Status::Ok);
        let wc = xcall_shmem_config {
            rank: rank as u32,
            size: 2,
            target: xcall_target {
                platform: PlatformCode(0),
                ordinal: 600 + rank as u32,
                stream: std::ptr::null_mut(),
            },
            bootstrap: BootstrapCode(0),
            address: address.as_ptr(),
            heap_bytes: sizes.heap_bytes + (1 << 16),
            timeout_ms: 20_000,
            pairs: PairPolicyCode(0),
        };
        assert_eq!(xcall_shmem_init(w, &wc), Status::Ok);
        let mut g = std::ptr::null_mut();
        assert_eq!(xcall_ep_group_new(w, &c, &mut g), Status::Ok);
        let mut rows = vec![0f32; sizes.rows_bytes as usize / 4];
        let mut counts = [0i64; 1];
        let out = xcall_ep_expert_major {
            rows: rows.as_mut_ptr().cast(),
            rows_bytes: sizes.rows_bytes,
            scales: std::ptr::null_mut(),
            scales_bytes: 0,
            rows_bf16: std::ptr::null_mut(),
            rows_bf16_bytes: 0,
            tokens_per_expert: counts.as_mut_ptr(),
            tokens_per_expert_bytes: 8,
            padded_per_expert: std::ptr::null_mut(),
            padded_per_expert_bytes: 0,
            offsets: std::ptr::null_mut(),
            offsets_bytes: 0,
        };
        if rank == 0 {
            world0.store(w as usize, Ordering::Release);
            group0.store(g as usize, Ordering::Release);
        } else {
            until("the prober to see PE 0 busy", || {
                busy_seen.load(Ordering::Acquire)
            });
        }
        let dispatch = || {
            let (x, ids, probs) = (std::ptr::null(), std::ptr::null(), std::ptr::null());
            xcall_ep_dispatch(g, x, 0, ids, 0, probs, 0, 0, &out, std::ptr::null_mut())
        };
        // PE 0 may meet the prober's check itself: Busy, nothing done.
        let mut status = dispatch();
        while rank == 0 && status == Status::Busy {
            status = dispatch();
        }
        assert_eq!(status, Status::Ok);
        assert_eq!(counts, [0]);
        assert_eq!(xcall_ep_check(g), Status::Ok);
        assert_eq!(xcall_ep_group_free(g, w), Status::Ok);
        assert_eq!(xcall_shmem_finalize(w, std::ptr::null_mut()), Status::Ok);
        xcall_shmem_world_free(w);
    });
}
