//! The Host ops against an independent reference that follows the
//! definitions in facts.md with plain loops (and f64 accumulation), on the
//! upstream test grid with a reduced hidden size, plus edge cases.

use std::collections::HashMap;

use half::{bf16, f16};
use xcall_core::testing::XorShift;
use xcall_core::DType;
use xcall_permute::ops::{
    permute, unpermute, PermuteInputs, PermuteOutputs, UnpermuteInputs, UnpermuteOutputs,
};
use xcall_permute::{make_row_id_map, PermuteError, RowIdMapOptions};

/// A routing map where every token picks `topk` distinct experts, except
/// every 97th token, which is routed nowhere.
fn routing(tokens: usize, experts: usize, topk: usize, seed: u64) -> Vec<u8> {
    let mut g = XorShift::new(seed);
    let mut r = vec![0u8; tokens * experts];
    for t in 0..tokens {
        if t % 97 == 13 {
            continue;
        }
        let mut picked = 0;
        while picked < topk.min(experts) {
            let e = (g.next_u64() % experts as u64) as usize;
            if r[t * experts + e] == 0 {
                r[t * experts + e] = 1;
                picked += 1;
            }
        }
    }
    r
}

/// Reference destinations: sort the (expert, token) pairs, walk each
/// expert's chunk (padded to `align`), drop rows at or past `cap`.
fn reference_rows(
    r: &[u8],
    tokens: usize,
    experts: usize,
    cap: Option<usize>,
    align: usize,
) -> (HashMap<(usize, usize), usize>, usize) {
    let mut pairs: Vec<(usize, usize)> = (0..tokens)
        .flat_map(|t| (0..experts).map(move |e| (e, t)))
        .filter(|&(e, t)| r[t * experts + e] == 1)
        .collect();
    pairs.sort();
    let mut rows = HashMap::new();
    let mut next = 0usize;
    let mut current = usize::MAX;
    let mut chunk_start = 0usize;
    for (e, t) in pairs {
        if e != current {
            // Close the previous chunk at a multiple of `align`, skip empty experts.
            let used = next - chunk_start;
            next = chunk_start + used.div_ceil(align) * align;
            chunk_start = next;
            current = e;
        }
        if cap.is_none_or(|c| next < c) {
            rows.insert((t, e), next);
        }
        next += 1;
    }
    let used = next - chunk_start;
    let total = chunk_start + used.div_ceil(align) * align;
    (rows, cap.unwrap_or(total))
}

/// Reference destinations with an expert capacity: expert `e` owns rows
/// `[e * capacity, (e + 1) * capacity)`; its routes fill them in token
/// order and the rest are dropped.
fn reference_capacity_rows(
    r: &[u8],
    tokens: usize,
    experts: usize,
    capacity: usize,
) -> (HashMap<(usize, usize), usize>, usize) {
    let mut rows = HashMap::new();
    for e in 0..experts {
        let routed = (0..tokens).filter(|&t| r[t * experts + e] != 0);
        for (j, t) in routed.take(capacity).enumerate() {
            rows.insert((t, e), e * capacity + j);
        }
    }
    (rows, experts * capacity)
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        // Pure data movement: any byte pattern is a valid fp8 payload here.
        DType::F8E4M3 | DType::F8E5M2 => v.iter().map(|x| (x.to_bits() >> 13) as u8).collect(),
        DType::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

fn decode(dtype: DType, b: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        _ => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
    }
}

