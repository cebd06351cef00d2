//! Segmented tensors on Host: `permute` writing its rows into segments
//! (separate allocations, as one per destination PE) and `unpermute`
//! reading its rows from them, against a reference that walks the row-id
//! map's flat entries; every refusal names its cause and writes nothing.

use xcall_core::testing::XorShift;
use xcall_core::{DType, FloatCodec, Status};
use xcall_permute::call::{self, PermuteArgs, Segments, Target, Tensor, UnpermuteArgs};
use xcall_permute::{ExpertGroups, PermuteError, RowIdMap, RowIdMapOptions};

/// Poison of rows no route writes: a bf16 NaN pattern.
const POISON: u8 = 0xff;

/// A routed layer: `t` tokens of `h` bf16 values, top-`k` over `e`
/// experts, and the row-id map of `s` groups of `rows` rows each (one
/// group per segment: the layout of a MoE layer over `s` PEs).
struct Case {
    t: usize,
    e: usize,
    h: usize,
    s: usize,
    rows: usize,
    x: Vec<u8>,
    probs: Vec<f32>,
    map: RowIdMap,
}

impl Case {
    fn new(seed: u64, (t, e, k, h): (usize, usize, usize, usize), s: usize, rows: usize) -> Case {
        let mut g = XorShift::new(seed);
        let routing = g.top_k_routing(t, e, k);
        let options = RowIdMapOptions {
            groups: Some(ExpertGroups {
                experts: e / s,
                rows,
            }),
            ..RowIdMapOptions::default()
        };
        let map = xcall_permute::make_row_id_map(&routing, t, e, options).unwrap();
        assert_eq!(map.out_rows, s * rows);
        let codec = FloatCodec::new(DType::Bf16).unwrap();
        let values: Vec<f32> = (0..t * h).map(|_| g.next_f32() * 4.0 - 2.0).collect();
        let mut x = vec![0u8; t * h * 2];
        codec.store_slice(&mut x, 0, &values);
        let probs = (0..t * e).map(|_| g.next_f32()).collect();
        Case {
            t,
            e,
            h,
            s,
            rows,
            x,
            probs,
            map,
        }
    }

    fn row(&self) -> usize {
        self.h * 2
    }

    /// `(token, destination row, expert)` of every route, read from the
    /// map's flat `[T, 2E + 1]` entries.
    fn routes(&self) -> Vec<(usize, usize, usize)> {
        let w = 2 * self.e + 1;
        let mut v = Vec::new();
        for t in 0..self.t {
            let m = &self.map.map[t * w..(t + 1) * w];
            for k in 0..m[2 * self.e] as usize {
                v.push((t, m[k] as usize, m[self.e + k] as usize));
            }
        }
        v
    }

    fn tensor<T>(&self, data: &[T], dtype: DType, dims: &[usize]) -> Tensor {
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        Tensor::of(data, dtype, &dims)
    }

    fn permute_args(&self, segs: &mut [Vec<u8>]) -> PermuteArgs {
        let bases: Vec<u64> = segs.iter_mut().map(|s| s.as_mut_ptr() as u64).collect();
        PermuteArgs {
            input: self.tensor(&self.x, DType::Bf16, &[self.t, self.h]),
            row_id_map: self.tensor(&self.map.map, DType::I32, &[self.t, 2 * self.e + 1]),
            tokens_per_expert: self.tensor(&self.map.tokens_per_expert, DType::I64, &[self.e]),
            expert_offsets: self.tensor(&self.map.expert_offsets, DType::I64, &[self.e + 1]),
            probs: None,
            scales: None,
            output: Tensor::new(
                bases[0],
                DType::Bf16,
                &[(self.s * self.rows) as u64, self.h as u64],
            ),
            permuted_probs: None,
            permuted_scales: None,
            in_place: false,
            output_segments: Some(Segments {
                bases,
                rows: self.rows as u64,
            }),
        }
    }

    fn unpermute_args(&self, segs: &[Vec<u8>], y: &mut [u8]) -> UnpermuteArgs {
        let bases: Vec<u64> = segs.iter().map(|s| s.as_ptr() as u64).collect();
        UnpermuteArgs {
            input: Tensor::new(
                bases[0],
                DType::Bf16,
                &[(self.s * self.rows) as u64, self.h as u64],
            ),
            row_id_map: self.tensor(&self.map.map, DType::I32, &[self.t, 2 * self.e + 1]),
            merging_probs: Some(self.tensor(&self.probs, DType::F32, &[self.t, self.e])),
            permuted_probs: None,
            output: Tensor::new(
                y.as_mut_ptr() as u64,
                DType::Bf16,
                &[self.t as u64, self.h as u64],
            ),
            unpermuted_probs: None,
            input_segments: Some(Segments {
                bases,
                rows: self.rows as u64,
            }),
        }
    }

