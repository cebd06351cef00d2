//! Expert parallelism for an XLA runtime driving several devices from one
//! process (JAX over a mesh of its local devices): the groups, made for
//! every device at once, and the handlers of dispatch, combine and their
//! backward calls.
//!
//! # Groups
//! `xcall_xla_ep_open` makes a shmem world and an expert-parallel group on
//! it for a list of devices (rank = index in the list), one thread per PE,
//! all at once, and returns once every PE's part is made: the group
//! exists before any handler runs, so handlers that XLA runs one after
//! another, or at once, never wait for a creation. A group may span
//! processes of one host: `xcall_xla_ep_open_ranks` makes this process's
//! PEs of it (see `ep_open`). Handlers name the group by the id it gets
//! (attribute `group`). `xcall_xla_ep_close` frees this process's PEs.
//!
//! # Which PE a handler is
//! On CUDA, the device of the call frame, looked up in the group's list
//! (never the calling thread's current device). On Host, the `rank`
//! operand (an s32 scalar in host memory, e.g. the mesh axis index); on
//! CUDA that operand is ignored.
//!
//! # Calls and their state
//! Every handler is collective over the group's PEs: each PE's program
//! makes the same calls in the same order. Each begins with an empty
//! phase (so it is safe after any call, also when XLA replays it from a
//! recorded command buffer); dispatch then saves its routing into its
//! `routing` result, and combine and the backward calls put the routing
//! they are given back first: each follows the dispatch whose routing it
//! gets, whatever was dispatched in between.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use xcall_core::{DType, Platform, Status};
use xcall_ep::{Buf, EpConfig, EpGroup, ExpertMajor, Precision};
use xcall_permute::call::{Target, Tensor};
use xcall_shmem::World;

use super::frame::invalid;
use super::specs::{always, Decoded, Spec, CBC};
use crate::guard::{ffi_call, out_ptr, FfiError};

/// One PE of an open group: its world and its group (None once freed).
pub(super) struct Pe {
    pub(super) world: World,
    pub(super) group: Option<EpGroup>,
}

/// A group over a list of devices, this process's PEs of it.
pub(super) struct MeshGroup {
    pub(super) id: u64,
    pub(super) platform: Platform,
    /// This process's PEs: CUDA, their devices' ordinals; Host, their
    /// worlds' slots.
    pub(super) ordinals: Vec<u32>,
    /// Each of this process's PEs' rank in the group (in-process groups:
    /// 0, 1, ..).
    pub(super) ranks: Vec<usize>,
    /// PEs of the group over every process.
    pub(super) size: usize,
    pub(super) config: EpConfig,
    pub(super) routing_bytes: usize,
    /// Each PE's slot. A call takes its PE out of the slot (the lock is
    /// held only for the taking and the putting back, never across the
    /// call's collective) and puts it back when done; a call that finds
    /// the slot empty gets `Busy`, so no thread waits for a PE that waits
    /// on its peers.
    pub(super) pes: Vec<Mutex<Option<Pe>>>,
}

/// How long closing a group waits for a call that found it just before it
/// was closed.
const CLOSE_WAIT: Duration = Duration::from_secs(60);

pub(super) fn open_groups() -> MutexGuard<'static, Vec<Arc<MeshGroup>>> {
    static GROUPS: Mutex<Vec<Arc<MeshGroup>>> = Mutex::new(Vec::new());
    // Only pushes, removals and clones of Arcs happen under it.
    GROUPS.lock().unwrap_or_else(|p| p.into_inner())
}

fn find(id: u64) -> Result<Arc<MeshGroup>, FfiError> {
    open_groups()
        .iter()
        .find(|g| g.id == id)
        .cloned()
        .ok_or_else(|| {
            FfiError::new(
                Status::InvalidHandle,
                format!("no open expert-parallel group {id} (closed already, or never opened)"),
            )
        })
}

/// Runs `f(rank)` on one thread per PE at once and collects the results
/// in rank order. Every PE's work ends by itself (its waits have the
/// world's timeout), so joining cannot hang.
pub(super) fn on_every_pe<T: Send>(
    n: usize,
    f: impl Fn(usize) -> T + Sync,
) -> Vec<std::thread::Result<T>> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..n).map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join()).collect()
    })
}

