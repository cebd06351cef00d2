//! The ops on raw addresses, for Host and CUDA alike: what the C ABI and
//! runtime integrations call.
//!
//! Every call first checks, in this order, and writes nothing when a check
//! fails: dtypes, ranks and shapes against each other; NULL addresses of
//! non-empty tensors; alignment to the element size; overlap of every
//! output with every input and with the other outputs (refused as
//! [`PermuteError::Aliased`] naming both buffers). Only then does it run,
//! on Host directly, on CUDA enqueued on the target's stream.
//!
//! In-place variants (`in_place: true` on `permute` and
//! `sort_chunks_by_map`) accept outputs overlapping inputs: every input
//! that overlaps an output is first copied to scratch (Host memory, or
//! stream-ordered device memory on CUDA) and the op reads the copy. The
//! cost is one extra read and write of those inputs and the scratch for
//! the duration of the call. Outputs overlapping each other stay refused.

use std::ffi::c_void;

use xcall_core::{DType, Device, Platform};

use crate::alias::{self, Op, Region};
use crate::chunks::{self, Direction};
use crate::error::{shape, PermuteError};
use crate::ops;
use crate::row_id_map::{self, MapFaults, RowIdMapOptions, RowIdMapRef};

/// Where an op runs.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The device every tensor lives on.
    pub device: Device,
    /// The `CUstream` on CUDA (not the legacy NULL stream); ignored on Host.
    pub stream: *mut c_void,
    /// Whether CUDA launches may autotune (see the crate docs). Defaults
    /// to on unless `XCALL_PERMUTE_AUTOTUNE=0`.
    pub autotune: bool,
    /// Checked mode on CUDA: ops that follow a row-id map check all of it
    /// on the device first (bounds, kept rows, unique rows, counts: what
    /// the Host checks) and, unless the stream is capturing, wait for the
    /// verdict, failing with nothing written. Under capture the check runs
    /// in the graph and records [`MapFaults`] for [`take_faults`]. Defaults
    /// to off unless `XCALL_PERMUTE_CHECK=1`. The Host always checks.
    pub checked: bool,
}

impl Target {
    /// The Host.
    pub fn host() -> Self {
        Target {
            device: Device::HOST,
            stream: std::ptr::null_mut(),
            autotune: false,
            checked: true,
        }
    }

    /// CUDA device `ordinal`, work enqueued on `stream`.
    pub fn cuda(ordinal: u32, stream: *mut c_void) -> Self {
        Target {
            device: Device::cuda(ordinal),
            stream,
            autotune: autotune_default(),
            checked: checked_default(),
        }
    }
}

/// Autotuning unless `XCALL_PERMUTE_AUTOTUNE` is `0`.
pub fn autotune_default() -> bool {
    std::env::var("XCALL_PERMUTE_AUTOTUNE").map_or(true, |v| v.trim() != "0")
}

/// Checked mode when `XCALL_PERMUTE_CHECK` is `1`.
pub fn checked_default() -> bool {
    std::env::var("XCALL_PERMUTE_CHECK").is_ok_and(|v| v.trim() == "1")
}

/// Waits for the target's stream and returns the map faults the device's
/// kernels recorded since the last call (then clears them). The record is
/// per device, not per stream. Always empty on Host, which refuses a bad
/// map before any work.
pub fn take_faults(target: &Target) -> Result<MapFaults, PermuteError> {
    match target.device.platform {
        Platform::Host => Ok(MapFaults(0)),
        Platform::Cuda => crate::cuda::take_faults(target).map(MapFaults),
    }
}

/// A tensor: address (a host pointer or a `CUdeviceptr`), dtype, dims
/// (row-major, dense).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor {
    /// First byte.
    pub address: u64,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub dims: Vec<u64>,
}

impl Tensor {
    /// A tensor at `address`.
    pub fn new(address: u64, dtype: DType, dims: &[u64]) -> Self {
        Tensor {
            address,
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// A tensor over a host slice.
    pub fn of<T>(data: &[T], dtype: DType, dims: &[u64]) -> Self {
        Self::new(data.as_ptr() as u64, dtype, dims)
    }

    /// Bytes, once [`check`] accepted the tensor.
    pub fn bytes(&self) -> u64 {
        self.dims.iter().product::<u64>() * self.dtype.size_bytes() as u64
    }

    fn region<'a>(&self, name: &'a str) -> Region<'a> {
        Region {
            name,
            address: self.address,
            bytes: self.bytes(),
        }
    }
}

