//! The search's reductions: the same verdicts as the full search over far
//! fewer states (on the designs, on faults of one warp in a late lap, on a
//! role that ends its own wait, and on random protocols), the 8-stage,
//! 4-warp plan at its default iterations within a second, interchangeable
//! compute warpgroups explored once and only those, and traces through them
//! that are real executions.

use std::time::Duration;

use xcall_warpspec::designs::{
    async_read_release, lapped_consumer, leader_release, prologue_empty_arrive,
    shared_full_barrier, store_producer_cycle,
};
use xcall_warpspec::verify::{
    verify_unreduced, verify_within, Budget, Protocol, Step, Verdict, ViolationKind,
};
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

#[test]
fn the_eight_stage_four_warp_plan_verifies_at_its_default_iterations_in_a_second() {
    // The planner's 8-stage plan of 4 async warps x 4 KiB and one compute
    // warpgroup at 2 x stages + 1 iterations: within 1 s and 100 MB even in
    // a debug build. The compute role moves alone while it can and only the
    // producers a stage still needs move when it waits: a few hundred
    // states (the search without the reduction passes 2 million by 8
    // iterations).
    let p = plan(8, 4, 1).protocol(17);
    let budget = Budget {
        bytes: 100 << 20,
        time: Duration::from_secs(1),
        ..Budget::default()
    };
    let v = verify_within(&p, &budget).unwrap();
    assert!(v.is_clean(), "{}", v.report());
    assert!(v.states < 1_000, "{} states", v.states);
    println!(
        "8 stages, 4 warps, 17 iterations: {} states, {} bytes, {:?}",
        v.states, v.bytes, v.elapsed
    );
    // Four more iterations, one more stage of each lap: a few more states,
    // not a product of them.
    let more = verify_within(&plan(8, 4, 1).protocol(21), &budget).unwrap();
    assert!(more.is_clean(), "{}", more.report());
    assert!(
        more.states < v.states * 2,
        "{} then {}",
        v.states,
        more.states
    );
}

#[test]
fn a_role_past_its_own_arrival_is_followed_through_its_wait() {
    // The store producer's arrival on its FULL barrier moved into the
    // compute role, just before the compute role waits there: its own
    // arrival completes the phase, so it goes on to read the store
    // producer's buffer before the stores. The reduction must not take
    // that wait for one only others can end (found by the random test
    // below when it did).
    let mut p = store_producer_cycle(3, true, 2);
    assert!(matches!(p.roles[1].body.pop(), Some(Step::Arrive { .. })));
    let compute = &mut p.roles[2].body;
    let (wait_full_w1, arrive_full_w1) = (
        compute.remove(1),
        Step::Arrive {
            group: 2,
            phase_offset: 0,
            count: 1,
        },
    );
    compute.insert(1, arrive_full_w1);
    compute.insert(2, wait_full_w1);
    let (reduced, full) = both(&p);
    let f = full.violation.unwrap();
    let r = reduced
        .violation
        .clone()
        .unwrap_or_else(|| panic!("missed with the reduction:\n{}", reduced.report()));
    assert_eq!(f.kind, ViolationKind::ReadBeforeLoad, "{f:?}");
    assert_eq!(r.kind, f.kind, "{r:?}");
    assert!(r.message.contains("reads BUF[w1][s0]"), "{}", r.message);
}

/// A fixed-seed generator (xorshift64*), so a failing case can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn coin(&mut self) -> bool {
        self.below(2) == 1
    }
}

/// A small protocol: a planner's plan or a hand-written design.
fn random_base(rng: &mut Rng) -> Protocol {
    let stages = 1 + rng.below(3) as u32;
    let iterations = 1 + rng.below(2 * stages as usize + 2) as u32;
    let warps = 1 + rng.below(3);
    match rng.below(10) {
        0..=3 => plan(stages, warps, 1 + rng.below(2) as u32).protocol(iterations),
        4 => leader_release(stages, 1 + rng.below(3) as u32, rng.coin(), iterations),
        5 => async_read_release(stages, rng.coin(), iterations),
        6 => lapped_consumer(stages, rng.coin(), iterations),
        7 => store_producer_cycle(stages, rng.coin(), iterations),
        8 => prologue_empty_arrive(
            stages,
            warps,
            1 + rng.below(2) as u32,
            rng.coin(),
            iterations,
        ),
        _ => shared_full_barrier(stages, warps, 1024, iterations),
    }
}

