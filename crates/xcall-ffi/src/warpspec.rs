//! C ABI of the warp-specialization runtime (xcall-warpspec).

use std::ffi::{c_char, c_void};

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::{DType, Status};
use xcall_warpspec::codegen::{generate, ElementwiseOp};
use xcall_warpspec::ops::{GroupScales, OpConfig, OpError, RaggedGroups};
use xcall_warpspec::verify::{verify_within, Budget};
use xcall_warpspec::OpCall;
use xcall_warpspec::{PipelinePlan, PipelineSpec, PlanError, RegisterSplit};

use crate::guard::{c_code, code_arg, ffi_call, out_ptr, DTypeCode, FfiError};
use crate::handle::{self, Handle};
use crate::target::xcall_target;

/// A derived pipeline plan. Immutable: any function may use it from any
/// thread; `xcall_ws_plan_free` must be the last call on it.
/// A plan freed already, or a pointer not made by `xcall_ws_plan_new`, is
/// `XCALL_STATUS_INVALID_HANDLE`.
pub struct xcall_ws_plan {
    plan: PipelinePlan,
}

impl Handle for xcall_ws_plan {
    const TYPE: &'static str = "xcall_ws_plan";
}

/// What a pipeline must do. Each async warp issues one bulk load of
/// `warp_bytes[w]` bytes per stage.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_ws_spec {
    /// Circular stages (at least 1).
    pub stages: u32,
    /// Compute warpgroups (128 threads each; at least 1).
    pub compute_warpgroups: u32,
    /// Bytes each async warp loads per stage (`num_warps` entries).
    pub warp_bytes: *const u32,
    /// Number of async warps (at least 1).
    pub num_warps: usize,
    /// `setmaxnreg` value of the producer warpgroup; 0 with
    /// `consumer_registers` 0 for no register split.
    pub producer_registers: u32,
    /// `setmaxnreg` value of every compute warpgroup.
    pub consumer_registers: u32,
    /// Shared memory per block in bytes; 0 for Hopper's 227 KiB.
    pub smem_limit: u32,
}

/// Facts of a plan.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_ws_plan_info {
    /// Dynamic shared memory per block.
    pub smem_bytes: u32,
    /// Threads per block.
    pub threads_per_block: u32,
    /// Number of mbarriers (FULL and EMPTY per async warp and stage).
    pub barriers: u32,
    /// Warpgroups holding the async warps.
    pub producer_warpgroups: u32,
}

/// Shape of a built-in op's pipeline.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_ws_op_config {
    /// Stages.
    pub stages: u32,
    /// Bytes per tile per operand (a multiple of 16 and of the element size).
    pub tile_bytes: u32,
    /// Compute warpgroups.
    pub compute_warpgroups: u32,
}

assert_eq_size!(xcall_ws_spec, [u64; 5]);
assert_eq_align!(xcall_ws_spec, u64);
assert_eq_size!(xcall_ws_plan_info, [u32; 4]);
assert_eq_size!(xcall_ws_op_config, [u32; 3]);
assert_eq_size!(ElementwiseOp, u32);

