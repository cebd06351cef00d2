//! What the generator emits, checked without a GPU.

use xcall_core::DType;
use xcall_warpspec::codegen::{generate, generate_plain, ElementwiseOp};
use xcall_warpspec::ops::OpConfig;
use xcall_warpspec::{Action, BarrierKind, PipelinePlan, PipelineSpec, PlanError};

#[test]
fn generated_source_follows_the_plan() {
    let config = OpConfig {
        stages: 3,
        tile_bytes: 8192,
        compute_warpgroups: 2,
    };
    let plan = config.plan(2).unwrap();
    let k = generate(&plan, ElementwiseOp::Mul, DType::Bf16).unwrap();
    assert_eq!(k.name, "xcall_ws_mul_bf16");
    assert_eq!(k.threads, 384);
    assert_eq!(k.smem_bytes, plan.smem_bytes);
    for needle in [
        "fence.mbarrier_init.release.cluster;",
        "mbarrier.inval.shared::cta.b64",
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
        "mbarrier.arrive.expect_tx.shared::cta.b64",
        "setmaxnreg.dec.sync.aligned.u32 40;",
        "setmaxnreg.inc.sync.aligned.u32 232;",
        "__launch_bounds__(384, 1)",
        "#define STAGES 3u",
        "mbar_init(smem_addr(smem + FULL_OFF[i]), FULL_INIT[i]);",
        "mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT[i]);",
        "EMPTY_INIT[6] = {256, 256, 256, 256, 256, 256}",
        "FULL_INIT[6] = {1, 1, 1, 1, 1, 1}",
        "#define PRODUCER_PHASE 1u",
        "#define CONSUMER_PHASE 0u",
    ] {
        assert!(k.source.contains(needle), "missing {needle:?}");
    }
    // The four verbs of a stage wrap the barrier operations, with the
    // state's parity on both waits.
    for verb in [
        "void producer_acquire(u32 empty, const PipelineState &st) {\n    mbar_wait(empty, st.phase);\n}",
        "    if (bytes) {\n        bulk_load_arrive(buf, src, bytes, full);\n    } else {\n        mbar_arrive(full);\n    }",
        // xcall-core's: expect_tx, then the copy.
        "    mbar_arrive_expect_tx(bar, bytes);\n    bulk_load(dst, src, bytes, bar);",
        "void consumer_wait(u32 full, const PipelineState &st) {\n    mbar_wait(full, st.phase);\n}",
        "void consumer_release(u32 empty) {\n    mbar_arrive(empty);\n}",
    ] {
        assert!(k.source.contains(verb), "missing {verb:?}");
    }
    // The plan's barrier offsets are what the kernel uses.
    let full: Vec<String> = (0..2)
        .flat_map(|w| (0..3).map(move |s| (w, s)))
        .map(|(w, s)| {
            let g = plan.group(BarrierKind::Full, w).unwrap();
            plan.barriers[plan.groups[g].barriers[s]].offset.to_string()
        })
        .collect();
    assert!(k
        .source
        .contains(&format!("FULL_OFF[6] = {{{}}}", full.join(", "))));
    // __syncthreads only outside the role branches: in the kernel, after
    // init and before inval; the ragged groups' table (whose helper
    // synchronizes too) is built before the roles split.
    let body = &k.source[k.source.find("extern \"C\" __global__").unwrap()..];
    assert_eq!(body.matches("__syncthreads()").count(), 2);
    let table = body.find("ragged_table(p, tab, TILE)").unwrap();
    assert!(table < body.find("if (tid < PRODUCER_THREADS)").unwrap());
    let one_wg = OpConfig {
        compute_warpgroups: 1,
        ..config
    };
    let k1 = generate(
        &one_wg.plan(1).unwrap(),
        ElementwiseOp::SiluScale,
        DType::F32,
    )
    .unwrap();
    assert!(
        !k1.source.contains("setmaxnreg"),
        "no register split without one in the spec"
    );
    assert!(k1.source.contains("expf(-v0)"));
    let plain = generate_plain(ElementwiseOp::Mul, DType::F32);
    assert!(plain.source.contains("xcall_ws_mul_f32_plain"));
}