/// The results in order, or the first error, naming its PE by `ranks`.
pub(super) fn first_error<T>(
    results: Vec<std::thread::Result<Result<T, FfiError>>>,
    ranks: &[usize],
) -> Result<Vec<T>, FfiError> {
    let mut out = Vec::with_capacity(results.len());
    let mut err = None;
    for (r, ranks_r) in results.into_iter().zip(ranks) {
        let rank = *ranks_r;
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                err.get_or_insert(FfiError::new(e.status, format!("PE {rank}: {}", e.message)));
            }
            Err(p) => {
                err.get_or_insert(FfiError::new(
                    Status::Panic,
                    format!(
                        "PE {rank}: internal panic: {}",
                        xcall_core::panic_message(&*p)
                    ),
                ));
            }
        }
    }
    match err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Frees the group `id` of `xcall_xla_ep_open` on every PE (its worlds
/// finalized, one thread per PE at once). Every call of its handlers must
/// have completed on its device first (synchronize the runtime's
/// streams): peers may read a PE's memory until every PE is here.
/// Thread-safe.
///
/// Bad input: an id not open (closed already, never opened):
/// `XCALL_STATUS_INVALID_HANDLE`; a handler of the group running now:
/// `XCALL_STATUS_BUSY`, the group left open.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_close(id: u64) -> Status {
    ffi_call!({
        let g = {
            let mut groups = open_groups();
            let at = groups.iter().position(|g| g.id == id).ok_or_else(|| {
                FfiError::new(
                    Status::InvalidHandle,
                    format!("no open expert-parallel group {id}"),
                )
            })?;
            if let Some(r) = (0..groups[at].pes.len()).find(|&r| slot(&groups[at], r).is_none()) {
                return Err(FfiError::new(
                    Status::Busy,
                    format!(
                        "PE {} of expert-parallel group {id} is in a call; close it after",
                        groups[at].ranks[r]
                    ),
                ));
            }
            groups.remove(at)
        };
        let done = on_every_pe(g.pes.len(), |local| -> Result<(), FfiError> {
            let rank = g.ranks[local];
            // Removed from the open groups while every PE was in its slot:
            // no new call finds it; one that found it just before finishes
            // first (its PE back in the slot), waited for without a lock.
            let waited = std::time::Instant::now();
            let mut pe = loop {
                if let Some(pe) = slot(&g, local).take() {
                    break pe;
                }
                if waited.elapsed() > CLOSE_WAIT {
                    return Err(FfiError::new(
                        Status::Busy,
                        format!(
                            "PE {rank} of expert-parallel group {id} stayed in a call for \
                             {CLOSE_WAIT:?}; not freed"
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            if let Some(group) = pe.group.take() {
                group.destroy(&mut pe.world)?;
            }
            pe.world.finalize()?;
            Ok(())
        });
        first_error(done, &g.ranks).map(|_| ())
    })
}

/// The first error a CUDA kernel of group `id` met on any of this
/// process's PEs since the last check, then cleared (`xcall_ep_check` on
/// each, in rank order):
/// a peer that did not reach a phase in time, or routing with ids that
/// were not taken. Synchronize the handlers' streams first. Always OK on
/// Host, whose handlers report their errors themselves.
///
/// Bad input: an id not open: `XCALL_STATUS_INVALID_HANDLE`; a handler
/// of the group running now: `XCALL_STATUS_BUSY`.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_check(id: u64) -> Status {
    ffi_call!({
        let g = find(id)?;
        for (local, rank) in g.ranks.iter().enumerate() {
            let pe = lock(&g, local)?;
            if let Some(group) = &pe.group {
                group
                    .check()
                    .map_err(|e| FfiError::new(e.status(), format!("PE {rank}: {e}")))?;
            }
        }
        Ok(())
    })
}

/// Routes dropped by the capacity on PE `rank` of group `id` (one of this
/// process's), summed over every dispatch so far, into `*out_dropped`. On
/// CUDA, synchronize the handlers' streams first.
///
/// Bad input: an id not open: `XCALL_STATUS_INVALID_HANDLE`; `rank` not a
/// PE of the group in this process: `XCALL_STATUS_INVALID_ARGUMENT`; NULL `out_dropped`:
/// `XCALL_STATUS_NULL_ARGUMENT`; a handler of that PE running now:
/// `XCALL_STATUS_BUSY`.
#[no_mangle]
pub extern "C" fn xcall_xla_ep_dropped_routes(id: u64, rank: u64, out_dropped: *mut u64) -> Status {
    ffi_call!({
        let out = out_ptr(out_dropped, "out_dropped")?;
        let g = find(id)?;
        let rank = usize::try_from(rank).unwrap_or(usize::MAX);
        let local = g.ranks.iter().position(|&r| r == rank).ok_or_else(|| {
            invalid(format!(
                "rank {rank} is not a PE of group {id} in this process (its PEs here: {:?} of {})",
                g.ranks, g.size
            ))
        })?;
        let pe = lock(&g, local)?;
        *out = pe.group.as_ref().map_or(Ok(0), |g| g.dropped_routes())?;
        Ok(())
    })
}

/// PE `rank`'s slot, locked for a moment (a panic while it was held
/// leaves the slot as it was: nothing is half-written in it).
fn slot(g: &MeshGroup, rank: usize) -> MutexGuard<'_, Option<Pe>> {
    g.pes[rank].lock().unwrap_or_else(|p| p.into_inner())
}

/// A PE taken out of its slot for one call, put back when dropped.
struct Taken<'a> {
    slot: &'a Mutex<Option<Pe>>,
    pe: Option<Pe>,
}

impl std::ops::Deref for Taken<'_> {
    type Target = Pe;
    fn deref(&self) -> &Pe {
        self.pe.as_ref().expect("a taken PE stays until dropped")
    }
}

impl std::ops::DerefMut for Taken<'_> {
    fn deref_mut(&mut self) -> &mut Pe {
        self.pe.as_mut().expect("a taken PE stays until dropped")
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = self.pe.take();
    }
}

