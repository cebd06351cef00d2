//! The kernels' parameter structs, one per family, written once here: the
//! CUDA C definitions `kernels.cu` uses are generated from them (see
//! [`prelude`]) with `static_assert`s on every size. Every field is 8
//! bytes (pointers, `long long` counts), so no struct has padding.

use xcall_core::cuda::KernelRecord;
use xcall_core::kernel_params;

use crate::args::MAX_SEGMENTS;

// The C array length of the `segs` fields is written out: keep it equal.
const _: () = assert!(MAX_SEGMENTS == 32);

/// The `segs` field of a launch: `bases` then zeros.
pub(super) fn segment_bases(bases: &[u64]) -> [u64; MAX_SEGMENTS] {
    let mut segs = [0u64; MAX_SEGMENTS];
    segs[..bases.len()].copy_from_slice(bases);
    segs
}

kernel_params! {
    /// Building a row-id map from a 0/1 routing map (`rim_count`,
    /// `rim_scan_blocks`, `rim_offsets`, `rim_write`).
    pub(super) struct RowIdMapParams {
        /// `[T, E]` bytes, nonzero where a token routes to an expert.
        routing: u64 => "const unsigned char*",
        /// The `[T, 2E + 1]` map being written.
        map: u64 => "int*",
        /// Per expert: routes counted, then kept.
        tpe: u64 => "i64*",
        /// `E + 1` chunk starts.
        offsets: u64 => "i64*",
        /// Tokens `T`.
        tokens: i64 => "i64",
        /// Experts `E`.
        experts: i64 => "i64",
        /// Tokens per block of the count and write passes.
        block_tokens: i64 => "i64",
        /// Blocks of the count and write passes.
        blocks: i64 => "i64",
        /// Chunk starts are multiples of this.
        align: i64 => "i64",
        /// Rows past this are dropped (`num_out_tokens`).
        cap: i64 => "i64",
        /// Rows per chunk when > 0 (fixed capacity).
        capacity: i64 => "i64",
        /// Experts per group (`E` without groups).
        group_experts: i64 => "i64",
        /// Rows per group, or 0 without groups.
        group_rows: i64 => "i64",
    }
}

kernel_params! {
    /// Checked mode's map check (`rim_check`, `rim_check_counts`).
    pub(super) struct MapCheckParams {
        /// The `[T, 2E + 1]` map.
        map: u64 => "const int*",
        /// Per expert kept routes (NULL: no chunks to check against).
        tpe: u64 => "const i64*",
        /// `E + 1` chunk starts (NULL with `tpe`).
        offsets: u64 => "const i64*",
        /// `N` bits of rows taken (zeroed).
        taken: u64 => "unsigned int*",
        /// `E` route counts (zeroed).
        counts: u64 => "unsigned long long*",
        /// Where faults are recorded.
        word: u64 => "unsigned int*",
        /// Tokens `T`.
        tokens: i64 => "i64",
        /// Experts `E`.
        experts: i64 => "i64",
        /// Output rows `N`.
        out_rows: i64 => "i64",
    }
}

kernel_params! {
    /// `permute` and the zero fill of rows no route writes (`permute_V_U`,
    /// `zero_V`).
    pub(super) struct PermuteParams {
        /// `[T, row]` bytes.
        input: u64 => "const unsigned char*",
        /// The `[T, 2E + 1]` map.
        map: u64 => "const int*",
        /// `[T, E]` probs, or NULL.
        probs: u64 => "const float*",
        /// `[T, S]` scales, or NULL.
        scales: u64 => "const float*",
        /// Per expert kept routes (the zero fill).
        tpe: u64 => "const i64*",
        /// `E + 1` chunk starts (the zero fill).
        offsets: u64 => "const i64*",
        /// `[N, row]` bytes.
        out: u64 => "unsigned char*",
        /// `[N]` permuted probs, or NULL.
        pprobs: u64 => "float*",
        /// `[N, S]` permuted scales, or NULL.
        pscales: u64 => "float*",
        /// Tokens `T`.
        tokens: i64 => "i64",
        /// Experts `E`.
        experts: i64 => "i64",
        /// Bytes per row.
        row: i64 => "i64",
        /// Scales per row `S`.
        nscales: i64 => "i64",
        /// Output rows `N`.
        out_rows: i64 => "i64",
        /// Rows per segment of a segmented `out` (`segs`), or 0: `out`
        /// is dense.
        seg_rows: i64 => "i64",
        /// Bytes of a row one bulk copy moves (`permute_bulk_*`: a multiple
        /// of 16), 0 for the other kernels.
        piece: i64 => "i64",
        /// The segments' bases (the first `N / seg_rows`).
        segs: [u64; MAX_SEGMENTS] => "unsigned char*[32]",
    }
}

