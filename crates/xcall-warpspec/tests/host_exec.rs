//! The Host executor against plain loops, and its watchdog.

mod common;

use std::time::Duration;

use common::{decode, encode, random_bytes};

use xcall_core::DType;
use xcall_warpspec::host::{self, HostError};
use xcall_warpspec::ops::{
    check_scales, mul_host, silu_scale_f32, silu_scale_host, GroupScales, HostExecutor, OpConfig,
    OpError, Scale,
};
use xcall_warpspec::{Action, BarrierKind, PipelinePlan, PipelineSpec, PipelineState};

/// Both Host executors: every result test runs each.
const EXECUTORS: [HostExecutor; 2] = [HostExecutor::Vectorized, HostExecutor::Pipeline];

/// The plain-loop reference: decode, compute in f32, round to the dtype.
fn reference(dtype: DType, inputs: &[&[u8]], f: impl Fn(&[f32]) -> f32) -> Vec<u8> {
    let decoded: Vec<Vec<f32>> = inputs.iter().map(|b| decode(dtype, b)).collect();
    let out: Vec<f32> = (0..decoded[0].len())
        .map(|i| f(&decoded.iter().map(|d| d[i]).collect::<Vec<_>>()))
        .collect();
    encode(dtype, &out)
}

#[test]
fn mul_and_silu_match_plain_loops_with_tails() {
    let configs = [
        OpConfig {
            stages: 1,
            tile_bytes: 256,
            compute_warpgroups: 1,
        },
        OpConfig {
            stages: 2,
            tile_bytes: 1024,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 4,
            tile_bytes: 4096,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 3,
            tile_bytes: 48,
            compute_warpgroups: 1,
        },
    ];
    let mut seed = 1;
    for (dtype, exec) in [DType::F32, DType::Bf16]
        .into_iter()
        .flat_map(|d| EXECUTORS.map(|e| (d, e)))
    {
        for config in &configs {
            for n in [1usize, 7, 63, 1000, 4099, 20_001] {
                seed += 1;
                let a = random_bytes(dtype, n, seed);
                let b = random_bytes(dtype, n, seed + 100);
                let mut out = vec![0xa5u8; a.len()]; // poisoned
                mul_host(dtype, &a, &b, &mut out, config, exec).unwrap();
                assert_eq!(
                    out,
                    reference(dtype, &[&a, &b], |v| v[0] * v[1]),
                    "mul {dtype} {exec:?} {config:?} n={n}"
                );
                let mut out = vec![0xa5u8; a.len()];
                silu_scale_host(dtype, &a, Scale::One(0.75), &mut out, config, exec).unwrap();
                assert_eq!(
                    out,
                    reference(dtype, &[&a], |v| silu_scale_f32(v[0], 0.75)),
                    "silu {dtype} {exec:?} {config:?} n={n}"
                );
            }
        }
    }
}

