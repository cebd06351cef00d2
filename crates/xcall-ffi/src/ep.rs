//! C ABI of expert parallelism (xcall-ep): a group on a symmetric-memory
//! world, its buffer sizes, dispatch, combine and their backward halves.

use std::ffi::c_void;
use std::sync::{Mutex, MutexGuard, TryLockError};

use static_assertions::{assert_eq_align, assert_eq_size};
use xcall_core::Status;
use xcall_ep::{
    Buf, Capacity, EpConfig, EpError, EpGroup, EpKernels, ExpertMajor, Precision, FP8_BLOCK,
};

use crate::guard::{c_code, code_arg, ffi_call, out_ptr, FfiError};
use crate::handle::{self, Handle};
use crate::shmem::{world, xcall_shmem_world};

assert_eq_size!(xcall_ep_config, [u64; 7]);
assert_eq_align!(xcall_ep_config, u64);
assert_eq_size!(xcall_ep_sizes, [u64; 11]);
assert_eq_size!(xcall_ep_expert_major, [u64; 12]);

impl From<EpError> for FfiError {
    fn from(e: EpError) -> Self {
        FfiError::new(e.status(), e.to_string())
    }
}

/// What an expert-parallel exchange moves, and in which precision
/// (`xcall_ep_config.precision`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpPrecision {
    /// f32 both ways.
    F32 = 0,
    /// bf16 both ways, f32 accumulation in combine.
    Bf16 = 1,
    /// bf16 tokens quantized to FP8 e4m3 by the sender (one f32 scale per
    /// `XCALL_EP_FP8_BLOCK` elements of a row); the receiver gets FP8 rows
    /// and their scales (and, if asked, bf16 rows made from them). Combine
    /// and the backward calls are bf16. CUDA: compute capability 8.9 or
    /// newer.
    Fp8 = 2,
}

xcall_core::c_enum!(EpPrecision, "expert-parallel precision", [F32, Bf16, Fp8]);

c_code!(
    /// An `xcall_ep_precision` as passed.
    EpPrecisionCode => EpPrecision
);

/// Elements of a row that share one FP8 scale (`XCALL_EP_PRECISION_FP8`).
pub const XCALL_EP_FP8_BLOCK: u64 = 128;
const _: () = assert!(XCALL_EP_FP8_BLOCK == FP8_BLOCK as u64);

/// The shape of an expert-parallel group: the same on every PE. Every
/// buffer size follows from it (`xcall_ep_layout`), never from the
/// routing, so a captured call replays for any routing.
///
/// On CUDA, a group of at most 256 tokens per PE (and two per SM of its
/// budget) and 2048 experts (decode) runs `xcall_ep_dispatch` and `xcall_ep_combine`
/// as one kernel each (the low-latency kernels: one block per SM of the
/// budget, all resident at once); larger groups run a kernel per step.
/// Both write the same bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_ep_config {
    /// Most tokens a PE hands to one dispatch (`T`); a call may pass fewer.
    pub tokens: u64,
    /// Elements of a token row (`H`); a row is a whole number of 16-byte
    /// vectors, and a multiple of `XCALL_EP_FP8_BLOCK` for FP8.
    pub hidden: u64,
    /// Experts each token is routed to (`k`), at most 32 and at most
    /// `experts`.
    pub topk: u64,
    /// Experts in all (`E`), a multiple of the PE count `P`: PE `q` hosts
    /// experts `q*L .. (q+1)*L`, `L = E / P`.
    pub experts: u64,
    /// Each expert's group of rows in the expert-major layout starts on a
    /// multiple of `align` rows (1: packed; 128 suits grouped GEMMs).
    pub align: u64,
    /// 0: dropless (every route lands). Otherwise the rows each local
    /// expert may receive, taken in (sender rank, token, top-k slot)
    /// order; the rest are dropped and counted
    /// (`xcall_ep_dropped_routes`).
    pub capacity: u64,
    /// An `xcall_ep_precision` value.
    pub precision: EpPrecisionCode,
    /// Streaming multiprocessors the exchange kernels may occupy on CUDA;
    /// 0: as many as help. Ignored on Host.
    pub num_sms: u32,
}

