//! Hand-written barrier designs the verifier judges: two broken designs of
//! a two-producer pipeline (a FULL barrier shared between producers, and an
//! EMPTY prologue arrive emitted once per producer) and a correct
//! prologue-based variant for contrast.

use crate::verify::{BarrierDecl, Protocol, RoleDecl, Step};

fn groups(stages: u32, barriers: &mut Vec<BarrierDecl>, name: &str, init_count: u32) -> Vec<usize> {
    (0..stages)
        .map(|s| {
            barriers.push(BarrierDecl {
                name: format!("{name}[s{s}]"),
                init_count,
            });
            barriers.len() - 1
        })
        .collect()
}

fn buffers(stages: u32, warps: usize) -> Vec<Vec<String>> {
    (0..warps)
        .map(|w| (0..stages).map(|s| format!("BUF[w{w}][s{s}]")).collect())
        .collect()
}

/// Two (or more) producer warps share ONE FULL barrier per stage with init
/// count 1: each producer's `arrive.expect_tx` counts toward it, so the
/// first producer's data completes the phase alone, so compute reads the other producer's stage
/// before it lands, and the extra arrival later hangs the pipeline.
pub fn shared_full_barrier(stages: u32, warps: usize, bytes: u64, iterations: u32) -> Protocol {
    let mut barriers = Vec::new();
    let mut barrier_groups = vec![groups(stages, &mut barriers, "FULL(shared)", 1)];
    for w in 0..warps {
        barrier_groups.push(groups(stages, &mut barriers, &format!("EMPTY[w{w}]"), 1));
    }
    let mut roles: Vec<RoleDecl> = (0..warps)
        .map(|w| RoleDecl {
            name: format!("producer w{w}"),
            prologue: vec![],
            body: vec![
                Step::Wait {
                    group: 1 + w,
                    phase_offset: -1,
                },
                Step::ExpectTxArrive {
                    group: 0,
                    phase_offset: 0,
                    bytes,
                },
                Step::Copy {
                    group: 0,
                    buffer_group: w,
                    phase_offset: 0,
                    bytes,
                },
            ],
        })
        .collect();
    let mut body = vec![Step::Wait {
        group: 0,
        phase_offset: 0,
    }];
    body.extend((0..warps).map(|w| Step::Read { buffer_group: w }));
    body.extend((0..warps).map(|w| Step::Arrive {
        group: 1 + w,
        phase_offset: 0,
        count: 1,
    }));
    roles.push(RoleDecl {
        name: "compute wg0".into(),
        prologue: vec![],
        body,
    });
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, warps),
        roles,
        iterations,
    }
}

/// Buffers start "empty" through a consumer prologue that arrives once on
/// every stage's EMPTY barrier (shared by the producers), and producers wait
/// on the same parity as consumers. With `arrive_per_async_warp` the
/// prologue arrive is emitted once per async warp (one copy per producer
/// warp in the generated loop): the EMPTY barrier advances two phases instead of one.
pub fn prologue_empty_arrive(
    stages: u32,
    warps: usize,
    compute_warpgroups: u32,
    arrive_per_async_warp: bool,
    iterations: u32,
) -> Protocol {
    let bytes = 1024;
    let mut barriers = Vec::new();
    let mut barrier_groups = Vec::new();
    for w in 0..warps {
        barrier_groups.push(groups(stages, &mut barriers, &format!("FULL[w{w}]"), 1));
    }
    let empty = barrier_groups.len();
    barrier_groups.push(groups(
        stages,
        &mut barriers,
        "EMPTY(shared)",
        compute_warpgroups,
    ));
    let mut roles: Vec<RoleDecl> = (0..warps)
        .map(|w| RoleDecl {
            name: format!("producer w{w}"),
            prologue: vec![],
            body: vec![
                // Waits for the release of the previous round, which the
                // prologue stands in for at round 0.
                Step::Wait {
                    group: empty,
                    phase_offset: 0,
                },
                Step::ExpectTxArrive {
                    group: w,
                    phase_offset: 0,
                    bytes,
                },
                Step::Copy {
                    group: w,
                    buffer_group: w,
                    phase_offset: 0,
                    bytes,
                },
            ],
        })
        .collect();
    let copies = if arrive_per_async_warp { warps } else { 1 };
    for g in 0..compute_warpgroups {
        let mut prologue = Vec::new();
        for s in 0..stages {
            for _ in 0..copies {
                prologue.push((
                    s,
                    Step::Arrive {
                        group: empty,
                        phase_offset: 0,
                        count: 1,
                    },
                ));
            }
        }
        let mut body: Vec<Step> = (0..warps)
            .map(|w| Step::Wait {
                group: w,
                phase_offset: 0,
            })
            .collect();
        body.extend((0..warps).map(|w| Step::Read { buffer_group: w }));
        body.push(Step::Arrive {
            group: empty,
            phase_offset: 1,
            count: 1,
        });
        roles.push(RoleDecl {
            name: format!("compute wg{g}"),
            prologue,
            body,
        });
    }
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, warps),
        roles,
        iterations,
    }
}