impl From<PlanError> for FfiError {
    fn from(e: PlanError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

impl From<OpError> for FfiError {
    fn from(e: OpError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

fn plan_ref<'a>(plan: *const xcall_ws_plan) -> Result<&'a PipelinePlan, FfiError> {
    handle::get(plan, "plan").map(|p| &p.plan)
}

/// Copies `text` and a NUL into `buf` (`len` bytes) and the size it needs,
/// NUL included, into `*out_len`. With `buf` NULL only the size is written.
fn write_text(
    text: &str,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> Result<(), FfiError> {
    let out_len = out_ptr(out_len, "out_len")?;
    let needed = text.len() + 1;
    if !buf.is_null() {
        if len < needed {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!("the buffer holds {len} bytes, {needed} are needed"),
            ));
        }
        // SAFETY: `buf` has room for `len >= needed` bytes (the caller's
        // promise); the source is `text` plus one NUL written separately.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            *buf.add(text.len()) = 0;
        }
    }
    *out_len = needed;
    Ok(())
}

/// Plans `spec` into `*out_plan` (free with `xcall_ws_plan_free`).
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_ARGUMENT` with
/// the rule the spec breaks (no stages, loads not a multiple of 16 bytes,
/// shared memory or register file exceeded, bad register values, ...).
///
/// Bad input: as listed under Errors, checked before anything is allocated
/// (thread and shared-memory totals in 64 bits); `*out_plan` is written
/// only on success.
#[no_mangle]
pub extern "C" fn xcall_ws_plan_new(
    spec: *const xcall_ws_spec,
    out_plan: *mut *mut xcall_ws_plan,
) -> Status {
    ffi_call!({
        // SAFETY: NULL or a valid spec, per the documentation.
        let spec = unsafe { spec.as_ref() }
            .ok_or_else(|| FfiError::new(Status::NullArgument, "spec is NULL"))?;
        let out = out_ptr(out_plan, "out_plan")?;
        let bytes: &[u32] = match (spec.warp_bytes.is_null(), spec.num_warps) {
            (_, 0) => &[],
            (true, _) => {
                return Err(FfiError::new(
                    Status::NullArgument,
                    "spec->warp_bytes is NULL",
                ))
            }
            // SAFETY: the caller promises num_warps readable entries.
            (false, n) => unsafe { std::slice::from_raw_parts(spec.warp_bytes, n) },
        };
        let mut s = PipelineSpec::new(spec.stages, bytes, spec.compute_warpgroups);
        if spec.producer_registers != 0 || spec.consumer_registers != 0 {
            s.registers = Some(RegisterSplit {
                producer: spec.producer_registers,
                consumer: spec.consumer_registers,
            });
        }
        if spec.smem_limit != 0 {
            s.smem_limit = spec.smem_limit;
        }
        let plan = PipelinePlan::new(&s)?;
        *out = handle::publish(xcall_ws_plan { plan })?;
        Ok(())
    })
}

/// Frees a plan. NULL is a no-op; a handle that is not live (freed
/// already, not made by xcall) is left alone and
/// `xcall_last_error_message()` says so.
///
/// Bad input: NULL, a freed or foreign handle: left alone (the function
/// returns nothing; the last error message says what was ignored).
#[no_mangle]
pub extern "C" fn xcall_ws_plan_free(plan: *mut xcall_ws_plan) {
    let _ = ffi_call!({
        drop(handle::release(plan, "plan")?);
        Ok(())
    });
}

/// Facts of a plan in `*out_info`.
///
/// Bad input: NULL plan or `out_info`: `XCALL_STATUS_NULL_ARGUMENT`; a
/// freed or foreign plan: `XCALL_STATUS_INVALID_HANDLE`.
#[no_mangle]
pub extern "C" fn xcall_ws_plan_get_info(
    plan: *const xcall_ws_plan,
    out_info: *mut xcall_ws_plan_info,
) -> Status {
    ffi_call!({
        let plan = plan_ref(plan)?;
        let out = out_ptr(out_info, "out_info")?;
        *out = xcall_ws_plan_info {
            smem_bytes: plan.smem_bytes,
            threads_per_block: plan.threads_per_block,
            barriers: plan.barriers.len() as u32,
            producer_warpgroups: plan.producer_warpgroups,
        };
        Ok(())
    })
}

/// Model-checks the plan's barrier protocol over `iterations` iterations
/// (0 for 2 x stages + 1). `*out_clean` is true when every interleaving is
/// free of deadlocks, early overwrites, reads before loads and phase errors.
/// The readable report (verdict, state count, and for a violation its
/// shortest trace) goes to `report` as with every text output: pass NULL to
/// learn the size (NUL included) in `*out_report_len`.
///
/// The search is bounded: 20 million states, 2 GiB of its own tables and 60
/// seconds, whichever comes first, ends it with `XCALL_STATUS_LIMIT` and a
/// message giving the states, bytes and time reached.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_HANDLE`,
/// `XCALL_STATUS_INVALID_ARGUMENT` (report buffer too small, iterations past
/// 65535), `XCALL_STATUS_LIMIT`.
///
/// Bad input: NULL plan or outputs: `XCALL_STATUS_NULL_ARGUMENT`; a freed
/// or foreign plan: `XCALL_STATUS_INVALID_HANDLE`; a report buffer too
/// small: `XCALL_STATUS_INVALID_ARGUMENT` with the size needed; a protocol
/// whose check passes the state, memory or time budget:
/// `XCALL_STATUS_LIMIT` with the numbers reached.
#[no_mangle]
pub extern "C" fn xcall_ws_plan_verify(
    plan: *const xcall_ws_plan,
    iterations: u32,
    out_clean: *mut bool,
    report: *mut c_char,
    report_len: usize,
    out_report_len: *mut usize,
) -> Status {
    ffi_call!({
        let plan = plan_ref(plan)?;
        let clean = out_ptr(out_clean, "out_clean")?;
        let iterations = if iterations == 0 {
            2 * plan.spec.stages + 1
        } else {
            iterations
        };
        let verdict = verify_within(&plan.protocol(iterations), &Budget::default())?;
        write_text(&verdict.report(), report, report_len, out_report_len)?;
        *clean = verdict.is_clean();
        Ok(())
    })
}

/// The CUDA C source of `op` (an `xcall_ws_op`) for `dtype` (f32 or bf16)
/// on `plan`, written like every text output (NULL `source` for the size).
///
/// Bad input: NULL plan or `out_len`: `XCALL_STATUS_NULL_ARGUMENT`; a freed
/// or foreign plan: `XCALL_STATUS_INVALID_HANDLE`; an unknown op:
/// `XCALL_STATUS_INVALID_ARGUMENT`; a dtype other than f32/bf16:
/// `XCALL_STATUS_UNSUPPORTED`; a plan the generated kernel cannot follow
/// (async warps with more than one load or tiles of different sizes):
/// `XCALL_STATUS_INVALID_ARGUMENT` naming the role; a buffer too small:
/// `XCALL_STATUS_INVALID_ARGUMENT` with the size needed.
#[no_mangle]
pub extern "C" fn xcall_ws_generate(
    plan: *const xcall_ws_plan,
    op: WsOpCode,
    dtype: DTypeCode,
    source: *mut c_char,
    source_len: usize,
    out_source_len: *mut usize,
) -> Status {
    ffi_call!({
        let plan = plan_ref(plan)?;
        let (op, dtype) = (op.get()?, dtype.get()?);
        if !matches!(dtype, DType::F32 | DType::Bf16) {
            return Err(FfiError::new(
                Status::Unsupported,
                format!("warp-specialized ops support f32 and bf16, not {dtype}"),
            ));
        }
        // generate refuses a plan whose async warps are not the op's operands.
        write_text(
            &generate(plan, op, dtype)?.source,
            source,
            source_len,
            out_source_len,
        )
    })
}

/// Writes the default op configuration (4 stages, 16 KiB tiles, 2 compute
/// warpgroups) to `*out_config`.
///
/// Bad input: NULL `out_config`: `XCALL_STATUS_NULL_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ws_op_config_default(out_config: *mut xcall_ws_op_config) -> Status {
    ffi_call!({
        let out = out_ptr(out_config, "out_config")?;
        let d = OpConfig::default();
        *out = xcall_ws_op_config {
            stages: d.stages,
            tile_bytes: d.tile_bytes,
            compute_warpgroups: d.compute_warpgroups,
        };
        Ok(())
    })
}

/// Runs a built-in op: `output = inputs[0] * inputs[1]` (`XCALL_WS_OP_MUL`)
/// or `output = silu(inputs[0]) * scale` (`XCALL_WS_OP_SILU_SCALE`) over
/// `bytes` bytes of `dtype` (f32 or bf16), through the warp-specialized
/// pipeline of `config` (NULL for the defaults). On a Host `target` the
/// pointers are host memory and the op runs vectorized over the cores,
/// writing the bytes the pipeline would (the config is checked all the
/// same, at every size); on CUDA (Hopper only) they are 16-byte
/// aligned device pointers of the target's device and the kernel is
/// enqueued on the target's stream. The output must not overlap an input.
///
/// Errors: `XCALL_STATUS_NULL_ARGUMENT`, `XCALL_STATUS_INVALID_ARGUMENT`
/// (sizes, alignment, overlap, operand count, config, unknown platform),
/// `XCALL_STATUS_NO_SUCH_DEVICE`,
/// `XCALL_STATUS_UNSUPPORTED` (dtype, non-Hopper GPU),
/// `XCALL_STATUS_CUDA_UNAVAILABLE`, `XCALL_STATUS_CUDA_DRIVER`,
/// `XCALL_STATUS_COMPILE_FAILED`, `XCALL_STATUS_TIMEOUT` (a stalled Host
/// pipeline). Thread-safe.
///
/// Bad input: as listed under Errors, each checked before anything runs
/// (sizes in 64 bits); nothing is written on an error.
// The C signature lists every argument of the call explicitly.
#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub extern "C" fn xcall_ws_run(
    target: *const xcall_target,
    op: WsOpCode,
    dtype: DTypeCode,
    config: *const xcall_ws_op_config,
    inputs: *const *const c_void,
    num_inputs: usize,
    output: *mut c_void,
    bytes: usize,
    scale: f32,
) -> Status {
    ffi_call!({
        // SAFETY: the caller's promises, as documented above.
        unsafe {
            run(
                target, op, dtype, config, inputs, num_inputs, output, bytes, scale, None, None,
            )
        }
    })
}

