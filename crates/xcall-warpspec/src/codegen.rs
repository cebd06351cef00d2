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
use crate::ops::table_offset;
use crate::pipeline::{Action, RoleKind};
use crate::plan::{PipelinePlan, WARPGROUP_THREADS};
use xcall_core::cuda::device::{BULK_COPY, CONVERT, MBARRIER};
use xcall_core::cuda::KernelRecord;
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

xcall_core::c_enum!(ElementwiseOp, "warp-specialized op", [Mul, SiluScale]);

impl ElementwiseOp {
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
            // The fast exp (ex2.approx) and division (rcp.approx): within
            // a few ulp of the Host's f32 definition, at a fifth of the
            // instructions of expf and IEEE division.
            ElementwiseOp::SiluScale => "__fdividef(v0, 1.0f + __expf(-v0)) * scale",
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

const PRELUDE: &str = include_str!("kernels/prelude.cu");
const PIPELINED: &str = include_str!("kernels/pipelined.cu");
const PLAIN: &str = include_str!("kernels/plain.cu");
const RAGGED: &str = include_str!("kernels/ragged.cu");

/// Bytes of the plain kernel's work item (`PLAIN_TILE` in its template:
/// 256 threads x 2 vectors of 16 bytes; a unit test checks they agree).
pub const PLAIN_TILE_BYTES: u64 = 256 * 2 * 16;

xcall_core::kernel_params! {
    /// What every generated kernel takes.
    pub struct WsParams {
        /// First operand (device address).
        src0: u64 => "const unsigned char*",
        /// Second operand, or 0 for a one-operand op.
        src1: u64 => "const unsigned char*",
        /// Output (device address).
        dst: u64 => "unsigned char*",
        /// Bytes of each buffer.
        bytes: u64 => "u64",
        /// `SiluScale`'s scale per group (device address of one f32 per
        /// group), or 0 for `scale` everywhere.
        scales: u64 => "const float*",
        /// Bytes of a scale group: a divisor of `bytes` (all of it for one
        /// group); work items never cross a group.
        group_bytes: u64 => "u64",
        /// Ragged groups' row counts (device address of `segments *
        /// groups` i64), or 0 for fixed groups; `scales` then holds one
        /// f32 per ragged group.
        rows: u64 => "const long long*",
        /// Bytes of a ragged segment.
        segment_bytes: u64 => "u64",
        /// Bytes of a row of a ragged group (a multiple of 16).
        row_bytes: u64 => "u64",
        /// Ragged segments.
        segments: u32 => "u32",
        /// Ragged groups per segment.
        groups: u32 => "u32",
        /// `SiluScale`'s scale when `scales` is 0.
        scale: f32 => "float",
        /// Zero.
        reserved: u32 => "u32",
    }
}

/// `template` with every hole `@NAME@` replaced by its value in `holes`.
/// A hole without a value, or a value without a hole, is an error (a
/// template and its generator that drift apart fail here).
fn fill<'a>(
    template: &str,
    holes: impl IntoIterator<Item = (&'a str, String)>,
) -> Result<String, PlanError> {
    let holes: Vec<(&str, String)> = holes.into_iter().collect();
    let mut out = String::with_capacity(template.len() + 1024);
    let mut used = vec![false; holes.len()];
    let mut rest = template;
    while let Some(at) = rest.find('@') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let end = after
            .find('@')
            .filter(|&e| {
                e > 0
                    && after[..e]
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c == '_')
            })
            .ok_or_else(|| {
                PlanError::Codegen(format!(
                    "a stray '@' in a kernel template before {:.40?}",
                    after
                ))
            })?;
        let name = &after[..end];
        let i = holes.iter().position(|(h, _)| *h == name).ok_or_else(|| {
            PlanError::Codegen(format!("no value for the template's hole @{name}@"))
        })?;
        used[i] = true;
        out.push_str(&holes[i].1);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    match holes.iter().zip(&used).find(|(_, u)| !**u) {
        Some(((name, _), _)) => Err(PlanError::Codegen(format!(
            "the kernel template has no hole @{name}@"
        ))),
        None => Ok(out),
    }
}