/// The vectorized path writes what the pipeline model writes, bit for
/// bit, on random data (with infinities, NaN and signed zeros mixed in)
/// of several shapes: sizes that split over threads (above 2^18 elements)
/// and blocks, tails, configs of every shape, one scale and per-group
/// scales.
#[test]
fn the_vectorized_path_writes_what_the_pipeline_writes() {
    let config = |stages, tile_bytes, compute_warpgroups| OpConfig {
        stages,
        tile_bytes,
        compute_warpgroups,
    };
    let mut seed = 900;
    for (dtype, n, config, per_group) in [
        (DType::F32, 600_001usize, OpConfig::default(), 1000usize),
        (DType::Bf16, (1 << 19) + 2049, config(3, 1024, 1), 4096),
        (DType::F32, 2047, config(1, 48, 1), 92),
        (DType::Bf16, 5, config(2, 256, 2), 5),
        (DType::Bf16, 70_000, config(4, 16 * 1024, 2), 7000),
    ] {
        seed += 1;
        let mut v = decode(DType::F32, &random_bytes(DType::F32, n, seed));
        for (i, special) in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            90.0,
            -90.0,
        ]
        .into_iter()
        .enumerate()
        {
            v[(i * 7919) % n] = special;
        }
        let a = encode(dtype, &v);
        let b = random_bytes(dtype, n, seed + 1);
        let groups = n.div_ceil(per_group);
        let x = &a[..(n / per_group).max(1) * per_group * dtype.size_bytes()];
        let scales: Vec<f32> = (0..groups).map(|g| 0.25 + g as f32 * 0.125).collect();
        let run = |exec: HostExecutor| {
            let mut outs = [
                vec![0xa5u8; a.len()],
                vec![0xa5u8; a.len()],
                vec![0xa5u8; x.len()],
            ];
            mul_host(dtype, &a, &b, &mut outs[0], &config, exec).unwrap();
            silu_scale_host(dtype, &a, Scale::One(1.5), &mut outs[1], &config, exec).unwrap();
            let grouped = Scale::PerGroup {
                scales: &scales[..x.len() / (per_group * dtype.size_bytes())],
                group_bytes: per_group * dtype.size_bytes(),
            };
            silu_scale_host(dtype, x, grouped, &mut outs[2], &config, exec).unwrap();
            outs
        };
        let (fast, model) = (run(HostExecutor::Vectorized), run(HostExecutor::Pipeline));
        for (k, what) in ["mul", "silu", "grouped silu"].into_iter().enumerate() {
            assert!(
                fast[k] == model[k],
                "{what} {dtype} n={n} {config:?}: the paths differ"
            );
            assert!(!fast[k].iter().all(|&b| b == 0xa5), "{what}: written");
        }
    }
}

/// One scale per group of elements: every element takes its group's scale,
/// whatever the tile size (groups ending mid-tile, groups smaller than a
/// tile).
#[test]
fn grouped_scales_match_a_plain_loop() {
    let mut seed = 500;
    for (dtype, exec) in [DType::F32, DType::Bf16]
        .into_iter()
        .flat_map(|d| EXECUTORS.map(|e| (d, e)))
    {
        for (per_group, groups, tile_bytes) in
            [(40usize, 7usize, 256u32), (8, 50, 4096), (1000, 3, 48)]
        {
            seed += 1;
            let x = random_bytes(dtype, per_group * groups, seed);
            let scales: Vec<f32> = (0..groups).map(|g| 1.0 + g as f32 * 0.5).collect();
            let config = OpConfig {
                stages: 2,
                tile_bytes,
                compute_warpgroups: 2,
            };
            let mut out = vec![0xa5u8; x.len()]; // poisoned
            silu_scale_host(
                dtype,
                &x,
                Scale::PerGroup {
                    scales: &scales,
                    group_bytes: per_group * dtype.size_bytes(),
                },
                &mut out,
                &config,
                exec,
            )
            .unwrap();
            let want: Vec<f32> = decode(dtype, &x)
                .iter()
                .enumerate()
                .map(|(i, &v)| silu_scale_f32(v, scales[i / per_group]))
                .collect();
            assert_eq!(
                out,
                encode(dtype, &want),
                "{dtype} {exec:?} {groups} x {per_group}"
            );
        }
    }
}

#[test]
fn bad_group_scales_are_refused() {
    for exec in EXECUTORS {
        bad_group_scales_are_refused_by(exec);
    }
}

