//! What a plan's tables say: lookups of groups and barriers, the checks
//! of hand-edited tables, and the protocol the verifier explores, read
//! from the tables as they are.

use crate::error::PlanError;
use crate::pipeline::Action;
use crate::plan::{BarrierKind, PipelinePlan};
use crate::verify::{BarrierDecl, Protocol, RoleDecl, Step};

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
