//! Known answers at the edges of a one-PE Host world: the size of the
//! internal region (where the first allocation lands and the smallest heap
//! init accepts), the bounds `free` and `ptr` accept, and every comparison
//! of `wait_until`.

use std::time::Duration;

use xcall_core::{Device, Platform, Status};
use xcall_shmem::{Cmp, SignalOp, World, WorldConfig};

/// Bytes a world of `n` PEs reserves at offset 0 of its heap, computed here
/// from the layout the crate documents: `n` arrival words, the epoch and
/// error words, `n` peer pointers, `n` exchange words, 64 staged signal
/// values, rounded up to the 256-byte alignment.
fn internal(n: usize) -> usize {
    let words = n + 2 + n + n + 64;
    (words * 8).div_ceil(256) * 256
}

fn host_world(group: &str, heap: usize) -> Result<World, xcall_shmem::ShmemError> {
    host_world_waiting(group, heap, Duration::from_secs(20))
}

fn host_world_waiting(
    group: &str,
    heap: usize,
    timeout: Duration,
) -> Result<World, xcall_shmem::ShmemError> {
    let mut c = WorldConfig::in_process(group, 0, 1, Device::new(Platform::Host, 0));
    c.heap_bytes = Some(heap);
    c.timeout = timeout;
    let mut w = World::new();
    w.init(&c)?;
    Ok(w)
}

/// Tests of this file bind the Host device slot 0: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn the_smallest_heap_holds_the_internal_region_and_one_block() {
    let _s = serial();
    let least = internal(1) + 256;
    let err = host_world("bounds-small", least - 1)
        .err()
        .expect("one byte short");
    assert_eq!(err.status(), Status::InvalidArgument, "{err}");
    assert!(
        err.to_string().contains(&format!("at least {least} bytes")),
        "{err}"
    );
    // Larger worlds reserve more; init says how much before any rendezvous.
    for n in [2, 20, 100] {
        let mut c = WorldConfig::in_process("bounds-many", 0, n, Device::new(Platform::Host, 0));
        c.heap_bytes = Some(1);
        let err = World::new().init(&c).unwrap_err();
        let least = internal(n) + 256;
        assert!(
            err.to_string().contains(&format!("at least {least} bytes")),
            "{n}: {err}"
        );
    }
    let mut w = host_world("bounds-small", least).unwrap();
    let (base, len) = w.heap().unwrap();
    assert_eq!(len, least);
    // The first allocation lands right after the internal region.
    let a = w.malloc(16).unwrap();
    assert_eq!(a - base, internal(1) as u64);
    w.free(a).unwrap();
    w.finalize().unwrap();
}

#[test]
fn free_and_ptr_accept_exactly_the_allocatable_range() {
    let _s = serial();
    let mut w = host_world("bounds-free", 1 << 20).unwrap();
    let (base, len) = w.heap().unwrap();
    let end = base + len as u64;
    // ptr: every address of the heap maps, one past its end does not.
    assert_eq!(w.ptr(0, base), Some(base));
    assert_eq!(w.ptr(0, end - 1), Some(end - 1));
    assert_eq!(w.ptr(0, end), None);
    assert_eq!(w.ptr(0, base - 1), None);
    assert_eq!(w.ptr(1, base), None, "no PE 1 in a world of one");
    // free: the internal region and one past the end are not the heap's
    // objects, whatever the allocator holds.
    for bad in [base, base + internal(1) as u64 - 1, end, end + 256] {
        let err = w.free(bad).unwrap_err();
        assert_eq!(err.status(), Status::InvalidArgument, "{bad:#x}: {err}");
        assert!(
            err.to_string()
                .contains("is not in this PE's symmetric heap"),
            "{bad:#x}: {err}"
        );
    }
    let a = w.malloc(256).unwrap();
    w.free(a).unwrap();
    w.finalize().unwrap();
}

#[test]
fn wait_until_knows_every_comparison() {
    let _s = serial();
    let mut w = host_world_waiting("bounds-cmp", 1 << 20, Duration::from_millis(100)).unwrap();
    let sig = w.malloc(8).unwrap();
    // SAFETY: an 8-byte word of this PE's own heap, set to 5 below.
    let set = |w: &mut World, v: u64| unsafe {
        let src = v.to_ne_bytes();
        w.put_signal(sig, src.as_ptr() as u64, 0, sig, v, SignalOp::Set, 0)
            .unwrap();
    };
    set(&mut w, 5);
    // (cmp, value, holds for a word of 5)
    let table = [
        (Cmp::Eq, 5, true),
        (Cmp::Eq, 4, false),
        (Cmp::Ne, 4, true),
        (Cmp::Ne, 5, false),
        (Cmp::Ge, 5, true),
        (Cmp::Ge, 6, false),
        (Cmp::Gt, 4, true),
        (Cmp::Gt, 5, false),
        (Cmp::Le, 5, true),
        (Cmp::Le, 4, false),
        (Cmp::Lt, 6, true),
        (Cmp::Lt, 5, false),
    ];
    for (cmp, value, holds) in table {
        let got = w.wait_until(sig, cmp, value);
        if holds {
            assert_eq!(got.unwrap(), 5, "{cmp:?} {value}");
        } else {
            // Nobody else signals: a comparison that does not hold waits
            // out the world's (short) timeout.
            let err = got.unwrap_err();
            assert_eq!(err.status(), Status::Timeout, "{cmp:?} {value}: {err}");
        }
    }
    w.free(sig).unwrap();
    w.finalize().unwrap();
}
