//! An expert-parallel group on a world: its buffers, the calls, and the
//! phase protocol that keeps them safe with no host synchronisation.
//!
//! # Phases
//! Every call is a sequence of phases. In a phase each PE writes one part
//! of its allocation that peers read (its tokens and routing, its partial
//! sums, or its probs' gradients), then announces the phase to every PE,
//! then waits until every PE announced it, then reads what peers wrote.
//! The epoch of a phase is a counter in device memory, so a captured call
//! replays correctly.
//!
//! A PE reads a peer's part of phase `m` only between its wait of phase
//! `m` and its announcement of phase `m + 1`; a PE writes a part for
//! phase `m` only after its wait of phase `m - 1`, which every PE passes
//! only after announcing `m - 1`, that is after finishing its reads of
//! phase `m - 2`. So a write never meets a read of the same part as long
//! as consecutive phases publish different parts; where two would publish
//! the same one (two dispatches in a row), the group puts an empty phase
//! between them.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use xcall_core::{Device, Platform};
use xcall_shmem::{ShmemError, World};

use crate::args::{in_place, need};
pub use crate::args::{Buf, ExpertMajor};
use crate::config::{word, Capacity, EpConfig, Layout, Precision};
use crate::cuda::{self, Kernels, Step};
use crate::error::{EpError, Result};
use crate::params::EpParams;
use crate::{host, host_grad, host_pull, steps};

/// The part of the allocation a phase publishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Send,
    Partial,
    GradProbs,
}

/// One PE's handle on an expert-parallel group. Made collectively on a
/// live world by [`EpGroup::new`], freed collectively by
/// [`EpGroup::destroy`]. Calls enqueue on the caller's CUDA stream (Host:
/// run before returning) and every PE makes the same calls in the same
/// order; a PE whose call is refused (bad arguments) takes no part, and
/// its peers' waits time out.
pub struct EpGroup {
    pub(crate) config: EpConfig,
    pub(crate) layout: Layout,
    pub(crate) device: Device,
    pub(crate) rank: usize,
    pub(crate) base: u64,
    pub(crate) timeout: Duration,
    pub(crate) kernels: Option<Arc<Kernels>>,
    exchange_blocks: u32,
    sms_used: usize,
    /// Whether dispatch and combine run the low-latency kernels.
    low_latency: bool,
    /// Host, every PE of this process: dispatch and combine read peers'
    /// rows where they are (see [`crate::host_pull`]).
    pull: bool,
    /// CUDA ([`EpConfig::cuda_kernels`]: [`crate::EpKernels::Pull`], and Auto
    /// above decode sizes): dispatch reads peers' send rows, or, with
    /// `peer_devices`, their callers' f32 or bf16 rows in place where
    /// peers may read them ([`xcall_core::cuda::peer_readable`]).
    pull_rows: bool,
    /// Where every PE is a thread of this process (peers' pointers are
    /// ours), the PEs' devices; else empty.
    peer_devices: Vec<xcall_core::Device>,
    pub(crate) last: Option<Part>,
    pub(crate) dispatched: Option<usize>,
    /// A dispatch sent and not yet received: its tokens, their count, and
    /// the ids this PE's publish replaced.
    pub(crate) pending: Option<(Buf, usize, usize)>,
    /// With [`EpGroup::profile`] on (CUDA): an event after each step, the
    /// first one before.
    pub(crate) marks: RefCell<Option<Vec<Mark>>>,
}

/// A step's end: its name and an event after it.
pub(crate) type Mark = (&'static str, xcall_core::cuda::Event);

impl std::fmt::Debug for EpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpGroup")
            .field("config", &self.config)
            .field("rank", &self.rank)
            .field("device", &self.device)
            .field("base", &format_args!("{:#x}", self.base))
            .finish()
    }
}