/// The sizes of a group on `P` PEs (`xcall_ep_layout`): the symmetric
/// heap it takes and the bytes of each of the caller's buffers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct xcall_ep_sizes {
    /// Bytes of symmetric heap the group takes on each PE (start the world
    /// with at least this much free).
    pub heap_bytes: u64,
    /// Experts on each PE (`L`).
    pub local_experts: u64,
    /// Rows of the expert-major layout (worst case when dropless, plus
    /// alignment padding).
    pub expert_rows: u64,
    /// `x` of dispatch, `y` of combine, `grad_x`, `grad_y`: `T * H`
    /// elements (f32 or bf16; bf16 for FP8).
    pub token_rows_bytes: u64,
    /// `ids` (i32) and `probs` (f32) of dispatch, `grad_probs`: `T * k * 4`.
    pub routing_bytes: u64,
    /// `xcall_ep_expert_major.rows`: `expert_rows * H` elements as sent
    /// (f32, bf16, or FP8 bytes).
    pub rows_bytes: u64,
    /// `xcall_ep_expert_major.scales` (FP8 only, else 0):
    /// `expert_rows * H / XCALL_EP_FP8_BLOCK` f32.
    pub scales_bytes: u64,
    /// `xcall_ep_expert_major.rows_bf16` (FP8 only, else 0):
    /// `expert_rows * H` bf16.
    pub rows_bf16_bytes: u64,
    /// `expert_out` of combine, `grad_rows` of dispatch_backward,
    /// `grad_expert_out` of combine_backward: `expert_rows * H` elements
    /// (f32 or bf16; bf16 for FP8).
    pub expert_out_bytes: u64,
    /// `tokens_per_expert` and `padded_per_expert`: `L` i64.
    pub tokens_per_expert_bytes: u64,
    /// `offsets`: `L + 1` i64.
    pub offsets_bytes: u64,
}

/// Where dispatch writes what this PE's experts receive: rows grouped by
/// local expert (expert `l`'s from row `offsets[l]`, a multiple of the
/// group's `align`), in (sender rank, token, top-k slot) order within an
/// expert; padding rows between groups are not written. Each buffer with
/// its size in bytes (`xcall_ep_sizes` gives what each needs); buffers
/// marked optional may be NULL (their size is then ignored). On CUDA
/// every buffer is device memory of this PE's device.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct xcall_ep_expert_major {
    /// `[expert_rows, H]` rows as sent: f32, bf16, or FP8 e4m3 bytes. FP8
    /// groups may leave `rows` and `scales` NULL and take `rows_bf16`
    /// alone (experts that read bf16; the FP8 rows are then not written).
    pub rows: *mut c_void,
    /// Bytes at `rows`.
    pub rows_bytes: u64,
    /// FP8 only, with `rows` (NULL otherwise): `[expert_rows, H / 128]`
    /// f32 scales.
    pub scales: *mut f32,
    /// Bytes at `scales`.
    pub scales_bytes: u64,
    /// FP8 only, optional (NULL otherwise): `[expert_rows, H]` bf16 rows
    /// dequantized from the FP8 rows and their scales.
    pub rows_bf16: *mut c_void,
    /// Bytes at `rows_bf16`.
    pub rows_bf16_bytes: u64,
    /// `[L]` i64: routes each local expert received (after the capacity).
    pub tokens_per_expert: *mut i64,
    /// Bytes at `tokens_per_expert`.
    pub tokens_per_expert_bytes: u64,
    /// Optional `[L]` i64: rows each expert's group spans (its count
    /// rounded up to `align`).
    pub padded_per_expert: *mut i64,
    /// Bytes at `padded_per_expert`.
    pub padded_per_expert_bytes: u64,
    /// Optional `[L + 1]` i64: each expert's first row, then the end of
    /// the last group.
    pub offsets: *mut i64,
    /// Bytes at `offsets`.
    pub offsets_bytes: u64,
}

