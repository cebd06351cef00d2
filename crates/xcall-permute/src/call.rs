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
//!
//! Segmented tensors: `permute`'s output and `unpermute`'s input may be
//! split over up to [`MAX_SEGMENTS`] separate allocations of equal rows
//! ([`Segments`]; `output_segments` / `input_segments`), for example the
//! receive slots of every PE of a symmetric heap, so a MoE layer's
//! dispatch is the permute itself and its combine the unpermute. Each
//! segment is checked like a tensor (NULL, alignment, overlap with every
//! other buffer and segment; on CUDA, memory the device reaches, its own or
//! a peer's). A segmented permute writes the routed rows only. Segment
//! bases are launch parameters of pointer type: a graph-cache exec update
//! moves those inside the call's buffers like any other pointer.
//!
//! A call goes: the checks (a [`Checked`] or an error), staging of in-place
//! inputs, then one backend: Host or [`cuda`]. Neither
//! backend calls back into this module.
//!
//! # Safety (of every `unsafe fn` here)
//! Each tensor's address must be valid for its bytes on `target.device`
//! (readable for inputs, writable for outputs) for the duration of the
//! call on Host, and until the enqueued work completes on CUDA; `stream`
//! must be a live stream of that device.

use xcall_core::Platform;

use crate::alias;
pub use crate::args::{
    autotune_default, checked_default, env_settings, MakeChunkSortMapArgs, MakeRowIdMapArgs,
    PermuteArgs, Segments, SortChunksArgs, Target, Tensor, UnpermuteArgs, UnpermuteBackwardArgs,
    MAX_SEGMENTS,
};
use crate::check;
pub use crate::check::{Checked, Dims};
use crate::error::PermuteError;
use crate::row_id_map::MapFaults;
use crate::{cuda, host};

/// Waits for the target's stream and returns the map faults the device's
/// kernels recorded since the last call (then clears them). The record is
/// per device, not per stream. Always empty on Host, which refuses a bad
/// map before any work.
pub fn take_faults(target: &Target) -> Result<MapFaults, PermuteError> {
    match target.device.platform {
        Platform::Host => Ok(MapFaults(0)),
        Platform::Cuda => cuda::take_faults(target).map(MapFaults),
    }
}

/// Copies of inputs that overlap an output (in-place calls); the copies
/// live until the value is dropped (on CUDA: freed in stream order).
#[derive(Default)]
struct Staged {
    host: Vec<Vec<u64>>,
    cuda: Vec<xcall_core::cuda::StreamAlloc>,
}

impl Staged {
    /// Points `input` at a copy of itself when it overlaps any output.
    fn stage(
        &mut self,
        target: &Target,
        input: &mut Tensor,
        outputs: &[Tensor],
    ) -> Result<(), PermuteError> {
        let r = input.region("input");
        if !outputs
            .iter()
            .any(|o| alias::check(&[r], &[o.region("output")], &[]).is_err())
        {
            return Ok(());
        }
        let bytes = check::usize_of(input.bytes());
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
                let copy = cuda::copy_of(target, input.address, bytes)?;
                input.address = copy.address();
                self.cuda.push(copy);
            }
        }
        Ok(())
    }
}

fn outputs_of(list: &[&Option<Tensor>], first: &Tensor) -> Vec<Tensor> {
    std::iter::once(first.clone())
        .chain(list.iter().filter_map(|o| (*o).clone()))
        .collect()
}

/// Builds the row-id map; see [`row_id_map::make_row_id_map`](crate::row_id_map::make_row_id_map).
///
/// # Safety
/// See the module docs.
pub unsafe fn make_row_id_map(target: &Target, a: &MakeRowIdMapArgs) -> Result<(), PermuteError> {
    let c = check::make_row_id_map(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs.
        Platform::Host => unsafe { host::make_row_id_map(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::make_row_id_map(target, &c) }
        }
    }
}

