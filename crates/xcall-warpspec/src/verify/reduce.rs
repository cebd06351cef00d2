//! The partial-order reduction of the search: which in-flight completions
//! a state needs to explore now, and which can wait.
//!
//! # The objects an event touches
//!
//! Every event reads or writes a few objects of the state: a barrier (its
//! phase, pending arrivals and bytes), a buffer (its version, copies in
//! flight and readers), or a role's set of asynchronous reads (what its
//! `WaitAsyncReads` looks at). A role's step touches the objects of every
//! step of its atomic block at its program counter (and its own program
//! counter); the completion of an in-flight entry touches its buffer, its
//! barrier if it is a copy, and its role's asynchronous reads if it is a
//! read. Two events that touch no common object are independent: each one's
//! outcome (moved, blocked or a violation, and what it writes) depends only
//! on the objects it touches, so neither enables, disables or changes the
//! other, and both orders reach the same state.
//!
//! # The rule
//!
//! In a state, every role's step is explored, and the completion of an
//! in-flight entry is explored only when it is *relevant*: one of its
//! objects is touched by the current block of some unfinished role (blocked
//! or not), or by another in-flight entry. The others are *deferred*. When
//! no role can move and no completion is relevant, every completion is
//! explored.
//!
//! # Why no violation and no deadlock is lost
//!
//! The explored events `E` form a persistent set: along any path from the
//! state that uses only events outside `E`, each event is independent of
//! every event of `E`. Such a path holds only deferred completions (every
//! role's step is in `E`, and a completion moves no role, so no later step
//! of any role and no new in-flight entry appears on it). A deferred
//! completion shares no object with any role's current block nor with any
//! other entry, so it is independent of all of `E` and of the other
//! deferred ones. `E` holds an enabled event whenever the state has one
//! (completions are always enabled, hence the fallback above). Every state
//! graph of a protocol is finite and acyclic (each event either advances a
//! role or retires an in-flight entry that a role's step created), and on
//! such graphs a search that follows a persistent set in every state reaches
//! every terminal state the full search reaches. A violation is a step into
//! a terminal error state (its outcome depends only on the objects its event
//! touches, so independence keeps it too), and a deadlock is a terminal
//! state where not every role finished: both are kept. Every path of the
//! reduced search is a path of the full one, so its traces are real
//! interleavings; they are the shortest of the reduced search, which may be
//! longer than the shortest of all.
//!
//! The rule names roles and entries only through the objects they touch,
//! so it commutes with the permutations the symmetry reduction applies
//! (interchangeable roles, interchangeable producer warps): the reduced
//! graph is itself symmetric, and exploring it up to those permutations
//! keeps its terminal states up to renaming.
//!
//! What it saves: a producer's copies of later iterations land only when
//! the consumer reaches their stage, instead of in every order and at
//! every point in between.

use super::model::Model;
use super::protocol::Step;

/// A set of objects, one bit each: barriers, then buffers, then each
/// role's asynchronous reads.
pub(super) struct Objects {
    bits: Vec<u64>,
}

impl Objects {
    fn new(n: usize) -> Self {
        Objects {
            bits: vec![0; n.div_ceil(64)],
        }
    }

    fn add(&mut self, o: usize) {
        self.bits[o / 64] |= 1 << (o % 64);
    }

    fn has(&self, o: usize) -> bool {
        self.bits[o / 64] >> (o % 64) & 1 == 1
    }
}

impl Model<'_> {
    fn objects(&self) -> usize {
        self.barriers + self.buffers + self.roles
    }

    /// The objects step `step` of `role` at `stage` touches, passed to `f`.
    fn step_objects(&self, role: usize, stage: u32, step: &Step, mut f: impl FnMut(usize)) {
        let barrier = |g: usize| self.p.barrier_groups[g][stage as usize];
        let buffer = |g: usize| self.barriers + self.buffer_index[g][stage as usize];
        let reads = self.barriers + self.buffers + role;
        match step {
            Step::Wait { group, .. }
            | Step::Arrive { group, .. }
            | Step::ExpectTxArrive { group, .. } => f(barrier(*group)),
            Step::Copy {
                group,
                buffer_group,
                ..
            } => {
                f(barrier(*group));
                f(buffer(*buffer_group));
            }
            Step::Read { buffer_group } | Step::Write { buffer_group } => f(buffer(*buffer_group)),
            Step::ReadAsync { buffer_group } => {
                f(buffer(*buffer_group));
                f(reads);
            }
            Step::WaitAsyncReads => f(reads),
        }
    }

    /// The objects in-flight entry `k` of `s` touches, passed to `f`.
    fn entry_objects(&self, s: &[u32], k: usize, mut f: impl FnMut(usize)) {
        let role = (s[self.copies_at() + k] >> 24) as usize;
        let c = self.in_flight(s, k);
        f(self.barriers + self.buffer_index[c.buffer_group][c.stage]);
        match c.copy {
            Some((group, _, _)) => f(self.p.barrier_groups[group][c.stage]),
            None => f(self.barriers + self.buffers + role),
        }
    }

    /// Which in-flight entries of `s` (by index) must be completed now:
    /// `relevant[k]` per entry (see the module's rule).
    pub(super) fn relevant_entries(&self, s: &[u32]) -> Vec<bool> {
        let entries = s.len() - self.copies_at();
        if entries == 0 {
            return Vec::new();
        }
        let mut touched = Objects::new(self.objects());
        for (r, &at) in s[..self.roles].iter().enumerate() {
            if at >= self.program_len(r) {
                continue;
            }
            for pc in at..self.block_end(r, at) {
                let (_, stage, step) = self.locate(r, pc);
                self.step_objects(r, stage, step, |o| touched.add(o));
            }
        }
        let mut once = Objects::new(self.objects());
        let mut twice = Objects::new(self.objects());
        for k in 0..entries {
            self.entry_objects(s, k, |o| {
                if once.has(o) {
                    twice.add(o);
                }
                once.add(o);
            });
        }
        (0..entries)
            .map(|k| {
                let mut relevant = false;
                self.entry_objects(s, k, |o| relevant |= touched.has(o) || twice.has(o));
                relevant
            })
            .collect()
    }
}
