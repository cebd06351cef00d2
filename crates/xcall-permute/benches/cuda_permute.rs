//! Every op at the upstream bf16 benchmark cases (T, E, H, topK), side by
//! side in one run with a device-to-device copy of the permuted tensor's
//! bytes. GB/s count bytes read plus bytes written once; times are
//! CUDA-event medians of interleaved rounds after warm-up; every op runs
//! with its autotuned config (tuned before timing). The copy each ratio
//! divides by is the faster of the driver's copy and a plain copy kernel
//! (see common/mod.rs); both are printed. A memset of the
//! permuted tensor shows the write rate alone (permute with top-8 is
//! nearly all writes). Then, for permute, unpermute and the backward,
//! every candidate launch config is replayed from its own graph beside the
//! tuned one: how far the autotuner's pick is from the fastest config,
//! and for permute the fastest register and bulk-copy configs apart.
//! `XCALL_PERMUTE_CASES` = `T,E,H,topK;...` runs other cases.

mod common;

use cudarc::driver::{CudaSlice, DevicePtr};
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

const ROUNDS: usize = 30;
/// Rounds of the every-config comparison (about 130 graphs per case).
const CONFIG_ROUNDS: usize = 10;

fn main() {
    let Some((info, ctx, stream, copy)) = common::setup("cuda_permute") else {
        return;
    };
    let target = Target {
        autotune: true,
        checked: false,
        ..Target::cuda(0, stream.cu_stream().cast())
    };
    // Checked mode: the whole map checked on the device before permute
    // (eager: plus a wait for the verdict).
    let checked = Target {
        checked: true,
        ..target
    };
    println!(
        "device: {} ({}), bf16, CUDA-event medians of {ROUNDS} interleaved rounds; copy = the faster of cuMemcpyDtoDAsync and a copy kernel, [N, H]",
        info.name,
        info.arch()
    );
    println!(
        "{:<28} {:<26} {:>9} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "case (T,E,H,topK)", "op", "eager us", "GB/s", "vs copy", "graph us", "GB/s", "vs copy"
    );
    let cases: Vec<(usize, usize, usize, usize)> = match std::env::var("XCALL_PERMUTE_CASES") {
        Ok(s) => s
            .split(';')
            .map(|c| {
                let v: Vec<usize> = c.split(',').map(|x| x.trim().parse().unwrap()).collect();
                assert!(
                    v.len() == 4,
                    "XCALL_PERMUTE_CASES is T,E,H,topK;..., not {s:?}"
                );
                (v[0], v[1], v[2], v[3])
            })
            .collect(),
        Err(_) => vec![
            (4096, 256, 7168, 8),
            (16384, 128, 4096, 6),
            (16384, 4, 7168, 1),
        ],
    };
    for (t, e, h, k) in cases {
        let mut g = XorShift::new(7);
        let routing = g.top_k_routing(t, e, k);
        let n = t * k;
        let row = h * 2;
        let codec = FloatCodec::new(DType::Bf16).unwrap();
        let mut data = vec![0u8; n.max(t) * row];
        for i in 0..n.max(t) * h {
            codec.store(&mut data, i, g.next_f32());
        }
        let probs: Vec<f32> = (0..t * e).map(|_| g.next_f32().abs()).collect();
        let up = |b: &[u8]| -> CudaSlice<u8> { stream.clone_htod(b).unwrap() };
        let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let d_routing = up(&routing);
        let d_map = up(&vec![0u8; t * (2 * e + 1) * 4]);
        let d_tpe = up(&vec![0u8; e * 8]);
        let d_off = up(&vec![0u8; (e + 1) * 8]);
        let d_in = up(&data[..t * row]);
        let d_probs = up(&f32b(&probs));
        let d_perm = up(&data[..n * row]);
        let d_pp = up(&vec![0u8; n * 4]);
        let d_back = up(&vec![0u8; t * row]);
        let d_act = up(&vec![0u8; n * row]);
        let d_pg = up(&vec![0u8; t * e * 4]);
        let d_sorted = up(&vec![0u8; n * row]);
        let d_cmap = up(&vec![0u8; n * 8]);
        // Chunk sort over the permuted rows: E chunks of the expert sizes,
        // in reversed order.
        let sizes: Vec<i64> = (0..e)
            .map(|x| {
                routing
                    .iter()
                    .skip(x)
                    .step_by(e)
                    .filter(|&&v| v != 0)
                    .count() as i64
            })
            .collect();
        let sorted: Vec<i64> = (0..e as i64).rev().collect();
        let i64b = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let d_sizes = up(&i64b(&sizes));
        let d_sorted_idx = up(&i64b(&sorted));
        let p = |s: &CudaSlice<u8>| s.device_ptr(&stream).0;
        let tensor = |s: &CudaSlice<u8>, dtype: DType, dims: &[usize]| {
            let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
            Tensor::new(p(s), dtype, &dims)
        };
        let rim = MakeRowIdMapArgs {
            routing: tensor(&d_routing, DType::U8, &[t, e]),
            options: RowIdMapOptions::default(),
            row_id_map: tensor(&d_map, DType::I32, &[t, 2 * e + 1]),
            tokens_per_expert: tensor(&d_tpe, DType::I64, &[e]),
            expert_offsets: tensor(&d_off, DType::I64, &[e + 1]),
        };
        let (permute, unpermute, backward) = ops_of(
            &rim,
            [
                tensor(&d_in, DType::Bf16, &[t, h]),
                tensor(&d_probs, DType::F32, &[t, e]),
                tensor(&d_perm, DType::Bf16, &[n, h]),
                tensor(&d_pp, DType::F32, &[n]),
            ],
            [
                tensor(&d_back, DType::Bf16, &[t, h]),
                tensor(&d_act, DType::Bf16, &[n, h]),
                tensor(&d_pg, DType::F32, &[t, e]),
            ],
        );
        let cmap = MakeChunkSortMapArgs {
            split_sizes: tensor(&d_sizes, DType::I64, &[e]),
            sorted_indices: tensor(&d_sorted_idx, DType::I64, &[e]),
            map: tensor(&d_cmap, DType::I64, &[n]),
        };
        let sort = SortChunksArgs {
            input: permute.output.clone(),
            map: cmap.map.clone(),
            probs: None,
            direction: Direction::Forward,
            output: tensor(&d_sorted, DType::Bf16, &[n, h]),
            permuted_probs: None,
            in_place: false,
        };
        // permute without probs: what the probs cost it.
        let bare = PermuteArgs {
            probs: None,
            permuted_probs: None,
            ..permute.clone()
        };
        // SAFETY: (this and every call below) device allocations of the
        // tensors' sizes on the bench's stream of cuda:0.
        unsafe {
            call::make_row_id_map(&target, &rim).unwrap();
            call::make_chunk_sort_map(&target, &cmap).unwrap();
        }
        let s = stream.cu_stream();
        // SAFETY: the bench's live stream of cuda:0.
        let on = unsafe { Stream::from_raw(Device::cuda(0), s) };
        let (copy_dst, copy_src) = (p(&d_sorted), p(&d_perm));
        let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
            Box::new(|| {
                // SAFETY: two live allocations of n * row bytes.
                unsafe { on.copy_dtod(copy_dst, copy_src, n * row) }.unwrap()
            }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::make_row_id_map(&target, &rim).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::permute(&target, &permute).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::unpermute(&target, &unpermute).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::unpermute_backward(&target, &backward).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::make_chunk_sort_map(&target, &cmap).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::sort_chunks_by_map(&target, &sort).unwrap() }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::permute(&checked, &permute).unwrap() }),
            Box::new(|| {
                // SAFETY: n * row bytes (a multiple of 4) of a live
                // allocation.
                unsafe { on.memset_d32(copy_dst, 0x3c003c00, n * row / 4) }.unwrap()
            }),
            // SAFETY: two live, disjoint, 16-byte aligned allocations of n *
            // row bytes (a multiple of 16) on this context.
            Box::new(|| unsafe { copy.enqueue(copy_dst, copy_src, n * row, s) }),
            // SAFETY: as above.
            Box::new(|| unsafe { call::permute(&target, &bare).unwrap() }),
        ];
        let ms = interleaved_medians(&ctx, &stream, ROUNDS, &mut variants);
        // The same ops replayed from CUDA graphs: device time without the
        // Host's launch and argument checks (how a graph cache runs them).
        let graphs: Vec<GraphExec> = variants
            .iter_mut()
            .map(|v| capture_graph(Device::cuda(0), &stream, &mut **v))
            .collect();
        let mut replays: Vec<Box<dyn FnMut() + '_>> = graphs
            .iter()
            .map(|g| -> Box<dyn FnMut() + '_> {
                // An executable graph of this stream's context.
                Box::new(move || on.launch_graph(g).unwrap())
            })
            .collect();
        let graph_ms = interleaved_medians(&ctx, &stream, ROUNDS, &mut replays);
        drop(replays);
        let (tr, nr) = ((t * row) as f64, (n * row) as f64);
        let rows: [(&str, f64); 11] = [
            ("d2d copy", 2.0 * nr),
            (
                "make_row_id_map",
                (t * e) as f64 + (t * (2 * e + 1) * 4) as f64,
            ),
            ("permute (+probs)", tr + nr + (n * 4) as f64),
            ("unpermute (merging probs)", nr + tr + (t * e * 4) as f64),
            ("unpermute_backward", tr + 2.0 * nr + (t * e * 8) as f64),
            ("make_chunk_sort_map", (n * 8) as f64),
            ("sort_chunks_by_map", 2.0 * nr),
            ("permute checked (+probs)", tr + nr + (n * 4) as f64),
            // Writes only: what permute's stores could reach at best.
            ("memset [N, H] (writes)", nr),
            ("kernel copy", 2.0 * nr),
            ("permute (no probs)", tr + nr),
        ];
        // The faster of the two copies is the reference.
        let copy_gbs = rows[0].1 / ms[0].min(ms[9]) / 1e6;
        let case = format!("({t},{e},{h},{k}) N={n}");
        let graph_copy_gbs = rows[0].1 / graph_ms[0].min(graph_ms[9]) / 1e6;
        for (((name, bytes), t_ms), g_ms) in rows.iter().zip(&ms).zip(&graph_ms) {
            let (gbs, ggbs) = (bytes / t_ms / 1e6, bytes / g_ms / 1e6);
            println!(
                "{case:<28} {name:<26} {:>9.1} {gbs:>9.1} {:>8.3} {:>9.1} {ggbs:>9.1} {:>8.3}",
                t_ms * 1e3,
                gbs / copy_gbs,
                g_ms * 1e3,
                ggbs / graph_copy_gbs
            );
        }
        println!(
            "{case:<28} {:<26} {:>9.3} {:>28.3}",
            "make_row_id_map / permute",
            ms[1] / ms[2],
            graph_ms[1] / graph_ms[2]
        );
        println!(
            "{case:<28} {:<26} {:>9.3} {:>28.3}",
            "checked / permute",
            ms[7] / ms[2],
            graph_ms[7] / graph_ms[2]
        );
        // Every candidate config of the three tuned ops, each replayed from
        // its own graph beside the tuned op's graph: how far the tuner's
        // pick is from the fastest config in replays.
        let tuned_calls: [(&str, &str, Vec<LaunchConfig>, usize); 3] = [
            ("permute (+probs)", "permute", permute_candidates(), 2),
            (
                "unpermute (merging probs)",
                "unpermute",
                unpermute_candidates(true),
                3,
            ),
            (
                "unpermute_backward",
                "unpermute_backward",
                backward_candidates(),
                4,
            ),
        ];
        for (label, kernel, candidates, at) in tuned_calls {
            // SAFETY: (the three calls) as above.
            let call = || unsafe {
                match at {
                    2 => call::permute(&target, &permute),
                    3 => call::unpermute(&target, &unpermute),
                    _ => call::unpermute_backward(&target, &backward),
                }
            };
            let timed = common::time_configs(
                &ctx,
                &stream,
                CONFIG_ROUNDS,
                kernel,
                &candidates,
                &call,
                None,
            );
            let us: Vec<f64> = timed.iter().map(|&(_, ms)| ms * 1e3).collect();
            let configs: Vec<LaunchConfig> = timed[1..].iter().map(|&(c, _)| c.unwrap()).collect();
            let ratio = |u: f64| rows[at].1 / u / 1e3 / graph_copy_gbs;
            let (best, best_us) = configs
                .iter()
                .zip(&us[1..])
                .min_by(|a, b| a.1.total_cmp(b.1))
                .map(|(&c, &u)| (c, u))
                .unwrap();
            let near = us[1..].iter().filter(|&&u| u <= best_us * 1.02).count();
            println!(
                "{case:<28} {label:<26} tuned {:.1} us ({:.3}), fastest of {} configs {:.1} us ({:.3}), tuned / fastest {:.3}, {near} within 2%: {best:?}",
                us[0],
                ratio(us[0]),
                us.len() - 1,
                best_us,
                ratio(best_us),
                us[0] / best_us,
            );
            if kernel == "permute" {
                // The fastest config of each kind (register kernels, bulk
                // copies).
                for (kind, bulk) in [("register", false), ("bulk-copy", true)] {
                    let fastest = configs
                        .iter()
                        .zip(&us[1..])
                        .filter(|(c, _)| (c.stages > 0) == bulk)
                        .min_by(|a, b| a.1.total_cmp(b.1));
                    if let Some((c, &u)) = fastest {
                        println!(
                            "{case:<28} {label:<26} fastest {kind} config {u:.1} us ({:.3}): {c:?}",
                            ratio(u),
                        );
                    }
                }
            }
        }
        // No replay is in flight after the timing synchronised.
        drop(graphs);
        drop(variants);
    }
    host_cost(&target);
    for (k, c) in xcall_permute::cuda::cached_configs(Device::cuda(0)) {
        println!("tuned: {k}: {c:?}");
    }
}