/// One PE's handle on an expert-parallel group, made collectively by
/// `xcall_ep_group_new` on a live `xcall_shmem_world` and freed
/// collectively by `xcall_ep_group_free`. Owned by one PE thread (another
/// thread's call gets `XCALL_STATUS_BUSY`).
///
/// What every call taking a group may return besides its own errors:
/// - `XCALL_STATUS_NULL_ARGUMENT` (NULL group), `XCALL_STATUS_INVALID_HANDLE`
///   (a group freed already, or not made by `xcall_ep_group_new`);
/// - `XCALL_STATUS_BUSY`: another thread is inside a call on this group
///   at that moment; nothing was done.
///
/// The group lives in its world's symmetric heap: free it before
/// finalizing the world (a group whose world was finalized may only be
/// freed).
pub struct xcall_ep_group {
    /// Taken with `try_lock` only: a call that finds it held is `Busy`, so
    /// no thread ever waits for it while its holder waits on peers.
    inner: Mutex<EpGroup>,
    /// The world handle it was made on (checked by `xcall_ep_group_free`).
    world: usize,
}

impl Handle for xcall_ep_group {
    const TYPE: &'static str = "xcall_ep_group";
}

/// The group behind a handle, held for this call.
fn group<'a>(g: *mut xcall_ep_group) -> Result<MutexGuard<'a, EpGroup>, FfiError> {
    let g = handle::get(g, "group")?;
    match g.inner.try_lock() {
        Ok(g) => Ok(g),
        // A panic caught inside an earlier call: the group's state is what
        // that call left; later calls report its errors.
        Err(TryLockError::Poisoned(p)) => Ok(p.into_inner()),
        Err(TryLockError::WouldBlock) => Err(FfiError::new(
            Status::Busy,
            "group is in use by another thread (a group handle belongs to one PE thread)",
        )),
    }
}

fn usize_arg(v: u64, what: &str) -> Result<usize, FfiError> {
    usize::try_from(v).map_err(|_| {
        FfiError::new(
            Status::InvalidArgument,
            format!("{what} {v} does not fit an address space"),
        )
    })
}

/// The config behind `config`, decoded (the shape is checked by the
/// group's layout).
pub(crate) fn config_arg(config: *const xcall_ep_config) -> Result<EpConfig, FfiError> {
    // SAFETY: NULL or a readable config, per the documentation.
    let c = unsafe { config.as_ref() }
        .ok_or_else(|| FfiError::new(Status::NullArgument, "config is NULL"))?;
    let precision = match c.precision.get()? {
        EpPrecision::F32 => Precision::F32,
        EpPrecision::Bf16 => Precision::Bf16,
        EpPrecision::Fp8 => Precision::Fp8Dispatch,
    };
    Ok(EpConfig {
        tokens: usize_arg(c.tokens, "tokens")?,
        hidden: usize_arg(c.hidden, "hidden")?,
        topk: usize_arg(c.topk, "topk")?,
        experts: usize_arg(c.experts, "experts")?,
        precision,
        align: usize_arg(c.align, "align")?,
        capacity: match usize_arg(c.capacity, "capacity")? {
            0 => Capacity::Dropless,
            n => Capacity::PerExpert(n),
        },
        num_sms: c.num_sms as usize,
        kernels: EpKernels::Auto,
    })
}

/// The sizes of `c`'s buffers on `pes` PEs; every product was checked by
/// the layout (rows * H * 4 fits).
fn sizes(c: &EpConfig, pes: usize) -> Result<xcall_ep_sizes, FfiError> {
    let l = c.layout(pes)?;
    let (h, rows) = (c.hidden as u64, l.expert_rows as u64);
    let element = c.precision.element_bytes() as u64;
    let fp8 = c.precision == Precision::Fp8Dispatch;
    Ok(xcall_ep_sizes {
        heap_bytes: l.heap_bytes as u64,
        local_experts: l.local_experts as u64,
        expert_rows: rows,
        token_rows_bytes: c.tokens as u64 * h * element,
        routing_bytes: c.tokens as u64 * c.topk as u64 * 4,
        rows_bytes: rows * h * c.precision.wire_bytes() as u64,
        scales_bytes: if fp8 {
            rows * (h / XCALL_EP_FP8_BLOCK) * 4
        } else {
            0
        },
        rows_bf16_bytes: if fp8 { rows * h * 2 } else { 0 },
        expert_out_bytes: rows * h * element,
        tokens_per_expert_bytes: l.local_experts as u64 * 8,
        offsets_bytes: (l.local_experts as u64 + 1) * 8,
    })
}

