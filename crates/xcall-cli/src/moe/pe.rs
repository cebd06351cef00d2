//! One PE of the layer: its world, its symmetric buffers and its step.
//!
//! Every PE numbers the experts from its own: PE `me` sees expert `e` as
//! `(e - me*L) mod E` (`L = E/P` local experts), so the routing and
//! probs it uploads are rotated by `me*L` columns. Then the first slot of
//! its permuted rows (`[L][C]` rows, one per destination PE) is its own,
//! and slot `j` goes to PE `(me + j) mod P`, with every destination's
//! experts in their natural order.
//!
//! Two symmetric buffers hold the exchanged rows, so that a PE's own rows
//! are never copied. With the fused exchange (the default) each has `P`
//! slots:
//! - `rows`: `[P-1 slots from peers | own slot]`. `permute` writes every
//!   destination's rows straight into its slot for this PE (segments, one
//!   per destination PE, reached through the world's peer pointers): PE
//!   `s`'s rows land in slot `(s - me - 1) mod P` of `me`'s `rows`, its
//!   own in slot `P - 1`. The experts read all `P`.
//! - `results`: the same layout; the experts write it, and `unpermute`
//!   reads each destination's results where they are (segments again:
//!   PE `me + j`'s slot `P - 1 - j`).
//!
//! Then dispatch and combine move no rows: each is one signal per peer,
//! enqueued after the kernel whose stores (or whose results) it
//! announces. With the copy exchange (`--exchange copy`, for transports
//! without load/store access to peers) each buffer has `2P - 1` slots:
//! - `rows`: `[P-1 slots from peers | own slot | P-1 slots to peers]`.
//!   `permute` writes the last `P` slots (own first); the experts read the
//!   first `P` (peers' rows, then its own). PE `s`'s rows land in slot
//!   `(s - me - 1) mod P`.
//! - `results`: `[P-1 slots to peers | own slot | P-1 slots from peers]`.
//!   The experts write the first `P` slots (the layout they read);
//!   `unpermute` reads the last `P` (own first, then slot `j` from PE
//!   `(me + j) mod P`, the order `permute` wrote).
//!
//! A slot holds `S` rows: `L*C` with an expert capacity `C` (expert `l`'s
//! rows at `[l*C, (l+1)*C)` of its slot), or, dropless, `T*min(k, L)`:
//! the most rows a PE's tokens can route to one PE's experts, each
//! destination's experts packed densely from its slot's first row. Either
//! way every slot's size and offset is fixed whatever the routing, so every
//! copy below has a fixed size and a captured step replays for new data.
//! Dropless, the experts' row counts travel with the rows: `counts` holds
//! `[P-1 slots of L counts from peers | the PE's own E tokens_per_expert]`,
//! so that its first `P*L` counts describe the first `P` slots of `rows`.
//!
//! The step on PE `me` (the same code on Host and CUDA; on CUDA every call
//! is enqueued on the PE's stream, so the graph cache can capture it):
//! 1. `make_row_id_map` with the expert capacity `C`, or dropless with
//!    one expert group of `L` experts and `S` rows per destination;
//! 2. `permute` groups the PE's tokens by (rotated) expert into the
//!    destinations' slots (fused) or the send half of `rows` (copy);
//! 3. dispatch: to PE `q = (me + j) mod P` for `j >= 1`, dropless its
//!    slot's `L` counts first, on the same stream; then `put_signal`, SET
//!    `dispatch[me] = 1` there, with the slot (copy) or no bytes (fused);
//!    the PE waits for `dispatch[s] == 1` from every peer `s` and clears
//!    it;
//! 4. its experts run `silu(x) * scale_e` (warpspec) from the receive
//!    half of `rows` into the send half of `results`: one call over every
//!    (sender, local expert) block of `C` rows, each with its expert's
//!    scale (`scales`, written once); dropless, one call over the ragged
//!    groups the counts give (only the routed rows are read and written);
//! 5. combine: `put_signal` SET `combine[me] = 1` on PE `s`, with the
//!    slot of PE `s`'s rows (copy: into PE `s`'s `results`) or no bytes
//!    (fused); the PE waits for every peer's `combine[q]`, clears it, and
//!    `unpermute` with the merging probs reads the results (from the
//!    peers' slots when fused) and writes `y` (`[T, H]`).
//!
//! No step needs a barrier: a PE writes into a peer's receive slots only
//! after that peer's combine of the previous step reached it, which the
//! peer sends after its experts read them. Fused, a PE's experts
//! overwrite the `results` its peers read only after every peer's next
//! dispatch signal, which each sends after its unpermute; copied, a PE
//! writes a peer's `results` only after that. The signal words are
//! cleared before the signal that lets the next write happen is sent. A
//! PE's own writes (permute, experts) never touch the slots its peers
//! write.

use std::ffi::c_void;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};
use xcall_core::{Device, Platform};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{Buffer, BufferRole, Call, CallKey, GraphCache, Outcome};
use xcall_permute::call::Target;
use xcall_permute::{ExpertGroups, RowIdMapOptions};
use xcall_shmem::{BootstrapKind, Cmp, Config, Incoming, Outgoing, SignalOp, Transport, World};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::Variant;
use xcall_warpspec::ops::{GroupScales, OpConfig, RaggedGroups};
use xcall_warpspec::{HostExecutor, OpCall};