impl EpGroup {
    /// Makes the group on every PE of `world` (collective: every PE calls
    /// it with the same config). Needs `config.layout(P).heap_bytes` of
    /// the world's symmetric heap and load/store access to every peer
    /// (same process, or one host: CUDA IPC or shared memory).
    pub fn new(world: &mut World, config: EpConfig) -> Result<EpGroup> {
        let pes = world.size()?;
        let rank = world.rank()?;
        let layout = config.layout(pes)?;
        let device = world.device_of(rank)?;
        let kernels = match device.platform {
            Platform::Host => None,
            Platform::Cuda => {
                let k = cuda::kernels(device)?;
                if config.precision == Precision::Fp8Dispatch && k.capability < (8, 9) {
                    return Err(EpError::Shmem(ShmemError::Unsupported(format!(
                        "FP8 dispatch needs compute capability 8.9 or newer; {device} has {}.{}",
                        k.capability.0, k.capability.1
                    ))));
                }
                Some(k)
            }
        };
        let base = world.malloc(layout.heap_bytes).map_err(|e| match e {
            ShmemError::OutOfMemory(m) => EpError::OutOfMemory(format!(
                "the group needs {} bytes of symmetric heap on each PE ({m}); \
                 start the world with a larger heap",
                layout.heap_bytes
            )),
            e => e.into(),
        })?;
        let bases: Option<Vec<u64>> = (0..pes).map(|q| world.ptr(q, base)).collect();
        let Some(bases) = bases else {
            // Every PE sees the same pairs, so every PE frees here too.
            let q = (0..pes)
                .find(|&q| world.ptr(q, base).is_none())
                .unwrap_or(0);
            let transport = world.transport(q)?;
            world.free(base)?;
            return Err(EpError::Shmem(ShmemError::Unsupported(format!(
                "PE {q} is reached through {transport:?}; an expert-parallel group reads \
                 peers' memory directly (one host)"
            ))));
        };
        let mut zeros = vec![0u64; pes + word::COUNT];
        let at = layout.at;
        // SAFETY: the group's allocation holds `pes` ready words, then (at
        // `words`) word::COUNT words and (at `bases`) `pes` bases.
        unsafe {
            match &kernels {
                None => {
                    std::ptr::write_bytes((base + at.ready as u64) as *mut u64, 0, pes);
                    std::ptr::write_bytes((base + at.words as u64) as *mut u64, 0, word::COUNT);
                    std::ptr::copy_nonoverlapping(
                        bases.as_ptr(),
                        (base + at.bases as u64) as *mut u64,
                        pes,
                    );
                }
                Some(_) => {
                    zeros.truncate(pes);
                    cuda::write_words(device, base + at.ready as u64, &zeros)?;
                    cuda::write_words(device, base + at.words as u64, &[0; word::COUNT])?;
                    cuda::write_words(device, base + at.bases as u64, &bases)?;
                }
            }
        }
        // Nobody announces a phase before every PE cleared its ready words.
        world.barrier_all()?;
        let mut same_process = true;
        let mut devices = Vec::with_capacity(pes);
        for q in 0..pes {
            same_process &= world.transport(q)? == xcall_shmem::Transport::SameProcess;
            devices.push(world.device_of(q)?);
        }
        let sms = kernels.as_ref().map_or(1, |k| k.sms as usize);
        let sms_used = match config.num_sms {
            0 => sms,
            n => n.min(sms),
        };
        let (low_latency, pull_rows) = match kernels {
            Some(_) => config.cuda_kernels(pes, sms_used),
            None => (false, false),
        };
        Ok(EpGroup {
            config,
            layout,
            device,
            rank,
            base,
            timeout: world.timeout()?,
            exchange_blocks: (2 * sms_used).max(1) as u32,
            low_latency,
            pull: kernels.is_none() && same_process && pes > 1,
            pull_rows,
            peer_devices: if same_process { devices } else { Vec::new() },
            kernels,
            sms_used,
            last: None,
            dispatched: None,
            pending: None,
            marks: RefCell::new(None),
        })
    }

    /// The group's config.
    pub fn config(&self) -> &EpConfig {
        &self.config
    }

    /// The group's layout (sizes of the caller's buffers among them).
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// This PE's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Streaming multiprocessors the exchange kernels occupy at most (1 on
    /// Host).
    pub fn sms_used(&self) -> usize {
        self.sms_used
    }

    /// Whether [`EpGroup::dispatch`] and [`EpGroup::combine`] (and
    /// `dispatch_backward`) run the low-latency kernels: CUDA and a size
    /// [`EpConfig::kernels`] lets them run (see [`crate::EpKernels`]). One
    /// PE's combine is one kernel either way (its sums are its outputs).
    pub fn low_latency(&self) -> bool {
        self.low_latency
    }

    /// Whether this PE's dispatch reads its peers' rows where they are
    /// (Host, every PE of this process: see [`crate::host_pull`]; CUDA,
    /// several PEs above decode sizes: see [`EpConfig::cuda_kernels`])
    /// instead of storing its own into them.
    pub fn pulls(&self) -> bool {
        self.pull || self.pull_rows
    }

