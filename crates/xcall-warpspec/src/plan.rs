//! The derived pipeline plan: barriers, roles and their start states,
//! shared-memory layout, register plan, threads and launch bounds.
//!
//! Nothing in a plan is hand-written: every FULL barrier is owned by one
//! async warp and one stage, with an init count equal to that warp's
//! arrivals per phase (one elected `arrive.expect_tx`); every EMPTY barrier
//! likewise, with an init count equal to the compute arrivals per phase
//! (every compute thread releases the stage after its own reads, as in
//! CUTLASS's TMA pipeline: 128 per compute warpgroup). Breaking exactly these
//! equalities by hand is what makes a pipeline hang or read early
//! ([`crate::designs`]).

use crate::error::PlanError;
pub use crate::pipeline::BarrierKind;
use crate::pipeline::{Action, BarrierGroup, PipelineState, RoleKind, RolePlan};
use crate::spec::PipelineSpec;

/// Largest transaction count one mbarrier phase can hold (2^20 - 1).
pub const MAX_TX_BYTES: u64 = (1 << 20) - 1;
/// Alignment of stage buffers in shared memory.
pub const BUFFER_ALIGN: u32 = 128;
/// Threads of a warpgroup.
pub const WARPGROUP_THREADS: u32 = 128;

/// One barrier of the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BarrierPlan {
    /// FULL or EMPTY.
    pub kind: BarrierKind,
    /// The async warp whose stage buffer it guards.
    pub warp: usize,
    /// The stage.
    pub stage: u32,
    /// Arrivals per phase.
    pub init_count: u32,
    /// Byte offset in shared memory (8-byte aligned).
    pub offset: u32,
}

/// A verified-by-construction pipeline layout for one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelinePlan {
    /// The spec it was derived from.
    pub spec: PipelineSpec,
    /// Every barrier, each with its kind, owner, stage, init count and
    /// offset.
    pub barriers: Vec<BarrierPlan>,
    /// The barriers by group (the FULL or EMPTY barriers of one async
    /// warp, one per stage): what roles' actions name.
    pub groups: Vec<BarrierGroup>,
    /// Every role's program: the async warps first, then the compute
    /// warpgroups. The verifier, the Host executor and the CUDA generator
    /// all follow these.
    pub roles: Vec<RolePlan>,
    /// Shared-memory offset of warp `w`'s buffer for stage `s`: `[w][s]`.
    pub buffer_offsets: Vec<Vec<u32>>,
    /// Bytes each warp loads per stage.
    pub bytes_per_stage: Vec<u32>,
    /// Total shared memory of the layout.
    pub smem_bytes: u32,
    /// Warpgroups holding the async warps (4 warps each).
    pub producer_warpgroups: u32,
    /// Threads per block.
    pub threads_per_block: u32,
    /// `__launch_bounds__(max threads, min blocks per SM)`.
    pub launch_bounds: (u32, u32),
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn check_register(role: &'static str, value: u32) -> Result<(), PlanError> {
    if (24..=256).contains(&value) && value % 8 == 0 {
        Ok(())
    } else {
        Err(PlanError::RegisterValue { role, value })
    }
}