fn lock(g: &MeshGroup, rank: usize) -> Result<Taken<'_>, FfiError> {
    match slot(g, rank).take() {
        Some(pe) => Ok(Taken {
            slot: &g.pes[rank],
            pe: Some(pe),
        }),
        None => Err(FfiError::new(
            Status::Busy,
            format!(
                "PE {} of expert-parallel group {} is in another call: a PE's calls run one \
                 at a time, in the same order on every PE",
                g.ranks[rank], g.id
            ),
        )),
    }
}

// ------------------------------------------------------------ handlers

/// The group of a call (attribute `group`) and the call's PE: its index
/// among this process's PEs of the group.
fn group_and_rank(t: &Target, d: &Decoded) -> Result<(Arc<MeshGroup>, usize), FfiError> {
    let id = d.attr("group", 0);
    if id <= 0 {
        return Err(invalid(
            "attribute group (the id of xcall_xla_ep_open) is missing".into(),
        ));
    }
    let g = find(id as u64)?;
    if g.platform != t.device.platform {
        return Err(invalid(format!(
            "group {id} was opened for {:?} devices; this handler runs on {}",
            g.platform, t.device
        )));
    }
    let rank = match t.device.platform {
        Platform::Cuda => g
            .ordinals
            .iter()
            .position(|&o| o == t.device.ordinal)
            .ok_or_else(|| {
                invalid(format!(
                    "{} is not one of group {id}'s devices (CUDA {:?})",
                    t.device, g.ordinals
                ))
            })?,
        Platform::Host => {
            let r = tensor(d, "rank")?;
            expect(r, "rank", DType::I32, &[])?;
            // SAFETY: a checked s32 scalar in host memory.
            let v = unsafe { (r.address as *const i32).read_unaligned() };
            usize::try_from(v)
                .ok()
                .and_then(|v| g.ranks.iter().position(|&r| r == v))
                .ok_or_else(|| {
                    invalid(format!(
                        "operand rank is {v}; group {id} has PEs 0..{}, of them {:?} in this process",
                        g.size, g.ranks
                    ))
                })?
        }
    };
    Ok((g, rank))
}

fn tensor<'a>(d: &'a Decoded, name: &str) -> Result<&'a Tensor, FfiError> {
    Decoded::find(&d.args, name)
        .or_else(|| Decoded::find(&d.rets, name))
        .ok_or_else(|| invalid(format!("{name} is missing")))
}

fn expect(t: &Tensor, name: &str, dtype: DType, dims: &[usize]) -> Result<(), FfiError> {
    let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if t.dtype != dtype || t.dims != want {
        return Err(invalid(format!(
            "{name} is {:?} {:?}; this group needs {dtype:?} {want:?}",
            t.dtype, t.dims
        )));
    }
    Ok(())
}

