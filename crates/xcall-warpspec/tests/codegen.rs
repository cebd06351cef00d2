//! What the generator emits, checked without a GPU.

use xcall_core::DType;
use xcall_warpspec::codegen::{generate, generate_plain, ElementwiseOp};
use xcall_warpspec::ops::OpConfig;

#[test]
fn generated_source_follows_the_plan() {
    let config = OpConfig {
        stages: 3,
        tile_bytes: 8192,
        compute_warpgroups: 2,
    };
    let plan = config.plan(2).unwrap();
    let k = generate(&plan, ElementwiseOp::Mul, DType::Bf16);
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
        "mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT);",
        "#define EMPTY_INIT 256u",
        "^ 1u;",
    ] {
        assert!(k.source.contains(needle), "missing {needle:?}");
    }
    // The plan's barrier offsets are what the kernel uses.
    let full: Vec<String> = (0..2)
        .flat_map(|w| (0..3).map(move |s| (w, s)))
        .map(|(w, s)| plan.barriers[plan.full(w, s)].offset.to_string())
        .collect();
    assert!(k
        .source
        .contains(&format!("FULL_OFF[6] = {{{}}}", full.join(", "))));
    // __syncthreads only outside the role branches: after init and before inval.
    assert_eq!(k.source.matches("__syncthreads()").count(), 2);
    let one_wg = OpConfig {
        compute_warpgroups: 1,
        ..config
    };
    let k1 = generate(
        &one_wg.plan(1).unwrap(),
        ElementwiseOp::SiluScale,
        DType::F32,
    );
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
                    let k = generate(&plan, op, dtype);
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
                        ("producer", producer, "mbar_wait(", 1),
                        ("producer", producer, "EMPTY_OFF[warp * STAGES + s]", 1),
                        ("producer", producer, "mbar_arrive_expect_tx(", 1),
                        ("producer", producer, "mbar_arrive(", 1),
                        ("producer", producer, "bulk_load(", 1),
                        ("compute", compute, "setmaxnreg.inc.sync.aligned.u32", regs),
                        ("compute", compute, "setmaxnreg.dec", 0),
                        ("compute", compute, "mbar_wait(", 1),
                        ("compute", compute, "FULL_OFF[w * STAGES + s]", 1),
                        ("compute", compute, "mbar_arrive(", 1),
                        ("compute", compute, "EMPTY_OFF[w * STAGES + s]", 1),
                        ("compute", compute, "mbar_arrive_expect_tx", 0),
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
                    // The producer starts one phase ahead on EMPTY (its first
                    // wait passes on the fresh barrier); compute waits FULL
                    // on the plain phase.
                    assert!(producer.contains("& 1ull) ^ 1u;"), "{what}");
                    assert!(!compute.contains("^ 1u"), "{what}");
                    // Both role loops walk the same tiles.
                    let walk = "for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, ++it)";
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
