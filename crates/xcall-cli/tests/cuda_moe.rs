//! `xcall moe --platform cuda` on every visible GPU (one thread per GPU):
//! matches the reference, captures each PE's step once and replays it.

mod common;

use common::{json_path, read_json, run};

#[test]
fn cuda_layer_matches_the_reference_and_replays_graphs() {
    let Some(gpus) = xcall_core::testing::cuda_devices_or_skip("cuda_moe") else {
        return;
    };
    // The f32 run checks every other step, its checks beside the GPU work;
    // factor 0 is dropless (the token-once exchange: its dispatch pulled,
    // the default, and pushed).
    for (dtype, factor, verify, kernels) in [
        ("bf16", "1.25", "every", None),
        ("f32", "0.7", "sample:2", None),
        ("bf16", "0", "every", None),
        ("bf16", "0", "every", Some("steps")),
    ] {
        let path = json_path(&format!(
            "cuda-moe-{dtype}-{factor}-{}",
            kernels.unwrap_or("auto")
        ));
        let steps = 5;
        let steps_arg = steps.to_string();
        let mut args = vec![
            "moe",
            "--platform",
            "cuda",
            "--tokens",
            "2048",
            "--hidden",
            "1024",
            "--experts",
            "8",
            "--topk",
            "2",
            "--dtype",
            dtype,
            "--capacity-factor",
            factor,
            "--steps",
            &steps_arg,
            "--verify",
            verify,
            "--progress-every",
            "0s",
            "--json",
            path.to_str().unwrap(),
        ];
        if let Some(k) = kernels {
            args.extend(["--ep-kernels", k]);
        }
        let (out, stdout) = run(&args);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{stdout}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let j = read_json(&path);
        assert_eq!(j["verification"]["verdict"], "PASS", "{dtype}");
        // 9 steps: the warm-up, 5 timed, 3 instrumented; sample:2 checks
        // steps 0, 2, 4, 6 and 8.
        let checked = if verify == "every" { 9 } else { 5 };
        assert_eq!(j["verification"]["checked_steps"], checked, "{dtype}");
        assert!(stderr.contains("xcall moe: 9/9 steps done"), "{stderr}");
        let memory = &j["memory_bytes"];
        assert_eq!(memory["kind"], "device_in_use");
        // The layer's buffers at least: the symmetric heap, whose slots
        // hold 2 x P x [S, H] per PE (the fused exchange; dropless, the
        // token-once exchange's expert-major rows in and out as much).
        assert_eq!(j["exchange"], if factor == "0" { "token" } else { "fused" });
        if factor == "0" {
            // Above decode sizes several PEs pull unless asked to push;
            // one PE has no peer to pull from.
            let want = match kernels {
                None if gpus > 1 => "pull",
                _ => "steps",
            };
            assert_eq!(j["exchange_per_pe"]["kernels"], want, "{dtype} {kernels:?}");
        }
        let buffers = j["heap_bytes"].as_u64().unwrap();
        let slots = 2 * gpus as u64 * j["slot_rows"].as_u64().unwrap() * 1024;
        assert!(buffers > slots * if dtype == "f32" { 4 } else { 2 }, "{j}");
        assert_eq!(j["dropless"], factor == "0");
        assert!(
            memory["after_warmup"].as_u64().unwrap() > buffers,
            "{memory}"
        );
        assert!(memory["at_end"].as_u64().unwrap() > buffers, "{memory}");
        assert_eq!(j["pes"], gpus as u64);
        assert_eq!(
            j["outcomes"]["captured"], gpus as u64,
            "{dtype}: {}",
            j["outcomes"]
        );
        assert_eq!(
            j["outcomes"]["replayed"],
            (gpus * (steps - 1)) as u64,
            "{dtype}: {}",
            j["outcomes"]
        );
        for g in 0..gpus {
            let s = &j["graph_cache"][format!("cuda:{g}")];
            assert!(s["hits"].as_u64().unwrap() >= (steps - 1) as u64, "{s}");
        }
        assert_eq!(j["dropped_routes"].as_u64().unwrap() > 0, factor == "0.7");
        // Per-phase device times beside byte floors at the copy rate: the
        // floors add up to the step's, and no phase that moves bytes beats
        // its floor by 2x (the marks bracket the phase they name).
        assert!(j["copy_gb_per_s"].as_f64().unwrap() > 100.0, "{j}");
        let phases = j["phases"].as_array().unwrap();
        let floors: f64 = phases.iter().map(|p| p["floor_ms"].as_f64().unwrap()).sum();
        let step_floor = j["step_floor_ms"].as_f64().unwrap();
        assert!((floors - step_floor).abs() <= 1e-9 * step_floor, "{j}");
        for p in phases {
            let (ms, floor) = (p["ms"].as_f64().unwrap(), p["floor_ms"].as_f64().unwrap());
            assert!(ms >= 0.0 && ms >= 0.5 * floor, "{p}");
        }
    }
}