/// Checks dtype, rank, size, NULL and alignment of one tensor.
fn check(name: &str, t: &Tensor, dtypes: &[DType], rank: usize) -> Result<(), PermuteError> {
    if !dtypes.contains(&t.dtype) {
        let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
        return Err(PermuteError::Unsupported(format!(
            "{name} is {}, expected {}",
            t.dtype,
            names.join(" or ")
        )));
    }
    if t.dims.len() != rank {
        return Err(shape(format!(
            "{name} has rank {} (dims {:?}), expected rank {rank}",
            t.dims.len(),
            t.dims
        )));
    }
    let bytes = t
        .dims
        .iter()
        .try_fold(t.dtype.size_bytes() as u64, |acc, &d| acc.checked_mul(d))
        .filter(|&b| b < i64::MAX as u64 && t.address.checked_add(b).is_some())
        .ok_or_else(|| {
            shape(format!(
                "{name} dims {:?} overflow the address space",
                t.dims
            ))
        })?;
    if bytes > 0 && t.address == 0 {
        return Err(PermuteError::Null(format!(
            "{name} is NULL but holds {bytes} bytes"
        )));
    }
    let align = t.dtype.size_bytes() as u64;
    if bytes > 0 && t.address % align != 0 {
        return Err(shape(format!(
            "{name} address {:#x} is not aligned to its {align}-byte {} elements",
            t.address, t.dtype
        )));
    }
    Ok(())
}

fn dim(name: &str, t: &Tensor, axis: usize, want: u64, meaning: &str) -> Result<(), PermuteError> {
    if t.dims[axis] == want {
        Ok(())
    } else {
        Err(shape(format!(
            "{name} dim {axis} is {}, expected {want} ({meaning})",
            t.dims[axis]
        )))
    }
}

fn usize_of(v: u64) -> usize {
    // Checked tensors' dims multiply to less than i64::MAX bytes.
    v as usize
}

/// Refuses overlaps (see the module docs); `in_place` allows outputs over
/// inputs, which [`Staged`] then copies away.
fn check_overlap(
    op: Op,
    inputs: &[(&str, &Tensor)],
    outputs: &[(&str, &Tensor)],
    in_place: bool,
) -> Result<(), PermuteError> {
    let ins: Vec<Region<'_>> = inputs.iter().map(|(n, t)| t.region(n)).collect();
    let outs: Vec<Region<'_>> = outputs.iter().map(|(n, t)| t.region(n)).collect();
    let mut allowed: Vec<(&str, &str)> = alias::alias_table(op).to_vec();
    if in_place {
        for (i, _) in inputs {
            for (o, _) in outputs {
                allowed.push((i, o));
            }
        }
    }
    alias::check(&ins, &outs, &allowed)
}

/// Copies of inputs that overlap an output (in-place calls); the copies
/// live until the value is dropped (on CUDA: freed in stream order).
struct Staged {
    host: Vec<Vec<u64>>,
    cuda: Vec<crate::cuda::Scratch>,
}

impl Staged {
    fn new() -> Self {
        Staged {
            host: Vec::new(),
            cuda: Vec::new(),
        }
    }

    /// Points `input` at a copy of itself when it overlaps any output.
    fn stage(
        &mut self,
        target: &Target,
        input: &mut Tensor,
        outputs: &[&Tensor],
    ) -> Result<(), PermuteError> {
        let r = input.region("input");
        if !outputs
            .iter()
            .any(|o| alias::check(&[r], &[o.region("output")], &[]).is_err())
        {
            return Ok(());
        }
        let bytes = usize_of(input.bytes());
        match target.device.platform {
            Platform::Host => {
                let mut copy = vec![0u64; bytes.div_ceil(8)];
                // SAFETY: `input` was checked (non-NULL, `bytes` long) and
                // the copy is at least `bytes` long; they do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        input.address as *const u8,
                        copy.as_mut_ptr().cast::<u8>(),
                        bytes,
                    )
                };
                input.address = copy.as_ptr() as u64;
                self.host.push(copy);
            }
            Platform::Cuda => {
                let scratch = crate::cuda::Scratch::copy_of(target, input.address, bytes as u64)?;
                input.address = scratch.address();
                self.cuda.push(scratch);
            }
        }
        Ok(())
    }
}