    /// The kernels this group runs, [`crate::EpKernels::Auto`] resolved:
    /// `LowLatency`, `Pull` or `Steps` (`Steps` on Host, which runs the
    /// steps).
    pub fn kernels_run(&self) -> crate::EpKernels {
        use crate::EpKernels::*;
        match (self.low_latency, self.pull_rows) {
            (true, _) => LowLatency,
            (false, true) => Pull,
            (false, false) => Steps,
        }
    }

    /// Bytes of the caller's expert-major rows buffer
    /// ([`ExpertMajor::rows`]).
    pub fn expert_rows_bytes(&self) -> usize {
        // Checked by the layout: rows * H * 4 fits (see Layout::new).
        self.layout.expert_rows * self.config.hidden * self.config.precision.wire_bytes()
    }

    /// The group's send rows (`[T, H]`, f32 or bf16 groups): tokens the
    /// caller writes here (after the combine or backward call that ends
    /// the previous dispatch, on the same stream) are sent from where they
    /// are when `x` of [`EpGroup::dispatch`] is this buffer, saving a copy.
    /// A CUDA group whose PEs are threads of one process and whose
    /// dispatch pulls saves it too for any `x` its peers may read where it
    /// is ([`xcall_core::cuda::peer_readable`]). FP8 groups quantize from
    /// `x` wherever it is (not here).
    pub fn send_rows(&self) -> Buf {
        Buf::new(
            self.base + self.layout.at.send as u64,
            self.config.tokens * self.row_bytes(),
        )
    }

    pub(crate) fn params(&self) -> EpParams {
        let (c, l, at) = (&self.config, &self.layout, &self.layout.at);
        EpParams {
            base: self.base,
            bases: self.base + at.bases as u64,
            rank: self.rank as i64,
            pes: l.pes as i64,
            tokens: c.tokens as i64,
            hidden: c.hidden as i64,
            topk: c.topk as i64,
            experts: c.experts as i64,
            local_experts: l.local_experts as i64,
            tiles_per_pe: (l.tiles / l.pes) as i64,
            align: c.align as i64,
            capacity: match c.capacity {
                Capacity::Dropless => 0,
                Capacity::PerExpert(n) => n as i64,
            },
            precision: c.precision.code() as i64,
            expert_rows: l.expert_rows as i64,
            off_send: at.send as i64,
            off_send_scales: at.send_scales as i64,
            off_ids: at.ids as i64,
            off_probs: at.probs as i64,
            off_partial: at.partial as i64,
            off_recv: at.recv as i64,
            off_recv_scales: at.recv_scales as i64,
            off_grad_probs: at.grad_probs as i64,
            off_ready: at.ready as i64,
            off_words: at.words as i64,
            off_local: at.local as i64,
            off_recv_probs: at.recv_probs as i64,
            off_route_row: at.route_row as i64,
            off_tile_counts: at.tile_counts as i64,
            off_expert_start: at.expert_start as i64,
            off_sent: at.sent as i64,
            off_ll_rank: at.ll_rank as i64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            exchange_blocks: self.exchange_blocks as i64,
            pull: self.pull_rows as i64,
            ..EpParams::default()
        }
    }

    /// Runs `steps` with `p`: on Host now, on CUDA enqueued on `stream`.
    ///
    /// # Safety
    /// `p`'s addresses are valid for the steps (checked by the caller).
    pub(crate) unsafe fn run(
        &self,
        steps: &[Step],
        p: &EpParams,
        stream: *mut c_void,
    ) -> Result<usize> {
        let mut replaced = 0;
        for (i, &step) in steps.iter().enumerate() {
            // On CUDA the kernels that read what peers wrote in a phase
            // wait for it themselves.
            let awaits = steps.get(i + 1).is_some_and(|next| next.awaits());
            match &self.kernels {
                Some(_) if step == Step::Wait && awaits => {}
                // SAFETY: the caller's contract.
                Some(k) => {
                    if self.marks.borrow().as_ref().is_some_and(|m| m.is_empty()) {
                        self.mark("start", stream)?;
                    }
                    // SAFETY: the caller's contract.
                    unsafe { cuda::launch(self.device, k, step, p, stream) }?;
                    self.mark(step.name(), stream)?;
                }
                // SAFETY: the caller's contract.
                None => unsafe {
                    match step {
                        Step::Publish => replaced += host::publish(p, p.wire == 1),
                        Step::Push => host::push(p),
                        Step::Signal => host::signal(p),
                        Step::Wait => host::wait(p)?,
                        Step::Count => host::count(p),
                        Step::Scan => host::scan(p),
                        Step::Assign => host::assign(p),
                        Step::Copy => host::copy(p, self.pull),
                        Step::Reduce => host::reduce(p),
                        Step::GatherSum if self.pull => host_pull::gather(p),
                        Step::GatherSum => host::gather_sum(p),
                        Step::ScatterGrad => host_grad::scatter_grad(p),
                        Step::GatherProbs => host_grad::gather_probs(p),
                        // Host groups run the steps (`low_latency` is
                        // false there).
                        Step::LlDispatch | Step::LlCombine => {
                            return Err(EpError::State(format!(
                                "{} is a CUDA kernel; a Host group runs the steps",
                                step.name()
                            )))
                        }
                    }
                },
            }
        }
        Ok(replaced)
    }

