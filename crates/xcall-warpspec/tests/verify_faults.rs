//! Faults of warp-specialized pipelines the verifier must refuse with a
//! trace, each beside its fix, which must verify clean.

use xcall_warpspec::designs::{
    async_read_release, lapped_consumer, leader_release, store_producer_cycle,
};
use xcall_warpspec::verify::{verify, Protocol, DEFAULT_STATE_LIMIT};
use xcall_warpspec::{Violation, ViolationKind};

const STAGES: u32 = 2;
const ITERATIONS: u32 = 2 * STAGES + 1;

fn refused(p: &Protocol) -> Violation {
    let v = verify(p, DEFAULT_STATE_LIMIT).unwrap();
    let report = v.report();
    print!("{report}");
    let violation = v
        .violation
        .unwrap_or_else(|| panic!("the fault must be refused:\n{report}"));
    assert!(!violation.trace.is_empty(), "{violation:?}");
    violation
}

fn clean(p: &Protocol) {
    let v = verify(p, DEFAULT_STATE_LIMIT).unwrap();
    assert!(v.is_clean(), "the fix must verify clean:\n{}", v.report());
}

#[test]
fn a_leader_warp_releasing_before_its_siblings_is_refused() {
    let v = refused(&leader_release(STAGES, 3, false, ITERATIONS));
    assert_eq!(v.kind, ViolationKind::Overwrite, "{v:?}");
    assert!(v.message.starts_with("producer w0"), "{}", v.message);
    assert!(v.message.contains("BUF[w0][s0]"), "{}", v.message);
    // The leader's release is in the trace, and the sibling that had not
    // read yet holds the buffer.
    assert!(
        v.trace
            .iter()
            .any(|l| l.starts_with("compute wg0 warp 0 (leader)")
                && l.contains("arrive x1 on EMPTY")),
        "{:?}",
        v.trace
    );
    clean(&leader_release(STAGES, 3, true, ITERATIONS));
}

#[test]
fn a_release_while_an_async_read_is_in_flight_is_refused() {
    let v = refused(&async_read_release(STAGES, false, ITERATIONS));
    assert_eq!(v.kind, ViolationKind::Overwrite, "{v:?}");
    assert!(v.message.contains("copy into BUF[w0][s0]"), "{}", v.message);
    assert!(
        v.trace
            .iter()
            .any(|l| l.contains("issue an asynchronous read of BUF[w0][s0]")),
        "{:?}",
        v.trace
    );
    // The read never completed before the refill.
    assert!(
        !v.trace.iter().any(|l| l.starts_with("asynchronous read")),
        "{:?}",
        v.trace
    );
    clean(&async_read_release(STAGES, true, ITERATIONS));
}

#[test]
fn a_consumer_a_lap_from_its_producer_is_refused() {
    let v = refused(&lapped_consumer(STAGES, false, ITERATIONS));
    assert_eq!(v.kind, ViolationKind::ParityOutOfRange, "{v:?}");
    assert!(
        v.message.starts_with("epilogue w1 (iteration 0)"),
        "{}",
        v.message
    );
    assert!(v.message.contains("FULL[w0][s0] (phase 2"), "{}", v.message);
    clean(&lapped_consumer(STAGES, true, ITERATIONS));
}

#[test]
fn a_back_pressure_cycle_through_a_store_producer_is_refused() {
    let v = refused(&store_producer_cycle(STAGES, false, ITERATIONS));
    assert_eq!(v.kind, ViolationKind::Deadlock, "{v:?}");
    let m = &v.message;
    assert!(
        m.contains("producer w1 (stores) (iteration 0): wait EMPTY[w1][s0] phase 0"),
        "{m}"
    );
    assert!(
        m.contains("compute wg0 (iteration 0): wait FULL[w0][s0]"),
        "{m}"
    );
    clean(&store_producer_cycle(STAGES, true, ITERATIONS));
}

#[test]
fn stores_into_a_buffer_still_read_are_an_overwrite() {
    // The store producer with no back-pressure at all: its stores of the
    // next round land on a buffer the compute warpgroup has not released,
    // caught at the stores (they are not a copy).
    let mut p = store_producer_cycle(STAGES, true, ITERATIONS);
    p.roles[1].body.remove(0);
    let v = refused(&p);
    assert_eq!(v.kind, ViolationKind::Overwrite, "{v:?}");
    assert!(
        v.message
            .starts_with("producer w1 (stores) (iteration 2): stores into BUF[w1][s0]"),
        "{}",
        v.message
    );
}

#[test]
fn copies_and_async_reads_in_a_prologue_are_malformed() {
    let mut p = async_read_release(STAGES, true, ITERATIONS);
    p.roles[1].prologue.push((
        0,
        xcall_warpspec::verify::Step::ReadAsync { buffer_group: 0 },
    ));
    let e = verify(&p, DEFAULT_STATE_LIMIT).unwrap_err();
    assert!(e.to_string().contains("belong in the body"), "{e}");
}