fn bad_group_scales_are_refused_by(exec: HostExecutor) {
    let c = OpConfig::default();
    let x = [0u8; 64];
    let mut out = [0u8; 64];
    let grouped = |scales: &[f32], group_bytes: usize, out: &mut [u8]| {
        silu_scale_host(
            DType::F32,
            &x[..out.len()],
            Scale::PerGroup {
                scales,
                group_bytes,
            },
            out,
            &c,
            exec,
        )
    };
    for (scales, group_bytes, want) in [
        (&[1.0f32; 4][..], 0usize, "do not divide"),
        (&[1.0; 4][..], 24, "do not divide"),
        (&[1.0; 8][..], 8, "a multiple of 16"),
        (&[1.0; 3][..], 16, "3 scales for 4 groups"),
        (&[1.0; 5][..], 16, "5 scales for 4 groups"),
    ] {
        let e = grouped(scales, group_bytes, &mut out).unwrap_err();
        assert!(matches!(e, OpError::Input(_)), "{e}");
        assert!(e.to_string().contains(want), "{group_bytes}: {e}");
        assert_eq!(out, [0u8; 64], "nothing written");
    }
    // One group of any size is the whole buffer.
    let mut odd = [0u8; 12];
    grouped(&[2.0], 12, &mut odd).unwrap();
}

/// Grouped scales by address (what the C ABI and CUDA take): known
/// answers for the count, and each refusal with its kind.
#[test]
fn scales_by_address_are_checked_before_use() {
    let at = |addr: u64, group_bytes: u64| GroupScales { addr, group_bytes };
    // 256 output bytes at 0x2000 in f32 (4-byte) elements.
    let check = |s: GroupScales, bytes: u64, elem: u64| check_scales(&s, bytes, elem, 0x2000);
    assert_eq!(check(at(0x1000, 64), 256, 4).unwrap(), 4);
    assert_eq!(check(at(0x1000, 16), 256, 2).unwrap(), 16);
    // One group of any whole number of elements is the whole buffer.
    assert_eq!(check(at(0x1000, 12), 12, 4).unwrap(), 1);
    // Scales right before or right after the output touch no byte of it.
    assert_eq!(check(at(0x2000 - 16, 64), 256, 4).unwrap(), 4);
    assert_eq!(check(at(0x2100, 64), 256, 4).unwrap(), 4);
    // An empty buffer has no groups and overlaps nothing.
    assert_eq!(check(at(0x2000, 16), 0, 4).unwrap(), 0);
    for (s, bytes, elem, want) in [
        (at(0x1002, 64), 256, 4, "4-byte aligned"),
        (at(0x1000, 0), 256, 4, "do not divide"),
        (at(0x1000, 96), 256, 4, "do not divide"),
        (at(0x1000, 8), 256, 4, "a multiple of 16"),
        (at(0x1000, 6), 6, 4, "split 4-byte elements"),
        (at(0x2000 - 12, 64), 256, 4, "overlaps the scales"),
        (at(0x20fc, 64), 256, 4, "overlaps the scales"),
        (at(0x2000, 256), 256, 4, "overlaps the scales"),
        (at(u64::MAX - 7, 16), 256, 4, "end of the address space"),
    ] {
        let e = check(s, bytes, elem).unwrap_err();
        assert!(matches!(e, OpError::Input(_)), "{s:?}: {e}");
        assert!(e.to_string().contains(want), "{s:?}: {e}");
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument);
    }
    let e = check(at(0, 64), 256, 4).unwrap_err();
    assert!(matches!(e, OpError::Null(_)), "{e}");
    assert_eq!(e.status(), xcall_core::Status::NullArgument);
}

#[test]
fn silu_definition_matches_an_independent_formula() {
    for x in [-20.0f32, -3.5, -1.0, -0.0, 0.0, 0.5, 2.0, 30.0] {
        let sigmoid = 1.0 / (1.0 + (-(x as f64)).exp());
        let want = (x as f64 * sigmoid * 1.5) as f32;
        assert!(
            (silu_scale_f32(x, 1.5) - want).abs() <= 1e-6 * want.abs().max(1.0),
            "x={x}"
        );
    }
}

#[test]
fn bad_inputs_are_refused() {
    for exec in EXECUTORS {
        bad_inputs_are_refused_by(exec);
    }
}

