//! The verifier's required verdicts on the hand-written designs and the
//! planner's own tables.

use xcall_warpspec::designs::{prologue_empty_arrive, shared_full_barrier};
use xcall_warpspec::verify::{
    verify, verify_unreduced, verify_within, Budget, DEFAULT_STATE_LIMIT,
};
use xcall_warpspec::{
    Action, BarrierKind, PipelinePlan, PipelineSpec, PipelineState, RoleKind, ViolationKind,
};

#[test]
fn shared_full_barrier_with_two_producers_is_caught_with_a_trace() {
    let stages = 2;
    let v = verify(
        &shared_full_barrier(stages, 2, 4096, 2 * stages + 1),
        DEFAULT_STATE_LIMIT,
    )
    .unwrap();
    print!("{}", v.report());
    let violation = v
        .violation
        .expect("the shared FULL barrier design must fail");
    // The second producer's arrival exceeds the shared barrier's count of 1
    // while the first producer's bytes are still in flight.
    assert_eq!(
        violation.kind,
        ViolationKind::ExcessArrival,
        "{violation:?}"
    );
    assert!(
        violation.message.contains("FULL(shared)[s0]"),
        "{}",
        violation.message
    );
    assert!(violation.trace.len() >= 2);
    assert!(
        violation.trace.last().unwrap().starts_with("producer w1"),
        "{:?}",
        violation.trace
    );
}

#[test]
fn prologue_arrive_per_async_warp_is_caught_and_the_fixed_prologue_is_clean() {
    let stages = 2;
    let iterations = 2 * stages + 1;
    let v = verify(
        &prologue_empty_arrive(stages, 2, 1, true, iterations),
        DEFAULT_STATE_LIMIT,
    )
    .unwrap();
    print!("{}", v.report());
    let violation = v.violation.expect("the doubled prologue arrive must fail");
    assert_eq!(violation.kind, ViolationKind::WrongPhase, "{violation:?}");
    assert!(
        violation.message.contains("EMPTY(shared)"),
        "{}",
        violation.message
    );
    let fixed = verify(
        &prologue_empty_arrive(stages, 2, 1, false, iterations),
        DEFAULT_STATE_LIMIT,
    )
    .unwrap();
    assert!(fixed.is_clean(), "{}", fixed.report());
}

#[test]
fn planner_output_is_clean_for_the_required_grid() {
    let mut report = String::new();
    for stages in 1..=4u32 {
        for warps in 1..=3usize {
            for wgs in 1..=2u32 {
                let spec = PipelineSpec::new(stages, &vec![4096; warps], wgs);
                let plan = PipelinePlan::new(&spec).unwrap();
                let iterations = 2 * stages + 1;
                let v = verify(&plan.protocol(iterations), DEFAULT_STATE_LIMIT).unwrap();
                assert!(
                    v.is_clean(),
                    "stages {stages} warps {warps} wgs {wgs}:\n{}",
                    v.report()
                );
                report.push_str(&format!(
                    "stages {stages} async warps {warps} compute warpgroups {wgs} iterations {iterations}: {} states, {:.3?}\n",
                    v.states, v.elapsed
                ));
            }
        }
    }
    print!("{report}");
}

#[test]
fn a_hand_edited_init_count_is_caught() {
    // The planner's layout with EMPTY barriers initialised for one compute
    // warpgroup while two release them: the phase flips early.
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[1024], 2)).unwrap();
    let mut protocol = plan.protocol(5);
    for b in protocol
        .barriers
        .iter_mut()
        .filter(|b| b.name.starts_with("EMPTY"))
    {
        b.init_count = 128;
    }
    let v = verify(&protocol, DEFAULT_STATE_LIMIT).unwrap();
    let violation = v.violation.clone().expect("wrong init count must fail");
    assert!(
        matches!(
            violation.kind,
            ViolationKind::WrongPhase | ViolationKind::Overwrite
        ),
        "{}",
        v.report()
    );
    // And one that never completes (init count too high) deadlocks.
    let mut protocol = plan.protocol(5);
    for b in protocol
        .barriers
        .iter_mut()
        .filter(|b| b.name.starts_with("EMPTY"))
    {
        b.init_count = 3 * 128;
    }
    let v = verify(&protocol, DEFAULT_STATE_LIMIT).unwrap();
    let violation = v
        .violation
        .clone()
        .expect("unreachable init count must deadlock");
    assert_eq!(violation.kind, ViolationKind::Deadlock, "{}", v.report());
    assert!(
        violation
            .message
            .contains("producer w0 (iteration 2): wait EMPTY[w0][s0] phase 0"),
        "{}",
        violation.message
    );
}

