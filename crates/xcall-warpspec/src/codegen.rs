//! CUDA C for a plan: a persistent streaming kernel for Hopper (sm_90a).
//!
//! Producer warps (lane 0 of each async warp) wait on their EMPTY barrier,
//! `arrive.expect_tx` the tile's bytes on their FULL barrier and issue one
//! 1D `cp.async.bulk` global->shared copy completing on it. Compute
//! warpgroups wait on every producer's FULL barrier, compute from shared
//! memory with 16-byte vectors, write results to global memory and arrive
//! on the EMPTY barriers, every thread after its own reads (as in CUTLASS's
//! TMA pipeline: the EMPTY count is the number of compute threads). The parities, init counts and
//! offsets are the plan's. Tiles that are not a multiple of 16 bytes copy
//! their 16-byte part in bulk; compute threads read the rest from global
//! memory. Barriers are initialised and fenced before use and invalidated
//! before exit.

use crate::plan::{BarrierKind, PipelinePlan, WARPGROUP_THREADS};
use xcall_core::DType;

/// A built-in elementwise op (`xcall_ws_op` in C).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementwiseOp {
    /// `out = a * b` (two async warps, one per operand).
    Mul = 0,
    /// `out = silu(x) * scale` (one async warp).
    SiluScale = 1,
}

impl ElementwiseOp {
    /// The op with this C code, if any.
    pub fn from_code(code: u32) -> Option<ElementwiseOp> {
        [ElementwiseOp::Mul, ElementwiseOp::SiluScale]
            .into_iter()
            .find(|o| *o as u32 == code)
    }

    /// Number of operands (async warps).
    pub fn operands(self) -> usize {
        match self {
            ElementwiseOp::Mul => 2,
            ElementwiseOp::SiluScale => 1,
        }
    }

    fn expression(self) -> &'static str {
        match self {
            ElementwiseOp::Mul => "v0 * v1",
            ElementwiseOp::SiluScale => "v0 / (1.0f + expf(-v0)) * scale",
        }
    }

    /// Kernel name for a dtype.
    pub fn kernel_name(self, dtype: DType) -> String {
        let op = match self {
            ElementwiseOp::Mul => "mul",
            ElementwiseOp::SiluScale => "silu_scale",
        };
        format!("xcall_ws_{op}_{dtype}")
    }
}