    /// Puts an empty phase first when the last call's last phase published
    /// `part` too (see the module docs).
    ///
    /// # Safety
    /// As [`EpGroup::run`].
    unsafe fn fence(&mut self, part: Part, stream: *mut c_void) -> Result<()> {
        if self.last == Some(part) {
            // SAFETY: signal and wait touch only the group's allocation.
            unsafe { self.run(&[Step::Signal, Step::Wait], &self.params(), stream) }?;
        }
        Ok(())
    }

    fn dispatched(&self, call: &str) -> Result<usize> {
        self.dispatched.ok_or_else(|| {
            EpError::State(format!(
                "{call} needs the layout of a dispatch; call dispatch first"
            ))
        })
    }

    fn row_bytes(&self) -> usize {
        self.config.hidden * self.config.precision.element_bytes()
    }

    /// Dispatch: this PE's first `tokens` rows of `x` (`[tokens, H]`, f32
    /// or bf16; bf16 for FP8, quantized here), each sent once to each PE
    /// hosting one of its experts, with `ids` (`[tokens, k]` i32, -1: no
    /// route) and `probs` (`[tokens, k]` f32); every PE's received rows
    /// land in `out`, grouped by its local experts. With a capacity,
    /// routes past an expert's capacity are dropped and counted
    /// ([`EpGroup::dropped_routes`]).
    ///
    /// An id outside `-1..E`, or one listed twice for a token, is not
    /// routed; the call still completes on every PE (so no peer waits for
    /// it), and this PE reports [`EpError::BadRouting`]: on Host as this
    /// call's result, on CUDA at the next [`EpGroup::check`].
    ///
    /// # Safety
    /// The buffers are this PE's memory (Host: host memory; CUDA: device
    /// memory of this PE's device) of at least the sizes given, and stay
    /// valid until the stream has run the call; nothing else writes `x`,
    /// `ids` or `probs`, or reads or writes `out`, meanwhile.
    pub unsafe fn dispatch(
        &mut self,
        x: Buf,
        ids: Buf,
        probs: Buf,
        tokens: usize,
        out: &ExpertMajor,
        stream: *mut c_void,
    ) -> Result<()> {
        self.not_pending("dispatch")?;
        out.check(&self.config, &self.layout)?;
        if !self.low_latency {
            // SAFETY: the caller's contract, passed on.
            return unsafe {
                self.dispatch_send(x, ids, probs, tokens, stream)?;
                self.dispatch_recv(out, stream)
            };
        }
        let p = out.writing(self.send_params(x, ids, probs, tokens)?);
        // SAFETY: as dispatch_send and dispatch_recv: the addresses were
        // checked against the sizes the kernel uses.
        unsafe {
            self.fence(Part::Send, stream)?;
            self.run(&[Step::LlDispatch], &p, stream)?;
        }
        self.last = Some(Part::Send);
        self.dispatched = Some(tokens);
        Ok(())
    }

    fn not_pending(&self, call: &str) -> Result<()> {
        match self.pending {
            Some(_) => Err(EpError::State(format!(
                "{call} while a dispatch_send waits for its dispatch_recv; call dispatch_recv first"
            ))),
            None => Ok(()),
        }
    }