// One test case: the shape, the options, the dtype and the seed.
#[allow(clippy::too_many_arguments)]
fn check_case(
    tokens: usize,
    experts: usize,
    hidden: usize,
    topk: usize,
    cap: Option<usize>,
    align: Option<usize>,
    capacity: Option<usize>,
    dtype: DType,
    seed: u64,
) {
    let what = format!(
        "T={tokens} E={experts} H={hidden} topk={topk} cap={cap:?} align={align:?} capacity={capacity:?} {dtype}"
    );
    let r = routing(tokens, experts, topk, seed);
    let map = make_row_id_map(
        &r,
        tokens,
        experts,
        RowIdMapOptions {
            num_out_tokens: cap,
            align,
            capacity,
            groups: None,
        },
    )
    .unwrap();
    let (rows, out_rows) = match capacity {
        Some(c) => reference_capacity_rows(&r, tokens, experts, c),
        None => reference_rows(&r, tokens, experts, cap, align.unwrap_or(1)),
    };
    assert_eq!(map.out_rows, out_rows, "{what}");
    // The map: routes in ascending expert order, -1 elsewhere, count in 2E.
    for t in 0..tokens {
        let want: Vec<(usize, usize)> = (0..experts)
            .filter_map(|e| rows.get(&(t, e)).map(|&d| (d, e)))
            .collect();
        assert_eq!(map.routes(t).collect::<Vec<_>>(), want, "{what} token {t}");
        let row = &map.map[t * map.width()..(t + 1) * map.width()];
        assert!(row[want.len()..experts].iter().all(|&v| v == -1));
        assert!(row[experts + want.len()..2 * experts]
            .iter()
            .all(|&v| v == -1));
    }
    for e in 0..experts {
        let kept = rows.keys().filter(|&&(_, x)| x == e).count() as i64;
        assert_eq!(map.tokens_per_expert[e], kept, "{what} expert {e}");
    }
    // permute, with probs and scales.
    let mut g = XorShift::new(seed + 1);
    let input_f: Vec<f32> = (0..tokens * hidden).map(|_| g.next_f32() * 3.0).collect();
    let input = encode(dtype, &input_f);
    let probs: Vec<f32> = (0..tokens * experts).map(|_| g.next_f32().abs()).collect();
    let scales: Vec<f32> = (0..tokens * 2).map(|_| g.next_f32()).collect();
    let row = hidden * dtype.size_bytes();
    let mut output = vec![0xa5u8; out_rows * row]; // poisoned
    let mut pp = vec![f32::NAN; out_rows];
    let mut ps = vec![f32::NAN; out_rows * 2];
    permute(
        map.view(),
        &PermuteInputs {
            input: &input,
            dtype,
            hidden,
            probs: Some(&probs),
            scales: Some(&scales),
        },
        &mut PermuteOutputs {
            output: &mut output,
            permuted_probs: Some(&mut pp),
            permuted_scales: Some(&mut ps),
        },
    )
    .unwrap();
    let mut want = vec![0u8; out_rows * row];
    let mut want_pp = vec![0f32; out_rows];
    let mut want_ps = vec![0f32; out_rows * 2];
    for (&(t, e), &d) in &rows {
        want[d * row..(d + 1) * row].copy_from_slice(&input[t * row..(t + 1) * row]);
        want_pp[d] = probs[t * experts + e];
        want_ps[2 * d..2 * d + 2].copy_from_slice(&scales[2 * t..2 * t + 2]);
    }
    assert!(output == want, "{what}: permute output differs");
    assert_eq!(pp, want_pp, "{what}");
    assert_eq!(ps, want_ps, "{what}");
    // unpermute (f32/f16/bf16) with merging probs, and scattering probs back.
    if dtype != DType::F32 && dtype != DType::F16 && dtype != DType::Bf16 {
        return;
    }
    let mut back = vec![0xa5u8; tokens * row];
    let mut up = vec![f32::NAN; tokens * experts];
    unpermute(
        map.view(),
        &UnpermuteInputs {
            input: &output,
            dtype,
            hidden,
            merging_probs: Some(&probs),
            permuted_probs: Some(&pp),
        },
        &mut UnpermuteOutputs {
            output: &mut back,
            unpermuted_probs: Some(&mut up),
        },
    )
    .unwrap();
    let permuted = decode(dtype, &output);
    let got = decode(dtype, &back);
    let tol = match dtype {
        DType::F32 => 1e-6,
        DType::F16 => 3e-3,
        _ => 2e-2,
    };
    for t in 0..tokens {
        for j in 0..hidden {
            let mut want = 0f64;
            for e in 0..experts {
                if let Some(&d) = rows.get(&(t, e)) {
                    want += permuted[d * hidden + j] * probs[t * experts + e] as f64;
                }
            }
            let g = got[t * hidden + j];
            assert!(
                (g - want).abs() <= tol * want.abs().max(1.0),
                "{what}: token {t} [{j}]: {g} vs {want}"
            );
        }
        for e in 0..experts {
            let want = rows.get(&(t, e)).map_or(0.0, |&d| want_pp[d]);
            assert_eq!(up[t * experts + e], want, "{what}");
        }
    }
}

