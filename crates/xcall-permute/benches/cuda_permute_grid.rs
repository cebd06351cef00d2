//! The permute family over a grid of MoE shapes, each op replayed from a
//! CUDA graph beside a device-to-device copy of the permuted tensor's bytes
//! in the same run. The ratio is the op's GB/s over the copy's, with the
//! byte model of `cuda_permute` (with expert padding, unpermute and the
//! backward read only the routed rows; with routes dropped, permute and
//! the backward read only the tokens that keep one); the copy is the faster of the
//! driver's and a plain kernel's (see common/mod.rs). The grid: H in {1024,
//! 2048, 4096, 7168} x topK in {1, 2, 6, 8} x E in {4, 8, 64, 128, 256} x T
//! in {4096, 16384}; bf16 runs every op, f32 and fp8 (e4m3) permute and
//! unpermute without probs; bf16 also runs with `num_out_tokens` = 3/4 of
//! T x topK (routes dropped) and with each expert padded to 128 rows.
//!
//! Writes one JSON object per measurement, one per line, to
//! `$XCALL_GRID_JSON` (default `permute-grid.json`); `scripts/permute-grid.py`
//! turns it into the table and heat map of docs/BENCHMARKS.md.
//! `XCALL_GRID_QUICK=1` runs T = 4096 only; `XCALL_GRID_ONLY` =
//! `dtype:variant:T:E:H:topK` (each field a value or `*`) runs the
//! matching shapes only, e.g. to profile one. `XCALL_GRID_CONFIGS=1` also
//! replays permute, unpermute and the backward under every candidate
//! launch config of the tuner and prints the tuned config's ratio beside
//! the fastest config's (how far the tuner's pick is from the best).

mod common;

use std::io::Write;
use std::sync::Arc;

use common::{KernelCopy, TunedCall};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use xcall_core::cuda::{GraphExec, Stream};
use xcall_core::testing::{capture_graph, interleaved_medians, XorShift};
use xcall_core::{DType, Device, FloatCodec};
use xcall_permute::call::{
    self, MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Target, Tensor,
    UnpermuteArgs, UnpermuteBackwardArgs,
};
use xcall_permute::chunks::Direction;
use xcall_permute::cuda::{
    backward_candidates, permute_candidates, unpermute_candidates, LaunchConfig,
};
use xcall_permute::RowIdMapOptions;

const ROUNDS: usize = 10;
const HS: [usize; 4] = [1024, 2048, 4096, 7168];
const TOPKS: [usize; 4] = [1, 2, 6, 8];
const ES: [usize; 5] = [4, 8, 64, 128, 256];
/// Random bytes are made on the Host in blocks of this size and tiled on
/// the device (a whole [N, H] tensor of random values would take minutes
/// to make).
const BLOCK: usize = 64 << 20;

/// Fills `bytes` of `dst` with random finite values of `dtype`.
fn fill(stream: &Arc<CudaStream>, dst: &CudaSlice<u8>, bytes: usize, dtype: DType, seed: u64) {
    let codec = FloatCodec::with_fp8(dtype).unwrap();
    let mut g = XorShift::new(seed);
    let n = BLOCK.min(bytes) / dtype.size_bytes();
    let mut block = vec![0u8; n * dtype.size_bytes()];
    for i in 0..n {
        codec.store(&mut block, i, g.next_f32() * 4.0 - 2.0);
    }
    let src = stream.clone_htod(&block).unwrap();
    let (s, d) = (src.device_ptr(stream).0, dst.device_ptr(stream).0);
    // SAFETY: the caller's live stream of cuda:0.
    let on = unsafe { Stream::from_raw(Device::cuda(0), stream.cu_stream()) };
    let mut at = 0;
    while at < bytes {
        let len = block.len().min(bytes - at);
        // SAFETY: both ranges lie inside live allocations of this stream's
        // context (`dst` holds at least `bytes`).
        unsafe { on.copy_dtod(d + at as u64, s, len) }.unwrap();
        at += len;
    }
    stream.synchronize().unwrap();
}