fn bad_inputs_are_refused_by(exec: HostExecutor) {
    let c = OpConfig::default();
    let mut out = vec![0u8; 8];
    let err = mul_host(DType::F32, &[0u8; 8], &[0u8; 4], &mut out, &c, exec).unwrap_err();
    assert!(err.to_string().contains("input 1 has 4 bytes"), "{err}");
    // A dtype the ops do not take is UNSUPPORTED (f16 too), not a bad input.
    for dtype in [DType::I32, DType::F16] {
        let e = mul_host(dtype, &[0u8; 8], &[0u8; 8], &mut out, &c, exec).unwrap_err();
        assert!(matches!(e, OpError::Unsupported(_)), "{e}");
        assert_eq!(e.status(), xcall_core::Status::Unsupported);
    }
    assert!(matches!(
        silu_scale_host(
            DType::F32,
            &[0u8; 6],
            Scale::One(1.0),
            &mut [0u8; 6],
            &c,
            exec
        ),
        Err(OpError::Input(_))
    ));
    let odd = OpConfig {
        tile_bytes: 40,
        ..c
    };
    assert!(matches!(
        mul_host(DType::F32, &[0u8; 8], &[0u8; 8], &mut out, &odd, exec),
        Err(OpError::Plan(_))
    ));
    // Nothing to do is not an error.
    mul_host(DType::F32, &[], &[], &mut [], &c, exec).unwrap();
    // ...but a config the pipeline cannot have is, at every size.
    let none = OpConfig {
        stages: 0,
        tile_bytes: 0,
        compute_warpgroups: 0,
    };
    for bytes in [0usize, 16 * 1024] {
        let (x, mut out) = (vec![0u8; bytes], vec![0xa5u8; bytes]);
        let e =
            silu_scale_host(DType::F32, &x, Scale::One(1.0), &mut out, &none, exec).unwrap_err();
        assert!(matches!(e, OpError::Plan(_)), "{exec:?} {bytes} bytes: {e}");
        assert!(out.iter().all(|&b| b == 0xa5), "nothing written");
    }
}

#[test]
fn the_watchdog_reports_every_roles_wait() {
    // EMPTY barriers that need 3 warpgroups' arrivals while one releases them:
    // the producer can never reuse a stage.
    let mut plan = PipelinePlan::new(&PipelineSpec::new(2, &[64], 1)).unwrap();
    for b in plan
        .barriers
        .iter_mut()
        .filter(|b| b.kind == xcall_warpspec::BarrierKind::Empty)
    {
        b.init_count = 3 * 128;
    }
    let data = vec![1u8; 64 * 6];
    let err = host::run(&plan, &[&data], Duration::from_millis(300), |_| {}).unwrap_err();
    let HostError::Stalled { waits, .. } = &err else {
        panic!("{err}")
    };
    assert!(
        waits[0].contains(
            "producer w0 (iteration 2) waits EMPTY[w0][s0] parity 0 (barrier in phase 0)"
        ),
        "{err}"
    );
    assert!(
        waits[1]
            .contains("compute wg0 (iteration 2) waits FULL[w0][s0] parity 1 (barrier in phase 1)"),
        "{err}"
    );
}

#[test]
fn sources_must_fit_the_plan() {
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[64, 64], 1)).unwrap();
    let err = host::run(&plan, &[&[0u8; 64]], Duration::from_secs(1), |_| {}).unwrap_err();
    assert!(
        err.to_string().contains("1 sources for 2 async warps"),
        "{err}"
    );
    let err = host::run(
        &plan,
        &[&[0u8; 64], &[0u8; 200]],
        Duration::from_secs(1),
        |_| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("different tile counts"), "{err}");
}

