//! Expert parallelism on an xcall-shmem world: dispatch and combine that
//! send each token **once to each PE hosting one of its experts** and
//! reduce before returning, on Host PEs (threads or processes) and on
//! CUDA (one thread per GPU, or a process per PE through CUDA IPC, where
//! processes may share a GPU and take turns on it).
//!
//! A group ([`EpGroup`]) is made collectively on a live world from an
//! [`EpConfig`] (`T` tokens per PE at most, `H`, top-`k`, `E` experts, the
//! [`Precision`], `align`, [`Capacity`], an SM budget). Every buffer's
//! size follows from the config ([`EpConfig::layout`], a query before
//! anything is made), so nothing waits on the host for counts and a
//! captured call replays for any routing:
//! - [`EpGroup::dispatch`]: each PE publishes its routing and its tokens;
//!   each token crosses once to every other PE hosting one of its
//!   experts, which writes it to each of its routes'
//!   rows of an **expert-major** buffer (rows grouped by local expert, each group
//!   starting on a multiple of `align`), with `tokens_per_expert` written
//!   on the device. FP8 dispatch quantizes on the sender (e4m3, one f32
//!   scale per 128 elements) and the receiver gets FP8 rows with their
//!   scales, bf16 rows dequantized from them, or both (experts that read
//!   bf16 leave the FP8 rows out, and nothing writes them; each received
//!   chunk is dequantized once, whatever its routes).
//!   [`EpGroup::dispatch_send`] and [`EpGroup::dispatch_recv`] are its two
//!   halves, for a caller that enqueues work of its own between them
//!   (with the pushed steps, while the stores are in flight).
//! - [`EpGroup::combine`]: each PE sums its experts' outputs for each
//!   token it received (weighted by the probs, f32) and stores one partial
//!   row into the token's PE, which adds the partial rows in PE rank order
//!   (f32), so results are the same run after run.
//! - [`EpGroup::dispatch_backward`] and [`EpGroup::combine_backward`]: the
//!   gradients (an unweighted combine; a dispatch of the output gradient
//!   times the probs, and the probs' gradient).
//!
//! On CUDA, decode-sized groups (at most 256 tokens per PE, two per SM
//! of the budget, and 2048 experts: [`EpKernels::Auto`]) run a whole dispatch as one kernel and a
//! whole combine as another (the low-latency kernels: one block per SM
//! of the budget, meeting at grid-wide barriers, each block laying the
//! received rows out itself from the senders' counts); larger groups run
//! a kernel per step, dispatch **pulling**: each PE reads every token
//! routed to it from its sender's send buffer (over NVLink) as it writes
//! the token's routes' rows, one kernel and one pass, instead of its
//! sender storing it into a receive buffer for a second kernel to copy
//! out (the pushed steps, [`EpKernels::Steps`]). Every choice writes the
//! same bytes ([`EpConfig::kernels`] picks).
//!
//! Peers' memory is reached directly (the world's peer pointers), so a
//! group needs every PE on one host. The Host path runs the same steps as the
//! CUDA kernels with the same arithmetic: a CUDA run equals a Host run on
//! the same data bit for bit (the probs' gradient within rounding). Host
//! PEs of one process read their peers' rows where they are instead of
//! storing them into each other ([`host_pull`]), with the same bytes as
//! a result.
//! See [`group`] for the phase protocol. [`EpGroup::save_routing`] and
//! [`EpGroup::restore_routing`] keep a dispatch's routing for combine and
//! backward calls made after other dispatches.

#![deny(missing_docs)]

mod args;
pub mod config;
mod cuda;
mod error;
pub mod fp8;
pub mod group;
pub mod host;
pub mod host_grad;
pub mod host_pull;
mod host_sum;
pub mod params;
mod saved;
mod sleep;
mod status;
mod steps;

pub use config::{
    Capacity, EpConfig, EpKernels, Layout, Offsets, Precision, FP8_BLOCK, LL_AUTO_TOKENS,
    LL_MAX_EXPERTS, LL_MAX_TOKENS, MAX_PES, MAX_TOPK,
};
pub use error::{EpError, Result};
pub use group::{Buf, EpGroup, ExpertMajor};
