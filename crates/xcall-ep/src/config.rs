//! A group's shape ([`EpConfig`]), checked, and the layout of its
//! buffers ([`Layout`]): every size follows from (T, H, k, E, P) and the
//! precision, never from the routing, so a captured step replays for any
//! routing.

use crate::error::{EpError, Result};

/// The largest PE count of a group (the kernels keep a per-PE table in
/// registers and shared memory).
pub const MAX_PES: usize = 64;
/// The most experts on one PE (the layout pass keeps their first rows in
/// shared memory).
pub const MAX_LOCAL_EXPERTS: usize = 4096;
/// The largest top-k.
pub const MAX_TOPK: usize = 32;
/// Elements of a row that share one FP8 scale (the DeepSeek-V3 layout).
pub const FP8_BLOCK: usize = 128;
/// Largest finite e4m3 magnitude: a block's largest magnitude maps to it.
pub const FP8_MAX: f32 = 448.0;
/// The most tokens per PE of a group that may run the low-latency
/// kernels ([`EpKernels::LowLatency`]).
pub const LL_MAX_TOKENS: usize = 1024;
/// The most tokens per PE for which [`EpKernels::Auto`] picks the
/// low-latency kernels (decode).
pub const LL_AUTO_TOKENS: usize = 256;
/// The most experts of a group that may run the low-latency kernels (each
/// block keeps a table of them in shared memory).
pub const LL_MAX_EXPERTS: usize = 2048;
/// Tokens per tile of the layout pass (rows of one sender that one warp
/// of the counting and assigning kernels walks in order).
pub const TILE_TOKENS: usize = 16;

/// What moves, and in which precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 both ways (tests and references).
    F32,
    /// bf16 both ways, f32 accumulation in combine.
    Bf16,
    /// bf16 tokens quantized to FP8 e4m3 on the way out, one f32 scale per
    /// [`FP8_BLOCK`] elements of a row; the receiver gets FP8 rows and
    /// their scales in the expert-major layout (and, if asked, bf16 rows
    /// dequantized from them). Combine is bf16.
    Fp8Dispatch,
}

impl Precision {
    /// Bytes of one element of the tokens the caller hands to dispatch and
    /// of everything combine moves.
    pub fn element_bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 | Precision::Fp8Dispatch => 2,
        }
    }

    /// Bytes of one element as dispatch sends it.
    pub fn wire_bytes(self) -> usize {
        match self {
            Precision::Fp8Dispatch => 1,
            p => p.element_bytes(),
        }
    }

    /// The name flags and reports use: `f32`, `bf16`, `fp8`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Fp8Dispatch => "fp8",
        }
    }

    pub(crate) fn code(self) -> u64 {
        match self {
            Precision::F32 => 0,
            Precision::Bf16 => 1,
            Precision::Fp8Dispatch => 2,
        }
    }
}

/// How many rows each local expert may receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capacity {
    /// Every route lands: the expert-major buffer is sized for the worst
    /// case, `P * T * min(k, L)` rows (plus alignment padding).
    Dropless,
    /// At most this many rows per local expert, taken in (sender rank,
    /// token, top-k slot) order; the rest are dropped, counted in the
    /// group's dropped-route counter, and contribute nothing to combine.
    PerExpert(usize),
}

/// Which CUDA kernels carry a dispatch and a combine. Every choice writes
/// the same bytes; on Host the steps run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EpKernels {
    /// The low-latency kernels for groups of at most [`LL_AUTO_TOKENS`]
    /// tokens per PE, two per SM of the budget, and [`LL_MAX_EXPERTS`]
    /// experts; the steps, dispatch pulling ([`EpKernels::Pull`]),
    /// otherwise.
    #[default]
    Auto,
    /// A kernel per step (publish, push, signal, count, scan, assign,
    /// copy; reduce, signal, gather), dispatch pushing: each PE stores
    /// its tokens into the receive rows of the PEs hosting their experts,
    /// which copy them out to their routes' rows. Dispatch can be split
    /// ([`crate::EpGroup::dispatch_send`]) with the stores in flight
    /// between the halves, and the steps profiled one by one.
    Steps,
    /// One kernel for a whole dispatch and one for a whole combine, one
    /// block per SM of the budget, meeting at grid-wide barriers (every
    /// block resident at once: a device shared with kernels that hold
    /// SMs for long delays them, and an SM limit below the budget times
    /// them out). For at most [`LL_MAX_TOKENS`] tokens per PE and
    /// [`LL_MAX_EXPERTS`] experts. `dispatch_send` and `dispatch_recv`
    /// still run the steps.
    LowLatency,
    /// The steps, but dispatch pulls: each PE publishes its rows in its
    /// send buffer (f32 and bf16: a copy of `x` there, none when `x` is
    /// [`crate::EpGroup::send_rows`], nor where every PE is a thread of
    /// one process and `x` memory of its PE's device that every peer may
    /// read, a plain allocation or a mapping that grants them access,
    /// which peers then read in place), and its copy step reads each
    /// peer's rows from where the peer published them (NVLink loads) as
    /// it writes them to their routes' rows. No PE stores into another's
    /// receive rows: the loads over NVLink overlap the local stores in
    /// one kernel, where pushed the copy waits for every PE's stores. A
    /// dispatch ends with one more phase: no PE returns (and lets its
    /// caller write `x` or publish again) while a peer may still read its
    /// rows.
    /// Combine is that of the steps. Where it pulls, copy keeps to the SM
    /// budget.
    Pull,
}

