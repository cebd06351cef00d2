//! `xcall moe` on Host: the layer runs on SPMT PEs, matches the reference,
//! reports its figures, and refuses bad flags with one line.

mod common;

use common::{json_path, read_json, run};

#[test]
fn host_layer_matches_the_reference_and_reports_json() {
    let path = json_path("moe-host");
    let p = path.to_str().unwrap();
    // The copy exchange: whole slots cross (the byte model below).
    let (out, stdout) = run(&[
        "moe",
        "--tokens",
        "300",
        "--hidden",
        "64",
        "--steps",
        "3",
        "--exchange",
        "copy",
        "--json",
        p,
    ]);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("4 PE(s) (threads)"), "{stdout}");
    assert!(stdout.contains("verification   PASS"), "{stdout}");
    let j = read_json(&path);
    assert_eq!(j["verification"]["verdict"], "PASS");
    assert_eq!(j["verification"]["mismatches"], 0);
    assert_eq!(j["pes"], 4);
    assert_eq!(j["exchange"], "copy");
    // ceil(1.25 * 300 * 2 / 8) rows per expert per PE.
    assert_eq!(j["capacity"], 94);
    // Every timed step of every PE went through the cache (run directly).
    assert_eq!(j["outcomes"]["eager_host"], 12);
    assert_eq!(j["graph_cache"]["host:0"]["eager_host"], 12);
    // dispatch + combine: 4 x 3 slots of 2 experts x 94 rows x 128 bytes.
    assert_eq!(
        j["exchange_bytes_per_step"],
        2.0 * 12.0 * 2.0 * 94.0 * 128.0
    );
    assert!(j["step_ms"]["median"].as_f64().unwrap() > 0.0);
    // Where the time goes: the eight phases in step order, each timed on
    // every PE; no copy reference (and so no floor) on Host.
    let phases = j["phases"].as_array().unwrap();
    let names: Vec<&str> = phases.iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "map",
            "permute",
            "dispatch",
            "dispatch_wait",
            "experts",
            "combine",
            "combine_wait",
            "unpermute"
        ]
    );
    for p in phases {
        let per_pe = p["ms_per_pe"].as_array().unwrap();
        assert_eq!(per_pe.len(), 4, "{p}");
        let slowest = per_pe
            .iter()
            .map(|v| v.as_f64().unwrap())
            .fold(0.0, f64::max);
        assert_eq!(p["ms"].as_f64().unwrap(), slowest, "{p}");
        assert!(p["floor_ms"].is_null(), "{p}");
    }
    assert!(phases[4]["ms"].as_f64().unwrap() > 0.0);
    assert!(j["step_floor_ms"].is_null() && j["copy_gb_per_s"].is_null());
    // The byte model at T = 300, H = 64 bf16 (128-byte rows), E = 8,
    // C = 94 (N = 752 rows), a map of 17 i32 per token.
    let map = 300.0 * 17.0 * 4.0;
    assert_eq!(phases[1]["bytes"], 300.0 * 128.0 + 752.0 * 128.0 + map);
    assert_eq!(phases[4]["bytes"], 2.0 * 752.0 * 128.0);
    // Dispatch and combine move the 3 of 4 slots that go to peers; each
    // PE's own slot stays where permute wrote it.
    for i in [2, 5] {
        assert_eq!(phases[i]["bytes"], 2.0 * 752.0 * 128.0 * 0.75);
    }
    assert_eq!(phases[3]["bytes"], 0.0);
    assert_eq!(
        phases[7]["bytes"],
        map + 300.0 * 8.0 * 4.0 + 600.0 * 128.0 + 300.0 * 128.0
    );
    assert!(
        stdout.contains("4 PE(s) x 7 of 7 step(s) (--verify every)"),
        "{stdout}"
    );
    let v = &j["verification"];
    assert_eq!(
        (v["mode"].as_str(), v["checked_steps"].as_u64()),
        (Some("every"), Some(7))
    );
    assert_eq!(v["total_steps"], 7);
    assert!(v["check_s"].as_f64().unwrap() > 0.0 && v["draw_s"].as_f64().unwrap() > 0.0);
    assert!(j["wall_s"].as_f64().unwrap() > 0.0);
    let tenths = (
        j["step_ms"]["first_tenth"].as_f64(),
        j["step_ms"]["last_tenth"].as_f64(),
    );
    assert!(
        matches!(tenths, (Some(a), Some(b)) if a > 0.0 && b > 0.0),
        "{tenths:?}"
    );
    // Linux says how much memory the process holds.
    assert_eq!(j["memory_bytes"]["kind"], "host_resident");
    let after = j["memory_bytes"]["after_warmup"].as_u64().unwrap();
    assert!(after > 1 << 20, "{after}");
    assert!(stdout.contains("check cost"), "{stdout}");
    assert!(stdout.contains("steady state"), "{stdout}");
}