use super::data::{Inputs, Shape};
use crate::layer::{Context, Dims, Layer, Res};

/// The graph-cache target id of the MoE step.
const TARGET: u64 = 0x6d6f_655f_7374_6570; // "moe_step"

/// Where the PE waits for its peers' signals.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Waits {
    /// The host thread polls (with the world's timeout): the eager
    /// warm-up step, where a failing peer must not hang the others.
    Host,
    /// The PE's CUDA stream waits (a kernel that gives up after the
    /// world's timeout; the barrier reports it): capturable.
    Stream,
}

/// The phases of a step, in order (see the module docs).
pub const PHASES: [&str; 8] = [
    "map",
    "permute",
    "dispatch",
    "dispatch wait",
    "experts",
    "combine",
    "combine wait",
    "unpermute",
];

/// The end of a phase: an event on the PE's stream, or the host clock (a
/// Host step runs synchronously).
enum Mark {
    Event(CudaEvent),
    Clock(Instant),
}

/// Symmetric buffers (the same offsets on every PE).
#[derive(Clone, Copy, Debug)]
struct Buffers {
    layer: Layer,
    /// `(P-1)*L + E` i64: the counts received with the peers' slots, then
    /// `layer.tpe`.
    counts: u64,
    /// `2P - 1` slots: received rows, the own slot, rows to send.
    rows: u64,
    /// `2P - 1` slots: results to send, the own slot, received results.
    results: u64,
    y: u64,
    dispatch: u64,
    combine: u64,
    scales: u64,
}

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

/// One PE.
pub struct Pe {
    world: World,
    shape: Shape,
    rank: usize,
    device: Device,
    b: Buffers,
    sizes: Vec<(u64, usize, BufferRole)>,
    gpu: Option<Gpu>,
    ops: OpConfig,
    /// How the experts run on Host.
    host: HostExecutor,
    /// The transport of the peers without peer pointers (NCCL on CUDA,
    /// TCP on Host), when some peer takes one: the copy exchange then
    /// moves its slots with `World::exchange`.
    remote: Option<Transport>,
    /// How long the PE waits for anything another PE takes part in, its
    /// own stream's work included (it may wait on peers' signals or NCCL
    /// transfers).
    timeout: Duration,
}

/// The segments of the copy exchange on PE `me` as one
/// `World::exchange`: the dispatch (`combine == false`: dropless, each
/// slot's counts first, then the slot of `rows`) or the combine (the
/// results' slots), with the slot indices of the `put_signal` path (see
/// the module docs). PE `me + j` receives what `me` sends it, in order.
fn copy_segments(
    shape: &Shape,
    b: &Buffers,
    me: usize,
    combine: bool,
) -> (Vec<Outgoing>, Vec<Incoming>) {
    let p = shape.pes;
    let slot = Pe::slot_bytes(shape) as u64;
    let l = shape.local_experts() as u64;
    let (mut out, mut inc) = (Vec::new(), Vec::new());
    for j in 1..p as u64 {
        let to = (me + j as usize) % p;
        let from = (me + p - j as usize) % p;
        if combine {
            out.push(Outgoing {
                pe: to,
                src: b.results + (j - 1) * slot,
                dest: b.results + (2 * p as u64 - 1 - j) * slot,
                bytes: slot as usize,
            });
            inc.push(Incoming {
                pe: from,
                dest: b.results + (2 * p as u64 - 1 - j) * slot,
                bytes: slot as usize,
            });
            continue;
        }
        let counts = b.counts + (p as u64 - 1 - j) * l * 8;
        let rows = b.rows + (p as u64 - 1 - j) * slot;
        if shape.dropless {
            out.push(Outgoing {
                pe: to,
                src: b.layer.tpe + j * l * 8,
                dest: counts,
                bytes: (l * 8) as usize,
            });
            inc.push(Incoming {
                pe: from,
                dest: counts,
                bytes: (l * 8) as usize,
            });
        }
        out.push(Outgoing {
            pe: to,
            src: b.rows + (p as u64 - 1 + j) * slot,
            dest: rows,
            bytes: slot as usize,
        });
        inc.push(Incoming {
            pe: from,
            dest: rows,
            bytes: slot as usize,
        });
    }
    (out, inc)
}

impl Pe {
    /// The layer's buffers of `shape`: bytes and role of each, in the order
    /// of [`Buffers`]' fields.
    fn buffer_sizes(shape: &Shape) -> [(usize, BufferRole); 12] {
        let (t, h, e) = (shape.tokens, shape.hidden, shape.experts);
        let s = shape.dtype.size_bytes();
        let p = shape.pes;
        let slots = Self::slots(shape) * Self::slot_bytes(shape);
        [
            (t * h * s, BufferRole::In),
            (t * e, BufferRole::In),
            (t * e * 4, BufferRole::In),
            (t * (2 * e + 1) * 4, BufferRole::InOut),
            (((p - 1) * shape.local_experts() + e) * 8, BufferRole::InOut),
            ((e + 1) * 8, BufferRole::InOut),
            (slots, BufferRole::InOut),
            (slots, BufferRole::InOut),
            (t * h * s, BufferRole::Out),
            (p * 8, BufferRole::InOut),
            (p * 8, BufferRole::InOut),
            (p * shape.local_experts() * 4, BufferRole::In),
        ]
    }