/// Micro-batches fork the token-once step onto a stream each: the
/// captured fork/join replays and matches the reference on every step,
/// and the report times the forked step beside its parts in turn.
#[test]
fn cuda_micro_batches_fork_the_step_and_match_the_reference() {
    let Some(gpus) = xcall_core::testing::cuda_devices_or_skip("cuda_moe") else {
        return;
    };
    for (n, dtype) in [("2", "bf16"), ("3", "fp8")] {
        let path = json_path(&format!("cuda-moe-micro-{n}"));
        let steps = 5;
        let (out, stdout) = run(&[
            "moe",
            "--platform",
            "cuda",
            "--tokens",
            "2047",
            "--hidden",
            "1024",
            "--experts",
            "8",
            "--topk",
            "2",
            "--dtype",
            dtype,
            "--microbatches",
            n,
            "--steps",
            &steps.to_string(),
            "--verify",
            "every",
            "--progress-every",
            "0s",
            "--json",
            path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{stdout}");
        let j = read_json(&path);
        assert_eq!(j["verification"]["verdict"], "PASS", "{n}");
        assert_eq!(j["verification"]["checked_steps"], 9, "{n}");
        assert_eq!(j["outcomes"]["captured"], gpus as u64, "{}", j["outcomes"]);
        assert_eq!(
            j["outcomes"]["replayed"],
            (gpus * (steps - 1)) as u64,
            "{}",
            j["outcomes"]
        );
        let ex = &j["exchange_per_pe"];
        assert_eq!(ex["microbatches"], n.parse::<u64>().unwrap());
        let (forked, in_turn) = (
            ex["forked_step_ms"].as_f64().unwrap(),
            ex["in_turn_step_ms"].as_f64().unwrap(),
        );
        assert!(forked > 0.0 && in_turn > 0.0, "{ex}");
        let hidden = ex["hidden_fraction"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hidden), "{ex}");
    }
}

/// The fused exchange (the permute's stores into the peers' slots, the
/// unpermute's loads from them) and the copy, with a capacity and
/// dropless, on every visible GPU: each matches the reference, each PE's
/// step captured once and replayed. A device named twice is refused.
#[test]
fn fused_and_copied_exchanges_match_the_reference() {
    let Some(gpus) = xcall_core::testing::cuda_devices_or_skip("cuda_moe exchanges") else {
        return;
    };
    for (exchange, factor) in [
        ("fused", "1.25"),
        ("copy", "1.25"),
        ("fused", "0"),
        ("copy", "0"),
    ] {
        let what = format!("--exchange {exchange} --capacity-factor {factor}");
        let path = json_path(&format!("cuda-moe-{exchange}-{factor}"));
        let steps = 4;
        let (out, stdout) = run(&[
            "moe",
            "--platform",
            "cuda",
            "--exchange",
            exchange,
            "--tokens",
            "1024",
            "--hidden",
            "512",
            "--experts",
            "24",
            "--topk",
            "4",
            "--capacity-factor",
            factor,
            "--steps",
            &steps.to_string(),
            "--json",
            path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{what}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{what}\n{stdout}");
        let j = read_json(&path);
        let pes = gpus as u64;
        assert_eq!(j["verification"]["verdict"], "PASS", "{what}");
        assert_eq!(j["verification"]["checked_steps"], steps + 4, "{what}");
        assert_eq!(j["pes"], pes, "{what}");
        assert_eq!(j["exchange"], exchange, "{what}");
        assert_eq!(j["dropless"], factor == "0", "{what}");
        if factor == "0" {
            assert_eq!(j["dropped_routes"], 0, "{what}");
        }
        assert_eq!(j["outcomes"]["captured"], pes, "{what}: {}", j["outcomes"]);
        assert_eq!(
            j["outcomes"]["replayed"],
            pes * (steps - 1),
            "{what}: {}",
            j["outcomes"]
        );
    }
    let (out, _) = run(&["moe", "--platform", "cuda", "--devices", "0,0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(
            "--devices: cuda:0 is named twice (PEs 0 and 1); a world takes one PE per device"
        ),
        "{stderr}"
    );
}

/// Two processes under torchrun's variables, each taking its share of the
/// visible GPUs (one GPU: both take it, reached through CUDA IPC, and the
/// report says they took turns): the token-once exchange (bf16 with two
/// micro-batches, and FP8 dispatch), the fused and the copied exchange
/// match the reference across processes, and each process captures its
/// PE's step once. With two GPUs or more, the same with every pair forced
/// onto NCCL (the copy exchange).
#[test]
fn launched_processes_make_one_cuda_world() {
    let Some(gpus) = xcall_core::testing::gpus_for_processes("cuda_moe launched", 2) else {
        return;
    };
    let mut cases = vec![
        ("token", "auto", vec!["--microbatches", "2"]),
        ("token", "auto", vec!["--dtype", "fp8"]),
        ("fused", "auto", vec![]),
        ("copy", "auto", vec![]),
    ];
    if gpus >= 2 {
        cases.push(("copy", "nccl", vec![]));
    }
    for (i, (exchange, transport, extra)) in cases.into_iter().enumerate() {
        let what = format!("2 processes, --exchange {exchange} {extra:?}, transport {transport}");
        let path = json_path(&format!("cuda-moe-launched-{i}-{exchange}-{transport}"));
        let steps = 4;
        let steps_arg = steps.to_string();
        let mut args = vec![
            "moe",
            "--platform",
            "cuda",
            "--exchange",
            exchange,
            "--tokens",
            "1024",
            "--hidden",
            "512",
            "--experts",
            "8",
            "--steps",
            &steps_arg,
            "--timeout",
            "60s",
            "--json",
            path.to_str().unwrap(),
        ];
        args.extend(extra);
        let outs = common::launch(
            "torchrun",
            2,
            &args,
            &[
                ("XCALL_SHMEM_TRANSPORT", transport),
                ("NCCL_NVLS_ENABLE", "0"),
            ],
        );
        for (r, o) in outs.iter().enumerate() {
            assert!(
                o.status.success(),
                "{what}: process {r}: {}\n{}",
                common::text(&o.stdout),
                common::text(&o.stderr)
            );
        }
        println!("{what}\n{}", common::text(&outs[0].stdout));
        let j = read_json(&path);
        assert_eq!(j["verification"]["verdict"], "PASS", "{what}");
        assert_eq!(j["processes"], 2, "{what}");
        assert_eq!(
            j["remote_transport"],
            if transport == "nccl" {
                serde_json::json!("nccl")
            } else {
                serde_json::Value::Null
            },
            "{what}"
        );
        let per = if gpus >= 2 { gpus / 2 } else { 1 } as u64;
        assert_eq!(j["pes"], 2 * per, "{what}");
        // Distinct GPUs: two PEs take turns on one.
        let shared = gpus < 2;
        assert_eq!(j["gpus"], if shared { 1 } else { 2 * per }, "{what}");
        assert_eq!(
            common::text(&outs[0].stdout).contains("shared GPUs    2 PEs ran on 1 GPU(s)"),
            shared,
            "{what}"
        );
        assert_eq!(
            j["outcomes"]["captured"],
            2 * per,
            "{what}: {}",
            j["outcomes"]
        );
        assert_eq!(
            j["outcomes"]["replayed"],
            2 * per * (steps - 1),
            "{what}: {}",
            j["outcomes"]
        );
    }
}