    fn poisoned_segments(&self) -> Vec<Vec<u8>> {
        (0..self.s)
            .map(|_| vec![POISON; self.rows * self.row()])
            .collect()
    }
}

fn permute(a: &PermuteArgs) -> Result<(), PermuteError> {
    // SAFETY: every tensor and segment is a live host vector of its size.
    unsafe { call::permute(&Target::host(), a) }
}

fn unpermute(a: &UnpermuteArgs) -> Result<(), PermuteError> {
    // SAFETY: as in `permute`.
    unsafe { call::unpermute(&Target::host(), a) }
}

#[test]
fn permute_writes_each_route_into_its_segment_and_leaves_the_other_rows() {
    // (T, E, k, H), segments, rows per segment: k below and above the
    // experts per segment, a segment too small for its routes (dropped).
    for (seed, shape, s, rows) in [
        (1, (37, 8, 2, 24), 4, 40),
        (2, (50, 6, 4, 8), 3, 70),
        (3, (64, 16, 3, 16), 2, 30),
        (4, (20, 4, 4, 40), 1, 80),
    ] {
        let c = Case::new(seed, shape, s, rows);
        let mut segs = c.poisoned_segments();
        let args = c.permute_args(&mut segs);
        permute(&args).unwrap();
        let mut want = c.poisoned_segments();
        let row = c.row();
        let routes = c.routes();
        assert!(!routes.is_empty());
        for &(t, dst, _) in &routes {
            let (g, at) = (dst / rows, dst % rows);
            want[g][at * row..(at + 1) * row].copy_from_slice(&c.x[t * row..(t + 1) * row]);
        }
        for (g, (got, want)) in segs.iter_mut().zip(&want).enumerate() {
            assert!(
                got == want,
                "seed {seed}: segment {g} differs from the reference"
            );
        }
    }
}

#[test]
fn unpermute_from_segments_equals_unpermute_of_the_joined_rows() {
    for (seed, shape, s, rows) in [(5, (37, 8, 2, 24), 4, 40), (6, (50, 6, 4, 8), 3, 70)] {
        let c = Case::new(seed, shape, s, rows);
        let mut segs = c.poisoned_segments();
        permute(&c.permute_args(&mut segs)).unwrap();
        let mut y = vec![0u8; c.t * c.row()];
        unpermute(&c.unpermute_args(&segs, &mut y)).unwrap();
        // The reference: every route's row in f32, weighted and summed in
        // route order, rounded to bf16 once.
        let codec = FloatCodec::new(DType::Bf16).unwrap();
        let joined: Vec<u8> = segs.concat();
        let mut want = vec![0u8; y.len()];
        let mut x = vec![0f32; c.h];
        for t in 0..c.t {
            let mut acc = vec![0f32; c.h];
            for &(_, dst, e) in c.routes().iter().filter(|r| r.0 == t) {
                codec.load_slice(&joined, dst * c.h, &mut x);
                let w = c.probs[t * c.e + e];
                for (a, v) in acc.iter_mut().zip(&x) {
                    *a += v * w;
                }
            }
            codec.store_slice(&mut want, t * c.h, &acc);
        }
        assert!(y == want, "seed {seed}: unpermute from segments differs");
    }
}

/// Runs `bad(args)` and expects a refusal of `status` whose message holds
/// `says`, with no segment written.
fn refused(c: &Case, says: &str, status: Status, bad: impl Fn(&mut PermuteArgs, &[Vec<u8>])) {
    let mut segs = c.poisoned_segments();
    let mut args = c.permute_args(&mut segs);
    bad(&mut args, &segs);
    let e = permute(&args).expect_err(says);
    assert_eq!(e.status(), status, "{says}: {e}");
    assert!(e.to_string().contains(says), "{says}: {e}");
    for s in &segs {
        assert!(
            s.iter().all(|&b| b == POISON),
            "{says}: a segment was written"
        );
    }
}

