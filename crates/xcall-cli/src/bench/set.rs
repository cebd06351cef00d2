//! One PE's benchmark set: its buffers, inputs and timed calls, and the
//! tables they produce (local ops, peer transfers, the graph cache).

use indicatif::ProgressBar;
use std::cell::RefCell;
use std::ffi::c_void;

use xcall_core::cuda::{ContextGuard, CudaContext, OwnedStream, Stream};
use xcall_core::testing::XorShift;
use xcall_core::{DType, Device, Platform};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{Buffer, BufferRole, Call, CallKey, GraphCache};
use xcall_permute::call::Target;
use xcall_permute::RowIdMapOptions;
use xcall_shmem::{World, WorldConfig};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::Variant;
use xcall_warpspec::ops::OpConfig;
use xcall_warpspec::{HostExecutor, OpCall};

use super::{medians, stream_medians, FirstError, Problem, Row, Sweep, SweepPoint};
use crate::layer::{Context, Dims, Layer, Res};

/// Symmetric buffers of the set.
pub(super) struct Buffers {
    layer: Layer,
    perm: u64,
    dst: u64,
    back: u64,
}

/// The set's buffers (collective: every PE allocates the same), and a
/// target buffer for peer puts when there is a peer.
pub(super) fn allocate(world: &mut World, p: Problem) -> Res<(Buffers, Option<u64>)> {
    let (t, h, e, n) = (p.tokens, p.hidden, p.experts, p.rows());
    let row = h * 2;
    let peers = world.size().context("shmem size")? > 1;
    let mut alloc = |bytes: u64| world.malloc(bytes as usize).context("shmem malloc");
    let b = Buffers {
        layer: Layer {
            x: alloc(t * row)?,
            routing: alloc(t * e)?,
            probs: alloc(t * e * 4)?,
            map: alloc(t * (2 * e + 1) * 4)?,
            tpe: alloc(e * 8)?,
            offsets: alloc((e + 1) * 8)?,
        },
        perm: alloc(n * row)?,
        dst: alloc(n * row)?,
        back: alloc(t * row)?,
    };
    let peer = if peers { Some(alloc(n * row)?) } else { None };
    Ok((b, peer))
}

/// Random tokens (bf16 bit patterns of values in [-4, 4)), a top-k
/// routing and softmax-like probs, written into the layer's buffers.
fn fill_inputs(world: &mut World, p: Problem, l: &Layer) -> Res<()> {
    let (t, h, e) = (p.tokens, p.hidden, p.experts);
    let mut g = XorShift::new(7);
    let x: Vec<u8> = (0..t * h)
        .flat_map(|_| half::bf16::from_f32(4.0 * g.next_f32()).to_le_bytes())
        .collect();
    let routing = g.top_k_routing(t as usize, e as usize, p.topk as usize);
    let probs: Vec<u8> = routing
        .iter()
        .flat_map(|&r| (r as f32 * 0.5).to_le_bytes())
        .collect();
    for (dest, bytes) in [(l.x, &x), (l.routing, &routing), (l.probs, &probs)] {
        // SAFETY: host vectors of exactly `bytes.len()` bytes.
        (unsafe { world.put(dest, bytes.as_ptr() as u64, bytes.len(), 0) }).context("shmem put")?;
    }
    Ok(())
}

/// One PE's set: its world and buffers, where calls run, and each timed
/// call as a method.
struct Set {
    platform: Platform,
    world: RefCell<World>,
    b: Buffers,
    p: Problem,
    /// The set's stream on CUDA, with device 0's primary context current
    /// on this thread while the set lives (the plain copies it times are
    /// issued as they are).
    gpu: Option<(OwnedStream, ContextGuard)>,
    target: Target,
}

impl Set {
    fn stream(&self) -> *mut c_void {
        self.gpu
            .as_ref()
            .map_or(std::ptr::null_mut(), |(s, _)| s.raw().cast())
    }

    /// The set's CUDA stream.
    fn cuda_stream(&self) -> Option<Stream> {
        self.gpu.as_ref().map(|(s, _)| s.stream())
    }