/// Copies `bytes` to device address `dst` (synchronous).
fn upload(dst: u64, bytes: &[u8]) {
    // SAFETY: every caller's `dst` is a live allocation of at least
    // `bytes.len()` bytes, and no stream work uses it meanwhile.
    unsafe { xcall_core::cuda::copy_htod_sync(Device::cuda(0), dst, bytes) }.unwrap();
}

struct Shape {
    t: usize,
    e: usize,
    h: usize,
    k: usize,
}

fn main() {
    let Some((info, ctx, stream, copy)) = common::setup("cuda_permute_grid") else {
        return;
    };
    let target = Target {
        autotune: true,
        checked: false,
        ..Target::cuda(0, stream.cu_stream().cast())
    };
    let quick = xcall_core::env::flag("XCALL_GRID_QUICK")
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(false);
    let sweep = xcall_core::env::flag("XCALL_GRID_CONFIGS")
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or(false);
    let json_path = std::env::var("XCALL_GRID_JSON").unwrap_or("permute-grid.json".into());
    let only: Option<Vec<String>> = std::env::var("XCALL_GRID_ONLY").ok().map(|s| {
        let fields: Vec<String> = s.split(':').map(str::to_string).collect();
        assert_eq!(
            fields.len(),
            6,
            "XCALL_GRID_ONLY is dtype:variant:T:E:H:topK, not {s:?}"
        );
        fields
    });
    let wanted = |values: [String; 6]| {
        only.as_ref()
            .is_none_or(|o| o.iter().zip(&values).all(|(f, v)| f == "*" || f == v))
    };
    let mut json = std::fs::File::create(&json_path).unwrap();
    let ts: &[usize] = if quick { &[4096] } else { &[4096, 16384] };
    let (max_t, max_n, max_h) = (16384, 16384 * 8, 7168);
    let alloc = |bytes: usize| -> CudaSlice<u8> { stream.alloc_zeros::<u8>(bytes).unwrap() };
    let d_in = alloc(max_t * max_h * 4);
    let d_grad = alloc(max_t * max_h * 4);
    let d_perm = alloc(max_n * max_h * 4);
    let d_out = alloc(max_n * max_h * 4);
    let d_back = alloc(max_t * max_h * 4);
    let d_routing = alloc(max_t * 256);
    let d_map = alloc(max_t * (2 * 256 + 1) * 4);
    let d_tpe = alloc(256 * 8);
    let d_off = alloc(257 * 8);
    let d_probs = alloc(max_t * 256 * 4);
    let d_pp = alloc((max_n + 256 * 128) * 4);
    let d_pg = alloc(max_t * 256 * 4);
    let d_sizes = alloc(256 * 8);
    let d_sorted_idx = alloc(256 * 8);
    let d_cmap = alloc((max_n + 256 * 128) * 8);
    let p = |s: &CudaSlice<u8>| s.device_ptr(&stream).0;
    let tensor = |s: &CudaSlice<u8>, dtype: DType, dims: &[usize]| {
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        Tensor::new(p(s), dtype, &dims)
    };
    println!(
        "device: {} ({}), graph replays, CUDA-event medians of {ROUNDS} interleaved rounds; ratio = op GB/s / copy GB/s (the faster of cuMemcpyDtoDAsync and a copy kernel)",
        info.name,
        info.arch()
    );
    println!(
        "{:<6} {:<8} {:<24} {:<22} {:>9} {:>9} {:>7}",
        "dtype", "variant", "shape (T,E,H,topK)", "op", "op us", "copy us", "ratio"
    );
    let mut worst: Vec<(String, f64)> = Vec::new();
    let env = Env {
        ctx: &ctx,
        stream: &stream,
        target: &target,
        copy: &copy,
        sweep,
    };
    for dtype in [DType::Bf16, DType::F32, DType::F8E4M3] {
        fill(&stream, &d_in, max_t * max_h * 4, dtype, 1);
        fill(&stream, &d_grad, max_t * max_h * 4, dtype, 2);
        fill(&stream, &d_perm, max_n * max_h * 4, dtype, 3);
        let variants: &[&str] = if dtype == DType::Bf16 {
            &["plain", "cap", "align"]
        } else {
            &["plain"]
        };
        for &variant in variants {
            for &t in ts {
                for &e in &ES {
                    for &k in &TOPKS {
                        if k > e {
                            continue;
                        }
                        let mut g = XorShift::new((t * 31 + e * 7 + k) as u64);
                        let routing = g.top_k_routing(t, e, k);
                        upload(p(&d_routing), &routing);
                        let probs: Vec<u8> = (0..t * e)
                            .flat_map(|_| g.next_f32().abs().to_le_bytes())
                            .collect();
                        upload(p(&d_probs), &probs);
                        for &h in &HS {
                            let fields = [
                                dtype.to_string(),
                                variant.to_string(),
                                t.to_string(),
                                e.to_string(),
                                h.to_string(),
                                k.to_string(),
                            ];
                            if !wanted(fields) {
                                continue;
                            }
                            let shape = Shape { t, e, h, k };
                            let lines = run_shape(
                                &env,
                                &shape,
                                dtype,
                                variant,
                                &Buffers {
                                    input: tensor(&d_in, dtype, &[t, h]),
                                    grad: tensor(&d_grad, dtype, &[t, h]),
                                    perm: p(&d_perm),
                                    out: p(&d_out),
                                    back: tensor(&d_back, dtype, &[t, h]),
                                    routing: tensor(&d_routing, DType::U8, &[t, e]),
                                    map: tensor(&d_map, DType::I32, &[t, 2 * e + 1]),
                                    tpe: tensor(&d_tpe, DType::I64, &[e]),
                                    off: tensor(&d_off, DType::I64, &[e + 1]),
                                    probs: tensor(&d_probs, DType::F32, &[t, e]),
                                    pp: p(&d_pp),
                                    pg: tensor(&d_pg, DType::F32, &[t, e]),
                                    sizes: tensor(&d_sizes, DType::I64, &[e]),
                                    sorted_idx: tensor(&d_sorted_idx, DType::I64, &[e]),
                                    cmap: p(&d_cmap),
                                },
                            );
                            for l in lines {
                                writeln!(
                                    json,
                                    "{{\"device\":\"{}\",\"dtype\":\"{dtype}\",\"variant\":\"{variant}\",\"t\":{t},\"e\":{e},\"h\":{h},\"topk\":{k},\"op\":\"{}\",\"op_us\":{:.2},\"copy_us\":{:.2},\"memcpy_us\":{:.2},\"kernel_copy_us\":{:.2},\"ratio\":{:.4}}}",
                                    info.name, l.op, l.op_us, l.copy_us, l.memcpy_us, l.kernel_copy_us, l.ratio
                                )
                                .unwrap();
                                println!(
                                    "{:<6} {variant:<8} {:<24} {:<22} {:>9.1} {:>9.1} {:>7.3}",
                                    dtype.to_string(),
                                    format!("({t},{e},{h},{k})"),
                                    l.op,
                                    l.op_us,
                                    l.copy_us,
                                    l.ratio
                                );
                                worst.push((
                                    format!("{dtype} {variant} {} ({t},{e},{h},{k})", l.op),
                                    l.ratio,
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    worst.sort_by(|a, b| a.1.total_cmp(&b.1));
    println!("lowest ratios:");
    for (what, r) in worst.iter().take(12) {
        println!("  {r:.3} {what}");
    }
    println!(
        "{} measurements, {} at or above 0.85; JSON in {json_path}",
        worst.len(),
        worst.iter().filter(|w| w.1 >= 0.85).count()
    );
    for (k, c) in xcall_permute::cuda::cached_configs(Device::cuda(0)) {
        println!("tuned: {k}: {c:?}");
    }
}

/// Device buffers of one shape (the largest shape's allocations, viewed).
struct Buffers {
    input: Tensor,
    grad: Tensor,
    perm: u64,
    out: u64,
    back: Tensor,
    routing: Tensor,
    map: Tensor,
    tpe: Tensor,
    off: Tensor,
    probs: Tensor,
    pp: u64,
    pg: Tensor,
    sizes: Tensor,
    sorted_idx: Tensor,
    cmap: u64,
}

/// An op's name, its bytes moved and one call of it.
type TimedOp<'a> = (&'static str, f64, Box<dyn FnMut() + 'a>);

struct Line {
    op: &'static str,
    op_us: f64,
    /// The faster of the two copies below.
    copy_us: f64,
    memcpy_us: f64,
    kernel_copy_us: f64,
    ratio: f64,
}

/// What every shape's run uses: the context, the stream, the target and
/// the reference copy kernel.
struct Env<'a> {
    ctx: &'a Arc<CudaContext>,
    stream: &'a Arc<CudaStream>,
    target: &'a Target,
    copy: &'a KernelCopy,
    /// Replay the tuned ops under every candidate config too.
    sweep: bool,
}

fn run_shape(env: &Env<'_>, s: &Shape, dtype: DType, variant: &str, b: &Buffers) -> Vec<Line> {
    let Env {
        ctx,
        stream,
        target,
        copy,
        sweep,
    } = *env;
    let (t, e, h, k) = (s.t, s.e, s.h, s.k);
    let options = match variant {
        "cap" => RowIdMapOptions {
            num_out_tokens: Some(t * k * 3 / 4),
            ..RowIdMapOptions::default()
        },
        "align" => RowIdMapOptions {
            align: Some(128),
            ..RowIdMapOptions::default()
        },
        _ => RowIdMapOptions::default(),
    };
    let rim = MakeRowIdMapArgs {
        routing: b.routing.clone(),
        options,
        row_id_map: b.map.clone(),
        tokens_per_expert: b.tpe.clone(),
        expert_offsets: b.off.clone(),
    };
    // SAFETY: (this and every call below) views of live device allocations
    // of at least the tensors' sizes, on the bench's stream of cuda:0.
    unsafe { call::make_row_id_map(target, &rim).unwrap() };
    let mut off = vec![0i64; e + 1];
    let mut tpe = vec![0i64; e];
    // SAFETY: reads e + 1 and e i64s of live allocations after the stream
    // has finished the map.
    unsafe {
        stream.synchronize().unwrap();
        xcall_core::cuda::copy_dtoh_sync(Device::cuda(0), &mut off, b.off.address).unwrap();
        xcall_core::cuda::copy_dtoh_sync(Device::cuda(0), &mut tpe, b.tpe.address).unwrap();
    }
    let n = match variant {
        "cap" => t * k * 3 / 4,
        _ => off[e] as usize,
    };
    // The tokens permute (their rows) and the backward (their gradients)
    // read: those with a kept route. With `cap` a token can lose every
    // route (its map row's count is then 0).
    let read_tokens = if variant == "cap" {
        let mut map = vec![0i32; t * (2 * e + 1)];
        // SAFETY: reads the map's t x (2e + 1) i32s of a live allocation;
        // the stream finished writing it above.
        unsafe { xcall_core::cuda::copy_dtoh_sync(Device::cuda(0), &mut map, b.map.address) }
            .unwrap();
        map.chunks(2 * e + 1).filter(|r| r[2 * e] > 0).count()
    } else {
        t
    };
    let row = h * dtype.size_bytes();
    let nt = |addr: u64, rows: usize| Tensor::new(addr, dtype, &[rows as u64, h as u64]);
    let bf16 = dtype == DType::Bf16;
    let permute = PermuteArgs {
        input: b.input.clone(),
        row_id_map: b.map.clone(),
        tokens_per_expert: b.tpe.clone(),
        expert_offsets: b.off.clone(),
        probs: bf16.then(|| b.probs.clone()),
        scales: None,
        output: nt(b.out, n),
        permuted_probs: bf16.then(|| Tensor::new(b.pp, DType::F32, &[n as u64])),
        permuted_scales: None,
        in_place: false,
        output_segments: None,
    };
    let unpermute = UnpermuteArgs {
        input: nt(b.perm, n),
        row_id_map: b.map.clone(),
        merging_probs: bf16.then(|| b.probs.clone()),
        permuted_probs: None,
        output: b.back.clone(),
        unpermuted_probs: None,
        input_segments: None,
    };
    let backward = UnpermuteBackwardArgs {
        grad: b.grad.clone(),
        fwd_input: nt(b.perm, n),
        row_id_map: b.map.clone(),
        tokens_per_expert: b.tpe.clone(),
        expert_offsets: b.off.clone(),
        merging_probs: b.probs.clone(),
        act_grad: nt(b.out, n),
        probs_grad: b.pg.clone(),
    };
    // The chunk sort over the permuted rows: E chunks of the expert sizes
    // in reversed order (plain bf16 only: every row belongs to a chunk).
    let sort_too = bf16 && variant == "plain";
    let cmap = MakeChunkSortMapArgs {
        split_sizes: b.sizes.clone(),
        sorted_indices: b.sorted_idx.clone(),
        map: Tensor::new(b.cmap, DType::I64, &[n as u64]),
    };
    let sort = SortChunksArgs {
        input: nt(b.perm, n),
        map: cmap.map.clone(),
        probs: None,
        direction: Direction::Forward,
        output: nt(b.out, n),
        permuted_probs: None,
        in_place: false,
    };
    if sort_too {
        let sorted: Vec<i64> = (0..e as i64).rev().collect();
        let bytes = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        upload(b.sizes.address, &bytes(&tpe));
        upload(b.sorted_idx.address, &bytes(&sorted));
        // SAFETY: as above.
        unsafe { call::make_chunk_sort_map(target, &cmap).unwrap() };
    }
    let cs = stream.cu_stream();
    // SAFETY: the bench's live stream of cuda:0.
    let on = unsafe { Stream::from_raw(Device::cuda(0), cs) };
    let (tr, nr) = ((t * row) as f64, (n * row) as f64);
    // The rows of kept routes: all N but for `align`, whose padding rows
    // permute and the backward write (zeros) and unpermute and the
    // backward's forward input never read.
    let routed: i64 = tpe.iter().sum();
    let rr = (routed as usize * row) as f64;
    let probs_bytes = if bf16 { (n * 4) as f64 } else { 0.0 };
    let merge_bytes = if bf16 { (t * e * 4) as f64 } else { 0.0 };
    let (perm_addr, out_addr) = (b.perm, b.out);
    let mut ops: Vec<TimedOp<'_>> = vec![
        (
            "d2d copy",
            2.0 * nr,
            Box::new(move || {
                // SAFETY: two live allocations of at least n * row bytes.
                unsafe { on.copy_dtod(out_addr, perm_addr, n * row) }.unwrap()
            }),
        ),
        (
            "kernel copy",
            2.0 * nr,
            // SAFETY: two live, disjoint, 16-byte aligned allocations of at
            // least n * row bytes (a multiple of 16) on this context.
            Box::new(move || unsafe { copy.enqueue(out_addr, perm_addr, n * row, cs) }),
        ),
        (
            "permute",
            (read_tokens * row) as f64 + nr + probs_bytes,
            // SAFETY: as above.
            Box::new(|| unsafe { call::permute(target, &permute).unwrap() }),
        ),
        (
            "unpermute",
            rr + tr + merge_bytes,
            // SAFETY: as above.
            Box::new(|| unsafe { call::unpermute(target, &unpermute).unwrap() }),
        ),
    ];
    if bf16 {
        ops.push((
            "unpermute_backward",
            (read_tokens * row) as f64 + rr + nr + (t * e * 8) as f64,
            // SAFETY: as above.
            Box::new(|| unsafe { call::unpermute_backward(target, &backward).unwrap() }),
        ));
    }
    if sort_too {
        ops.push((
            "sort_chunks_by_map",
            2.0 * nr,
            // SAFETY: as above.
            Box::new(|| unsafe { call::sort_chunks_by_map(target, &sort).unwrap() }),
        ));
    }
    if bf16 && variant == "plain" {
        // Writes only: the rate permute's stores could reach at best.
        ops.push((
            "memset (writes)",
            nr,
            Box::new(move || {
                // SAFETY: n * row bytes (a multiple of 2) of a live
                // allocation.
                unsafe { on.memset_d16(out_addr, 0x3c00, n * row / 2) }.unwrap()
            }),
        ));
    }
    // Eager calls first: they tune each kernel class (never under capture).
    for op in ops.iter_mut() {
        (op.2)();
    }
    stream.synchronize().unwrap();
    let graphs: Vec<GraphExec> = ops
        .iter_mut()
        .map(|op| capture_graph(Device::cuda(0), stream, &mut *op.2))
        .collect();
    let mut replays: Vec<Box<dyn FnMut() + '_>> = graphs
        .iter()
        .map(|g| -> Box<dyn FnMut() + '_> {
            // An executable graph of this stream's context.
            Box::new(move || on.launch_graph(g).unwrap())
        })
        .collect();
    let ms = interleaved_medians(ctx, stream, ROUNDS, &mut replays);
    drop(replays);
    // The timing synchronised; no replay is in flight.
    drop(graphs);
    // The reference is the faster of the two copies (see common/mod.rs).
    let copy_ms = ms[0].min(ms[1]);
    let copy_gbs = ops[0].1 / copy_ms;
    if sweep {
        let shape = format!("{dtype} {variant} ({t},{e},{h},{k})");
        // SAFETY: (the three calls) as above.
        let permute_call = || unsafe { call::permute(target, &permute) };
        // SAFETY: as above.
        let unpermute_call = || unsafe { call::unpermute(target, &unpermute) };
        // SAFETY: as above.
        let backward_call = || unsafe { call::unpermute_backward(target, &backward) };
        let tuned: [(&str, Vec<LaunchConfig>, &TunedCall<'_>); 3] = [
            ("permute", permute_candidates(), &permute_call),
            ("unpermute", unpermute_candidates(true), &unpermute_call),
            ("unpermute_backward", backward_candidates(), &backward_call),
        ];
        // Each config runs after the copy kernel, whose [N, H] output
        // evicts most of what the last run left in L2, as the shape's own
        // timing runs each op after another op.
        let flush = capture_graph(Device::cuda(0), stream, &mut *ops[1].2);
        for (kernel, candidates, call) in tuned {
            let Some(at) = ops.iter().position(|op| op.0 == kernel) else {
                continue;
            };
            let bytes = ops[at].1;
            config_sweep(env, &shape, kernel, &candidates, call, &flush, |m| {
                bytes / m / copy_gbs
            });
        }
        // The sweeps synchronised; no replay is in flight.
        drop(flush);
    }
    ops.iter()
        .zip(&ms)
        .skip(2)
        .map(|(op, &m)| Line {
            op: op.0,
            op_us: m * 1e3,
            copy_us: copy_ms * 1e3,
            memcpy_us: ms[0] * 1e3,
            kernel_copy_us: ms[1] * 1e3,
            ratio: op.1 / m / copy_gbs,
        })
        .collect()
}

/// Replays `kernel`'s op (`call`) under its tuned config and under each
/// candidate config, each after a replay of `flush` (see
/// [`common::time_configs`]), and prints the tuned config's ratio beside
/// the fastest candidate's.
fn config_sweep(
    env: &Env<'_>,
    shape: &str,
    kernel: &'static str,
    candidates: &[LaunchConfig],
    call: &TunedCall<'_>,
    flush: &GraphExec,
    ratio: impl Fn(f64) -> f64,
) {
    let timed = common::time_configs(
        env.ctx,
        env.stream,
        ROUNDS,
        kernel,
        candidates,
        call,
        Some(flush),
    );
    let Some((best, best_ms)) = timed[1..]
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|&(c, m)| (c.unwrap(), m))
    else {
        return;
    };
    println!(
        "configs: {shape} {kernel}: tuned {:.3}, fastest of {} {:.3} ({best:?})",
        ratio(timed[0].1),
        timed.len() - 1,
        ratio(best_ms)
    );
}
