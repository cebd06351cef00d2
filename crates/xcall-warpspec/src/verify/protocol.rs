//! The declarations of a barrier protocol, the verdict of its search and
//! the budget the search runs within.

use std::fmt::Write as _;
use std::time::Duration;

/// A barrier of a protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BarrierDecl {
    /// Name in traces, for example `FULL[w0][s1]`.
    pub name: String,
    /// Arrivals per phase.
    pub init_count: u32,
}

/// One step of a role's program. `group` indexes
/// [`Protocol::barrier_groups`] (one barrier per stage; the stage is the
/// iteration modulo the stage count); `phase_offset` is added to the
/// iteration's round (`iteration / stages`) to give the phase the step is
/// meant for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `try_wait.parity` until the intended phase has completed.
    Wait {
        /// Barrier group.
        group: usize,
        /// Phase offset from the round.
        phase_offset: i32,
    },
    /// `mbarrier.arrive` with a count.
    Arrive {
        /// Barrier group.
        group: usize,
        /// Phase offset from the round.
        phase_offset: i32,
        /// Arrivals.
        count: u32,
    },
    /// `mbarrier.arrive.expect_tx`: expect `bytes`, then arrive once.
    ExpectTxArrive {
        /// Barrier group.
        group: usize,
        /// Phase offset from the round.
        phase_offset: i32,
        /// Transaction bytes expected.
        bytes: u64,
    },
    /// Issue an async bulk copy of `bytes` into the stage's buffer of
    /// `buffer_group`, completing `bytes` on the barrier when it lands.
    Copy {
        /// Barrier group the copy completes on.
        group: usize,
        /// Buffer group written.
        buffer_group: usize,
        /// Phase offset from the round.
        phase_offset: i32,
        /// Bytes copied.
        bytes: u64,
    },
    /// Read the stage's buffer of `buffer_group` (needs this iteration's
    /// load landed; releases the reader's claim on it).
    Read {
        /// Buffer group read.
        buffer_group: usize,
    },
    /// Write the stage's buffer of `buffer_group` with ordinary stores of
    /// the role's own threads (a producer that is not a bulk copy): done
    /// when the step is, so a later plain `Arrive` publishes it. Like a
    /// copy, it may not overwrite a buffer whose readers have not released
    /// it.
    Write {
        /// Buffer group written.
        buffer_group: usize,
    },
    /// Issue an asynchronous read of the stage's buffer of `buffer_group`
    /// (a `wgmma` operand or a bulk copy out of shared memory): it needs
    /// this iteration's load landed when issued, and it holds the reader's
    /// claim until it completes, its own event at any later point. Only in
    /// the body.
    ReadAsync {
        /// Buffer group read.
        buffer_group: usize,
    },
    /// Wait until every asynchronous read this role issued has completed
    /// (`wgmma.wait_group 0`, or `cp.async.bulk.wait_group.read 0` with the
    /// proxy fence): the only way a release after it is safe.
    WaitAsyncReads,
}

/// A role (one warp or warpgroup acting through an elected thread).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleDecl {
    /// Name in traces.
    pub name: String,
    /// Steps run once before the first iteration, each with its stage
    /// (round 0).
    pub prologue: Vec<(u32, Step)>,
    /// Steps run every iteration.
    pub body: Vec<Step>,
}

/// A barrier protocol to verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// Stages (barrier and buffer groups have one entry per stage).
    pub stages: u32,
    /// Every barrier.
    pub barriers: Vec<BarrierDecl>,
    /// Barrier groups: `[group][stage]` -> barrier index.
    pub barrier_groups: Vec<Vec<usize>>,
    /// Buffer groups: `[group][stage]` -> buffer name.
    pub buffer_groups: Vec<Vec<String>>,
    /// The roles.
    pub roles: Vec<RoleDecl>,
    /// Iterations every role runs.
    pub iterations: u32,
}

/// The kinds of violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ViolationKind {
    /// No role can move and not all have finished.
    Deadlock,
    /// A copy was issued into a buffer a reader had not released.
    Overwrite,
    /// A buffer was read before its load for this iteration landed.
    ReadBeforeLoad,
    /// More arrivals than the init count in one phase.
    ExcessArrival,
    /// An arrival or transaction landed in another phase than meant.
    WrongPhase,
    /// A parity wait on a phase that is neither current nor preceding.
    ParityOutOfRange,
}

/// A violation with its shortest trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// What went wrong.
    pub kind: ViolationKind,
    /// One line saying where.
    pub message: String,
    /// The events from the start that lead to it, the last one included.
    pub trace: Vec<String>,
}

/// The result of a verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The first (shortest) violation found, or `None` when every
    /// interleaving is clean.
    pub violation: Option<Violation>,
    /// Distinct states explored.
    pub states: u64,
    /// Bytes the search's tables held at the end.
    pub bytes: u64,
    /// Time taken.
    pub elapsed: Duration,
}

impl Verdict {
    /// Whether no violation was found.
    pub fn is_clean(&self) -> bool {
        self.violation.is_none()
    }

    /// A readable report: the verdict, the states explored, and for a
    /// violation its trace. Deterministic (the time taken is in `elapsed`),
    /// so the same protocol always gives the same text.
    pub fn report(&self) -> String {
        let mut out = String::new();
        match &self.violation {
            None => {
                let _ = writeln!(out, "clean: {} states explored", self.states);
            }
            Some(v) => {
                let _ = writeln!(out, "VIOLATION ({:?}): {}", v.kind, v.message);
                let _ = writeln!(out, "shortest trace ({} events):", v.trace.len());
                for (i, line) in v.trace.iter().enumerate() {
                    let _ = writeln!(out, "  {:>3}. {line}", i + 1);
                }
                let _ = writeln!(out, "{} states explored", self.states);
            }
        }
        out
    }
}

/// Default bound on explored states (a protocol needing more is refused
/// rather than exhausting memory).
pub const DEFAULT_STATE_LIMIT: u64 = 20_000_000;
/// Default bound on the memory of a search (states, their index and the
/// search tree), in bytes.
pub const DEFAULT_MEMORY_LIMIT: u64 = 2 << 30;
/// Default bound on the time of a search.
pub const DEFAULT_TIME_LIMIT: Duration = Duration::from_secs(60);

/// What one search may spend; reaching any bound is a
/// [`PlanError::Limit`] that gives the states, bytes and time reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Distinct states.
    pub states: u64,
    /// Bytes of the search's own tables.
    pub bytes: u64,
    /// Wall-clock time.
    pub time: Duration,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            states: DEFAULT_STATE_LIMIT,
            bytes: DEFAULT_MEMORY_LIMIT,
            time: DEFAULT_TIME_LIMIT,
        }
    }
}
