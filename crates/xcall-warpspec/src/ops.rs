//! Built-in warp-specialized ops: `mul(a, b)` with two async warps (one per
//! operand, the shape whose hand-written barriers hang when two producers
//! share one FULL barrier) and `silu(x) * scale` with one; f32 and
//! bf16. This module runs them on the Host, by default vectorized over the
//! buffer's elements ([`HostExecutor::Vectorized`]), or through the Host
//! executor's thread-by-thread model of the pipeline
//! ([`HostExecutor::Pipeline`], what the protocol tests run). Both compute
//! every element with the same f32 arithmetic and the same rounding, so
//! their outputs are equal bit for bit.

use std::sync::Mutex;
use std::time::Duration;

use xcall_core::{DType, FloatCodec};

use crate::host::{self, HostError};
use crate::host_vectorized::{silu_bf16_table, silu_f32, silu_run, vectorized, Block};
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

/// How the Host runs a built-in op. Both refuse the same input and write
/// the same bytes; they differ in speed and in what they exercise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HostExecutor {
    /// Blocks of elements decoded, computed and encoded in a loop, split
    /// over the machine's cores for large buffers. The config is checked
    /// (planned) as for the pipeline but shapes nothing.
    #[default]
    Vectorized,
    /// The pipeline of the config on the Host executor ([`host::run`]):
    /// producer and compute roles as threads on software mbarriers,
    /// tile by tile. Orders of magnitude slower; it runs the protocol the
    /// verifier checks and the CUDA kernels follow.
    Pipeline,
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

/// `silu(x) * scale` in f32, the definition both platforms follow (CUDA
/// with the fast exp and division: within a few ulp, see the tests).
pub fn silu_scale_f32(x: f32, scale: f32) -> f32 {
    silu_f32(x) * scale
}

/// Per-group scales of `silu(x) * scale` by address (host memory on Host,
/// device memory on CUDA): one f32 for every `group_bytes` bytes of the
/// buffer, e.g. one per expert over its capacity-sized block of rows, so
/// that one launch covers every expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupScales {
    /// Address of `bytes / group_bytes` f32 scales (4-byte aligned, not
    /// overlapping the output).
    pub addr: u64,
    /// Bytes of one group: a divisor of the buffer's bytes and a multiple
    /// of 16 (or the whole buffer).
    pub group_bytes: u64,
}

/// The most groups (segments x groups per segment) of one
/// [`RaggedGroups`] call: the CUDA kernels keep a table of them in shared
/// memory.
pub const MAX_RAGGED_GROUPS: u64 = 1024;

/// Bytes of the CUDA kernels' shared-memory table of `groups` ragged
/// groups (each group's first byte and length, then each group's first
/// work item and the item count, then each group's f32 scale).
pub fn ragged_table_bytes(groups: u64) -> u64 {
    28 * groups + 8
}

/// Where the ragged groups' table starts in a kernel's dynamic shared
/// memory: past the kernel's own `smem_bytes`, 16-byte aligned (the
/// templates' `@TABLE_OFF@`).
pub fn table_offset(smem_bytes: u32) -> u64 {
    (smem_bytes as u64).next_multiple_of(16)
}

/// Ragged groups of rows for `silu(x) * scale`, sized by data the caller
/// may write on the device (e.g. each expert's row count from a row-id
/// map, received from the PE that routed the rows): the buffer is
/// `segments` segments of `segment_bytes` bytes, and segment `s` holds
/// `groups` groups of whole rows packed from its first byte, group `(s,
/// g)` being `rows[s * groups + g]` rows of `row_bytes` bytes scaled by
/// `scales[s * groups + g]`. The bytes of a segment past its groups are
/// neither read nor written, so one launch covers every expert of every
/// sender whatever the routing, at the cost of the rows routed.
///
/// Counts are read when the op runs: the Host refuses a negative count or
/// groups passing their segment's end (nothing written); a CUDA kernel,
/// which cannot fail, takes a negative count as 0 and cuts groups at their
/// segment's end (nothing outside the segment is read or written).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RaggedGroups {
    /// Address of `segments * groups` f32 scales (4-byte aligned).
    pub scales: u64,
    /// Address of `segments * groups` i64 row counts (8-byte aligned).
    pub rows: u64,
    /// Segments: at least 1, with `groups`, at most
    /// [`MAX_RAGGED_GROUPS`] groups in all.
    pub segments: u64,
    /// Groups per segment: at least 1.
    pub groups: u64,
    /// Bytes of a segment: the op's bytes are `segments * segment_bytes`;
    /// a multiple of `row_bytes`.
    pub segment_bytes: u64,
    /// Bytes of a row: a positive multiple of 16.
    pub row_bytes: u64,
}

