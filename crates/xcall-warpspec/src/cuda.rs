//! The generated kernels on CUDA: compiled with NVRTC for sm_90a through
//! the core kernel cache (once per device and pipeline shape) and launched
//! as persistent kernels, one block per SM at most. Everything a launch
//! needs besides the buffers (source, module, function, launch shape) is
//! prepared once per (device, op, dtype, variant, config) and reused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use xcall_core::cuda::{self, CudaFunction, Launch, Params, RawStream};
use xcall_core::kernel_cache::LoadedModule;
use xcall_core::{DType, Device, DeviceMap, Error, KernelCache, KernelSource, Result};

use crate::codegen::{
    generate, generate_plain, ElementwiseOp, GeneratedKernel, WsParams, PLAIN_TILE_BYTES,
};
use crate::ops::{
    check_ragged, check_scales, ragged_table_bytes, table_offset, GroupScales, OpConfig,
    RaggedGroups, MAX_RAGGED_GROUPS,
};

/// Where the operands and the result live on the device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBuffers<'a> {
    /// Operand addresses (one per async warp), 16-byte aligned.
    pub inputs: &'a [u64],
    /// Result address, 16-byte aligned, not overlapping an input.
    pub output: u64,
    /// Bytes of every operand and of the result.
    pub bytes: u64,
    /// `SiluScale`'s scales per group (device memory), or `None` for the
    /// launch's one scale.
    pub scales: Option<GroupScales>,
    /// `SiluScale`'s ragged groups (counts and scales in device memory)
    /// instead.
    pub ragged: Option<RaggedGroups>,
    /// SMs the kernel may occupy (one block each): 0 for every SM; fewer
    /// leave the others to work on other streams.
    pub sms: u32,
}

/// Which kernel to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The warp-specialized pipeline of the config.
    WarpSpecialized,
    /// The plain vectorized reference kernel.
    Plain,
}

/// Checks a launch's buffers; returns the bytes of a scale group (all of
/// them without grouped scales).
fn check(op: ElementwiseOp, dtype: DType, b: &DeviceBuffers<'_>) -> Result<u64> {
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
    match (op, &b.scales, &b.ragged) {
        (_, None, None) => Ok(b.bytes),
        (ElementwiseOp::SiluScale, Some(s), None) => {
            check_scales(s, b.bytes, dtype.size_bytes() as u64, b.output)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            Ok(s.group_bytes)
        }
        (ElementwiseOp::SiluScale, None, Some(r)) => {
            check_ragged(r, b.bytes, b.output)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            Ok(b.bytes)
        }
        (ElementwiseOp::SiluScale, Some(_), Some(_)) => Err(Error::InvalidArgument(
            "grouped scales and ragged groups cannot be combined".into(),
        )),
        (op, ..) => Err(Error::InvalidArgument(format!("{op:?} takes no scales"))),
    }
}

/// A kernel ready to launch on one device.
struct Prepared {
    function: CudaFunction,
    threads: u32,
    smem_bytes: u32,
    /// The dynamic shared memory the function may take: its own, and the
    /// table of [`MAX_RAGGED_GROUPS`] ragged groups where the device holds
    /// both.
    max_smem_bytes: u32,
    multiprocessors: u32,
    _module: Arc<LoadedModule>,
}

type PreparedKey = (ElementwiseOp, DType, Variant, OpConfig);

/// The warp-specialized ops on CUDA, with their compiled kernels and launch
/// shapes cached per device. Thread-safe; devices share no lock.
#[derive(Default)]
pub struct WsKernels {
    kernels: KernelCache,
    prepared: DeviceMap<Mutex<HashMap<PreparedKey, Arc<Prepared>>>>,
}

impl WsKernels {
    /// An empty cache; compiles nothing until the first launch.
    pub fn new() -> Self {
        Self::default()
    }