impl EpKernels {
    /// The name flags and reports use: `auto`, `steps`, `low-latency`,
    /// `pull`.
    pub fn name(self) -> &'static str {
        match self {
            EpKernels::Auto => "auto",
            EpKernels::Steps => "steps",
            EpKernels::LowLatency => "low-latency",
            EpKernels::Pull => "pull",
        }
    }
}

/// The shape of an expert-parallel group; the same on every PE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EpConfig {
    /// Most tokens a PE hands to one dispatch (`T`); a call may pass
    /// fewer.
    pub tokens: usize,
    /// Elements of a token row (`H`).
    pub hidden: usize,
    /// Experts each token is routed to (`k`).
    pub topk: usize,
    /// Experts in all (`E`), `E / P` on each PE: PE `q` hosts experts
    /// `q*L .. (q+1)*L`.
    pub experts: usize,
    /// The precision of the exchange.
    pub precision: Precision,
    /// Each expert's group of rows starts at a multiple of `align` rows of
    /// the expert-major layout (1: packed; 128 suits grouped GEMMs).
    pub align: usize,
    /// Dropless, or a per-expert capacity.
    pub capacity: Capacity,
    /// Streaming multiprocessors the exchange kernels (the ones that read
    /// peers' memory) may occupy on CUDA; 0: as many as help.
    pub num_sms: usize,
    /// Which CUDA kernels run the calls.
    pub kernels: EpKernels,
}

impl EpConfig {
    /// A dropless bf16 group with packed expert groups.
    pub fn new(tokens: usize, hidden: usize, topk: usize, experts: usize) -> EpConfig {
        EpConfig {
            tokens,
            hidden,
            topk,
            experts,
            precision: Precision::Bf16,
            align: 1,
            capacity: Capacity::Dropless,
            num_sms: 0,
            kernels: EpKernels::Auto,
        }
    }

    /// The kernels a CUDA group of this config runs on `pes` PEs with
    /// `sms_used` SMs for the exchange: (the low-latency kernels, dispatch
    /// pulling). Auto takes the low-latency kernels while each block of
    /// the budget sends two tokens at most (they send a block's tokens in
    /// turn: on two H200 at T=128, they paid off from 66 SMs), and pulls
    /// above (on two and four H200 the pulled steps' step was 1.08-1.15x
    /// faster than the pushed ones'). One PE has nothing to pull.
    pub fn cuda_kernels(&self, pes: usize, sms_used: usize) -> (bool, bool) {
        let low_latency = self.low_latency_fits()
            && (self.kernels == EpKernels::LowLatency || self.tokens <= sms_used.saturating_mul(2));
        let pull = pes > 1
            && match self.kernels {
                EpKernels::Pull => true,
                EpKernels::Auto => !low_latency,
                EpKernels::Steps | EpKernels::LowLatency => false,
            };
        (low_latency, pull)
    }

    /// Whether the low-latency kernels may run this group: the chosen
    /// kernels and the group's size (the PE count aside).
    pub fn low_latency_fits(&self) -> bool {
        let limit = match self.kernels {
            EpKernels::Steps | EpKernels::Pull => return false,
            EpKernels::Auto => LL_AUTO_TOKENS,
            EpKernels::LowLatency => LL_MAX_TOKENS,
        };
        self.tokens <= limit && self.experts <= LL_MAX_EXPERTS
    }