/// The element type of the group's token rows.
fn row_dtype(c: &EpConfig) -> Result<DType, FfiError> {
    match c.precision {
        Precision::F32 => Ok(DType::F32),
        Precision::Bf16 => Ok(DType::Bf16),
        Precision::Fp8Dispatch => Err(FfiError::new(
            Status::Unsupported,
            "FP8 dispatch has no XLA handler: open the group as f32 or bf16",
        )),
    }
}

/// A tensor checked against `dims` of `dtype`, as a buffer.
fn checked(d: &Decoded, name: &str, dtype: DType, dims: &[usize]) -> Result<Buf, FfiError> {
    let t = tensor(d, name)?;
    expect(t, name, dtype, dims)?;
    Ok(Buf::new(t.address, t.bytes() as usize))
}

/// Zeros `b` (this PE's memory): on Host now, on CUDA enqueued.
///
/// # Safety
/// `b` is writable memory of the target's device, valid until the stream
/// has run the call.
unsafe fn zero(t: &Target, b: Buf) -> Result<(), FfiError> {
    match t.device.platform {
        // SAFETY: the caller's contract; host memory.
        Platform::Host => unsafe { std::ptr::write_bytes(b.addr as *mut u8, 0, b.bytes) },
        Platform::Cuda => {
            // SAFETY: the frame's stream of the target's device.
            let s = unsafe {
                xcall_core::cuda::Stream::from_raw(
                    t.device,
                    t.stream as xcall_core::cuda::RawStream,
                )
            };
            // SAFETY: the caller's contract.
            s.in_context(|s| unsafe { s.memset_d8(b.addr, 0, b.bytes) })?;
        }
    }
    Ok(())
}

/// The PE's group, held for the call.
fn held(g: &MeshGroup, rank: usize) -> Result<Taken<'_>, FfiError> {
    let pe = lock(g, rank)?;
    if pe.group.is_none() {
        return Err(FfiError::new(Status::InvalidState, "the group was freed"));
    }
    Ok(pe)
}

fn stream(t: &Target) -> *mut c_void {
    match t.device.platform {
        Platform::Host => std::ptr::null_mut(),
        Platform::Cuda => t.stream,
    }
}

/// The dispatch handler's call.
///
/// # Safety
/// XLA's buffers are valid for their shapes on the target's device until
/// the stream has run the call.
pub(super) unsafe fn run_dispatch(t: &Target, d: &Decoded) -> Result<(), FfiError> {
    let (g, rank) = group_and_rank(t, d)?;
    let c = g.config;
    let layout = c.layout(g.size)?;
    let elem = row_dtype(&c)?;
    let (tk, h, k) = (c.tokens, c.hidden, c.topk);
    let x = checked(d, "x", elem, &[tk, h])?;
    let ids = checked(d, "ids", DType::I32, &[tk, k])?;
    let probs = checked(d, "probs", DType::F32, &[tk, k])?;
    let rows = checked(d, "rows", elem, &[layout.expert_rows, h])?;
    let tpe = checked(d, "tokens_per_expert", DType::I64, &[layout.local_experts])?;
    let routing = checked(d, "routing", DType::U8, &[g.routing_bytes])?;
    let mut pe = held(&g, rank)?;
    let group = pe.group.as_mut().expect("held checks it");
    let s = stream(t);
    let out = ExpertMajor {
        rows,
        tokens_per_expert: tpe,
        ..ExpertMajor::default()
    };
    // SAFETY: every buffer was checked against its shape; the caller's
    // contract for the rest.
    unsafe {
        if d.flag("zero_unused") {
            zero(t, rows)?;
        }
        group.phase_barrier(s)?;
        let dispatched = group.dispatch(x, ids, probs, tk, &out, s);
        // Saved even when the routing had ids that were not taken (the
        // call completed on every PE): later calls stay in step.
        group.save_routing(routing, s)?;
        dispatched?;
    }
    Ok(())
}

