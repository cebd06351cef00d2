//! The derived pipeline plan: barriers, parities, shared-memory layout,
//! register plan, threads and launch bounds.
//!
//! Nothing in a plan is hand-written: every FULL barrier is owned by one
//! async warp and one stage, with an init count equal to that warp's
//! arrivals per phase (one elected `arrive.expect_tx`); every EMPTY barrier
//! likewise, with an init count equal to the compute arrivals per phase
//! (every compute thread releases the stage after its own reads, as in
//! CUTLASS's TMA pipeline: 128 per compute warpgroup). Incident 5 came from
//! breaking exactly these equalities by hand.

use crate::error::PlanError;
use crate::spec::PipelineSpec;
use crate::verify::{BarrierDecl, Protocol, RoleDecl, Step};

/// Largest transaction count one mbarrier phase can hold (2^20 - 1).
pub const MAX_TX_BYTES: u64 = (1 << 20) - 1;
/// Alignment of stage buffers in shared memory.
pub const BUFFER_ALIGN: u32 = 128;
/// Threads of a warpgroup.
pub const WARPGROUP_THREADS: u32 = 128;

/// FULL (data landed) or EMPTY (buffer released).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierKind {
    /// Completed by the producer's arrive.expect_tx and its copies landing.
    Full,
    /// Completed by every compute warpgroup's release.
    Empty,
}

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
    /// Barriers: FULL and EMPTY of warp `w`, stage `s` at
    /// `2 * (w * stages + s)` and that plus one.
    pub barriers: Vec<BarrierPlan>,
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
        let mut barriers = Vec::new();
        for w in 0..spec.async_warps.len() {
            for s in 0..spec.stages {
                for (kind, init_count) in [
                    (BarrierKind::Full, 1),
                    (
                        BarrierKind::Empty,
                        spec.compute_warpgroups * WARPGROUP_THREADS,
                    ),
                ] {
                    barriers.push(BarrierPlan {
                        kind,
                        warp: w,
                        stage: s,
                        init_count,
                        offset: offset as u32,
                    });
                    offset += 8;
                }
            }
        }
        if offset > spec.smem_limit as u64 {
            return Err(PlanError::SharedMemory {
                needed: offset,
                limit: spec.smem_limit,
            });
        }
        Ok(PipelinePlan {
            spec: spec.clone(),
            barriers,
            buffer_offsets: buffer_offsets
                .into_iter()
                .map(|v| v.into_iter().map(|o| o as u32).collect())
                .collect(),
            bytes_per_stage,
            smem_bytes: offset as u32,
            producer_warpgroups,
            threads_per_block: threads as u32,
            launch_bounds: (threads as u32, 1),
        })
    }

    /// Index of warp `w`'s FULL barrier for stage `s`.
    pub fn full(&self, w: usize, s: u32) -> usize {
        2 * (w * self.spec.stages as usize + s as usize)
    }

    /// Index of warp `w`'s EMPTY barrier for stage `s`.
    pub fn empty(&self, w: usize, s: u32) -> usize {
        self.full(w, s) + 1
    }

    /// Parity compute warps wait on (FULL barriers) at iteration `i`.
    pub fn consumer_parity(&self, i: u64) -> u32 {
        ((i / self.spec.stages as u64) & 1) as u32
    }

    /// Parity producers wait on (EMPTY barriers) at iteration `i`: the
    /// opposite phase, since buffers begin empty (the first wait on a fresh
    /// barrier's "preceding phase" passes at once).
    pub fn producer_parity(&self, i: u64) -> u32 {
        self.consumer_parity(i) ^ 1
    }

    /// The barrier protocol of this plan, for the verifier, over
    /// `iterations` iterations.
    pub fn protocol(&self, iterations: u32) -> Protocol {
        let stages = self.spec.stages;
        let warps = self.spec.async_warps.len();
        let mut barriers = Vec::new();
        let mut barrier_groups = Vec::new();
        for w in 0..warps {
            let (mut full, mut empty) = (Vec::new(), Vec::new());
            for s in 0..stages {
                full.push(barriers.len());
                barriers.push(BarrierDecl {
                    name: format!("FULL[w{w}][s{s}]"),
                    init_count: 1,
                });
                empty.push(barriers.len());
                barriers.push(BarrierDecl {
                    name: format!("EMPTY[w{w}][s{s}]"),
                    init_count: self.spec.compute_warpgroups * WARPGROUP_THREADS,
                });
            }
            barrier_groups.push(full);
            barrier_groups.push(empty);
        }
        let full_group = |w: usize| 2 * w;
        let empty_group = |w: usize| 2 * w + 1;
        let buffer_groups: Vec<Vec<String>> = (0..warps)
            .map(|w| (0..stages).map(|s| format!("BUF[w{w}][s{s}]")).collect())
            .collect();
        let mut roles = Vec::new();
        for (w, warp) in self.spec.async_warps.iter().enumerate() {
            let mut body = vec![
                Step::Wait {
                    group: empty_group(w),
                    phase_offset: -1,
                },
                Step::ExpectTxArrive {
                    group: full_group(w),
                    phase_offset: 0,
                    bytes: warp.bytes_per_stage(),
                },
            ];
            for &bytes in &warp.loads {
                body.push(Step::Copy {
                    group: full_group(w),
                    buffer_group: w,
                    phase_offset: 0,
                    bytes: bytes as u64,
                });
            }
            roles.push(RoleDecl {
                name: format!("producer w{w}"),
                prologue: vec![],
                body,
            });
        }
        for g in 0..self.spec.compute_warpgroups {
            let mut body: Vec<Step> = (0..warps)
                .map(|w| Step::Wait {
                    group: full_group(w),
                    phase_offset: 0,
                })
                .collect();
            body.extend((0..warps).map(|w| Step::Read { buffer_group: w }));
            body.extend((0..warps).map(|w| Step::Arrive {
                group: empty_group(w),
                phase_offset: 0,
                count: WARPGROUP_THREADS,
            }));
            roles.push(RoleDecl {
                name: format!("compute wg{g}"),
                prologue: vec![],
                body,
            });
        }
        Protocol {
            stages,
            barriers,
            barrier_groups,
            buffer_groups,
            roles,
            iterations,
        }
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
        assert_eq!(
            plan.barriers[plan.full(1, 2)],
            BarrierPlan {
                kind: BarrierKind::Full,
                warp: 1,
                stage: 2,
                init_count: 1,
                offset: plan.barriers[plan.full(1, 2)].offset
            }
        );
        assert_eq!(plan.barriers[plan.empty(1, 2)].kind, BarrierKind::Empty);
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
        let parities: Vec<(u32, u32)> = (0..7)
            .map(|i| (plan.consumer_parity(i), plan.producer_parity(i)))
            .collect();
        assert_eq!(
            parities,
            vec![(0, 1), (0, 1), (0, 1), (1, 0), (1, 0), (1, 0), (0, 1)]
        );
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