/// # Safety (of every `unsafe fn` here)
/// Each tensor's address must be valid for its bytes on `target.device`
/// (readable for inputs, writable for outputs) for the duration of the
/// call on Host, and until the enqueued work completes on CUDA; `stream`
/// must be a live stream of that device.
unsafe fn host_slice<'a, T>(t: &Tensor) -> &'a [T] {
    let n = usize_of(t.bytes()) / std::mem::size_of::<T>();
    if n == 0 {
        &[]
    } else {
        // SAFETY: see the function docs; checked non-NULL and aligned.
        unsafe { std::slice::from_raw_parts(t.address as *const T, n) }
    }
}

/// See [`host_slice`]; the overlap check makes the slice exclusive.
#[allow(clippy::mut_from_ref)]
unsafe fn host_slice_mut<'a, T>(t: &Tensor) -> &'a mut [T] {
    let n = usize_of(t.bytes()) / std::mem::size_of::<T>();
    if n == 0 {
        &mut []
    } else {
        // SAFETY: see host_slice; no other slice of the call overlaps it.
        unsafe { std::slice::from_raw_parts_mut(t.address as *mut T, n) }
    }
}

/// Arguments of [`make_row_id_map`].
#[derive(Clone, Debug)]
pub struct MakeRowIdMapArgs {
    /// `[T, E]` u8 or bool; any nonzero byte is a route.
    pub routing: Tensor,
    /// See [`RowIdMapOptions`].
    pub options: RowIdMapOptions,
    /// Output `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// Output `[E]` i64: routes kept per expert.
    pub tokens_per_expert: Tensor,
    /// Output `[E + 1]` i64: first row of each expert's (padded) chunk,
    /// then the end of the last chunk.
    pub expert_offsets: Tensor,
}

/// Shape facts of a checked call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Tokens `T`.
    pub tokens: usize,
    /// Experts `E` (0 for chunk sort).
    pub experts: usize,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Permuted rows `N`.
    pub out_rows: usize,
    /// Scales per token `S` (0 without scales).
    pub scales: usize,
}

/// Builds the row-id map; see [`row_id_map::make_row_id_map`].
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn make_row_id_map(target: &Target, a: &MakeRowIdMapArgs) -> Result<(), PermuteError> {
    check("routing", &a.routing, &[DType::U8, DType::Bool], 2)?;
    let (t, e) = (a.routing.dims[0], a.routing.dims[1]);
    if e == 0 {
        return Err(shape("a routing map needs at least 1 expert"));
    }
    if e > i32::MAX as u64 {
        return Err(shape(format!(
            "routing has {e} experts: expert ids do not fit the i32 row-id map"
        )));
    }
    check("row_id_map", &a.row_id_map, &[DType::I32], 2)?;
    dim("row_id_map", &a.row_id_map, 0, t, "tokens")?;
    dim("row_id_map", &a.row_id_map, 1, 2 * e + 1, "2 * experts + 1")?;
    check("tokens_per_expert", &a.tokens_per_expert, &[DType::I64], 1)?;
    dim("tokens_per_expert", &a.tokens_per_expert, 0, e, "experts")?;
    check("expert_offsets", &a.expert_offsets, &[DType::I64], 1)?;
    dim("expert_offsets", &a.expert_offsets, 0, e + 1, "experts + 1")?;
    row_id_map::check_layout(a.options, usize_of(t), usize_of(e))?;
    check_overlap(
        Op::MakeRowIdMap,
        &[("routing", &a.routing)],
        &[
            ("row_id_map", &a.row_id_map),
            ("tokens_per_expert", &a.tokens_per_expert),
            ("expert_offsets", &a.expert_offsets),
        ],
        false,
    )?;
    let dims = Dims {
        tokens: usize_of(t),
        experts: usize_of(e),
        hidden: 0,
        out_rows: 0,
        scales: 0,
    };
    match target.device.platform {
        Platform::Host => {
            // SAFETY: checked tensors, see the function docs.
            let routing = unsafe { host_slice::<u8>(&a.routing) };
            let map = row_id_map::make_row_id_map(routing, dims.tokens, dims.experts, a.options)?;
            // SAFETY: as above; outputs overlap nothing.
            unsafe {
                host_slice_mut::<i32>(&a.row_id_map).copy_from_slice(&map.map);
                host_slice_mut::<i64>(&a.tokens_per_expert).copy_from_slice(&map.tokens_per_expert);
                host_slice_mut::<i64>(&a.expert_offsets).copy_from_slice(&map.expert_offsets);
            }
            Ok(())
        }
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::make_row_id_map(target, a, dims) },
    }
}