/// The block that follows `header` in `src` (from its `{` to the matching
/// `}`, without the braces), and the rest of `src` after it.
fn block<'a>(src: &'a str, header: &str) -> (&'a str, &'a str) {
    let start = src.find(header).unwrap_or_else(|| panic!("no {header:?}")) + header.len();
    let open = start + src[start..].find('{').expect("an opening brace");
    let mut depth = 0;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return (&src[open + 1..open + i], &src[open + i + 1..]);
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced braces after {header:?}")
}

#[test]
fn each_role_issues_its_register_change_waits_and_arrives_exactly_once() {
    // Counted per role branch, for one and two async warps, one and two
    // compute warpgroups: a per-warp copy of an instruction (two
    // setmaxnreg, a doubled arrive) shows as a count of 2.
    for op in [ElementwiseOp::Mul, ElementwiseOp::SiluScale] {
        for wgs in [1, 2] {
            for stages in [1, 3] {
                let config = OpConfig {
                    stages,
                    tile_bytes: 8192,
                    compute_warpgroups: wgs,
                };
                let plan = config.plan(op.operands()).unwrap();
                for dtype in [DType::F32, DType::Bf16] {
                    let what = format!("{op:?} {dtype} wgs={wgs} stages={stages}");
                    let k = generate(&plan, op, dtype).unwrap();
                    let (body, _) = block(&k.source, "__global__");
                    let role_if = "if (tid < PRODUCER_THREADS)";
                    let prologue = &body[..body.find(role_if).expect("role branch")];
                    let (producer, rest) = block(body, role_if);
                    assert!(rest.trim_start().starts_with("else {"), "{what}");
                    let (compute, epilogue) = block(rest, "else");
                    assert_eq!(epilogue.matches("mbar_inval(").count(), 2, "{what}");
                    let count = |s: &str, needle: &str| s.matches(needle).count();
                    // Register reallocation only when the plan asks for it.
                    let regs = usize::from(plan.spec.registers.is_some());
                    let table = [
                        // (part, needle, expected)
                        ("prologue", prologue, "mbar_init(", 2),
                        ("prologue", prologue, "mbar_arrive", 0),
                        ("prologue", prologue, "setmaxnreg", 0),
                        (
                            "producer",
                            producer,
                            "setmaxnreg.dec.sync.aligned.u32",
                            regs,
                        ),
                        ("producer", producer, "setmaxnreg.inc", 0),
                        ("producer", producer, "producer_acquire(", 1),
                        ("producer", producer, "EMPTY_OFF, warp, s)", 1),
                        ("producer", producer, "producer_commit(", 1),
                        ("producer", producer, "FULL_OFF, warp, s)", 1),
                        ("producer", producer, "consumer_", 0),
                        ("producer", producer, "mbar_", 0),
                        ("producer", producer, "bulk_load", 0),
                        ("compute", compute, "setmaxnreg.inc.sync.aligned.u32", regs),
                        ("compute", compute, "setmaxnreg.dec", 0),
                        ("compute", compute, "consumer_wait(", 1),
                        ("compute", compute, "FULL_OFF, w, s)", 1),
                        ("compute", compute, "consumer_release(", 1),
                        ("compute", compute, "EMPTY_OFF, w, s)", 1),
                        ("compute", compute, "producer_", 0),
                        ("compute", compute, "mbar_", 0),
                        ("compute", compute, "bulk_load", 0),
                    ];
                    assert_eq!(regs, usize::from(wgs > 1), "{what}: registers planned");
                    for (part, text, needle, want) in table {
                        assert_eq!(
                            count(text, needle),
                            want,
                            "{what}: {part} has {needle:?} {} time(s)",
                            count(text, needle)
                        );
                    }
                    // Each side walks the stages from its own start state:
                    // the producer one phase ahead on EMPTY (its first wait
                    // passes on the fresh barrier), compute on the plain
                    // phase of FULL.
                    assert_eq!(
                        count(producer, "PipelineState st = {0u, PRODUCER_PHASE};"),
                        1,
                        "{what}"
                    );
                    assert_eq!(
                        count(compute, "PipelineState st = {0u, CONSUMER_PHASE};"),
                        1,
                        "{what}"
                    );
                    assert_eq!(count(producer, ", st);"), 1, "{what}");
                    assert_eq!(count(compute, ", st);"), 1, "{what}");
                    // Both role loops walk the same work items.
                    let walk =
                        "for (u64 i = blockIdx.x; i < items; i += gridDim.x, advance(st, STAGES))";
                    assert_eq!(
                        (count(producer, walk), count(compute, walk)),
                        (1, 1),
                        "{what}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_kernel_takes_init_counts_offsets_and_start_phases_from_the_plan() {
    let plan = OpConfig {
        stages: 2,
        tile_bytes: 4096,
        compute_warpgroups: 1,
    }
    .plan(2)
    .unwrap();
    let source = |plan: &PipelinePlan| {
        generate(plan, ElementwiseOp::Mul, DType::F32)
            .unwrap()
            .source
    };
    let base = source(&plan);
    // An init count edited in the plan is the one the kernel initialises.
    let mut edited = plan.clone();
    let g = edited.group(BarrierKind::Empty, 1).unwrap();
    let b = edited.groups[g].barriers[1];
    edited.barriers[b].init_count = 77;
    assert!(source(&edited).contains("EMPTY_INIT[4] = {128, 128, 128, 77}"));
    // So are the start phases.
    let mut edited = plan.clone();
    for role in &mut edited.roles[..2] {
        role.start.phase = 0;
    }
    let text = source(&edited);
    assert!(text.contains("#define PRODUCER_PHASE 0u"), "{text}");
    assert_ne!(text, base);
    // And a producer pointed at another warp's FULL barriers: the kernel
    // follows the role's group, not the warp's index.
    let mut edited = plan.clone();
    let full0 = edited.group(BarrierKind::Full, 0).unwrap();
    for action in &mut edited.roles[1].body {
        if let Action::ArriveExpectTx { group, .. } | Action::Copy { group, .. } = action {
            *group = full0;
        }
    }
    assert!(
        matches!(
            generate(&edited, ElementwiseOp::Mul, DType::F32),
            Err(PlanError::Codegen(_))
        ),
        "compute waits on warp 1's own FULL, which the kernel cannot express then"
    );
}

#[test]
fn plans_the_kernel_cannot_follow_are_refused_with_the_role() {
    // Tiles of different sizes: one TILE would overrun the smaller buffers.
    let uneven = PipelinePlan::new(&PipelineSpec::new(2, &[4096, 1024], 1)).unwrap();
    let err = generate(&uneven, ElementwiseOp::Mul, DType::F32).unwrap_err();
    assert!(
        matches!(&err, PlanError::Codegen(m) if m.contains("producer w1")),
        "{err}"
    );
    // Two loads in one warp.
    let mut spec = PipelineSpec::new(2, &[1024], 1);
    spec.async_warps[0].loads = vec![512, 512];
    let two = PipelinePlan::new(&spec).unwrap();
    assert!(matches!(
        generate(&two, ElementwiseOp::SiluScale, DType::F32),
        Err(PlanError::Codegen(_))
    ));
    // The wrong operand count.
    let one = PipelinePlan::new(&PipelineSpec::new(2, &[1024], 1)).unwrap();
    assert!(matches!(
        generate(&one, ElementwiseOp::Mul, DType::F32),
        Err(PlanError::Codegen(_))
    ));
    // A table index out of range is an error, not a panic.
    let mut broken = one.clone();
    broken.roles[0].body[0] = Action::Wait { group: 99 };
    assert!(matches!(
        generate(&broken, ElementwiseOp::SiluScale, DType::F32),
        Err(PlanError::Protocol(_))
    ));
}

#[test]
fn element_types_vector_widths_and_role_split_match_the_dtype_and_plan() {
    // Known answers per dtype: bf16 is 8 elements per 16-byte vector
    // (read as 16-bit words in the tail, widened and rounded back); f32 is
    // 4 floats per vector.
    for (dtype, ctype, per_vec, widen) in [
        (DType::Bf16, "unsigned short", 8, true),
        (DType::F32, "float", 4, false),
    ] {
        for wgs in [1, 2] {
            let plan = OpConfig {
                stages: 2,
                tile_bytes: 4096,
                compute_warpgroups: wgs,
            }
            .plan(2)
            .unwrap();
            let k = generate(&plan, ElementwiseOp::Mul, dtype).unwrap();
            let plain = generate_plain(ElementwiseOp::Mul, dtype);
            for (what, src) in [("warp-specialized", &k.source), ("plain", &plain.source)] {
                assert!(
                    src.contains(&format!("float out[{per_vec}];")),
                    "{what} {dtype}"
                );
                assert!(src.contains(&format!("k < {per_vec}u;")), "{what} {dtype}");
                assert!(
                    src.contains(&format!("(*(const {ctype} *)(src1 + it.base + b))")),
                    "{what} {dtype}"
                );
                assert_eq!(
                    src.contains("= bf16_to_f32(*(const unsigned short *)(src0"),
                    widen,
                    "{what} {dtype}"
                );
                assert_eq!(
                    src.contains("= f32_to_bf16(v0 * v1);"),
                    widen,
                    "{what} {dtype}"
                );
            }
            // One producer warpgroup (two async warps) ahead of the compute ones.
            assert!(
                k.source.contains("#define PRODUCER_THREADS 128u"),
                "{dtype}"
            );
            assert!(k.source.contains(&format!("#define WGS {wgs}u")), "{dtype}");
            // The tail walks whole elements.
            let elem = 16 / per_vec;
            for src in [&k.source, &plain.source] {
                assert!(src.contains(&format!("b < it.n; b += {elem}u")), "{dtype}");
            }
            // Each operand's 16-byte vectors unpack into per_vec floats.
            for w in 0..2 {
                assert!(
                    k.source
                        .contains(&format!("float a{w}[{per_vec}]; unpack(")),
                    "{dtype} operand {w}"
                );
                assert!(
                    plain
                        .source
                        .contains(&format!("float a{w}[PLAIN_VECS][{per_vec}];")),
                    "{dtype} operand {w}"
                );
            }
        }
        // An op of one operand picks no second source: its one async warp
        // loads src0 (no src1 local is declared in its kernel).
        let one = OpConfig::default().plan(1).unwrap();
        let k = generate(&one, ElementwiseOp::SiluScale, dtype).unwrap();
        assert!(!k.source.contains("? src0 : src1"), "{dtype}");
        assert!(
            k.source.contains("const unsigned char *src = src0;"),
            "{dtype}"
        );
    }
    // The C codes of the ops.
    assert_eq!(ElementwiseOp::from_code(0), Some(ElementwiseOp::Mul));
    assert_eq!(ElementwiseOp::from_code(1), Some(ElementwiseOp::SiluScale));
    assert_eq!(ElementwiseOp::from_code(2), None);
}

/// The generated kernels compile with NVRTC and assemble for sm_90a (their
/// mbarrier, bulk-copy and setmaxnreg PTX checked as the driver would), no
/// GPU needed: each op and dtype, warp-specialized under two plans and
/// plain.
#[test]
fn generated_kernels_compile_with_nvrtc() {
    let Some(version) = xcall_core::testing::nvrtc_or_skip("warp-specialized kernels with NVRTC")
    else {
        return;
    };
    eprintln!("NVRTC {}.{}", version.0, version.1);
    let configs = [
        OpConfig {
            stages: 3,
            tile_bytes: 8192,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 2,
            tile_bytes: 4096,
            compute_warpgroups: 1,
        },
    ];
    let mut kernels = Vec::new();
    for op in [ElementwiseOp::Mul, ElementwiseOp::SiluScale] {
        for dtype in [DType::F32, DType::Bf16] {
            for config in configs {
                let plan = config.plan(op.operands()).unwrap();
                kernels.push(generate(&plan, op, dtype).unwrap());
            }
            kernels.push(generate_plain(op, dtype));
        }
    }
    std::thread::scope(|s| {
        for k in &kernels {
            s.spawn(move || {
                xcall_core::testing::nvrtc_compiles(&k.name, &k.source, "sm_90a", &["-std=c++17"])
            });
        }
    });
}
