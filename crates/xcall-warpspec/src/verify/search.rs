//! The breadth-first search within a budget.

use std::time::Instant;

use super::model::{Event, Model, Outcome};
use super::protocol::{Budget, Protocol, Step, Verdict, Violation, ViolationKind};
use super::states::{Full, StateSet};
use crate::error::PlanError;

impl Event {
    fn code(self) -> u32 {
        match self {
            Event::Step(r) => u32::from(r) << 1,
            Event::Land(k) => u32::from(k) << 1 | 1,
        }
    }

    fn from_code(c: u32) -> Event {
        if c & 1 == 0 {
            Event::Step((c >> 1) as u16)
        } else {
            Event::Land((c >> 1) as u16)
        }
    }
}

/// Explores every interleaving of `protocol` (at most `state_limit` states)
/// and returns the verdict. Malformed protocols and protocols that exceed
/// the state limit are errors.
pub fn verify(protocol: &Protocol, state_limit: u64) -> Result<Verdict, PlanError> {
    verify_within(
        protocol,
        &Budget {
            states: state_limit,
            ..Budget::default()
        },
    )
}

/// [`verify`] within `budget`: the search stops with
/// [`PlanError::Limit`] at the first bound it reaches (states, bytes of its
/// tables, or time), naming the numbers reached.
pub fn verify_within(protocol: &Protocol, budget: &Budget) -> Result<Verdict, PlanError> {
    search(protocol, budget, true)
}

/// [`verify_within`] without the partial-order reduction (every step of
/// every role and every completion of an in-flight copy or read explored in
/// every state): the same verdicts, over many more states. For measuring
/// what the reduction saves, and for checking it.
pub fn verify_unreduced(protocol: &Protocol, budget: &Budget) -> Result<Verdict, PlanError> {
    search(protocol, budget, false)
}