/// Arguments of [`permute`].
#[derive(Clone, Debug)]
pub struct PermuteArgs {
    /// `[T, H]`, any dtype.
    pub input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// `[E]` i64, from `make_row_id_map`.
    pub tokens_per_expert: Tensor,
    /// `[E + 1]` i64, from `make_row_id_map`.
    pub expert_offsets: Tensor,
    /// Optional `[T, E]` f32.
    pub probs: Option<Tensor>,
    /// Optional `[T, S]` f32.
    pub scales: Option<Tensor>,
    /// Output `[N, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[N]` f32, with `probs`.
    pub permuted_probs: Option<Tensor>,
    /// Output `[N, S]` f32, with `scales`.
    pub permuted_scales: Option<Tensor>,
    /// Outputs may overlap inputs (see the module docs).
    pub in_place: bool,
}

fn pair<'a>(
    input: (&'a str, &'a Option<Tensor>),
    output: (&'a str, &'a Option<Tensor>),
) -> Result<Option<(&'a Tensor, &'a Tensor)>, PermuteError> {
    match (input.1, output.1) {
        (Some(i), Some(o)) => Ok(Some((i, o))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(shape(format!("{} given without {}", input.0, output.0))),
        (None, Some(_)) => Err(shape(format!("{} given without {}", output.0, input.0))),
    }
}

fn check_map(a: &Tensor, t: u64) -> Result<u64, PermuteError> {
    check("row_id_map", a, &[DType::I32], 2)?;
    dim("row_id_map", a, 0, t, "tokens")?;
    let w = a.dims[1];
    if w < 3 || w % 2 == 0 {
        return Err(shape(format!(
            "row_id_map dim 1 is {w}, expected 2 * experts + 1 with experts >= 1"
        )));
    }
    Ok((w - 1) / 2)
}

fn check_chunks(tpe: &Tensor, offsets: &Tensor, e: u64) -> Result<(), PermuteError> {
    check("tokens_per_expert", tpe, &[DType::I64], 1)?;
    dim("tokens_per_expert", tpe, 0, e, "experts")?;
    check("expert_offsets", offsets, &[DType::I64], 1)?;
    dim("expert_offsets", offsets, 0, e + 1, "experts + 1")
}

/// Checks a permute call; returns its dims.
fn check_permute(a: &PermuteArgs) -> Result<Dims, PermuteError> {
    check("input", &a.input, &DType::ALL, 2)?;
    let (t, h) = (a.input.dims[0], a.input.dims[1]);
    let e = check_map(&a.row_id_map, t)?;
    check_chunks(&a.tokens_per_expert, &a.expert_offsets, e)?;
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    let n = a.output.dims[0];
    if n > i32::MAX as u64 {
        return Err(shape(format!(
            "{n} output rows do not fit the i32 row-id map"
        )));
    }
    if let Some((p, pp)) = pair(("probs", &a.probs), ("permuted_probs", &a.permuted_probs))? {
        check("probs", p, &[DType::F32], 2)?;
        dim("probs", p, 0, t, "tokens")?;
        dim("probs", p, 1, e, "experts")?;
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, n, "output rows")?;
    }
    let mut s = 0;
    if let Some((sc, ps)) = pair(
        ("scales", &a.scales),
        ("permuted_scales", &a.permuted_scales),
    )? {
        check("scales", sc, &[DType::F32], 2)?;
        dim("scales", sc, 0, t, "tokens")?;
        s = sc.dims[1];
        check("permuted_scales", ps, &[DType::F32], 2)?;
        dim("permuted_scales", ps, 0, n, "output rows")?;
        dim("permuted_scales", ps, 1, s, "scales per token")?;
    }
    let mut ins = vec![
        ("input", &a.input),
        ("row_id_map", &a.row_id_map),
        ("tokens_per_expert", &a.tokens_per_expert),
        ("expert_offsets", &a.expert_offsets),
    ];
    ins.extend(a.probs.as_ref().map(|p| ("probs", p)));
    ins.extend(a.scales.as_ref().map(|p| ("scales", p)));
    let mut outs = vec![("output", &a.output)];
    outs.extend(a.permuted_probs.as_ref().map(|p| ("permuted_probs", p)));
    outs.extend(a.permuted_scales.as_ref().map(|p| ("permuted_scales", p)));
    check_overlap(Op::Permute, &ins, &outs, a.in_place)?;
    Ok(Dims {
        tokens: usize_of(t),
        experts: usize_of(e),
        hidden: usize_of(h),
        out_rows: usize_of(n),
        scales: usize_of(s),
    })
}