/// One random edit of the kind a wrong planner or a wrong hand-written
/// kernel makes: counts, missing, repeated or reordered steps, phases,
/// groups, asynchronous reads, stores instead of copies, prologue arrivals,
/// a barrier a role arrives on and then waits on.
fn mutate(p: &mut Protocol, rng: &mut Rng) {
    let r = rng.below(p.roles.len());
    let (groups, buffers, stages) = (p.barrier_groups.len(), p.buffer_groups.len(), p.stages);
    let body = &mut p.roles[r].body;
    let j = rng.below(body.len());
    match rng.below(11) {
        0 => {
            let b = rng.below(p.barriers.len());
            let c = &mut p.barriers[b].init_count;
            *c = [c.saturating_sub(1), *c + 1, *c * 2, (*c / 2).max(1)][rng.below(4)];
        }
        1 if body.len() > 1 => {
            body.remove(j);
        }
        2 if body.len() > 1 => {
            let next = (j + 1) % body.len();
            body.swap(j, next);
        }
        3 => match &mut body[j] {
            Step::Wait { phase_offset, .. }
            | Step::Arrive { phase_offset, .. }
            | Step::ExpectTxArrive { phase_offset, .. }
            | Step::Copy { phase_offset, .. } => *phase_offset += [-1, 1][rng.below(2)],
            _ => {}
        },
        4 => {
            let step = body[j].clone();
            body.insert(j, step);
        }
        5 => {
            if let Step::Arrive { count, .. } = &mut body[j] {
                *count = [count.saturating_sub(1).max(1), *count + 1, *count * 2][rng.below(3)];
            }
        }
        6 => {
            if let Step::Read { buffer_group } = body[j] {
                body[j] = Step::ReadAsync { buffer_group };
                if rng.coin() {
                    body.insert(j + 1, Step::WaitAsyncReads);
                }
            }
        }
        7 => {
            if let Step::Copy { buffer_group, .. } = body[j] {
                body[j] = Step::Write { buffer_group };
            }
        }
        8 => {
            let group = rng.below(groups);
            p.roles[r].prologue.push((
                rng.below(stages as usize) as u32,
                Step::Arrive {
                    group,
                    phase_offset: 0,
                    count: 1,
                },
            ));
        }
        9 => {
            // A role that arrives on a barrier and then waits on it (a
            // named barrier between warps).
            let group = rng.below(groups);
            body.insert(
                j,
                Step::Wait {
                    group,
                    phase_offset: 0,
                },
            );
            body.insert(
                j,
                Step::Arrive {
                    group,
                    phase_offset: 0,
                    count: 1,
                },
            );
        }
        _ => match &mut body[j] {
            Step::Wait { group, .. }
            | Step::Arrive { group, .. }
            | Step::ExpectTxArrive { group, .. } => *group = rng.below(groups),
            Step::Copy { buffer_group, .. }
            | Step::Read { buffer_group }
            | Step::ReadAsync { buffer_group }
            | Step::Write { buffer_group } => *buffer_group = rng.below(buffers),
            Step::WaitAsyncReads => {}
        },
    }
}

#[test]
fn the_reduction_agrees_with_the_full_search_on_random_protocols() {
    // Plans and designs with random edits: whenever the full search
    // finishes, the reduced one finishes too and refuses exactly what the
    // full one refuses (its violations are real by construction; a missed
    // one is the reduction's fault). XCALL_VERIFY_RANDOM_CASES for more.
    let cases: usize = std::env::var("XCALL_VERIFY_RANDOM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let budget = Budget {
        states: 100_000,
        ..Budget::default()
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut refused, mut clean, mut skipped) = (0, 0, 0);
    for case in 0..cases {
        let mut p = random_base(&mut rng);
        for _ in 0..rng.below(4) {
            mutate(&mut p, &mut rng);
        }
        let full = match verify_unreduced(&p, &budget) {
            Ok(v) => v,
            Err(_) => {
                skipped += 1;
                continue;
            }
        };
        let reduced = verify_within(&p, &budget).unwrap_or_else(|e| {
            panic!("case {case}: the full search finished, not the reduced one: {e}\n{p:?}")
        });
        assert_eq!(
            reduced.is_clean(),
            full.is_clean(),
            "case {case}:\n{p:?}\nreduced:\n{}\nfull:\n{}",
            reduced.report(),
            full.report()
        );
        if full.is_clean() {
            // Every state of the reduced search is one of the full search.
            assert!(reduced.states <= full.states, "case {case}");
            clean += 1;
        } else {
            refused += 1;
        }
    }
    println!("{refused} refused, {clean} clean, {skipped} malformed or too large");
    assert!(
        refused > cases / 4 && clean > cases / 10,
        "{refused} refused, {clean} clean"
    );
}