    /// The buffers of this group on `pes` PEs, after checking the shape.
    pub fn layout(&self, pes: usize) -> Result<Layout> {
        Layout::new(self, pes)
    }
}

/// Where everything of a group lies in its one symmetric allocation (the
/// same offsets on every PE), and the sizes of the caller's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// PEs of the group.
    pub pes: usize,
    /// Experts on each PE (`L`).
    pub local_experts: usize,
    /// Rows of the expert-major buffer dispatch writes: dropless,
    /// `P * T * min(k, L)` plus `L * (align - 1)`; with a capacity `C`,
    /// `L * round_up(C, align)`.
    pub expert_rows: usize,
    /// Tiles of the layout pass (`P * ceil(T / TILE_TOKENS)`).
    pub tiles: usize,
    /// Bytes of the group's symmetric allocation on each PE.
    pub heap_bytes: usize,
    /// Offsets of the parts of that allocation, in bytes.
    pub at: Offsets,
}

/// Byte offsets into a group's symmetric allocation. Peers read `send`,
/// `send_scales`, `ids`, `probs`, `grad_probs` and the words, and write
/// `partial`, `recv`, `recv_scales` and the ready words; the rest only
/// its owner touches, except on Host PEs of one process, where peers also
/// read `recv_probs` and `route_row` (and leave `partial` and `recv`
/// alone: see [`crate::host_pull`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offsets {
    /// `[T, H]` rows as sent (the precision's wire type), published by
    /// dispatch and by `combine_backward` (its output gradient).
    pub send: usize,
    /// `[T, H / 128]` f32 FP8 scales of `send` (FP8 only).
    pub send_scales: usize,
    /// `[T, k]` i32 expert ids as published.
    pub ids: usize,
    /// `[T, k]` f32 probs as published.
    pub probs: usize,
    /// `[P, T, H]` partial sums of this PE's tokens: row `(q, t)` holds
    /// what PE `q`'s experts made of token `t`, stored there by PE `q` in
    /// combine.
    pub partial: usize,
    /// `[P, T, H]` received rows as sent (the wire type): row `(s, t)` is
    /// token `t` of PE `s`, stored here by PE `s` in dispatch.
    pub recv: usize,
    /// `[P, T, H / 128]` f32 FP8 scales of `recv` (FP8 only).
    pub recv_scales: usize,
    /// `[P, T, k]` f32 gradients of probs, published by
    /// `combine_backward`.
    pub grad_probs: usize,
    /// `[P]` u64: the phase each PE last announced here (peers write).
    pub ready: usize,
    /// u64 words: tokens published, phase epoch, error, dropped routes.
    pub words: usize,
    /// `[P]` u64: the group's base address as each PE reaches it.
    pub bases: usize,
    /// `[P, T, k]` i32: the local expert of each received route (-1: not
    /// here, or no route).
    pub local: usize,
    /// `[P, T, k]` f32: the received probs.
    pub recv_probs: usize,
    /// `[P, T, k]` i32: each route's row in the expert-major layout (-1:
    /// not here, or dropped).
    pub route_row: usize,
    /// `[tiles, L]` i32: routes per (tile, local expert), then each
    /// tile's first rank per expert.
    pub tile_counts: usize,
    /// `[L]` i64: each expert's first row (padded starts).
    pub expert_start: usize,
    /// `[P]` i32: the tokens each sender published this dispatch.
    pub sent: usize,
    /// `[P, T, k]` i32, groups the low-latency kernels may run (else
    /// empty): each received route's rank among its sender's routes to
    /// its expert (token order), stored here by the sender.
    pub ll_rank: usize,
}

/// Index of each u64 in [`Offsets::words`].
pub(crate) mod word {
    /// Tokens this PE published (peers read it).
    pub const TOKENS: usize = 0;
    /// The last phase epoch this PE announced.
    pub const EPOCH: usize = 1;
    /// The first error a kernel met (see `crate::cuda::ErrorCode`).
    pub const ERROR: usize = 2;
    /// Routes dropped by the capacity, summed over calls.
    pub const DROPPED: usize = 3;
    /// Arrivals at the low-latency kernels' grid-wide barriers (only
    /// `kernels.cu` touches it).
    #[cfg_attr(not(test), allow(dead_code))]
    pub const BAR: usize = 4;
    /// Where peers read this PE's rows in the current call. Host groups of
    /// one process (see `crate::host_pull`): the address of its `x` in
    /// dispatch, of its experts' outputs in combine. CUDA groups that
    /// pull (written by dispatch's publish): the address of its `x`
    /// where peers read it in place, else 0 (its send rows).
    pub const PULL: usize = 5;
    /// Words in all.
    pub const COUNT: usize = 6;
}

