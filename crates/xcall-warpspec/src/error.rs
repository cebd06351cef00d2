//! Errors of the planner, verifier and executors.

use xcall_core::Status;

/// Why a spec, plan or run was refused. Each variant is one rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// `stages` must be at least 1.
    #[error("a pipeline needs at least 1 stage")]
    NoStages,
    /// At least one async warp.
    #[error("a pipeline needs at least 1 async warp")]
    NoAsyncWarps,
    /// At least one compute warpgroup.
    #[error("a pipeline needs at least 1 compute warpgroup")]
    NoComputeWarpgroups,
    /// An async warp issues no load.
    #[error("async warp {warp} issues no load")]
    EmptyWarp {
        /// The warp.
        warp: usize,
    },
    /// A bulk copy must move a positive multiple of 16 bytes.
    #[error("async warp {warp} load {load}: {bytes} bytes is not a positive multiple of 16 (cp.async.bulk)")]
    LoadNotMultipleOf16 {
        /// The warp.
        warp: usize,
        /// The load within the warp.
        load: usize,
        /// Its size.
        bytes: u32,
    },
    /// A phase's transaction count must stay below 2^20 - 1 bytes.
    #[error(
        "async warp {warp} loads {bytes} bytes per stage; one mbarrier phase counts at most {max}"
    )]
    TooManyBytesPerPhase {
        /// The warp.
        warp: usize,
        /// Its bytes per stage.
        bytes: u64,
        /// The limit.
        max: u64,
    },
    /// Stage buffers and barriers do not fit in shared memory.
    #[error("the plan needs {needed} bytes of shared memory, the limit is {limit}")]
    SharedMemory {
        /// Bytes the layout needs.
        needed: u64,
        /// The limit of the spec.
        limit: u32,
    },
    /// A register count outside [24, 256] or not a multiple of 8.
    #[error("{role} registers {value}: setmaxnreg takes a multiple of 8 in [24, 256]")]
    RegisterValue {
        /// `producer` or `consumer`.
        role: &'static str,
        /// The value.
        value: u32,
    },
    /// The producer must not get more registers than a consumer.
    #[error("producer registers {producer} exceed consumer registers {consumer}")]
    ProducerAboveConsumer {
        /// Producer registers.
        producer: u32,
        /// Consumer registers.
        consumer: u32,
    },
    /// The register file of one SM (65536) is exceeded for one block.
    #[error("registers {needed} per block exceed the 65536 of one SM")]
    RegisterFile {
        /// Registers the split needs for one block.
        needed: u64,
    },
    /// A block would have more than 1024 threads.
    #[error("{threads} threads per block exceed 1024")]
    TooManyThreads {
        /// Threads the plan needs.
        threads: u32,
    },
    /// A hand-written protocol is malformed (an index out of range, ...).
    #[error("malformed protocol: {0}")]
    Protocol(String),
    /// The plan's protocol has a shape the CUDA generator's kernel does
    /// not implement (it generates one persistent streaming kernel: one
    /// load per async warp, every warp's tile the same size).
    #[error("the CUDA generator cannot follow this plan: {0}")]
    Codegen(String),
    /// The model checker reached a bound of its budget (states, memory or
    /// time) before it finished; the message gives the numbers reached.
    #[error("verification stopped at its limit: {0}")]
    Limit(String),
}

impl PlanError {
    /// The stable status code of this error.
    pub fn status(&self) -> Status {
        match self {
            PlanError::Limit(_) => Status::Limit,
            _ => Status::InvalidArgument,
        }
    }
}