/// `xcall_ws_run` of `XCALL_WS_OP_SILU_SCALE` with one scale per group of
/// `group_bytes` bytes: `output = silu(inputs[0]) * scales[g]` over the
/// bytes `[g * group_bytes, (g + 1) * group_bytes)`, e.g. one scale per
/// expert over capacity-sized blocks of rows, so that one call covers every
/// expert. `scales` holds `bytes / group_bytes` floats (host memory on a
/// Host target, device memory of the target's device on CUDA), 4-byte
/// aligned, not overlapping the output; `group_bytes` divides `bytes` and
/// is a multiple of 16 (or equals `bytes`).
///
/// Errors: those of `xcall_ws_run`; `XCALL_STATUS_NULL_ARGUMENT` for NULL
/// `scales`; `XCALL_STATUS_INVALID_ARGUMENT` for an op other than
/// `XCALL_WS_OP_SILU_SCALE`, groups that do not divide the buffer,
/// misaligned scales or scales overlapping the output.
///
/// Bad input: as listed under Errors, each checked before anything runs
/// (sizes in 64 bits); nothing is written on an error.
#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub extern "C" fn xcall_ws_run_grouped(
    target: *const xcall_target,
    op: WsOpCode,
    dtype: DTypeCode,
    config: *const xcall_ws_op_config,
    inputs: *const *const c_void,
    num_inputs: usize,
    output: *mut c_void,
    bytes: usize,
    scales: *const f32,
    group_bytes: usize,
) -> Status {
    ffi_call!({
        let scales = GroupScales {
            addr: scales as u64,
            group_bytes: group_bytes as u64,
        };
        // SAFETY: the caller's promises, as documented above.
        unsafe {
            run(
                target,
                op,
                dtype,
                config,
                inputs,
                num_inputs,
                output,
                bytes,
                0.0,
                Some(scales),
                None,
            )
        }
    })
}

