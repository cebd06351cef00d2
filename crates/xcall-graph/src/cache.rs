//! The per-device graph cache: lookup, capture, replay, exec-update, eviction.
