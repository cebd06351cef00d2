//! The permutation calls `xcall moe` and `xcall bench` make on buffers of
//! a symmetric heap (host memory on Host, device memory on CUDA), and the
//! error context both report.

use xcall_core::DType;
use xcall_permute::call::{
    self, MakeRowIdMapArgs, PermuteArgs, Segments, Target, Tensor, UnpermuteArgs,
};
use xcall_permute::RowIdMapOptions;

/// A result with a message naming what failed.
pub type Res<T> = Result<T, String>;

/// Maps any displayable error to a message naming the failed step.
pub trait Context<T> {
    /// `"{what}: {error}"`.
    fn context(self, what: &str) -> Res<T>;
}

impl<T, E: std::fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// The symmetric heap per PE for a command that needs `needed` bytes:
/// `Some(needed)`, or `None` (the world then reads the variable) when
/// `XCALL_SHMEM_HEAP_BYTES` gives at least that much. A smaller or
/// malformed value is an error naming the variable.
pub fn heap_size(needed: usize, what: &str) -> Res<Option<usize>> {
    let name = xcall_shmem::world::HEAP_ENV;
    match xcall_core::env::bytes(name).map_err(|e| e.to_string())? {
        None => Ok(Some(needed)),
        Some(b) if b >= needed as u64 => Ok(None),
        Some(b) => Err(format!(
            "{name}={b} bytes is less than the {needed} bytes per PE {what} needs; \
             unset it to let xcall size the heap"
        )),
    }
}

/// The transport policy `XCALL_SHMEM_TRANSPORT` gives (`None` when
/// unset), after checking `XCALL_SHMEM_HOST` too: the variables every
/// world reads as it starts, checked before a command starts any, so that
/// a malformed one is a usage error naming it rather than every PE's
/// failure.
pub fn world_environment() -> Res<Option<xcall_shmem::Pairs>> {
    let bare = |e: xcall_shmem::ShmemError| match e {
        xcall_shmem::ShmemError::InvalidArgument(m) => m,
        other => other.to_string(),
    };
    xcall_shmem::host_identity().map_err(bare)?;
    let name = xcall_shmem::TRANSPORT_ENV;
    match xcall_core::env::text(name).map_err(|e| e.to_string())? {
        None => Ok(None),
        Some(v) => xcall_shmem::Pairs::parse(&v).map(Some).ok_or_else(|| {
            format!("{name}={v:?} is not a transport policy: auto, nccl (CUDA) or tcp (Host)")
        }),
    }
}

/// Shape of the calls: `T` tokens of `H` values of `dtype`, `E` experts,
/// `rows` permuted rows.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Tokens `T`.
    pub tokens: u64,
    /// Hidden size `H`.
    pub hidden: u64,
    /// Experts `E`.
    pub experts: u64,
    /// Permuted rows `N`.
    pub rows: u64,
    /// Element type of the tokens.
    pub dtype: DType,
}

/// A token layer's buffers: tokens `[T, H]`, routing `[T, E]` u8, merging
/// probs `[T, E]` f32, and the row-id map with its chunk facts.
#[derive(Clone, Copy, Debug, Default)]
pub struct Layer {
    /// Tokens.
    pub x: u64,
    /// Routing map.
    pub routing: u64,
    /// Merging probs.
    pub probs: u64,
    /// Row-id map `[T, 2E + 1]` i32.
    pub map: u64,
    /// Tokens per expert `[E]` i64.
    pub tpe: u64,
    /// Expert offsets `[E + 1]` i64.
    pub offsets: u64,
}

impl Layer {
    fn map(&self, d: Dims) -> Tensor {
        Tensor::new(self.map, DType::I32, &[d.tokens, 2 * d.experts + 1])
    }

    fn chunks(&self, d: Dims) -> (Tensor, Tensor) {
        (
            Tensor::new(self.tpe, DType::I64, &[d.experts]),
            Tensor::new(self.offsets, DType::I64, &[d.experts + 1]),
        )
    }

    /// `make_row_id_map` of the routing.
    ///
    /// # Safety
    /// Every buffer holds its tensor of `d` on the target's device and
    /// stays alive until the call completes.
    pub unsafe fn make_row_id_map(
        &self,
        target: &Target,
        d: Dims,
        options: RowIdMapOptions,
    ) -> Res<()> {
        let (tpe, offsets) = self.chunks(d);
        let args = MakeRowIdMapArgs {
            routing: Tensor::new(self.routing, DType::U8, &[d.tokens, d.experts]),
            options,
            row_id_map: self.map(d),
            tokens_per_expert: tpe,
            expert_offsets: offsets,
        };
        // SAFETY: the caller's contract.
        unsafe { call::make_row_id_map(target, &args) }.context("make_row_id_map")
    }

