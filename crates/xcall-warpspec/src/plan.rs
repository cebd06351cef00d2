//! The derived pipeline plan: barriers, parities, shared-memory layout, register plan.