impl RaggedGroups {
    /// Groups in all (`segments * groups`; checked by [`check_ragged`]).
    pub fn count(&self) -> u64 {
        self.segments.saturating_mul(self.groups)
    }
}

/// Checks ragged groups for a `bytes`-byte buffer written at `output`:
/// NULL and alignment of the scales and the counts, the group count, the
/// segments covering the buffer exactly, whole 16-byte rows, and neither
/// array overlapping the output (64-bit sizes). Returns the groups in all.
pub fn check_ragged(r: &RaggedGroups, bytes: u64, output: u64) -> Result<u64, OpError> {
    if r.scales == 0 || r.rows == 0 {
        return Err(OpError::Null(
            "the ragged groups' scales or row counts are NULL".into(),
        ));
    }
    if r.scales % 4 != 0 || r.rows % 8 != 0 {
        return Err(OpError::Input(format!(
            "the scales at {:#x} must be 4-byte aligned and the row counts at {:#x} 8-byte aligned",
            r.scales, r.rows
        )));
    }
    let groups = r.count();
    if r.segments == 0 || r.groups == 0 || groups > MAX_RAGGED_GROUPS {
        return Err(OpError::Input(format!(
            "{} segments of {} groups: at least 1 of each and at most {MAX_RAGGED_GROUPS} groups in all",
            r.segments, r.groups
        )));
    }
    if r.row_bytes == 0 || r.row_bytes % 16 != 0 || r.segment_bytes % r.row_bytes != 0 {
        return Err(OpError::Input(format!(
            "rows of {} bytes in segments of {}: a row is a positive multiple of 16 bytes and divides a segment",
            r.row_bytes, r.segment_bytes
        )));
    }
    if r.segments.checked_mul(r.segment_bytes) != Some(bytes) {
        return Err(OpError::Input(format!(
            "{} segments of {} bytes do not make the buffer's {bytes} bytes",
            r.segments, r.segment_bytes
        )));
    }
    for (what, addr, size) in [("scales", r.scales, 4), ("row counts", r.rows, 8)] {
        let end = addr.checked_add(groups * size).ok_or_else(|| {
            OpError::Input(format!("the {what} pass the end of the address space"))
        })?;
        if bytes > 0 && addr < output.saturating_add(bytes) && output < end {
            return Err(OpError::Input(format!("the output overlaps the {what}")));
        }
    }
    Ok(groups)
}

/// The byte range and scale of every non-empty ragged group, from the
/// counts on the Host, or why the counts do not fit their segments.
pub fn ragged_pieces(
    r: &RaggedGroups,
    rows: &[i64],
    scales: &[f32],
) -> Result<Vec<(std::ops::Range<usize>, f32)>, OpError> {
    let mut pieces = Vec::new();
    for s in 0..r.segments {
        let mut at = 0u64;
        for g in 0..r.groups {
            let i = (s * r.groups + g) as usize;
            let n = u64::try_from(rows[i]).map_err(|_| {
                OpError::Input(format!(
                    "ragged group {g} of segment {s} has {} rows",
                    rows[i]
                ))
            })?;
            let end = n
                .checked_mul(r.row_bytes)
                .and_then(|b| b.checked_add(at))
                .filter(|&end| end <= r.segment_bytes)
                .ok_or_else(|| {
                    OpError::Input(format!(
                        "ragged group {g} of segment {s} ({n} rows of {} bytes from byte {at}) passes the segment's {} bytes",
                        r.row_bytes, r.segment_bytes
                    ))
                })?;
            if end > at {
                let base = s * r.segment_bytes;
                pieces.push(((base + at) as usize..(base + end) as usize, scales[i]));
            }
            at = end;
        }
    }
    Ok(pieces)
}

/// The scale of `silu(x) * scale` on the Host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale<'a> {
    /// One scale for every element.
    One(f32),
    /// `scales[g]` for the bytes `[g * group_bytes, (g + 1) * group_bytes)`.
    PerGroup {
        /// One scale per group.
        scales: &'a [f32],
        /// Bytes of a group (see [`GroupScales::group_bytes`]).
        group_bytes: usize,
    },
}

