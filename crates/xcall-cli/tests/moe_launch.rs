//! `xcall moe` as processes started the way launchers start them: each
//! process gets torchrun's, Open MPI's or Slurm's variables (and
//! `MASTER_ADDR`/`MASTER_PORT`), runs its own PEs, and the world spans the
//! processes through the TCP bootstrap; process 0 prints the report of
//! the whole world. A watchdog kills every process still running after
//! its limit and fails the test naming them.

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::{free_port, json_path, launch, read_json, spawn, text, wait_all, xcall};

#[test]
fn four_processes_under_torchrun_make_one_world_and_one_report() {
    let path = json_path("moe-launch");
    let p = path.to_str().unwrap();
    let outs = launch(
        "torchrun",
        4,
        &[
            "moe", "--tokens", "200", "--hidden", "64", "--steps", "3", "--json", p,
        ],
        &[],
    );
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "process {r}: {}\n{}",
            text(&o.stdout),
            text(&o.stderr)
        );
    }
    let report = text(&outs[0].stdout);
    assert!(
        report.contains("4 PE(s) (4 processes under torchrun, 1 PE(s) each"),
        "{report}"
    );
    assert!(report.contains("verification   PASS: 4 PE(s)"), "{report}");
    for r in 0..4 {
        assert!(
            report.contains(&format!(
                "graph cache    process {r} host:0: 3 run directly"
            )),
            "{report}"
        );
    }
    for (r, o) in outs.iter().enumerate().skip(1) {
        let line = text(&o.stdout);
        assert!(
            line.starts_with(&format!(
                "xcall moe: process {r} of 4 (torchrun), PE {r} of 4 on host:{r}: verification PASS over the world"
            )),
            "process {r}: {line}"
        );
    }
    // Process 0 wrote the report of every PE; the others wrote nothing.
    let j = read_json(&path);
    assert_eq!(j["processes"], 4);
    // No transport forced: the token-once exchange by default, across
    // processes through shared memory.
    assert_eq!(j["exchange"], "token");
    assert_eq!(j["launcher"], "torchrun");
    assert_eq!(j["pes"], 4);
    assert_eq!(j["remote_transport"], serde_json::Value::Null);
    assert_eq!(j["verification"]["verdict"], "PASS");
    assert_eq!(j["outcomes"]["eager_host"], 12);
    assert_eq!(j["graph_cache"]["process 3 host:0"]["eager_host"], 3);
    assert_eq!(j["phases"][0]["ms_per_pe"].as_array().unwrap().len(), 4);
}

/// Two processes of two PEs each: the PEs of one process are threads of
/// it (direct pairs), the other process's reached through shared memory;
/// both exchanges match the reference; a third run under Open MPI's
/// variables with a dropless layer.
#[test]
fn processes_of_several_pes_under_srun_and_mpirun_match_the_reference() {
    for (launcher, n, extra) in [
        ("srun", 2, &["--pes", "2", "--exchange", "copy"][..]),
        (
            "srun",
            2,
            &["--pes", "2", "--exchange", "fused", "--dtype", "f32"][..],
        ),
        ("mpirun", 3, &["--experts", "6", "--dropless"][..]),
    ] {
        launched(launcher, n, extra, &[]);
    }
}

/// Every pair but a PE with itself through TCP connections (the path of
/// Host PEs on other hosts): the copy exchange goes as one
/// `World::exchange` per phase and matches the reference; the fused one
/// is refused naming the copy.
#[test]
fn tcp_pairs_carry_the_layer_across_processes() {
    let tcp = [("XCALL_SHMEM_TRANSPORT", "tcp")];
    let report = launched("torchrun", 3, &["--experts", "6", "--pes", "2"], &tcp);
    assert!(
        report.contains("copy (whole slots, one World::exchange per phase, through TCP)"),
        "{report}"
    );
    launched("srun", 2, &["--dropless", "--dtype", "f32"], &tcp);
    let outs = launch(
        "torchrun",
        2,
        &[
            "moe",
            "--exchange",
            "fused",
            "--steps",
            "1",
            "--timeout",
            "5s",
        ],
        &tcp,
    );
    for (r, o) in outs.iter().enumerate() {
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "process {r}: {err}");
        assert!(
            err.contains("reached through tcp: use --exchange copy"),
            "process {r}: {err}"
        );
    }
}

