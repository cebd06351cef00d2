//! The search's partial-order reduction: the same verdicts as the full
//! search over far fewer states, faults of one warp in a late lap still
//! found, and the 8-stage, 4-warp plan within a small budget.

use std::time::Duration;

use xcall_warpspec::designs::{
    async_read_release, lapped_consumer, leader_release, prologue_empty_arrive,
    shared_full_barrier, store_producer_cycle,
};
use xcall_warpspec::verify::{verify_unreduced, verify_within, Budget, Protocol, Step, Verdict};
use xcall_warpspec::{PipelinePlan, PipelineSpec};

fn both(p: &Protocol) -> (Verdict, Verdict) {
    let reduced = verify_within(p, &Budget::default()).unwrap();
    let full = verify_unreduced(p, &Budget::default()).unwrap();
    (reduced, full)
}

fn plan(stages: u32, warps: usize, compute: u32) -> PipelinePlan {
    PipelinePlan::new(&PipelineSpec::new(stages, &vec![4096; warps], compute)).unwrap()
}

#[test]
fn the_reduction_keeps_every_verdict_over_far_fewer_states() {
    // (stages, async warps, compute warpgroups, the least saving)
    for (stages, warps, compute, saving) in [(4, 2, 1, 5), (3, 3, 1, 5), (2, 2, 2, 1)] {
        let p = plan(stages, warps, compute).protocol(2 * stages + 1);
        let (reduced, full) = both(&p);
        assert!(reduced.is_clean(), "{}", reduced.report());
        assert!(full.is_clean(), "{}", full.report());
        println!(
            "{stages} stages, {warps} warps, {compute} wg: {} states reduced, {} full",
            reduced.states, full.states
        );
        assert!(
            reduced.states * saving < full.states,
            "{stages} stages, {warps} warps: the reduction saved little: {} of {} states",
            reduced.states,
            full.states
        );
    }
    // Every fault design: refused both ways, with the same kind.
    let faults = [
        shared_full_barrier(2, 2, 1024, 5),
        leader_release(2, 3, false, 5),
        async_read_release(2, false, 5),
        lapped_consumer(2, false, 5),
        store_producer_cycle(2, false, 5),
        prologue_empty_arrive(2, 2, 1, true, 5),
    ];
    for p in &faults {
        let (reduced, full) = both(p);
        let (r, f) = (reduced.violation.unwrap(), full.violation.unwrap());
        assert_eq!(r.kind, f.kind, "{r:?}\n{f:?}");
        assert!(!r.trace.is_empty());
    }
}

/// The planner's plan with the EMPTY wait removed from one producer warp:
/// it refills its buffers without waiting for the consumer, which only
/// shows once it runs a lap ahead (its next arrival lands in a phase that
/// has not completed yet).
fn one_warp_without_back_pressure(stages: u32, warps: usize, warp: usize) -> Protocol {
    let mut p = plan(stages, warps, 1).protocol(2 * stages + 1);
    let name = format!("producer w{warp}");
    let role = p.roles.iter_mut().find(|r| r.name == name).unwrap();
    let before = role.body.len();
    role.body.retain(|s| !matches!(s, Step::Wait { .. }));
    assert!(role.body.len() < before, "the producer waited on EMPTY");
    p
}

#[test]
fn a_fault_of_one_warp_in_a_late_lap_is_still_found() {
    for warp in [0, 2] {
        let p = one_warp_without_back_pressure(3, 3, warp);
        let (reduced, full) = both(&p);
        let report = reduced.report();
        let v = reduced
            .violation
            .unwrap_or_else(|| panic!("refused with the reduction:\n{report}"));
        let f = full.violation.unwrap();
        assert_eq!(f.kind, v.kind, "{v:?}\n{f:?}");
        // The warp at fault, in its second lap (iteration 3 of 3 stages).
        assert!(
            v.message
                .starts_with(&format!("producer w{warp} (iteration 3)")),
            "{}",
            v.message
        );
        assert!(!v.trace.is_empty());
    }
}

#[test]
fn the_eight_stage_four_warp_plan_verifies_within_a_small_budget() {
    // Its first laps; the bench reports the default 17 iterations.
    let p = plan(8, 4, 1).protocol(4);
    let budget = Budget {
        bytes: 100 << 20,
        time: Duration::from_secs(120),
        ..Budget::default()
    };
    let v = verify_within(&p, &budget).unwrap();
    assert!(v.is_clean(), "{}", v.report());
    assert!(v.bytes <= 100 << 20);
    println!(
        "8 stages, 4 warps, 4 iterations: {} states, {} bytes",
        v.states, v.bytes
    );
}
