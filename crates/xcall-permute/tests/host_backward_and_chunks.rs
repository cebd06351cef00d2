//! unpermute_backward and chunk sort against independent references.

use xcall_core::testing::XorShift;
use xcall_core::DType;
use xcall_permute::chunks::{make_chunk_sort_map, sort_chunks_by_map, Direction};
use xcall_permute::ops::{unpermute_backward, UnpermuteBackwardInputs, UnpermuteBackwardOutputs};
use xcall_permute::{make_row_id_map, RowIdMapOptions};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_values(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn unpermute_backward_matches_the_definition() {
    let (t, e, h, topk) = (300, 7, 13, 2);
    let mut g = XorShift::new(9);
    let routing = g.top_k_routing(t, e, topk);
    let map = make_row_id_map(
        &routing,
        t,
        e,
        RowIdMapOptions {
            num_out_tokens: Some(500),
            align: None,
            capacity: None,
            groups: None,
        },
    )
    .unwrap();
    let n = map.out_rows;
    let grad: Vec<f32> = (0..t * h).map(|_| g.next_f32()).collect();
    let fwd: Vec<f32> = (0..n * h).map(|_| g.next_f32()).collect();
    let probs: Vec<f32> = (0..t * e).map(|_| g.next_f32().abs()).collect();
    let (grad_b, fwd_b) = (f32_bytes(&grad), f32_bytes(&fwd));
    let mut act = vec![0xa5u8; n * h * 4];
    let mut pg = vec![f32::NAN; t * e];
    unpermute_backward(
        map.view(),
        &UnpermuteBackwardInputs {
            grad: &grad_b,
            fwd_input: &fwd_b,
            dtype: DType::F32,
            hidden: h,
            merging_probs: &probs,
        },
        &mut UnpermuteBackwardOutputs {
            act_grad: &mut act,
            probs_grad: &mut pg,
        },
    )
    .unwrap();
    // Reference: walk the map's columns directly, f64 dot products.
    let act = f32_values(&act);
    let mut want_act = vec![0f32; n * h];
    let mut want_pg = vec![0f64; t * e];
    for tok in 0..t {
        let row = &map.map[tok * (2 * e + 1)..(tok + 1) * (2 * e + 1)];
        for k in 0..row[2 * e] as usize {
            let (dst, ex) = (row[k] as usize, row[e + k] as usize);
            for j in 0..h {
                want_act[dst * h + j] = grad[tok * h + j] * probs[tok * e + ex];
                want_pg[tok * e + ex] += fwd[dst * h + j] as f64 * grad[tok * h + j] as f64;
            }
        }
    }
    assert_eq!(act, want_act);
    for i in 0..t * e {
        assert!(
            (pg[i] as f64 - want_pg[i]).abs() <= 1e-5 * want_pg[i].abs().max(1.0),
            "{i}: {} vs {}",
            pg[i],
            want_pg[i]
        );
    }
}

#[test]
fn chunk_sort_map_and_both_directions() {
    // (S, T) as upstream, with rows past the chunks left in place.
    for (s, t, row_bytes, seed) in [
        (8usize, 4096usize, 12usize, 1u64),
        (64, 4096, 8, 2),
        (256, 4096, 4, 3),
        (5, 37, 3, 4),
    ] {
        let mut g = XorShift::new(seed);
        let mut sizes: Vec<i64> = (0..s)
            .map(|_| (g.next_u64() % (t as u64 / s as u64 + 1)) as i64)
            .collect();
        sizes[0] = 0; // an empty chunk
        let mut order: Vec<i64> = (0..s as i64).collect();
        for i in (1..s).rev() {
            order.swap(i, (g.next_u64() % (i as u64 + 1)) as usize);
        }
        let map = make_chunk_sort_map(&sizes, &order, t).unwrap();
        // Reference: build the output row list chunk by chunk in sorted order.
        let starts: Vec<i64> = sizes
            .iter()
            .scan(0, |acc, &x| {
                let s = *acc;
                *acc += x;
                Some(s)
            })
            .collect();
        let mut expected_src: Vec<usize> = Vec::new();
        for &c in &order {
            expected_src.extend((0..sizes[c as usize]).map(|k| (starts[c as usize] + k) as usize));
        }
        let covered = expected_src.len();
        expected_src.extend(covered..t);
        let input: Vec<u8> = (0..t * row_bytes).map(|_| g.next_u64() as u8).collect();
        let probs: Vec<f32> = (0..t).map(|_| g.next_f32()).collect();
        let mut fwd = vec![0u8; input.len()];
        let mut fwd_p = vec![f32::NAN; t];
        sort_chunks_by_map(
            &input,
            row_bytes,
            &map,
            Some(&probs),
            Direction::Forward,
            &mut fwd,
            Some(&mut fwd_p),
        )
        .unwrap();
        for (dst, &src) in expected_src.iter().enumerate() {
            assert_eq!(
                &fwd[dst * row_bytes..(dst + 1) * row_bytes],
                &input[src * row_bytes..(src + 1) * row_bytes],
                "S={s} row {dst}"
            );
            assert_eq!(fwd_p[dst], probs[src]);
        }
        let mut back = vec![0u8; input.len()];
        sort_chunks_by_map(
            &fwd,
            row_bytes,
            &map,
            None,
            Direction::Backward,
            &mut back,
            None,
        )
        .unwrap();
        assert_eq!(back, input, "backward undoes forward");
    }
}

#[test]
fn chunk_sort_bad_inputs() {
    assert!(make_chunk_sort_map(&[2, 2], &[0], 4).is_err());
    assert!(make_chunk_sort_map(&[2, -1], &[0, 1], 4).is_err());
    let err = make_chunk_sort_map(&[3, 3], &[1, 0], 5).unwrap_err();
    assert!(
        err.to_string().contains("sum to 6, past the 5 rows"),
        "{err}"
    );
    // Sizes whose sum wraps i64 are refused, not a panic or a wrapped sum.
    let err = make_chunk_sort_map(&[i64::MAX, i64::MAX, 4], &[0, 1, 2], 4).unwrap_err();
    assert!(err.to_string().contains("split_sizes sum"), "{err}");
    let err = make_chunk_sort_map(&[1, 1], &[1, 1], 4).unwrap_err();
    assert!(err.to_string().contains("not a permutation"), "{err}");
    let mut out = vec![9u8; 4];
    let err = sort_chunks_by_map(
        &[1, 2, 3, 4],
        1,
        &[0, 0, 1, 2],
        None,
        Direction::Forward,
        &mut out,
        None,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("map is not a permutation"),
        "{err}"
    );
    assert_eq!(out, vec![9u8; 4], "nothing written");
    assert_eq!(make_chunk_sort_map(&[], &[], 3).unwrap(), vec![0, 1, 2]);
}
