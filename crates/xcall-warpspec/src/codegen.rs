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

use crate::error::PlanError;
use crate::pipeline::{Action, RoleKind};
use crate::plan::{PipelinePlan, WARPGROUP_THREADS};
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

// A role's walk over the stages (stage index, parity waited on there).
struct PipeState { u32 index, phase; };
__device__ __forceinline__ void advance(PipeState &s, u32 stages) {
    if (++s.index == stages) { s.index = 0; s.phase ^= 1u; }
}
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

/// What the kernel takes from a plan's roles: per async warp the FULL
/// group its producer arrives on (and compute waits on) and the EMPTY group
/// it waits on (and compute releases), and each side's start parity.
struct Template {
    full: Vec<usize>,
    empty: Vec<usize>,
    tile: u32,
    producer_phase: u32,
    consumer_phase: u32,
}

/// Reads the plan's roles into the kernel's shape, or says where they
/// differ from it: producers `[wait EMPTY, arrive.expect_tx FULL, one copy
/// of the tile into its own buffer]`, then compute warpgroups `[wait every
/// FULL, read every buffer, every thread arrives once on every EMPTY]`,
/// all starting at stage 0.
fn template(plan: &PipelinePlan) -> Result<Template, PlanError> {
    plan.check_tables()?;
    let warps = plan.spec.async_warps.len();
    let wgs = plan.spec.compute_warpgroups as usize;
    let bad = |m: String| Err(PlanError::Codegen(m));
    if plan.roles.len() != warps + wgs {
        return bad(format!(
            "{} roles for {warps} async warps and {wgs} compute warpgroups",
            plan.roles.len()
        ));
    }
    if plan.roles.iter().any(|r| r.start.index != 0) {
        return bad("every role must start at stage 0".into());
    }
    let tile = plan.bytes_per_stage[0];
    let (mut full, mut empty) = (Vec::new(), Vec::new());
    for (w, role) in plan.roles[..warps].iter().enumerate() {
        match (role.kind, role.body.as_slice()) {
            (
                RoleKind::Producer { warp },
                &[Action::Wait { group: e }, Action::ArriveExpectTx { group: f, bytes }, Action::Copy {
                    group: f2,
                    buffer,
                    bytes: copied,
                }],
            ) if warp == w && f2 == f && buffer == w && bytes == copied && copied == u64::from(tile) => {
                full.push(f);
                empty.push(e);
            }
            _ => {
                return bad(format!(
                    "{}: the kernel's producer waits EMPTY, arrive.expect_tx's one {tile}-byte tile on FULL and copies it into its own buffer; the plan has {:?}",
                    role.name(),
                    role.body
                ))
            }
        }
    }
    let mut compute_body: Vec<Action> = full.iter().map(|&group| Action::Wait { group }).collect();
    compute_body.extend((0..warps).map(|buffer| Action::Read { buffer }));
    compute_body.extend(empty.iter().map(|&group| Action::Arrive {
        group,
        count: WARPGROUP_THREADS,
    }));
    for (g, role) in plan.roles[warps..].iter().enumerate() {
        if role.kind
            != (RoleKind::Compute {
                warpgroup: g as u32,
            })
            || role.body != compute_body
        {
            return bad(format!(
                "{}: the kernel's compute warpgroup waits every FULL, reads every buffer and arrives once per thread on every EMPTY ({compute_body:?}); the plan has {:?}",
                role.name(),
                role.body
            ));
        }
    }
    let phase = |roles: &[crate::pipeline::RolePlan]| -> Result<u32, PlanError> {
        match roles {
            [first, rest @ ..] if rest.iter().all(|r| r.start == first.start) => {
                Ok(first.start.phase)
            }
            _ => Err(PlanError::Codegen(
                "roles of one side must start alike".into(),
            )),
        }
    };
    Ok(Template {
        producer_phase: phase(&plan.roles[..warps])?,
        consumer_phase: phase(&plan.roles[warps..])?,
        full,
        empty,
        tile,
    })
}

