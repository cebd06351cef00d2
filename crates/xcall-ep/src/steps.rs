//! The steps each call runs: one PE has no peer to store to or announce
//! to; Host PEs of one process pull instead of pushing
//! ([`crate::host_pull`]) and end each call with an empty phase, as does
//! a CUDA dispatch that pulls ([`crate::EpConfig::cuda_kernels`]; its
//! combine pushes); CUDA groups of decode size run the low-latency
//! kernels.

use crate::cuda::Step;

/// [`crate::EpGroup::dispatch_send`]'s steps.
pub(crate) fn send(pes: usize, pull: bool) -> &'static [Step] {
    match (pes, pull) {
        (1, _) => &[Step::Publish],
        (_, true) => &[Step::Publish, Step::Signal],
        _ => &[Step::Publish, Step::Push, Step::Signal],
    }
}

/// [`crate::EpGroup::dispatch_recv`]'s steps.
pub(crate) fn recv(pes: usize, pull: bool) -> &'static [Step] {
    use Step::*;
    match (pes, pull) {
        (1, _) => &[Count, Scan, Assign, Copy],
        // Pulled: no PE returns (and lets its caller write what peers
        // read: Host, its `x`; CUDA, its send rows, which may be `x`)
        // while a peer may still copy from it.
        (_, true) => &[Wait, Count, Scan, Assign, Copy, Signal, Wait],
        _ => &[Wait, Count, Scan, Assign, Copy],
    }
}

/// The steps of [`crate::EpGroup::combine`] and
/// [`crate::EpGroup::dispatch_backward`].
pub(crate) fn combine(pes: usize, low_latency: bool, pull: bool) -> &'static [Step] {
    use Step::*;
    match (pes, low_latency, pull) {
        // One PE's sums are its outputs (see `host::reduce`).
        (1, ..) => &[Reduce],
        (_, true, _) => &[LlCombine],
        // Pulled: every PE offers its outputs and announces them; each
        // sums its own tokens from them, and no PE returns (and lets its
        // caller write them) before all did.
        (.., true) => &[Signal, Wait, GatherSum, Signal, Wait],
        _ => &[Reduce, Signal, Wait, GatherSum],
    }
}

/// [`crate::EpGroup::combine_backward`]'s steps.
pub(crate) const COMBINE_BACKWARD: [Step; 7] = [
    Step::Publish,
    Step::Signal,
    Step::Wait,
    Step::ScatterGrad,
    Step::Signal,
    Step::Wait,
    Step::GatherProbs,
];
