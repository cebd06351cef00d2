//! Hand-written barrier designs the verifier judges: two broken designs of
//! a two-producer pipeline (a FULL barrier shared between producers, and an
//! EMPTY prologue arrive emitted once per producer) and a correct
//! prologue-based variant for contrast; and four faults of warp-specialized
//! pipelines, each with a switch to its fix: a leader warp that releases a
//! stage before its sibling warps are done with it, a release while an
//! asynchronous reader still reads, a consumer a lap apart from its
//! producer, and a back-pressure cycle through a producer that writes with
//! stores instead of a bulk copy.

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

fn wait(group: usize, phase_offset: i32) -> Step {
    Step::Wait {
        group,
        phase_offset,
    }
}

fn arrive(group: usize) -> Step {
    Step::Arrive {
        group,
        phase_offset: 0,
        count: 1,
    }
}

/// The body of a bulk-copy producer of buffer group `buffer` guarded by
/// barrier groups `full` and `empty`.
fn copy_producer(full: usize, empty: usize, buffer: usize, bytes: u64) -> Vec<Step> {
    vec![
        wait(empty, -1),
        Step::ExpectTxArrive {
            group: full,
            phase_offset: 0,
            bytes,
        },
        Step::Copy {
            group: full,
            buffer_group: buffer,
            phase_offset: 0,
            bytes,
        },
    ]
}

fn role(name: &str, body: Vec<Step>) -> RoleDecl {
    RoleDecl {
        name: name.into(),
        prologue: vec![],
        body,
    }
}

/// A compute warpgroup as its warps: each warp waits for the stage and
/// reads it, and only the leader warp releases it (EMPTY counts one
/// arrival). Without `synced`, the leader arrives as soon as its own read
/// is done, while its `siblings` may still wait on the FULL barrier: the
/// producer refills a buffer they have not read (the missing `__syncwarp`
/// or named barrier before the leader's arrive). With `synced`, every
/// sibling arrives on a per-stage SYNC barrier after its read and the leader
/// waits there before releasing.
pub fn leader_release(stages: u32, siblings: u32, synced: bool, iterations: u32) -> Protocol {
    let mut barriers = Vec::new();
    let mut barrier_groups = vec![
        groups(stages, &mut barriers, "FULL[w0]", 1),
        groups(stages, &mut barriers, "EMPTY[w0]", 1),
    ];
    if synced {
        barrier_groups.push(groups(stages, &mut barriers, "SYNC[wg0]", siblings));
    }
    let mut roles = vec![role("producer w0", copy_producer(0, 1, 0, 4096))];
    let mut leader = vec![wait(0, 0), Step::Read { buffer_group: 0 }];
    if synced {
        leader.push(wait(2, 0));
    }
    leader.push(arrive(1));
    roles.push(role("compute wg0 warp 0 (leader)", leader));
    for w in 1..=siblings {
        let mut body = vec![wait(0, 0), Step::Read { buffer_group: 0 }];
        if synced {
            body.push(arrive(2));
        }
        roles.push(role(&format!("compute wg0 warp {w}"), body));
    }
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, 1),
        roles,
        iterations,
    }
}

/// A compute warpgroup whose read of the stage is asynchronous (a `wgmma`
/// on the shared-memory tile, or a bulk copy out of it): without `fenced`
/// it releases the stage right after issuing the read, so the producer may
/// refill the buffer while the read is still in flight; with `fenced` it
/// waits for its reads to complete before the release.
pub fn async_read_release(stages: u32, fenced: bool, iterations: u32) -> Protocol {
    let mut barriers = Vec::new();
    let barrier_groups = vec![
        groups(stages, &mut barriers, "FULL[w0]", 1),
        groups(stages, &mut barriers, "EMPTY[w0]", 1),
    ];
    let mut body = vec![wait(0, 0), Step::ReadAsync { buffer_group: 0 }];
    if fenced {
        body.push(Step::WaitAsyncReads);
    }
    body.push(arrive(1));
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, 1),
        roles: vec![
            role("producer w0", copy_producer(0, 1, 0, 4096)),
            role("compute wg0", body),
        ],
        iterations,
    }
}

/// A second consumer of the FULL barriers (an epilogue warp tracking which
/// tiles have landed) that the producer does not wait for: without
/// `counted` the producer and the releasing consumer run up to a lap of
/// stages ahead of it, so a FULL barrier completes two phases past the one
/// it waits for, which its parity bit cannot tell from the phase before.
/// With `counted` it also releases the stage (EMPTY counts two arrivals),
/// so it never falls a lap behind.
pub fn lapped_consumer(stages: u32, counted: bool, iterations: u32) -> Protocol {
    let mut barriers = Vec::new();
    let barrier_groups = vec![
        groups(stages, &mut barriers, "FULL[w0]", 1),
        groups(stages, &mut barriers, "EMPTY[w0]", 1 + counted as u32),
    ];
    let mut observer = vec![wait(0, 0)];
    if counted {
        observer.push(arrive(1));
    }
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, 1),
        roles: vec![
            role("producer w0", copy_producer(0, 1, 0, 4096)),
            role(
                "compute wg0",
                vec![wait(0, 0), Step::Read { buffer_group: 0 }, arrive(1)],
            ),
            role("epilogue w1", observer),
        ],
        iterations,
    }
}

/// Two producers feed one compute warpgroup: warp 0 with a bulk copy, warp
/// 1 with its own stores (`Write` then a plain arrive on its FULL barrier).
/// Without `producer_parity` the store producer starts its walk on the
/// consumers' parity (as if only bulk-copy roles were producers), so it
/// waits for the release of the iteration it has yet to produce: the
/// compute warpgroup waits for its data, it waits for the compute
/// warpgroup's release, a back-pressure cycle. With `producer_parity` it
/// waits for the release of the round before, like the copy producer.
pub fn store_producer_cycle(stages: u32, producer_parity: bool, iterations: u32) -> Protocol {
    let mut barriers = Vec::new();
    let barrier_groups = vec![
        groups(stages, &mut barriers, "FULL[w0]", 1),
        groups(stages, &mut barriers, "EMPTY[w0]", 1),
        groups(stages, &mut barriers, "FULL[w1]", 1),
        groups(stages, &mut barriers, "EMPTY[w1]", 1),
    ];
    let stores = vec![
        wait(3, if producer_parity { -1 } else { 0 }),
        Step::Write { buffer_group: 1 },
        arrive(2),
    ];
    Protocol {
        stages,
        barriers,
        barrier_groups,
        buffer_groups: buffers(stages, 2),
        roles: vec![
            role("producer w0", copy_producer(0, 1, 0, 4096)),
            role("producer w1 (stores)", stores),
            role(
                "compute wg0",
                vec![
                    wait(0, 0),
                    wait(2, 0),
                    Step::Read { buffer_group: 0 },
                    Step::Read { buffer_group: 1 },
                    arrive(1),
                    arrive(3),
                ],
            ),
        ],
        iterations,
    }
}