fn outputs_of(list: &[&Option<Tensor>], first: &Tensor) -> Vec<Tensor> {
    std::iter::once(first.clone())
        .chain(list.iter().filter_map(|o| (*o).clone()))
        .collect()
}

/// Groups tokens by expert; see [`ops::permute`].
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn permute(target: &Target, a: &PermuteArgs) -> Result<(), PermuteError> {
    let dims = check_permute(a)?;
    let mut a = a.clone();
    let mut staged = Staged::new();
    if a.in_place {
        let outs = outputs_of(&[&a.permuted_probs, &a.permuted_scales], &a.output);
        let outs: Vec<&Tensor> = outs.iter().collect();
        staged.stage(target, &mut a.input, &outs)?;
        staged.stage(target, &mut a.row_id_map, &outs)?;
        staged.stage(target, &mut a.tokens_per_expert, &outs)?;
        staged.stage(target, &mut a.expert_offsets, &outs)?;
        for t in [&mut a.probs, &mut a.scales].into_iter().flatten() {
            staged.stage(target, t, &outs)?;
        }
    }
    match target.device.platform {
        // SAFETY: checked tensors, see the function docs; staged inputs no
        // longer overlap outputs.
        Platform::Host => unsafe {
            let map = RowIdMapRef::new(
                dims.tokens,
                dims.experts,
                host_slice(&a.row_id_map),
                host_slice(&a.tokens_per_expert),
                host_slice(&a.expert_offsets),
                dims.out_rows,
            )?;
            ops::permute(
                map,
                &ops::PermuteInputs {
                    input: host_slice(&a.input),
                    dtype: a.input.dtype,
                    hidden: dims.hidden,
                    probs: a.probs.as_ref().map(|t| host_slice(t)),
                    scales: a.scales.as_ref().map(|t| host_slice(t)),
                },
                &mut ops::PermuteOutputs {
                    output: host_slice_mut(&a.output),
                    permuted_probs: a.permuted_probs.as_ref().map(|t| host_slice_mut(t)),
                    permuted_scales: a.permuted_scales.as_ref().map(|t| host_slice_mut(t)),
                },
            )
        },
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::permute(target, &a, dims) },
    }
}

/// Arguments of [`unpermute`].
#[derive(Clone, Debug)]
pub struct UnpermuteArgs {
    /// `[N, H]` f32, f16 or bf16 (f8e4m3/f8e5m2 without merging probs).
    pub input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// Optional `[T, E]` f32 merging weights.
    pub merging_probs: Option<Tensor>,
    /// Optional `[N]` f32 to scatter back.
    pub permuted_probs: Option<Tensor>,
    /// Output `[T, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[T, E]` f32, with `permuted_probs`.
    pub unpermuted_probs: Option<Tensor>,
}