/// The number of scale groups of a `bytes`-byte buffer cut into groups of
/// `group_bytes`, or why it cannot be cut so.
pub fn groups_of(bytes: u64, group_bytes: u64) -> Result<u64, OpError> {
    if group_bytes == 0 || bytes % group_bytes != 0 {
        return Err(OpError::Input(format!(
            "scale groups of {group_bytes} bytes do not divide the buffer's {bytes} bytes"
        )));
    }
    if group_bytes != bytes && group_bytes % 16 != 0 {
        return Err(OpError::Input(format!(
            "scale groups of {group_bytes} bytes: a group is a multiple of 16 bytes (or the whole buffer)"
        )));
    }
    Ok(bytes / group_bytes)
}

/// Checks grouped scales at `s` for a `bytes`-byte buffer written at
/// `output` (`elem`-byte elements): NULL, alignment, the groups, and
/// overlap with the output (64-bit sizes). Returns the number of groups.
pub fn check_scales(s: &GroupScales, bytes: u64, elem: u64, output: u64) -> Result<u64, OpError> {
    if s.addr == 0 {
        return Err(OpError::Null("the scales are NULL".into()));
    }
    if s.addr % 4 != 0 {
        return Err(OpError::Input(format!(
            "the scales at {:#x} are not 4-byte aligned",
            s.addr
        )));
    }
    let groups = groups_of(bytes, s.group_bytes)?;
    if s.group_bytes % elem != 0 {
        return Err(OpError::Input(format!(
            "scale groups of {} bytes split {elem}-byte elements",
            s.group_bytes
        )));
    }
    let end = groups
        .checked_mul(4)
        .and_then(|n| s.addr.checked_add(n))
        .ok_or_else(|| OpError::Input("the scales pass the end of the address space".into()))?;
    if bytes > 0 && s.addr < output.saturating_add(bytes) && output < end {
        return Err(OpError::Input("the output overlaps the scales".into()));
    }
    Ok(groups)
}

/// The table of [`silu_bf16_table`](crate::host_vectorized) where the vectorized path takes it.
fn silu_table(dtype: DType, exec: HostExecutor) -> Option<&'static [f32]> {
    (dtype == DType::Bf16 && exec == HostExecutor::Vectorized).then(silu_bf16_table)
}

/// The codec of `dtype` and the plan of `config` for `operands` async
/// warps, or why the op cannot run them (checked at every size).
fn check_config(
    dtype: DType,
    config: &OpConfig,
    operands: usize,
) -> Result<(FloatCodec, PipelinePlan), OpError> {
    let codec = codec(dtype)?;
    let size = dtype.size_bytes();
    if config.tile_bytes as usize % size != 0 {
        return Err(OpError::Input(format!(
            "tile_bytes {} is not a multiple of {size}",
            config.tile_bytes
        )));
    }
    Ok((codec, config.plan(operands)?))
}

/// Runs the op over `inputs` with `exec`: through the plan of `config`,
/// where `f` maps the element index and the elements at that index of
/// every input to the output element, or vectorized, where `block` does
/// the same over a block of elements (the same f32 operations per
/// element). The config, the dtype and the sizes are checked first,
/// whatever the executor and the size (an empty buffer included).
fn run_elementwise(
    dtype: DType,
    inputs: &[&[u8]],
    out: &mut [u8],
    config: &OpConfig,
    exec: HostExecutor,
    f: impl Fn(usize, &[f32]) -> f32 + Sync,
    block: Block<'_>,
) -> Result<(), OpError> {
    let (codec, plan) = check_config(dtype, config, inputs.len())?;
    let size = dtype.size_bytes();
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
    if exec == HostExecutor::Vectorized {
        vectorized(codec, inputs, out, block);
        return Ok(());
    }
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
        let first = t.index * (tile / size);
        let mut out = tiles[t.index].lock().unwrap_or_else(|p| p.into_inner());
        let mut args = vec![0f32; t.inputs.len()];
        for i in lo..hi {
            for (a, input) in args.iter_mut().zip(&t.inputs) {
                *a = codec.load(input, i);
            }
            codec.store(&mut out, i, f(first + i, &args));
        }
    })?;
    Ok(())
}

