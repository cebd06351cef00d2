//! The explicit-state model checker of barrier protocols.