fn check_unpermute(a: &UnpermuteArgs) -> Result<Dims, PermuteError> {
    let dtypes: &[DType] = if a.merging_probs.is_some() {
        &[DType::F32, DType::F16, DType::Bf16]
    } else {
        &[
            DType::F32,
            DType::F16,
            DType::Bf16,
            DType::F8E4M3,
            DType::F8E5M2,
        ]
    };
    check("input", &a.input, dtypes, 2).map_err(|e| match e {
        PermuteError::Unsupported(m) => PermuteError::Unsupported(format!(
            "{m}: unpermute accumulates in f32 (fp8 only without merging_probs)"
        )),
        e => e,
    })?;
    let (n, h) = (a.input.dims[0], a.input.dims[1]);
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    let t = a.output.dims[0];
    let e = check_map(&a.row_id_map, t)?;
    if let Some(m) = &a.merging_probs {
        check("merging_probs", m, &[DType::F32], 2)?;
        dim("merging_probs", m, 0, t, "tokens")?;
        dim("merging_probs", m, 1, e, "experts")?;
    }
    if let Some((pp, up)) = pair(
        ("permuted_probs", &a.permuted_probs),
        ("unpermuted_probs", &a.unpermuted_probs),
    )? {
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, n, "input rows")?;
        check("unpermuted_probs", up, &[DType::F32], 2)?;
        dim("unpermuted_probs", up, 0, t, "tokens")?;
        dim("unpermuted_probs", up, 1, e, "experts")?;
    }
    let mut ins = vec![("input", &a.input), ("row_id_map", &a.row_id_map)];
    ins.extend(a.merging_probs.as_ref().map(|p| ("merging_probs", p)));
    ins.extend(a.permuted_probs.as_ref().map(|p| ("permuted_probs", p)));
    let mut outs = vec![("output", &a.output)];
    outs.extend(a.unpermuted_probs.as_ref().map(|p| ("unpermuted_probs", p)));
    check_overlap(Op::Unpermute, &ins, &outs, false)?;
    Ok(Dims {
        tokens: usize_of(t),
        experts: usize_of(e),
        hidden: usize_of(h),
        out_rows: usize_of(n),
        scales: 0,
    })
}

/// Restores token order; see [`ops::unpermute`].
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn unpermute(target: &Target, a: &UnpermuteArgs) -> Result<(), PermuteError> {
    let dims = check_unpermute(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the function docs.
        Platform::Host => unsafe {
            let map = RowIdMapRef::routes_only(
                dims.tokens,
                dims.experts,
                host_slice(&a.row_id_map),
                dims.out_rows,
            )?;
            ops::unpermute(
                map,
                &ops::UnpermuteInputs {
                    input: host_slice(&a.input),
                    dtype: a.input.dtype,
                    hidden: dims.hidden,
                    merging_probs: a.merging_probs.as_ref().map(|t| host_slice(t)),
                    permuted_probs: a.permuted_probs.as_ref().map(|t| host_slice(t)),
                },
                &mut ops::UnpermuteOutputs {
                    output: host_slice_mut(&a.output),
                    unpermuted_probs: a.unpermuted_probs.as_ref().map(|t| host_slice_mut(t)),
                },
            )
        },
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::unpermute(target, a, dims) },
    }
}

/// Arguments of [`unpermute_backward`].
#[derive(Clone, Debug)]
pub struct UnpermuteBackwardArgs {
    /// `[T, H]` f32, f16 or bf16.
    pub grad: Tensor,
    /// `[N, H]`, the forward input of `unpermute`.
    pub fwd_input: Tensor,
    /// `[T, 2E + 1]` i32.
    pub row_id_map: Tensor,
    /// `[E]` i64.
    pub tokens_per_expert: Tensor,
    /// `[E + 1]` i64.
    pub expert_offsets: Tensor,
    /// `[T, E]` f32.
    pub merging_probs: Tensor,
    /// Output `[N, H]`.
    pub act_grad: Tensor,
    /// Output `[T, E]` f32.
    pub probs_grad: Tensor,
}