    /// The first half of [`EpGroup::dispatch`]: this PE's routing and
    /// tokens published, enqueued on `stream`: stored into the PEs hosting
    /// their experts (the pushed steps: Host processes, and CUDA groups
    /// that do not pull, see [`EpGroup::pulls`]), or offered where peers
    /// read them (pulled: the rows move in the second half). The caller
    /// may enqueue work of its own before [`EpGroup::dispatch_recv`],
    /// which every PE must call next (it waits for the peers' tokens);
    /// pushed, that work runs while the stores are in flight.
    ///
    /// # Safety
    /// As [`EpGroup::dispatch`]; `x`, `ids` and `probs` stay valid and
    /// unwritten until the stream has run the `dispatch_recv` after it.
    pub unsafe fn dispatch_send(
        &mut self,
        x: Buf,
        ids: Buf,
        probs: Buf,
        tokens: usize,
        stream: *mut c_void,
    ) -> Result<()> {
        self.not_pending("dispatch_send")?;
        let mut p = self.send_params(x, ids, probs, tokens)?;
        let (rows, send) = (tokens * self.row_bytes(), self.send_rows().addr);
        if self.pull_rows && in_place(&self.config, self.device, &self.peer_devices, x, rows, send)?
        {
            p.pull = 2;
        }
        // SAFETY: the addresses were checked against the sizes the steps
        // use; the rest is the caller's contract and the group's layout.
        let replaced = unsafe {
            self.fence(Part::Send, stream)?;
            if self.pull {
                host_pull::offer(&p);
            }
            self.run(steps::send(self.layout.pes, self.pulls()), &p, stream)?
        };
        self.last = Some(Part::Send);
        self.pending = Some((x, tokens, replaced));
        Ok(())
    }

    /// The parameters of a dispatch's sending half, its buffers checked.
    fn send_params(&self, x: Buf, ids: Buf, probs: Buf, tokens: usize) -> Result<EpParams> {
        let c = self.config;
        if tokens > c.tokens {
            return Err(EpError::InvalidArgument(format!(
                "{tokens} tokens is more than the group's {}",
                c.tokens
            )));
        }
        need("x", x, tokens * self.row_bytes(), 16)?;
        let ours = self.base..self.base + self.layout.heap_bytes as u64;
        let zero_copy = x.addr == self.send_rows().addr && c.precision != Precision::Fp8Dispatch;
        if !zero_copy
            && tokens > 0
            && (ours.contains(&x.addr)
                || x.addr < ours.start && x.addr.saturating_add(x.bytes as u64) > ours.start)
        {
            return Err(EpError::InvalidArgument(format!(
                "x at {:#x} overlaps the group's own memory; only an f32 or bf16 group's send_rows() may be passed as x",
                x.addr
            )));
        }
        need("ids", ids, tokens * c.topk * 4, 4)?;
        need("probs", probs, tokens * c.topk * 4, 4)?;
        Ok(EpParams {
            n: tokens as i64,
            src: x.addr,
            src_ids: ids.addr,
            src_probs: probs.addr,
            wire: 1,
            ..self.params()
        })
    }

    /// The second half of [`EpGroup::dispatch`]: waits for every PE's
    /// tokens of the last [`EpGroup::dispatch_send`] and lays this PE's
    /// received rows out in `out` (enqueued on `stream`). Reports
    /// [`EpError::BadRouting`] as dispatch does.
    ///
    /// # Safety
    /// As [`EpGroup::dispatch`], for `out`.
    pub unsafe fn dispatch_recv(&mut self, out: &ExpertMajor, stream: *mut c_void) -> Result<()> {
        let Some((x, tokens, replaced)) = self.pending else {
            return Err(EpError::State(
                "dispatch_recv needs a dispatch_send first".into(),
            ));
        };
        out.check(&self.config, &self.layout)?;
        let p = out.writing(EpParams {
            n: tokens as i64,
            src: x.addr,
            wire: 1,
            ..self.params()
        });
        // SAFETY: as dispatch_send; `out` checked above.
        unsafe {
            let steps = steps::recv(self.layout.pes, self.pulls());
            self.run(steps, &p, stream)?;
        }
        if self.pulls() {
            // A pulled dispatch ends with an empty phase: no peer still
            // reads what this PE published, so the next call needs none.
            self.last = None;
        }
        self.pending = None;
        self.dispatched = Some(tokens);
        if replaced > 0 {
            return Err(host::routing_error(&p, replaced));
        }
        Ok(())
    }