/// `line(w)` for every operand `w`, joined.
fn per_operand(warps: usize, line: impl Fn(usize) -> String) -> String {
    (0..warps).map(line).collect()
}

/// The operand locals a kernel body reads (`src0`, `src1`), from its
/// parameters.
fn operand_locals(warps: usize) -> String {
    per_operand(warps, |w| {
        format!("    const unsigned char *__restrict__ src{w} = p.src{w};\n")
    })
}

/// Element size, C type, and the load/store conversions of `dtype` (bf16
/// widens to f32; f32 needs none).
fn element(dtype: DType) -> (usize, &'static str, &'static str, &'static str) {
    match dtype {
        DType::Bf16 => (2, "unsigned short", "bf16_to_f32", "f32_to_bf16"),
        _ => (4, "float", "", ""),
    }
}

/// Elements of `dtype` in one 16-byte vector.
fn per_vec(dtype: DType) -> usize {
    16 / element(dtype).0
}

/// The holes both templates fill alike: the operands' locals, the element
/// type and its conversions, the op's expression, and the scalar tail.
fn element_holes(op: ElementwiseOp, dtype: DType) -> [(&'static str, String); 7] {
    let (elem, ctype, load, store) = element(dtype);
    let warps = op.operands();
    [
        ("OPERANDS", operand_locals(warps)),
        ("PER_VEC", per_vec(dtype).to_string()),
        ("ELEM", elem.to_string()),
        ("CTYPE", ctype.to_string()),
        ("STORE", store.to_string()),
        ("EXPR", op.expression().to_string()),
        (
            "TAIL_VALS",
            per_operand(warps, |w| {
                format!(
                    "                    const float v{w} = {load}(*(const {ctype} *)(src{w} + it.base + b));\n"
                )
            }),
        ),
    ]
}

/// The source text every kernel starts with: xcall-core's device helpers
/// (mbarrier, bulk copy, conversions), this crate's helpers, the parameter
/// struct and the ragged groups' helpers.
fn preamble() -> String {
    format!(
        "{MBARRIER}{BULK_COPY}{CONVERT}{PRELUDE}{}{RAGGED}",
        WsParams::c_definition()
    )
}

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
    let per_vec = per_vec(dtype);
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
    let n = warps as u32 * stages;
    let tables = format!(
        "__constant__ u32 FULL_OFF[{n}] = {{{}}};\n__constant__ u32 EMPTY_OFF[{n}] = {{{}}};\n__constant__ u32 FULL_INIT[{n}] = {{{}}};\n__constant__ u32 EMPTY_INIT[{n}] = {{{}}};\n__constant__ u32 BUF_OFF[{n}] = {{{}}};\n",
        table(&t.full, &offset),
        table(&t.empty, &offset),
        table(&t.full, &init),
        table(&t.empty, &init),
        buffers.join(", ")
    );
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
    let body = fill(
        PIPELINED,
        [
            ("TABLES", tables),
            ("STAGES", stages.to_string()),
            ("WARPS", warps.to_string()),
            ("WGS", wgs.to_string()),
            ("PRODUCER_PHASE", t.producer_phase.to_string()),
            ("CONSUMER_PHASE", t.consumer_phase.to_string()),
            ("TILE", tile.to_string()),
            ("PRODUCER_THREADS", producer_threads.to_string()),
            ("TABLE_OFF", table_offset(plan.smem_bytes).to_string()),
            ("THREADS", plan.threads_per_block.to_string()),
            ("NAME", name.clone()),
            ("DEC", dec),
            ("INC", inc),
            (
                "SRC_SELECT",
                if warps == 1 { "src0" } else { "warp == 0 ? src0 : src1" }.to_string(),
            ),
            (
                "VEC_LOADS",
                per_operand(warps, |w| format!(
                    "                float a{w}[{per_vec}]; unpack(*(const uint4 *)(smem + BUF_OFF[{w} * STAGES + s] + c * 16), a{w});\n"
                )),
            ),
            (
                "VEC_VALS",
                per_operand(warps, |w| format!("                    const float v{w} = a{w}[k];\n")),
            ),
        ]
        .into_iter()
        .chain(element_holes(op, dtype)),
    )?;
    Ok(GeneratedKernel {
        source: format!(
            "// Generated by xcall-warpspec: {name}, {stages} stages, {warps} async warp(s), {wgs} compute warpgroup(s), {tile} B tiles.\n{}\n{body}",
            preamble()
        ),
        name,
        threads: plan.threads_per_block,
        smem_bytes: plan.smem_bytes,
    })
}

