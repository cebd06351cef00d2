//! The protocol of a plan as data: which barriers exist, which role waits
//! on, arrives on, copies into and reads what, per stage, and where each
//! role's stage/phase walk starts.
//!
//! The planner writes these tables once ([`PipelinePlan::new`]); the
//! verifier ([`PipelinePlan::protocol`]), the Host executor and the CUDA
//! generator all read them, so the protocol that is model-checked is the
//! protocol that runs. A planner mistake (two warps sharing a barrier, an
//! init count that does not match the arrivals) therefore shows in the
//! verifier's verdict, not only in a kernel that hangs.

use crate::error::PlanError;
use crate::plan::{BarrierKind, PipelinePlan};
use crate::verify::{BarrierDecl, Protocol, RoleDecl, Step};

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
    /// Index into [`PipelinePlan::barriers`] per stage.
    pub barriers: Vec<usize>,
}

/// One operation of a role's iteration. `group` indexes
/// [`PipelinePlan::groups`] and `buffer` the async warps' buffers
/// ([`PipelinePlan::buffer_offsets`]); both at the stage of the role's
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

impl PipelinePlan {
    /// The group of `kind` barriers of async warp `warp`, if the plan has one.
    pub fn group(&self, kind: BarrierKind, warp: usize) -> Option<usize> {
        self.groups
            .iter()
            .position(|g| g.kind == kind && g.warp == warp)
    }

    /// Checks that the tables index each other within range (a plan's
    /// fields are public, so one may have been edited by hand): every
    /// group has a barrier per stage, every action names an existing group
    /// and buffer, every start state a stage and a parity.
    pub fn check_tables(&self) -> Result<(), PlanError> {
        let stages = self.spec.stages as usize;
        let buffers = self.bytes_per_stage.len();
        let bad = |m: String| Err(PlanError::Protocol(m));
        if self.buffer_offsets.len() != buffers
            || self.buffer_offsets.iter().any(|b| b.len() != stages)
        {
            return bad(format!(
                "{buffers} buffer sizes but offsets for {} buffers, or not one per stage",
                self.buffer_offsets.len()
            ));
        }
        for (g, group) in self.groups.iter().enumerate() {
            if group.barriers.len() != stages
                || group.barriers.iter().any(|&b| b >= self.barriers.len())
            {
                return bad(format!(
                    "barrier group {g} needs one valid barrier per stage"
                ));
            }
        }
        for role in &self.roles {
            if role.start.index as usize >= stages || role.start.phase > 1 {
                return bad(format!(
                    "{}: start state {:?} out of range",
                    role.name(),
                    role.start
                ));
            }
            for action in &role.body {
                let (group, buffer) = match *action {
                    Action::Wait { group }
                    | Action::ArriveExpectTx { group, .. }
                    | Action::Arrive { group, .. } => (Some(group), None),
                    Action::Copy { group, buffer, .. } => (Some(group), Some(buffer)),
                    Action::Read { buffer } => (None, Some(buffer)),
                };
                if group.is_some_and(|g| g >= self.groups.len())
                    || buffer.is_some_and(|b| b >= buffers)
                {
                    return bad(format!(
                        "{}: {action:?} names no group or buffer of the plan",
                        role.name()
                    ));
                }
            }
        }
        Ok(())
    }

    /// The name of barrier `b` (`FULL[w0][s1]`).
    pub fn barrier_name(&self, b: usize) -> String {
        let p = &self.barriers[b];
        let kind = match p.kind {
            BarrierKind::Full => "FULL",
            BarrierKind::Empty => "EMPTY",
        };
        format!("{kind}[w{}][s{}]", p.warp, p.stage)
    }

    /// The barrier protocol of this plan's tables, for the verifier, over
    /// `iterations` iterations. Nothing is re-derived from the spec: the
    /// barriers, their init counts, the groups and every role's actions are
    /// the plan's own. A wait names the phase its start parity implies
    /// (producers, starting on parity 1, wait for the phase before the
    /// round's); every arrival and copy is meant for the round's phase.
    pub fn protocol(&self, iterations: u32) -> Protocol {
        let barriers = (0..self.barriers.len())
            .map(|b| BarrierDecl {
                name: self.barrier_name(b),
                init_count: self.barriers[b].init_count,
            })
            .collect();
        let barrier_groups = self.groups.iter().map(|g| g.barriers.clone()).collect();
        let buffer_groups = (0..self.buffer_offsets.len())
            .map(|w| {
                (0..self.spec.stages)
                    .map(|s| format!("BUF[w{w}][s{s}]"))
                    .collect()
            })
            .collect();
        let roles = self
            .roles
            .iter()
            .map(|role| {
                let wait_offset = -(role.start.phase as i32);
                let body = role
                    .body
                    .iter()
                    .map(|&action| match action {
                        Action::Wait { group } => Step::Wait {
                            group,
                            phase_offset: wait_offset,
                        },
                        Action::ArriveExpectTx { group, bytes } => Step::ExpectTxArrive {
                            group,
                            phase_offset: 0,
                            bytes,
                        },
                        Action::Copy {
                            group,
                            buffer,
                            bytes,
                        } => Step::Copy {
                            group,
                            buffer_group: buffer,
                            phase_offset: 0,
                            bytes,
                        },
                        Action::Read { buffer } => Step::Read {
                            buffer_group: buffer,
                        },
                        Action::Arrive { group, count } => Step::Arrive {
                            group,
                            phase_offset: 0,
                            count,
                        },
                    })
                    .collect();
                RoleDecl {
                    name: role.name(),
                    prologue: vec![],
                    body,
                }
            })
            .collect();
        Protocol {
            stages: self.spec.stages,
            barriers,
            barrier_groups,
            buffer_groups,
            roles,
            iterations,
        }
    }

    /// Arrivals per phase on every barrier, counted from the roles' actions
    /// (each role runs its body once per phase of a stage's barriers).
    pub fn arrivals_per_phase(&self) -> Vec<u64> {
        let mut arrivals = vec![0u64; self.barriers.len()];
        for role in &self.roles {
            for action in &role.body {
                let (group, count) = match *action {
                    Action::ArriveExpectTx { group, .. } => (group, 1),
                    Action::Arrive { group, count } => (group, u64::from(count)),
                    _ => continue,
                };
                for &b in &self.groups[group].barriers {
                    arrivals[b] += count;
                }
            }
        }
        arrivals
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
