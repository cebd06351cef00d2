//! Pipeline specifications: stages, async warps and their loads, compute
//! warpgroups, register split.

/// One async (producer) warp: the loads it issues per stage, in bytes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AsyncWarp {
    /// Bytes of each load the warp issues per stage (each a 1D bulk copy).
    pub loads: Vec<u32>,
}

impl AsyncWarp {
    /// Total bytes the warp loads per stage.
    pub fn bytes_per_stage(&self) -> u64 {
        self.loads.iter().map(|&b| b as u64).sum()
    }
}

/// Registers per thread for the producer warpgroup and each compute
/// warpgroup (`setmaxnreg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisterSplit {
    /// Registers per thread of the producer warpgroup.
    pub producer: u32,
    /// Registers per thread of every compute warpgroup.
    pub consumer: u32,
}

/// What a warp-specialized pipeline must do.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PipelineSpec {
    /// Number of circular stages (buffers per async warp).
    pub stages: u32,
    /// The async warps; each fills its own stage buffers.
    pub async_warps: Vec<AsyncWarp>,
    /// Number of compute warpgroups (128 threads each); each consumes every
    /// stage (they split the tile).
    pub compute_warpgroups: u32,
    /// Optional register split.
    pub registers: Option<RegisterSplit>,
    /// Shared memory available to one block in bytes (H100/H200: 227 KiB).
    pub smem_limit: u32,
}

/// Shared memory one block may use on Hopper (sm_90): 227 KiB.
pub const HOPPER_SMEM_PER_BLOCK: u32 = 227 * 1024;

impl PipelineSpec {
    /// A spec with `stages` stages, one async warp per entry of `warp_bytes`
    /// (one load of that many bytes per stage), `compute_warpgroups` compute
    /// warpgroups, no register split and the Hopper shared-memory limit.
    pub fn new(stages: u32, warp_bytes: &[u32], compute_warpgroups: u32) -> Self {
        PipelineSpec {
            stages,
            async_warps: warp_bytes
                .iter()
                .map(|&b| AsyncWarp { loads: vec![b] })
                .collect(),
            compute_warpgroups,
            registers: None,
            smem_limit: HOPPER_SMEM_PER_BLOCK,
        }
    }
}