#[test]
fn upstream_grid_with_reduced_hidden() {
    let mut seed = 100;
    for experts in [7, 16] {
        for topk in [2, 5] {
            for cap in [None, Some(2039)] {
                for dtype in [DType::F32, DType::Bf16] {
                    seed += 1;
                    check_case(4096, experts, 32, topk, cap, None, None, dtype, seed);
                }
            }
        }
    }
}

#[test]
fn padding_cases_with_reduced_hidden() {
    for (t, e, h, k, seed) in [
        (4096, 8, 16, 2, 1),
        (4096, 64, 8, 6, 2),
        (1024, 256, 4, 6, 3),
        (512, 512, 2, 8, 4),
    ] {
        check_case(t, e, h, k, None, Some(16), None, DType::F16, seed);
        check_case(t, e, h, k, None, Some(3), None, DType::F32, seed + 10);
    }
}

#[test]
fn capacity_cases_with_reduced_hidden() {
    // Capacity below the mean load (drops), at it, far above (padding),
    // 1, and fewer tokens than the capacity.
    for (t, e, h, k, capacity, dtype, seed) in [
        (1024, 8, 16, 2, 200, DType::Bf16, 1),
        (1024, 8, 16, 2, 256, DType::F32, 2),
        (1000, 16, 8, 4, 600, DType::F16, 3),
        (64, 7, 5, 3, 1, DType::F32, 4),
        (3, 4, 8, 2, 3, DType::F32, 5),
    ] {
        check_case(t, e, h, k, None, None, Some(capacity), dtype, seed);
    }
}

#[test]
fn edge_shapes_and_dtypes() {
    check_case(0, 4, 8, 2, None, None, None, DType::F32, 1); // no tokens
    check_case(33, 5, 1, 2, None, None, None, DType::Bf16, 2); // H = 1
    check_case(40, 3, 7, 3, None, None, None, DType::F16, 3); // odd H, all experts
    check_case(50, 6, 5, 2, Some(0), None, None, DType::F32, 4); // everything dropped
    check_case(50, 6, 5, 2, Some(1000), None, None, DType::F32, 5); // cap above the routes
    check_case(64, 4, 9, 1, None, None, None, DType::F8E4M3, 6); // fp8: pure data movement
    check_case(64, 4, 9, 2, None, None, None, DType::F8E5M2, 7);
}