/// Groups tokens by expert; see [`ops::permute`](crate::ops::permute).
///
/// # Safety
/// See the module docs.
pub unsafe fn permute(target: &Target, a: &PermuteArgs) -> Result<(), PermuteError> {
    let mut c = check::permute(a)?;
    let mut staged = Staged::default();
    if a.in_place {
        let a = c.args_mut();
        let outs = outputs_of(&[&a.permuted_probs, &a.permuted_scales], &a.output);
        staged.stage(target, &mut a.input, &outs)?;
        staged.stage(target, &mut a.row_id_map, &outs)?;
        staged.stage(target, &mut a.tokens_per_expert, &outs)?;
        staged.stage(target, &mut a.expert_offsets, &outs)?;
        for t in [&mut a.probs, &mut a.scales].into_iter().flatten() {
            staged.stage(target, t, &outs)?;
        }
    }
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs; staged inputs no
        // longer overlap outputs.
        Platform::Host => unsafe { host::permute(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::permute(target, &c) }
        }
    }
}

/// Restores token order; see [`ops::unpermute`](crate::ops::unpermute).
///
/// # Safety
/// See the module docs.
pub unsafe fn unpermute(target: &Target, a: &UnpermuteArgs) -> Result<(), PermuteError> {
    let c = check::unpermute(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs.
        Platform::Host => unsafe { host::unpermute(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::unpermute(target, &c) }
        }
    }
}

/// The backward of `unpermute` with merging probs; see
/// [`ops::unpermute_backward`](crate::ops::unpermute_backward).
///
/// # Safety
/// See the module docs.
pub unsafe fn unpermute_backward(
    target: &Target,
    a: &UnpermuteBackwardArgs,
) -> Result<(), PermuteError> {
    let c = check::unpermute_backward(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs.
        Platform::Host => unsafe { host::unpermute_backward(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::unpermute_backward(target, &c) }
        }
    }
}

/// Builds a chunk-sort map; see
/// [`chunks::make_chunk_sort_map`](crate::chunks::make_chunk_sort_map). On
/// CUDA, `split_sizes` and `sorted_indices` are read back to the Host and
/// checked before anything is enqueued (this waits for the stream) unless
/// the stream is capturing; under capture the kernel checks them and, when
/// they are invalid, leaves `map` untouched without an error status.
///
/// # Safety
/// See the module docs.
pub unsafe fn make_chunk_sort_map(
    target: &Target,
    a: &MakeChunkSortMapArgs,
) -> Result<(), PermuteError> {
    let c = check::make_chunk_sort_map(a)?;
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs.
        Platform::Host => unsafe { host::make_chunk_sort_map(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::make_chunk_sort_map(target, &c) }
        }
    }
}

/// Reorders rows by a chunk-sort map; see
/// [`chunks::sort_chunks_by_map`](crate::chunks::sort_chunks_by_map). On
/// CUDA the map is not checked to be a permutation (that needs a pass over
/// it); entries outside `[0, T)` are skipped, never written through.
///
/// # Safety
/// See the module docs.
pub unsafe fn sort_chunks_by_map(target: &Target, a: &SortChunksArgs) -> Result<(), PermuteError> {
    let mut c = check::sort_chunks_by_map(a)?;
    let mut staged = Staged::default();
    if a.in_place {
        let a = c.args_mut();
        let outs = outputs_of(&[&a.permuted_probs], &a.output);
        staged.stage(target, &mut a.input, &outs)?;
        staged.stage(target, &mut a.map, &outs)?;
        if let Some(p) = a.probs.as_mut() {
            staged.stage(target, p, &outs)?;
        }
    }
    match target.device.platform {
        // SAFETY: checked tensors, see the module docs; staged inputs no
        // longer overlap outputs.
        Platform::Host => unsafe { host::sort_chunks_by_map(&c) },
        Platform::Cuda => {
            env_settings()?;
            // SAFETY: see the module docs.
            unsafe { cuda::sort_chunks_by_map(target, &c) }
        }
    }
}