fn too_big(what: &str) -> EpError {
    EpError::InvalidArgument(format!("{what} overflows 64 bits"))
}

fn mul(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| too_big(what))
}

impl Layout {
    fn new(c: &EpConfig, pes: usize) -> Result<Layout> {
        let bad = |m: String| Err(EpError::InvalidArgument(m));
        if pes == 0 || pes > MAX_PES {
            return bad(format!("PEs must be in 1..={MAX_PES}, not {pes}"));
        }
        if c.tokens == 0 || c.hidden == 0 || c.topk == 0 || c.experts == 0 {
            return bad(format!(
                "tokens, hidden, topk and experts must be positive (got {}, {}, {}, {})",
                c.tokens, c.hidden, c.topk, c.experts
            ));
        }
        if c.topk > MAX_TOPK {
            return bad(format!("topk {} is over {MAX_TOPK}", c.topk));
        }
        if c.topk > c.experts {
            return bad(format!(
                "topk {} is more than the {} experts",
                c.topk, c.experts
            ));
        }
        if c.experts % pes != 0 {
            return bad(format!(
                "{} experts do not split evenly over {pes} PEs",
                c.experts
            ));
        }
        if c.align == 0 {
            return bad("align must be at least 1".into());
        }
        let row = mul(c.hidden, c.precision.element_bytes(), "a row")?;
        if row % 16 != 0 {
            return bad(format!(
                "a row of {} {} elements is {row} bytes; rows must be whole 16-byte vectors",
                c.hidden,
                c.precision.name()
            ));
        }
        if c.precision == Precision::Fp8Dispatch && c.hidden % FP8_BLOCK != 0 {
            return bad(format!(
                "FP8 dispatch scales blocks of {FP8_BLOCK} elements; hidden {} is not a multiple",
                c.hidden
            ));
        }
        if c.kernels == EpKernels::LowLatency
            && (c.tokens > LL_MAX_TOKENS || c.experts > LL_MAX_EXPERTS)
        {
            return bad(format!(
                "the low-latency kernels take at most {LL_MAX_TOKENS} tokens per PE and \
                 {LL_MAX_EXPERTS} experts (got {} and {})",
                c.tokens, c.experts
            ));
        }
        let l = c.experts / pes;
        if l > MAX_LOCAL_EXPERTS {
            return bad(format!("{l} experts per PE is over {MAX_LOCAL_EXPERTS}"));
        }
        let expert_rows = match c.capacity {
            Capacity::Dropless => mul(mul(pes, c.tokens, "rows")?, c.topk.min(l), "rows")?
                .checked_add(mul(l, c.align - 1, "rows")?)
                .ok_or_else(|| too_big("rows"))?,
            Capacity::PerExpert(0) => return bad("a capacity must be at least 1 row".into()),
            Capacity::PerExpert(cap) => mul(
                l,
                cap.div_ceil(c.align)
                    .checked_mul(c.align)
                    .ok_or_else(|| too_big("rows"))?,
                "rows",
            )?,
        };
        // Rows, routes and their indices are i32 on the device.
        let routes = mul(mul(pes, c.tokens, "routes")?, c.topk, "routes")?;
        if expert_rows > i32::MAX as usize || routes > i32::MAX as usize {
            return bad(format!(
                "{expert_rows} expert rows / {routes} routes: at most {} each",
                i32::MAX
            ));
        }
        mul(expert_rows, row, "the expert-major rows")?;
        let tiles = mul(pes, c.tokens.div_ceil(TILE_TOKENS), "tiles")?;
        let tk = mul(c.tokens, c.topk, "routes")?;
        let send = mul(
            c.tokens,
            mul(c.hidden, c.precision.element_bytes(), "a row")?,
            "send rows",
        )?;
        let scales = match c.precision {
            Precision::Fp8Dispatch => mul(c.tokens, c.hidden / FP8_BLOCK * 4, "scales")?,
            _ => 0,
        };
        // Each part starts on 256 bytes, so every vector access is aligned.
        let mut at = Offsets::default();
        let mut end = 0usize;
        let mut place = |bytes: usize| -> Result<usize> {
            let start = end
                .div_ceil(256)
                .checked_mul(256)
                .ok_or_else(|| too_big("the group"))?;
            end = start
                .checked_add(bytes)
                .ok_or_else(|| too_big("the group"))?;
            Ok(start)
        };
        at.send = place(send)?;
        at.send_scales = place(scales)?;
        at.ids = place(tk * 4)?;
        at.probs = place(tk * 4)?;
        at.partial = place(mul(pes, mul(c.tokens, row, "partials")?, "partials")?)?;
        let wire_row = mul(c.hidden, c.precision.wire_bytes(), "a row")?;
        at.recv = place(mul(
            pes,
            mul(c.tokens, wire_row, "received rows")?,
            "received rows",
        )?)?;
        at.recv_scales = place(mul(pes, scales, "received scales")?)?;
        at.grad_probs = place(routes * 4)?;
        at.ready = place(pes * 8)?;
        at.words = place(word::COUNT * 8)?;
        at.bases = place(pes * 8)?;
        at.local = place(routes * 4)?;
        at.recv_probs = place(routes * 4)?;
        at.route_row = place(routes * 4)?;
        at.tile_counts = place(mul(tiles, l * 4, "tile counts")?)?;
        at.expert_start = place(l * 8)?;
        at.sent = place(pes * 4)?;
        at.ll_rank = place(if c.low_latency_fits() { routes * 4 } else { 0 })?;
        let heap_bytes = place(0)?;
        Ok(Layout {
            pes,
            local_experts: l,
            expert_rows,
            tiles,
            heap_bytes,
            at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precisions_name_their_bytes_and_the_kernels_code() {
        let all = [Precision::F32, Precision::Bf16, Precision::Fp8Dispatch];
        let seen: Vec<_> = all
            .iter()
            .map(|p| (p.name(), p.element_bytes(), p.wire_bytes(), p.code()))
            .collect();
        // The codes are the ones kernels.cu and host.rs branch on.
        assert_eq!(
            seen,
            [("f32", 4, 4, 0), ("bf16", 2, 2, 1), ("fp8", 2, 1, 2)]
        );
    }

    #[test]
    fn dropless_rows_are_the_worst_case_and_capacity_rows_are_padded() {
        let c = EpConfig::new(4096, 7168, 8, 256);
        let l = c.layout(4).unwrap();
        assert_eq!(l.local_experts, 64);
        assert_eq!(l.expert_rows, 4 * 4096 * 8);
        let c = EpConfig { align: 128, ..c };
        assert_eq!(c.layout(4).unwrap().expert_rows, 4 * 4096 * 8 + 64 * 127);
        // k > L: a token has at most L routes to one PE.
        let small = EpConfig::new(10, 8, 4, 4);
        assert_eq!(small.layout(2).unwrap().expert_rows, 2 * 10 * 2);
        let cap = EpConfig {
            capacity: Capacity::PerExpert(100),
            align: 64,
            ..EpConfig::new(10, 8, 2, 8)
        };
        assert_eq!(cap.layout(2).unwrap().expert_rows, 4 * 128);
    }

    #[test]
    fn parts_do_not_overlap_and_start_on_256_bytes() {
        let c = EpConfig {
            precision: Precision::Fp8Dispatch,
            ..EpConfig::new(100, 256, 3, 12)
        };
        let l = c.layout(3).unwrap();
        let a = l.at;
        let starts = [
            a.send,
            a.send_scales,
            a.ids,
            a.probs,
            a.partial,
            a.recv,
            a.recv_scales,
            a.grad_probs,
            a.ready,
            a.words,
            a.bases,
            a.local,
            a.recv_probs,
            a.route_row,
            a.tile_counts,
            a.expert_start,
            a.sent,
            a.ll_rank,
            l.heap_bytes,
        ];
        assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{starts:?}");
        assert!(starts.iter().all(|s| s % 256 == 0));
        // The parts hold what they must: send 100*256*2, scales 100*2*4,
        // partials 3*100*256*2.
        assert!(a.send_scales - a.send >= 100 * 256 * 2);
        assert!(a.ids - a.send_scales >= 100 * 2 * 4);
        assert!(a.recv - a.partial >= 3 * 100 * 256 * 2);
        assert!(a.recv_scales - a.recv >= 3 * 100 * 256);
        assert!(a.grad_probs - a.recv_scales >= 3 * 100 * 2 * 4);
        assert!(a.tile_counts < a.expert_start);
        assert_eq!(l.tiles, 3 * 100usize.div_ceil(TILE_TOKENS));
    }

    /// Auto takes the low-latency kernels up to 256 tokens per PE, a
    /// forced choice up to 1024, neither past 2048 experts; a forced one
    /// past its limits is refused by name; only groups that may run them
    /// carry the ranks' part.
    #[test]
    fn auto_runs_the_low_latency_kernels_up_to_two_tokens_an_sm_and_pulls_above() {
        use EpKernels::*;
        let at = |tokens, kernels| EpConfig {
            kernels,
            ..EpConfig::new(tokens, 16, 2, 8)
        };
        // (tokens, kernels, PEs, SMs used) -> (low-latency, pull)
        for (tokens, kernels, pes, sms, want) in [
            (128, Auto, 2, 64, (true, false)),
            (128, Auto, 2, 63, (false, true)),
            (129, Auto, 4, 64, (false, true)),
            (4096, Auto, 2, 132, (false, true)),
            (4096, Auto, 1, 132, (false, false)),
            (300, Auto, 2, 1000, (false, true)),
            (16, LowLatency, 2, 1, (true, false)),
            (1024, LowLatency, 2, 8, (true, false)),
            (16, Steps, 2, 132, (false, false)),
            (16, Pull, 2, 132, (false, true)),
            (4096, Pull, 4, 24, (false, true)),
            (4096, Pull, 1, 24, (false, false)),
            (8, Auto, 2, usize::MAX, (true, false)),
        ] {
            assert_eq!(
                at(tokens, kernels).cuda_kernels(pes, sms),
                want,
                "{tokens} tokens, {kernels:?}, {pes} PEs, {sms} SMs"
            );
        }
    }

    #[test]
    fn the_low_latency_kernels_fit_decode_sized_groups() {
        let at = |tokens, experts, kernels| EpConfig {
            kernels,
            ..EpConfig::new(tokens, 16, 2, experts)
        };
        for (tokens, experts, kernels, fits) in [
            (256, 2048, EpKernels::Auto, true),
            (257, 8, EpKernels::Auto, false),
            (8, 2050, EpKernels::Auto, false),
            (1024, 2048, EpKernels::LowLatency, true),
            (8, 8, EpKernels::Steps, false),
            (8, 8, EpKernels::Pull, false),
        ] {
            let c = at(tokens, experts, kernels);
            assert_eq!(c.low_latency_fits(), fits, "{c:?}");
            let l = c.layout(2).unwrap();
            let ranks = l.heap_bytes - l.at.ll_rank;
            assert_eq!(ranks, if fits { 2 * tokens * 2 * 4 } else { 0 }, "{c:?}");
        }
        for (tokens, experts) in [(1025, 8), (8, 2050)] {
            let e = at(tokens, experts, EpKernels::LowLatency)
                .layout(2)
                .unwrap_err();
            assert!(
                e.to_string()
                    .contains("low-latency kernels take at most 1024"),
                "{e}"
            );
        }
        assert_eq!(
            [
                EpKernels::Auto,
                EpKernels::Steps,
                EpKernels::LowLatency,
                EpKernels::Pull
            ]
            .map(EpKernels::name),
            ["auto", "steps", "low-latency", "pull"]
        );
    }

    #[test]
    fn bad_shapes_name_what_is_wrong() {
        let err = |c: EpConfig, p: usize| c.layout(p).unwrap_err().to_string();
        let base = EpConfig::new(16, 8, 2, 8);
        assert!(err(base, 0).contains("PEs must be"));
        assert!(err(base, 3).contains("do not split evenly"));
        assert!(err(EpConfig { topk: 9, ..base }, 2).contains("more than the 8 experts"));
        assert!(err(
            EpConfig {
                topk: 33,
                experts: 64,
                ..base
            },
            2
        )
        .contains("over 32"));
        assert!(err(EpConfig { hidden: 4, ..base }, 2).contains("16-byte"));
        assert!(err(EpConfig { align: 0, ..base }, 2).contains("align"));
        assert!(err(EpConfig { tokens: 0, ..base }, 2).contains("positive"));
        assert!(err(
            EpConfig {
                capacity: Capacity::PerExpert(0),
                ..base
            },
            2
        )
        .contains("capacity"));
        assert!(err(
            EpConfig {
                precision: Precision::Fp8Dispatch,
                hidden: 64,
                ..base
            },
            2
        )
        .contains("multiple"));
        assert!(err(
            EpConfig {
                tokens: usize::MAX / 2,
                ..base
            },
            2
        )
        .contains("64 bits"));
        assert!(err(
            EpConfig {
                tokens: 1 << 30,
                ..base
            },
            2
        )
        .contains("at most"));
    }
}
