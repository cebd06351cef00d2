//! Worlds of processes started the way launchers start them: the test
//! binary spawns itself once per rank with torchrun's, Open MPI's or
//! Slurm's variables (and `MASTER_ADDR`/`MASTER_PORT`), and each process
//! joins through `LaunchEnv::from_env` and the TCP bootstrap; heaps in POSIX
//! shared memory. A watchdog kills every child still running after 60 s
//! and fails the test naming them.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use xcall_core::{Device, Platform, Status};
use xcall_shmem::launch::LaunchEnv;
use xcall_shmem::{Transport, World};

mod common;

/// Set in a child: what it checks ("ring:LAUNCHER" or "orphan").
const ROLE_ENV: &str = "XCALL_SHMEM_TEST_LAUNCH";

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A launcher's variables for rank `r` of `n` (all on this host).
fn vars(launcher: &str, r: usize, n: usize, port: u16) -> Vec<(String, String)> {
    let names: &[&str] = match launcher {
        "torchrun" => &["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
        "mpirun" => &[
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
        _ => &["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
    };
    let values = [r, n, r, n];
    let mut v: Vec<(String, String)> = names
        .iter()
        .zip(values)
        .map(|(k, x)| (k.to_string(), x.to_string()))
        .collect();
    v.push(("MASTER_ADDR".into(), "127.0.0.1".into()));
    v.push(("MASTER_PORT".into(), port.to_string()));
    v
}

/// Spawns rank `r` of `n` as `launcher` would, in role `role`.
fn spawn(launcher: &str, r: usize, n: usize, port: u16, role: &str) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "launched_worlds",
        "--nocapture",
        "--test-threads=1",
    ]);
    // Only the variables of the launcher under test.
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(name);
    }
    cmd.env_remove(xcall_shmem::HOST_ENV);
    match role {
        // Two named hosts, alternating ranks.
        "hosts" => {
            cmd.env(xcall_shmem::HOST_ENV, format!("node{}", r % 2));
        }
        // The longest name, one byte too long, and one of two lines.
        "name:255" => {
            cmd.env(xcall_shmem::HOST_ENV, "h".repeat(255));
        }
        "name:256" => {
            cmd.env(xcall_shmem::HOST_ENV, "h".repeat(256));
        }
        "name:lines" => {
            cmd.env(xcall_shmem::HOST_ENV, "node\rtwo");
        }
        _ => {}
    }
    cmd.envs(vars(launcher, r, n, port))
        .env(ROLE_ENV, role)
        .spawn()
        .unwrap()
}

/// Waits for every child under the watchdog; each must succeed.
fn wait_all(what: &str, children: Vec<Child>, limit: Duration) {
    for (r, ok) in xcall_core::testing::wait_children(what, children, limit)
        .into_iter()
        .enumerate()
    {
        assert!(ok, "{what}: rank {r} failed");
    }
}

/// One process of a ring exchange, its rank and world from the launcher.
/// Joins the world the launcher's variables describe, one Host PE of
/// this process: (the launcher, rank, size, the live world).
fn join_launched() -> (&'static str, usize, usize, World) {
    let launch = LaunchEnv::from_env()
        .unwrap()
        .expect("a launcher's variables");
    let (rank, n) = (launch.rank, launch.size);
    let mut c = launch
        .config(Device::new(Platform::Host, rank as u32))
        .unwrap();
    c.heap_bytes = Some(1 << 20);
    c.timeout = Duration::from_secs(20);
    let mut w = World::new();
    w.init(&c).unwrap();
    (launch.launcher, rank, n, w)
}

fn ring_pe(launcher: &str) {
    let (from, rank, n, mut w) = join_launched();
    assert_eq!(from, launcher);
    let (buf, sig, _) = common::ring(&mut w, rank, n, 77, 65_536);
    common::all_to_all(&mut w, rank, n, 78, 4, 5000);
    // Host bytes through the TCP bootstrap: rank r offers r * 3000 + 1.
    let offer = |r: usize| common::segment_data(79, r, 0, 0, r * 3000 + 1);
    let all = w.allgather(&offer(rank)).unwrap();
    assert_eq!(all, (0..n).map(offer).collect::<Vec<_>>(), "rank {rank}");
    w.barrier_all().unwrap();
    w.free(sig).unwrap();
    w.free(buf).unwrap();
    assert!(w.finalize().unwrap().leaked.is_empty());
}