/// The combine handler's call (safety as [`run_dispatch`]).
pub(super) unsafe fn run_combine(t: &Target, d: &Decoded) -> Result<(), FfiError> {
    let (g, rank) = group_and_rank(t, d)?;
    let c = g.config;
    let layout = c.layout(g.size)?;
    let elem = row_dtype(&c)?;
    let expert_out = checked(d, "expert_out", elem, &[layout.expert_rows, c.hidden])?;
    let routing = checked(d, "routing", DType::U8, &[g.routing_bytes])?;
    let y = checked(d, "y", elem, &[c.tokens, c.hidden])?;
    let mut pe = held(&g, rank)?;
    let group = pe.group.as_mut().expect("held checks it");
    let s = stream(t);
    // SAFETY: as in run_dispatch.
    unsafe {
        group.restore_routing(routing, c.tokens, s)?;
        group.combine(expert_out, y, s)?;
    }
    Ok(())
}

/// The combine_backward handler's call (safety as [`run_dispatch`]).
pub(super) unsafe fn run_combine_backward(t: &Target, d: &Decoded) -> Result<(), FfiError> {
    let (g, rank) = group_and_rank(t, d)?;
    let c = g.config;
    let layout = c.layout(g.size)?;
    let elem = row_dtype(&c)?;
    let rows = [layout.expert_rows, c.hidden];
    let grad_y = checked(d, "grad_y", elem, &[c.tokens, c.hidden])?;
    let expert_out = checked(d, "expert_out", elem, &rows)?;
    let routing = checked(d, "routing", DType::U8, &[g.routing_bytes])?;
    let grad_expert_out = checked(d, "grad_expert_out", elem, &rows)?;
    let grad_probs = checked(d, "grad_probs", DType::F32, &[c.tokens, c.topk])?;
    let mut pe = held(&g, rank)?;
    let group = pe.group.as_mut().expect("held checks it");
    let s = stream(t);
    // SAFETY: as in run_dispatch.
    unsafe {
        // Rows no route fills (padding, the unused tail) get zeros, not
        // whatever the runtime's buffer held.
        zero(t, grad_expert_out)?;
        group.restore_routing(routing, c.tokens, s)?;
        group.combine_backward(grad_y, expert_out, grad_expert_out, grad_probs, s)?;
    }
    Ok(())
}

/// The dispatch_backward handler's call (safety as [`run_dispatch`]).
pub(super) unsafe fn run_dispatch_backward(t: &Target, d: &Decoded) -> Result<(), FfiError> {
    let (g, rank) = group_and_rank(t, d)?;
    let c = g.config;
    let layout = c.layout(g.size)?;
    let elem = row_dtype(&c)?;
    let grad_rows = checked(d, "grad_rows", elem, &[layout.expert_rows, c.hidden])?;
    let routing = checked(d, "routing", DType::U8, &[g.routing_bytes])?;
    let grad_x = checked(d, "grad_x", elem, &[c.tokens, c.hidden])?;
    let mut pe = held(&g, rank)?;
    let group = pe.group.as_mut().expect("held checks it");
    let s = stream(t);
    // SAFETY: as in run_dispatch.
    unsafe {
        group.restore_routing(routing, c.tokens, s)?;
        group.dispatch_backward(grad_rows, grad_x, s)?;
    }
    Ok(())
}

pub(super) static EP_DISPATCH: Spec = Spec {
    name: "xcall_ep_dispatch",
    args: &[always("x"), always("ids"), always("probs"), always("rank")],
    rets: &[
        always("rows"),
        always("tokens_per_expert"),
        always("routing"),
    ],
    scalars: &["group", "zero_unused"],
    cuda_traits: CBC,
    run: run_dispatch,
};

pub(super) static EP_COMBINE: Spec = Spec {
    name: "xcall_ep_combine",
    args: &[always("expert_out"), always("routing"), always("rank")],
    rets: &[always("y")],
    scalars: &["group"],
    cuda_traits: CBC,
    run: run_combine,
};

pub(super) static EP_COMBINE_BACKWARD: Spec = Spec {
    name: "xcall_ep_combine_backward",
    args: &[
        always("grad_y"),
        always("expert_out"),
        always("routing"),
        always("rank"),
    ],
    rets: &[always("grad_expert_out"), always("grad_probs")],
    scalars: &["group"],
    cuda_traits: CBC,
    run: run_combine_backward,
};

pub(super) static EP_DISPATCH_BACKWARD: Spec = Spec {
    name: "xcall_ep_dispatch_backward",
    args: &[always("grad_rows"), always("routing"), always("rank")],
    rets: &[always("grad_x")],
    scalars: &["group"],
    cuda_traits: CBC,
    run: run_dispatch_backward,
};