    fn dims(&self) -> Dims {
        Dims {
            tokens: self.p.tokens,
            hidden: self.p.hidden,
            experts: self.p.experts,
            rows: self.p.rows(),
            dtype: DType::Bf16,
        }
    }

    /// Bytes of the permuted tensor.
    fn tensor_bytes(&self) -> u64 {
        self.p.rows() * self.p.hidden * 2
    }

    fn make_map(&self) -> Res<()> {
        // SAFETY: (this and the next two layer calls) heap buffers of
        // exactly these dims, alive until the world is finalized after the
        // last synchronisation.
        unsafe {
            self.b
                .layer
                .make_row_id_map(&self.target, self.dims(), RowIdMapOptions::default())
        }
    }

    fn permute(&self) -> Res<()> {
        // SAFETY: as in make_map.
        unsafe { self.b.layer.permute(&self.target, self.dims(), self.b.perm) }
    }

    fn unpermute(&self) -> Res<()> {
        // SAFETY: as in make_map.
        unsafe {
            self.b
                .layer
                .unpermute(&self.target, self.dims(), self.b.perm, self.b.back)
        }
    }

    fn silu(&self, variant: Variant) -> Res<()> {
        let call = OpCall {
            sms: 0,
            device: Device::new(self.platform, 0),
            stream: self.stream(),
            op: ElementwiseOp::SiluScale,
            dtype: DType::Bf16,
            config: OpConfig::default(),
            variant,
            // The row measures the pipeline, on Host its thread model.
            host: HostExecutor::Pipeline,
            inputs: &[self.b.perm],
            output: self.b.dst,
            bytes: self.tensor_bytes(),
            scale: 1.5,
            scales: None,
            ragged: None,
        };
        // SAFETY: `perm` and `dst` are distinct heap buffers of the
        // tensor's bytes on the platform's device; nothing else touches
        // them meanwhile (on CUDA: ordered on the stream).
        (unsafe { xcall_warpspec::run(&call) }).context("silu_scale")
    }

    /// The reference: a copy of the permuted tensor on the same device.
    fn copy(&self) -> Res<()> {
        // SAFETY: `dst` is a heap buffer of the tensor's bytes, apart from
        // `perm`.
        unsafe { self.copy_to(self.b.dst, self.tensor_bytes() as usize) }
    }

    /// A plain copy of the permuted tensor's first `bytes` bytes to `dst`
    /// on this PE's device (Host: memcpy; CUDA: cuMemcpyDtoDAsync on the
    /// set's stream).
    ///
    /// # Safety
    /// `dst` holds `bytes` bytes that this PE may write, apart from `perm`,
    /// and `bytes` is at most the tensor's.
    unsafe fn copy_to(&self, dst: u64, bytes: usize) -> Res<()> {
        let src = self.b.perm;
        match self.platform {
            // SAFETY: the caller's contract; `perm` holds the tensor.
            Platform::Host => unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
                Ok(())
            },
            Platform::Cuda => {
                let stream = self.cuda_stream().ok_or("a CUDA set without its stream")?;
                // SAFETY: as above, device memory ordered on the stream
                // (device 0's context is current: see `gpu`).
                unsafe { stream.copy_dtod(dst, src, bytes) }.context("cuMemcpyDtoDAsync")
            }
        }
    }

    /// A put of the permuted tensor to `dest` on PE `pe`.
    fn put(&self, dest: u64, pe: usize) -> Res<()> {
        self.put_bytes(dest, pe, self.tensor_bytes() as usize)
    }

    /// A put of the permuted tensor's first `bytes` bytes to `dest` on PE
    /// `pe` (at most the tensor's bytes: the heap objects are that large).
    fn put_bytes(&self, dest: u64, pe: usize, bytes: usize) -> Res<()> {
        debug_assert!(bytes as u64 <= self.tensor_bytes());
        // SAFETY: `perm` holds the tensor's bytes, `bytes` at most that.
        (unsafe {
            self.world
                .borrow_mut()
                .put_nbi(dest, self.b.perm, bytes, pe, self.stream())
        })
        .context("shmem put")
    }

    /// Everything once, checked, before timing (compiles and autotunes).
    fn warm_up(&self) -> Res<()> {
        self.make_map()?;
        self.permute()?;
        self.unpermute()?;
        self.silu(Variant::WarpSpecialized)?;
        if self.platform == Platform::Cuda {
            self.silu(Variant::Plain)?;
        }
        self.put(self.b.dst, 0)
    }
}