const PRELUDE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u32 smem_addr(const void *p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(u32 bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"#;

/// Launch facts of a generated kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedKernel {
    /// `extern "C"` name.
    pub name: String,
    /// CUDA C source.
    pub source: String,
    /// Threads per block.
    pub threads: u32,
    /// Dynamic shared memory per block.
    pub smem_bytes: u32,
}

/// Generates the kernel of `op` for `dtype` on `plan` (whose async warps
/// must be the op's operands, each loading `tile_bytes` per stage).
pub fn generate(plan: &PipelinePlan, op: ElementwiseOp, dtype: DType) -> GeneratedKernel {
    let name = op.kernel_name(dtype);
    let stages = plan.spec.stages;
    let warps = plan.spec.async_warps.len();
    let wgs = plan.spec.compute_warpgroups;
    let producer_threads = plan.producer_warpgroups * WARPGROUP_THREADS;
    let tile = plan.bytes_per_stage[0];
    let (elem, ctype, load, store) = match dtype {
        DType::Bf16 => (2, "unsigned short", "bf16_to_f32", "f32_to_bf16"),
        _ => (4, "float", "", ""),
    };
    let per_vec = 16 / elem;
    let mut s = String::new();
    s.push_str(&format!("// Generated by xcall-warpspec: {name}, {stages} stages, {warps} async warp(s), {wgs} compute warpgroup(s), {tile} B tiles.\n"));
    s.push_str(PRELUDE);
    // Offsets of the plan.
    let offsets = |kind: BarrierKind| -> String {
        let mut v = Vec::new();
        for w in 0..warps {
            for st in 0..stages {
                let b = &plan.barriers[if kind == BarrierKind::Full {
                    plan.full(w, st)
                } else {
                    plan.empty(w, st)
                }];
                v.push(b.offset.to_string());
            }
        }
        v.join(", ")
    };
    let buffers: Vec<String> = plan
        .buffer_offsets
        .iter()
        .flatten()
        .map(|o| o.to_string())
        .collect();
    s.push_str(&format!(
        "__constant__ u32 FULL_OFF[{n}] = {{{full}}};\n__constant__ u32 EMPTY_OFF[{n}] = {{{empty}}};\n__constant__ u32 BUF_OFF[{n}] = {{{bufs}}};\n",
        n = warps as u32 * stages,
        full = offsets(BarrierKind::Full),
        empty = offsets(BarrierKind::Empty),
        bufs = buffers.join(", ")
    ));
    let srcs: Vec<String> = (0..warps)
        .map(|w| format!("const unsigned char *__restrict__ src{w}"))
        .collect();
    let (dec, inc) = match plan.spec.registers {
        Some(r) => (
            format!(
                "asm volatile(\"setmaxnreg.dec.sync.aligned.u32 {};\");",
                r.producer
            ),
            format!(
                "asm volatile(\"setmaxnreg.inc.sync.aligned.u32 {};\");",
                r.consumer
            ),
        ),
        None => (String::new(), String::new()),
    };
    let loads: String = (0..warps)
        .map(|w| format!("                float v{w} = {load}(((const {ctype} *)p{w})[k]);\n"))
        .collect();
    let vec_ptrs: String = (0..warps)
        .map(|w| {
            format!(
                "            const unsigned char *p{w} = (c * 16 + 16 <= bulk) ? smem + BUF_OFF[{w} * STAGES + s] + c * 16 : src{w} + base + c * 16;\n"
            )
        })
        .collect();
    let vec_compute = format!(
        "{}                        out[k] = {store}({expr});\n",
        (0..warps)
            .map(|w| format!("                        float v{w} = {load}(e{w}[k]);\n"))
            .collect::<String>(),
        expr = op.expression()
    );
    s.push_str(&format!(
        r#"
#define STAGES {stages}u
#define WARPS {warps}u
#define WGS {wgs}u
#define EMPTY_INIT {empty_init}u
#define TILE {tile}ull
#define PRODUCER_THREADS {producer_threads}u

extern "C" __global__ void __launch_bounds__({threads}, 1)
{name}({srcs}, unsigned char *__restrict__ dst, u64 bytes, float scale) {{
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 tid = threadIdx.x;
    if (tid == 0) {{
        for (u32 i = 0; i < WARPS * STAGES; ++i) {{
            mbar_init(smem_addr(smem + FULL_OFF[i]), 1u);
            mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT);
        }}
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }}
    __syncthreads();
    const u64 tiles = (bytes + TILE - 1) / TILE;
    if (tid < PRODUCER_THREADS) {{
        {dec}
        const u32 warp = tid / 32, lane = tid % 32;
        if (warp < WARPS && lane == 0) {{
            const unsigned char *src = {src_select};
            u64 it = 0;
            for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, ++it) {{
                const u32 s = (u32)(it % STAGES);
                const u32 parity = (u32)((it / STAGES) & 1ull) ^ 1u;
                // The EMPTY barrier (release by the compute warps, acquire
                // here) orders their reads of this stage before the next bulk
                // copy into it, as in CUTLASS's TMA pipeline. A proxy fence
                // here cost ~3% bandwidth on H100 (it waits for this
                // producer's copies in flight) and changed no result.
                mbar_wait(smem_addr(smem + EMPTY_OFF[warp * STAGES + s]), parity);
                const u64 base = t * TILE;
                const u32 n = (u32)((bytes - base < TILE) ? bytes - base : TILE);
                const u32 bulk = n & ~15u;
                const u32 full = smem_addr(smem + FULL_OFF[warp * STAGES + s]);
                if (bulk) {{
                    mbar_arrive_expect_tx(full, bulk);
                    bulk_load(smem_addr(smem + BUF_OFF[warp * STAGES + s]), src + base, bulk, full);
                }} else {{
                    mbar_arrive(full);
                }}
            }}
        }}
    }} else {{
        {inc}
        const u32 ct = tid - PRODUCER_THREADS;
        const u32 wg = ct / 128, lt = ct % 128;
        u64 it = 0;
        for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, ++it) {{
            const u32 s = (u32)(it % STAGES);
            const u32 parity = (u32)((it / STAGES) & 1ull);
            for (u32 w = 0; w < WARPS; ++w) mbar_wait(smem_addr(smem + FULL_OFF[w * STAGES + s]), parity);
            const u64 base = t * TILE;
            const u32 n = (u32)((bytes - base < TILE) ? bytes - base : TILE);
            const u32 bulk = n & ~15u;
            const u32 chunks = (n + 15u) / 16u;
            for (u32 c = wg * 128u + lt; c < chunks; c += WGS * 128u) {{
{vec_ptrs}                const u32 count = (c * 16 + 16 <= n) ? {per_vec}u : (n - c * 16) / {elem}u;
                if (count == {per_vec}u) {{
                    {ctype} out[{per_vec}];
                    {vec_loads}
                    #pragma unroll
                    for (u32 k = 0; k < {per_vec}u; ++k) {{
{vec_compute}                    }}
                    *(uint4 *)(dst + base + c * 16) = *(const uint4 *)out;
                }} else {{
                    for (u32 k = 0; k < count; ++k) {{
{loads}                        (({ctype} *)(dst + base + c * 16))[k] = {store}({expr});
                    }}
                }}
            }}
            // Every compute thread releases the stage after its own reads
            // (the EMPTY count is the number of compute threads).
            for (u32 w = 0; w < WARPS; ++w) mbar_arrive(smem_addr(smem + EMPTY_OFF[w * STAGES + s]));
        }}
    }}
    __syncthreads();
    if (tid == 0) {{
        for (u32 i = 0; i < WARPS * STAGES; ++i) {{
            mbar_inval(smem_addr(smem + FULL_OFF[i]));
            mbar_inval(smem_addr(smem + EMPTY_OFF[i]));
        }}
    }}
}}
"#,
        threads = plan.threads_per_block,
        empty_init = plan.barriers[plan.empty(0, 0)].init_count,
        srcs = srcs.join(", "),
        src_select = if warps == 1 { "src0".to_string() } else { "warp == 0 ? src0 : src1".to_string() },
        vec_loads = (0..warps)
            .map(|w| format!("const uint4 q{w} = *(const uint4 *)p{w}; const {ctype} *e{w} = (const {ctype} *)&q{w};"))
            .collect::<Vec<_>>()
            .join(" "),
        expr = op.expression(),
    ));
    GeneratedKernel {
        name,
        source: s,
        threads: plan.threads_per_block,
        smem_bytes: plan.smem_bytes,
    }
}

