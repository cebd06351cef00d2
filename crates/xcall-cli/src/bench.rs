// Over 600 lines: one benchmark set over every crate in one process; `measure` still runs its steps inline.
//! `xcall bench`: one benchmark set over every crate, in one process, each
//! figure next to a reference measured in the same run (a copy of the same
//! bytes on the same device, the peer copy for transfers between GPUs,
//! the eager calls for the graph cache).
//!
//! Every buffer comes from an xcall-shmem world (one PE per device, two
//! when there are two devices), so the same code serves Host and CUDA.
//! GB/s count bytes read plus bytes written once. CUDA times are
//! CUDA-event medians of interleaved rounds after warm-up; Host times are
//! medians of interleaved rounds of the host clock.

use std::cell::RefCell;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use cudarc::driver::{sys, CudaContext, CudaStream};
use serde_json::json;
use xcall_core::testing::{interleaved_medians, XorShift};
use xcall_core::{DType, Device, Platform};
use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{Buffer, BufferRole, Call, CallKey, GraphCache};
use xcall_permute::call::Target;
use xcall_permute::RowIdMapOptions;
use xcall_shmem::{Config, World};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::Variant;
use xcall_warpspec::ops::OpConfig;
use xcall_warpspec::OpCall;

use crate::layer::{Context, Dims, Layer, Res};
use crate::moe::PlatformArg;

/// Flags of `xcall bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which set: the Host set, or the CUDA set on GPU 0 (and GPU 1 for
    /// transfers between GPUs when there is one).
    #[arg(long, value_enum, default_value_t = PlatformArg::Host)]
    platform: PlatformArg,
    /// Timed rounds per figure.
    #[arg(long, default_value_t = 30)]
    rounds: usize,
    /// Also write the table as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One figure.
struct Row {
    group: &'static str,
    item: String,
    ms: f64,
    /// Bytes read plus written (0: a latency figure).
    bytes: f64,
    /// Index of the reference row; `None` for a reference.
    reference: Option<usize>,
}

/// The layer-shaped problem every figure uses.
#[derive(Clone, Copy)]
struct Problem {
    tokens: u64,
    hidden: u64,
    experts: u64,
    topk: u64,
}

impl Problem {
    fn rows(&self) -> u64 {
        self.tokens * self.topk
    }
}

/// Symmetric buffers of the set.
struct Buffers {
    layer: Layer,
    perm: u64,
    dst: u64,
    back: u64,
}

/// The first error of the timed closures (which cannot return one).
#[derive(Default)]
struct Failure(RefCell<Option<String>>);

impl Failure {
    fn keep(&self, r: Res<()>) {
        if let Err(e) = r {
            self.0.borrow_mut().get_or_insert(e);
        }
    }

    fn check(&self) -> Res<()> {
        self.0.borrow_mut().take().map_or(Ok(()), Err)
    }
}

