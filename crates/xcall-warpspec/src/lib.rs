//! Warp-specialized mbarrier pipelines: plan, model-check, run.
//!
//! A [`PipelineSpec`] names the stages, the async (producer) warps and their
//! loads, and the compute warpgroups. The planner derives a
//! [`PipelinePlan`]: one FULL and one EMPTY barrier per async warp and
//! stage with init counts equal to the arrivals per phase by construction,
//! every role's actions and start [`PipelineState`] as data (the protocol
//! the verifier checks, the Host executor runs and the CUDA generator
//! emits), the shared-memory layout and the register plan. The verifier ([`verify::verify`]) explores every
//! interleaving of a barrier protocol with PTX mbarrier semantics and
//! reports deadlocks, early overwrites, reads before loads and phase errors
//! with a shortest trace; it judges hand-written designs too
//! ([`designs`]: the broken ones deadlock or flip a phase early).

#![deny(missing_docs)]

pub mod codegen;
pub mod cuda;
pub mod designs;
mod error;
pub mod host;
mod host_vectorized;
pub mod ops;
pub mod pipeline;
pub mod plan;
mod run;
pub mod spec;
mod tables;
pub mod verify;

pub use error::PlanError;
pub use ops::HostExecutor;
pub use pipeline::{Action, BarrierGroup, PipelineState, RoleKind, RolePlan};
pub use plan::{BarrierKind, BarrierPlan, PipelinePlan};
pub use run::{run, shared_kernels, OpCall};
pub use spec::{AsyncWarp, PipelineSpec, RegisterSplit};
pub use verify::{verify, Protocol, Verdict, Violation, ViolationKind};
pub use xcall_core::{Device, Error, Platform, Result};
