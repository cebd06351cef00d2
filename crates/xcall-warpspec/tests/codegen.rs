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
