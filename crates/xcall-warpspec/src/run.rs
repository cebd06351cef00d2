//! One built-in op on raw addresses, on Host or CUDA: what the C ABI calls.
//!
//! [`run`] checks, in this order and before anything runs: the operand
//! count, NULL addresses, overlap of the output with every input (refused;
//! sizes in 64 bits), grouped scales (only `SiluScale` takes them; NULL,
//! alignment, groups that divide the buffer, overlap with the output) or
//! ragged groups (see [`check_ragged`]), the
//! Host device's ordinal, and on Host the dtype and the config (at every
//! size, an empty buffer included); then runs the op on the Host (with
//! the call's [`HostExecutor`]) or enqueues the warp-specialized kernel on the caller's
//! stream, with the process's prepared kernels ([`shared_kernels`]).

use std::sync::OnceLock;

use xcall_core::{DType, Device, Platform};

use crate::codegen::ElementwiseOp;
use crate::cuda::{DeviceBuffers, Variant, WsKernels};
use crate::ops::{
    check_ragged, check_scales, mul_host, ragged_pieces, silu_scale_host, silu_scale_pieces_host,
    GroupScales, HostExecutor, OpConfig, OpError, RaggedGroups, Scale,
};

/// A call of a built-in op.
#[derive(Clone, Copy, Debug)]
pub struct OpCall<'a> {
    /// Where it runs.
    pub device: Device,
    /// The `CUstream` on CUDA; ignored on Host.
    pub stream: *mut std::ffi::c_void,
    /// The op.
    pub op: ElementwiseOp,
    /// Element type of every operand and of the result.
    pub dtype: DType,
    /// The pipeline's shape.
    pub config: OpConfig,
    /// Which CUDA kernel runs (ignored on Host).
    pub variant: Variant,
    /// How the Host runs the op ([`HostExecutor::Vectorized`] unless a
    /// caller asks for the pipeline model; ignored on CUDA).
    pub host: HostExecutor,
    /// Operand addresses (host pointers or device pointers).
    pub inputs: &'a [u64],
    /// Result address.
    pub output: u64,
    /// Bytes of every operand and of the result.
    pub bytes: u64,
    /// The scale of `SiluScale` (ignored by `Mul`).
    pub scale: f32,
    /// `SiluScale`'s scales per group instead of `scale` (`Mul` takes
    /// none).
    pub scales: Option<GroupScales>,
    /// `SiluScale`'s ragged groups instead of `scale` or `scales`: only
    /// the groups' rows are read and written.
    pub ragged: Option<RaggedGroups>,
    /// SMs the CUDA kernel may occupy: 0 for every SM (ignored on Host).
    pub sms: u32,
}

/// The process's prepared CUDA kernels of the built-in ops (per device).
pub fn shared_kernels() -> &'static WsKernels {
    static KERNELS: OnceLock<WsKernels> = OnceLock::new();
    KERNELS.get_or_init(WsKernels::new)
}

/// The checks of [`run`] that need no device.
fn check(c: &OpCall<'_>) -> Result<(), OpError> {
    if c.inputs.len() != c.op.operands() {
        return Err(OpError::Input(format!(
            "{:?} takes {} input(s), got {}",
            c.op,
            c.op.operands(),
            c.inputs.len()
        )));
    }
    if c.output == 0 || c.inputs.contains(&0) {
        return Err(OpError::Null("an input or the output is NULL".into()));
    }
    for (i, &a) in c.inputs.iter().enumerate() {
        let o = c.output;
        if c.bytes > 0 && a < o.saturating_add(c.bytes) && o < a.saturating_add(c.bytes) {
            return Err(OpError::Input(format!("the output overlaps input {i}")));
        }
    }
    match (c.op, &c.scales, &c.ragged) {
        (_, None, None) => Ok(()),
        (ElementwiseOp::SiluScale, Some(s), None) => {
            check_scales(s, c.bytes, c.dtype.size_bytes() as u64, c.output).map(|_| ())
        }
        (ElementwiseOp::SiluScale, None, Some(r)) => check_ragged(r, c.bytes, c.output).map(|_| ()),
        (ElementwiseOp::SiluScale, Some(_), Some(_)) => Err(OpError::Input(
            "grouped scales and ragged groups cannot be combined".into(),
        )),
        (op, ..) => Err(OpError::Input(format!("{op:?} takes no scales"))),
    }
}