    /// The symmetric heap a PE of `shape` needs: its buffers (256-byte
    /// aligned), the world's signal words, and 1 MiB to spare.
    pub fn heap_bytes(shape: &Shape) -> usize {
        Self::buffer_sizes(shape)
            .iter()
            .map(|(b, _)| b.next_multiple_of(256))
            .sum::<usize>()
            + (shape.pes + 4) * 16
            + (1 << 20)
    }

    /// Joins the world met through `bootstrap` as `rank` on `device`,
    /// waiting at most `timeout` for any other PE, and allocates the
    /// layer's buffers in a heap of `heap` bytes (`None`: the world's
    /// default, `XCALL_SHMEM_HEAP_BYTES`).
    pub fn new(
        shape: Shape,
        heap: Option<usize>,
        rank: usize,
        device: Device,
        bootstrap: &BootstrapKind,
        timeout: Duration,
    ) -> Res<Pe> {
        let p = shape.pes;
        let sizes = Self::buffer_sizes(&shape);
        let mut config = Config::in_process("", rank, p, device);
        config.bootstrap = bootstrap.clone();
        config.heap_bytes = heap;
        config.timeout = timeout;
        let mut world = World::new();
        world.init(&config).context("shmem init")?;
        let mut addrs = Vec::with_capacity(sizes.len());
        for (bytes, _) in sizes {
            addrs.push(world.malloc(bytes.max(1)).context("shmem malloc")?);
        }
        let b = Buffers {
            layer: Layer {
                x: addrs[0],
                routing: addrs[1],
                probs: addrs[2],
                map: addrs[3],
                tpe: addrs[4] + ((p - 1) * shape.local_experts() * 8) as u64,
                offsets: addrs[5],
            },
            counts: addrs[4],
            rows: addrs[6],
            results: addrs[7],
            y: addrs[8],
            dispatch: addrs[9],
            combine: addrs[10],
            scales: addrs[11],
        };
        let gpu = match device.platform {
            Platform::Host => None,
            Platform::Cuda => {
                let ctx = CudaContext::new(device.ordinal as usize).context("CUDA context")?;
                let stream = ctx.new_stream().context("CUDA stream")?;
                Some(Gpu { ctx, stream })
            }
        };
        let mut pe = Pe {
            world,
            shape,
            rank,
            device,
            b,
            sizes: addrs
                .iter()
                .zip(sizes)
                .map(|(&a, (bytes, role))| (a, bytes, role))
                .collect(),
            gpu,
            ops: OpConfig::default(),
            host: HostExecutor::default(),
            remote: None,
            timeout,
        };
        for q in 0..p {
            let t = pe.world.transport(q).context("shmem transport")?;
            if q != rank && (t.is_nccl() || t == Transport::Tcp) {
                if shape.fused {
                    return Err(format!(
                        "--exchange fused needs every PE addressable, and PE {q} is reached through {}: use --exchange copy",
                        t.name()
                    ));
                }
                pe.remote = Some(t);
            }
        }
        let zeros = vec![0u8; p * 8];
        pe.write(b.dispatch, &zeros)?;
        pe.write(b.combine, &zeros)?;
        // The slots start zeroed: with a capacity the experts read whole
        // slots, whose rows no route writes a fused permute leaves as
        // they are.
        let slots = (Self::slots(&shape) * Self::slot_bytes(&shape)) as u64;
        pe.zero(b.rows, slots)?;
        pe.zero(b.results, slots)?;
        // The scale of every (sender, local expert) block the experts read.
        let scales: Vec<u8> = (0..p * shape.local_experts())
            .flat_map(|block| {
                let expert = rank * shape.local_experts() + block % shape.local_experts();
                shape.scale(expert).to_le_bytes()
            })
            .collect();
        pe.write(b.scales, &scales)?;
        pe.world.barrier_all().context("shmem barrier")?;
        Ok(pe)
    }

    fn stream(&self) -> *mut c_void {
        self.gpu
            .as_ref()
            .map_or(std::ptr::null_mut(), |g| g.stream.cu_stream().cast())
    }

    /// Copies host bytes into this PE's buffer at `dest` (blocking).
    fn write(&mut self, dest: u64, bytes: &[u8]) -> Res<()> {
        let me = self.rank;
        // SAFETY: `bytes` is a live host slice; the world checks `dest`.
        unsafe { self.world.put(dest, bytes.as_ptr() as u64, bytes.len(), me) }
            .context("shmem put (upload)")
    }