#[test]
fn malformed_protocols_are_refused() {
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[1024], 1)).unwrap();
    let mut p = plan.protocol(3);
    p.barrier_groups[0].pop();
    assert!(verify(&p, DEFAULT_STATE_LIMIT).is_err());
    let mut p = plan.protocol(3);
    p.roles[0]
        .body
        .push(xcall_warpspec::verify::Step::Read { buffer_group: 9 });
    assert!(verify(&p, DEFAULT_STATE_LIMIT).is_err());
    let p = plan.protocol(0);
    assert!(verify(&p, DEFAULT_STATE_LIMIT).is_err());
    // The state limit turns a too-large search into an error, not a hang.
    // (Three compute warpgroups: a search of about 15,000 states and 2 MB.)
    let big = PipelinePlan::new(&PipelineSpec::new(4, &[1024, 1024, 1024], 3)).unwrap();
    let err = verify(&big.protocol(9), 1000).unwrap_err();
    assert!(
        err.to_string()
            .contains("state budget reached: 1000 states"),
        "{err}"
    );
    assert_eq!(err.status(), xcall_core::Status::Limit);
    // The memory and time bounds stop it too, with the numbers reached.
    for (budget, what) in [
        (
            Budget {
                bytes: 1 << 20,
                ..Budget::default()
            },
            "memory budget reached",
        ),
        (
            Budget {
                time: std::time::Duration::ZERO,
                ..Budget::default()
            },
            "time budget reached",
        ),
    ] {
        let t0 = std::time::Instant::now();
        let err = verify_within(&big.protocol(9), &budget).unwrap_err();
        assert!(err.to_string().contains(what), "{err}");
        assert!(err.to_string().contains("bytes/state"), "{err}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "bounded");
    }
}

#[test]
fn huge_counts_are_refused_before_anything_is_laid_out() {
    // Wrapping thread counts: refused, never a plan of 0 threads.
    let e = PipelinePlan::new(&PipelineSpec::new(2, &[1024], u32::MAX)).unwrap_err();
    assert!(
        e.to_string().contains("threads per block exceed 1024"),
        "{e}"
    );
    // A stage count whose layout cannot fit shared memory: refused at once.
    let t0 = std::time::Instant::now();
    let e = PipelinePlan::new(&PipelineSpec::new(u32::MAX, &[16; 4], 1)).unwrap_err();
    assert!(e.to_string().contains("shared memory"), "{e}");
    assert!(t0.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn reports_are_deterministic() {
    // Callers size a buffer from one call and fill it in the next (C ABI).
    let plan = PipelinePlan::new(&PipelineSpec::new(3, &[1024, 2048], 2)).unwrap();
    let a = verify(&plan.protocol(7), DEFAULT_STATE_LIMIT).unwrap();
    let b = verify(&plan.protocol(7), DEFAULT_STATE_LIMIT).unwrap();
    assert_eq!(a.report(), b.report());
    let broken = shared_full_barrier(2, 2, 4096, 5);
    assert_eq!(
        verify(&broken, DEFAULT_STATE_LIMIT).unwrap().report(),
        verify(&broken, DEFAULT_STATE_LIMIT).unwrap().report()
    );
}

/// The first violation of `plan`'s own protocol over 5 iterations.
fn first_violation(plan: &PipelinePlan) -> xcall_warpspec::Violation {
    let v = verify(&plan.protocol(5), DEFAULT_STATE_LIMIT).unwrap();
    v.violation
        .clone()
        .unwrap_or_else(|| panic!("the edited plan must fail verification:\n{}", v.report()))
}

#[test]
fn the_verifier_judges_the_plans_own_tables() {
    // Planner mistakes written into a plan's tables, one at a time: the
    // protocol the verifier checks is read from those tables, so each fails.
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[1024, 1024], 2)).unwrap();
    assert!(verify(&plan.protocol(5), DEFAULT_STATE_LIMIT)
        .unwrap()
        .is_clean());
    let full0 = plan.group(BarrierKind::Full, 0).unwrap();
    let full1 = plan.group(BarrierKind::Full, 1).unwrap();

    // Both async warps arrive and copy on warp 0's FULL barriers (and the
    // compute warpgroups wait there).
    let mut shared = plan.clone();
    for role in &mut shared.roles {
        for action in &mut role.body {
            match action {
                Action::Wait { group }
                | Action::ArriveExpectTx { group, .. }
                | Action::Copy { group, .. }
                    if *group == full1 =>
                {
                    *group = full0
                }
                _ => {}
            }
        }
    }
    let v = first_violation(&shared);
    assert_eq!(v.kind, ViolationKind::ExcessArrival, "{v:?}");
    assert!(v.message.contains("FULL[w0]"), "{}", v.message);

    // EMPTY init counts for one compute warpgroup while two release.
    let mut counts = plan.clone();
    for b in counts
        .barriers
        .iter_mut()
        .filter(|b| b.kind == BarrierKind::Empty)
    {
        b.init_count = 128;
    }
    let v = first_violation(&counts);
    assert!(
        matches!(v.kind, ViolationKind::WrongPhase | ViolationKind::Overwrite),
        "{v:?}"
    );

    // A compute arrival count that does not match the init count.
    let mut arrivals = plan.clone();
    if let Some(Action::Arrive { count, .. }) = arrivals.roles[2].body.last_mut() {
        *count = 64;
    }
    assert_eq!(first_violation(&arrivals).kind, ViolationKind::Deadlock);

    // Compute starting on the producers' parity reads before the load.
    let mut early = plan.clone();
    for role in &mut early.roles {
        if matches!(role.kind, RoleKind::Compute { .. }) {
            role.start = PipelineState::PRODUCER_START;
        }
    }
    assert_eq!(first_violation(&early).kind, ViolationKind::ReadBeforeLoad);

    // Producers starting on the consumers' parity wait for a release that
    // never comes.
    let mut late = plan.clone();
    for role in &mut late.roles {
        if matches!(role.kind, RoleKind::Producer { .. }) {
            role.start = PipelineState::CONSUMER_START;
        }
    }
    let v = first_violation(&late);
    assert_eq!(v.kind, ViolationKind::Deadlock, "{v:?}");
    assert!(
        v.message.contains("wait EMPTY[w0][s0] phase 0"),
        "{}",
        v.message
    );
}

