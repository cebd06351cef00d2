//! The device-side helpers (`xcall_core::cuda::device`) compile with NVRTC
//! and assemble for the architectures they name, prepended to a kernel
//! that uses every one of them, and prepended twice. No GPU needed; skips
//! without NVRTC unless XCALL_REQUIRE_NVRTC=1.

use xcall_core::cuda::device::{ALL, BULK_COPY, CONVERT, MBARRIER};
use xcall_core::testing::{nvrtc_compiles, nvrtc_or_skip};

/// A kernel that calls every helper: a one-stage bulk load through a
/// barrier, a bulk store back, and each conversion.
const USES_EVERY_HELPER: &str = r#"
extern "C" __global__ void every_helper(const uint4 *in, uint4 *out, float *f, unsigned char *b) {
    __shared__ alignas(16) uint4 tile[8];
    __shared__ alignas(8) u64 bar;
    const u32 b_addr = smem_addr(&bar);
    if (threadIdx.x == 0) {
        mbar_init(b_addr, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bulk_load_arrive(smem_addr(tile), in, sizeof(tile), b_addr);
    }
    mbar_wait(b_addr, 0);
    if (threadIdx.x == 0) {
        if (!mbar_try_wait(b_addr, 0)) f[1] = 1.0f;
        mbar_arrive_expect_tx(b_addr, 0);
        mbar_arrive(b_addr);
        bulk_load(smem_addr(tile), in, 16, b_addr);
        mbar_wait(b_addr, 1);
        fence_proxy_async();
        bulk_store(out, smem_addr(tile), sizeof(tile));
        bulk_commit();
        bulk_wait_read<0>();
        bulk_wait<0>();
        mbar_inval(b_addr);
    }
    float lo, hi;
    bf16x2_to_f32(f32_to_bf16x2(f[0], f[1]), lo, hi);
    f[2] = bf16_to_f32(f32_to_bf16(lo + hi));
    f[3] = fp8e5m2_to_f32(b[0]) + fp8e4m3_to_f32(b[1]);
    b[2] = f32_to_fp8e4m3(f[3]);
    b[3] = f32_to_fp8e5m2(f[3]);
}
"#;

#[test]
fn the_helpers_compile_and_assemble_for_sm_90() {
    if nvrtc_or_skip("the_helpers_compile_and_assemble_for_sm_90").is_none() {
        return;
    }
    let code = format!("{ALL}{USES_EVERY_HELPER}");
    nvrtc_compiles("device_helpers.cu", &code, "sm_90", &["-std=c++17"]);
    // Prepended twice (all of them, then each again): the guards define
    // everything once.
    let twice = format!("{ALL}{MBARRIER}{BULK_COPY}{CONVERT}{USES_EVERY_HELPER}");
    nvrtc_compiles("device_helpers_twice.cu", &twice, "sm_90", &["-std=c++17"]);
}

/// The conversions' documented floor: bf16 and the e5m2 decoder on sm_80,
/// without the sm_89 fp8 instructions.
#[test]
fn the_bf16_conversions_assemble_for_sm_80() {
    if nvrtc_or_skip("the_bf16_conversions_assemble_for_sm_80").is_none() {
        return;
    }
    let code = format!(
        "{CONVERT}{}",
        r#"
extern "C" __global__ void bf16_only(float *f, unsigned char *b) {
    float lo, hi;
    bf16x2_to_f32(f32_to_bf16x2(f[0], f[1]), lo, hi);
    f[2] = bf16_to_f32(f32_to_bf16(lo + hi)) + fp8e5m2_to_f32(b[0]);
}
"#
    );
    nvrtc_compiles("convert_sm80.cu", &code, "sm_80", &["-std=c++17"]);
}
