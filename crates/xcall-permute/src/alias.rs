//! Alias tables and the overlap check every call runs before writing.
//!
//! Permutation kernels read row `src` and write row `dst != src` across
//! thread blocks that run in waves, so an output sharing memory with an
//! input is corrupted silently. Every op publishes which
//! (input, output) pairs may alias: for these ops none may. A runtime
//! reads the table to declare its aliases; every call checks its address
//! ranges and refuses an overlap before anything is written.

use crate::error::PermuteError;

/// An op of this crate (`xcall_permute_op` in C). Codes are stable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `make_row_id_map`.
    MakeRowIdMap = 0,
    /// `permute`.
    Permute = 1,
    /// `unpermute`.
    Unpermute = 2,
    /// `unpermute_backward`.
    UnpermuteBackward = 3,
    /// `sort_chunks_by_map`.
    SortChunksByMap = 4,
    /// `make_chunk_sort_map`.
    MakeChunkSortMap = 5,
}

xcall_core::c_enum!(
    Op,
    "permutation op code",
    [
        MakeRowIdMap,
        Permute,
        Unpermute,
        UnpermuteBackward,
        SortChunksByMap,
        MakeChunkSortMap
    ]
);

/// The (input, output) pairs of `op` that may share memory. Empty for every
/// op of this crate: outputs must not overlap inputs or each other.
pub fn alias_table(op: Op) -> &'static [(&'static str, &'static str)] {
    match op {
        Op::MakeRowIdMap
        | Op::Permute
        | Op::Unpermute
        | Op::UnpermuteBackward
        | Op::SortChunksByMap
        | Op::MakeChunkSortMap => &[],
    }
}

/// A named byte range of a call (host or device address space alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region<'a> {
    /// Buffer name, as in the op's signature.
    pub name: &'a str,
    /// First byte.
    pub address: u64,
    /// Length in bytes (0: an empty buffer, overlaps nothing).
    pub bytes: u64,
}

impl<'a> Region<'a> {
    /// The region of a slice.
    pub fn of<T>(name: &'a str, data: &[T]) -> Self {
        Region {
            name,
            address: data.as_ptr() as u64,
            bytes: std::mem::size_of_val(data) as u64,
        }
    }

    fn overlaps(&self, other: &Region<'_>) -> bool {
        let (a, a_end) = (
            self.address as u128,
            self.address as u128 + self.bytes as u128,
        );
        let (b, b_end) = (
            other.address as u128,
            other.address as u128 + other.bytes as u128,
        );
        self.bytes > 0 && other.bytes > 0 && a < b_end && b < a_end
    }
}

/// Refuses any overlap between an output and an input, or between two
/// outputs, unless `allowed` lists the (input, output) pair.
pub fn check(
    inputs: &[Region<'_>],
    outputs: &[Region<'_>],
    allowed: &[(&str, &str)],
) -> Result<(), PermuteError> {
    for (i, out) in outputs.iter().enumerate() {
        for input in inputs {
            if out.overlaps(input) && !allowed.contains(&(input.name, out.name)) {
                return Err(PermuteError::Aliased {
                    output: out.name.into(),
                    other: input.name.into(),
                });
            }
        }
        for other in &outputs[i + 1..] {
            if out.overlaps(other) {
                return Err(PermuteError::Aliased {
                    output: other.name.into(),
                    other: out.name.into(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, address: u64, bytes: u64) -> Region<'_> {
        Region {
            name,
            address,
            bytes,
        }
    }

    #[test]
    fn overlaps_are_refused_with_both_names() {
        let ins = [r("input", 0x1000, 0x100), r("probs", 0x2000, 0x40)];
        let outs = [
            r("output", 0x10f0, 0x100),
            r("permuted_probs", 0x3000, 0x10),
        ];
        let err = check(&ins, &outs, &[]).unwrap_err();
        assert_eq!(
            err,
            PermuteError::Aliased {
                output: "output".into(),
                other: "input".into()
            }
        );
        assert_eq!(err.status(), xcall_core::Status::Aliased);
        assert!(err.to_string().contains("output overlaps input"), "{err}");
        // Adjacent is fine; so is an empty buffer anywhere.
        let outs = [r("output", 0x1100, 0x100), r("permuted_probs", 0x2000, 0)];
        assert!(check(&ins, &outs, &[]).is_ok());
        // Two outputs overlapping each other.
        let outs = [r("output", 0x5000, 0x100), r("permuted_probs", 0x50ff, 4)];
        let err = check(&ins, &outs, &[]).unwrap_err();
        assert_eq!(
            err,
            PermuteError::Aliased {
                output: "permuted_probs".into(),
                other: "output".into()
            }
        );
        // An allowed pair passes.
        let outs = [r("output", 0x1000, 0x100)];
        assert!(check(&ins, &outs, &[("input", "output")]).is_ok());
    }

    #[test]
    fn edges_adjacency_on_either_side_and_empty_buffers_inside_others() {
        let input = r("input", 0x1000, 0x100);
        // Touching at either end is not overlapping; one byte more is.
        for (address, bytes, overlap) in [
            (0x0f00, 0x100, false),
            (0x1100, 0x100, false),
            (0x0f00, 0x101, true),
            (0x10ff, 0x100, true),
        ] {
            let out = r("output", address, bytes);
            assert_eq!(out.overlaps(&input), overlap, "{out:?}");
            assert_eq!(input.overlaps(&out), overlap, "{out:?}");
            assert_eq!(check(&[input], &[out], &[]).is_err(), overlap, "{out:?}");
        }
        // An empty buffer overlaps nothing, even strictly inside another.
        let empty = r("permuted_probs", 0x1080, 0);
        assert!(!empty.overlaps(&input) && !input.overlaps(&empty));
        assert!(check(&[input], &[empty], &[]).is_ok());
        assert!(check(&[r("probs", 0x1080, 0)], &[r("output", 0x1000, 0x100)], &[]).is_ok());
    }

    #[test]
    fn no_op_publishes_an_alias() {
        for op in Op::ALL {
            assert!(alias_table(op).is_empty(), "{op:?}");
        }
    }
}
