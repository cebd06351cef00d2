//! The raw-address entry points on Host: every op x every (input, output)
//! pair made to overlap is refused with both names and nothing written;
//! every pair of outputs likewise; in-place variants give the out-of-place
//! result; NULL and misaligned tensors get their own errors.

use std::collections::HashMap;

use xcall_core::testing::XorShift;
use xcall_core::{DType, Status};
use xcall_permute::call::{
    self, MakeChunkSortMapArgs, MakeRowIdMapArgs, PermuteArgs, SortChunksArgs, Target, Tensor,
    UnpermuteArgs, UnpermuteBackwardArgs,
};
use xcall_permute::chunks::Direction;
use xcall_permute::{PermuteError, RowIdMapOptions};

const T: u64 = 40;
const E: u64 = 5;
const H: u64 = 12;

/// Every buffer of every op, by name, 8-byte aligned and filled with
/// random bytes (valid where an op reads indices).
struct Buffers(HashMap<&'static str, (Vec<u64>, DType, Vec<u64>)>);

impl Buffers {
    fn new() -> Self {
        let mut g = XorShift::new(3);
        let mut b = Buffers(HashMap::new());
        let routing: Vec<u8> = (0..T * E).map(|_| (g.next_u64() % 3 == 0) as u8).collect();
        let map = xcall_permute::make_row_id_map(
            &routing,
            T as usize,
            E as usize,
            RowIdMapOptions::default(),
        )
        .unwrap();
        let n = map.out_rows as u64;
        let mut add = |name, dtype: DType, dims: &[u64], bytes: Option<Vec<u8>>| {
            let len = dims.iter().product::<u64>() as usize * dtype.size_bytes();
            let mut words = vec![0u64; len.div_ceil(8).max(1)];
            let data =
                bytes.unwrap_or_else(|| (0..len).map(|_| (g.next_u64() & 0x3f) as u8).collect());
            // SAFETY: `words` holds at least `len` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), words.as_mut_ptr().cast::<u8>(), len)
            };
            b.0.insert(name, (words, dtype, dims.to_vec()));
        };
        let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let i64b = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        add("routing", DType::U8, &[T, E], Some(routing.clone()));
        add(
            "row_id_map",
            DType::I32,
            &[T, 2 * E + 1],
            Some(i32b(&map.map)),
        );
        add(
            "tokens_per_expert",
            DType::I64,
            &[E],
            Some(i64b(&map.tokens_per_expert)),
        );
        add(
            "expert_offsets",
            DType::I64,
            &[E + 1],
            Some(i64b(&map.expert_offsets)),
        );
        add("map_out", DType::I32, &[T, 2 * E + 1], None);
        add("tpe_out", DType::I64, &[E], None);
        add("offsets_out", DType::I64, &[E + 1], None);
        add("input", DType::F32, &[T, H], None);
        add("probs", DType::F32, &[T, E], None);
        add("scales", DType::F32, &[T, 2], None);
        add("output", DType::F32, &[n, H], None);
        add("permuted_probs", DType::F32, &[n], None);
        add("permuted_scales", DType::F32, &[n, 2], None);
        add("back", DType::F32, &[T, H], None);
        add("unpermuted_probs", DType::F32, &[T, E], None);
        add("probs_grad", DType::F32, &[T, E], None);
        add("act_grad", DType::F32, &[n, H], None);
        add("split_sizes", DType::I64, &[4], Some(i64b(&[10, 5, 0, 20])));
        add(
            "sorted_indices",
            DType::I64,
            &[4],
            Some(i64b(&[3, 1, 0, 2])),
        );
        let chunk_map =
            xcall_permute::chunks::make_chunk_sort_map(&[10, 5, 0, 20], &[3, 1, 0, 2], T as usize)
                .unwrap();
        add("chunk_map", DType::I64, &[T], Some(i64b(&chunk_map)));
        add("chunk_map_out", DType::I64, &[T], None);
        add("sorted", DType::F32, &[T, H], None);
        add("sorted_probs", DType::F32, &[T], None);
        add("row_probs", DType::F32, &[T], None);
        b
    }

    fn tensor(&self, name: &str, moved: &HashMap<&str, u64>) -> Tensor {
        let (words, dtype, dims) = &self.0[name];
        let address = moved.get(name).copied().unwrap_or(words.as_ptr() as u64);
        Tensor::new(address, *dtype, dims)
    }

    fn address(&self, name: &str) -> u64 {
        self.0[name].0.as_ptr() as u64
    }

    fn snapshot(&self) -> HashMap<&'static str, Vec<u64>> {
        self.0.iter().map(|(k, v)| (*k, v.0.clone())).collect()
    }
}