/// The timed ops over the map of `rim`: permute of `input` [T, H] with
/// `probs` [T, E] into `output` [N, H] and `permuted_probs` [N]; unpermute
/// of that output, merging the probs, into `back` [T, H]; and its backward
/// (the gradient `back`) into `act_grad` [N, H] and `probs_grad` [T, E].
fn ops_of(
    rim: &MakeRowIdMapArgs,
    [input, probs, output, permuted_probs]: [Tensor; 4],
    [back, act_grad, probs_grad]: [Tensor; 3],
) -> (PermuteArgs, UnpermuteArgs, UnpermuteBackwardArgs) {
    let unpermute = UnpermuteArgs {
        input: output.clone(),
        row_id_map: rim.row_id_map.clone(),
        merging_probs: Some(probs.clone()),
        permuted_probs: None,
        output: back.clone(),
        unpermuted_probs: None,
        input_segments: None,
    };
    let backward = UnpermuteBackwardArgs {
        grad: back,
        fwd_input: output.clone(),
        row_id_map: rim.row_id_map.clone(),
        tokens_per_expert: rim.tokens_per_expert.clone(),
        expert_offsets: rim.expert_offsets.clone(),
        merging_probs: probs.clone(),
        act_grad,
        probs_grad,
    };
    let permute = PermuteArgs {
        input,
        row_id_map: rim.row_id_map.clone(),
        tokens_per_expert: rim.tokens_per_expert.clone(),
        expert_offsets: rim.expert_offsets.clone(),
        probs: Some(probs),
        scales: None,
        output,
        permuted_probs: Some(permuted_probs),
        permuted_scales: None,
        in_place: false,
        output_segments: None,
    };
    (permute, unpermute, backward)
}

