//! The Host backend: the ops of `ops`, `row_id_map` and `chunks` run on
//! host slices of checked tensors.
//!
//! # Safety (of every `unsafe fn` here)
//! Each tensor's address must be valid for its bytes (readable for inputs,
//! writable for outputs) for the duration of the call, and no output may
//! overlap another tensor of the call (the checks and staging ensure it).

use crate::args::{
    MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Tensor, UnpermuteArgs,
    UnpermuteBackwardArgs,
};
use crate::check::{usize_of, Checked, Dims};
use crate::error::PermuteError;
use crate::row_id_map::{self, RowIdMapRef};
use crate::{chunks, ops};

/// The elements of a checked tensor as a host slice; see the module docs.
unsafe fn host_slice<'a, T>(t: &Tensor) -> &'a [T] {
    let n = usize_of(t.bytes()) / std::mem::size_of::<T>();
    if n == 0 {
        &[]
    } else {
        // SAFETY: see the module docs; checked non-NULL and aligned.
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

/// `bytes` bytes of a checked segment at `base`; see the module docs.
unsafe fn segment<'a>(base: u64, bytes: usize) -> &'a [u8] {
    if bytes == 0 {
        &[]
    } else {
        // SAFETY: see the module docs; checked non-NULL, its bytes inside
        // the address space.
        unsafe { std::slice::from_raw_parts(base as *const u8, bytes) }
    }
}

/// See [`segment`]; the overlap check makes the slice exclusive.
unsafe fn segment_mut<'a>(base: u64, bytes: usize) -> &'a mut [u8] {
    if bytes == 0 {
        &mut []
    } else {
        // SAFETY: see segment; no other slice of the call overlaps it.
        unsafe { std::slice::from_raw_parts_mut(base as *mut u8, bytes) }
    }
}

/// The row-id map with its expert chunks, over checked tensors; see the
/// module docs.
unsafe fn chunked_map<'a>(
    dims: Dims,
    map: &Tensor,
    tokens_per_expert: &Tensor,
    expert_offsets: &Tensor,
) -> Result<RowIdMapRef<'a>, PermuteError> {
    // SAFETY: the caller's contract (checked tensors).
    unsafe {
        RowIdMapRef::new(
            dims.tokens,
            dims.experts,
            host_slice(map),
            host_slice(tokens_per_expert),
            host_slice(expert_offsets),
            dims.out_rows,
        )
    }
}

/// See [`row_id_map::make_row_id_map`] and the module docs.
pub(crate) unsafe fn make_row_id_map(
    c: &Checked<'_, MakeRowIdMapArgs>,
) -> Result<(), PermuteError> {
    let (a, dims) = (c.args(), c.dims());
    // SAFETY: checked tensors, see the module docs.
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

/// See [`ops::permute`] and the module docs.
pub(crate) unsafe fn permute(c: &Checked<'_, PermuteArgs>) -> Result<(), PermuteError> {
    let (a, dims) = (c.args(), c.dims());
    // SAFETY: checked (and staged) tensors, see the module docs.
    unsafe {
        let map = chunked_map(dims, &a.row_id_map, &a.tokens_per_expert, &a.expert_offsets)?;
        if let Some(segs) = &a.output_segments {
            let row = dims.hidden * a.input.dtype.size_bytes();
            let rows = usize_of(segs.rows);
            let mut parts: Vec<&mut [u8]> = segs
                .bases
                .iter()
                .map(|&b| segment_mut(b, rows * row))
                .collect();
            return ops::permute_segmented(
                map,
                &ops::PermuteInputs {
                    input: host_slice(&a.input),
                    dtype: a.input.dtype,
                    hidden: dims.hidden,
                    probs: None,
                    scales: None,
                },
                &mut parts,
                rows,
            );
        }
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
    }
}

/// See [`ops::unpermute`] and the module docs.
pub(crate) unsafe fn unpermute(c: &Checked<'_, UnpermuteArgs>) -> Result<(), PermuteError> {
    let (a, dims) = (c.args(), c.dims());
    // SAFETY: checked (and staged) tensors, see the module docs.
    unsafe {
        let map = RowIdMapRef::routes_only(
            dims.tokens,
            dims.experts,
            host_slice(&a.row_id_map),
            dims.out_rows,
        )?;
        if let Some(segs) = &a.input_segments {
            let row = dims.hidden * a.input.dtype.size_bytes();
            let rows = usize_of(segs.rows);
            let parts: Vec<&[u8]> = segs.bases.iter().map(|&b| segment(b, rows * row)).collect();
            return ops::unpermute_segmented(
                map,
                &parts,
                rows,
                &ops::UnpermuteInputs {
                    input: &[],
                    dtype: a.input.dtype,
                    hidden: dims.hidden,
                    merging_probs: a.merging_probs.as_ref().map(|t| host_slice(t)),
                    permuted_probs: None,
                },
                &mut ops::UnpermuteOutputs {
                    output: host_slice_mut(&a.output),
                    unpermuted_probs: None,
                },
            );
        }
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
    }
}

/// See [`ops::unpermute_backward`] and the module docs.
pub(crate) unsafe fn unpermute_backward(
    c: &Checked<'_, UnpermuteBackwardArgs>,
) -> Result<(), PermuteError> {
    let (a, dims) = (c.args(), c.dims());
    // SAFETY: checked (and staged) tensors, see the module docs.
    unsafe {
        let map = chunked_map(dims, &a.row_id_map, &a.tokens_per_expert, &a.expert_offsets)?;
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
    }
}

/// See [`chunks::sort_chunks_by_map`] and the module docs.
pub(crate) unsafe fn sort_chunks_by_map(
    c: &Checked<'_, SortChunksArgs>,
) -> Result<(), PermuteError> {
    let (a, dims) = (c.args(), c.dims());
    // SAFETY: checked (and staged) tensors, see the module docs.
    unsafe {
        chunks::sort_chunks_by_map(
            host_slice(&a.input),
            dims.hidden * a.input.dtype.size_bytes(),
            host_slice(&a.map),
            a.probs.as_ref().map(|t| host_slice(t)),
            a.direction,
            host_slice_mut(&a.output),
            a.permuted_probs.as_ref().map(|t| host_slice_mut(t)),
        )
    }
}

/// See [`chunks::make_chunk_sort_map`] and the module docs.
pub(crate) unsafe fn make_chunk_sort_map(
    c: &Checked<'_, MakeChunkSortMapArgs>,
) -> Result<(), PermuteError> {
    let (a, tokens) = (c.args(), c.dims().tokens);
    // SAFETY: checked tensors, see the module docs.
    unsafe {
        let map = chunks::make_chunk_sort_map(
            host_slice(&a.split_sizes),
            host_slice(&a.sorted_indices),
            tokens,
        )?;
        host_slice_mut::<i64>(&a.map).copy_from_slice(&map);
        Ok(())
    }
}