/// A plain grid-stride kernel of the same op with 16-byte vector loads and
/// stores (the reference the warp-specialized kernel is measured against).
pub fn generate_plain(op: ElementwiseOp, dtype: DType) -> GeneratedKernel {
    let name = format!("{}_plain", op.kernel_name(dtype));
    let warps = op.operands();
    let per_vec = per_vec(dtype);
    let body = fill(
        PLAIN,
        [
            ("NAME", name.clone()),
            (
                "VEC_LOADS",
                per_operand(warps, |w| format!(
                    "        float a{w}[PLAIN_VECS][{per_vec}];\n        #pragma unroll\n        for (u32 r = 0; r < PLAIN_VECS; ++r) {{\n            const u32 c = threadIdx.x + r * PLAIN_THREADS;\n            if (c < vecs) unpack(*(const uint4 *)(src{w} + it.base + c * 16), a{w}[r]);\n        }}\n"
                )),
            ),
            (
                "VEC_VALS",
                per_operand(warps, |w| format!("                    const float v{w} = a{w}[r][k];\n")),
            ),
        ]
        .into_iter()
        .chain(element_holes(op, dtype)),
    )
    .expect("the plain template's holes are the ones filled here (a unit test checks)");
    GeneratedKernel {
        source: format!("{}\n{body}", preamble()),
        name,
        threads: 256,
        smem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_and_their_holes_agree() {
        fn holes<'a>(names: &[&'a str]) -> Vec<(&'a str, String)> {
            names.iter().map(|n| (*n, format!("<{n}>"))).collect()
        }
        assert_eq!(
            fill("a @X@ b @Y_Z@ @X@", holes(&["X", "Y_Z"])).unwrap(),
            "a <X> b <Y_Z> <X>"
        );
        for (template, names, missing) in [
            (
                "a @X@ @Y@",
                &["X"][..],
                "no value for the template's hole @Y@",
            ),
            (
                "a @X@",
                &["X", "W"][..],
                "the kernel template has no hole @W@",
            ),
            ("a @x@", &["X"][..], "a stray '@'"),
            ("a @X", &["X"][..], "a stray '@'"),
            // An empty name is a stray '@' too, not a hole named "".
            ("a @@ b", &["X"][..], "a stray '@'"),
        ] {
            let err = fill(template, holes(names)).unwrap_err().to_string();
            assert!(err.contains(missing), "{template}: {err}");
        }
        // Both kernels take WsParams and read only its fields.
        for template in [PIPELINED, PLAIN, RAGGED] {
            assert_eq!(WsParams::check_reads(template), Ok(()));
        }
        // The launch's grid counts the plain kernel's items as it does.
        assert!(PLAIN.contains("#define PLAIN_THREADS 256u\n#define PLAIN_VECS 2u\n"));
        let define = |name: &str| -> u64 {
            let line = PLAIN
                .lines()
                .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("plain.cu defines {name}"));
            line.trim_end_matches('u').parse().unwrap()
        };
        assert_eq!(
            PLAIN_TILE_BYTES,
            define("PLAIN_THREADS") * define("PLAIN_VECS") * 16
        );
        // The plain kernel fills its template for every op and dtype.
        for op in [ElementwiseOp::Mul, ElementwiseOp::SiluScale] {
            for dtype in [DType::F32, DType::Bf16] {
                let k = generate_plain(op, dtype);
                assert!(!k.source.contains('@'), "{op:?} {dtype}");
                assert_eq!(
                    k.source.matches("= p.src").count(),
                    op.operands(),
                    "{op:?} {dtype}"
                );
            }
        }
    }
}