    /// Combine: each of this PE's tokens of the last dispatch becomes the
    /// sum of its experts' output rows, each times its prob: every PE sums
    /// its experts' rows of a token (in top-k slot order, f32) and sends
    /// one row back; this PE adds those in PE rank order (f32) into `y`
    /// (`[tokens, H]`). `expert_out` is `[expert_rows, H]` in the
    /// expert-major layout (bf16 for FP8). A token with no route gets a
    /// zero row.
    ///
    /// # Safety
    /// As [`EpGroup::dispatch`], for `expert_out` (read) and `y` (written).
    pub unsafe fn combine(&mut self, expert_out: Buf, y: Buf, stream: *mut c_void) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.combine_weighted(expert_out, y, true, stream, "combine") }
    }

    /// The gradient of dispatch: `grad_x` (`[tokens, H]`) of each token is
    /// the sum of the gradients of its routes' rows (`grad_rows`, the
    /// expert-major layout), unweighted; dropped routes add nothing.
    ///
    /// # Safety
    /// As [`EpGroup::combine`].
    pub unsafe fn dispatch_backward(
        &mut self,
        grad_rows: Buf,
        grad_x: Buf,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.combine_weighted(grad_rows, grad_x, false, stream, "dispatch_backward") }
    }

    unsafe fn combine_weighted(
        &mut self,
        src: Buf,
        y: Buf,
        weighted: bool,
        stream: *mut c_void,
        call: &str,
    ) -> Result<()> {
        self.not_pending(call)?;
        let n = self.dispatched(call)?;
        let rows = self.layout.expert_rows * self.row_bytes();
        need(
            if weighted { "expert_out" } else { "grad_rows" },
            src,
            rows,
            16,
        )?;
        need(
            if weighted { "y" } else { "grad_x" },
            y,
            n * self.row_bytes(),
            16,
        )?;
        let p = EpParams {
            n: n as i64,
            src: src.addr,
            out: y.addr,
            weighted: weighted as i64,
            ..self.params()
        };
        // SAFETY: checked above; the caller's contract.
        unsafe {
            self.fence(Part::Partial, stream)?;
            let steps = steps::combine(self.layout.pes, self.low_latency, self.pull);
            if self.pull {
                host_pull::offer(&p);
            }
            self.run(steps, &p, stream)?;
        }
        self.last = Some(Part::Partial);
        Ok(())
    }

    /// The gradient of combine, given `grad_y` (`[tokens, H]`): each route's
    /// row of `grad_expert_out` (expert-major) is `grad_y` of its token
    /// times the route's prob, and `grad_probs` (`[tokens, k]` f32) each
    /// route's dot product of its expert's output row (`expert_out`, as
    /// combine read it) with `grad_y`, in f32; 0 for a dropped route or an
    /// id that routes nowhere.
    ///
    /// # Safety
    /// As [`EpGroup::combine`], for `grad_y` and `expert_out` (read) and
    /// `grad_expert_out` and `grad_probs` (written).
    pub unsafe fn combine_backward(
        &mut self,
        grad_y: Buf,
        expert_out: Buf,
        grad_expert_out: Buf,
        grad_probs: Buf,
        stream: *mut c_void,
    ) -> Result<()> {
        self.not_pending("combine_backward")?;
        let n = self.dispatched("combine_backward")?;
        let rows = self.layout.expert_rows * self.row_bytes();
        need("grad_y", grad_y, n * self.row_bytes(), 16)?;
        need("expert_out", expert_out, rows, 16)?;
        need("grad_expert_out", grad_expert_out, rows, 16)?;
        need("grad_probs", grad_probs, n * self.config.topk * 4, 4)?;
        let p = EpParams {
            n: n as i64,
            src: grad_y.addr,
            out: grad_expert_out.addr,
            expert_out: expert_out.addr,
            grad_probs_out: grad_probs.addr,
            ..self.params()
        };
        // SAFETY: checked above; the caller's contract.
        unsafe {
            self.fence(Part::Send, stream)?;
            self.run(&steps::COMBINE_BACKWARD, &p, stream)?;
        }
        self.last = Some(Part::GradProbs);
        Ok(())
    }

    /// Frees the group on every PE (collective). Synchronize the calls'
    /// streams first: peers may still read this PE's memory until every
    /// PE is here.
    pub fn destroy(self, world: &mut World) -> Result<()> {
        world.barrier_all()?;
        world.free(self.base)?;
        Ok(())
    }
}
