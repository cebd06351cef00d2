//! The Host permutation ops at a reduced MoE shape, bf16, with GB/s (bytes
//! read plus written once), next to a plain copy of the permuted tensor's
//! bytes measured in the same run (`copy`: the memory system's own rate).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use xcall_core::testing::XorShift;
use xcall_core::{DType, FloatCodec};
use xcall_permute::chunks::{make_chunk_sort_map, sort_chunks_by_map, Direction};
use xcall_permute::ops::{
    permute, unpermute, unpermute_backward, PermuteInputs, PermuteOutputs, UnpermuteBackwardInputs,
    UnpermuteBackwardOutputs, UnpermuteInputs, UnpermuteOutputs,
};
use xcall_permute::{make_row_id_map, RowIdMapOptions};

/// (tokens, experts, hidden, topK): the (16384, 128, 4096, 6) upstream case
/// with T and H divided by 8.
const SHAPE: (usize, usize, usize, usize) = (2048, 128, 512, 6);

fn ops(c: &mut Criterion) {
    let (t, e, h, k) = SHAPE;
    let mut g = XorShift::new(5);
    let routing = g.top_k_routing(t, e, k);
    let codec = FloatCodec::new(DType::Bf16).unwrap();
    let random = |n: usize, g: &mut XorShift| {
        let mut b = vec![0u8; 2 * n];
        (0..n).for_each(|i| codec.store(&mut b, i, g.next_f32()));
        b
    };
    let input = random(t * h, &mut g);
    let grad = random(t * h, &mut g);
    let probs: Vec<f32> = (0..t * e).map(|_| g.next_f32().abs()).collect();
    let map = make_row_id_map(&routing, t, e, RowIdMapOptions::default()).unwrap();
    let n = map.out_rows;
    let row = 2 * h;
    let (map_bytes, prob_bytes) = (4 * t * (2 * e + 1), 4 * t * e);
    let mut permuted = vec![0u8; n * row];
    let mut copy_out = vec![0u8; n * row];
    let mut back = vec![0u8; t * row];
    let mut act = vec![0u8; n * row];
    let mut pgrad = vec![0f32; t * e];
    let mut sorted = vec![0u8; n * row];

    let mut grp = c.benchmark_group(format!("permute_host_bf16_T{t}_E{e}_H{h}_top{k}"));
    grp.sample_size(20);
    grp.throughput(Throughput::Bytes(2 * (n * row) as u64));
    grp.bench_function("copy", |b| {
        b.iter(|| copy_out.copy_from_slice(black_box(&permuted)))
    });
    grp.throughput(Throughput::Bytes((t * e + map_bytes + 16 * e) as u64));
    grp.bench_function("make_row_id_map", |b| {
        b.iter(|| make_row_id_map(black_box(&routing), t, e, RowIdMapOptions::default()).unwrap())
    });
    grp.throughput(Throughput::Bytes((t * row + map_bytes + n * row) as u64));
    grp.bench_function("permute", |b| {
        b.iter(|| {
            permute(
                map.view(),
                &PermuteInputs {
                    input: &input,
                    dtype: DType::Bf16,
                    hidden: h,
                    probs: None,
                    scales: None,
                },
                &mut PermuteOutputs {
                    output: &mut permuted,
                    permuted_probs: None,
                    permuted_scales: None,
                },
            )
            .unwrap()
        })
    });
    grp.throughput(Throughput::Bytes(
        (n * row + map_bytes + prob_bytes + t * row) as u64,
    ));
    grp.bench_function("unpermute_with_probs", |b| {
        b.iter(|| {
            unpermute(
                map.view(),
                &UnpermuteInputs {
                    input: &permuted,
                    dtype: DType::Bf16,
                    hidden: h,
                    merging_probs: Some(&probs),
                    permuted_probs: None,
                },
                &mut UnpermuteOutputs {
                    output: &mut back,
                    unpermuted_probs: None,
                },
            )
            .unwrap()
        })
    });
    grp.throughput(Throughput::Bytes(
        (t * row + 2 * n * row + map_bytes + 2 * prob_bytes) as u64,
    ));
    grp.bench_function("unpermute_backward", |b| {
        b.iter(|| {
            unpermute_backward(
                map.view(),
                &UnpermuteBackwardInputs {
                    grad: &grad,
                    fwd_input: &permuted,
                    dtype: DType::Bf16,
                    hidden: h,
                    merging_probs: &probs,
                },
                &mut UnpermuteBackwardOutputs {
                    act_grad: &mut act,
                    probs_grad: &mut pgrad,
                },
            )
            .unwrap()
        })
    });
    // Chunk sort: the permuted rows in E chunks (one per expert), sorted
    // by a random permutation of the chunks.
    let split: Vec<i64> = map.tokens_per_expert.clone();
    let mut order: Vec<i64> = (0..e as i64).collect();
    for i in (1..e).rev() {
        order.swap(i, (g.next_u64() % (i as u64 + 1)) as usize);
    }
    let sort_map = make_chunk_sort_map(&split, &order, n).unwrap();
    grp.throughput(Throughput::Bytes((2 * n * row + 8 * n) as u64));
    grp.bench_function("sort_chunks_by_map", |b| {
        b.iter(|| {
            sort_chunks_by_map(
                &permuted,
                row,
                &sort_map,
                None,
                Direction::Forward,
                &mut sorted,
                None,
            )
            .unwrap()
        })
    });
    grp.finish();
}

criterion_group!(benches, ops);
criterion_main!(benches);