/// The stages of [`measure`], as the progress bar names them.
pub(super) const STAGES: [&str; 5] = [
    "warm-up (compiling kernels, autotuning)",
    "figures on one device",
    "figures between devices",
    "shmem put by message size",
    "graph cache figures",
];

pub(super) fn measure(
    platform: Platform,
    config: &WorldConfig,
    p: Problem,
    rounds: usize,
    bar: &ProgressBar,
) -> Res<(Vec<Row>, Sweep)> {
    bar.set_message(STAGES[0]);
    let mut world = World::new();
    world.init(config).context("shmem init")?;
    let (b, peer_dst) = allocate(&mut world, p)?;
    fill_inputs(&mut world, p, &b.layer)?;
    let gpu = match platform {
        Platform::Host => None,
        Platform::Cuda => {
            let s = OwnedStream::new(Device::cuda(0)).context("CUDA stream")?;
            let current = ContextGuard::primary(Device::cuda(0)).context("CUDA context")?;
            Some((s, current))
        }
    };
    let target = match &gpu {
        None => Target::host(),
        Some((s, _)) => Target {
            autotune: true,
            ..Target::cuda(0, s.raw().cast())
        },
    };
    let set = Set {
        platform,
        world: RefCell::new(world),
        b,
        p,
        gpu,
        target,
    };
    set.warm_up()?;
    bar.inc(1);
    bar.set_message(STAGES[1]);
    let mut rows = local_rows(&set, peer_dst, rounds)?;
    bar.inc(1);
    bar.set_message(STAGES[2]);
    if let (Some(remote), Platform::Cuda) = (peer_dst, platform) {
        let base = rows.len();
        rows.extend(peer_rows(&set, remote, rounds, base)?);
    }
    bar.inc(1);
    bar.set_message(STAGES[3]);
    let sizes = size_sweep(&set, peer_dst, rounds)?;
    bar.inc(1);
    bar.set_message(STAGES[4]);
    if let Some(s) = set.cuda_stream() {
        rows.extend(graph_rows(&s, &set.target, &set.b, p, rounds)?);
    }
    bar.inc(1);
    let mut world = set.world.into_inner();
    world.barrier_all().context("shmem barrier")?;
    world.finalize().context("shmem finalize")?;
    Ok((rows, sizes))
}

/// The put sizes of the sweep: 4 KiB, then 4x each step, up to the
/// permuted tensor's bytes (the heap objects' size).
fn sweep_sizes(max: u64) -> Vec<u64> {
    std::iter::successors(Some(4096u64), |&b| Some(b * 4))
        .take_while(|&b| b <= max)
        .collect()
}