#[test]
fn bad_segments_are_refused_by_cause_and_nothing_is_written() {
    let c = Case::new(7, (16, 4, 2, 8), 2, 24);
    let invalid = Status::InvalidArgument;
    refused(&c, "0 bases, expected 1 to 32", invalid, |a, _| {
        a.output_segments.as_mut().unwrap().bases.clear()
    });
    refused(&c, "33 bases, expected 1 to 32", invalid, |a, _| {
        let s = a.output_segments.as_mut().unwrap();
        s.bases = vec![s.bases[0]; 33];
    });
    refused(&c, "is not output's address", invalid, |a, _| {
        a.output.address += 16
    });
    refused(
        &c,
        "2 segments of 23 rows do not make output's 48 rows",
        invalid,
        |a, _| a.output_segments.as_mut().unwrap().rows = 23,
    );
    refused(&c, "2 segments of 0 rows", invalid, |a, _| {
        a.output_segments.as_mut().unwrap().rows = 0
    });
    refused(
        &c,
        "output segment 1 is NULL",
        Status::NullArgument,
        |a, _| a.output_segments.as_mut().unwrap().bases[1] = 0,
    );
    refused(&c, "output segment 1 address", invalid, |a, _| {
        a.output_segments.as_mut().unwrap().bases[1] += 1
    });
    refused(&c, "overflows the address space", invalid, |a, _| {
        a.output_segments.as_mut().unwrap().bases[1] = u64::MAX - 7
    });
    // Segments overlapping each other, or the input.
    refused(&c, "output segment 1", Status::Aliased, |a, segs| {
        a.output_segments.as_mut().unwrap().bases[1] = segs[0].as_ptr() as u64 + 64
    });
    refused(&c, "input", Status::Aliased, |a, _| {
        a.output_segments.as_mut().unwrap().bases[1] = a.input.address
    });
    // What a segmented permute does not take.
    let probs = vec![0.5f32; 16 * 4];
    let pp = vec![0f32; 48];
    refused(&c, "not permuted_probs", Status::Unsupported, |a, _| {
        a.probs = Some(Tensor::of(&probs, DType::F32, &[16, 4]));
        a.permuted_probs = Some(Tensor::of(&pp, DType::F32, &[48]));
    });
    refused(&c, "not in_place", Status::Unsupported, |a, _| {
        a.in_place = true
    });
}

#[test]
fn unpermute_refuses_bad_segments_and_permuted_probs() {
    let c = Case::new(8, (16, 4, 2, 8), 2, 24);
    let segs = c.poisoned_segments();
    let mut y = vec![POISON; c.t * c.row()];
    let y_addr = y.as_mut_ptr() as u64;
    let run = |bad: &dyn Fn(&mut UnpermuteArgs)| {
        let mut a = c.unpermute_args(&segs, &mut []);
        a.output.address = y_addr;
        bad(&mut a);
        unpermute(&a).unwrap_err()
    };
    let e = run(&|a| a.input_segments.as_mut().unwrap().rows = 25);
    assert!(
        e.to_string()
            .contains("input segments: 2 segments of 25 rows"),
        "{e}"
    );
    let e = run(&|a| a.input_segments.as_mut().unwrap().bases[1] = 0);
    assert_eq!(e.status(), Status::NullArgument, "{e}");
    // An input segment over the output.
    let e = run(&|a| a.input_segments.as_mut().unwrap().bases[1] = y_addr);
    assert_eq!(e.status(), Status::Aliased, "{e}");
    assert!(e.to_string().contains("input segment 1"), "{e}");
    let pp = vec![0f32; 48];
    let up = vec![0f32; 16 * 4];
    let e = run(&|a| {
        a.permuted_probs = Some(Tensor::of(&pp, DType::F32, &[48]));
        a.unpermuted_probs = Some(Tensor::of(&up, DType::F32, &[16, 4]));
    });
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(y.iter().all(|&b| b == POISON), "a refused call wrote y");
}