/// Times every variant; medians in ms.
fn medians(
    gpu: Option<&(Arc<CudaContext>, Arc<CudaStream>)>,
    rounds: usize,
    variants: &mut [Box<dyn FnMut() + '_>],
) -> Vec<f64> {
    match gpu {
        Some((c, s)) => interleaved_medians(c, s, rounds, variants),
        None => {
            for v in variants.iter_mut() {
                v();
            }
            let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
            for _ in 0..rounds {
                for (v, out) in variants.iter_mut().zip(samples.iter_mut()) {
                    let start = Instant::now();
                    v();
                    out.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            samples
                .into_iter()
                .map(|mut t| {
                    t.sort_by(|a, b| a.total_cmp(b));
                    t[t.len() / 2]
                })
                .collect()
        }
    }
}

/// Runs `xcall bench`.
pub fn run(args: &BenchArgs) -> Res<bool> {
    let platform = match args.platform {
        PlatformArg::Host => Platform::Host,
        PlatformArg::Cuda => Platform::Cuda,
    };
    if args.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let pes = match platform {
        Platform::Host => 2,
        Platform::Cuda => match xcall_core::cuda::device_count() {
            Ok(0) => return Err("--platform cuda: no CUDA device is visible".into()),
            Ok(n) => n.min(2),
            Err(e) => return Err(format!("--platform cuda: {e}")),
        },
    };
    let problem = match platform {
        Platform::Host => Problem {
            tokens: 2048,
            hidden: 1024,
            experts: 8,
            topk: 2,
        },
        Platform::Cuda => Problem {
            tokens: 8192,
            hidden: 4096,
            experts: 8,
            topk: 2,
        },
    };
    let row = problem.hidden * 2;
    let heap = (problem.rows() * row * 3 + problem.tokens * row * 2) as usize + (64 << 20);
    let group = format!("xcall-bench-{}", std::process::id());
    let config = |rank| {
        let mut c = Config::in_process(&group, rank, pes, Device::new(platform, rank as u32));
        c.heap_bytes = Some(heap);
        c.timeout = Duration::from_secs(600);
        c
    };
    let rows = std::thread::scope(|scope| {
        // The second PE only lends its heap as the target of peer puts.
        let helper = (pes > 1).then(|| {
            let c = config(1);
            scope.spawn(move || -> Res<()> {
                let mut w = World::new();
                w.init(&c).context("shmem init")?;
                allocate(&mut w, problem)?;
                w.barrier_all().context("shmem barrier")?;
                w.finalize().context("shmem finalize").map(|_| ())
            })
        });
        let rows = measure(platform, &config(0), problem, args.rounds);
        let helped = helper.map_or(Ok(()), |h| {
            h.join()
                .unwrap_or_else(|_| Err("the helper PE panicked".into()))
        });
        rows.and_then(|r| helped.map(|()| r))
    })?;
    print_and_write(platform, problem, &rows, args.json.as_ref())?;
    Ok(true)
}

/// Device and name for the header line.
fn device_name(platform: Platform) -> String {
    match platform {
        Platform::Host => format!(
            "Host ({} hardware thread(s))",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        ),
        Platform::Cuda => xcall_core::cuda::device_info(Device::cuda(0))
            .map_or_else(|e| e.to_string(), |i| format!("{} ({})", i.name, i.arch())),
    }
}

/// The set's buffers (collective: every PE allocates the same), and a
/// target buffer for peer puts when there is a peer.
fn allocate(world: &mut World, p: Problem) -> Res<(Buffers, Option<u64>)> {
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

fn measure(platform: Platform, config: &Config, p: Problem, rounds: usize) -> Res<Vec<Row>> {
    let mut world = World::new();
    world.init(config).context("shmem init")?;
    let (t, h, e, n) = (p.tokens, p.hidden, p.experts, p.rows());
    let row = h * 2;
    let (b, peer_dst) = allocate(&mut world, p)?;
    // Random tokens (bf16 bit patterns of values in [-4, 4)), a top-k
    // routing, softmax-like probs.
    let mut g = XorShift::new(7);
    let x: Vec<u8> = (0..t * h)
        .flat_map(|_| half::bf16::from_f32(4.0 * g.next_f32()).to_le_bytes())
        .collect();
    let mut routing = vec![0u8; (t * e) as usize];
    for tok in 0..t as usize {
        let mut picked = 0;
        while picked < p.topk {
            let x = (g.next_u64() % e) as usize;
            if routing[tok * e as usize + x] == 0 {
                routing[tok * e as usize + x] = 1;
                picked += 1;
            }
        }
    }
    let probs: Vec<u8> = routing
        .iter()
        .flat_map(|&r| (r as f32 * 0.5).to_le_bytes())
        .collect();
    let l = b.layer;
    for (dest, bytes) in [(l.x, &x), (l.routing, &routing), (l.probs, &probs)] {
        // SAFETY: host vectors of exactly `bytes.len()` bytes.
        (unsafe { world.put(dest, bytes.as_ptr() as u64, bytes.len(), 0) }).context("shmem put")?;
    }
    let gpu = match platform {
        Platform::Host => None,
        Platform::Cuda => {
            let c = CudaContext::new(0).context("CUDA context")?;
            // SAFETY: the set orders its own work on one stream.
            unsafe { c.disable_event_tracking() };
            let s = c.new_stream().context("CUDA stream")?;
            Some((c, s))
        }
    };
    let stream: *mut c_void = gpu
        .as_ref()
        .map_or(std::ptr::null_mut(), |(_, s)| s.cu_stream().cast());
    let target = match platform {
        Platform::Host => Target::host(),
        Platform::Cuda => Target {
            autotune: true,
            ..Target::cuda(0, stream)
        },
    };
    let ops = OpConfig::default();
    let failure = Failure::default();
    let keep = |r| failure.keep(r);
    let d = Dims {
        tokens: t,
        hidden: h,
        experts: e,
        rows: n,
        dtype: DType::Bf16,
    };
    // SAFETY: (this and the next two layer calls) heap buffers of exactly
    // these dims, alive until the world is finalized after the last
    // synchronisation.
    let make_map = || unsafe { l.make_row_id_map(&target, d, RowIdMapOptions::default()) };
    // SAFETY: as above.
    let permute = || unsafe { l.permute(&target, d, b.perm) };
    // SAFETY: as above.
    let unpermute = || unsafe { l.unpermute(&target, d, b.perm, b.back) };
    let silu = |variant: Variant| -> Res<()> {
        let call = OpCall {
            device: Device::new(platform, 0),
            stream,
            op: ElementwiseOp::SiluScale,
            dtype: DType::Bf16,
            config: ops,
            variant,
            inputs: &[b.perm],
            output: b.dst,
            bytes: n * row,
            scale: 1.5,
        };
        // SAFETY: `perm` and `dst` are distinct heap buffers of n * row
        // bytes of the platform's device; nothing else touches them
        // meanwhile (on CUDA: ordered on the stream).
        (unsafe { xcall_warpspec::run(&call) }).context("silu_scale")
    };
    let copy = |dst: u64, src: u64, bytes: u64| -> Res<()> {
        match platform {
            // SAFETY: distinct heap buffers of at least `bytes` bytes.
            Platform::Host => unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes as usize);
                Ok(())
            },
            Platform::Cuda => {
                // SAFETY: as above, device memory ordered on the stream.
                (unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes as usize, stream.cast()) }
                    .result())
                .context("cuMemcpyDtoDAsync")
            }
        }
    };
    // Everything once, checked, before timing (compiles and autotunes).
    make_map()?;
    permute()?;
    unpermute()?;
    silu(Variant::WarpSpecialized)?;
    if platform == Platform::Cuda {
        silu(Variant::Plain)?;
    }
    let world = RefCell::new(world);
    let put = |dest: u64, pe: usize| -> Res<()> {
        // SAFETY: `perm` holds n * row bytes.
        (unsafe {
            world
                .borrow_mut()
                .put_nbi(dest, b.perm, (n * row) as usize, pe, stream)
        })
        .context("shmem put")
    };
    put(b.dst, 0)?;
    let tensor = (n * row) as f64;
    let mut rows = vec![
        Row {
            group: "reference",
            item: "copy of the permuted tensor (same device)".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: None,
        },
        Row {
            group: "permute",
            item: "make_row_id_map".into(),
            ms: 0.0,
            bytes: (t * e + t * (2 * e + 1) * 4) as f64,
            reference: Some(0),
        },
        Row {
            group: "permute",
            item: "permute".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: Some(0),
        },
        Row {
            group: "permute",
            item: "unpermute with merging probs".into(),
            ms: 0.0,
            bytes: tensor + (t * row) as f64,
            reference: Some(0),
        },
        Row {
            group: "warpspec",
            item: "silu(x)*scale, warp-specialized".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: Some(0),
        },
        Row {
            group: "shmem",
            item: "put to its own heap".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: Some(0),
        },
    ];
    let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| keep(copy(b.dst, b.perm, n * row))),
        Box::new(|| keep(make_map())),
        Box::new(|| keep(permute())),
        Box::new(|| keep(unpermute())),
        Box::new(|| keep(silu(Variant::WarpSpecialized))),
        Box::new(|| keep(put(b.dst, 0))),
    ];
    if let (Some(remote), Platform::Host) = (peer_dst, platform) {
        rows.push(Row {
            group: "shmem",
            item: "put to PE 1's heap".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: Some(0),
        });
        variants.push(Box::new(move || keep(put(remote, 1))));
    }
    if platform == Platform::Cuda {
        rows.push(Row {
            group: "warpspec",
            item: "silu(x)*scale, plain kernel".into(),
            ms: 0.0,
            bytes: 2.0 * tensor,
            reference: Some(0),
        });
        variants.push(Box::new(|| keep(silu(Variant::Plain))));
    }
    let ms = medians(gpu.as_ref(), rounds, &mut variants);
    drop(variants);
    failure.check()?;
    for (r, m) in rows.iter_mut().zip(ms) {
        r.ms = m;
    }
    if let (Some(remote), Platform::Cuda) = (peer_dst, platform) {
        // Transfers to GPU 1 next to the driver's peer copy of the same
        // bytes between the same buffers.
        let peer = world.borrow().ptr(1, remote).ok_or("no peer address")?;
        put(remote, 1)?;
        let base = rows.len();
        rows.push(Row {
            group: "reference",
            item: "cuMemcpyPeerAsync GPU 0 -> GPU 1".into(),
            ms: 0.0,
            bytes: tensor,
            reference: None,
        });
        rows.push(Row {
            group: "shmem",
            item: "put GPU 0 -> GPU 1".into(),
            ms: 0.0,
            bytes: tensor,
            reference: Some(base),
        });
        let (c0, c1) = (
            CudaContext::new(0).context("CUDA context")?,
            CudaContext::new(1).context("CUDA context")?,
        );
        let (raw0, raw1) = (c0.cu_ctx(), c1.cu_ctx());
        let mut pair: Vec<Box<dyn FnMut() + '_>> = vec![
            Box::new(|| {
                // SAFETY: live allocations of both contexts, n * row bytes.
                let r = unsafe {
                    sys::cuMemcpyPeerAsync(
                        peer,
                        raw1,
                        b.perm,
                        raw0,
                        (n * row) as usize,
                        stream.cast(),
                    )
                };
                keep(r.result().context("cuMemcpyPeerAsync"))
            }),
            Box::new(|| keep(put(remote, 1))),
        ];
        let ms = medians(gpu.as_ref(), rounds, &mut pair);
        drop(pair);
        failure.check()?;
        rows[base].ms = ms[0];
        rows[base + 1].ms = ms[1];
    }
    if let Some((c, s)) = &gpu {
        rows.extend(graph_rows(c, s, &target, &b, p, rounds)?);
    }
    let mut world = world.into_inner();
    world.barrier_all().context("shmem barrier")?;
    world.finalize().context("shmem finalize")?;
    Ok(rows)
}

