//! Shared fixtures of the integration tests.
pub mod gpu;