/// fp8 by its definition: (exponent bits, mantissa bits, bias).
fn fp8_value(dtype: DType, b: u8) -> f64 {
    let (eb, mb, bias) = if dtype == DType::F8E4M3 {
        (4, 3, 7)
    } else {
        (5, 2, 15)
    };
    let (e, m) = (
        (b as i32 >> mb) & ((1 << eb) - 1),
        b as i32 & ((1 << mb) - 1),
    );
    let mag = if e == 0 {
        m as f64 * 2f64.powi(1 - bias - mb)
    } else {
        (1.0 + m as f64 / (1 << mb) as f64) * 2f64.powi(e - bias)
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

#[test]
fn fp8_unpermute_without_probs_sums_in_f32_rounds_and_saturates() {
    for (dtype, max, mbits) in [(DType::F8E4M3, 448.0, 3), (DType::F8E5M2, 57344.0, 2)] {
        let (tokens, experts, hidden) = (300, 6, 37);
        let r = routing(tokens, experts, 4, 11);
        let map = make_row_id_map(&r, tokens, experts, RowIdMapOptions::default()).unwrap();
        let n = map.out_rows;
        let mut g = XorShift::new(12);
        // Finite encodings only (E4M3 NaN is S.1111.111, E5M2 S.11111.xx
        // is Inf/NaN); every 50th row is all large values to saturate.
        let finite = |b: u8| fp8_value(dtype, b).is_finite() && fp8_value(dtype, b).abs() <= max;
        let input: Vec<u8> = (0..n * hidden)
            .map(|i| loop {
                let b = if (i / hidden) % 50 == 0 {
                    if dtype == DType::F8E4M3 {
                        0x7d
                    } else {
                        0x7a
                    }
                } else {
                    g.next_u64() as u8
                };
                if finite(b) {
                    break b;
                }
            })
            .collect();
        let mut out = vec![0xa5u8; tokens * hidden];
        unpermute(
            map.view(),
            &UnpermuteInputs {
                input: &input,
                dtype,
                hidden,
                merging_probs: None,
                permuted_probs: None,
            },
            &mut UnpermuteOutputs {
                output: &mut out,
                unpermuted_probs: None,
            },
        )
        .unwrap();
        let mut saturated = 0;
        for t in 0..tokens {
            for j in 0..hidden {
                let terms: Vec<f64> = map
                    .routes(t)
                    .map(|(d, _)| fp8_value(dtype, input[d * hidden + j]))
                    .collect();
                let want: f64 = terms.iter().sum();
                // The f32 accumulation may lose up to 2^-24 of the running
                // magnitude per add (large terms that cancel).
                let f32_err = terms.iter().map(|x| x.abs()).sum::<f64>() * 4.0 * 2f64.powi(-24);
                let clamped = want.clamp(-max, max);
                saturated += usize::from(clamped != want);
                let got = fp8_value(dtype, out[t * hidden + j]);
                // Within half a unit in the last place of the result (and
                // half the smallest subnormal near zero).
                let half_ulp =
                    clamped.abs() * 2f64.powi(-(mbits + 1)) + fp8_value(dtype, 1) / 2.0 + f32_err;
                assert!(
                    got.is_finite() && (got - clamped).abs() <= half_ulp,
                    "{dtype} token {t} [{j}]: {got} vs {want}"
                );
            }
        }
        assert!(saturated > 0, "{dtype}: the test should reach saturation");
        // Weighted sums stay f32/f16/bf16 only.
        let probs = vec![0.5f32; tokens * experts];
        let err = unpermute(
            map.view(),
            &UnpermuteInputs {
                input: &input,
                dtype,
                hidden,
                merging_probs: Some(&probs),
                permuted_probs: None,
            },
            &mut UnpermuteOutputs {
                output: &mut out,
                unpermuted_probs: None,
            },
        )
        .unwrap_err();
        assert!(matches!(err, PermuteError::Unsupported(m) if m.contains("merging_probs")));
    }
}

#[test]
fn bad_inputs_are_refused_and_nothing_is_written() {
    let opts = RowIdMapOptions::default();
    assert!(
        matches!(make_row_id_map(&[], 0, 0, opts), Err(PermuteError::Shape(m)) if m.contains("at least 1 expert"))
    );
    assert!(make_row_id_map(&[1, 0, 1], 2, 2, opts).is_err());
    let two = make_row_id_map(&[1, 2], 1, 2, opts).unwrap();
    assert_eq!(two.routes(0).count(), 2, "any nonzero byte is a route");
    assert!(make_row_id_map(
        &[1, 0],
        1,
        2,
        RowIdMapOptions {
            align: Some(0),
            ..opts
        }
    )
    .is_err());
    assert!(make_row_id_map(
        &[1, 0],
        1,
        2,
        RowIdMapOptions {
            align: Some(4),
            num_out_tokens: Some(4),
            capacity: None,
            groups: None,
        }
    )
    .is_err());
    for (capacity, align, cap) in [(0, None, None), (4, Some(2), None), (4, None, Some(8))] {
        let opts = RowIdMapOptions {
            num_out_tokens: cap,
            align,
            capacity: Some(capacity),
            groups: None,
        };
        assert!(
            matches!(make_row_id_map(&[1, 0], 1, 2, opts), Err(PermuteError::Shape(m)) if m.contains("capacity")),
            "{opts:?}"
        );
    }

    let map = make_row_id_map(&[1, 1, 0, 1], 2, 2, opts).unwrap();
    let input = vec![1u8; 2 * 4 * 4];
    let mut out = vec![0x5au8; 3 * 4 * 4];
    let probs = [0.5f32; 4];
    let mut pp = vec![7.0f32; 3];
    // Wrong output size, probs without permuted_probs, wrong hidden.
    for (hidden, with_pp, out_len) in [(4, true, 2 * 16), (4, false, 3 * 16), (3, true, 3 * 16)] {
        let mut o = out[..out_len].to_vec();
        let before = o.clone();
        let r = permute(
            map.view(),
            &PermuteInputs {
                input: &input,
                dtype: DType::F32,
                hidden,
                probs: Some(&probs),
                scales: None,
            },
            &mut PermuteOutputs {
                output: &mut o,
                permuted_probs: if with_pp { Some(&mut pp) } else { None },
                permuted_scales: None,
            },
        );
        assert_eq!(r.unwrap_err().status(), xcall_core::Status::InvalidArgument);
        assert_eq!(o, before, "nothing written");
    }
    assert_eq!(pp, vec![7.0; 3]);
    let err = unpermute(
        map.view(),
        &UnpermuteInputs {
            input: &out,
            dtype: DType::I32,
            hidden: 16,
            merging_probs: None,
            permuted_probs: None,
        },
        &mut UnpermuteOutputs {
            output: &mut [0u8; 2 * 16],
            unpermuted_probs: None,
        },
    )
    .unwrap_err();
    assert_eq!(err.status(), xcall_core::Status::Unsupported);
    out.fill(0);
}

/// Expert groups against a reference that walks each group's experts and
/// their tokens in order, placing rows from the group's base (padded to
/// `align`) and dropping those that reach the group's end; also the
/// options the groups refuse, and the per-group bound of the i32 map.
#[test]
fn expert_groups_pack_each_group_from_its_base() {
    use xcall_permute::ExpertGroups;
    for (tokens, experts, topk, per_group, rows, align, seed) in [
        (300, 256, 8, 256, 2400, None, 1u64),
        (200, 8, 2, 4, 400, None, 2),
        (200, 8, 3, 4, 100, None, 3),
        (500, 64, 6, 16, 700, Some(8), 4),
        (97, 12, 3, 3, 1, None, 5),
        (0, 4, 2, 2, 5, Some(4), 6),
    ] {
        let r = routing(tokens, experts, topk, seed);
        let options = RowIdMapOptions {
            align,
            groups: Some(ExpertGroups {
                experts: per_group,
                rows,
            }),
            ..RowIdMapOptions::default()
        };
        let map = make_row_id_map(&r, tokens, experts, options).unwrap();
        let what = format!(
            "T={tokens} E={experts} k={topk} groups of {per_group} x {rows} align={align:?}"
        );
        let groups = experts / per_group;
        assert_eq!(map.out_rows, groups * rows, "{what}");
        let mut want = HashMap::new();
        let (mut offsets, mut kept) = (vec![0i64; experts + 1], vec![0i64; experts]);
        for g in 0..groups {
            let end = (g + 1) * rows;
            let mut at = g * rows;
            for e in g * per_group..(g + 1) * per_group {
                offsets[e] = at.min(end) as i64;
                let mut n = 0;
                for t in (0..tokens).filter(|&t| r[t * experts + e] != 0) {
                    if at + n < end {
                        want.insert((t, e), at + n);
                        kept[e] += 1;
                    }
                    n += 1;
                }
                at += n.div_ceil(align.unwrap_or(1)) * align.unwrap_or(1);
            }
        }
        offsets[experts] = (groups * rows) as i64;
        let got: HashMap<(usize, usize), usize> = (0..tokens)
            .flat_map(|t| map.routes(t).map(move |(dst, e)| ((t, e), dst)))
            .collect();
        assert_eq!(got, want, "{what}");
        assert_eq!(map.tokens_per_expert, kept, "{what}");
        assert_eq!(map.expert_offsets, offsets, "{what}");
        // The map passes the checks every consumer runs.
        xcall_permute::RowIdMapRef::new(
            tokens,
            experts,
            &map.map,
            &map.tokens_per_expert,
            &map.expert_offsets,
            map.out_rows,
        )
        .unwrap();
    }
    // With rows = T * min(k, group) nothing is dropped (known answer).
    let r = routing(300, 16, 5, 9);
    let groups = Some(ExpertGroups {
        experts: 4,
        rows: 300 * 4,
    });
    let map = make_row_id_map(
        &r,
        300,
        16,
        RowIdMapOptions {
            groups,
            ..RowIdMapOptions::default()
        },
    )
    .unwrap();
    let routes: usize = r.iter().map(|&b| b as usize).sum();
    assert_eq!(map.tokens_per_expert.iter().sum::<i64>() as usize, routes);

    let refused = |options: RowIdMapOptions, experts: usize, needle: &str| {
        let r = vec![1u8; 2 * experts];
        match make_row_id_map(&r, 2, experts, options) {
            Err(PermuteError::Shape(m)) => assert!(m.contains(needle), "{options:?}: {m}"),
            other => panic!("{options:?}: {other:?}"),
        }
    };
    let g = |experts, rows| Some(ExpertGroups { experts, rows });
    let none = RowIdMapOptions::default();
    refused(
        RowIdMapOptions {
            groups: g(0, 4),
            ..none
        },
        4,
        "at least 1",
    );
    refused(
        RowIdMapOptions {
            groups: g(2, 0),
            ..none
        },
        4,
        "at least 1",
    );
    refused(
        RowIdMapOptions {
            groups: g(3, 4),
            ..none
        },
        4,
        "do not split",
    );
    refused(
        RowIdMapOptions {
            groups: g(2, 4),
            capacity: Some(2),
            ..none
        },
        4,
        "cannot be combined",
    );
    refused(
        RowIdMapOptions {
            groups: g(2, 4),
            num_out_tokens: Some(2),
            ..none
        },
        4,
        "cannot be combined",
    );
    // 2 groups of 2^30 rows fit the i32 map only just not.
    refused(
        RowIdMapOptions {
            groups: g(2, 1 << 30),
            ..none
        },
        4,
        "past the i32 row-id map",
    );
    assert!(make_row_id_map(
        &[1; 8],
        2,
        4,
        RowIdMapOptions {
            groups: g(2, (1 << 30) - 1),
            ..none
        }
    )
    .is_ok());
}

/// A map made elsewhere: each entry outside its range refused with its
/// message (known answers), whether the chunks are known, and the output
/// row bounds at i32::MAX exactly.
#[test]
fn maps_made_elsewhere_are_checked_entry_by_entry() {
    use xcall_permute::{ExpertGroups, RowIdMapRef};
    // One token, 2 experts: [row0, row1, e0, e1, n].
    let good = [3, 1, 0, 1, 2];
    let view = RowIdMapRef::routes_only(1, 2, &good, 4).unwrap();
    assert!(!view.has_chunks());
    let with = RowIdMapRef::new(1, 2, &good, &[1, 1], &[3, 1, 4], 4);
    assert!(with.is_err(), "expert 0's chunk [3, 1) is not valid");
    let chunked = RowIdMapRef::new(1, 2, &[0, 1, 0, 1, 2], &[1, 1], &[0, 1, 2], 2).unwrap();
    assert!(chunked.has_chunks());
    for (map, want) in [
        ([3, 1, 0, 1, -1], "has -1 routes"),
        ([3, 1, 0, 1, 3], "has 3 routes"),
        ([-1, 1, 0, 1, 2], "is (row -1, expert 0)"),
        ([4, 1, 0, 1, 2], "is (row 4, expert 0)"),
        ([3, 1, -1, 1, 2], "is (row 3, expert -1)"),
        ([3, 1, 0, 2, 2], "is (row 1, expert 2)"),
    ] {
        match RowIdMapRef::routes_only(1, 2, &map, 4) {
            Err(PermuteError::Shape(m)) => assert!(m.contains(want), "{map:?}: {m}"),
            other => panic!("{map:?}: {other:?}"),
        }
    }
    // Output rows up to i32::MAX fit the map, whichever option sets them.
    let max = i32::MAX as usize;
    let capped = RowIdMapOptions {
        num_out_tokens: Some(max),
        ..RowIdMapOptions::default()
    };
    assert_eq!(
        make_row_id_map(&[1, 1], 1, 2, capped).unwrap().out_rows,
        max
    );
    let over = RowIdMapOptions {
        num_out_tokens: Some(max + 1),
        ..RowIdMapOptions::default()
    };
    assert!(make_row_id_map(&[1, 1], 1, 2, over).is_err());
    let one_group = RowIdMapOptions {
        groups: Some(ExpertGroups {
            experts: 2,
            rows: max,
        }),
        ..RowIdMapOptions::default()
    };
    assert_eq!(
        make_row_id_map(&[1, 1], 1, 2, one_group).unwrap().out_rows,
        max
    );
}
