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

/// `out->rows` may be NULL for an FP8 group that takes the bf16 rows
/// alone; an f32 group's NULL rows stay `XCALL_STATUS_NULL_ARGUMENT`, and
/// an FP8 group given neither rows is refused naming both.
#[test]
fn fp8_groups_may_take_the_bf16_rows_alone() {
    let address = CString::new(format!("ffi-ep-bf16-{}", std::process::id())).unwrap();
    run_threads("ep bf16 rows alone", 1, watchdog(), move |_| {
        let mut w = std::ptr::null_mut();
        assert_eq!(xcall_shmem_world_new(&mut w), Status::Ok);
        let fp8 = xcall_ep_config {
            hidden: 128,
            precision: EpPrecisionCode(EpPrecision::Fp8 as u32),
            ..config()
        };
        let mut sizes = xcall_ep_sizes::default();
        assert_eq!(xcall_ep_layout(&fp8, 1, &mut sizes), Status::Ok);
        let wc = xcall_shmem_config {
            rank: 0,
            size: 1,
            target: xcall_target {
                platform: PlatformCode(0),
                ordinal: 700,
                stream: std::ptr::null_mut(),
            },
            bootstrap: BootstrapCode(0),
            address: address.as_ptr(),
            heap_bytes: sizes.heap_bytes * 2 + (1 << 16),
            timeout_ms: 20_000,
            pairs: PairPolicyCode(0),
        };
        assert_eq!(xcall_shmem_init(w, &wc), Status::Ok);
        let mut g = std::ptr::null_mut();
        assert_eq!(xcall_ep_group_new(w, &fp8, &mut g), Status::Ok);
        // bf16 bits of a small whole number (exact: the f32's upper half).
        let bits = |v: f32| (v.to_bits() >> 16) as u16;
        // Token t's elements are t + 1: each row's scale (t + 1) / 448
        // quantizes them to 448 exactly, and dequantizes back exactly.
        let x: Vec<u16> = (0..4 * 128).map(|i| bits((i / 128 + 1) as f32)).collect();
        let ids = [0i32, 1, 0, 1];
        let probs = [1f32; 4];
        let mut bf16 = vec![0xffffu16; sizes.rows_bf16_bytes as usize / 2];
        let mut counts = [0i64; 2];
        let mut out = xcall_ep_expert_major {
            rows: std::ptr::null_mut(),
            rows_bytes: 0,
            scales: std::ptr::null_mut(),
            scales_bytes: 0,
            rows_bf16: bf16.as_mut_ptr().cast(),
            rows_bf16_bytes: sizes.rows_bf16_bytes,
            tokens_per_expert: counts.as_mut_ptr(),
            tokens_per_expert_bytes: 16,
            padded_per_expert: std::ptr::null_mut(),
            padded_per_expert_bytes: 0,
            offsets: std::ptr::null_mut(),
            offsets_bytes: 0,
        };
        let dispatch = |g: *mut xcall_ep_group, out: &xcall_ep_expert_major| {
            xcall_ep_dispatch(
                g,
                x.as_ptr().cast(),
                (x.len() * 2) as u64,
                ids.as_ptr(),
                16,
                probs.as_ptr(),
                16,
                4,
                out,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(dispatch(g, &out), Status::Ok);
        assert_eq!(xcall_ep_check(g), Status::Ok);
        // Expert 0 got tokens 0 and 2 (rows 0 and 1), expert 1 tokens 1
        // and 3.
        assert_eq!(counts, [2, 2]);
        let row = |r: usize| bf16[r * 128..(r + 1) * 128].to_vec();
        let of = |v: f32| vec![bits(v); 128];
        assert_eq!(
            [row(0), row(1), row(2), row(3)],
            [of(1.0), of(3.0), of(2.0), of(4.0)]
        );
        out.rows_bf16 = std::ptr::null_mut();
        out.rows_bf16_bytes = 0;
        assert_eq!(dispatch(g, &out), Status::InvalidArgument);
        // SAFETY: the message is a NUL-terminated string of this thread,
        // valid until its next xcall call.
        let msg = unsafe { std::ffi::CStr::from_ptr(xcall_last_error_message()) };
        assert!(
            msg.to_string_lossy()
                .contains("out.rows and out.rows_bf16 are both null"),
            "{msg:?}"
        );
        assert_eq!(xcall_ep_group_free(g, w), Status::Ok);
        // An f32 group's rows are required.
        assert_eq!(xcall_ep_group_new(w, &config(), &mut g), Status::Ok);
        assert_eq!(dispatch(g, &out), Status::NullArgument);
        assert_eq!(xcall_ep_group_free(g, w), Status::Ok);
        assert_eq!(xcall_shmem_finalize(w, std::ptr::null_mut()), Status::Ok);
        xcall_shmem_world_free(w);
    });
}
