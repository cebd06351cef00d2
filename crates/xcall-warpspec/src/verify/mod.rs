//! The explicit-state model checker of barrier protocols.
//!
//! A [`Protocol`] is a set of roles (producer warps, compute warpgroups),
//! each running a program of barrier steps for a number of iterations,
//! over mbarriers with PTX semantics:
//! - a barrier has a phase, pending arrivals and a signed transaction count;
//!   a phase completes when both reach zero, then the phase advances and the
//!   pending count reloads from the init count;
//! - `try_wait.parity` is only meaningful for the current phase (blocks) or
//!   the preceding one (passes); any other wait is reported;
//! - an async copy's completion (`complete_tx`) is its own event and may land
//!   at any later point, before or after other roles' steps.
//!
//! Every step names the phase it is meant for (the iteration's round plus
//! an offset), so an arrival or a transaction that lands in another phase
//! (a barrier that flipped early or late) is caught where it
//! happens. The explorer also reports deadlocks, stage buffers overwritten
//! before every reader released them, reads before a buffer's load
//! completed, and arrivals beyond the init count. The search is breadth-first,
//! so a violation comes with a shortest trace of the reduced search (below),
//! replayed as a real interleaving.
//!
//! Granularity (what keeps the state space small): a role's consecutive
//! waits are one atomic step (it proceeds when all of them pass), and so are
//! its consecutive non-blocking operations (arrivals, copy issues, reads);
//! copy completions stay separate events that interleave anywhere. This can
//! only add reports for designs that read or overwrite without waiting, never
//! hide a race between blocking points. Roles with identical programs that
//! issue no copies (the compute warpgroups) are interchangeable, so states
//! that differ only by permuting them are explored once. In each state only
//! a persistent set of events is explored (`reduce`, a partial-order
//! reduction that keeps every violation and deadlock; its argument is
//! there): a role steps, and a copy completes, only where something that
//! must happen there could be disturbed by it, so producers do not fill
//! later stages in every order while the compute role is elsewhere;
//! [`verify_unreduced`] explores every event.
//!
//! Modules: [`protocol`] (the declarations a search reads and the verdict
//! it gives), `states` (the packed table of explored states), `model` (the
//! state layout and the semantics of one step), `reduce` (which events a
//! state explores), `describe` (trace lines) and `search` (the
//! breadth-first search within a budget).

mod describe;
mod model;
pub mod protocol;
mod reduce;
mod search;
mod states;

pub use protocol::{
    BarrierDecl, Budget, Protocol, RoleDecl, Step, Verdict, Violation, ViolationKind,
    DEFAULT_MEMORY_LIMIT, DEFAULT_STATE_LIMIT, DEFAULT_TIME_LIMIT,
};
pub use search::{verify, verify_unreduced, verify_within};