/// `xcall_ws_run_grouped` with groups of rows whose sizes are data (e.g.
/// each expert's row count, written on the device by the PE that routed
/// the rows): `output = silu(input) * scales[i]` over the rows of ragged
/// group `i`. The buffers are `segments` segments of `segment_bytes`
/// bytes (`bytes = segments * segment_bytes`); segment `s` holds
/// `groups` groups of whole rows of `row_bytes` bytes packed from its
/// first byte, group `(s, g)` being `rows[s * groups + g]` rows scaled by
/// `scales[s * groups + g]`. The bytes of a segment past its groups are
/// neither read nor written. `rows` (int64) and `scales` (float) hold
/// `segments * groups` values each (host memory on a Host target, device
/// memory on CUDA, where they are read when the kernel runs).
///
/// Errors: those of `xcall_ws_run`; `XCALL_STATUS_NULL_ARGUMENT` for NULL
/// `rows` or `scales`; `XCALL_STATUS_INVALID_ARGUMENT` for misaligned
/// `rows` (8 bytes) or `scales` (4), no segment or group or more than
/// 1024 groups in all, `row_bytes` not a positive multiple of 16 or not
/// dividing `segment_bytes`, segments not making `bytes`, `rows` or
/// `scales` overlapping the output; on Host also a negative count or
/// groups passing their segment's end (a CUDA kernel, which cannot fail,
/// takes a negative count as 0 and cuts groups at their segment's end);
/// `XCALL_STATUS_UNSUPPORTED` where the config's pipeline leaves no
/// shared memory for the groups' table.
///
/// Bad input: as listed under Errors, each checked before anything runs
/// (sizes in 64 bits); nothing is written on an error.
#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub extern "C" fn xcall_ws_run_ragged(
    target: *const xcall_target,
    dtype: DTypeCode,
    config: *const xcall_ws_op_config,
    input: *const c_void,
    output: *mut c_void,
    segments: usize,
    groups: usize,
    segment_bytes: usize,
    row_bytes: usize,
    rows: *const i64,
    scales: *const f32,
) -> Status {
    ffi_call!({
        let ragged = RaggedGroups {
            scales: scales as u64,
            rows: rows as u64,
            segments: segments as u64,
            groups: groups as u64,
            segment_bytes: segment_bytes as u64,
            row_bytes: row_bytes as u64,
        };
        let bytes = segments.checked_mul(segment_bytes).ok_or_else(|| {
            FfiError::new(
                Status::InvalidArgument,
                format!("{segments} segments of {segment_bytes} bytes overflow a size"),
            )
        })?;
        let inputs = [input];
        // SAFETY: the caller's promises, as documented above.
        unsafe {
            run(
                target,
                WsOpCode(ElementwiseOp::SiluScale as u32),
                dtype,
                config,
                inputs.as_ptr(),
                1,
                output,
                bytes,
                0.0,
                None,
                Some(ragged),
            )
        }
    })
}

