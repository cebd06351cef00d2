//! The one parameter record every step of a call takes, on Host and
//! CUDA alike: the group's shape and layout, then the call's buffers.
//! The Host steps ([`crate::host`]) and the CUDA kernels
//! (`kernels.cu`) read the same fields with the same meaning (`pull`,
//! CUDA's alone, aside).

xcall_core::kernel_params! {
    /// A step of a dispatch, combine or backward call.
    pub struct EpParams {
        /// This PE's group allocation.
        base: u64 => "unsigned char*",
        /// `[P]` u64: the group's allocation as this PE reaches each PE.
        bases: u64 => "const unsigned long long*",
        /// This PE's rank.
        rank: i64 => "long long",
        /// PEs.
        pes: i64 => "long long",
        /// Most tokens per PE (`T`).
        tokens: i64 => "long long",
        /// Elements of a row (`H`).
        hidden: i64 => "long long",
        /// Routes per token (`k`).
        topk: i64 => "long long",
        /// Experts in all (`E`).
        experts: i64 => "long long",
        /// Experts per PE (`L`).
        local_experts: i64 => "long long",
        /// Tiles of [`crate::config::TILE_TOKENS`] tokens per sender.
        tiles_per_pe: i64 => "long long",
        /// Expert groups start at multiples of this many rows.
        align: i64 => "long long",
        /// Rows per local expert at most (0: dropless).
        capacity: i64 => "long long",
        /// 0 f32, 1 bf16, 2 FP8 dispatch (bf16 combine).
        precision: i64 => "long long",
        /// Rows of the caller's expert-major buffer.
        expert_rows: i64 => "long long",
        /// Offset of [`crate::config::Offsets::send`].
        off_send: i64 => "long long",
        /// Offset of [`crate::config::Offsets::send_scales`].
        off_send_scales: i64 => "long long",
        /// Offset of [`crate::config::Offsets::ids`].
        off_ids: i64 => "long long",
        /// Offset of [`crate::config::Offsets::probs`].
        off_probs: i64 => "long long",
        /// Offset of [`crate::config::Offsets::partial`].
        off_partial: i64 => "long long",
        /// Offset of [`crate::config::Offsets::recv`].
        off_recv: i64 => "long long",
        /// Offset of [`crate::config::Offsets::recv_scales`].
        off_recv_scales: i64 => "long long",
        /// Offset of [`crate::config::Offsets::grad_probs`].
        off_grad_probs: i64 => "long long",
        /// Offset of [`crate::config::Offsets::ready`].
        off_ready: i64 => "long long",
        /// Offset of [`crate::config::Offsets::words`].
        off_words: i64 => "long long",
        /// Offset of [`crate::config::Offsets::local`].
        off_local: i64 => "long long",
        /// Offset of [`crate::config::Offsets::recv_probs`].
        off_recv_probs: i64 => "long long",
        /// Offset of [`crate::config::Offsets::route_row`].
        off_route_row: i64 => "long long",
        /// Offset of [`crate::config::Offsets::tile_counts`].
        off_tile_counts: i64 => "long long",
        /// Offset of [`crate::config::Offsets::expert_start`].
        off_expert_start: i64 => "long long",
        /// Offset of [`crate::config::Offsets::sent`].
        off_sent: i64 => "long long",
        /// Offset of [`crate::config::Offsets::ll_rank`].
        off_ll_rank: i64 => "long long",
        /// Tokens of this call on this PE (at most `tokens`).
        n: i64 => "long long",
        /// Rows read: the tokens (dispatch), the output gradient
        /// (`combine_backward`), the experts' outputs (combine) or their
        /// inputs' gradient (`dispatch_backward`).
        src: u64 => "const unsigned char*",
        /// `[n, k]` i32 expert ids (dispatch).
        src_ids: u64 => "const int*",
        /// `[n, k]` f32 probs (dispatch).
        src_probs: u64 => "const float*",
        /// Rows written: the expert-major rows (dispatch, and the experts'
        /// outputs' gradient in `combine_backward`), or `[n, H]` (combine,
        /// `dispatch_backward`).
        out: u64 => "unsigned char*",
        /// FP8: `[rows, H/128]` f32 scales of `out`.
        out_scales: u64 => "float*",
        /// FP8, optional (null: none): bf16 rows dequantized from `out`.
        out_bf16: u64 => "unsigned short*",
        /// `[L]` i64 routes each local expert received (kept).
        tokens_per_expert: u64 => "long long*",
        /// Optional `[L]` i64: rows each expert's group spans (padded).
        padded_per_expert: u64 => "long long*",
        /// Optional `[L + 1]` i64: each expert's first row, then the end.
        expert_offsets: u64 => "long long*",
        /// `combine_backward`: the experts' outputs (for probs' gradient).
        expert_out: u64 => "const unsigned char*",
        /// `combine_backward`: `[n, k]` f32 gradient of the probs.
        grad_probs_out: u64 => "float*",
        /// 1: combine weights by the probs; 0: unweighted.
        weighted: i64 => "long long",
        /// 1: publish quantizes to FP8 (an FP8 group's dispatch).
        wire: i64 => "long long",
        /// 1: dispatch pulls on CUDA ([`crate::EpKernels::Pull`]):
        /// publish copies f32 and bf16 rows into the send buffer, and
        /// copy reads peers' rows from theirs. 2 (publish only): peers
        /// read this PE's f32 or bf16 rows in place, in the caller's
        /// buffer (every PE in one process, the buffer memory of its
        /// device every peer may read): publish copies nothing and says so
        /// in its word `PULL`, which copy reads of every peer.
        pull: i64 => "long long",
        /// How long a wait for a peer lasts.
        timeout_ns: u64 => "unsigned long long",
        /// Blocks of the steps that read peers' memory.
        exchange_blocks: i64 => "long long",
    }
}
