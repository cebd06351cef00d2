//! The values the choice flags of `xcall moe` take.

use clap::ValueEnum;

/// Where the PEs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlatformArg {
    /// Host threads, one per PE.
    Host,
    /// One thread per GPU.
    Cuda,
}

/// Element type of the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// bfloat16 tokens, dispatched in FP8 (e4m3, a scale per 128
    /// elements; the token-once exchange only).
    Fp8,
}

/// How a Host PE runs its experts (the warp-specialized op).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostExecutorArg {
    /// Blocks of elements decoded, computed and encoded over the cores.
    Vectorized,
    /// The pipeline's thread-by-thread model on software mbarriers (the
    /// protocol the CUDA kernels follow; far slower).
    Pipeline,
}

/// How rows reach other PEs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExchangeArg {
    /// xcall-ep: each token moved once to each PE hosting one of its
    /// experts, expanded there into expert-major rows; each PE sums its
    /// experts' outputs of a token and stores one row back (dropless;
    /// peers reached by pointer).
    Token,
    /// `permute` writes each peer's rows straight into its receive slot
    /// and `unpermute` reads the results from the peers' slots (loads and
    /// stores through peer pointers): no staging copy, only routed rows
    /// cross.
    Fused,
    /// `permute` into local send slots, whole slots copied with
    /// `put_signal` both ways: the path of a transport without load/store
    /// access to peers.
    Copy,
}

/// Which kernels run the token-once exchange on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EpKernelsArg {
    /// The low-latency kernels up to 256 tokens per PE and two per SM of
    /// the budget (decode), a kernel per step above (dispatch pulling).
    Auto,
    /// A kernel per step, dispatch pushing (each PE stores its tokens into
    /// its peers' receive rows).
    Steps,
    /// One kernel for a whole dispatch and one for a whole combine (up to
    /// 1024 tokens per PE and 2048 experts).
    LowLatency,
    /// A kernel per step, dispatch's copy reading peers' rows where they
    /// are instead of their pushing them.
    Pull,
}