type Runner = fn(&Buffers, &HashMap<&str, u64>) -> Result<(), PermuteError>;

/// (op, inputs, outputs, runner); output names are the buffers' names.
fn ops() -> Vec<(&'static str, Vec<&'static str>, Vec<&'static str>, Runner)> {
    vec![
        (
            "make_row_id_map",
            vec!["routing"],
            vec!["map_out", "tpe_out", "offsets_out"],
            // SAFETY: (every runner) tensors over live vectors of their sizes.
            |b, m| unsafe {
                call::make_row_id_map(
                    &Target::host(),
                    &MakeRowIdMapArgs {
                        routing: b.tensor("routing", m),
                        options: RowIdMapOptions::default(),
                        row_id_map: b.tensor("map_out", m),
                        tokens_per_expert: b.tensor("tpe_out", m),
                        expert_offsets: b.tensor("offsets_out", m),
                    },
                )
            },
        ),
        (
            "permute",
            vec![
                "input",
                "row_id_map",
                "tokens_per_expert",
                "expert_offsets",
                "probs",
                "scales",
            ],
            vec!["output", "permuted_probs", "permuted_scales"],
            // SAFETY: as the first runner.
            |b, m| unsafe {
                call::permute(
                    &Target::host(),
                    &PermuteArgs {
                        input: b.tensor("input", m),
                        row_id_map: b.tensor("row_id_map", m),
                        tokens_per_expert: b.tensor("tokens_per_expert", m),
                        expert_offsets: b.tensor("expert_offsets", m),
                        probs: Some(b.tensor("probs", m)),
                        scales: Some(b.tensor("scales", m)),
                        output: b.tensor("output", m),
                        permuted_probs: Some(b.tensor("permuted_probs", m)),
                        permuted_scales: Some(b.tensor("permuted_scales", m)),
                        in_place: false,
                        output_segments: None,
                    },
                )
            },
        ),
        (
            "unpermute",
            vec!["output", "row_id_map", "probs", "permuted_probs"],
            vec!["back", "unpermuted_probs"],
            // SAFETY: as the first runner.
            |b, m| unsafe {
                call::unpermute(
                    &Target::host(),
                    &UnpermuteArgs {
                        input: b.tensor("output", m),
                        row_id_map: b.tensor("row_id_map", m),
                        merging_probs: Some(b.tensor("probs", m)),
                        permuted_probs: Some(b.tensor("permuted_probs", m)),
                        output: b.tensor("back", m),
                        unpermuted_probs: Some(b.tensor("unpermuted_probs", m)),
                        input_segments: None,
                    },
                )
            },
        ),
        (
            "unpermute_backward",
            vec![
                "input",
                "output",
                "row_id_map",
                "tokens_per_expert",
                "expert_offsets",
                "probs",
            ],
            vec!["act_grad", "probs_grad"],
            // SAFETY: as the first runner.
            |b, m| unsafe {
                call::unpermute_backward(
                    &Target::host(),
                    &UnpermuteBackwardArgs {
                        grad: b.tensor("input", m),
                        fwd_input: b.tensor("output", m),
                        row_id_map: b.tensor("row_id_map", m),
                        tokens_per_expert: b.tensor("tokens_per_expert", m),
                        expert_offsets: b.tensor("expert_offsets", m),
                        merging_probs: b.tensor("probs", m),
                        act_grad: b.tensor("act_grad", m),
                        probs_grad: b.tensor("probs_grad", m),
                    },
                )
            },
        ),
        (
            "make_chunk_sort_map",
            vec!["split_sizes", "sorted_indices"],
            vec!["chunk_map_out"],
            // SAFETY: as the first runner.
            |b, m| unsafe {
                call::make_chunk_sort_map(
                    &Target::host(),
                    &MakeChunkSortMapArgs {
                        split_sizes: b.tensor("split_sizes", m),
                        sorted_indices: b.tensor("sorted_indices", m),
                        map: b.tensor("chunk_map_out", m),
                    },
                )
            },
        ),
        (
            "sort_chunks_by_map",
            vec!["input", "chunk_map", "row_probs"],
            vec!["sorted", "sorted_probs"],
            // SAFETY: as the first runner.
            |b, m| unsafe {
                call::sort_chunks_by_map(
                    &Target::host(),
                    &SortChunksArgs {
                        input: b.tensor("input", m),
                        map: b.tensor("chunk_map", m),
                        probs: Some(b.tensor("row_probs", m)),
                        direction: Direction::Forward,
                        output: b.tensor("sorted", m),
                        permuted_probs: Some(b.tensor("sorted_probs", m)),
                        in_place: false,
                    },
                )
            },
        ),
    ]
}