impl PipelinePlan {
    /// Derives the plan of `spec`, or the first rule it breaks.
    pub fn new(spec: &PipelineSpec) -> Result<PipelinePlan, PlanError> {
        if spec.stages == 0 {
            return Err(PlanError::NoStages);
        }
        if spec.async_warps.is_empty() {
            return Err(PlanError::NoAsyncWarps);
        }
        if spec.compute_warpgroups == 0 {
            return Err(PlanError::NoComputeWarpgroups);
        }
        let mut bytes_per_stage = Vec::new();
        for (w, warp) in spec.async_warps.iter().enumerate() {
            if warp.loads.is_empty() {
                return Err(PlanError::EmptyWarp { warp: w });
            }
            for (l, &bytes) in warp.loads.iter().enumerate() {
                if bytes == 0 || bytes % 16 != 0 {
                    return Err(PlanError::LoadNotMultipleOf16 {
                        warp: w,
                        load: l,
                        bytes,
                    });
                }
            }
            let total = warp.bytes_per_stage();
            if total > MAX_TX_BYTES {
                return Err(PlanError::TooManyBytesPerPhase {
                    warp: w,
                    bytes: total,
                    max: MAX_TX_BYTES,
                });
            }
            bytes_per_stage.push(total as u32);
        }
        // Sizes in u64 from here: no count a caller passes can wrap them.
        let warps = spec.async_warps.len() as u64;
        let threads =
            (warps.div_ceil(4) + spec.compute_warpgroups as u64) * WARPGROUP_THREADS as u64;
        if threads > 1024 {
            return Err(PlanError::TooManyThreads {
                threads: threads.min(u32::MAX as u64) as u32,
            });
        }
        // At most 8 warpgroups of 128 threads: the counts below fit u32.
        let producer_warpgroups = warps.div_ceil(4) as u32;
        // The shared memory the layout below will need, bounded before any
        // of it is laid out: a huge stage count is refused, not allocated.
        let least = bytes_per_stage
            .iter()
            .map(|&b| u64::from(b) + 16)
            .sum::<u64>()
            .saturating_mul(u64::from(spec.stages));
        if least > spec.smem_limit as u64 {
            return Err(PlanError::SharedMemory {
                needed: least,
                limit: spec.smem_limit,
            });
        }
        if let Some(r) = spec.registers {
            check_register("producer", r.producer)?;
            check_register("consumer", r.consumer)?;
            if r.producer > r.consumer {
                return Err(PlanError::ProducerAboveConsumer {
                    producer: r.producer,
                    consumer: r.consumer,
                });
            }
            let needed = (producer_warpgroups as u64 * r.producer as u64
                + spec.compute_warpgroups as u64 * r.consumer as u64)
                * WARPGROUP_THREADS as u64;
            if needed > 65536 {
                return Err(PlanError::RegisterFile { needed });
            }
        }
        // Layout: stage buffers first (128-byte aligned), then barriers.
        let mut offset = 0u64;
        let mut buffer_offsets = Vec::new();
        for &bytes in &bytes_per_stage {
            let mut per_stage = Vec::new();
            for _ in 0..spec.stages {
                offset = align(offset, BUFFER_ALIGN as u64);
                per_stage.push(offset);
                offset += bytes as u64;
            }
            buffer_offsets.push(per_stage);
        }
        offset = align(offset, 8);
        // One FULL and one EMPTY group per async warp, each a barrier per
        // stage, and the roles that use them.
        let mut barriers = Vec::new();
        let mut groups = Vec::new();
        for w in 0..spec.async_warps.len() {
            for kind in [BarrierKind::Full, BarrierKind::Empty] {
                groups.push(BarrierGroup {
                    kind,
                    warp: w,
                    barriers: Vec::new(),
                });
            }
            for s in 0..spec.stages {
                for kind in [BarrierKind::Full, BarrierKind::Empty] {
                    let group = groups.len() - 2 + usize::from(kind == BarrierKind::Empty);
                    groups[group].barriers.push(barriers.len());
                    barriers.push(BarrierPlan {
                        kind,
                        warp: w,
                        stage: s,
                        init_count: 0,
                        offset: offset as u32,
                    });
                    offset += 8;
                }
            }
        }
        let (full, empty) = (|w: usize| 2 * w, |w: usize| 2 * w + 1);
        let mut roles = Vec::new();
        for (w, warp) in spec.async_warps.iter().enumerate() {
            let mut body = vec![
                Action::Wait { group: empty(w) },
                Action::ArriveExpectTx {
                    group: full(w),
                    bytes: warp.bytes_per_stage(),
                },
            ];
            body.extend(warp.loads.iter().map(|&bytes| Action::Copy {
                group: full(w),
                buffer: w,
                bytes: u64::from(bytes),
            }));
            roles.push(RolePlan {
                kind: RoleKind::Producer { warp: w },
                start: PipelineState::PRODUCER_START,
                body,
            });
        }
        let warps = spec.async_warps.len();
        for g in 0..spec.compute_warpgroups {
            let mut body: Vec<Action> = (0..warps)
                .map(|w| Action::Wait { group: full(w) })
                .collect();
            body.extend((0..warps).map(|w| Action::Read { buffer: w }));
            // Every compute thread releases the stage after its own reads.
            body.extend((0..warps).map(|w| Action::Arrive {
                group: empty(w),
                count: WARPGROUP_THREADS,
            }));
            roles.push(RolePlan {
                kind: RoleKind::Compute { warpgroup: g },
                start: PipelineState::CONSUMER_START,
                body,
            });
        }
        if offset > spec.smem_limit as u64 {
            return Err(PlanError::SharedMemory {
                needed: offset,
                limit: spec.smem_limit,
            });
        }
        let mut plan = PipelinePlan {
            spec: spec.clone(),
            barriers,
            groups,
            roles,
            buffer_offsets: buffer_offsets
                .into_iter()
                .map(|v| v.into_iter().map(|o| o as u32).collect())
                .collect(),
            bytes_per_stage,
            smem_bytes: offset as u32,
            producer_warpgroups,
            threads_per_block: threads as u32,
            launch_bounds: (threads as u32, 1),
        };
        // Init counts are the arrivals per phase the roles make: equal by
        // construction (at most 8 warpgroups of 128 threads per barrier).
        for (b, arrivals) in plan.arrivals_per_phase().into_iter().enumerate() {
            plan.barriers[b].init_count = arrivals as u32;
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{AsyncWarp, RegisterSplit};

    #[test]
    fn derived_counts_layout_and_parities() {
        let spec = PipelineSpec::new(3, &[1040, 4096], 2);
        let plan = PipelinePlan::new(&spec).unwrap();
        assert_eq!(plan.barriers.len(), 2 * 2 * 3);
        for b in &plan.barriers {
            let want = match b.kind {
                BarrierKind::Full => 1,
                BarrierKind::Empty => 256,
            };
            assert_eq!(b.init_count, want, "{b:?}");
            assert_eq!(b.offset % 8, 0);
        }
        let at = |kind, w, s: usize| plan.groups[plan.group(kind, w).unwrap()].barriers[s];
        let full_1_2 = plan.barriers[at(BarrierKind::Full, 1, 2)];
        assert_eq!(
            full_1_2,
            BarrierPlan {
                kind: BarrierKind::Full,
                warp: 1,
                stage: 2,
                init_count: 1,
                offset: full_1_2.offset
            }
        );
        let empty_1_2 = plan.barriers[at(BarrierKind::Empty, 1, 2)];
        assert_eq!((empty_1_2.kind, empty_1_2.stage), (BarrierKind::Empty, 2));
        // Every barrier is in exactly one group, at its own stage.
        let mut seen = vec![0; plan.barriers.len()];
        for g in &plan.groups {
            for (s, &b) in g.barriers.iter().enumerate() {
                seen[b] += 1;
                let p = plan.barriers[b];
                assert_eq!((p.kind, p.warp, p.stage), (g.kind, g.warp, s as u32));
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        // Buffers are 128-byte aligned, do not overlap, and barriers follow.
        let mut spans: Vec<(u32, u32)> = Vec::new();
        for (w, per_stage) in plan.buffer_offsets.iter().enumerate() {
            for &o in per_stage {
                assert_eq!(o % 128, 0);
                spans.push((o, o + plan.bytes_per_stage[w]));
            }
        }
        spans.sort();
        for pair in spans.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "{pair:?}");
        }
        assert!(plan
            .barriers
            .iter()
            .all(|b| b.offset >= spans.last().unwrap().1));
        assert_eq!(plan.smem_bytes, plan.barriers.last().unwrap().offset + 8);
        // 1 producer warpgroup + 2 compute warpgroups.
        assert_eq!(plan.threads_per_block, 384);
        assert_eq!(plan.launch_bounds, (384, 1));
        // Consumers wait parity 0 in round 0, producers start on parity 1.
        let producer = plan.roles[0].start;
        let consumer = plan.roles[2].start;
        assert_eq!(plan.roles[0].kind, RoleKind::Producer { warp: 0 });
        assert_eq!(plan.roles[2].kind, RoleKind::Compute { warpgroup: 0 });
        let parities: Vec<(u32, u32)> = (0..7)
            .scan((consumer, producer), |(c, p), _| {
                let now = (c.phase, p.phase);
                (*c, *p) = (c.advance(3), p.advance(3));
                Some(now)
            })
            .collect();
        assert_eq!(
            parities,
            vec![(0, 1), (0, 1), (0, 1), (1, 0), (1, 0), (1, 0), (0, 1)]
        );
    }

    #[test]
    fn every_group_has_one_owner_and_init_counts_are_the_arrivals() {
        for (stages, warps, wgs) in [(1, 1, 1), (3, 2, 2), (4, 3, 1)] {
            let spec = PipelineSpec::new(stages, &vec![1024; warps], wgs);
            let plan = PipelinePlan::new(&spec).unwrap();
            assert_eq!(plan.roles.len(), warps + wgs as usize);
            for (g, group) in plan.groups.iter().enumerate() {
                // Exactly one producer arrives on a FULL group (and waits
                // on no FULL); exactly one waits on an EMPTY group.
                let producers: Vec<usize> = plan
                    .roles
                    .iter()
                    .filter_map(|r| match r.kind {
                        RoleKind::Producer { warp } => Some((warp, &r.body)),
                        _ => None,
                    })
                    .filter(|(_, body)| {
                        body.iter().any(|a| {
                            matches!(*a, Action::ArriveExpectTx { group, .. } | Action::Wait { group } if group == g)
                        })
                    })
                    .map(|(w, _)| w)
                    .collect();
                assert_eq!(producers, vec![group.warp], "{group:?}");
                // Counted by hand: one elected arrival per phase on FULL,
                // 128 per compute warpgroup on EMPTY.
                let want = match group.kind {
                    BarrierKind::Full => 1,
                    BarrierKind::Empty => 128 * wgs,
                };
                for &b in &group.barriers {
                    assert_eq!(plan.barriers[b].init_count, want);
                    assert_eq!(plan.arrivals_per_phase()[b], u64::from(want));
                }
            }
        }
    }

    #[test]
    fn each_rule_has_its_error() {
        let ok = PipelineSpec::new(2, &[1024], 1);
        let with = |f: &dyn Fn(&mut PipelineSpec)| {
            let mut s = ok.clone();
            f(&mut s);
            PipelinePlan::new(&s).unwrap_err()
        };
        assert_eq!(with(&|s| s.stages = 0), PlanError::NoStages);
        assert_eq!(with(&|s| s.async_warps.clear()), PlanError::NoAsyncWarps);
        assert_eq!(
            with(&|s| s.compute_warpgroups = 0),
            PlanError::NoComputeWarpgroups
        );
        assert_eq!(
            with(&|s| s.async_warps[0].loads.clear()),
            PlanError::EmptyWarp { warp: 0 }
        );
        assert_eq!(
            with(&|s| s.async_warps.push(AsyncWarp {
                loads: vec![64, 100]
            })),
            PlanError::LoadNotMultipleOf16 {
                warp: 1,
                load: 1,
                bytes: 100
            }
        );
        assert!(matches!(
            with(&|s| s.async_warps[0].loads = vec![1 << 20]),
            PlanError::TooManyBytesPerPhase { .. }
        ));
        assert!(matches!(
            with(&|s| {
                s.stages = 8;
                s.async_warps[0].loads = vec![32768];
            }),
            PlanError::SharedMemory { .. }
        ));
        assert_eq!(
            with(&|s| s.compute_warpgroups = 8),
            PlanError::TooManyThreads { threads: 1152 }
        );
        let split = |producer, consumer| {
            move |s: &mut PipelineSpec| s.registers = Some(RegisterSplit { producer, consumer })
        };
        assert_eq!(
            with(&split(20, 232)),
            PlanError::RegisterValue {
                role: "producer",
                value: 20
            }
        );
        assert_eq!(
            with(&split(40, 236)),
            PlanError::RegisterValue {
                role: "consumer",
                value: 236
            }
        );
        assert_eq!(
            with(&split(40, 264)),
            PlanError::RegisterValue {
                role: "consumer",
                value: 264
            }
        );
        assert_eq!(
            with(&split(240, 232)),
            PlanError::ProducerAboveConsumer {
                producer: 240,
                consumer: 232
            }
        );
        let mut three = ok.clone();
        three.compute_warpgroups = 3;
        three.registers = Some(RegisterSplit {
            producer: 256,
            consumer: 256,
        });
        assert_eq!(
            PipelinePlan::new(&three).unwrap_err(),
            PlanError::RegisterFile { needed: 131072 }
        );
        // The common Hopper split fits: 40 + 2 x 232 registers x 128 threads.
        let mut common = PipelineSpec::new(4, &[8192, 8192], 2);
        common.registers = Some(RegisterSplit {
            producer: 40,
            consumer: 232,
        });
        assert!(PipelinePlan::new(&common).is_ok());
    }
}