/// One process of a world over two named hosts (ranks alternate): pairs
/// on the same host map each other's heaps, pairs across hosts take TCP;
/// all-to-all exchanges and an allgather cross both.
fn hosts_pe() {
    let (_, rank, n, mut w) = join_launched();
    for q in 0..n {
        let want = match (q == rank, q % 2 == rank % 2) {
            (true, _) => Transport::SameProcess,
            (false, true) => Transport::HostSharedMemory,
            (false, false) => Transport::Tcp,
        };
        assert_eq!(w.transport(q).unwrap(), want, "rank {rank} to {q}");
    }
    common::all_to_all(&mut w, rank, n, 81, 5, 40_000);
    let all = w.allgather(&[rank as u8; 3]).unwrap();
    assert_eq!(all, (0..n).map(|r| vec![r as u8; 3]).collect::<Vec<_>>());
    w.barrier_all().unwrap();
    assert!(w.finalize().unwrap().leaked.is_empty());
}

/// A world of one process whose host is named by `XCALL_SHMEM_HOST`:
/// up to 255 bytes on one line joins; a longer name or a second line is
/// refused by name before any bootstrap.
fn named_pe(which: &str) {
    let launch = LaunchEnv::from_env().unwrap().unwrap();
    let mut c = launch.config(Device::new(Platform::Host, 0)).unwrap();
    c.heap_bytes = Some(1 << 20);
    c.timeout = Duration::from_secs(20);
    let mut w = World::new();
    match which {
        "255" => {
            w.init(&c).unwrap();
            w.finalize().unwrap();
        }
        _ => {
            let e = w.init(&c).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "{which}: {e}");
            assert!(e.to_string().contains("XCALL_SHMEM_HOST"), "{which}: {e}");
        }
    }
}

/// A process of a world whose last rank never starts: init times out.
fn orphan_pe() {
    let launch = LaunchEnv::from_env().unwrap().unwrap();
    let mut c = launch
        .config(Device::new(Platform::Host, launch.rank as u32))
        .unwrap();
    c.heap_bytes = Some(1 << 20);
    c.timeout = Duration::from_millis(800);
    let e = World::new().init(&c).unwrap_err();
    assert_eq!(e.status(), Status::Timeout, "rank {}: {e}", launch.rank);
}

#[test]
fn launched_worlds() {
    if let Ok(role) = std::env::var(ROLE_ENV) {
        match role.split_once(':') {
            Some(("ring", launcher)) => ring_pe(launcher),
            _ if role == "hosts" => hosts_pe(),
            Some(("name", which)) => named_pe(which),
            _ => orphan_pe(),
        }
        return;
    }
    for (launcher, n) in [("torchrun", 4), ("mpirun", 2), ("srun", 3)] {
        let port = free_port();
        let role = format!("ring:{launcher}");
        let children = (0..n).map(|r| spawn(launcher, r, n, port, &role)).collect();
        wait_all(
            &format!("{n} PEs under {launcher}"),
            children,
            Duration::from_secs(60),
        );
    }
    // Four processes on two named hosts: shared memory within a host,
    // TCP across.
    let port = free_port();
    let children = (0..4)
        .map(|r| spawn("torchrun", r, 4, port, "hosts"))
        .collect();
    wait_all("4 PEs on 2 named hosts", children, Duration::from_secs(60));
    for which in ["255", "256", "lines"] {
        let port = free_port();
        let child = spawn("torchrun", 0, 1, port, &format!("name:{which}"));
        wait_all(
            &format!("a host name of {which}"),
            vec![child],
            Duration::from_secs(60),
        );
    }
    // Rank 2 of 3 never starts: ranks 0 and 1 both time out, soon.
    let port = free_port();
    let started = Instant::now();
    let children = (0..2)
        .map(|r| spawn("torchrun", r, 3, port, "orphan"))
        .collect();
    wait_all("a world missing rank 2", children, Duration::from_secs(60));
    assert!(started.elapsed() < Duration::from_secs(20));
}