/// The graph cache on a launch-bound call (make_row_id_map, permute and
/// unpermute of 64 tokens): replayed through the cache vs the same calls
/// eagerly.
fn graph_rows(
    c: &Arc<CudaContext>,
    s: &Arc<CudaStream>,
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
        GraphCache::new(CudaGraphs, xcall_graph::Config::default()).context("graph cache")?;
    let key = CallKey {
        device: Device::cuda(0),
        target: 1,
        attributes: 0,
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
    let handle = CudaStreamHandle(s.cu_stream());
    let through_cache = || -> Res<()> {
        cache
            .execute(&Call::new(key.clone(), Some(handle)), |_| calls())
            .context("graph cache")
            .map(|_| ())
    };
    through_cache()?;
    let failure = Failure::default();
    let keep = |r| failure.keep(r);
    let mut v: Vec<Box<dyn FnMut() + '_>> = vec![
        Box::new(|| keep(calls())),
        Box::new(|| keep(through_cache())),
    ];
    let ms = interleaved_medians(c, s, rounds, &mut v);
    drop(v);
    failure.check()?;
    let stats = cache.stats(Device::cuda(0));
    if stats.hits == 0 {
        return Err(format!("the graph cache never replayed: {stats:?}"));
    }
    Ok(vec![
        Row {
            group: "reference",
            item: "3 permute calls on 64 tokens, eager".into(),
            ms: ms[0],
            bytes: 0.0,
            reference: None,
        },
        Row {
            group: "graph",
            item: "the same through the graph cache (replayed)".into(),
            ms: ms[1],
            bytes: 0.0,
            reference: None,
        },
    ])
}