/// A caller's buffer: NULL with a size above 0 is `NullArgument` naming
/// it; a size past the address space `InvalidArgument`. NULL with size 0
/// is [`Buf::NONE`] (the group then says what the call needs).
fn buf<T>(p: *const T, bytes: u64, what: &str) -> Result<Buf, FfiError> {
    if p.is_null() {
        if bytes > 0 {
            return Err(FfiError::new(
                Status::NullArgument,
                format!("{what} is NULL with {bytes} bytes"),
            ));
        }
        return Ok(Buf::NONE);
    }
    Ok(Buf::new(p as u64, usize_arg(bytes, what)?))
}

/// A required buffer: NULL is `NullArgument` whatever its size.
fn required<T>(p: *const T, bytes: u64, what: &str) -> Result<Buf, FfiError> {
    if p.is_null() {
        return Err(FfiError::new(
            Status::NullArgument,
            format!("{what} is NULL"),
        ));
    }
    buf(p, bytes, what)
}

/// The sizes of a group of `config`'s shape on `pes` PEs into `*out_sizes`:
/// what to start the world with (`heap_bytes`) and what each of the
/// caller's buffers needs. Nothing is made. Thread-safe.
///
/// Bad input: NULL `config` or `out_sizes`: `XCALL_STATUS_NULL_ARGUMENT`;
/// an unknown precision, `pes` 0 or above 64, a zero tokens, hidden,
/// topk, experts or align, topk above 32 or above experts, experts not a
/// multiple of `pes`, a row that is not whole 16-byte vectors (FP8: not a
/// multiple of `XCALL_EP_FP8_BLOCK` elements), more than 4096 experts per
/// PE, rows or routes past 2^31 - 1, sizes past 64 bits:
/// `XCALL_STATUS_INVALID_ARGUMENT` naming what is wrong.
#[no_mangle]
pub extern "C" fn xcall_ep_layout(
    config: *const xcall_ep_config,
    pes: u32,
    out_sizes: *mut xcall_ep_sizes,
) -> Status {
    ffi_call!({
        let c = config_arg(config)?;
        let out = out_ptr(out_sizes, "out_sizes")?;
        *out = sizes(&c, pes as usize)?;
        Ok(())
    })
}

/// Makes an expert-parallel group on every PE of `world` (collective:
/// every PE calls it with the same config, in the same order as its other
/// collectives) into `*out_group`. Takes `xcall_ep_layout`'s `heap_bytes`
/// of the world's symmetric heap (`XCALL_STATUS_OUT_OF_MEMORY` says so
/// when the heap is short) and reads peers' memory directly: every peer
/// of this process or host (a peer reached through NCCL or TCP:
/// `XCALL_STATUS_UNSUPPORTED`, on every PE). FP8 on a GPU older than
/// compute capability 8.9: `XCALL_STATUS_UNSUPPORTED`.
///
/// Bad input: refused before the collective, nothing made (the peers then
/// wait out the world's timeout, as for a PE that never calls): the world
/// rules of `xcall_shmem_world`; NULL `config` or `out_group`:
/// `XCALL_STATUS_NULL_ARGUMENT`; a config `xcall_ep_layout` refuses for
/// the world's size: `XCALL_STATUS_INVALID_ARGUMENT`; a world that is not
/// live: `XCALL_STATUS_INVALID_STATE`.
#[no_mangle]
pub extern "C" fn xcall_ep_group_new(
    w: *mut xcall_shmem_world,
    config: *const xcall_ep_config,
    out_group: *mut *mut xcall_ep_group,
) -> Status {
    ffi_call!({
        let c = config_arg(config)?;
        let out = out_ptr(out_group, "out_group")?;
        let mut world = world(w)?;
        let g = EpGroup::new(&mut world, c)?;
        drop(world);
        // If the table cannot record the handle, the group's heap stays
        // allocated until the world is finalized (its free is collective).
        *out = handle::publish(xcall_ep_group {
            inner: Mutex::new(g),
            world: w as usize,
        })?;
        Ok(())
    })
}