#[test]
fn every_overlap_of_every_op_is_refused_and_nothing_is_written() {
    let b = Buffers::new();
    let mut refusals = 0;
    for (op, inputs, outputs, run) in ops() {
        run(&b, &HashMap::new()).unwrap_or_else(|e| panic!("{op}: valid call failed: {e}"));
        let before = b.snapshot();
        for &out in &outputs {
            for &inp in &inputs {
                let moved = HashMap::from([(out, b.address(inp))]);
                let err = run(&b, &moved).unwrap_err();
                assert_eq!(
                    err.status(),
                    Status::Aliased,
                    "{op}: {out} over {inp}: {err}"
                );
                let msg = err.to_string();
                // A large output moved onto a small input may also cover its
                // neighbours in memory; the first overlap found is named.
                assert!(
                    msg.starts_with(&format!("{} overlaps ", display(op, out))),
                    "{op}: {msg}"
                );
                refusals += 1;
            }
            for &other in outputs.iter().filter(|&&o| o != out) {
                let moved = HashMap::from([(out, b.address(other))]);
                let err = run(&b, &moved).unwrap_err();
                assert_eq!(
                    err.status(),
                    Status::Aliased,
                    "{op}: {out} over {other}: {err}"
                );
                refusals += 1;
            }
        }
        assert!(b.snapshot() == before, "{op}: a refused call wrote");
    }
    assert!(refusals >= 40, "{refusals}");
}

/// The name an op's message uses for a buffer of this test.
fn display(op: &str, buffer: &str) -> String {
    match (op, buffer) {
        ("unpermute", "output") => "input".into(),
        ("unpermute_backward", "input") => "grad".into(),
        ("unpermute_backward", "output") => "fwd_input".into(),
        ("unpermute_backward", "probs") => "merging_probs".into(),
        ("unpermute", "probs") => "merging_probs".into(),
        ("sort_chunks_by_map", "chunk_map") => "map".into(),
        ("sort_chunks_by_map", "row_probs") => "probs".into(),
        (_, "map_out") => "row_id_map".into(),
        (_, "tpe_out") => "tokens_per_expert".into(),
        (_, "offsets_out") => "expert_offsets".into(),
        (_, "chunk_map_out") => "map".into(),
        (_, "back") | (_, "sorted") => "output".into(),
        (_, "sorted_probs") => "permuted_probs".into(),
        _ => buffer.into(),
    }
}

#[test]
fn null_misaligned_and_foreign_shapes_have_their_own_errors() {
    let b = Buffers::new();
    let run = |moved: HashMap<&str, u64>| unsafe {
        // SAFETY: refused before anything is read or written.
        call::sort_chunks_by_map(
            &Target::host(),
            &SortChunksArgs {
                input: b.tensor("input", &moved),
                map: b.tensor("chunk_map", &moved),
                probs: None,
                direction: Direction::Backward,
                output: b.tensor("sorted", &moved),
                permuted_probs: None,
                in_place: false,
            },
        )
    };
    let err = run(HashMap::from([("input", 0)])).unwrap_err();
    assert_eq!(err.status(), Status::NullArgument, "{err}");
    let err = run(HashMap::from([("chunk_map", b.address("chunk_map") + 4)])).unwrap_err();
    assert!(err.to_string().contains("not aligned"), "{err}");
    // A 3-D input.
    let mut bad = b.tensor("input", &HashMap::new());
    bad.dims = vec![T, H, 1];
    // SAFETY: refused before anything is read or written.
    let err = unsafe {
        call::sort_chunks_by_map(
            &Target::host(),
            &SortChunksArgs {
                input: bad,
                map: b.tensor("chunk_map", &HashMap::new()),
                probs: None,
                direction: Direction::Forward,
                output: b.tensor("sorted", &HashMap::new()),
                permuted_probs: None,
                in_place: false,
            },
        )
    }
    .unwrap_err();
    assert!(err.to_string().contains("rank 3"), "{err}");
}