fn check_unpermute_backward(a: &UnpermuteBackwardArgs) -> Result<Dims, PermuteError> {
    check("grad", &a.grad, &[DType::F32, DType::F16, DType::Bf16], 2)?;
    let (t, h) = (a.grad.dims[0], a.grad.dims[1]);
    check("fwd_input", &a.fwd_input, &[a.grad.dtype], 2)?;
    dim("fwd_input", &a.fwd_input, 1, h, "hidden, as grad")?;
    let n = a.fwd_input.dims[0];
    let e = check_map(&a.row_id_map, t)?;
    check_chunks(&a.tokens_per_expert, &a.expert_offsets, e)?;
    check("merging_probs", &a.merging_probs, &[DType::F32], 2)?;
    dim("merging_probs", &a.merging_probs, 0, t, "tokens")?;
    dim("merging_probs", &a.merging_probs, 1, e, "experts")?;
    check("act_grad", &a.act_grad, &[a.grad.dtype], 2)?;
    dim("act_grad", &a.act_grad, 0, n, "rows, as fwd_input")?;
    dim("act_grad", &a.act_grad, 1, h, "hidden, as grad")?;
    check("probs_grad", &a.probs_grad, &[DType::F32], 2)?;
    dim("probs_grad", &a.probs_grad, 0, t, "tokens")?;
    dim("probs_grad", &a.probs_grad, 1, e, "experts")?;
    check_overlap(
        Op::UnpermuteBackward,
        &[
            ("grad", &a.grad),
            ("fwd_input", &a.fwd_input),
            ("row_id_map", &a.row_id_map),
            ("tokens_per_expert", &a.tokens_per_expert),
            ("expert_offsets", &a.expert_offsets),
            ("merging_probs", &a.merging_probs),
        ],
        &[("act_grad", &a.act_grad), ("probs_grad", &a.probs_grad)],
        false,
    )?;
    Ok(Dims {
        tokens: usize_of(t),
        experts: usize_of(e),
        hidden: usize_of(h),
        out_rows: usize_of(n),
        scales: 0,
    })
}

/// The backward of `unpermute` with merging probs; see
/// [`ops::unpermute_backward`].
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn unpermute_backward(
    target: &Target,
    a: &UnpermuteBackwardArgs,
) -> Result<(), PermuteError> {
    let dims = check_unpermute_backward(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the function docs.
        Platform::Host => unsafe {
            let map = RowIdMapRef::new(
                dims.tokens,
                dims.experts,
                host_slice(&a.row_id_map),
                host_slice(&a.tokens_per_expert),
                host_slice(&a.expert_offsets),
                dims.out_rows,
            )?;
            ops::unpermute_backward(
                map,
                &ops::UnpermuteBackwardInputs {
                    grad: host_slice(&a.grad),
                    fwd_input: host_slice(&a.fwd_input),
                    dtype: a.grad.dtype,
                    hidden: dims.hidden,
                    merging_probs: host_slice(&a.merging_probs),
                },
                &mut ops::UnpermuteBackwardOutputs {
                    act_grad: host_slice_mut(&a.act_grad),
                    probs_grad: host_slice_mut(&a.probs_grad),
                },
            )
        },
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::unpermute_backward(target, a, dims) },
    }
}

/// Arguments of [`make_chunk_sort_map`].
#[derive(Clone, Debug)]
pub struct MakeChunkSortMapArgs {
    /// `[S]` i64 rows per chunk.
    pub split_sizes: Tensor,
    /// `[S]` i64, a permutation of `0..S`: the output order of the chunks.
    pub sorted_indices: Tensor,
    /// Output `[T]` i64.
    pub map: Tensor,
}

/// Builds a chunk-sort map; see [`chunks::make_chunk_sort_map`]. On CUDA,
/// `split_sizes` and `sorted_indices` are read back to the Host and checked
/// before anything is enqueued (this waits for the stream) unless the
/// stream is capturing; under capture the kernel checks them and, when they
/// are invalid, leaves `map` untouched without an error status.
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn make_chunk_sort_map(
    target: &Target,
    a: &MakeChunkSortMapArgs,
) -> Result<(), PermuteError> {
    check("split_sizes", &a.split_sizes, &[DType::I64], 1)?;
    check("sorted_indices", &a.sorted_indices, &[DType::I64], 1)?;
    dim(
        "sorted_indices",
        &a.sorted_indices,
        0,
        a.split_sizes.dims[0],
        "chunks",
    )?;
    check("map", &a.map, &[DType::I64], 1)?;
    check_overlap(
        Op::MakeChunkSortMap,
        &[
            ("split_sizes", &a.split_sizes),
            ("sorted_indices", &a.sorted_indices),
        ],
        &[("map", &a.map)],
        false,
    )?;
    let tokens = usize_of(a.map.dims[0]);
    match target.device.platform {
        // SAFETY: checked tensors, see the function docs.
        Platform::Host => unsafe {
            let map = chunks::make_chunk_sort_map(
                host_slice(&a.split_sizes),
                host_slice(&a.sorted_indices),
                tokens,
            )?;
            host_slice_mut::<i64>(&a.map).copy_from_slice(&map);
            Ok(())
        },
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::make_chunk_sort_map(target, a, tokens) },
    }
}