/// Frees the group on every PE (collective, like `xcall_shmem_free`; NULL
/// `group`: nothing done, `XCALL_STATUS_OK`). Synchronize the streams of
/// the group's calls first: peers may read this PE's memory until every PE
/// is here. Past the checks below the handle is released whatever the
/// outcome (a failing barrier or free, `XCALL_STATUS_INVALID_STATE` for a
/// world finalized already, is returned after it).
///
/// Bad input: refused with the group left live: the world rules of
/// `xcall_shmem_world`; a freed or foreign group:
/// `XCALL_STATUS_INVALID_HANDLE`; a group in use by another thread:
/// `XCALL_STATUS_BUSY`; a world other than the one the group was made on:
/// `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ep_group_free(g: *mut xcall_ep_group, w: *mut xcall_shmem_world) -> Status {
    ffi_call!({
        if g.is_null() {
            return Ok(());
        }
        let made_on = handle::get(g, "group")?.world;
        let mut world = world(w)?;
        if made_on != w as usize {
            return Err(FfiError::new(
                Status::InvalidArgument,
                format!("the group was made on world {:#x}, not {w:p}", made_on),
            ));
        }
        drop(group(g)?);
        let Some(freed) = handle::release(g, "group")? else {
            return Ok(());
        };
        let ep = freed.inner.into_inner().unwrap_or_else(|p| p.into_inner());
        ep.destroy(&mut world)?;
        Ok(())
    })
}

/// Dispatch: this PE's first `tokens` rows of `x` (`[tokens, H]`, f32 or
/// bf16; bf16 for FP8, quantized here) are sent once to each PE hosting
/// one of their experts, with `ids` (`[tokens, k]` i32, -1: no route) and
/// `probs` (`[tokens, k]` f32); the rows every PE sent to this PE's
/// experts land in `out` (expert-major, with `tokens_per_expert` and the
/// optional counts written by the call). Collective: every PE makes its
/// group calls in the same order. On CUDA the call enqueues on `stream`
/// (a `CUstream` of this PE's device; NULL: the legacy default stream)
/// and returns; it is capturable, and a captured call replays for any
/// routing (with the `tokens` it was captured with). On Host it runs before
/// returning (it waits for the peers; `stream` is ignored). `x` may be
/// the group's own send rows (`xcall_ep_send_rows`), saving a copy.
///
/// An id outside `-1..E`, or an expert listed twice for a token, is not
/// routed; the call still completes on every PE, and this PE reports
/// `XCALL_STATUS_INVALID_ARGUMENT`: on Host as this call's status, on
/// CUDA at the next `xcall_ep_check`. A peer that does not come within
/// the world's timeout: `XCALL_STATUS_TIMEOUT` (CUDA: at `xcall_ep_check`).
///
/// Bad input: refused before any work, nothing written (this PE takes no
/// part: its peers' waits time out): the group rules of `xcall_ep_group`;
/// NULL `out`, NULL `out->rows` (f32 and bf16 groups) or
/// `out->tokens_per_expert`, a NULL buffer with a size above 0:
/// `XCALL_STATUS_NULL_ARGUMENT`; `tokens` above the group's, a buffer
/// smaller than the call needs (see `xcall_ep_sizes`), one not aligned to
/// its element (rows: 16 bytes), `x` overlapping the group's memory but
/// for the send rows of an f32 or bf16 group, `scales` or `rows_bf16`
/// given to a group that is not FP8, an FP8 group given `rows` without
/// `scales` (or the reverse) or neither `rows` nor `rows_bf16`:
/// `XCALL_STATUS_INVALID_ARGUMENT` naming the buffer.
#[no_mangle]
pub extern "C" fn xcall_ep_dispatch(
    g: *mut xcall_ep_group,
    x: *const c_void,
    x_bytes: u64,
    ids: *const i32,
    ids_bytes: u64,
    probs: *const f32,
    probs_bytes: u64,
    tokens: u64,
    out: *const xcall_ep_expert_major,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        let mut group = group(g)?;
        // SAFETY: NULL or a readable struct, per the documentation.
        let o = unsafe { out.as_ref() }
            .ok_or_else(|| FfiError::new(Status::NullArgument, "out is NULL"))?;
        let rows = match group.config().precision {
            Precision::Fp8Dispatch => buf(o.rows, o.rows_bytes, "out->rows")?,
            _ => required(o.rows, o.rows_bytes, "out->rows")?,
        };
        let out = ExpertMajor {
            rows,
            scales: buf(o.scales, o.scales_bytes, "out->scales")?,
            rows_bf16: buf(o.rows_bf16, o.rows_bf16_bytes, "out->rows_bf16")?,
            tokens_per_expert: required(
                o.tokens_per_expert,
                o.tokens_per_expert_bytes,
                "out->tokens_per_expert",
            )?,
            padded_per_expert: buf(
                o.padded_per_expert,
                o.padded_per_expert_bytes,
                "out->padded_per_expert",
            )?,
            offsets: buf(o.offsets, o.offsets_bytes, "out->offsets")?,
        };
        let x = buf(x, x_bytes, "x")?;
        let ids = buf(ids, ids_bytes, "ids")?;
        let probs = buf(probs, probs_bytes, "probs")?;
        let tokens = usize_arg(tokens, "tokens")?;
        // SAFETY: the buffers are this PE's memory of the sizes given, valid
        // until the stream ran the call, per the documentation; the group
        // checks every size against what the call uses.
        unsafe { group.dispatch(x, ids, probs, tokens, &out, stream) }?;
        Ok(())
    })
}