/// Generates the kernel of `op` for `dtype` following `plan`'s roles and
/// tables (whose async warps must be the op's operands, each loading one
/// tile of the same size per stage), or says why the kernel cannot follow
/// that plan.
pub fn generate(
    plan: &PipelinePlan,
    op: ElementwiseOp,
    dtype: DType,
) -> Result<GeneratedKernel, PlanError> {
    if plan.spec.async_warps.len() != op.operands() {
        return Err(PlanError::Codegen(format!(
            "{op:?} takes {} operand(s), the plan has {} async warp(s)",
            op.operands(),
            plan.spec.async_warps.len()
        )));
    }
    let t = template(plan)?;
    let name = op.kernel_name(dtype);
    let stages = plan.spec.stages;
    let warps = plan.spec.async_warps.len();
    let wgs = plan.spec.compute_warpgroups;
    let producer_threads = plan.producer_warpgroups * WARPGROUP_THREADS;
    let tile = t.tile;
    let (elem, ctype, load, store) = match dtype {
        DType::Bf16 => (2, "unsigned short", "bf16_to_f32", "f32_to_bf16"),
        _ => (4, "float", "", ""),
    };
    let per_vec = 16 / elem;
    let mut s = String::new();
    s.push_str(&format!("// Generated by xcall-warpspec: {name}, {stages} stages, {warps} async warp(s), {wgs} compute warpgroup(s), {tile} B tiles.\n"));
    s.push_str(PRELUDE);
    // The plan's barriers, in the order of its roles' groups: the offset
    // and init count of warp `w`'s barrier for stage `s` at `w * STAGES + s`.
    let table = |groups: &[usize], field: &dyn Fn(usize) -> u32| -> String {
        groups
            .iter()
            .flat_map(|&g| plan.groups[g].barriers.iter())
            .map(|&b| field(b).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let offset = |b: usize| plan.barriers[b].offset;
    let init = |b: usize| plan.barriers[b].init_count;
    let buffers: Vec<String> = plan
        .buffer_offsets
        .iter()
        .flatten()
        .map(|o| o.to_string())
        .collect();
    s.push_str(&format!(
        "__constant__ u32 FULL_OFF[{n}] = {{{full}}};\n__constant__ u32 EMPTY_OFF[{n}] = {{{empty}}};\n__constant__ u32 FULL_INIT[{n}] = {{{full_init}}};\n__constant__ u32 EMPTY_INIT[{n}] = {{{empty_init}}};\n__constant__ u32 BUF_OFF[{n}] = {{{bufs}}};\n",
        n = warps as u32 * stages,
        full = table(&t.full, &offset),
        empty = table(&t.empty, &offset),
        full_init = table(&t.full, &init),
        empty_init = table(&t.empty, &init),
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
#define PRODUCER_PHASE {producer_phase}u
#define CONSUMER_PHASE {consumer_phase}u
#define TILE {tile}ull
#define PRODUCER_THREADS {producer_threads}u

extern "C" __global__ void __launch_bounds__({threads}, 1)
{name}({srcs}, unsigned char *__restrict__ dst, u64 bytes, float scale) {{
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 tid = threadIdx.x;
    if (tid == 0) {{
        for (u32 i = 0; i < WARPS * STAGES; ++i) {{
            mbar_init(smem_addr(smem + FULL_OFF[i]), FULL_INIT[i]);
            mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT[i]);
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
            PipeState st = {{0u, PRODUCER_PHASE}};
            for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, advance(st, STAGES)) {{
                const u32 s = st.index;
                // The EMPTY barrier (release by the compute warps, acquire
                // here) orders their reads of this stage before the next bulk
                // copy into it, as in CUTLASS's TMA pipeline. A proxy fence
                // here cost ~3% bandwidth on H100 (it waits for this
                // producer's copies in flight) and changed no result.
                mbar_wait(smem_addr(smem + EMPTY_OFF[warp * STAGES + s]), st.phase);
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
        PipeState st = {{0u, CONSUMER_PHASE}};
        for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, advance(st, STAGES)) {{
            const u32 s = st.index;
            for (u32 w = 0; w < WARPS; ++w) mbar_wait(smem_addr(smem + FULL_OFF[w * STAGES + s]), st.phase);
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
        producer_phase = t.producer_phase,
        consumer_phase = t.consumer_phase,
        srcs = srcs.join(", "),
        src_select = if warps == 1 { "src0".to_string() } else { "warp == 0 ? src0 : src1".to_string() },
        vec_loads = (0..warps)
            .map(|w| format!("const uint4 q{w} = *(const uint4 *)p{w}; const {ctype} *e{w} = (const {ctype} *)&q{w};"))
            .collect::<Vec<_>>()
            .join(" "),
        expr = op.expression(),
    ));
    Ok(GeneratedKernel {
        name,
        source: s,
        threads: plan.threads_per_block,
        smem_bytes: plan.smem_bytes,
    })
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