/// `xcall_shmem` puts of growing size next to the plain copy between the
/// same two addresses, interleaved size by size: to PE 1 when there is
/// one (CUDA: cuMemcpyPeerAsync; Host: a memcpy into PE 1's heap), to
/// this PE's own heap otherwise (cuMemcpyDtoDAsync).
fn size_sweep(set: &Set, peer_dst: Option<u64>, rounds: usize) -> Res<Sweep> {
    let (pe, dest) = match peer_dst {
        Some(remote) => (1, remote),
        None => (0, set.b.dst),
    };
    let to = set
        .world
        .borrow()
        .ptr(pe, dest)
        .ok_or("no address of the put's target")?;
    let src = set.b.perm;
    let stream = set.cuda_stream();
    let contexts = match (set.platform, pe) {
        (Platform::Cuda, 1) => Some((
            CudaContext::new(0).context("CUDA context")?,
            CudaContext::new(1).context("CUDA context")?,
        )),
        _ => None,
    };
    let (put, reference) = match (set.platform, pe) {
        (Platform::Cuda, 1) => ("put GPU 0 -> GPU 1", "cuMemcpyPeerAsync GPU 0 -> GPU 1"),
        (Platform::Cuda, _) => ("put to its own heap", "cuMemcpyDtoDAsync on GPU 0"),
        (Platform::Host, 1) => ("put to PE 1's heap", "memcpy into PE 1's heap"),
        (Platform::Host, _) => ("put to its own heap", "memcpy into its own heap"),
    };
    let mut points = Vec::new();
    for bytes in sweep_sizes(set.tensor_bytes()) {
        let n = bytes as usize;
        let failure = FirstError::default();
        let keep = |r| failure.keep(r);
        let copy = || -> Res<()> {
            match &contexts {
                Some((c0, c1)) => {
                    let stream = stream.as_ref().ok_or("a CUDA set without its stream")?;
                    // SAFETY: live allocations of both contexts, `n` bytes
                    // long, ordered on the set's stream.
                    unsafe { stream.copy_peer(to, c1, src, c0, n) }.context("cuMemcpyPeerAsync")
                }
                // SAFETY: `to` is a heap object of at least `n` bytes apart
                // from `perm`, this PE's or (Host) PE 1's mapped here.
                None => unsafe { set.copy_to(to, n) },
            }
        };
        let mut pair: Vec<Box<dyn FnMut() + '_>> = vec![
            Box::new(|| keep(copy())),
            Box::new(|| keep(set.put_bytes(dest, pe, n))),
        ];
        let ms = medians(stream.as_ref(), rounds, &mut pair);
        drop(pair);
        let ms = ms?;
        failure.check()?;
        points.push(SweepPoint {
            bytes,
            reference_ms: ms[0],
            put_ms: ms[1],
        });
    }
    Ok(Sweep {
        put,
        reference,
        points,
    })
}

/// Every op on this PE's device next to a copy of the permuted tensor (and
/// on Host, a put into PE 1's heap).
fn local_rows(set: &Set, peer_dst: Option<u64>, rounds: usize) -> Res<Vec<Row>> {
    let (t, e) = (set.p.tokens, set.p.experts);
    let tensor = set.tensor_bytes() as f64;
    let token_bytes = (t * set.p.hidden * 2) as f64;
    let failure = FirstError::default();
    let keep = |r| failure.keep(r);
    let mut rows = vec![
        Row::new(
            "reference",
            "copy of the permuted tensor (same device)",
            2.0 * tensor,
            None,
        ),
        Row::new(
            "permute",
            "make_row_id_map",
            (t * e + t * (2 * e + 1) * 4) as f64,
            Some(0),
        ),
        Row::new("permute", "permute", 2.0 * tensor, Some(0)),
        Row::new(
            "permute",
            "unpermute with merging probs",
            tensor + token_bytes,
            Some(0),
        ),
        Row::new(
            "warpspec",
            "silu(x)*scale, warp-specialized",
            2.0 * tensor,
            Some(0),
        ),
        Row::new("shmem", "put to its own heap", 2.0 * tensor, Some(0)),
    ];
    let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| keep(set.copy())),
        Box::new(|| keep(set.make_map())),
        Box::new(|| keep(set.permute())),
        Box::new(|| keep(set.unpermute())),
        Box::new(|| keep(set.silu(Variant::WarpSpecialized))),
        Box::new(|| keep(set.put(set.b.dst, 0))),
    ];
    if let (Some(remote), Platform::Host) = (peer_dst, set.platform) {
        rows.push(Row::new(
            "shmem",
            "put to PE 1's heap",
            2.0 * tensor,
            Some(0),
        ));
        variants.push(Box::new(move || keep(set.put(remote, 1))));
    }
    if set.platform == Platform::Cuda {
        rows.push(Row::new(
            "warpspec",
            "silu(x)*scale, plain kernel",
            2.0 * tensor,
            Some(0),
        ));
        variants.push(Box::new(|| keep(set.silu(Variant::Plain))));
    }
    let ms = medians(set.cuda_stream().as_ref(), rounds, &mut variants)?;
    drop(variants);
    failure.check()?;
    for (r, m) in rows.iter_mut().zip(ms) {
        r.ms = m;
    }
    Ok(rows)
}

