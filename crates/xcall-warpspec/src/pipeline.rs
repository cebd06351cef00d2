//! The protocol of a plan as data: which barriers exist, which role waits
//! on, arrives on, copies into and reads what, per stage, and where each
//! role's stage/phase walk starts.
//!
//! The planner writes these tables once ([`PipelinePlan::new`](crate::PipelinePlan::new)); the
//! verifier ([`PipelinePlan::protocol`](crate::PipelinePlan::protocol)), the Host executor and the CUDA
//! generator all read them, so the protocol that is model-checked is the
//! protocol that runs. A planner mistake (two warps sharing a barrier, an
//! init count that does not match the arrivals) therefore shows in the
//! verifier's verdict, not only in a kernel that hangs.

/// FULL (data landed) or EMPTY (buffer released).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierKind {
    /// Completed by the producer's arrive.expect_tx and its copies landing.
    Full,
    /// Completed by every compute warpgroup's release.
    Empty,
}

/// Where a role's walk over the circular stages stands: the stage buffer
/// it uses next and the parity of the barrier phase it waits for there
/// (the same pair as CUTLASS's `PipelineState`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PipelineState {
    /// The stage.
    pub index: u32,
    /// The parity a wait at this stage waits on (0 or 1).
    pub phase: u32,
}

/// cbindgen:ignore
impl PipelineState {
    /// Where compute roles start: stage 0, waiting for phase 0 of the FULL
    /// barriers to complete.
    pub const CONSUMER_START: PipelineState = PipelineState { index: 0, phase: 0 };

    /// Where producers start: stage 0, parity 1. Buffers begin empty, and a
    /// wait for the parity of the phase before a fresh barrier's first one
    /// passes at once.
    pub const PRODUCER_START: PipelineState = PipelineState { index: 0, phase: 1 };

    /// The next state: the following stage, flipping the parity when the
    /// walk wraps around the `stages` buffers.
    pub fn advance(self, stages: u32) -> PipelineState {
        if self.index + 1 >= stages {
            PipelineState {
                index: 0,
                phase: self.phase ^ 1,
            }
        } else {
            PipelineState {
                index: self.index + 1,
                phase: self.phase,
            }
        }
    }
}

/// One barrier per stage, all of one kind and owner: the FULL or EMPTY
/// barriers of one async warp.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BarrierGroup {
    /// FULL or EMPTY.
    pub kind: BarrierKind,
    /// The async warp whose buffers it guards.
    pub warp: usize,
    /// Index into [`PipelinePlan::barriers`](crate::PipelinePlan::barriers) per stage.
    pub barriers: Vec<usize>,
}

/// One operation of a role's iteration. `group` indexes
/// [`PipelinePlan::groups`](crate::PipelinePlan::groups) and `buffer` the async warps' buffers
/// ([`PipelinePlan::buffer_offsets`](crate::PipelinePlan::buffer_offsets)); both at the stage of the role's
/// [`PipelineState`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Wait until the phase of the state's parity completes.
    Wait {
        /// Barrier group.
        group: usize,
    },
    /// `mbarrier.arrive.expect_tx`: expect `bytes`, arrive once.
    ArriveExpectTx {
        /// Barrier group.
        group: usize,
        /// Bytes expected in the phase.
        bytes: u64,
    },
    /// A bulk copy of `bytes` into the stage's buffer, completing on the
    /// group's barrier.
    Copy {
        /// Barrier group the copy completes on.
        group: usize,
        /// Buffer written.
        buffer: usize,
        /// Bytes.
        bytes: u64,
    },
    /// Read the stage's buffer.
    Read {
        /// Buffer read.
        buffer: usize,
    },
    /// `mbarrier.arrive` by `count` threads (each arrives once).
    Arrive {
        /// Barrier group.
        group: usize,
        /// Arrivals.
        count: u32,
    },
}

/// What a role is in the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RoleKind {
    /// An async warp (its lane 0 acts).
    Producer {
        /// The warp.
        warp: usize,
    },
    /// A compute warpgroup (128 threads).
    Compute {
        /// The warpgroup.
        warpgroup: u32,
    },
}

/// One role's program: the actions of every iteration, in order, and where
/// its stage/phase walk starts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RolePlan {
    /// Producer or compute, and which.
    pub kind: RoleKind,
    /// The state of its first iteration.
    pub start: PipelineState,
    /// Its actions per iteration.
    pub body: Vec<Action>,
}

impl RolePlan {
    /// Its name in traces and hang reports (`producer w0`, `compute wg1`).
    pub fn name(&self) -> String {
        match self.kind {
            RoleKind::Producer { warp } => format!("producer w{warp}"),
            RoleKind::Compute { warpgroup } => format!("compute wg{warpgroup}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PlanError;
    use crate::plan::PipelinePlan;

    #[test]
    fn the_walk_wraps_and_flips_like_the_closed_form() {
        for stages in 1..=5u32 {
            for start in [PipelineState::CONSUMER_START, PipelineState::PRODUCER_START] {
                let mut state = start;
                for i in 0..(4 * stages) {
                    assert_eq!(state.index, i % stages, "stages {stages} i {i}");
                    assert_eq!(
                        state.phase,
                        start.phase ^ ((i / stages) & 1),
                        "stages {stages} i {i}"
                    );
                    state = state.advance(stages);
                }
            }
        }
    }

    #[test]
    fn tables_that_index_nothing_are_refused_one_by_one() {
        use crate::spec::PipelineSpec;
        let plan = PipelinePlan::new(&PipelineSpec::new(2, &[1024, 1024], 1)).unwrap();
        assert_eq!(plan.check_tables(), Ok(()));
        let refused = |edit: &dyn Fn(&mut PipelinePlan)| {
            let mut p = plan.clone();
            edit(&mut p);
            matches!(p.check_tables(), Err(PlanError::Protocol(_)))
        };
        assert!(refused(&|p| {
            p.buffer_offsets.pop();
        }));
        assert!(refused(&|p| {
            p.buffer_offsets[1].pop();
        }));
        assert!(refused(&|p| {
            p.groups[3].barriers.pop();
        }));
        assert!(refused(&|p| p.groups[0].barriers[1] = 99));
        assert!(refused(&|p| p.roles[2].start.index = 2));
        assert!(refused(&|p| p.roles[0].start.phase = 2));
        assert!(refused(&|p| p.roles[1].body[0] = Action::Wait { group: 4 }));
        assert!(refused(&|p| p.roles[2]
            .body
            .push(Action::Read { buffer: 2 })));
        assert!(refused(&|p| p.roles[0].body.push(Action::Copy {
            group: 0,
            buffer: 2,
            bytes: 16
        })));
    }
}