fn print_and_write(
    platform: Platform,
    p: Problem,
    rows: &[Row],
    json_path: Option<&PathBuf>,
) -> Res<()> {
    let device = device_name(platform);
    println!(
        "xcall bench: {device}; T={} H={} E={} top-{} bf16; medians of interleaved rounds after warm-up",
        p.tokens, p.hidden, p.experts, p.topk
    );
    println!(
        "{:<10} {:<44} {:>11} {:>9} {:>9}",
        "crate", "item", "time us", "GB/s", "ratio"
    );
    let gbs = |r: &Row| (r.bytes > 0.0).then(|| r.bytes / (r.ms / 1e3) / 1e9);
    let mut out = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let g = gbs(r);
        // Bandwidth figures: GB/s over the reference's GB/s. The graph
        // row: the eager time over the replayed time (a speed-up).
        let ratio = match (r.reference, g) {
            (Some(k), Some(g)) => gbs(&rows[k]).map(|x| g / x),
            _ if r.group == "graph" => Some(rows[i - 1].ms / r.ms),
            _ => None,
        };
        println!(
            "{:<10} {:<44} {:>11.1} {:>9} {:>9}",
            r.group,
            r.item,
            r.ms * 1e3,
            g.map_or("-".into(), |g| format!("{g:.1}")),
            ratio.map_or("ref".into(), |x| format!("{x:.3}")),
        );
        out.push(json!({
            "crate": r.group, "item": r.item, "us": r.ms * 1e3, "bytes": r.bytes,
            "gb_per_s": g, "ratio": ratio,
            "reference": r.reference.map(|k| rows[k].item.clone()),
        }));
    }
    println!("ratio: GB/s over the same device's copy (the peer copy for GPU 0 -> GPU 1); graph: eager time over replayed time");
    if let Some(path) = json_path {
        let doc = json!({
            "platform": platform.name(), "device": device,
            "tokens": p.tokens, "hidden": p.hidden, "experts": p.experts, "topk": p.topk,
            "rows": out,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n").map_err(|e| format!("--json {}: {e}", path.display()))?;
    }
    Ok(())
}
