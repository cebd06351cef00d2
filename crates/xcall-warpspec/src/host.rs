//! The Host executor: warps as OS threads on a software mbarrier.