#[test]
fn in_place_sort_equals_out_of_place_on_host() {
    let b = Buffers::new();
    let none = HashMap::new();
    for direction in [Direction::Forward, Direction::Backward] {
        let mut want = vec![0u64; (T * H) as usize / 2];
        let mut data: Vec<u64> = b.0["input"].0.clone();
        let out = Tensor::new(want.as_mut_ptr() as u64, DType::F32, &[T, H]);
        let inplace = Tensor::new(data.as_mut_ptr() as u64, DType::F32, &[T, H]);
        // SAFETY: tensors over live vectors of their sizes.
        unsafe {
            let args = |input: Tensor, output: Tensor, in_place| SortChunksArgs {
                input,
                map: b.tensor("chunk_map", &none),
                probs: None,
                direction,
                output,
                permuted_probs: None,
                in_place,
            };
            call::sort_chunks_by_map(&Target::host(), &args(b.tensor("input", &none), out, false))
                .unwrap();
            call::sort_chunks_by_map(&Target::host(), &args(inplace.clone(), inplace, true))
                .unwrap();
        }
        assert_eq!(data, want, "{direction:?}");
    }
}

/// `permute` with each output laid over the input it comes from (the
/// rows, probs and scales each in one buffer, long enough for the larger
/// of the two): with `in_place` it gives the out-of-place result; without,
/// it is refused as an alias and the buffers are left as they were.
#[test]
fn in_place_permute_equals_out_of_place_on_host() {
    let b = Buffers::new();
    let none = HashMap::new();
    let n = b.0["output"].2[0];
    let words = |name: &str| b.0[name].0.clone();
    let dims = |name: &str| b.0[name].2.clone();
    // The out-of-place result, into fresh outputs.
    let mut want = [
        vec![0u64; (n * H) as usize / 2],
        vec![0u64; n.div_ceil(2) as usize],
        vec![0u64; n as usize],
    ];
    // Each input's bytes at the start of a buffer its output fits too.
    let over = |name: &str, out: &[u64]| {
        let mut v = words(name);
        v.resize(v.len().max(out.len()), 0);
        v
    };
    let mut shared = [
        over("input", &want[0]),
        over("probs", &want[1]),
        over("scales", &want[2]),
    ];
    let at = |v: &mut Vec<u64>, name: &str, d: &[u64]| {
        Tensor::new(v.as_mut_ptr() as u64, b.0[name].1, d)
    };
    let args = |ins: [Tensor; 3], outs: [Tensor; 3], in_place| PermuteArgs {
        input: ins[0].clone(),
        row_id_map: b.tensor("row_id_map", &none),
        tokens_per_expert: b.tensor("tokens_per_expert", &none),
        expert_offsets: b.tensor("expert_offsets", &none),
        probs: Some(ins[1].clone()),
        scales: Some(ins[2].clone()),
        output: outs[0].clone(),
        permuted_probs: Some(outs[1].clone()),
        permuted_scales: Some(outs[2].clone()),
        in_place,
        output_segments: None,
    };
    let [w0, w1, w2] = &mut want;
    let outs = [
        at(w0, "output", &dims("output")),
        at(w1, "permuted_probs", &dims("permuted_probs")),
        at(w2, "permuted_scales", &dims("permuted_scales")),
    ];
    let [s0, s1, s2] = &mut shared;
    let ins = [
        at(s0, "input", &dims("input")),
        at(s1, "probs", &dims("probs")),
        at(s2, "scales", &dims("scales")),
    ];
    let overlaid = [
        at(s0, "output", &dims("output")),
        at(s1, "permuted_probs", &dims("permuted_probs")),
        at(s2, "permuted_scales", &dims("permuted_scales")),
    ];
    let before = shared.clone();
    // SAFETY: tensors over live vectors of their sizes.
    let refused =
        unsafe { call::permute(&Target::host(), &args(ins.clone(), overlaid.clone(), false)) };
    assert!(
        matches!(refused, Err(PermuteError::Aliased { .. })),
        "{refused:?}"
    );
    assert_eq!(shared, before, "a refused call wrote");
    // SAFETY: as above.
    unsafe {
        call::permute(
            &Target::host(),
            &args(
                [
                    b.tensor("input", &none),
                    b.tensor("probs", &none),
                    b.tensor("scales", &none),
                ],
                outs,
                false,
            ),
        )
        .unwrap();
        call::permute(&Target::host(), &args(ins, overlaid, true)).unwrap();
    }
    for (i, (got, want)) in shared.iter().zip(&want).enumerate() {
        assert_eq!(&got[..want.len()], &want[..], "output {i}");
    }
}