/// An op's name and one eager call of it.
type NamedCall<'a> = (&'static str, Box<dyn FnMut() + 'a>);

/// The Host side of eager calls at small T, where it can outlast the
/// kernels: the median wall time of one call returning (checks, lookups
/// and launches, the stream never waited on), beside the same for one
/// `cuMemsetD8Async` (the cost of any enqueue) in the same run.
fn host_cost(target: &Target) {
    use std::time::Instant;
    println!("host cost of one eager call (median of 200, us); enqueue = one cuMemsetD8Async");
    println!(
        "{:<22} {:<26} {:>9} {:>9} {:>8}",
        "case (T,E,H,topK)", "op", "host us", "enqueue", "ratio"
    );
    // SAFETY: the bench's live stream of cuda:0.
    let stream = unsafe { Stream::from_handle(Device::cuda(0), target.stream as u64) };
    let device = Device::cuda(0);
    for (t, e, h, k) in [(256usize, 8usize, 4096usize, 2usize), (256, 256, 7168, 8)] {
        let mut g = XorShift::new(11);
        let n = t * k;
        let row = h * 2;
        let bytes = n.max(t) * row;
        let mut bufs: Vec<u64> = Vec::new();
        let mut alloc = |len: usize| -> u64 {
            // A plain device allocation, freed below.
            let p = xcall_core::cuda::mem_alloc(device, len.max(1)).unwrap();
            // SAFETY: fills the allocation just made.
            unsafe { xcall_core::cuda::memset_d8_sync(device, p, 0x3c, len.max(1)) }.unwrap();
            bufs.push(p);
            p
        };
        let routing = g.top_k_routing(t, e, k);
        let d_routing = alloc(t * e);
        // SAFETY: t * e bytes into an allocation of that size.
        unsafe { xcall_core::cuda::copy_htod_sync(device, d_routing, &routing[..t * e]) }.unwrap();
        let ten = |a: u64, dtype: DType, dims: &[usize]| {
            Tensor::new(
                a,
                dtype,
                &dims.iter().map(|&d| d as u64).collect::<Vec<_>>(),
            )
        };
        let rim = MakeRowIdMapArgs {
            routing: ten(d_routing, DType::U8, &[t, e]),
            options: RowIdMapOptions::default(),
            row_id_map: ten(alloc(t * (2 * e + 1) * 4), DType::I32, &[t, 2 * e + 1]),
            tokens_per_expert: ten(alloc(e * 8), DType::I64, &[e]),
            expert_offsets: ten(alloc((e + 1) * 8), DType::I64, &[e + 1]),
        };
        let (permute, unpermute, backward) = ops_of(
            &rim,
            [
                ten(alloc(bytes), DType::Bf16, &[t, h]),
                ten(alloc(t * e * 4), DType::F32, &[t, e]),
                ten(alloc(bytes), DType::Bf16, &[n, h]),
                ten(alloc(n * 4), DType::F32, &[n]),
            ],
            [
                ten(alloc(bytes), DType::Bf16, &[t, h]),
                ten(alloc(bytes), DType::Bf16, &[n, h]),
                ten(alloc(t * e * 4), DType::F32, &[t, e]),
            ],
        );
        let scratch = alloc(64);
        let median = |f: &mut dyn FnMut()| -> f64 {
            for _ in 0..20 {
                f();
            }
            let mut us: Vec<f64> = (0..200)
                .map(|_| {
                    let at = Instant::now();
                    f();
                    at.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            // Waits for this bench's own stream.
            stream.sync().unwrap();
            us.sort_by(|a, b| a.total_cmp(b));
            us[us.len() / 2]
        };
        // SAFETY: (every call below) device allocations of the tensors'
        // sizes on the bench's stream of cuda:0.
        unsafe { call::make_row_id_map(target, &rim).unwrap() };
        let enqueue = median(&mut || {
            // SAFETY: 64 bytes of a live allocation on the bench's stream.
            unsafe { stream.memset_d8(scratch, 0, 64) }.unwrap()
        });
        let case = format!("({t},{e},{h},{k})");
        let mut ops: Vec<NamedCall<'_>> = vec![
            (
                "make_row_id_map",
                // SAFETY: as above.
                Box::new(|| unsafe { call::make_row_id_map(target, &rim).unwrap() }),
            ),
            (
                "permute (+probs)",
                // SAFETY: as above.
                Box::new(|| unsafe { call::permute(target, &permute).unwrap() }),
            ),
            (
                "unpermute (merging probs)",
                // SAFETY: as above.
                Box::new(|| unsafe { call::unpermute(target, &unpermute).unwrap() }),
            ),
            (
                "unpermute_backward",
                // SAFETY: as above.
                Box::new(|| unsafe { call::unpermute_backward(target, &backward).unwrap() }),
            ),
        ];
        for (name, f) in ops.iter_mut() {
            let us = median(&mut **f);
            println!(
                "{case:<22} {name:<26} {us:>9.2} {enqueue:>9.2} {:>8.1}",
                us / enqueue
            );
        }
        drop(ops);
        // The stream is idle (the medians waited) before this section's
        // allocations are freed.
        stream.sync().unwrap();
        for p in bufs {
            // SAFETY: an allocation of `alloc`, freed once, no work pending.
            unsafe { xcall_core::cuda::mem_free(device, p) }.unwrap();
        }
    }
}