#[test]
fn the_executor_follows_the_roles_groups_and_starts() {
    // Warp 1's producer pointed at warp 0's FULL barriers (as a planner
    // sharing one barrier would): each producer completes a phase of its
    // own there, so warp 0's FULL runs ahead of compute's walk and warp 1's
    // never completes; compute stalls on one of them, whichever it reaches
    // first.
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[64, 64], 1)).unwrap();
    let full0 = plan.group(BarrierKind::Full, 0).unwrap();
    let mut shared = plan.clone();
    for action in &mut shared.roles[1].body {
        if let Action::ArriveExpectTx { group, .. } | Action::Copy { group, .. } = action {
            *group = full0;
        }
    }
    let data = vec![3u8; 64 * 4];
    let err = host::run(&shared, &[&data, &data], Duration::from_millis(300), |_| {}).unwrap_err();
    assert!(matches!(err, HostError::Stalled { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("compute wg0 (iteration 0) waits FULL[w"),
        "{err}"
    );
    // Producers starting on the consumers' parity wait for a release of a
    // fresh EMPTY barrier that only compute could give, and compute waits
    // for their data: the executor follows the plan's start states.
    let mut late = plan.clone();
    for role in &mut late.roles[..2] {
        role.start = PipelineState::CONSUMER_START;
    }
    let err = host::run(&late, &[&data, &data], Duration::from_millis(300), |_| {}).unwrap_err();
    assert!(
        err.to_string()
            .contains("producer w0 (iteration 0) waits EMPTY[w0][s0] parity 0"),
        "{err}"
    );
    host::run(&plan, &[&data, &data], Duration::from_secs(10), |_| {}).unwrap();
    // Tables that index nothing are refused before any thread starts.
    let mut broken = plan.clone();
    broken.roles[2].body.push(Action::Read { buffer: 7 });
    let err = host::run(&broken, &[&data, &data], Duration::from_secs(1), |_| {}).unwrap_err();
    assert!(matches!(err, HostError::Input(_)), "{err}");
}

/// Ragged groups through `run` on the Host, against a loop over rows:
/// each row's group found by walking its segment's counts, rows past the
/// groups keep the poison.
#[test]
fn ragged_groups_match_a_loop_over_rows_and_leave_the_rest() {
    use xcall_core::Device;
    use xcall_warpspec::codegen::ElementwiseOp;
    use xcall_warpspec::cuda::Variant;
    use xcall_warpspec::ops::RaggedGroups;
    use xcall_warpspec::OpCall;
    let mut seed = 700;
    // (dtype, row elements, rows per segment, counts per segment)
    for (dtype, row, seg_rows, counts, host) in [
        (
            DType::F32,
            8usize,
            10usize,
            vec![vec![3i64, 0, 4], vec![0, 0, 0], vec![10, 0, 0]],
        ),
        (DType::Bf16, 24, 7, vec![vec![1, 2, 3, 1]]),
        (DType::Bf16, 8, 5, vec![vec![0, 2], vec![5, 0], vec![1, 1]]),
    ]
    .into_iter()
    .flat_map(|case| EXECUTORS.map(|e| (case.clone(), e)))
    .map(|((d, r, s, c), e)| (d, r, s, c, e))
    {
        seed += 1;
        let (segments, groups) = (counts.len(), counts[0].len());
        let row_bytes = row * dtype.size_bytes();
        let bytes = segments * seg_rows * row_bytes;
        let x = random_bytes(dtype, bytes / dtype.size_bytes(), seed);
        let rows: Vec<i64> = counts.concat();
        let scales: Vec<f32> = (0..rows.len()).map(|g| 0.75 + g as f32 * 0.5).collect();
        let mut out = vec![0xa5u8; bytes];
        let ragged = RaggedGroups {
            scales: scales.as_ptr() as u64,
            rows: rows.as_ptr() as u64,
            segments: segments as u64,
            groups: groups as u64,
            segment_bytes: (seg_rows * row_bytes) as u64,
            row_bytes: row_bytes as u64,
        };
        let inputs = [x.as_ptr() as u64];
        let call = OpCall {
            sms: 0,
            device: Device::HOST,
            stream: std::ptr::null_mut(),
            op: ElementwiseOp::SiluScale,
            dtype,
            config: OpConfig {
                stages: 2,
                tile_bytes: 64,
                compute_warpgroups: 2,
            },
            variant: Variant::WarpSpecialized,
            host,
            inputs: &inputs,
            output: out.as_mut_ptr() as u64,
            bytes: bytes as u64,
            scale: 99.0,
            scales: None,
            ragged: Some(ragged),
        };
        // SAFETY: host buffers of the sizes the call names.
        unsafe { xcall_warpspec::run(&call) }.unwrap();
        let xs = decode(dtype, &x);
        let mut want = vec![0xa5u8; bytes];
        for s in 0..segments {
            for r in 0..seg_rows {
                // The group holding row r: the first whose running count passes it.
                let mut total = 0;
                let group = counts[s].iter().position(|&c| {
                    total += c as usize;
                    r < total
                });
                let Some(g) = group else { continue };
                let first = (s * seg_rows + r) * row;
                let vals: Vec<f32> = xs[first..first + row]
                    .iter()
                    .map(|&v| silu_scale_f32(v, scales[s * groups + g]))
                    .collect();
                want[first * dtype.size_bytes()..(first + row) * dtype.size_bytes()]
                    .copy_from_slice(&encode(dtype, &vals));
            }
        }
        assert_eq!(out, want, "{dtype} {host:?} {counts:?}");
    }
}

/// Ragged groups' checks: each refusal with its kind, nothing written.
#[test]
fn bad_ragged_groups_are_refused() {
    use xcall_warpspec::ops::{check_ragged, ragged_pieces, RaggedGroups, MAX_RAGGED_GROUPS};
    let ok = RaggedGroups {
        scales: 0x1000,
        rows: 0x1800,
        segments: 2,
        groups: 3,
        segment_bytes: 320,
        row_bytes: 32,
    };
    // 640 output bytes at 0x4000.
    let check = |r: RaggedGroups| check_ragged(&r, 640, 0x4000);
    assert_eq!(check(ok).unwrap(), 6);
    for (r, want) in [
        (
            RaggedGroups {
                scales: 0x1002,
                ..ok
            },
            "4-byte aligned",
        ),
        (RaggedGroups { rows: 0x1804, ..ok }, "8-byte aligned"),
        (
            RaggedGroups {
                segments: 0,
                segment_bytes: 0,
                ..ok
            },
            "at least 1",
        ),
        (RaggedGroups { groups: 0, ..ok }, "at least 1"),
        (
            RaggedGroups {
                segments: 1,
                groups: MAX_RAGGED_GROUPS + 1,
                segment_bytes: 640,
                ..ok
            },
            "at most 1024",
        ),
        (
            RaggedGroups {
                groups: u64::MAX,
                ..ok
            },
            "at most 1024",
        ),
        (
            RaggedGroups { row_bytes: 0, ..ok },
            "positive multiple of 16",
        ),
        (
            RaggedGroups {
                row_bytes: 40,
                segment_bytes: 320,
                ..ok
            },
            "positive multiple of 16",
        ),
        (
            RaggedGroups {
                row_bytes: 48,
                ..ok
            },
            "divides a segment",
        ),
        (
            RaggedGroups {
                segment_bytes: 160,
                ..ok
            },
            "do not make the buffer's 640 bytes",
        ),
        (
            RaggedGroups {
                scales: 0x4000 - 20,
                ..ok
            },
            "overlaps the scales",
        ),
        (
            RaggedGroups {
                rows: 0x4000 + 632,
                ..ok
            },
            "overlaps the row counts",
        ),
        (
            RaggedGroups {
                rows: u64::MAX - 15,
                ..ok
            },
            "end of the address space",
        ),
    ] {
        let e = check(r).unwrap_err();
        assert!(matches!(e, OpError::Input(_)), "{r:?}: {e}");
        assert!(e.to_string().contains(want), "{r:?}: {e}");
    }
    for r in [
        RaggedGroups { scales: 0, ..ok },
        RaggedGroups { rows: 0, ..ok },
    ] {
        assert!(matches!(check(r), Err(OpError::Null(_))), "{r:?}");
    }
    // Counts read when the op runs: negative, or passing the segment.
    let scales = [1.0f32; 6];
    for (rows, want) in [
        ([1i64, -1, 0, 0, 0, 0], "has -1 rows"),
        ([4, 4, 3, 0, 0, 0], "passes the segment's 320 bytes"),
        ([0, 0, 0, 0, 11, 0], "passes the segment's 320 bytes"),
        ([0, 0, 0, i64::MAX, 0, 0], "passes the segment's 320 bytes"),
    ] {
        let e = ragged_pieces(&ok, &rows, &scales).unwrap_err();
        assert!(e.to_string().contains(want), "{rows:?}: {e}");
    }
    // Exactly full segments are fine: 10 rows of 32 bytes.
    let pieces = ragged_pieces(&ok, &[4, 0, 6, 0, 10, 0], &scales).unwrap();
    assert_eq!(
        pieces.iter().map(|p| p.0.clone()).collect::<Vec<_>>(),
        [0..128, 128..320, 320..640]
    );
}

/// A config the pipeline cannot have is refused by `run` (what the C ABI
/// calls) before anything runs, at every size (an empty buffer included),
/// with one scale, per-group scales or ragged groups, on either executor.
#[test]
fn a_bad_config_is_refused_by_run_at_every_size() {
    use xcall_core::Device;
    use xcall_warpspec::codegen::ElementwiseOp;
    use xcall_warpspec::cuda::Variant;
    use xcall_warpspec::ops::RaggedGroups;
    use xcall_warpspec::OpCall;
    let none = OpConfig {
        stages: 0,
        tile_bytes: 0,
        compute_warpgroups: 0,
    };
    let (scales, rows) = ([1.0f32; 64], [0i64; 8]);
    for (host, bytes, form) in EXECUTORS
        .into_iter()
        .flat_map(|e| [0usize, 16 * 1024].map(|b| (e, b)))
        .flat_map(|(e, b)| [0, 1, 2].map(|f| (e, b, f)))
    {
        let x = vec![0x3fu8; bytes];
        let mut out = vec![0xa5u8; bytes];
        let inputs = [x.as_ptr() as u64];
        let grouped = GroupScales {
            addr: scales.as_ptr() as u64,
            group_bytes: 16 * 1024,
        };
        let ragged = RaggedGroups {
            scales: scales.as_ptr() as u64,
            rows: rows.as_ptr() as u64,
            segments: 1,
            groups: 1,
            segment_bytes: bytes as u64,
            row_bytes: 16,
        };
        let call = OpCall {
            sms: 0,
            device: Device::HOST,
            stream: std::ptr::null_mut(),
            op: ElementwiseOp::SiluScale,
            dtype: DType::F32,
            config: none,
            variant: Variant::WarpSpecialized,
            host,
            inputs: &inputs,
            output: out.as_mut_ptr() as u64,
            bytes: bytes as u64,
            scale: 1.0,
            scales: (form == 1).then_some(grouped),
            ragged: (form == 2).then_some(ragged),
        };
        // SAFETY: host buffers of the sizes the call names.
        let e = unsafe { xcall_warpspec::run(&call) }.unwrap_err();
        assert!(
            matches!(e, OpError::Plan(_)),
            "{host:?} {bytes} bytes, form {form}: {e}"
        );
        assert_eq!(e.status(), xcall_core::Status::InvalidArgument, "{e}");
        assert!(out.iter().all(|&b| b == 0xa5), "nothing written");
    }
}
