//! Properties of the world's argument checks, over random input: init
//! refuses what it cannot honour without panicking, and a transfer is
//! accepted exactly when its range lies inside one live allocation (a
//! reference written here from the allocations made).

use std::time::Duration;

use proptest::prelude::*;
use xcall_core::{Device, Platform, Status};
use xcall_shmem::{World, WorldConfig, MAX_PES};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Tests of this file bind the Host device slots: one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

proptest! {
    #![proptest_config(config())]

    /// Sizes and ranks that cannot make a world are refused at once, with
    /// no rendezvous (the timeout would show) and no panic.
    #[test]
    fn init_refuses_impossible_worlds(
        rank in prop_oneof![0usize..4, Just(usize::MAX)],
        size in prop_oneof![0usize..1, Just(MAX_PES + 1), Just(u32::MAX as usize), Just(usize::MAX)],
        heap in prop::option::of(prop_oneof![0usize..4096, Just(usize::MAX), Just(usize::MAX - 255)]),
    ) {
        let _s = serial();
        let mut w = World::new();
        let mut c = WorldConfig::in_process("prop-init", rank, size, Device::new(Platform::Host, 0));
        c.heap_bytes = heap;
        c.timeout = Duration::from_secs(30);
        let t0 = std::time::Instant::now();
        let e = w.init(&c).unwrap_err();
        prop_assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
        prop_assert!(t0.elapsed() < Duration::from_secs(5));
    }

    /// In a one-PE world with a few objects (some freed), a put is
    /// accepted exactly when its range lies inside one live object.
    #[test]
    fn transfers_are_accepted_exactly_inside_live_objects(
        sizes in prop::collection::vec(1usize..1000, 1..6),
        freed in prop::collection::vec(any::<bool>(), 6),
        probes in prop::collection::vec((0usize..6, -300i64..1300, 0usize..1200), 1..12),
    ) {
        let _s = serial();
        let mut w = World::new();
        let mut c = WorldConfig::in_process("prop-ranges", 0, 1, Device::new(Platform::Host, 0));
        c.heap_bytes = Some(1 << 20);
        w.init(&c).unwrap();
        let objects: Vec<(u64, usize)> = sizes.iter().map(|&n| (w.malloc(n).unwrap(), n)).collect();
        let mut live = vec![true; objects.len()];
        for (i, &(a, _)) in objects.iter().enumerate() {
            if freed[i] && i % 2 == 1 {
                w.free(a).unwrap();
                live[i] = false;
            }
        }
        let data = vec![0x5au8; 1200];
        for &(obj, delta, bytes) in &probes {
            let (base, _) = objects[obj % objects.len()];
            let at = (base as i64 + delta) as u64;
            // The reference: inside one live object's rounded extent (the
            // allocator hands out 256-byte granules).
            let inside = objects.iter().zip(&live).any(|(&(a, n), &l)| {
                let end = a + n.next_multiple_of(256) as u64;
                l && at >= a && at + bytes as u64 <= end
            });
            // SAFETY: `data` holds 1200 bytes.
            let r = unsafe { w.put(at, data.as_ptr() as u64, bytes, 0) };
            prop_assert_eq!(r.is_ok(), inside, "put [{:#x}, +{}): {:?}", at, bytes, r);
            if let Err(e) = r {
                prop_assert_eq!(e.status(), Status::InvalidArgument);
            }
        }
        for (i, &(a, _)) in objects.iter().enumerate() {
            if live[i] {
                w.free(a).unwrap();
            }
        }
        prop_assert!(w.finalize().unwrap().leaked.is_empty());
    }
}