/// Transfers to GPU 1 next to the driver's peer copy of the same bytes
/// between the same buffers. The reference is the first row returned, at
/// index `base` of the table.
fn peer_rows(set: &Set, remote: u64, rounds: usize, base: usize) -> Res<Vec<Row>> {
    let peer = set.world.borrow().ptr(1, remote).ok_or("no peer address")?;
    set.put(remote, 1)?;
    let (c0, c1) = (
        CudaContext::new(0).context("CUDA context")?,
        CudaContext::new(1).context("CUDA context")?,
    );
    let bytes = set.tensor_bytes() as usize;
    let stream = set
        .cuda_stream()
        .ok_or("peer transfers without a CUDA stream")?;
    let failure = FirstError::default();
    let keep = |r| failure.keep(r);
    let mut pair: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| {
            // SAFETY: live allocations of both contexts, `bytes` long.
            let r = unsafe { stream.copy_peer(peer, &c1, set.b.perm, &c0, bytes) };
            keep(r.context("cuMemcpyPeerAsync"))
        }),
        Box::new(|| keep(set.put(remote, 1))),
    ];
    let ms = medians(Some(&stream), rounds, &mut pair);
    drop(pair);
    let ms = ms?;
    failure.check()?;
    Ok(vec![
        Row {
            ms: ms[0],
            ..Row::new(
                "reference",
                "cuMemcpyPeerAsync GPU 0 -> GPU 1",
                bytes as f64,
                None,
            )
        },
        Row {
            ms: ms[1],
            ..Row::new("shmem", "put GPU 0 -> GPU 1", bytes as f64, Some(base))
        },
    ])
}

/// The graph cache on a launch-bound call (make_row_id_map, permute and
/// unpermute of 64 tokens): replayed through the cache vs the same calls
/// eagerly.
fn graph_rows(
    s: &Stream,
    target: &Target,
    b: &Buffers,
    p: Problem,
    rounds: usize,
) -> Res<Vec<Row>> {
    let small = Problem { tokens: 64, ..p };
    let (t, h, e, n) = (small.tokens, small.hidden, small.experts, small.rows());
    let target = Target {
        autotune: false,
        ..*target
    };
    let d = Dims {
        tokens: t,
        hidden: h,
        experts: e,
        rows: n,
        dtype: DType::Bf16,
    };
    let l = b.layer;
    let calls = || -> Res<()> {
        // SAFETY: prefixes of the set's heap buffers, large enough for 64
        // tokens, alive for the whole set.
        unsafe {
            l.make_row_id_map(&target, d, RowIdMapOptions::default())?;
            l.permute(&target, d, b.perm)?;
            l.unpermute(&target, d, b.perm, b.back)
        }
    };
    calls()?;
    let cache =
        GraphCache::new(CudaGraphs, xcall_graph::CacheConfig::default()).context("graph cache")?;
    let key = CallKey {
        device: Device::cuda(0),
        target: 1,
        attributes: 0.into(),
        buffers: [
            (l.routing, t * e),
            (l.x, t * h * 2),
            (b.perm, n * h * 2),
            (b.back, t * h * 2),
        ]
        .iter()
        .map(|&(a, bytes)| Buffer::new(a, bytes, BufferRole::InOut))
        .collect(),
    };
    let handle = CudaStreamHandle(s.raw());
    let through_cache = || -> Res<()> {
        cache
            .execute(&Call::new(key.clone(), Some(handle)), |_| calls())
            .context("graph cache")
            .map(|_| ())
    };
    through_cache()?;
    let failure = FirstError::default();
    let keep = |r| failure.keep(r);
    let mut v: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| keep(calls())),
        Box::new(|| keep(through_cache())),
    ];
    let ms = stream_medians(s, rounds, &mut v);
    drop(v);
    let ms = ms?;
    failure.check()?;
    let stats = cache.stats(Device::cuda(0));
    if stats.hits == 0 {
        return Err(format!("the graph cache never replayed: {stats:?}"));
    }
    Ok(vec![
        Row {
            ms: ms[0],
            ..Row::new(
                "reference",
                "3 permute calls on 64 tokens, eager",
                0.0,
                None,
            )
        },
        Row {
            ms: ms[1],
            ..Row::new(
                "graph",
                "the same through the graph cache (replayed)",
                0.0,
                None,
            )
        },
    ])
}