    fn prepare(&self, device: Device, key: PreparedKey) -> Result<Arc<Prepared>> {
        let slot = self
            .prepared
            .get_or_init(device, || Mutex::new(HashMap::new()));
        if let Some(p) = slot.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return Ok(p.clone());
        }
        let (op, dtype, variant, config) = key;
        let info = cuda::device_info(device)?;
        if info.compute_capability.0 != 9 {
            return Err(Error::Unsupported(format!(
                "warp-specialized kernels need Hopper (sm_90); {device} is {} ({})",
                info.name,
                info.arch()
            )));
        }
        let generated: GeneratedKernel = match variant {
            Variant::WarpSpecialized => {
                let plan = config
                    .plan(op.operands())
                    .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                generate(&plan, op, dtype).map_err(|e| Error::InvalidArgument(e.to_string()))?
            }
            Variant::Plain => generate_plain(op, dtype),
        };
        let options: &[&str] = &["--gpu-architecture=sm_90a", "-std=c++17"];
        let module = self.kernels.module(
            device,
            &KernelSource {
                name: &generated.name,
                code: &generated.source,
                options,
            },
        )?;
        let function = module.function(&generated.name)?;
        // Room for the ragged groups' table past the kernel's own shared
        // memory, where the device has it; otherwise the kernel's own.
        let with_table = table_offset(generated.smem_bytes) + ragged_table_bytes(MAX_RAGGED_GROUPS);
        let with_table = u32::try_from(with_table).unwrap_or(u32::MAX);
        let max_smem_bytes = match cuda::set_max_dynamic_shared(device, &function, with_table) {
            Ok(()) => with_table,
            Err(_) => {
                cuda::set_max_dynamic_shared(device, &function, generated.smem_bytes)?;
                generated.smem_bytes
            }
        };
        let prepared = Arc::new(Prepared {
            function,
            threads: generated.threads,
            smem_bytes: generated.smem_bytes,
            max_smem_bytes,
            multiprocessors: info.multiprocessors as u32,
            _module: module,
        });
        slot.lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, prepared.clone());
        Ok(prepared)
    }

    /// Launches `op` on `stream` (compiling and preparing it on first use
    /// for this device and shape).
    ///
    /// # Safety
    /// `stream` must be a live `CUstream` of `device`, and the buffers must be
    /// device allocations of `device` holding `bytes` bytes each, alive until
    /// the launch completes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        device: Device,
        stream: RawStream,
        op: ElementwiseOp,
        dtype: DType,
        variant: Variant,
        config: &OpConfig,
        buffers: &DeviceBuffers<'_>,
        scale: f32,
    ) -> Result<()> {
        let group_bytes = check(op, dtype, buffers)?;
        cuda::check_device(device)?;
        let p = self.prepare(device, (op, dtype, variant, *config))?;
        if buffers.bytes == 0 {
            return Ok(());
        }
        // Work items are the tiles of every group; the grid never exceeds
        // them.
        let (tile, blocks) = match variant {
            Variant::WarpSpecialized => (config.tile_bytes as u64, p.multiprocessors as u64),
            Variant::Plain => (PLAIN_TILE_BYTES, p.multiprocessors as u64 * 8),
        };
        // A budget of SMs caps the grid (the plain kernel's blocks per SM
        // alike).
        let blocks = match buffers.sms {
            0 => blocks,
            n => blocks.min(n as u64 * (blocks / p.multiprocessors.max(1) as u64)),
        };
        // Ragged groups: at most one partial tile per group beyond the
        // buffer's whole tiles.
        let items = match buffers.ragged {
            Some(r) => buffers.bytes.div_ceil(tile) + r.count(),
            None => (buffers.bytes / group_bytes) * group_bytes.div_ceil(tile),
        };
        let grid = items.min(blocks) as u32;
        let smem = match buffers.ragged {
            Some(r) => {
                let need = table_offset(p.smem_bytes) + ragged_table_bytes(r.count());
                if need > p.max_smem_bytes as u64 {
                    return Err(Error::Unsupported(format!(
                        "{} ragged groups need {need} bytes of shared memory with this pipeline; the kernel may take {}",
                        r.count(),
                        p.max_smem_bytes
                    )));
                }
                need as u32
            }
            None => p.smem_bytes,
        };
        // Zeros (no ragged groups) without them.
        let ragged = buffers.ragged.unwrap_or_default();
        let mut params = Params::new().record(&WsParams {
            src0: buffers.inputs[0],
            src1: buffers.inputs.get(1).copied().unwrap_or(0),
            dst: buffers.output,
            bytes: buffers.bytes,
            scales: buffers.scales.map_or(ragged.scales, |s| s.addr),
            group_bytes,
            rows: ragged.rows,
            segment_bytes: ragged.segment_bytes,
            row_bytes: ragged.row_bytes,
            segments: ragged.segments as u32,
            groups: ragged.groups as u32,
            scale,
            reserved: 0,
        });
        let config = Launch::linear(grid, p.threads, stream).with_shared(smem);
        // SAFETY: every generated kernel takes one `WsParams` (its C
        // definition generated from the Rust struct, layout asserted); the
        // buffers were checked for count, alignment, overlap and element
        // size.
        unsafe { cuda::launch(device, &p.function, config, &mut params) }
    }
}
