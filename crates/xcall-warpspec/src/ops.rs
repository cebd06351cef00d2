//! Built-in warp-specialized ops: `mul(a, b)` with two async warps (one per
//! operand, the shape whose hand-written barriers hang when two producers
//! share one FULL barrier) and `silu(x) * scale` with one; f32 and
//! bf16. This module runs them on the Host executor.

use std::sync::Mutex;
use std::time::Duration;

use xcall_core::{DType, FloatCodec};

use crate::host::{self, HostError};
use crate::plan::PipelinePlan;
use crate::spec::{PipelineSpec, RegisterSplit};
use crate::PlanError;

/// Shape of an op's pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpConfig {
    /// Stages.
    pub stages: u32,
    /// Bytes per tile per operand (a multiple of 16).
    pub tile_bytes: u32,
    /// Compute warpgroups.
    pub compute_warpgroups: u32,
}

impl Default for OpConfig {
    fn default() -> Self {
        OpConfig {
            stages: 4,
            tile_bytes: 16 * 1024,
            compute_warpgroups: 2,
        }
    }
}

impl OpConfig {
    /// The plan of an op with `operands` async warps.
    pub fn plan(&self, operands: usize) -> Result<PipelinePlan, PlanError> {
        let mut spec = PipelineSpec::new(
            self.stages,
            &vec![self.tile_bytes; operands],
            self.compute_warpgroups,
        );
        spec.registers = Some(RegisterSplit {
            producer: 40,
            consumer: 232,
        })
        .filter(|_| self.compute_warpgroups == 2);
        PipelinePlan::new(&spec)
    }
}

/// An error of an op.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// The pipeline could not be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The Host executor failed.
    #[error(transparent)]
    Host(#[from] HostError),
    /// Inputs that do not fit the op.
    #[error("{0}")]
    Input(String),
    /// Arguments the op does not support (a dtype).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A NULL address where memory is needed.
    #[error("{0}")]
    Null(String),
    /// The device or the CUDA layer refused.
    #[error(transparent)]
    Platform(#[from] xcall_core::Error),
}

impl OpError {
    /// The stable status code of this error.
    pub fn status(&self) -> xcall_core::Status {
        match self {
            OpError::Host(HostError::Stalled { .. }) => xcall_core::Status::Timeout,
            OpError::Unsupported(_) => xcall_core::Status::Unsupported,
            OpError::Plan(e) => e.status(),
            OpError::Null(_) => xcall_core::Status::NullArgument,
            OpError::Platform(e) => e.status(),
            _ => xcall_core::Status::InvalidArgument,
        }
    }
}

/// The codec of the op's element type (the ops support f32 and bf16).
fn codec(dtype: DType) -> Result<FloatCodec, OpError> {
    FloatCodec::new(dtype)
        .filter(|_| dtype != DType::F16)
        .ok_or_else(|| {
            OpError::Unsupported(format!(
                "warp-specialized ops support f32 and bf16, not {dtype}"
            ))
        })
}

/// `silu(x) * scale` in f32, the definition both platforms follow.
pub fn silu_scale_f32(x: f32, scale: f32) -> f32 {
    x / (1.0 + (-x).exp()) * scale
}

/// Streams `inputs` through the plan; `f` maps the elements at one index of
/// every input to the output element.
fn run_elementwise(
    dtype: DType,
    inputs: &[&[u8]],
    out: &mut [u8],
    config: &OpConfig,
    f: impl Fn(&[f32]) -> f32 + Sync,
) -> Result<(), OpError> {
    let codec = codec(dtype)?;
    let size = dtype.size_bytes();
    if config.tile_bytes as usize % size != 0 {
        return Err(OpError::Input(format!(
            "tile_bytes {} is not a multiple of {size}",
            config.tile_bytes
        )));
    }
    for (k, input) in inputs.iter().enumerate() {
        if input.len() != out.len() || input.len() % size != 0 {
            return Err(OpError::Input(format!(
                "input {k} has {} bytes, the output {}: both must hold whole {dtype} elements and match",
                input.len(),
                out.len()
            )));
        }
    }
    if out.is_empty() {
        return Ok(());
    }
    let plan = config.plan(inputs.len())?;
    let tile = config.tile_bytes as usize;
    let tiles: Vec<Mutex<&mut [u8]>> = out.chunks_mut(tile).map(Mutex::new).collect();
    host::run(&plan, inputs, Duration::from_secs(10), |t| {
        let elements = t.inputs[0].len() / size;
        // Each compute warpgroup takes its share of the tile's elements.
        let per = elements.div_ceil(t.warpgroups as usize);
        let (lo, hi) = (
            (t.warpgroup as usize * per).min(elements),
            ((t.warpgroup as usize + 1) * per).min(elements),
        );
        let mut out = tiles[t.index].lock().unwrap_or_else(|p| p.into_inner());
        let mut args = vec![0f32; t.inputs.len()];
        for i in lo..hi {
            for (a, input) in args.iter_mut().zip(&t.inputs) {
                *a = codec.load(input, i);
            }
            codec.store(&mut out, i, f(&args));
        }
    })?;
    Ok(())
}

/// `out = a * b` elementwise on the Host executor (two async warps).
pub fn mul_host(
    dtype: DType,
    a: &[u8],
    b: &[u8],
    out: &mut [u8],
    config: &OpConfig,
) -> Result<(), OpError> {
    run_elementwise(dtype, &[a, b], out, config, |v| v[0] * v[1])
}

/// `out = silu(x) * scale` elementwise on the Host executor (one async warp).
pub fn silu_scale_host(
    dtype: DType,
    x: &[u8],
    scale: f32,
    out: &mut [u8],
    config: &OpConfig,
) -> Result<(), OpError> {
    run_elementwise(dtype, &[x], out, config, |v| silu_scale_f32(v[0], scale))
}
