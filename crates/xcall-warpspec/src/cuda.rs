//! The generated kernels on CUDA: compiled with NVRTC for sm_90a through
//! the core kernel cache (once per device and pipeline shape) and launched
//! as persistent kernels, one block per SM at most.

use std::ffi::c_void;

use cudarc::driver::sys;
use xcall_core::cuda::{self, driver_error};
use xcall_core::{DType, Device, Error, KernelCache, KernelSource, Result};

use crate::codegen::{generate, generate_plain, ElementwiseOp, GeneratedKernel};
use crate::ops::OpConfig;

/// Where the operands and the result live on the device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBuffers<'a> {
    /// Operand addresses (one per async warp), 16-byte aligned.
    pub inputs: &'a [u64],
    /// Result address, 16-byte aligned, not overlapping an input.
    pub output: u64,
    /// Bytes of every operand and of the result.
    pub bytes: u64,
}

/// Which kernel to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// The warp-specialized pipeline of the config.
    WarpSpecialized,
    /// The plain vectorized reference kernel.
    Plain,
}

fn check(device: Device, op: ElementwiseOp, dtype: DType, b: &DeviceBuffers<'_>) -> Result<()> {
    let info = cuda::device_info(device)?;
    if info.compute_capability.0 != 9 {
        return Err(Error::Unsupported(format!(
            "warp-specialized kernels need Hopper (sm_90); {device} is {} ({})",
            info.name,
            info.arch()
        )));
    }
    if !matches!(dtype, DType::F32 | DType::Bf16) {
        return Err(Error::Unsupported(format!(
            "warp-specialized ops support f32 and bf16, not {dtype}"
        )));
    }
    if b.inputs.len() != op.operands() {
        return Err(Error::InvalidArgument(format!(
            "{op:?} takes {} operand(s), got {}",
            op.operands(),
            b.inputs.len()
        )));
    }
    if b.bytes % dtype.size_bytes() as u64 != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} bytes is not a whole number of {dtype} elements",
            b.bytes
        )));
    }
    for (what, addr) in b
        .inputs
        .iter()
        .map(|a| ("input", *a))
        .chain([("output", b.output)])
    {
        if addr % 16 != 0 {
            return Err(Error::InvalidArgument(format!(
                "{what} address {addr:#x} is not 16-byte aligned"
            )));
        }
    }
    for (i, &a) in b.inputs.iter().enumerate() {
        if a < b.output.saturating_add(b.bytes) && b.output < a.saturating_add(b.bytes) {
            return Err(Error::InvalidArgument(format!("output overlaps input {i}")));
        }
    }
    Ok(())
}

/// Compiles (once per device) and launches `op` on `stream`. Returns the
/// generated kernel's facts.
///
/// # Safety
/// `stream` must be a live `CUstream` of `device`, and the buffers must be
/// device allocations of `device` holding `bytes` bytes each, alive until
/// the launch completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch(
    kernels: &KernelCache,
    device: Device,
    stream: sys::CUstream,
    op: ElementwiseOp,
    dtype: DType,
    variant: Variant,
    config: &OpConfig,
    buffers: &DeviceBuffers<'_>,
    scale: f32,
) -> Result<GeneratedKernel> {
    check(device, op, dtype, buffers)?;
    let generated = match variant {
        Variant::WarpSpecialized => {
            let plan = config
                .plan(op.operands())
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            generate(&plan, op, dtype)
        }
        Variant::Plain => generate_plain(op, dtype),
    };
    let options: &[&str] = &["--gpu-architecture=sm_90a", "-std=c++17"];
    let module = kernels.module(
        device,
        &KernelSource {
            name: &generated.name,
            code: &generated.source,
            options,
        },
    )?;
    let f = module.function(&generated.name)?;
    let info = cuda::device_info(device)?;
    if buffers.bytes == 0 {
        return Ok(generated);
    }
    let grid = match variant {
        Variant::WarpSpecialized => {
            let tiles = buffers.bytes.div_ceil(config.tile_bytes as u64);
            tiles.min(info.multiprocessors as u64) as u32
        }
        Variant::Plain => {
            (buffers.bytes.div_ceil(16).div_ceil(256)).min(info.multiprocessors as u64 * 8) as u32
        }
    };
    cuda::with_context(device, |_| {
        // SAFETY: sets an attribute of a function loaded in this context.
        unsafe {
            sys::cuFuncSetAttribute(
                f.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                generated.smem_bytes as i32,
            )
        }
        .result()
        .map_err(|e| driver_error("cuFuncSetAttribute", device, e))?;
        let mut ptrs: Vec<u64> = buffers.inputs.to_vec();
        ptrs.push(buffers.output);
        let (mut bytes, mut scale) = (buffers.bytes, scale);
        let mut params: Vec<*mut c_void> =
            ptrs.iter_mut().map(|p| (p as *mut u64).cast()).collect();
        params.push((&mut bytes as *mut u64).cast());
        params.push((&mut scale as *mut f32).cast());
        // SAFETY: the parameters match the generated signature (operands,
        // output, bytes, scale) and point to live locals; the buffers were
        // checked for alignment, overlap and element size.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                (grid, 1, 1),
                (generated.threads, 1, 1),
                generated.smem_bytes,
                stream,
                &mut params,
            )
        }
        .map_err(|e| driver_error("cuLaunchKernel", device, e))
    })?;
    Ok(generated)
}