/// Combine: each of this PE's tokens of the last dispatch becomes the sum
/// of its experts' output rows, each times its prob: every PE sums its
/// experts' rows of a token (in top-k slot order, f32) and sends one row
/// back; this PE adds those in PE rank order (f32) into `y` (`[tokens, H]`
/// of that dispatch). `expert_out` is `[expert_rows, H]` in the
/// expert-major layout of that dispatch (bf16 for FP8); padding rows are
/// not read. A token with no route gets a zero row. Dropped routes add
/// nothing. Collective, enqueued and capturable like `xcall_ep_dispatch`.
///
/// Bad input: refused before any work, nothing written: the group rules
/// of `xcall_ep_group`; NULL `expert_out`, a NULL `y` with a size above 0:
/// `XCALL_STATUS_NULL_ARGUMENT`; no dispatch before:
/// `XCALL_STATUS_INVALID_STATE`; a buffer smaller than the call needs or
/// not 16-byte aligned: `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ep_combine(
    g: *mut xcall_ep_group,
    expert_out: *const c_void,
    expert_out_bytes: u64,
    y: *mut c_void,
    y_bytes: u64,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        let mut group = group(g)?;
        let src = required(expert_out, expert_out_bytes, "expert_out")?;
        let y = buf(y, y_bytes, "y")?;
        // SAFETY: as in xcall_ep_dispatch.
        unsafe { group.combine(src, y, stream) }?;
        Ok(())
    })
}

/// The gradient of dispatch: `grad_x` (`[tokens, H]` of the last
/// dispatch) of each token is the sum of the gradients of its routes' rows
/// (`grad_rows`, expert-major; bf16 for FP8), unweighted; dropped routes
/// add nothing. Collective, enqueued and capturable like
/// `xcall_ep_dispatch`.
///
/// Bad input: refused before any work, nothing written: the group rules
/// of `xcall_ep_group`; NULL `grad_rows`, a NULL `grad_x` with a size
/// above 0: `XCALL_STATUS_NULL_ARGUMENT`; no dispatch before:
/// `XCALL_STATUS_INVALID_STATE`; a buffer smaller than the call needs or
/// not 16-byte aligned: `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ep_dispatch_backward(
    g: *mut xcall_ep_group,
    grad_rows: *const c_void,
    grad_rows_bytes: u64,
    grad_x: *mut c_void,
    grad_x_bytes: u64,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        let mut group = group(g)?;
        let src = required(grad_rows, grad_rows_bytes, "grad_rows")?;
        let grad_x = buf(grad_x, grad_x_bytes, "grad_x")?;
        // SAFETY: as in xcall_ep_dispatch.
        unsafe { group.dispatch_backward(src, grad_x, stream) }?;
        Ok(())
    })
}