/// A plain grid-stride kernel of the same op with 16-byte vector loads and
/// stores (the reference the warp-specialized kernel is measured against).
pub fn generate_plain(op: ElementwiseOp, dtype: DType) -> GeneratedKernel {
    let name = format!("{}_plain", op.kernel_name(dtype));
    let warps = op.operands();
    let (elem, ctype, load, store) = match dtype {
        DType::Bf16 => (2, "unsigned short", "bf16_to_f32", "f32_to_bf16"),
        _ => (4, "float", "", ""),
    };
    let per_vec = 16 / elem;
    let srcs: Vec<String> = (0..warps)
        .map(|w| format!("const unsigned char *__restrict__ src{w}"))
        .collect();
    let vloads: String = (0..warps)
        .map(|w| format!("        const uint4 q{w} = *(const uint4 *)(src{w} + c * 16); const {ctype} *e{w} = (const {ctype} *)&q{w};\n"))
        .collect();
    let vals: String = (0..warps)
        .map(|w| format!("            float v{w} = {load}(e{w}[k]);\n"))
        .collect();
    let tail_vals: String = (0..warps)
        .map(|w| {
            format!("            float v{w} = {load}(((const {ctype} *)(src{w} + c * 16))[k]);\n")
        })
        .collect();
    let source = format!(
        r#"{PRELUDE}
extern "C" __global__ void {name}({srcs}, unsigned char *__restrict__ dst, u64 bytes, float scale) {{
    const u64 chunks = (bytes + 15) / 16;
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (u64)gridDim.x * blockDim.x) {{
        if (c * 16 + 16 <= bytes) {{
{vloads}        {ctype} out[{per_vec}];
        #pragma unroll
        for (u32 k = 0; k < {per_vec}u; ++k) {{
{vals}            out[k] = {store}({expr});
        }}
        *(uint4 *)(dst + c * 16) = *(const uint4 *)out;
        }} else {{
        for (u32 k = 0; k < (u32)(bytes - c * 16) / {elem}u; ++k) {{
{tail_vals}            (({ctype} *)(dst + c * 16))[k] = {store}({expr});
        }}
        }}
    }}
}}
"#,
        srcs = srcs.join(", "),
        expr = op.expression(),
    );
    GeneratedKernel {
        name,
        source,
        threads: 256,
        smem_bytes: 0,
    }
}