/// The bytes a `Limit` message says the tables held.
fn bytes_reached(err: &xcall_warpspec::PlanError) -> u64 {
    let m = err.to_string();
    let at = m
        .find(" bytes (")
        .unwrap_or_else(|| panic!("no bytes in {m}"));
    let digits = m[..at].rsplit(' ').next().unwrap();
    digits.parse().unwrap_or_else(|_| panic!("bytes in {m}"))
}

#[test]
fn the_memory_budget_is_checked_all_through_the_search() {
    // The mul op's default pipeline (2 x 16 KiB tiles, 2 compute
    // warpgroups): half the bytes its whole search needs stops it, at the
    // table growth that would pass them, long after its first states.
    let plan = xcall_warpspec::ops::OpConfig::default().plan(2).unwrap();
    let whole = verify(&plan.protocol(8), DEFAULT_STATE_LIMIT).unwrap();
    assert!(whole.is_clean(), "{}", whole.report());
    let budget = Budget {
        bytes: whole.bytes / 2,
        ..Budget::default()
    };
    let err = verify_within(&plan.protocol(8), &budget).unwrap_err();
    assert!(err.to_string().contains("memory budget reached"), "{err}");
    assert!(bytes_reached(&err) <= budget.bytes, "{err}");
    assert!(
        bytes_reached(&err) > budget.bytes / 2,
        "stopped early: {err}"
    );
}

#[test]
fn the_memory_budget_is_enforced_before_it_is_passed() {
    // A plan the planner accepts (8 stages, 4 async warps x 4 KiB, one
    // compute warpgroup) whose search without the reduction needs far more
    // than these budgets (with it, 239 states): each stops it with LIMIT
    // while the tables hold no more than it.
    let plan = PipelinePlan::new(&PipelineSpec::new(8, &[4096; 4], 1)).unwrap();
    for bytes in [1 << 20, 8 << 20] {
        let budget = Budget {
            bytes,
            ..Budget::default()
        };
        let err = verify_unreduced(&plan.protocol(17), &budget).unwrap_err();
        assert_eq!(err.status(), xcall_core::Status::Limit, "{err}");
        assert!(err.to_string().contains("memory budget reached"), "{err}");
        let reached = bytes_reached(&err);
        assert!(reached <= bytes, "the tables passed the budget: {err}");
        assert!(reached > bytes / 2, "stopped long before it: {err}");
    }
}

#[test]
fn a_deadlock_names_only_the_stuck_roles_and_their_barriers() {
    // FULL needs two arrivals but the producer makes one: compute waits on
    // stage 0 for ever, while the producer fills both stages and finishes
    // its two iterations.
    let plan = PipelinePlan::new(&PipelineSpec::new(2, &[1024], 1)).unwrap();
    let mut protocol = plan.protocol(2);
    for b in protocol
        .barriers
        .iter_mut()
        .filter(|b| b.name.starts_with("FULL"))
    {
        b.init_count = 2;
    }
    let v = verify(&protocol, DEFAULT_STATE_LIMIT).unwrap();
    let violation = v.violation.expect("an unreachable FULL count deadlocks");
    assert_eq!(violation.kind, ViolationKind::Deadlock, "{violation:?}");
    let m = &violation.message;
    assert!(
        m.contains("wait FULL[w0][s0] phase 0 (parity 0) on FULL[w0][s0] (phase 0, 1 arrival(s) and 0 tx byte(s) pending)"),
        "{m}"
    );
    assert!(!m.contains("producer"), "the producer finished: {m}");
}