/// The gradient of combine, given `grad_y` (`[tokens, H]` of the last
/// dispatch): each route's row of `grad_expert_out` (expert-major) is
/// `grad_y` of its token times the route's prob, and `grad_probs`
/// (`[tokens, k]` f32) each route's dot product of its expert's output
/// row (`expert_out`, as combine read it) with `grad_y`, in f32; 0 for a
/// dropped route or an id that routes nowhere. Padding rows of
/// `grad_expert_out` are not written. Collective, enqueued and capturable
/// like `xcall_ep_dispatch`.
///
/// Bad input: refused before any work, nothing written: the group rules
/// of `xcall_ep_group`; NULL `expert_out` or `grad_expert_out`, a NULL
/// `grad_y` or `grad_probs` with a size above 0:
/// `XCALL_STATUS_NULL_ARGUMENT`; no dispatch before:
/// `XCALL_STATUS_INVALID_STATE`; a buffer smaller than the call needs or
/// not aligned (rows: 16 bytes, `grad_probs`: 4):
/// `XCALL_STATUS_INVALID_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ep_combine_backward(
    g: *mut xcall_ep_group,
    grad_y: *const c_void,
    grad_y_bytes: u64,
    expert_out: *const c_void,
    expert_out_bytes: u64,
    grad_expert_out: *mut c_void,
    grad_expert_out_bytes: u64,
    grad_probs: *mut f32,
    grad_probs_bytes: u64,
    stream: *mut c_void,
) -> Status {
    ffi_call!({
        let mut group = group(g)?;
        let grad_y = buf(grad_y, grad_y_bytes, "grad_y")?;
        let expert_out = required(expert_out, expert_out_bytes, "expert_out")?;
        let grad_expert_out = required(grad_expert_out, grad_expert_out_bytes, "grad_expert_out")?;
        let grad_probs = buf(grad_probs, grad_probs_bytes, "grad_probs")?;
        // SAFETY: as in xcall_ep_dispatch.
        unsafe { group.combine_backward(grad_y, expert_out, grad_expert_out, grad_probs, stream) }?;
        Ok(())
    })
}

/// Routes this PE's experts dropped by the capacity, summed over every
/// dispatch so far, into `*out_dropped` (0 when dropless). Reads the
/// group's counter now: on CUDA, synchronize the dispatches' streams
/// first.
///
/// Bad input: the group rules of `xcall_ep_group`; NULL `out_dropped`:
/// `XCALL_STATUS_NULL_ARGUMENT`.
#[no_mangle]
pub extern "C" fn xcall_ep_dropped_routes(g: *mut xcall_ep_group, out_dropped: *mut u64) -> Status {
    ffi_call!({
        let group = group(g)?;
        let out = out_ptr(out_dropped, "out_dropped")?;
        *out = group.dropped_routes()?;
        Ok(())
    })
}

/// The first error a CUDA kernel of this PE's group calls met since the
/// last check, then cleared: `XCALL_STATUS_TIMEOUT` (a peer did not reach
/// a phase within the world's timeout, named) or
/// `XCALL_STATUS_INVALID_ARGUMENT` (routing this PE dispatched had ids
/// that were not taken). Synchronize the calls' streams first. Always
/// `XCALL_STATUS_OK` on Host, whose calls report their errors themselves.
///
/// Bad input: the group rules of `xcall_ep_group`.
#[no_mangle]
pub extern "C" fn xcall_ep_check(g: *mut xcall_ep_group) -> Status {
    ffi_call!({ Ok(group(g)?.check()?) })
}

/// The group's send rows: `[T, H]` (f32 or bf16) of this PE's memory
/// (device memory on CUDA) in `*out_rows` and their size in
/// `*out_bytes`. Tokens the caller writes there (after the call that ends
/// the previous dispatch's use, combine or a backward call, on the same
/// stream) are sent from where they are when passed as `x` of
/// `xcall_ep_dispatch`, saving a copy.
///
/// Bad input: the group rules of `xcall_ep_group`; NULL outputs:
/// `XCALL_STATUS_NULL_ARGUMENT`; an FP8 group (it quantizes from `x`
/// wherever it is): `XCALL_STATUS_UNSUPPORTED`.
#[no_mangle]
pub extern "C" fn xcall_ep_send_rows(
    g: *mut xcall_ep_group,
    out_rows: *mut *mut c_void,
    out_bytes: *mut u64,
) -> Status {
    ffi_call!({
        let group = group(g)?;
        let rows = out_ptr(out_rows, "out_rows")?;
        let bytes = out_ptr(out_bytes, "out_bytes")?;
        if group.config().precision == Precision::Fp8Dispatch {
            return Err(FfiError::new(
                Status::Unsupported,
                "an FP8 group quantizes from x wherever it is: it has no send rows to write",
            ));
        }
        let b = group.send_rows();
        *rows = b.addr as *mut c_void;
        *bytes = b.bytes as u64;
        Ok(())
    })
}
