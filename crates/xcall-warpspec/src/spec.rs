//! Pipeline specifications: stages, async warps and their loads, compute warpgroups, register split.