/// `out = a * b` elementwise with `exec` (a pipeline of two async warps).
pub fn mul_host(
    dtype: DType,
    a: &[u8],
    b: &[u8],
    out: &mut [u8],
    config: &OpConfig,
    exec: HostExecutor,
) -> Result<(), OpError> {
    run_elementwise(
        dtype,
        &[a, b],
        out,
        config,
        exec,
        |_, v| v[0] * v[1],
        Block::F32(&|_, v, out| {
            for ((o, a), b) in out.iter_mut().zip(v[0]).zip(v[1]) {
                *o = a * b;
            }
        }),
    )
}

/// `out[range] = silu(x[range]) * scale` for every `(range, scale)` of
/// `pieces` (disjoint byte ranges inside the buffers, e.g. from
/// [`ragged_pieces`]) with `exec`; the rest of `out` is not written. The
/// config and every piece are checked before any is written.
pub fn silu_scale_pieces_host(
    dtype: DType,
    x: &[u8],
    pieces: &[(std::ops::Range<usize>, f32)],
    out: &mut [u8],
    config: &OpConfig,
    exec: HostExecutor,
) -> Result<(), OpError> {
    check_config(dtype, config, 1)?;
    if x.len() != out.len() {
        return Err(OpError::Input(format!(
            "input of {} bytes, output of {}: they must match",
            x.len(),
            out.len()
        )));
    }
    if let Some((range, _)) = pieces
        .iter()
        .find(|(r, _)| r.start > r.end || r.end > x.len())
    {
        return Err(OpError::Input(format!(
            "a piece {range:?} outside the {}-byte buffers",
            x.len()
        )));
    }
    let table = silu_table(dtype, exec);
    for (range, scale) in pieces {
        let (x, out) = match (x.get(range.clone()), out.get_mut(range.clone())) {
            (Some(x), Some(out)) => (x, out),
            _ => {
                return Err(OpError::Input(format!(
                    "a piece {range:?} outside the {}-byte buffers",
                    x.len()
                )))
            }
        };
        let plain = |_: usize, v: &[&[f32]], out: &mut [f32]| silu_run(None, v[0], out, *scale);
        run_elementwise(
            dtype,
            &[x],
            out,
            config,
            exec,
            |_, v| silu_scale_f32(v[0], *scale),
            match table {
                Some(_) => Block::SiluBf16(*scale),
                None => Block::F32(&plain),
            },
        )?;
    }
    Ok(())
}

/// `out = silu(x) * scale` elementwise with `exec` (a pipeline of one
/// async warp), with one scale or one per group.
pub fn silu_scale_host(
    dtype: DType,
    x: &[u8],
    scale: Scale<'_>,
    out: &mut [u8],
    config: &OpConfig,
    exec: HostExecutor,
) -> Result<(), OpError> {
    let table = silu_table(dtype, exec);
    match scale {
        Scale::One(s) => {
            let plain = |_: usize, v: &[&[f32]], out: &mut [f32]| silu_run(None, v[0], out, s);
            run_elementwise(
                dtype,
                &[x],
                out,
                config,
                exec,
                |_, v| silu_scale_f32(v[0], s),
                match table {
                    Some(_) => Block::SiluBf16(s),
                    None => Block::F32(&plain),
                },
            )
        }
        Scale::PerGroup {
            scales,
            group_bytes,
        } => {
            let groups = groups_of(out.len() as u64, group_bytes as u64)?;
            let size = dtype.size_bytes();
            if group_bytes % size != 0 || groups != scales.len() as u64 {
                return Err(OpError::Input(format!(
                    "{} scales for {groups} groups of {group_bytes} bytes ({dtype} elements)",
                    scales.len()
                )));
            }
            let per_group = group_bytes / size;
            run_elementwise(
                dtype,
                &[x],
                out,
                config,
                exec,
                |i, v| silu_scale_f32(v[0], scales[i / per_group]),
                // Runs of one group's elements at a time.
                Block::F32(&|first, v, out| {
                    let mut j = 0;
                    while j < out.len() {
                        let g = (first + j) / per_group;
                        let end = ((g + 1) * per_group - first).min(out.len());
                        silu_run(table, &v[0][j..end], &mut out[j..end], scales[g]);
                        j = end;
                    }
                }),
            )
        }
    }
}