fn search(protocol: &Protocol, budget: &Budget, reduce: bool) -> Result<Verdict, PlanError> {
    let started = Instant::now();
    let model = Model::new(protocol)?;
    let reduction = model.reduction();
    let init = model.canonical(model.initial());
    let mut states = StateSet::new(model.initial(), budget.bytes);
    let limit = |what: &str, states: &StateSet| {
        let bytes = states.bytes();
        PlanError::Limit(format!(
            "{what}: {} states, {bytes} bytes ({} bytes/state), {:.1?} (budget: {} states, {} bytes, {:?}); verify fewer iterations or a smaller pipeline",
            states.len(),
            bytes / states.len().max(1) as u64,
            started.elapsed(),
            budget.states,
            budget.bytes,
            budget.time
        ))
    };
    let full = |why: Full, states: &StateSet| match why {
        Full::Budget => limit("memory budget reached", states),
        Full::Allocation => limit("no memory for the search's tables", states),
    };
    if let Err(why) = states.insert(&init, None) {
        return Err(full(why, &states));
    }
    let trace_to = |id: u32, states: &StateSet| -> Vec<Event> {
        let mut events = Vec::new();
        let mut at = id;
        while let Some((parent, code)) = states.parent(at) {
            events.push(Event::from_code(code));
            at = parent;
        }
        events.reverse();
        events
    };
    // The recorded events lead through canonical states; the trace follows
    // them in a real execution, naming the interchangeable role that moved
    // there, and ends in that execution's state.
    // A violation's message is the one of that execution's last event.
    let replay = |events: &[Event]| -> (Vec<String>, Vec<u32>, Option<String>) {
        let (mut s, mut real) = (init.clone(), init.clone());
        let (mut lines, mut message) = (Vec::new(), None);
        for &e in events {
            let moved = model.real_event(&s, &real, e);
            lines.push(model.describe_event(&real, moved));
            match model.apply(&real, moved) {
                Outcome::Next(n) => real = n,
                Outcome::Violation(_, m) => message = Some(m),
                Outcome::Blocked => {}
            }
            if let Outcome::Next(n) = model.apply(&s, e) {
                s = model.canonical(n);
            }
        }
        (lines, real, message)
    };
    // Ids are in breadth-first order: the queue is the ids not yet expanded.
    let mut next = 0u32;
    let mut s = Vec::new();
    while (next as usize) < states.len() {
        let id = next;
        next += 1;
        // A state can cost up to a millisecond with many roles: look often.
        if id % 64 == 0 && started.elapsed() > budget.time {
            return Err(limit("time budget reached", &states));
        }
        states.get(id, &mut s);
        let mut moved = false;
        let events = model.events(&s);
        let mut outcomes: Vec<Option<Outcome>> =
            events.iter().map(|&e| Some(model.apply(&s, e))).collect();
        // A violation of any event of this state is real: report it even
        // when the reduction would not explore its event here.
        let violation = outcomes
            .iter()
            .position(|o| matches!(o, Some(Outcome::Violation(..))));
        let explored: Vec<usize> = if let Some(i) = violation {
            vec![i]
        } else if reduce {
            let enabled: Vec<bool> = outcomes
                .iter()
                .map(|o| !matches!(o, Some(Outcome::Blocked)))
                .collect();
            model.persistent(&reduction, &s, &events, &enabled)
        } else {
            (0..events.len()).collect()
        };
        for i in explored {
            let e = events[i];
            match outcomes[i].take().expect("each event is explored once") {
                Outcome::Blocked => {}
                Outcome::Next(n) => {
                    moved = true;
                    let n = model.canonical(n);
                    if states.len() as u64 >= budget.states.min(u32::MAX as u64 - 1) {
                        if !states.contains(&n) {
                            return Err(limit("state budget reached", &states));
                        }
                        continue;
                    }
                    if let Err(why) = states.insert(&n, Some((id, e.code()))) {
                        return Err(full(why, &states));
                    }
                }
                Outcome::Violation(kind, message) => {
                    let mut events = trace_to(id, &states);
                    events.push(e);
                    let (trace, _, real) = replay(&events);
                    return Ok(Verdict {
                        violation: Some(Violation {
                            kind,
                            message: real.unwrap_or(message),
                            trace,
                        }),
                        states: states.len() as u64,
                        bytes: states.bytes(),
                        elapsed: started.elapsed(),
                    });
                }
            }
        }
        let finished = (0..model.roles).all(|r| s[r] >= model.program_len(r));
        if !moved && !finished {
            let events = trace_to(id, &states);
            let (trace, end, _) = replay(&events);
            let waits: Vec<String> = (0..model.roles)
                .filter(|&r| end[r] < model.program_len(r))
                .map(|r| {
                    let (i, stage, step) = model.locate(r, end[r]);
                    let on = match step {
                        Step::Wait { group, .. } => {
                            format!(
                                " on {}",
                                model.describe_barrier(
                                    &end,
                                    protocol.barrier_groups[*group][stage as usize]
                                )
                            )
                        }
                        _ => String::new(),
                    };
                    let _ = i;
                    format!("{}{on}", model.describe_step(&end, r))
                })
                .collect();
            return Ok(Verdict {
                violation: Some(Violation {
                    kind: ViolationKind::Deadlock,
                    message: format!("no role can move: {}", waits.join("; ")),
                    trace,
                }),
                states: states.len() as u64,
                bytes: states.bytes(),
                elapsed: started.elapsed(),
            });
        }
    }
    Ok(Verdict {
        violation: None,
        states: states.len() as u64,
        bytes: states.bytes(),
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::protocol::DEFAULT_STATE_LIMIT;
    use super::*;

    #[test]
    fn a_verdict_is_clean_exactly_without_a_violation() {
        let broken = crate::designs::shared_full_barrier(2, 2, 1024, 3);
        let v = verify(&broken, DEFAULT_STATE_LIMIT).unwrap();
        assert!(v.violation.is_some());
        assert!(!v.is_clean());
        let good = crate::designs::prologue_empty_arrive(2, 2, 1, false, 3);
        let v = verify(&good, DEFAULT_STATE_LIMIT).unwrap();
        assert!(v.violation.is_none(), "{}", v.report());
        assert!(v.is_clean());
    }
}