    /// `permute` of the tokens into segments of `rows` rows at `bases`
    /// (`N = bases.len() * rows`): routed rows only.
    ///
    /// # Safety
    /// As [`Layer::make_row_id_map`], and each base holds `[rows, H]`
    /// that the target's device reaches.
    pub unsafe fn permute_segments(
        &self,
        target: &Target,
        d: Dims,
        bases: &[u64],
        rows: u64,
    ) -> Res<()> {
        let segments = Segments {
            bases: bases.to_vec(),
            rows,
        };
        // SAFETY: the caller's contract.
        unsafe { self.permute_to(target, d, bases[0], Some(segments)) }
    }

    /// `unpermute` with the merging probs of segments of `rows` rows at
    /// `bases` into `output` (`[T, H]`).
    ///
    /// # Safety
    /// As [`Layer::permute_segments`], and `output` holds `[T, H]`.
    pub unsafe fn unpermute_segments(
        &self,
        target: &Target,
        d: Dims,
        bases: &[u64],
        rows: u64,
        output: u64,
    ) -> Res<()> {
        let segments = Segments {
            bases: bases.to_vec(),
            rows,
        };
        // SAFETY: the caller's contract.
        unsafe { self.unpermute_from(target, d, bases[0], Some(segments), output) }
    }

    /// `permute` of the tokens into `output` (`[N, H]`).
    ///
    /// # Safety
    /// As [`Layer::make_row_id_map`], and `output` holds `[N, H]`.
    pub unsafe fn permute(&self, target: &Target, d: Dims, output: u64) -> Res<()> {
        // SAFETY: the caller's contract.
        unsafe { self.permute_to(target, d, output, None) }
    }

    /// `unpermute` of `input` (`[N, H]`) into `output` (`[T, H]`) with the
    /// merging probs.
    ///
    /// # Safety
    /// As [`Layer::permute`], and `output` holds `[T, H]`.
    pub unsafe fn unpermute(&self, target: &Target, d: Dims, input: u64, output: u64) -> Res<()> {
        // SAFETY: the caller's contract.
        unsafe { self.unpermute_from(target, d, input, None, output) }
    }

    /// `permute` into `output`, dense or in `segments` (whose first base
    /// is `output`).
    ///
    /// # Safety
    /// As [`Layer::permute`] or [`Layer::permute_segments`].
    unsafe fn permute_to(
        &self,
        target: &Target,
        d: Dims,
        output: u64,
        segments: Option<Segments>,
    ) -> Res<()> {
        let (tpe, offsets) = self.chunks(d);
        let args = PermuteArgs {
            input: Tensor::new(self.x, d.dtype, &[d.tokens, d.hidden]),
            row_id_map: self.map(d),
            tokens_per_expert: tpe,
            expert_offsets: offsets,
            probs: None,
            scales: None,
            output: Tensor::new(output, d.dtype, &[d.rows, d.hidden]),
            permuted_probs: None,
            permuted_scales: None,
            in_place: false,
            output_segments: segments,
        };
        // SAFETY: the caller's contract.
        unsafe { call::permute(target, &args) }.context("permute")
    }

    /// `unpermute` with the merging probs of `input`, dense or in
    /// `segments` (whose first base is `input`), into `output`.
    ///
    /// # Safety
    /// As [`Layer::unpermute`] or [`Layer::unpermute_segments`].
    unsafe fn unpermute_from(
        &self,
        target: &Target,
        d: Dims,
        input: u64,
        segments: Option<Segments>,
        output: u64,
    ) -> Res<()> {
        let args = UnpermuteArgs {
            input: Tensor::new(input, d.dtype, &[d.rows, d.hidden]),
            row_id_map: self.map(d),
            merging_probs: Some(Tensor::new(self.probs, DType::F32, &[d.tokens, d.experts])),
            permuted_probs: None,
            output: Tensor::new(output, d.dtype, &[d.tokens, d.hidden]),
            unpermuted_probs: None,
            input_segments: segments,
        };
        // SAFETY: the caller's contract.
        unsafe { call::unpermute(target, &args) }.context("unpermute")
    }
}