/// The argument check alone, before any platform: a CUDA target on a
/// machine with or without CUDA. Overlapping segments are refused there
/// (the Host op's own check comes later and a CUDA launch has none);
/// exactly 32 segments pass it; a segment whose rows (rows x row bytes)
/// run past the address space is refused even when rows + row bytes would
/// not.
#[test]
fn the_argument_check_alone_refuses_overlaps_and_bounds_segments() {
    // A stream that is never used: every call here fails its check.
    let cuda = Target::cuda(0, std::ptr::dangling_mut::<u8>().cast());
    let checked = |a: &PermuteArgs| {
        // SAFETY: the call is refused by its argument check, before any
        // tensor is touched or any CUDA call is made.
        unsafe { call::permute(&cuda, a) }.expect_err("refused by the check")
    };
    let c = Case::new(9, (16, 4, 2, 8), 2, 24);
    let mut segs = c.poisoned_segments();
    let first = segs[0].as_ptr() as u64;
    let mut a = c.permute_args(&mut segs);
    a.output_segments.as_mut().unwrap().bases[1] = first + 64;
    let e = checked(&a);
    assert_eq!(e.status(), Status::Aliased, "{e}");
    assert!(e.to_string().contains("output segment 1"), "{e}");
    let input = a.input.address;
    a.output_segments.as_mut().unwrap().bases[1] = input;
    assert_eq!(checked(&a).status(), Status::Aliased);

    // 32 segments of one row each, past the check; then past the end of
    // the address space by their bytes (2 rows x 16 bytes), not by
    // rows + bytes.
    let c = Case::new(10, (16, 32, 2, 8), 32, 1);
    let mut segs = c.poisoned_segments();
    permute(&c.permute_args(&mut segs)).unwrap();
    let c = Case::new(11, (16, 4, 2, 8), 2, 2);
    let mut segs = c.poisoned_segments();
    let mut a = c.permute_args(&mut segs);
    let bytes = (2 * c.row()) as u64;
    a.output_segments.as_mut().unwrap().bases[1] = (u64::MAX - bytes + 1) & !7;
    let e = checked(&a);
    assert!(e.to_string().contains("overflows the address space"), "{e}");
}

/// The Host ops called directly (the public `ops` functions, with no
/// argument check in front): a segmented permute refuses probs and
/// scales each on its own; a segmented unpermute refuses a non-empty
/// dense input and permuted probs each on its own; a dense unpermute of
/// the wrong length names "input (bytes)", not a segment. Nothing is
/// written.
#[test]
fn the_host_ops_refuse_what_segments_do_not_take() {
    use xcall_permute::ops::{self, PermuteInputs, UnpermuteInputs, UnpermuteOutputs};
    let c = Case::new(12, (16, 4, 2, 8), 2, 24);
    let probs = vec![0.5f32; c.t * c.e];
    let scales = vec![1.0f32; c.t];
    let mut segs = c.poisoned_segments();
    for (p, s) in [(Some(&probs[..]), None), (None, Some(&scales[..]))] {
        let mut parts: Vec<&mut [u8]> = segs.iter_mut().map(|s| &mut s[..]).collect();
        let e = ops::permute_segmented(
            c.map.view(),
            &PermuteInputs {
                input: &c.x,
                dtype: DType::Bf16,
                hidden: c.h,
                probs: p,
                scales: s,
            },
            &mut parts,
            c.rows,
        )
        .unwrap_err();
        assert_eq!(e.status(), Status::Unsupported, "{e}");
    }
    assert!(segs.iter().all(|s| s.iter().all(|&b| b == POISON)));
    let parts: Vec<&[u8]> = segs.iter().map(|s| &s[..]).collect();
    let pp = vec![0f32; c.s * c.rows];
    let mut y = vec![POISON; c.t * c.row()];
    for (input, permuted_probs) in [(&c.x[..2], None), (&[][..], Some(&pp[..]))] {
        let e = ops::unpermute_segmented(
            c.map.view(),
            &parts,
            c.rows,
            &UnpermuteInputs {
                input,
                dtype: DType::Bf16,
                hidden: c.h,
                merging_probs: None,
                permuted_probs,
            },
            &mut UnpermuteOutputs {
                output: &mut y,
                unpermuted_probs: None,
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("input must be empty"), "{e}");
    }
    let joined: Vec<u8> = segs.concat();
    let e = ops::unpermute(
        c.map.view(),
        &UnpermuteInputs {
            input: &joined[..joined.len() - 2],
            dtype: DType::Bf16,
            hidden: c.h,
            merging_probs: None,
            permuted_probs: None,
        },
        &mut UnpermuteOutputs {
            output: &mut y,
            unpermuted_probs: None,
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("input (bytes)") && !e.to_string().contains("segment"),
        "{e}"
    );
    assert!(y.iter().all(|&b| b == POISON), "a refused call wrote y");
}