/// Runs `call`: on Host directly, on CUDA (Hopper) enqueued on its stream.
///
/// # Safety
/// Every input must be `bytes` readable bytes and the output `bytes`
/// writable bytes (and grouped scales `bytes / group_bytes` readable f32,
/// ragged groups' scales and counts `segments * groups` readable values)
/// of `call.device` (host memory on Host; on CUDA device
/// memory, until the enqueued kernel completes), and on CUDA the stream must
/// be a live stream of that device.
pub unsafe fn run(call: &OpCall<'_>) -> Result<(), OpError> {
    check(call)?;
    match call.device.platform {
        Platform::Host => {
            if call.device != Device::HOST {
                return Err(OpError::Platform(xcall_core::Error::NoSuchDevice {
                    device: call.device,
                    count: 1,
                }));
            }
            let bytes = usize::try_from(call.bytes).map_err(|_| {
                OpError::Input(format!("{} bytes exceed the address space", call.bytes))
            })?;
            // SAFETY: each input holds `bytes` readable bytes (the caller's
            // contract); the output overlaps none of them (checked).
            let ins: Vec<&[u8]> = call
                .inputs
                .iter()
                .map(|&p| unsafe { std::slice::from_raw_parts(p as *const u8, bytes) })
                .collect();
            // SAFETY: as above, for the output.
            let out = unsafe { std::slice::from_raw_parts_mut(call.output as *mut u8, bytes) };
            if let Some(r) = call.ragged {
                let n = r.count() as usize;
                // SAFETY: `n` i64 counts and `n` f32 scales at aligned
                // addresses (checked; the caller's contract), neither
                // overlapping the output (checked).
                let (rows, scales) = unsafe {
                    (
                        std::slice::from_raw_parts(r.rows as *const i64, n),
                        std::slice::from_raw_parts(r.scales as *const f32, n),
                    )
                };
                let pieces = ragged_pieces(&r, rows, scales)?;
                return silu_scale_pieces_host(
                    call.dtype,
                    ins[0],
                    &pieces,
                    out,
                    &call.config,
                    call.host,
                );
            }
            let scale = match call.scales {
                None => Scale::One(call.scale),
                Some(s) => Scale::PerGroup {
                    // SAFETY: `bytes / group_bytes` f32 at a 4-byte aligned
                    // address (checked; the caller's contract), not
                    // overlapping the output (checked).
                    scales: unsafe {
                        std::slice::from_raw_parts(
                            s.addr as *const f32,
                            (call.bytes / s.group_bytes) as usize,
                        )
                    },
                    group_bytes: s.group_bytes as usize,
                },
            };
            match call.op {
                ElementwiseOp::Mul => {
                    mul_host(call.dtype, ins[0], ins[1], out, &call.config, call.host)
                }
                ElementwiseOp::SiluScale => {
                    silu_scale_host(call.dtype, ins[0], scale, out, &call.config, call.host)
                }
            }
        }
        Platform::Cuda => {
            let buffers = DeviceBuffers {
                sms: call.sms,
                inputs: call.inputs,
                output: call.output,
                bytes: call.bytes,
                scales: call.scales,
                ragged: call.ragged,
            };
            // SAFETY: the caller's contract on the stream and the buffers.
            unsafe {
                shared_kernels().launch(
                    call.device,
                    call.stream.cast(),
                    call.op,
                    call.dtype,
                    call.variant,
                    &call.config,
                    &buffers,
                    call.scale,
                )
            }
            .map_err(OpError::Platform)
        }
    }
}