/// `n` processes of `xcall moe` with `extra` flags under `launcher`, each
/// succeeding; returns process 0's report.
fn launched(launcher: &str, n: usize, extra: &[&str], envs: &[(&str, &str)]) -> String {
    let mut args = vec!["moe", "--tokens", "150", "--hidden", "32", "--steps", "2"];
    args.extend(extra);
    let outs = launch(launcher, n, &args, envs);
    for (r, o) in outs.iter().enumerate() {
        assert!(
            o.status.success(),
            "{launcher} {extra:?} process {r}: {}\n{}",
            text(&o.stdout),
            text(&o.stderr)
        );
    }
    let report = text(&outs[0].stdout);
    assert!(report.contains("verification   PASS"), "{report}");
    assert!(
        report.contains(&format!("{n} processes under {launcher}")),
        "{report}"
    );
    if extra.starts_with(&["--pes", "2"]) && n == 2 {
        assert!(report.contains("2 PE(s) each"), "{report}");
        let line = text(&outs[1].stdout);
        assert!(
            line.contains("PEs 2..3 of 4 on host:2, host:3: verification PASS"),
            "{line}"
        );
    }
    report
}

/// A process killed mid-run makes every other fail with a message naming
/// what it waited for, within the timeout; a launched process without
/// rank 0's address, and processes that disagree on the PEs each runs,
/// are refused clearly, never a hang.
#[test]
fn a_dying_process_and_bad_launches_fail_every_process_clearly() {
    // Pairs mapped through shared memory, then every pair through TCP.
    for transport in ["auto", "tcp"] {
        a_process_dies(transport);
    }
    bad_launches();
}

/// Process 2 of 3 is killed while they step: the others fail.
fn a_process_dies(transport: &str) {
    let port = free_port();
    let args = [
        "moe",
        "--experts",
        "6",
        "--tokens",
        "100",
        "--hidden",
        "32",
        "--steps",
        "1000000",
        "--verify",
        "off",
        "--timeout",
        "5s",
        "--progress-every",
        "100ms",
    ];
    let env = [("XCALL_SHMEM_TRANSPORT", transport)];
    let mut children: Vec<Child> = (0..3)
        .map(|r| spawn("mpirun", r, 3, port, &args, &env))
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    children[2].kill().expect("kill process 2");
    let killed_at = Instant::now();
    let outs = wait_all(
        "a world losing process 2",
        children,
        Duration::from_secs(60),
    );
    assert!(
        killed_at.elapsed() < Duration::from_secs(20),
        "the survivors took {:?}",
        killed_at.elapsed()
    );
    // Process 0 was stepping when process 2 died.
    let err = text(&outs[0].stderr);
    assert!(err.contains("steps done (timed steps)"), "{err}");
    for (r, o) in outs.iter().enumerate().take(2) {
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{transport}: process {r}: {err}");
        assert!(
            err.contains(&format!("PE {r}:"))
                && (err.contains("left the world")
                    || err.contains("closed the bootstrap")
                    || err.contains("its connection closed")
                    || err.contains("timeout")),
            "{transport}: process {r}: {err}"
        );
    }
}

/// A launched process without rank 0's address, and processes that
/// disagree on the PEs each runs.
fn bad_launches() {
    // No MASTER_ADDR: a usage error naming the variables, at once.
    let out = xcall()
        .env_clear()
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .args(["moe", "--steps", "1"])
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("torchrun started this process as rank 1 of 2")
            && err.contains("MASTER_ADDR and MASTER_PORT"),
        "{err}"
    );

    // Process 1 runs 2 PEs, process 0 one: the worlds' sizes disagree and
    // neither waits past its timeout.
    let port = free_port();
    let started = Instant::now();
    let children = (0..2)
        .map(|r| {
            let pes = (r + 1).to_string();
            spawn(
                "torchrun",
                r,
                2,
                port,
                &["moe", "--pes", &pes, "--steps", "1", "--timeout", "2s"],
                &[],
            )
        })
        .collect();
    let outs = wait_all(
        "processes disagreeing on --pes",
        children,
        Duration::from_secs(60),
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    for (r, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "process {r} succeeded");
        let err = text(&o.stderr);
        assert!(err.contains("shmem init"), "process {r}: {err}");
    }
}