#[test]
fn a_trace_through_interchangeable_roles_is_a_real_execution() {
    // Two identical compute warpgroups are explored up to which of them is
    // which; the trace still follows one real execution: each warpgroup's
    // lines are its own program in order (wait, then read and release, per
    // iteration), whichever one moved ahead. EMPTY counts one warpgroup's
    // release, so the second one's lands in the next phase.
    let mut p = plan(2, 1, 2).protocol(5);
    for b in p
        .barriers
        .iter_mut()
        .filter(|b| b.name.starts_with("EMPTY"))
    {
        b.init_count = 128;
    }
    let v = verify_within(&p, &Budget::default()).unwrap();
    let violation = v.violation.clone().expect("refused");
    let mut seen = std::collections::HashMap::<String, usize>::new();
    for line in &violation.trace {
        let Some(at) = line.find(" (iteration ") else {
            continue;
        };
        let role = &line[..at];
        if !role.starts_with("compute wg") {
            continue;
        }
        let iteration: usize = line[at + 12..line.find(')').unwrap()].parse().unwrap();
        let k = seen.entry(role.to_string()).or_default();
        let wait = line.contains("): wait");
        assert_eq!(
            (iteration, wait),
            (*k / 2, *k % 2 == 0),
            "{role}'s block {k} out of its program order:\n{}",
            v.report()
        );
        *k += 1;
    }
    assert_eq!(seen.len(), 2, "both warpgroups moved:\n{}", v.report());
    // The message names the warpgroup whose step of the trace broke a rule.
    let last = violation.trace.last().unwrap();
    let who = &last[..last.find("): ").unwrap() + 1];
    assert!(violation.message.starts_with(who), "{}", v.report());
}

#[test]
fn identical_roles_that_issue_asynchronous_reads_stay_apart() {
    // Two compute warpgroups with the same program of fenced asynchronous
    // reads: clean. Their in-flight reads name the warpgroup that waits for
    // them, so the two are not interchangeable; exploring them as one would
    // let a warpgroup's wait pass on the other's reads and release a stage
    // still being read.
    let mut p = async_read_release(2, true, 5);
    let mut second = p.roles[1].clone();
    second.name = "compute wg1".into();
    p.roles.push(second);
    for b in p
        .barriers
        .iter_mut()
        .filter(|b| b.name.starts_with("EMPTY"))
    {
        b.init_count = 2;
    }
    let (reduced, full) = both(&p);
    assert!(full.is_clean(), "{}", full.report());
    assert!(reduced.is_clean(), "{}", reduced.report());
}

#[test]
fn identical_compute_warpgroups_are_explored_once() {
    // Two compute warpgroups with one program are explored up to which is
    // which; the same protocol with the second warpgroup's release split
    // into two arrivals of 64 (the same behaviour, another program) is
    // explored in both orders, over more states.
    let same = plan(4, 2, 2).protocol(9);
    let mut apart = same.clone();
    let wg1 = &mut apart.roles[3].body;
    let at = wg1
        .iter()
        .position(|s| matches!(s, Step::Arrive { .. }))
        .unwrap();
    let Step::Arrive {
        group,
        phase_offset,
        count: 128,
    } = wg1[at].clone()
    else {
        panic!("a release of 128 arrivals: {wg1:?}")
    };
    let half = Step::Arrive {
        group,
        phase_offset,
        count: 64,
    };
    wg1[at] = half.clone();
    wg1.insert(at, half);
    let (a, b) = (both(&same).0, both(&apart).0);
    assert!(a.is_clean() && b.is_clean(), "{}{}", a.report(), b.report());
    println!("{} states as one, {} apart", a.states, b.states);
    assert!(a.states * 3 < b.states * 2, "{} and {}", a.states, b.states);
}
