//! The bounds a world holds to, in one place: how many PEs, how much a PE
//! gathers, how large a bootstrap frame may be.

/// The most PEs a world may have. Rack-scale systems have 72 GPUs and CPU
/// partitions more; the bound keeps the per-PE tables of init (O(PEs) on
/// every PE) from growing without limit on a wrong size.
pub const MAX_PES: usize = 1 << 16;

/// The most bytes one PE gives [`crate::World::allgather`].
pub const MAX_GATHER_BYTES: usize = 16 << 20;

/// The largest frame a socket bootstrap sends: one collective's data of
/// every PE together, as rank 0 answers it.
pub const MAX_FRAME: usize = 1 << 30;
