//! Multi-process worlds on Host: the test binary spawns itself as the
//! other PEs (environment XCALL_SHMEM_TEST_PE = "socket,rank,size,mode"),
//! meeting at a Unix socket; heaps in POSIX shared memory.

use std::process::{Child, Command};
use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform, Status};
use xcall_shmem::{World, WorldConfig};

mod common;

const PE_ENV: &str = "XCALL_SHMEM_TEST_PE";

fn config(socket: &str, rank: usize, n: usize, timeout_ms: u64) -> WorldConfig {
    let mut c = WorldConfig::unix_socket(socket, rank, n, Device::new(Platform::Host, rank as u32));
    c.heap_bytes = Some(1 << 20);
    c.timeout = Duration::from_millis(timeout_ms);
    c
}

/// One PE of a ring exchange: put random data to the right neighbour with
/// a signal, check the left neighbour's arrived, get it back.
fn ring_pe(socket: &str, rank: usize, n: usize) {
    let mut w = World::new();
    w.init(&config(socket, rank, n, 20_000)).unwrap();
    let bytes = 100_000;
    let (buf, sig, data) = common::ring(&mut w, rank, n, 1000, bytes);
    let right = (rank + 1) % n;
    let mut back = vec![0u8; bytes];
    // SAFETY: `back` has `bytes` bytes.
    unsafe { w.get(back.as_mut_ptr() as u64, buf, bytes, right) }.unwrap();
    assert_eq!(back, data, "rank {rank}: get from rank {right}");
    assert!(w.ptr(right, buf).is_some());
    // Exchanges between processes: shared memory and signals.
    common::all_to_all(&mut w, rank, n, 4000, 6, 3000);
    w.barrier_all().unwrap();
    w.free(sig).unwrap();
    w.free(buf).unwrap();
    assert!(w.finalize().unwrap().leaked.is_empty());
}

/// One process of two whose exchange lists disagree, through shared
/// memory: `mode` "none" (rank 1 lists nothing from rank 0) or "size"
/// (32 bytes of rank 0's 64); see [`common::disagreeing_pe`].
fn disagreeing_pe(socket: &str, rank: usize, mode: &str) {
    let listed = (mode == "size").then_some(32);
    let mut w = World::new();
    w.init(&config(socket, rank, 2, 20_000)).unwrap();
    assert_eq!(
        w.transport(1 - rank).unwrap(),
        xcall_shmem::Transport::HostSharedMemory
    );
    let seen = common::disagreeing_pe(&mut w, rank, listed);
    let what = format!("shared memory, {mode}");
    let wrong = common::disagreement_failures(&what, listed, &[(rank, seen)]);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A PE of a world where one PE never comes: init must time out.
fn orphan_pe(socket: &str, rank: usize, n: usize) {
    let mut w = World::new();
    let e = w.init(&config(socket, rank, n, 500)).unwrap_err();
    assert_eq!(e.status(), Status::Timeout, "rank {rank}: {e}");
}

fn spawn(socket: &str, rank: usize, n: usize, mode: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "multi_process_worlds",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(PE_ENV, format!("{socket},{rank},{n},{mode}"))
        .spawn()
        .unwrap()
}

fn shm_leftovers(pid: u32) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!("xcall-{pid}-")))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn multi_process_worlds() {
    if let Ok(spec) = std::env::var(PE_ENV) {
        let f: Vec<&str> = spec.split(',').collect();
        let (rank, n) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        match f[3] {
            "ring" => ring_pe(f[0], rank, n),
            "none" | "size" => disagreeing_pe(f[0], rank, f[3]),
            _ => orphan_pe(f[0], rank, n),
        }
        return;
    }
    let dir = std::env::temp_dir();
    for n in [2, 4] {
        let socket = dir.join(format!("xcall-test-{}-{n}.sock", std::process::id()));
        let socket = socket.to_str().unwrap();
        let children: Vec<Child> = (1..n).map(|r| spawn(socket, r, n, "ring")).collect();
        ring_pe(socket, 0, n);
        for (i, mut c) in children.into_iter().enumerate() {
            assert!(
                c.wait().unwrap().success(),
                "{n} PEs: rank {} failed",
                i + 1
            );
        }
        assert!(!std::path::Path::new(socket).exists(), "socket removed");
        assert!(shm_leftovers(std::process::id()).is_empty());
    }
    // Exchange lists that disagree, between two processes: each fails
    // with the mismatch, nothing lands, nothing carries over.
    for mode in ["none", "size"] {
        let socket = dir.join(format!("xcall-test-{}-{mode}.sock", std::process::id()));
        let socket = socket.to_str().unwrap();
        let child = spawn(socket, 1, 2, mode);
        let socket0 = socket.to_string();
        // Rank 0 under a watchdog; rank 1 is killed if it outlives one.
        let rank0 = std::panic::catch_unwind(move || {
            run_threads(mode, 1, watchdog(), move |_| {
                disagreeing_pe(&socket0, 0, mode)
            })
        });
        let ok = xcall_core::testing::wait_children(mode, vec![child], watchdog());
        if let Err(p) = rank0 {
            std::panic::resume_unwind(p);
        }
        assert_eq!(ok, [true], "{mode}: rank 1 failed");
    }
    // Rank 2 of 3 never starts: ranks 0 and 1 both time out.
    let socket = dir.join(format!("xcall-test-{}-orphan.sock", std::process::id()));
    let socket = socket.to_str().unwrap();
    let child = spawn(socket, 1, 3, "orphan");
    let t0 = std::time::Instant::now();
    orphan_pe(socket, 0, 3);
    let mut child = child;
    assert!(
        child.wait().unwrap().success(),
        "rank 1 saw the timeout too"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
}
