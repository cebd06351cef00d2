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

mod step;
mod timed;
mod token;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use xcall_core::cuda::OwnedStream;
use xcall_core::{Device, Platform};
use xcall_graph::BufferRole;
use xcall_shmem::{BootstrapKind, Transport, World, WorldConfig};
use xcall_warpspec::ops::OpConfig;
use xcall_warpspec::HostExecutor;

use super::data::{Inputs, Shape};
use crate::alloc::{self, AllocError, RunError};
use crate::layer::{Context, Layer, Res};

pub use step::{phases, Waits};
pub use timed::Queued;

/// Symmetric buffers (the same offsets on every PE).
#[derive(Clone, Copy, Debug, Default)]
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

impl Buffers {
    /// No buffers: a token-once PE has its own ([`token::TokenPe`]).
    fn unused() -> Buffers {
        Buffers::default()
    }
}

struct Gpu {
    /// The PE's stream, destroyed after the world (a field below it):
    /// the world's end aborts any transfer the stream still waits for.
    stream: OwnedStream,
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
    /// The routing and the probs (as bytes) of a step in this PE's expert
    /// numbering, staged for the upload: empty until
    /// [`Pe::reserve_upload`].
    staged: (Vec<u8>, Vec<u8>),
    /// The group and buffers of the token-once exchange (`shape.ep`);
    /// `b` is then unused.
    ep: Option<token::TokenPe>,
}

impl Pe {
    /// The layer's buffers of `shape`: bytes and role of each, in the order
    /// of [`Buffers`]' fields; `None` when a size passes `usize`.
    fn buffer_sizes(shape: &Shape) -> Option<[(usize, BufferRole); 12]> {
        let (t, h, e) = (shape.tokens, shape.hidden, shape.experts);
        let s = shape.dtype.size_bytes();
        let p = shape.pes;
        let mul = |a: usize, b: usize| a.checked_mul(b);
        let slots = mul(
            Self::slots(shape),
            mul(shape.slot_rows(), shape.row_bytes())?,
        )?;
        let tokens = mul(mul(t, h)?, s)?;
        let map = mul(mul(t, mul(e, 2)?.checked_add(1)?)?, 4)?;
        let counts = ((p - 1) * shape.local_experts()).checked_add(e)?;
        Some([
            (tokens, BufferRole::In),
            (mul(t, e)?, BufferRole::In),
            (mul(mul(t, e)?, 4)?, BufferRole::In),
            (map, BufferRole::InOut),
            (mul(counts, 8)?, BufferRole::InOut),
            (mul(e.checked_add(1)?, 8)?, BufferRole::InOut),
            (slots, BufferRole::InOut),
            (slots, BufferRole::InOut),
            (tokens, BufferRole::Out),
            (p * 8, BufferRole::InOut),
            (p * 8, BufferRole::InOut),
            (mul(e, 4)?, BufferRole::In),
        ])
    }

    /// The symmetric heap a PE of `shape` needs: its buffers (256-byte
    /// aligned), the world's signal words, and 1 MiB to spare; `None` when
    /// that passes `usize`.
    pub fn heap_bytes(shape: &Shape) -> Option<usize> {
        if shape.ep.is_some() {
            return token::heap_bytes(shape);
        }
        Self::buffer_sizes(shape)?
            .iter()
            .try_fold((shape.pes + 4) * 16 + (1 << 20), |sum: usize, (b, _)| {
                sum.checked_add(b.checked_next_multiple_of(256)?)
            })
    }