    /// Zeroes `bytes` of this PE's buffer at `dest` (blocking, in chunks
    /// of at most 64 MiB).
    fn zero(&mut self, dest: u64, bytes: u64) -> Res<()> {
        const CHUNK: u64 = 64 << 20;
        let zeros = vec![0u8; bytes.min(CHUNK) as usize];
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(CHUNK) as usize;
            self.write(dest + at, &zeros[..n])?;
            at += n as u64;
        }
        Ok(())
    }

    /// Uploads a step's inputs, routing and probs in this PE's expert
    /// numbering (see the module docs), and poisons `y` (NaN in both
    /// dtypes).
    pub fn upload(&mut self, inputs: &Inputs) -> Res<()> {
        let e = self.shape.experts;
        let shift = self.rank * self.shape.local_experts();
        let rotated = |row: usize, col: usize| row * e + (col + shift) % e;
        let routing: Vec<u8> = (0..inputs.routing.len())
            .map(|i| inputs.routing[rotated(i / e, i % e)])
            .collect();
        let probs: Vec<u8> = (0..inputs.probs.len())
            .flat_map(|i| inputs.probs[rotated(i / e, i % e)].to_le_bytes())
            .collect();
        let l = self.b.layer;
        self.write(l.x, &inputs.x)?;
        self.write(l.routing, &routing)?;
        self.write(l.probs, &probs)?;
        let poison = vec![0xffu8; self.shape.tokens * self.shape.row_bytes()];
        self.write(self.b.y, &poison)
    }

    /// The PE's output `y` of the last step (after its stream drained).
    pub fn download(&mut self) -> Res<Vec<u8>> {
        self.drain()?;
        let mut y = vec![0u8; self.shape.tokens * self.shape.row_bytes()];
        let me = self.rank;
        // SAFETY: `y` holds exactly the bytes read.
        unsafe { self.world.get(y.as_mut_ptr() as u64, self.b.y, y.len(), me) }
            .context("shmem get (download)")?;
        Ok(y)
    }

    /// The transport of the peers without pointers, if any.
    pub fn remote(&self) -> Option<Transport> {
        self.remote
    }

    /// This PE's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Waits until the PE's stream ran everything enqueued (nothing on
    /// Host, whose steps run synchronously).
    pub fn drain(&self) -> Res<()> {
        match &self.gpu {
            Some(g) => {
                let done = g.ctx.new_event(None).context("CUDA event")?;
                done.record(&g.stream).context("CUDA event")?;
                self.reached(&done)
            }
            None => Ok(()),
        }
    }

    /// Waits until the PE's stream reached `event`, at most the run's
    /// timeout. The stream may wait on other PEs (signals, NCCL
    /// transfers): a peer that stopped must end in an error here, where a
    /// plain synchronize would never return.
    fn reached(&self, event: &CudaEvent) -> Res<()> {
        let start = Instant::now();
        let mut polls = 0u32;
        while !event.try_is_complete().context("CUDA event")? {
            if start.elapsed() > self.timeout {
                return Err(format!(
                    "PE {}: its GPU work did not finish within {:?} (a peer stopped, or its transfers never came)",
                    self.rank, self.timeout
                ));
            }
            // Spin briefly (a step takes about a millisecond), then yield
            // the core.
            polls += 1;
            if polls < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        Ok(())
    }

    /// Bytes of memory in use: the device's (every context on it) on
    /// CUDA, the process's resident set on Host; `None` where the system
    /// does not say.
    pub fn memory_in_use(&self) -> Res<Option<u64>> {
        match &self.gpu {
            Some(g) => {
                g.ctx.bind_to_thread().context("CUDA context")?;
                let (free, total) =
                    cudarc::driver::result::mem_get_info().context("cuMemGetInfo")?;
                Ok(Some(total.saturating_sub(free) as u64))
            }
            None => Ok(resident_bytes()),
        }
    }

    /// Waits for every PE before the next step.
    pub fn barrier(&mut self) -> Res<()> {
        self.world.barrier_all().context("shmem barrier")
    }

    /// Every PE's `data`, by rank (a collective through the world's
    /// bootstrap).
    pub fn allgather(&mut self, data: &[u8]) -> Res<Vec<Vec<u8>>> {
        self.world.allgather(data).context("shmem allgather")
    }

    /// Slots of `rows` and of `results`: `P` with the fused exchange (the
    /// receive slots and the own one), `2P - 1` with the copy.
    pub fn slots(shape: &Shape) -> usize {
        if shape.fused {
            shape.pes
        } else {
            2 * shape.pes - 1
        }
    }

    /// Bytes of one slot: [`Shape::slot_rows`] rows, what one PE sends
    /// another in dispatch and in combine.
    pub fn slot_bytes(shape: &Shape) -> usize {
        shape.slot_rows() * shape.row_bytes()
    }

    /// The graph-cache key of this PE's step: its device, the shape and
    /// the peers' addresses as attributes, every buffer it touches.
    fn key(&self) -> CallKey {
        let mut h = DefaultHasher::new();
        let s = &self.shape;
        (
            s.pes, s.tokens, s.hidden, s.experts, s.topk, s.capacity, s.dropless, s.fused,
        )
            .hash(&mut h);
        s.dtype.hash(&mut h);
        self.rank.hash(&mut h);
        for pe in 0..s.pes {
            self.world.ptr(pe, self.b.rows).hash(&mut h);
            self.world.ptr(pe, self.b.results).hash(&mut h);
        }
        CallKey {
            device: match self.device.platform {
                Platform::Host => Device::HOST,
                Platform::Cuda => self.device,
            },
            target: TARGET,
            attributes: h.finish(),
            buffers: self
                .sizes
                .iter()
                .map(|&(a, bytes, role)| Buffer::new(a, bytes as u64, role))
                .collect(),
        }
    }

    /// Runs one step through the graph cache; returns its time in ms (CUDA
    /// events on the PE's stream, or the host clock) and what the cache
    /// did.
    pub fn timed_step(&mut self, cache: &GraphCache<CudaGraphs>) -> Res<(f64, Outcome)> {
        let key = self.key();
        match self.gpu.as_ref().map(|g| (g.ctx.clone(), g.stream.clone())) {
            None => {
                let start = Instant::now();
                let outcome = cache
                    .execute(&Call::new(key, None), |_| self.step(Waits::Host))
                    .context("graph cache")?;
                Ok((start.elapsed().as_secs_f64() * 1e3, outcome))
            }
            Some((ctx, stream)) => {
                let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
                let a = ctx.new_event(timed).context("CUDA event")?;
                let z = ctx.new_event(timed).context("CUDA event")?;
                a.record(&stream).context("CUDA event")?;
                let handle = CudaStreamHandle(stream.cu_stream());
                let outcome = cache
                    .execute(&Call::new(key, Some(handle)), |_| self.step(Waits::Stream))
                    .context("graph cache")?;
                z.record(&stream).context("CUDA event")?;
                self.reached(&z)?;
                Ok((a.elapsed_ms(&z).context("CUDA event")? as f64, outcome))
            }
        }
    }

    /// One step of the layer (see the module docs), enqueued on the PE's
    /// stream on CUDA.
    pub fn step(&mut self, waits: Waits) -> Res<()> {
        self.step_marked(waits, &mut None)
    }

    /// One eager step with the end of every phase marked; returns each
    /// phase's time in ms ([`PHASES`] order). On CUDA the whole step is
    /// enqueued before any mark is read, so a phase's time is device time
    /// (plus any wait for the host to enqueue it) and the waits are on the
    /// stream, as in a captured step.
    pub fn phase_step(&mut self) -> Res<Vec<f64>> {
        let mut marks = Some(Vec::with_capacity(PHASES.len() + 1));
        self.mark(&mut marks)?;
        let waits = match self.gpu {
            Some(_) => Waits::Stream,
            None => Waits::Host,
        };
        self.step_marked(waits, &mut marks)?;
        let marks = marks.unwrap_or_default();
        marks
            .windows(2)
            .map(|w| match w {
                [Mark::Event(a), Mark::Event(b)] => {
                    self.reached(b)?;
                    Ok(a.elapsed_ms(b).context("CUDA event")? as f64)
                }
                [Mark::Clock(a), Mark::Clock(b)] => Ok((*b - *a).as_secs_f64() * 1e3),
                _ => Err("a step mixed event and clock marks".to_string()),
            })
            .collect()
    }

    /// Records the end of a phase into `marks` (nothing when `None`).
    fn mark(&self, marks: &mut Option<Vec<Mark>>) -> Res<()> {
        let Some(marks) = marks else {
            return Ok(());
        };
        marks.push(match &self.gpu {
            None => Mark::Clock(Instant::now()),
            Some(g) => {
                let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
                let e = g.ctx.new_event(timed).context("CUDA event")?;
                e.record(&g.stream).context("CUDA event")?;
                Mark::Event(e)
            }
        });
        Ok(())
    }

    /// The median ms of a device-to-device copy of `P` slots (the size of
    /// the permuted tensor), the first `P` of `rows` into the first `P` of
    /// `results`, on the PE's stream: the bandwidth the
    /// phases' byte floors are measured against. `None` on Host.
    pub fn copy_ms(&mut self) -> Res<Option<f64>> {
        let Some(g) = &self.gpu else {
            return Ok(None);
        };
        let bytes = self.shape.pes * Self::slot_bytes(&self.shape);
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        g.ctx.bind_to_thread().context("CUDA context")?;
        let mut ms = Vec::new();
        for _ in 0..5 {
            let a = g.ctx.new_event(timed).context("CUDA event")?;
            let z = g.ctx.new_event(timed).context("CUDA event")?;
            a.record(&g.stream).context("CUDA event")?;
            // SAFETY: `rows` and `results` are distinct device allocations
            // of this PE's heap, each holding at least P slots; neither is
            // read or written by anyone else between steps.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(self.b.results, self.b.rows, bytes, g.stream.cu_stream())
            }
            .result()
            .context("cuMemcpyDtoDAsync")?;
            z.record(&g.stream).context("CUDA event")?;
            self.reached(&z)?;
            ms.push(a.elapsed_ms(&z).context("CUDA event")? as f64);
        }
        ms.sort_by(|x, y| x.total_cmp(y));
        Ok(Some(ms[ms.len() / 2]))
    }

    fn step_marked(&mut self, waits: Waits, marks: &mut Option<Vec<Mark>>) -> Res<()> {
        let s = self.shape;
        let (b, stream) = (self.b, self.stream());
        let target = match self.device.platform {
            Platform::Host => Target::host(),
            Platform::Cuda => Target::cuda(self.device.ordinal, stream),
        };
        let d = Dims {
            tokens: s.tokens as u64,
            hidden: s.hidden as u64,
            experts: s.experts as u64,
            rows: (s.pes * s.slot_rows()) as u64,
            dtype: s.dtype,
        };
        let options = if s.dropless {
            RowIdMapOptions {
                groups: Some(ExpertGroups {
                    experts: s.local_experts(),
                    rows: s.slot_rows(),
                }),
                ..RowIdMapOptions::default()
            }
        } else {
            RowIdMapOptions {
                capacity: Some(s.capacity),
                ..RowIdMapOptions::default()
            }
        };
        let (p, slot) = (s.pes as u64, Self::slot_bytes(&s) as u64);
        // SAFETY: (this and the layer calls below) every buffer is this PE's
        // heap allocation for exactly these dims, alive for the world's life.
        unsafe { b.layer.make_row_id_map(&target, d, options) }?;
        self.mark(marks)?;
        if s.fused {
            // Destination j's rows go straight to PE me + j's receive slot
            // for me's rows, P - 1 - j (the own slot, P - 1, for j = 0).
            let bases = self.peer_slots(b.rows, |j| p - 1 - j)?;
            // SAFETY: as above; each base is a slot of [S, H] in a PE's
            // `rows` (a peer's through its mapping), none of which another
            // PE writes or the owner reads until this step's dispatch
            // signal (see the module docs).
            unsafe {
                b.layer
                    .permute_segments(&target, d, &bases, s.slot_rows() as u64)
            }?;
        } else {
            // SAFETY: as above; the send half of `rows` holds P slots of
            // [S, H], none of which a peer writes.
            unsafe { b.layer.permute(&target, d, b.rows + (p - 1) * slot) }?;
        }
        self.mark(marks)?;
        // Send slot j >= 1 (slot P - 1 + j of `rows`) goes to PE me + j,
        // into the slot of me's rows there, P - 1 - j (fused: already
        // there, only the signal goes). Dropless, each slot's row counts
        // go with it.
        let (counts, copy) = (s.dropless, !s.fused);
        if self.remote.is_some() {
            self.exchange_all(false, stream)?;
            self.mark(marks)?;
        } else {
            self.exchange(
                b.rows,
                (|j| p - 1 + j, |j| p - 1 - j),
                b.dispatch,
                (counts, copy),
                stream,
            )
            .context("dispatch put_signal")?;
            self.mark(marks)?;
            self.await_all(b.dispatch, waits)?;
        }
        self.mark(marks)?;
        self.experts(stream)?;
        self.mark(marks)?;
        // The results of PE me + j's rows (slot j - 1, where they were in
        // `rows`) go back to it, into the slot of its send slot P - j (the
        // one it sent to me): slot 2P - 1 - j of its `results`. Fused,
        // only the signal goes: PE me + j reads them where they are.
        if self.remote.is_some() {
            self.exchange_all(true, stream)?;
            self.mark(marks)?;
        } else {
            self.exchange(
                b.results,
                (|j| j - 1, |j| 2 * p - 1 - j),
                b.combine,
                (false, copy),
                stream,
            )
            .context("combine put_signal")?;
            self.mark(marks)?;
            self.await_all(b.combine, waits)?;
        }
        self.mark(marks)?;
        if s.fused {
            // Destination j's results are in PE me + j's `results`, in the
            // slot of me's rows there, P - 1 - j.
            let bases = self.peer_slots(b.results, |j| p - 1 - j)?;
            // SAFETY: as above; each base is a slot of [S, H] that its
            // owner's experts wrote before its combine signal, and no PE
            // writes until this PE's next dispatch signal.
            unsafe {
                b.layer
                    .unpermute_segments(&target, d, &bases, s.slot_rows() as u64, b.y)
            }?;
        } else {
            // SAFETY: as above; the receive half of `results` holds P
            // slots of [S, H] in the order permute wrote, and `y` [T, H].
            unsafe {
                b.layer
                    .unpermute(&target, d, b.results + (p - 1) * slot, b.y)
            }?;
        }
        self.mark(marks)
    }

    /// For each destination `j` in `0..P` (PE `me + j`): the address, as
    /// this PE reaches it, of slot `slot(j)` of `buffer` on that PE.
    fn peer_slots(&self, buffer: u64, slot: impl Fn(u64) -> u64) -> Res<Vec<u64>> {
        let (me, p) = (self.rank, self.shape.pes);
        let bytes = Self::slot_bytes(&self.shape) as u64;
        (0..p as u64)
            .map(|j| {
                let q = (me + j as usize) % p;
                self.world
                    .ptr(q, buffer + slot(j) * bytes)
                    .ok_or_else(|| format!("PE {q} has no address for this PE's slot {}", slot(j)))
            })
            .collect()
    }

    /// For every peer `q = me + j` (`j` in `1..P`): with `copy`, the slot
    /// at `source(j)` of `buffer` goes to slot `dest(j)` of `buffer` on PE
    /// `q`; then SET `signals[me] = 1` there (ordered after the slot, and
    /// after everything enqueued before on CUDA). `with_counts`: the
    /// slot's `L` counts (of `tpe`) first, into `counts` there.
    fn exchange(
        &mut self,
        buffer: u64,
        (source, dest): (impl Fn(u64) -> u64, impl Fn(u64) -> u64),
        signals: u64,
        (with_counts, copy): (bool, bool),
        stream: *mut c_void,
    ) -> Res<()> {
        let (me, p) = (self.rank, self.shape.pes);
        let slot = Self::slot_bytes(&self.shape) as u64;
        let l = self.shape.local_experts() as u64;
        for j in 1..p as u64 {
            let q = (me + j as usize) % p;
            if with_counts {
                // The slot's L counts (tokens_per_expert of PE q's experts)
                // into the counts of the slot they land in there; ordered
                // before the put_signal below on the same stream.
                // SAFETY: `tpe` holds E = P*L counts and `counts` (P-1)*L
                // before it; both indices are in range.
                unsafe {
                    self.world.put_nbi(
                        self.b.counts + (p as u64 - 1 - j) * l * 8,
                        self.b.layer.tpe + j * l * 8,
                        (l * 8) as usize,
                        q,
                        stream,
                    )
                }
                .map_err(|e| e.to_string())?;
            }
            // Fused: a signal only (no bytes), after the permute's or the
            // experts' stores into and out of the peers' slots.
            let bytes = if copy { slot } else { 0 };
            // SAFETY: `buffer` is one of this PE's heap buffers of 2P - 1
            // slots when copying, and both slot indices are below 2P - 1;
            // fused, nothing is copied.
            unsafe {
                self.world.put_signal_nbi(
                    buffer + if copy { dest(j) * slot } else { 0 },
                    buffer + if copy { source(j) * slot } else { 0 },
                    bytes as usize,
                    signals + 8 * me as u64,
                    1,
                    SignalOp::Set,
                    q,
                    stream,
                )
            }
            .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The copy exchange's dispatch or combine as one `World::exchange`
    /// on `stream` (a world with NCCL pairs; its waits are the
    /// exchange's own, so its "wait" phase is empty).
    fn exchange_all(&mut self, combine: bool, stream: *mut c_void) -> Res<()> {
        let (out, inc) = copy_segments(&self.shape, &self.b, self.rank, combine);
        let what = if combine { "combine" } else { "dispatch" };
        // SAFETY: every segment is a slot (or a slot's counts) of this
        // PE's heap buffers, alive for the world's life, and no PE writes
        // a slot that its owner still reads (see the module docs).
        unsafe { self.world.exchange_on_stream(&out, &inc, stream) }
            .map_err(|e| format!("{what} exchange: {e}"))
    }

    /// Waits until every peer set its word of the signal array at `base`,
    /// then clears the words (ordered after the wait).
    fn await_all(&mut self, base: u64, waits: Waits) -> Res<()> {
        let (me, stream) = (self.rank, self.stream());
        for p in (0..self.shape.pes).filter(|&p| p != me) {
            let word = base + 8 * p as u64;
            if self.device.platform == Platform::Cuda && waits == Waits::Stream {
                self.world
                    .wait_until_on_stream(word, Cmp::Eq, 1, stream)
                    .context("shmem wait")?;
            } else {
                self.world
                    .wait_until(word, Cmp::Eq, 1)
                    .context("shmem wait")?;
            }
            // A zero-byte put to itself whose signal SETs the word to 0.
            // SAFETY: copies nothing.
            unsafe {
                self.world
                    .put_signal_nbi(word, word, 0, word, 0, SignalOp::Set, me, stream)
            }
            .context("shmem signal reset")?;
        }
        Ok(())
    }

    /// `out = silu(recv) * scale_e` for every (sender, local expert)
    /// block of `C` rows, or dropless every ragged group of rows the
    /// counts give, in one call.
    fn experts(&mut self, stream: *mut c_void) -> Res<()> {
        let s = self.shape;
        let block = (s.capacity * s.row_bytes()) as u64;
        let (scales, ragged) = if s.dropless {
            let ragged = RaggedGroups {
                scales: self.b.scales,
                rows: self.b.counts,
                segments: s.pes as u64,
                groups: s.local_experts() as u64,
                segment_bytes: Self::slot_bytes(&s) as u64,
                row_bytes: s.row_bytes() as u64,
            };
            (None, Some(ragged))
        } else {
            let scales = GroupScales {
                addr: self.b.scales,
                group_bytes: block,
            };
            (Some(scales), None)
        };
        // A Host PE's device names its slot in the world (host:rank); the
        // op itself runs on the one Host device.
        let device = match self.device.platform {
            Platform::Host => Device::HOST,
            Platform::Cuda => self.device,
        };
        let call = OpCall {
            device,
            stream,
            op: ElementwiseOp::SiluScale,
            dtype: s.dtype,
            config: self.ops,
            variant: Variant::WarpSpecialized,
            host: self.host,
            inputs: &[self.b.rows],
            output: self.b.results,
            bytes: (s.pes * Self::slot_bytes(&s)) as u64,
            scale: 0.0,
            scales,
            ragged,
        };
        // SAFETY: `rows`, `results`, `scales` and `counts` are distinct
        // buffers of this PE's heap (the first P slots of `rows` and of
        // `results` are exactly these bytes, `scales` one f32 per block,
        // `counts` P*L counts from its first), alive as long
        // as the world; no peer writes those slots of `rows` until this
        // PE's combine of the step, nor those of `results` ever (see the
        // module docs).
        unsafe { xcall_warpspec::run(&call) }.context("experts")
    }

    /// This PE with its Host experts run by `host` (vectorized unless
    /// set; ignored on CUDA).
    pub fn with_host_executor(mut self, host: HostExecutor) -> Pe {
        self.host = host;
        self
    }

    /// Frees the buffers and leaves the world; an error on a leak.
    pub fn finish(mut self) -> Res<()> {
        self.drain()?;
        for &(a, _, _) in &self.sizes {
            self.world.free(a).context("shmem free")?;
        }
        let report = self.world.finalize().context("shmem finalize")?;
        if !report.leaked.is_empty() {
            return Err(format!("shmem finalize found leaks: {:?}", report.leaked));
        }
        Ok(())
    }
}

/// The process's resident set in bytes (Linux's `/proc/self/statm`).
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok()?.checked_mul(pages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xcall_core::DType;

    fn shape(pes: usize, dropless: bool) -> Shape {
        Shape {
            pes,
            tokens: 64,
            hidden: 16,
            experts: 4 * pes,
            topk: 2,
            dtype: DType::F32,
            capacity: 40,
            dropless,
            fused: false,
        }
    }

    fn buffers() -> Buffers {
        Buffers {
            layer: Layer {
                x: 1 << 40,
                routing: 2 << 40,
                probs: 3 << 40,
                map: 4 << 40,
                tpe: (5 << 40) + 4096,
                offsets: 6 << 40,
            },
            counts: 5 << 40,
            rows: 7 << 40,
            results: 8 << 40,
            y: 9 << 40,
            dispatch: 10 << 40,
            combine: 11 << 40,
            scales: 12 << 40,
        }
    }

    /// Every PE's exchange pairs up with every other's (NCCL's rule: the
    /// same bytes to the same place, in order), fills each receive slot
    /// exactly once, and sends from the send half only.
    #[test]
    fn copy_segments_pair_up_and_cover_every_receive_slot() {
        let b = buffers();
        for pes in [1, 2, 3, 5] {
            for dropless in [false, true] {
                let s = shape(pes, dropless);
                let slot = Pe::slot_bytes(&s) as u64;
                for combine in [false, true] {
                    let all: Vec<_> = (0..pes)
                        .map(|me| copy_segments(&s, &b, me, combine))
                        .collect();
                    let per_peer = if dropless && !combine { 2 } else { 1 };
                    for (a, (out, inc)) in all.iter().enumerate() {
                        assert_eq!(out.len(), (pes - 1) * per_peer);
                        assert_eq!(inc.len(), (pes - 1) * per_peer);
                        for q in (0..pes).filter(|&q| q != a) {
                            let sent: Vec<(u64, usize)> = out
                                .iter()
                                .filter(|o| o.pe == q)
                                .map(|o| (o.dest, o.bytes))
                                .collect();
                            let got: Vec<(u64, usize)> = all[q]
                                .1
                                .iter()
                                .filter(|i| i.pe == a)
                                .map(|i| (i.dest, i.bytes))
                                .collect();
                            assert_eq!(
                                sent, got,
                                "P={pes} dropless={dropless} combine={combine}: {a} -> {q}"
                            );
                        }
                        assert!(out.iter().all(|o| o.pe != a) && inc.iter().all(|i| i.pe != a));
                        let (base, recv_half, send_half) = match combine {
                            // Results: send the first P - 1 slots, receive into the last P - 1.
                            true => (b.results, pes as u64..2 * pes as u64 - 1, 0..pes as u64 - 1),
                            // Rows: receive into the first P - 1, send the last P - 1.
                            false => (b.rows, 0..pes as u64 - 1, pes as u64..2 * pes as u64 - 1),
                        };
                        let mut slots: Vec<u64> = inc
                            .iter()
                            .filter(|i| i.bytes == slot as usize && i.dest >= base)
                            .map(|i| (i.dest - base) / slot)
                            .collect();
                        slots.sort();
                        assert_eq!(slots, recv_half.collect::<Vec<_>>());
                        for o in out.iter().filter(|o| o.bytes == slot as usize) {
                            assert!(send_half.contains(&((o.src - base) / slot)));
                            assert_eq!((o.src - base) % slot, 0);
                        }
                    }
                }
            }
        }
    }
}