#[test]
fn verify_picks_the_checked_steps_and_progress_lines_go_to_stderr() {
    // 10 timed steps: 14 in all with the warm-up and the 3 phase steps.
    let moe = |verify: &str, name: &str| {
        let path = json_path(name);
        let (out, stdout) = run(&[
            "moe",
            "--tokens",
            "120",
            "--hidden",
            "32",
            "--steps",
            "10",
            "--capacity-factor",
            "0.6",
            "--verify",
            verify,
            "--progress-every",
            "0s",
            "--json",
            path.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(0), "{verify}: {stdout}\n{stderr}");
        (read_json(&path), stdout, stderr)
    };
    for (verify, checked, verdict) in [
        ("every", 14, "PASS"),
        ("sample:3", 6, "PASS"),
        ("first:2", 2, "PASS"),
        ("off", 0, "OFF"),
    ] {
        let (j, stdout, stderr) = moe(verify, &format!("moe-verify-{}", verify.replace(':', "-")));
        let v = &j["verification"];
        assert_eq!(v["mode"], verify);
        assert_eq!(v["checked_steps"], checked, "{verify}");
        assert_eq!(v["verdict"], verdict, "{verify}");
        assert!(
            stdout.contains(&format!(
                "4 PE(s) x {checked} of 14 step(s) (--verify {verify})"
            )),
            "{stdout}"
        );
        // Not a terminal: a line per step at --progress-every 0s.
        for n in 1..=14 {
            let line = format!("xcall moe: {n}/14 steps done (");
            assert!(stderr.contains(&line), "{line}: {stderr}");
        }
        // The drops count the inputs every step ran on: an unchecked step
        // runs again on the last drawn ones, so with one draw (off) each of
        // the 14 steps drops what step 0's routing drops.
        let dropped = j["dropped_routes"].as_u64().unwrap();
        assert!(dropped > 0, "{verify}");
        if verify == "off" {
            assert_eq!(dropped % 14, 0, "{dropped}");
        }
    }
    let (out, _) = run(&["moe", "--verify", "sample:0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("sample:0 checks nothing; say off"),
        "{stderr}"
    );
}

#[test]
fn host_layer_with_drops_f32_and_other_pe_counts() {
    for (pes, experts, topk, factor, dtype) in [
        ("2", "4", "3", "0.6", "f32"),
        ("1", "3", "1", "1.5", "bf16"),
        ("8", "16", "4", "2.0", "bf16"),
    ] {
        let path = json_path(&format!("moe-{pes}"));
        let (out, stdout) = run(&[
            "moe",
            "--pes",
            pes,
            "--experts",
            experts,
            "--topk",
            topk,
            "--capacity-factor",
            factor,
            "--dtype",
            dtype,
            "--tokens",
            "200",
            "--hidden",
            "32",
            "--steps",
            "2",
            "--seed",
            "9",
            "--json",
            path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{pes} PEs: {stdout}");
        let j = read_json(&path);
        assert_eq!(j["verification"]["verdict"], "PASS", "{pes} PEs");
        let dropped = j["dropped_routes"].as_u64().unwrap();
        assert_eq!(dropped > 0, factor == "0.6", "{pes} PEs: {dropped} dropped");
    }
}

/// Dropless: no route dropped at any PE count, with top-k below and
/// above the experts per PE (the slot holds T * min(k, L) rows), where the
/// default capacity drops routes on the same inputs.
#[test]
fn dropless_layer_drops_nothing_and_reports_its_slots() {
    for (pes, experts, topk, dtype, flag) in [
        ("1", "8", "3", "bf16", "--dropless"),
        ("2", "4", "3", "f32", "--capacity-factor=0"),
        ("3", "6", "1", "bf16", "--dropless"),
        ("4", "8", "2", "f32", "--dropless"),
        ("8", "16", "4", "bf16", "--dropless"),
    ] {
        let common = [
            "moe",
            "--pes",
            pes,
            "--experts",
            experts,
            "--topk",
            topk,
            "--dtype",
            dtype,
            "--tokens",
            "200",
            "--hidden",
            "32",
            "--steps",
            "2",
            "--seed",
            "5",
        ];
        let path = json_path(&format!("moe-dropless-{pes}"));
        let mut args = common.to_vec();
        args.extend([flag, "--json", path.to_str().unwrap()]);
        let (out, stdout) = run(&args);
        assert!(out.status.success(), "{pes} PEs: {stdout}");
        assert!(stdout.contains("dropless: slots of"), "{stdout}");
        assert!(stdout.contains("slot fill"), "{stdout}");
        let j = read_json(&path);
        assert_eq!(j["verification"]["verdict"], "PASS", "{pes} PEs");
        assert_eq!(j["verification"]["mismatches"], 0, "{pes} PEs");
        assert_eq!(j["dropped_routes"], 0, "{pes} PEs");
        assert_eq!(j["dropless"], true);
        assert_eq!(j["capacity_factor"], 0.0);
        let (p, e, k): (u64, u64, u64) = (
            pes.parse().unwrap(),
            experts.parse().unwrap(),
            topk.parse().unwrap(),
        );
        assert_eq!(j["slot_rows"], 200 * k.min(e / p), "{pes} PEs");
        // Every route of every PE-step kept: the fill is routes / rows.
        let fill = j["capacity_fill"].as_f64().unwrap();
        let want = (200 * k) as f64 / (p * 200 * k.min(e / p)) as f64;
        assert!(
            (fill - want).abs() < 1e-9,
            "{pes} PEs: fill {fill}, want {want}"
        );
        // The same inputs with a tight capacity drop routes.
        let mut args = common.to_vec();
        args.extend(["--capacity-factor", "0.5"]);
        let (out, stdout) = run(&args);
        assert!(out.status.success(), "{stdout}");
        assert!(!stdout.contains(" 0 route(s) dropped"), "{stdout}");
    }
}

/// The fused exchange (permute into the peers' slots, unpermute from
/// them) against the copy on the same inputs: both match the reference at
/// every PE count, with a capacity and dropless; fused, dispatch and
/// combine move no bytes, only the routed rows cross and each buffer has
/// `P` slots instead of `2P - 1`.
#[test]
fn fused_and_copied_exchanges_both_match_the_reference() {
    for (pes, experts, topk, mode) in [
        ("2", "4", "3", "--capacity-factor=1.0"),
        ("3", "6", "2", "--dropless"),
        ("5", "10", "4", "--capacity-factor=0.7"),
        ("8", "16", "2", "--dropless"),
    ] {
        let (mut heap, mut slot_bytes) = (Vec::new(), 0.0);
        for exchange in ["fused", "copy"] {
            let path = json_path(&format!("moe-{exchange}-{pes}"));
            let (out, stdout) = run(&[
                "moe",
                "--pes",
                pes,
                "--experts",
                experts,
                "--topk",
                topk,
                mode,
                "--exchange",
                exchange,
                "--tokens",
                "150",
                "--hidden",
                "24",
                "--steps",
                "2",
                "--seed",
                "3",
                "--json",
                path.to_str().unwrap(),
            ]);
            let what = format!("{pes} PEs {mode} {exchange}");
            assert!(out.status.success(), "{what}: {stdout}");
            let j = read_json(&path);
            assert_eq!(j["verification"]["verdict"], "PASS", "{what}");
            assert_eq!(j["verification"]["mismatches"], 0, "{what}");
            assert_eq!(j["exchange"], exchange, "{what}");
            let p: f64 = pes.parse().unwrap();
            let slot = j["slot_rows"].as_f64().unwrap() * 48.0;
            let fill = j["capacity_fill"].as_f64().unwrap();
            let phases = j["phases"].as_array().unwrap();
            let (dispatch, combine) = (&phases[2]["bytes"], &phases[5]["bytes"]);
            let crossing = j["exchange_bytes_per_step"].as_f64().unwrap();
            if exchange == "fused" {
                assert_eq!((dispatch, combine), (&0.0.into(), &0.0.into()), "{what}");
                let want = 2.0 * fill * slot * p * (p - 1.0);
                assert!(
                    (crossing - want).abs() < 1e-6 * want,
                    "{what}: {crossing} vs {want}"
                );
            } else {
                assert!(dispatch.as_f64().unwrap() > 0.0, "{what}");
                assert_eq!(crossing, 2.0 * slot * p * (p - 1.0), "{what}");
            }
            heap.push(j["heap_bytes"].as_f64().unwrap());
            slot_bytes = slot;
        }
        // Two buffers of P - 1 slots fewer (each slot 256-byte aligned
        // already or not: within the alignment of the two buffers).
        let p: f64 = pes.parse().unwrap();
        let saved = heap[1] - heap[0];
        let want = 2.0 * (p - 1.0) * slot_bytes;
        assert!(
            (saved - want).abs() <= 512.0,
            "{pes} PEs: {saved} vs {want}"
        );
    }
}

#[test]
fn bad_flags_are_one_line_and_a_failure() {
    for (args, want) in [
        (
            vec!["--pes", "3"],
            "--experts 8: must be a positive multiple of the 3 PE(s)",
        ),
        (vec!["--pes", "0"], "--pes must be at least 1"),
        (
            vec!["--hidden", "12"],
            "--hidden 12: must be a positive multiple of 8",
        ),
        (vec!["--topk", "9"], "--topk 9: must be in [1, 8]"),
        (vec!["--steps", "0"], "must be at least 1"),
        (
            vec!["--capacity-factor=-1"],
            "--capacity-factor -1: must be positive",
        ),
        (
            vec!["--dropless", "--capacity-factor", "2"],
            "a dropless layer has no capacity",
        ),
        (
            vec!["--tokens", "4000000", "--hidden", "65536"],
            "reduce --tokens or --hidden",
        ),
        (vec!["--dtype", "f16"], "invalid value 'f16'"),
        (
            vec!["--pes", "40", "--experts", "40", "--exchange", "fused"],
            "--exchange fused: at most 32 PEs (one permute segment per PE), not 40",
        ),
        (
            vec!["--devices", "0,0"],
            "--devices names CUDA devices: use it with --platform cuda",
        ),
        // Thousands of threads are refused at once, with the reason.
        (
            vec!["--pes", "1000", "--experts", "1000"],
            "--pes 1000: at most 64 on Host",
        ),
        // A size past usize's products is a size error, not a wrap or a panic.
        (
            vec!["--hidden", "9223372036854775808"],
            "reduce --tokens or --hidden",
        ),
    ] {
        let mut all = vec!["moe"];
        all.extend(&args);
        let (out, _) = run(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("xcall: "), "{stderr}");
        // Semantic errors are usage errors too, like the ones clap finds.
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    }
}

#[test]
fn the_heap_variable_is_honoured_when_large_enough_and_refused_by_name_otherwise() {
    let moe = [
        "moe",
        "--tokens",
        "100",
        "--hidden",
        "32",
        "--steps",
        "1",
        "--exchange",
        "fused",
    ];
    // The heap: the layer's buffers (256-byte aligned) with 2 x 4 slots
    // (fused) of 2 experts x 32 rows x 64 bytes, signal words and 1 MiB
    // to spare.
    for (value, ok, want) in [
        ("64M", true, "verification   PASS"),
        ("64MiB", true, "verification   PASS"),
        (
            "1K",
            false,
            "XCALL_SHMEM_HEAP_BYTES=1024 bytes is less than the 1106816 bytes per PE this shape needs",
        ),
        ("lots", false, "XCALL_SHMEM_HEAP_BYTES=\"lots\" is not a size"),
    ] {
        let out = common::xcall()
            .args(moe)
            .env("XCALL_SHMEM_HEAP_BYTES", value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(if ok { &out.stdout } else { &out.stderr });
        assert_eq!(out.status.code(), Some(if ok { 0 } else { 2 }), "{value}: {text}");
        assert!(text.contains(want), "{value}: {text}");
    }
}

/// `xcall moe` under an address-space limit of 8 GiB, through `sh`'s
/// `ulimit -v`.
fn moe_in_8_gib(args: &[&str]) -> std::process::Output {
    let bin = common::xcall().get_program().to_owned();
    std::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 8388608 && exec \"$0\" moe \"$@\"")
        .arg(bin)
        .args(args)
        .output()
        .expect("run xcall moe under sh")
}

/// Shapes whose host buffers the machine cannot give (here: an address
/// space of 8 GiB, most of it the symmetric heaps) end in one line naming
/// the buffer and its bytes, and exit 1; not an abort of the process.
#[test]
fn host_buffers_that_cannot_be_allocated_are_one_line_and_exit_1() {
    for args in [
        // The per-route exchange: its heaps fit, the CLI's own buffers do
        // not (the token-once exchange's larger heaps fail first).
        &[
            "--tokens",
            "7000000",
            "--hidden",
            "8",
            "--steps",
            "1",
            "--verify",
            "off",
            "--exchange",
            "fused",
        ][..],
        &[
            "--pes",
            "1",
            "--tokens",
            "30000000",
            "--hidden",
            "8",
            "--steps",
            "1",
            "--exchange",
            "fused",
        ],
    ] {
        let out = moe_in_8_gib(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        let line = stderr.trim_end();
        assert!(
            line.starts_with("xcall: cannot allocate PE ") && line.contains(" bytes): "),
            "{args:?}: {stderr}"
        );
        // The size named is the buffer's: a product of the flags' sizes.
        let bytes: u64 = line
            .split(" (")
            .nth(1)
            .and_then(|b| b.split(' ').next())
            .and_then(|b| b.parse().ok())
            .unwrap_or_else(|| panic!("{args:?}: no byte count in {line}"));
        assert!(bytes >= 7_000_000, "{args:?}: {line}");
        assert!(
            out.stdout.is_empty(),
            "{args:?}: a report after the failure"
        );
    }
}

/// A malformed variable of the shmem world is a usage error (exit 2, as
/// the help says) naming it, found before any PE starts: for `moe` and
/// for `bench`, which both start worlds.
#[test]
fn a_malformed_world_variable_is_a_usage_error_naming_it() {
    let long = "h".repeat(300);
    for (name, value, want) in [
        (
            "XCALL_SHMEM_TRANSPORT",
            "bogus",
            "xcall: XCALL_SHMEM_TRANSPORT=\"bogus\" is not a transport policy: auto, nccl (CUDA) or tcp (Host)",
        ),
        (
            "XCALL_SHMEM_HOST",
            long.as_str(),
            "a host's name is one line of 1 to 255 bytes",
        ),
        (
            "XCALL_SHMEM_HOST",
            "node\ntwo",
            "a host's name is one line of 1 to 255 bytes",
        ),
    ] {
        for command in [
            &["moe", "--tokens", "100", "--hidden", "32", "--steps", "1"][..],
            &["bench", "--rounds", "1"],
        ] {
            let out = common::xcall()
                .args(command)
                .env(name, value)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{command:?} {name}: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "{command:?} {name}: {stderr}");
            assert!(
                stderr.starts_with(&format!("xcall: {name}=")) && stderr.contains(want),
                "{command:?} {name}: {stderr}"
            );
            assert!(out.stdout.is_empty(), "{command:?} {name}: work started");
        }
    }
}

#[test]
fn cuda_without_gpus_or_with_too_many_pes_is_refused() {
    let count = if !matches!(
        xcall_core::env::flag(xcall_core::cuda::DISABLE_ENV),
        Ok(None | Some(false))
    ) {
        0
    } else {
        xcall_core::cuda::device_count().unwrap_or(0)
    };
    let too_many = (count + 1).to_string();
    let (out, _) = run(&["moe", "--platform", "cuda", "--pes", &too_many]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // No GPU is a runtime error (1); more PEs than GPUs a usage error (2).
    assert_eq!(
        out.status.code(),
        Some(if count == 0 { 1 } else { 2 }),
        "{stderr}"
    );
    assert!(stderr.starts_with("xcall: --p"), "{stderr}");
    if count == 0 {
        assert!(stderr.contains("--platform cuda"), "{stderr}");
    } else {
        assert!(
            stderr.contains(&format!("only {count} CUDA device(s)")),
            "{stderr}"
        );
    }
}

#[test]
fn an_unwritable_json_path_is_refused_before_any_work() {
    let dir = std::env::temp_dir().join(format!("xcall-json-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("no-such-folder").join("out.json");
    for (path, want) in [
        (missing.to_str().unwrap(), "No such file or directory"),
        // A folder is not a file to write.
        (dir.to_str().unwrap(), "Is a directory"),
    ] {
        let start = std::time::Instant::now();
        // Enough steps that a run reaching its end would take seconds.
        let (out, stdout) = run(&["moe", "--steps", "100000", "--json", path]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{path}: {stderr}");
        assert!(
            stderr.starts_with(&format!("xcall: --json {path}: ")),
            "{stderr}"
        );
        assert!(stderr.contains(want), "{stderr}");
        assert!(stdout.is_empty(), "work started: {stdout}");
        assert!(start.elapsed().as_secs() < 30);
    }
    assert!(!missing.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_run_leaves_no_json_file_behind_and_an_old_one_untouched() {
    let path = json_path("moe-left-alone");
    let p = path.to_str().unwrap();
    // The heap variable refuses the run before the path is touched: no
    // file appears, and an existing one keeps its content.
    let refused = || {
        let out = common::xcall()
            .args(["moe", "--tokens", "100", "--hidden", "32", "--json", p])
            .env("XCALL_SHMEM_HEAP_BYTES", "1K")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
    };
    refused();
    assert!(!path.exists());
    std::fs::write(&path, "old report\n").unwrap();
    refused();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "old report\n");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn xcall_log_sends_lines_to_stderr_only_when_set_and_a_bad_filter_is_a_usage_error() {
    let moe = ["moe", "--tokens", "100", "--hidden", "32", "--steps", "1"];
    let stderr_of = |log: Option<&str>| {
        let mut cmd = common::xcall();
        cmd.args(moe).env_remove("XCALL_LOG");
        if let Some(filter) = log {
            cmd.env("XCALL_LOG", filter);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, quiet) = stderr_of(None);
    assert_eq!(code, Some(0), "{quiet}");
    assert!(
        !quiet.contains("[xcall +"),
        "logging is off by default: {quiet}"
    );

    let (code, lines) = stderr_of(Some("xcall_shmem=debug,xcall_graph=trace"));
    assert_eq!(code, Some(0), "{lines}");
    for rank in 0..4 {
        for pe in 0..4 {
            let mapped = format!(
                " DEBUG xcall_shmem::world::live] init: peer mapped rank={rank} pe={pe} device=host:{rank} peer_device=host:{pe} transport=same_process\n"
            );
            assert!(lines.contains(&mapped), "{mapped}: {lines}");
        }
    }
    let up = " INFO xcall_shmem::world::live] shmem world up bootstrap=";
    assert_eq!(lines.matches(up).count(), 4, "{lines}");
    // The timed step of each of 4 PEs goes through the cache (the report
    // counts them as eager_host): one line each.
    let host_runs = lines
        .matches(" TRACE xcall_graph::cache] eager_host device=host:0 ")
        .count();
    assert_eq!(host_runs, 4, "{lines}");
    assert!(
        lines.lines().all(|l| l.starts_with("[xcall +")),
        "only log lines on stderr (no progress bar): {lines}"
    );

    let (code, err) = stderr_of(Some("xcall_graph=loud"));
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(
        err.trim_end(),
        "xcall: XCALL_LOG: log filter \"xcall_graph=loud\": error parsing level filter: expected one of \"off\", \"error\", \"warn\", \"info\", \"debug\", \"trace\", or a number 0-5"
    );
}

/// The Host experts run vectorized by default and through the pipeline's
/// thread model on request: both pass the reference with the same largest
/// error (the same bytes), with capacity blocks and dropless ragged groups,
/// and the report names the executor.
#[test]
fn both_host_executors_write_the_same_experts() {
    for dropless in [false, true] {
        let mut errors = Vec::new();
        for executor in [None, Some("pipeline"), Some("vectorized")] {
            let path = json_path(&format!("moe-exec-{dropless}-{executor:?}"));
            let mut args = vec![
                "moe",
                "--tokens",
                "200",
                "--hidden",
                "64",
                "--steps",
                "2",
                "--json",
                path.to_str().unwrap(),
            ];
            if dropless {
                args.push("--dropless");
            }
            if let Some(e) = executor {
                args.extend(["--host-executor", e]);
            }
            let (out, stdout) = run(&args);
            assert!(out.status.success(), "{executor:?}: {stdout}");
            let name = executor.unwrap_or("vectorized");
            assert!(
                stdout.contains(&format!("experts        on the Host, {name}")),
                "{stdout}"
            );
            let j = read_json(&path);
            assert_eq!(j["verification"]["verdict"], "PASS", "{executor:?}");
            assert_eq!(j["host_executor"], name);
            errors.push(j["verification"]["max_relative_error"].as_f64().unwrap());
        }
        assert!(errors[0] > 0.0, "{errors:?}");
        assert!(errors.iter().all(|&e| e == errors[0]), "{errors:?}");
    }
}

/// The default exchange is the token-once one: every PE count and FP8
/// dispatch and aligned groups match the reference; with every token
/// routed to every PE (E = P, top-P) each PE stores exactly its T tokens
/// into each of the P - 1 others and gets as many rows back.
#[test]
fn the_token_once_exchange_is_the_default_and_counts_its_bytes() {
    for (pes, extra) in [
        ("1", &["--hidden", "64"][..]),
        ("2", &["--dtype", "fp8", "--hidden", "256"][..]),
        (
            "3",
            &[
                "--align",
                "8",
                "--dtype",
                "f32",
                "--hidden",
                "64",
                "--experts",
                "12",
            ][..],
        ),
        (
            "4",
            &["--experts", "4", "--topk", "4", "--hidden", "64"][..],
        ),
    ] {
        let path = json_path(&format!("moe-token-{pes}"));
        let mut args = vec![
            "moe", "--pes", pes, "--tokens", "300", "--steps", "2", "--json",
        ];
        args.push(path.to_str().unwrap());
        args.extend_from_slice(extra);
        let (out, stdout) = run(&args);
        let what = format!("{pes} PEs {extra:?}");
        assert!(
            out.status.success(),
            "{what}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("verification   PASS"), "{what}: {stdout}");
        assert!(stdout.contains("token-once"), "{what}: {stdout}");
        let j = read_json(&path);
        assert_eq!(j["exchange"], "token", "{what}");
        assert_eq!(j["dropless"], true, "{what}");
        let names: Vec<&str> = j["phases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["dispatch", "experts", "combine"], "{what}");
        let per_pe = j["exchange_per_pe"]["bytes_per_step"].as_f64().unwrap();
        match pes {
            "1" => assert_eq!(per_pe, 0.0, "{what}"),
            // 300 tokens to each of 3 others, 128-byte rows both ways.
            "4" => assert_eq!(per_pe, 300.0 * 3.0 * 2.0 * 128.0, "{what}"),
            _ => assert!(per_pe > 0.0, "{what}"),
        }
        assert_eq!(j["exchange_per_pe"]["fp8_dispatch"], pes == "2", "{what}");
    }
}

/// The token-once exchange's flags are refused where they do not apply.
#[test]
fn token_once_flags_are_refused_elsewhere() {
    for (args, want) in [
        (
            vec!["--dtype", "fp8", "--exchange", "fused"],
            "are for --exchange token",
        ),
        (
            vec!["--align", "4", "--exchange", "copy"],
            "are for --exchange token",
        ),
        (
            vec!["--ep-kernels", "steps", "--exchange", "fused"],
            "are for --exchange token",
        ),
        (
            vec!["--ep-kernels", "low-latency", "--tokens", "2000"],
            "low-latency kernels take at most 1024",
        ),
        (
            vec!["--exchange", "token", "--capacity-factor", "1.5"],
            "--exchange token is dropless",
        ),
        (
            vec!["--dtype", "fp8", "--hidden", "64"],
            "not a multiple of 128",
        ),
        (vec!["--align", "0"], "--align must be at least 1"),
        (
            vec!["--microbatches", "2", "--exchange", "copy"],
            "are for --exchange token",
        ),
        (
            vec!["--microbatches", "0"],
            "--microbatches 0: must be 1 to 8",
        ),
        (
            vec!["--microbatches", "9"],
            "--microbatches 9: must be 1 to 8",
        ),
        (
            vec!["--microbatches", "3", "--tokens", "2"],
            "at most --tokens (2)",
        ),
    ] {
        let mut full = vec!["moe", "--steps", "1"];
        full.extend(&args);
        let (out, _) = run(&full);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
    // A capacity alone picks the fused per-route exchange.
    let path = json_path("moe-capacity-default");
    let (out, _) = run(&[
        "moe",
        "--steps",
        "1",
        "--tokens",
        "64",
        "--hidden",
        "32",
        "--capacity-factor",
        "1.25",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    assert_eq!(read_json(&path)["exchange"], "fused");
}

/// Micro-batches split a PE's tokens into runs, each through its own
/// group: every split (uneven ones, FP8, aligned groups) matches the
/// reference with the very same largest error as the unsplit step (a
/// token's rows are summed in the same order), and the report says how
/// many ran and that a Host step does not fork.
#[test]
fn micro_batches_match_the_unsplit_step() {
    for extra in [
        &["--dtype", "bf16", "--hidden", "64"][..],
        &["--dtype", "fp8", "--hidden", "128", "--align", "4"][..],
    ] {
        let mut errors = Vec::new();
        for n in ["1", "2", "3"] {
            let path = json_path(&format!("moe-micro-{n}-{}", extra[1]));
            let mut args = vec![
                "moe",
                "--pes",
                "3",
                "--tokens",
                "301",
                "--experts",
                "6",
                "--topk",
                "3",
                "--steps",
                "2",
                "--microbatches",
                n,
                "--json",
            ];
            args.push(path.to_str().unwrap());
            args.extend_from_slice(extra);
            let (out, stdout) = run(&args);
            let what = format!("{n} micro-batches {extra:?}");
            assert!(
                out.status.success(),
                "{what}: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let j = read_json(&path);
            assert_eq!(j["verification"]["verdict"], "PASS", "{what}");
            assert_eq!(j["verification"]["checked_steps"], 6, "{what}");
            let ex = &j["exchange_per_pe"];
            assert_eq!(ex["microbatches"], n.parse::<u64>().unwrap(), "{what}");
            assert_eq!(ex["hidden_fraction"], 0.0, "{what}");
            assert!(ex["forked_step_ms"].is_null(), "{what}");
            errors.push(j["verification"]["max_relative_error"].as_f64().unwrap());
        }
        assert!(errors[0] > 0.0, "{errors:?}");
        assert!(
            errors.iter().all(|&e| e == errors[0]),
            "{extra:?}: {errors:?}"
        );
    }
}