/// Arguments of [`sort_chunks_by_map`].
#[derive(Clone, Debug)]
pub struct SortChunksArgs {
    /// `[T, H]`, any dtype.
    pub input: Tensor,
    /// `[T]` i64, a permutation of `0..T` (from `make_chunk_sort_map`).
    pub map: Tensor,
    /// Optional `[T]` f32.
    pub probs: Option<Tensor>,
    /// Scatter (forward) or gather (backward).
    pub direction: Direction,
    /// Output `[T, H]` of the input's dtype.
    pub output: Tensor,
    /// Output `[T]` f32, with `probs`.
    pub permuted_probs: Option<Tensor>,
    /// Outputs may overlap inputs (see the module docs).
    pub in_place: bool,
}

fn check_sort_chunks(a: &SortChunksArgs) -> Result<Dims, PermuteError> {
    check("input", &a.input, &DType::ALL, 2)?;
    let (t, h) = (a.input.dims[0], a.input.dims[1]);
    check("map", &a.map, &[DType::I64], 1)?;
    dim("map", &a.map, 0, t, "rows of input")?;
    check("output", &a.output, &[a.input.dtype], 2)?;
    dim("output", &a.output, 0, t, "rows, as input")?;
    dim("output", &a.output, 1, h, "hidden, as input")?;
    if let Some((p, pp)) = pair(("probs", &a.probs), ("permuted_probs", &a.permuted_probs))? {
        check("probs", p, &[DType::F32], 1)?;
        dim("probs", p, 0, t, "rows of input")?;
        check("permuted_probs", pp, &[DType::F32], 1)?;
        dim("permuted_probs", pp, 0, t, "rows of input")?;
    }
    let mut ins = vec![("input", &a.input), ("map", &a.map)];
    ins.extend(a.probs.as_ref().map(|p| ("probs", p)));
    let mut outs = vec![("output", &a.output)];
    outs.extend(a.permuted_probs.as_ref().map(|p| ("permuted_probs", p)));
    check_overlap(Op::SortChunksByMap, &ins, &outs, a.in_place)?;
    Ok(Dims {
        tokens: usize_of(t),
        experts: 0,
        hidden: usize_of(h),
        out_rows: usize_of(t),
        scales: 0,
    })
}

/// Reorders rows by a chunk-sort map; see [`chunks::sort_chunks_by_map`].
/// On CUDA the map is not checked to be a permutation (that needs a pass
/// over it); entries outside `[0, T)` are skipped, never written through.
///
/// # Safety
/// See [`host_slice`].
pub unsafe fn sort_chunks_by_map(target: &Target, a: &SortChunksArgs) -> Result<(), PermuteError> {
    let dims = check_sort_chunks(a)?;
    let mut a = a.clone();
    let mut staged = Staged::new();
    if a.in_place {
        let outs = outputs_of(&[&a.permuted_probs], &a.output);
        let outs: Vec<&Tensor> = outs.iter().collect();
        staged.stage(target, &mut a.input, &outs)?;
        staged.stage(target, &mut a.map, &outs)?;
        if let Some(p) = a.probs.as_mut() {
            staged.stage(target, p, &outs)?;
        }
    }
    match target.device.platform {
        // SAFETY: checked tensors, see the function docs; staged inputs no
        // longer overlap outputs.
        Platform::Host => unsafe {
            chunks::sort_chunks_by_map(
                host_slice(&a.input),
                dims.hidden * a.input.dtype.size_bytes(),
                host_slice(&a.map),
                a.probs.as_ref().map(|t| host_slice(t)),
                a.direction,
                host_slice_mut(&a.output),
                a.permuted_probs.as_ref().map(|t| host_slice_mut(t)),
            )
        },
        // SAFETY: see the function docs.
        Platform::Cuda => unsafe { crate::cuda::sort_chunks_by_map(target, &a, dims) },
    }
}
