//! Permute, unpermute and chunk-sort operations, forward and backward.