    /// Joins the world met through `bootstrap` as `rank` on `device`,
    /// waiting at most `timeout` for any other PE, and allocates the
    /// layer's buffers in a heap of `heap` bytes (`None`: the world's
    /// default, `XCALL_SHMEM_HEAP_BYTES`); [`Pe::set_up_buffers`] sets
    /// them up.
    pub fn new(
        shape: Shape,
        heap: Option<usize>,
        rank: usize,
        device: Device,
        bootstrap: &BootstrapKind,
        timeout: Duration,
    ) -> Result<Pe, RunError> {
        let p = shape.pes;
        let mut config = WorldConfig::in_process("", rank, p, device);
        config.bootstrap = bootstrap.clone();
        config.heap_bytes = heap;
        config.timeout = timeout;
        let mut world = World::new();
        world.init(&config).context("shmem init")?;
        let gpu = match device.platform {
            Platform::Host => None,
            Platform::Cuda => {
                let stream = OwnedStream::new(device).context("CUDA stream")?;
                Some(Gpu { stream })
            }
        };
        if shape.ep.is_some() {
            let (tok, sizes) = token::new(&mut world, &shape, device)?;
            return Ok(Pe {
                world,
                shape,
                rank,
                device,
                b: Buffers::unused(),
                sizes,
                gpu,
                ops: OpConfig::default(),
                host: HostExecutor::default(),
                remote: None,
                timeout,
                staged: (Vec::new(), Vec::new()),
                ep: Some(tok),
            });
        }
        let sizes = Self::buffer_sizes(&shape).ok_or("the layer's buffers pass usize")?;
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
            staged: (Vec::new(), Vec::new()),
            ep: None,
        };
        for q in 0..p {
            let t = pe.world.transport(q).context("shmem transport")?;
            if q != rank && (t.is_nccl() || t == Transport::Tcp) {
                if shape.fused {
                    return Err(format!(
                        "--exchange fused needs every PE addressable, and PE {q} is reached through {}: use --exchange copy",
                        t.name()
                    )
                    .into());
                }
                pe.remote = Some(t);
            }
        }
        Ok(pe)
    }

    /// Sets the buffers up for the first step: the signal words and the
    /// slots zeroed, every expert's scale written; then waits for every
    /// PE to have done the same.
    pub fn set_up_buffers(&mut self) -> Result<(), RunError> {
        let (shape, b, p, rank) = (self.shape, self.b, self.shape.pes, self.rank);
        if let Some(tok) = &self.ep {
            // Each local expert's scale, by its global number.
            let l = shape.local_experts();
            let at = tok.scales.addr;
            let scales: Vec<u8> = (0..l)
                .flat_map(|e| shape.scale(rank * l + e).to_le_bytes())
                .collect();
            self.write(at, &scales)?;
            self.world.barrier_all().context("shmem barrier")?;
            return Ok(());
        }
        let pe = self;
        pe.fill(b.dispatch, (p * 8) as u64, 0)?;
        pe.fill(b.combine, (p * 8) as u64, 0)?;
        // The slots start zeroed: with a capacity the experts read whole
        // slots, whose rows no route writes a fused permute leaves as
        // they are.
        let slots = pe.sizes[6].1 as u64;
        pe.fill(b.rows, slots, 0)?;
        pe.fill(b.results, slots, 0)?;
        // The scale of every (sender, local expert) block the experts read.
        let mut scales =
            alloc::with_capacity(|| format!("PE {rank}'s expert scales"), 4 * shape.experts)?;
        scales.extend((0..shape.experts).flat_map(|block| {
            let expert = rank * shape.local_experts() + block % shape.local_experts();
            shape.scale(expert).to_le_bytes()
        }));
        pe.write(b.scales, &scales)?;
        pe.world.barrier_all().context("shmem barrier")?;
        Ok(())
    }

    fn stream(&self) -> *mut c_void {
        self.gpu
            .as_ref()
            .map_or(std::ptr::null_mut(), |g| g.stream.raw().cast())
    }

    /// Copies host bytes into this PE's buffer at `dest` (blocking).
    fn write(&mut self, dest: u64, bytes: &[u8]) -> Res<()> {
        let me = self.rank;
        // SAFETY: `bytes` is a live host slice; the world checks `dest`.
        unsafe { self.world.put(dest, bytes.as_ptr() as u64, bytes.len(), me) }
            .context("shmem put (upload)")
    }

    /// Sets `bytes` of this PE's buffer at `dest` to `value` (blocking, in
    /// chunks of at most 8 MiB).
    fn fill(&mut self, dest: u64, bytes: u64, value: u8) -> Result<(), RunError> {
        const CHUNK: u64 = 8 << 20;
        let chunk = bytes.min(CHUNK) as usize;
        let rank = self.rank;
        let values = alloc::filled(|| format!("PE {rank}'s buffer initialiser"), chunk, value)?;
        let mut at = 0;
        while at < bytes {
            let n = (bytes - at).min(CHUNK) as usize;
            self.write(dest + at, &values[..n])?;
            at += n as u64;
        }
        Ok(())
    }

    /// Allocates the host buffers [`Pe::upload`] stages a step's routing
    /// and probs in.
    pub fn reserve_upload(&mut self) -> Result<(), AllocError> {
        let rank = self.rank;
        let routing = self.sizes[1].1;
        let probs = self.sizes[2].1;
        self.staged = (
            alloc::zeroed(|| format!("PE {rank}'s routing for the upload"), routing)?,
            alloc::zeroed(|| format!("PE {rank}'s probs for the upload"), probs)?,
        );
        Ok(())
    }

    /// Uploads a step's inputs, routing and probs in this PE's expert
    /// numbering (see the module docs), and poisons `y` (NaN in both
    /// dtypes).
    pub fn upload(&mut self, inputs: &Inputs) -> Result<(), RunError> {
        if let Some(tok) = &self.ep {
            let (x, ids, probs, y) = (tok.x.addr, tok.ids.addr, tok.probs.addr, tok.y);
            let mut staged = std::mem::take(&mut self.staged);
            if staged.0.len() != tok.ids.bytes || staged.1.len() != tok.probs.bytes {
                return Err("the upload's host buffers were not reserved for these inputs".into());
            }
            token::top_k(&self.shape, inputs, &mut staged.0, &mut staged.1);
            let written = self
                .write(x, &inputs.x)
                .and_then(|()| self.write(ids, &staged.0))
                .and_then(|()| self.write(probs, &staged.1));
            self.staged = staged;
            written?;
            return self.fill(y.addr, y.bytes as u64, 0xff);
        }
        let e = self.shape.experts;
        let shift = self.rank * self.shape.local_experts();
        let mut staged = std::mem::take(&mut self.staged);
        let (routing, probs) = (&mut staged.0, &mut staged.1);
        if routing.len() != inputs.routing.len() || probs.len() != 4 * inputs.probs.len() {
            return Err("the upload's host buffers were not reserved for these inputs".into());
        }
        for (token, (routes, weights)) in routing
            .chunks_exact_mut(e)
            .zip(probs.chunks_exact_mut(4 * e))
            .enumerate()
        {
            let row = token * e;
            for col in 0..e {
                let from = row + (col + shift) % e;
                routes[col] = inputs.routing[from];
                weights[4 * col..4 * col + 4].copy_from_slice(&inputs.probs[from].to_le_bytes());
            }
        }
        let l = self.b.layer;
        let written = self
            .write(l.x, &inputs.x)
            .and_then(|()| self.write(l.routing, routing))
            .and_then(|()| self.write(l.probs, probs));
        self.staged = staged;
        written?;
        let y = self.sizes[8].1 as u64;
        self.fill(self.b.y, y, 0xff)
    }

    /// Reads the PE's output `y` of the last step (after its stream
    /// drained) into `y` (`[T, H]`).
    pub fn download(&mut self, y: &mut [u8]) -> Res<()> {
        self.drain()?;
        let (at, bytes) = match &self.ep {
            Some(tok) => (tok.y.addr, tok.y.bytes),
            None => (self.b.y, self.sizes[8].1),
        };
        if y.len() != bytes {
            return Err(format!(
                "a buffer of {} bytes for the output of {bytes} bytes",
                y.len(),
            ));
        }
        let me = self.rank;
        // SAFETY: `y` holds exactly the bytes read.
        unsafe { self.world.get(y.as_mut_ptr() as u64, at, y.len(), me) }
            .context("shmem get (download)")
    }

    /// SMs the token-once exchange kernels may occupy (`None` for the
    /// per-route exchanges and on Host).
    pub fn sms_used(&self) -> Option<usize> {
        match (&self.ep, &self.gpu) {
            (Some(t), Some(_)) => t.micro.first().map(|m| m.group.sms_used()),
            _ => None,
        }
    }

    /// The kernels of the token-once exchange: `low-latency`, `steps` or
    /// `pull` (`None` for the per-route exchanges and on Host).
    pub fn kernels(&self) -> Option<&'static str> {
        self.gpu.as_ref()?;
        Some(self.ep.as_ref()?.micro.first()?.group.kernels_run().name())
    }

    /// The transport of the peers without pointers, if any.
    pub fn remote(&self) -> Option<Transport> {
        self.remote
    }

    /// This PE's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Waits until the PE's stream ran everything enqueued, at most the
    /// run's timeout (nothing on Host, whose steps run synchronously). The
    /// stream may wait on other PEs (signals, NCCL transfers): a peer that
    /// stopped must end in an error here, where a plain synchronize would
    /// never return.
    pub fn drain(&self) -> Res<()> {
        let Some(g) = &self.gpu else {
            return Ok(());
        };
        let start = Instant::now();
        let mut polls = 0u32;
        let checked = |pe: &Pe| match &pe.ep {
            Some(tok) => tok
                .micro
                .iter()
                .try_for_each(|m| m.group.check().context("expert-parallel step")),
            None => Ok(()),
        };
        while !g.stream.is_idle().context("CUDA stream")? {
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
        checked(self)
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

    /// Bytes of the copy the phases' floors are measured against (see
    /// `Pe::copy_ms`): token-once, micro-batch 0's received rows (the
    /// bf16 rows with `--dtype fp8`) into its experts' outputs, as many
    /// bytes as the smaller buffer holds.
    pub fn copy_bytes(shape: &Shape) -> usize {
        let rows = if shape.ep.is_some_and(|e| e.fp8) {
            2
        } else {
            0
        };
        match shape.ep {
            Some(_) => {
                token::buffer_sizes(shape).map_or(0, |(_, _, each)| each[rows].0.min(each[5].0))
            }
            None => shape.pes * Self::slot_bytes(shape),
        }
    }

    /// Bytes of one slot: [`Shape::slot_rows`] rows, what one PE sends
    /// another in dispatch and in combine.
    pub fn slot_bytes(shape: &Shape) -> usize {
        shape.slot_rows() * shape.row_bytes()
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
        if let Some(tok) = self.ep.take() {
            // The fork's streams end first (idle: the PE's stream joined
            // them). Every group is destroyed (a collective) before an
            // error returns.
            drop(tok.fork);
            let mut first = Ok(());
            for m in tok.micro {
                let r = m.group.destroy(&mut self.world);
                if first.is_ok() {
                    first = r;
                }
            }
            first.context("expert-parallel group")?;
        }
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
