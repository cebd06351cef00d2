//! init/finalize cycles: no growth in memory, threads or file
//! descriptors (its own test binary, so nothing else runs meanwhile).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform};
use xcall_shmem::registry::device_slot;
use xcall_shmem::{World, WorldConfig};

fn host(rank: usize) -> Device {
    Device::new(Platform::Host, rank as u32)
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn status_field(name: &str) -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// Mapped address space (kB) and number of mappings of this process:
/// an unmapped heap shows here even when its pages were never touched
/// (RSS would not see it).
fn mapped() -> (usize, usize) {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    (status_field("VmSize:"), maps.lines().count())
}

#[test]
fn two_hundred_init_finalize_cycles_leave_nothing_behind() {
    let n = 4;
    let go = Arc::new(Barrier::new(n + 1));
    let done = Arc::new(Barrier::new(n + 1));
    // Threads 0..n are the PEs; thread n measures after warm-up (cycle 20)
    // and at the end, while every PE waits.
    let results = run_threads("init/finalize cycles", n + 1, watchdog(), move |rank| {
        if rank == n {
            let mut at = Vec::new();
            for _ in 0..2 {
                go.wait();
                at.push((fds(), status_field("Threads:"), mapped()));
                done.wait();
            }
            return at;
        }
        let mut w = World::new();
        let mut c = WorldConfig::in_process("cycles", rank, n, host(200 + rank));
        c.heap_bytes = Some(1 << 20);
        c.timeout = Duration::from_secs(20);
        for cycle in 0..200 {
            if cycle == 20 || cycle == 199 {
                go.wait();
                done.wait();
            }
            w.init(&c).unwrap();
            let x = w.malloc(4096).unwrap();
            w.barrier_all().unwrap();
            w.free(x).unwrap();
            w.finalize().unwrap();
        }
        Vec::new()
    });
    let (f0, t0, (vm0, maps0)) = results[n][0];
    let (f1, t1, (vm1, maps1)) = results[n][1];
    assert_eq!(f1, f0, "file descriptors");
    assert_eq!(t1, t0, "threads");
    // 180 cycles of 4 heaps of 1 MiB: a heap left mapped per cycle would
    // add 720 MiB and 720 mappings.
    assert!(
        vm1 < vm0 + 4 * 1024,
        "mapped address space grew from {vm0} to {vm1} kB"
    );
    assert!(maps1 <= maps0 + 4, "mappings grew from {maps0} to {maps1}");
    assert!(!xcall_shmem::bootstrap::group_alive("cycles"));
    for r in 0..n {
        let s = device_slot(host(200 + r)).lock().unwrap().clone();
        assert_eq!((s.bound, s.inits, s.finalizes), (None, 200, 200));
    }
}