kernel_params! {
    /// `sort_chunks_by_map` (`sort_V_U`).
    pub(super) struct SortParams {
        /// `[T, row]` bytes.
        input: u64 => "const unsigned char*",
        /// `[T]` destination (forward) or source (backward) rows.
        map: u64 => "const i64*",
        /// `[T]` probs, or NULL.
        probs: u64 => "const float*",
        /// `[T, row]` bytes.
        out: u64 => "unsigned char*",
        /// `[T]` sorted probs, or NULL.
        pprobs: u64 => "float*",
        /// Rows `T`.
        tokens: i64 => "i64",
        /// Bytes per row.
        row: i64 => "i64",
        /// 1: gather (backward), 0: scatter.
        backward: i64 => "i64",
    }
}

kernel_params! {
    /// `unpermute` and its backward (`unpermute_V_U`, `unpermute_bwd_V_U`).
    pub(super) struct UnpermuteParams {
        /// Forward: `[N, H]` expert outputs. Backward: `[T, H]` gradient.
        input: u64 => "const unsigned char*",
        /// Backward: `[N, H]` forward input; NULL forward.
        fwd: u64 => "const unsigned char*",
        /// The `[T, 2E + 1]` map.
        map: u64 => "const int*",
        /// `[T, E]` merging probs, or NULL (forward only).
        mprobs: u64 => "const float*",
        /// Forward: `[N]` permuted probs, or NULL.
        pprobs: u64 => "const float*",
        /// Forward: `[T, H]`. Backward: `[N, H]` activation gradient.
        out: u64 => "unsigned char*",
        /// Forward: `[T, E]` unpermuted probs, or NULL. Backward: `[T, E]`
        /// probs gradient.
        oprobs: u64 => "float*",
        /// Tokens `T`.
        tokens: i64 => "i64",
        /// Experts `E`.
        experts: i64 => "i64",
        /// Elements per row `H`.
        hidden: i64 => "i64",
        /// Rows `N`.
        out_rows: i64 => "i64",
        /// Rows per segment of a segmented forward `input` (`segs`), or
        /// 0: `input` is dense.
        seg_rows: i64 => "i64",
        /// Backward, warp kernels (`unpermute_bwd_w_*`): warps per token,
        /// route k going to warp k % split (0 counts as 1).
        split: i64 => "i64",
        /// The segments' bases (the first `N / seg_rows`).
        segs: [u64; MAX_SEGMENTS] => "const unsigned char*[32]",
    }
}

kernel_params! {
    /// `make_chunk_sort_map` (`chunk_map`).
    pub(super) struct ChunkMapParams {
        /// `[S]` chunk sizes.
        sizes: u64 => "const i64*",
        /// `[S]` chunk order.
        sorted: u64 => "const i64*",
        /// `[T]` destination rows.
        map: u64 => "i64*",
        /// Chunks `S`.
        chunks: i64 => "i64",
        /// Rows `T`.
        tokens: i64 => "i64",
    }
}

/// The CUDA C definitions of every parameter struct, with their layout
/// assertions: what `kernels.cu` is compiled after.
pub(super) fn prelude() -> String {
    let mut s =
        String::from("// Generated from xcall-permute's cuda/params.rs.\ntypedef long long i64;\n");
    for definition in [
        RowIdMapParams::c_definition(),
        MapCheckParams::c_definition(),
        PermuteParams::c_definition(),
        SortParams::c_definition(),
        UnpermuteParams::c_definition(),
        ChunkMapParams::c_definition(),
    ] {
        s += &definition;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_use_only_fields_their_struct_has() {
        let source = include_str!("../kernels.cu");
        for checked in [
            RowIdMapParams::check_reads(source),
            MapCheckParams::check_reads(source),
            PermuteParams::check_reads(source),
            SortParams::check_reads(source),
            UnpermuteParams::check_reads(source),
            ChunkMapParams::check_reads(source),
        ] {
            assert_eq!(checked, Ok(()), "kernels.cu");
        }
    }

    #[test]
    fn the_prelude_defines_and_checks_every_struct() {
        let text = prelude();
        for name in [
            "RowIdMapParams",
            "MapCheckParams",
            "PermuteParams",
            "SortParams",
            "UnpermuteParams",
            "ChunkMapParams",
        ] {
            assert_eq!(text.matches(&format!("struct {name} {{")).count(), 1);
            assert!(text.contains(&format!("static_assert(sizeof({name}) == ")));
        }
        // 8 bytes a field: PermuteParams has 16, then 32 segment bases.
        assert_eq!(std::mem::size_of::<PermuteParams>(), (16 + 32) * 8);
        assert!(text.contains("    unsigned char* segs[32];\n"));
        assert!(text.contains(
            "static_assert(sizeof(PermuteParams::out_rows) == 8, \"PermuteParams.out_rows (at byte 104)"
        ));
    }
}