/// What `xcall_ws_run`, `xcall_ws_run_grouped` and `xcall_ws_run_ragged`
/// do after reading their arguments.
///
/// # Safety
/// The pointers as the two functions document them.
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    target: *const xcall_target,
    op: WsOpCode,
    dtype: DTypeCode,
    config: *const xcall_ws_op_config,
    inputs: *const *const c_void,
    num_inputs: usize,
    output: *mut c_void,
    bytes: usize,
    scale: f32,
    scales: Option<GroupScales>,
    ragged: Option<RaggedGroups>,
) -> Result<(), FfiError> {
    let target = xcall_target::read(target, "target")?;
    let device = target.device()?;
    let stream = target.cuda_stream(device).unwrap_or(std::ptr::null_mut());
    let (op, dtype) = (op.get()?, dtype.get()?);
    // SAFETY: NULL or a valid config, per the documentation.
    let config = match unsafe { config.as_ref() } {
        Some(c) => OpConfig {
            stages: c.stages,
            tile_bytes: c.tile_bytes,
            compute_warpgroups: c.compute_warpgroups,
        },
        None => OpConfig::default(),
    };
    if inputs.is_null() {
        return Err(FfiError::new(Status::NullArgument, "inputs is NULL"));
    }
    if num_inputs != op.operands() {
        return Err(FfiError::new(
            Status::InvalidArgument,
            format!("{op:?} takes {} input(s), got {num_inputs}", op.operands()),
        ));
    }
    // SAFETY: the caller promises num_inputs readable pointers (and the
    // count was checked against the op before the read).
    let inputs: Vec<u64> = unsafe { std::slice::from_raw_parts(inputs, num_inputs) }
        .iter()
        .map(|&p| p as u64)
        .collect();
    let call = OpCall {
        sms: 0,
        device,
        stream,
        op,
        dtype,
        config,
        variant: xcall_warpspec::cuda::Variant::WarpSpecialized,
        host: xcall_warpspec::HostExecutor::Vectorized,
        inputs: &inputs,
        output: output as u64,
        bytes: bytes as u64,
        scale,
        scales,
        ragged,
    };
    // SAFETY: the caller's promises on the buffers and the stream, as
    // documented on the two functions.
    Ok(unsafe { xcall_warpspec::run(&call) }?)
}

c_code!(
    /// An `xcall_ws_op` as passed.
    WsOpCode => ElementwiseOp
);
