//! init/finalize cycles: no growth in memory, threads or file
//! descriptors (its own test binary, so nothing else runs meanwhile).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use xcall_core::{Device, Platform};
use xcall_shmem::registry::device_slot;
use xcall_shmem::{Config, World};

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

#[test]
fn two_hundred_init_finalize_cycles_leave_nothing_behind() {
    let n = 4;
    let go = Arc::new(Barrier::new(n + 1));
    let done = Arc::new(Barrier::new(n + 1));
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (go, done) = (go.clone(), done.clone());
            std::thread::spawn(move || {
                let mut w = World::new();
                let mut c = Config::in_process("cycles", rank, n, host(200 + rank));
                c.heap_bytes = Some(1 << 20);
                c.timeout = Duration::from_secs(20);
                for cycle in 0..200 {
                    if cycle == 20 || cycle == 199 {
                        go.wait(); // measure after warm-up and at the end
                        done.wait();
                    }
                    w.init(&c).unwrap();
                    let x = w.malloc(4096).unwrap();
                    w.barrier_all().unwrap();
                    w.free(x).unwrap();
                    w.finalize().unwrap();
                }
            })
        })
        .collect();
    go.wait();
    let (f0, t0, rss0) = (fds(), status_field("Threads:"), status_field("VmRSS:"));
    done.wait();
    go.wait();
    let (f1, t1, rss1) = (fds(), status_field("Threads:"), status_field("VmRSS:"));
    done.wait();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(f1, f0, "file descriptors");
    assert_eq!(t1, t0, "threads");
    assert!(rss1 < rss0 + 8 * 1024, "RSS grew from {rss0} to {rss1} kB");
    assert!(!xcall_shmem::bootstrap::group_alive("cycles"));
    for r in 0..n {
        let s = device_slot(host(200 + r)).lock().unwrap().clone();
        assert_eq!((s.bound, s.inits, s.finalizes), (None, 200, 200));
    }
}
