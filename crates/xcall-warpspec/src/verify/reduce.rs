//! The partial-order reduction of the search: which of a state's events
//! are explored (a persistent set), and why no violation and no deadlock is
//! lost.
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
//! # How far a role can get without a set of events
//!
//! Let `T` be a set of roles and in-flight entries of a state `s`. A path
//! *outside `T`* is a path from `s` whose events are steps of roles not in
//! `T` and completions of entries not in `T` (or created on the path). A
//! barrier is *fixed outside `T` for role `q`* when no role but `q` that is
//! not in `T` has a step left in its program that arrives on it or copies
//! into it (`Reduction::last_change`, from the whole rest of its program), no
//! entry outside `T` completes on it, and `q` itself does not change it
//! before the point considered. A wait block of `q` is *frozen* when, in
//! order, its waits are on barriers fixed for `q` and the first one that
//! does not pass in `s` blocks (evaluated on `s`'s barriers): on any path
//! outside `T` those barriers keep their values (below), so `q` reaches that
//! block and stays there. The *reach* of `q` is the set of objects of its
//! steps from its program counter up to its first frozen block (to its end
//! when there is none), copies and asynchronous reads included, since their
//! entries touch a subset of their steps' objects.
//!
//! # The rule
//!
//! For a seed event enabled in `s`, `T` starts as its role or entry and
//! grows until it is closed: every entry not in `T` that touches an object
//! of `T` joins, and so does every role not in `T` whose reach (computed
//! for the `T` of that moment; it only shrinks as `T` grows) touches one.
//! The objects of `T` are those of each entry in `T`, of the current block
//! of each role in `T` that can step, and, for a role in `T` that is
//! blocked, those of its block's waits up to the first one that blocks
//! (nothing else can unblock it). Blocked roles join first, then enabled
//! ones one at a time, first the one after which the fewest others still
//! touch the set (a role frozen by a later member stays out). The
//! explored events are the enabled events of `T` (a violation counts as
//! enabled); of every seed's closure the search takes one with the fewest.
//! With no enabled event the state is final. A violation of any event of a
//! state, explored or not, is reported there: it is real all the same.
//!
//! # Why no violation and no deadlock is lost
//!
//! Let `T` be closed and `w` a path outside the explored events `E`. By
//! induction along `w`: no role of `T` steps on it (one enabled in `s` is in
//! `E`; one blocked in `s` stays blocked, as the barriers of its waits up to
//! the blocking one are touched by nothing that ran, and its block is
//! evaluated in order); every role `q` not in `T` runs only steps
//! of its reach (a frozen block's barriers are changed by nothing that ran:
//! roles of `T` did not run, the other roles are no writers of them, and
//! no entry outside `T` lands on them, new entries included, whose issuers
//! would be writers); so every event of `w` touches no object of `T` and is
//! independent of every event of `E`. `E` is therefore a persistent set,
//! and it holds an enabled event whenever `s` has one (the seed). Every
//! state graph of a protocol is finite and acyclic (each event either
//! advances a role or retires an in-flight entry that a role's step
//! created), and on such graphs a search that follows a persistent set in
//! every state reaches every final state the full search reaches. A
//! violation is kept as well: read it as an event that sets a sticky flag
//! and stops its role (its outcome depends only on the objects it touches,
//! so the independence above holds for it), and a reachable flag is then
//! carried into a final state, which the reduced search reaches. A
//! deadlock is a final state where not every role finished. Every path of
//! the reduced search is a path of the full one, so its traces are real
//! interleavings; they are the shortest of the reduced search, which may be
//! longer than the shortest of all.
//!
//! The search explores states up to a permutation of interchangeable
//! compute roles (`Model::canonical`). The full transition relation
//! commutes with those permutations, so a state and its canonical form
//! reach the same final states up to renaming, and exploring a persistent
//! set of the canonical form (whichever seed it chose) keeps every final
//! state up to renaming: by induction on the longest path left, each final
//! state reachable from a state is reachable from a successor through an
//! explored event, whose canonical form has a shorter longest path. The
//! trace of a violation is replayed as a real execution (`search`).
//!
//! What it saves: a role runs ahead only where something in the set needs
//! it. In a planner's pipeline the compute role moves alone while it can;
//! when it waits on a stage, only the producers and copies that stage
//! still needs move, so producers do not fill later stages in every order
//! and at every point in between (a producer with no back-pressure wait is
//! never frozen, so it keeps its place in every set that it can disturb).

use super::model::{Event, Model, One};
use super::protocol::Step;

/// A set of objects, one bit each: barriers, then buffers, then each
/// role's asynchronous reads.
#[derive(Clone)]
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

    fn add_all(&mut self, other: &Objects) {
        for (a, b) in self.bits.iter_mut().zip(&other.bits) {
            *a |= b;
        }
    }

    fn meets(&self, other: &Objects) -> bool {
        self.bits.iter().zip(&other.bits).any(|(a, b)| a & b != 0)
    }
}

/// What the closures of one state share: each entry's objects and the
/// barrier it completes on, each unfinished role's current block's objects.
struct Here<'r> {
    red: &'r Reduction,
    entries: Vec<Objects>,
    lands_on: Vec<Option<usize>>,
    blocks: Vec<Option<Objects>>,
}

/// What the reduction reads of a protocol, once per search.
pub(super) struct Reduction {
    /// `[role][barrier]`: one past the last program counter at which the
    /// role arrives on the barrier or copies into it, 0 for never.
    last_change: Vec<Vec<u32>>,
    /// Every object each role's program touches, at any point.
    role_objects: Vec<Objects>,
}

/// A set `T` of roles and entries.
struct Members {
    roles: Vec<bool>,
    entries: Vec<bool>,
}

impl Model<'_> {
    fn objects(&self) -> usize {
        self.barriers + self.buffers + self.roles
    }

    /// The barrier step `step` of a role at `stage` changes (an arrival, or
    /// a copy that completes on it), if any.
    fn changes(&self, stage: u32, step: &Step) -> Option<usize> {
        match step {
            Step::Arrive { group, .. }
            | Step::ExpectTxArrive { group, .. }
            | Step::Copy { group, .. } => Some(self.p.barrier_groups[*group][stage as usize]),
            _ => None,
        }
    }

    /// The reduction's tables of this protocol.
    pub(super) fn reduction(&self) -> Reduction {
        let n = self.p.iterations;
        let stages = self.p.stages;
        let mut r = Reduction {
            last_change: Vec::new(),
            role_objects: Vec::new(),
        };
        for (q, role) in self.p.roles.iter().enumerate() {
            let mut last = vec![0u32; self.barriers];
            let mut all = Objects::new(self.objects());
            let mut note = |b: usize, pc: u32| last[b] = last[b].max(pc + 1);
            for (x, (stage, step)) in role.prologue.iter().enumerate() {
                self.step_objects(q, *stage, step, |o| all.add(o));
                if let Some(b) = self.changes(*stage, step) {
                    note(b, x as u32);
                }
            }
            let (pro, len) = (role.prologue.len() as u32, role.body.len() as u32);
            for (j, step) in role.body.iter().enumerate() {
                // The last iteration at each stage (iterations <= 65535,
                // steps <= 255: no overflow).
                for stage in 0..stages.min(n) {
                    let i = stage + stages * ((n - 1 - stage) / stages);
                    self.step_objects(q, stage, step, |o| all.add(o));
                    if let Some(b) = self.changes(stage, step) {
                        note(b, pro + i * len + j as u32);
                    }
                }
            }
            r.last_change.push(last);
            r.role_objects.push(all);
        }
        r
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

    /// `enabled[r]`: whether role `r`'s step does not block.
    fn here<'r>(&self, red: &'r Reduction, s: &[u32], enabled: &[bool]) -> Here<'r> {
        let entries = s.len() - self.copies_at();
        let mut here = Here {
            red,
            entries: Vec::with_capacity(entries),
            lands_on: Vec::with_capacity(entries),
            blocks: Vec::with_capacity(self.roles),
        };
        for k in 0..entries {
            let role = (s[self.copies_at() + k] >> 24) as usize;
            let c = self.in_flight(s, k);
            let mut o = Objects::new(self.objects());
            o.add(self.barriers + self.buffer_index[c.buffer_group][c.stage]);
            let lands_on = c
                .copy
                .map(|(group, _, _)| self.p.barrier_groups[group][c.stage]);
            o.add(lands_on.unwrap_or(self.barriers + self.buffers + role));
            here.entries.push(o);
            here.lands_on.push(lands_on);
        }
        for (r, &at) in s[..self.roles].iter().enumerate() {
            if at >= self.program_len(r) {
                here.blocks.push(None);
                continue;
            }
            // A blocked wait block's outcome depends only on its waits up
            // to the first one that blocks: what could enable it.
            let mut o = Objects::new(self.objects());
            let mut cur = if enabled[r] { Vec::new() } else { s.to_vec() };
            for pc in at..self.block_end(r, at) {
                let (_, stage, step) = self.locate(r, pc);
                self.step_objects(r, stage, step, |x| o.add(x));
                if !enabled[r] && matches!(self.step_one(&mut cur, r), One::Blocked) {
                    break;
                }
            }
            here.blocks.push(Some(o));
        }
        here
    }

    /// Whether the wait block of `q` starting at `start` is frozen outside
    /// `t`, `changed` holding the barriers `q` changes before it.
    fn frozen(
        &self,
        s: &[u32],
        q: usize,
        start: u32,
        t: &Members,
        here: &Here,
        changed: &Objects,
    ) -> bool {
        let end = self.block_end(q, start);
        for pc in start..end {
            let (i, stage, step) = self.locate(q, pc);
            let Step::Wait {
                group,
                phase_offset,
            } = step
            else {
                return false;
            };
            let b = self.p.barrier_groups[*group][stage as usize];
            let written = changed.has(b)
                || (0..self.roles)
                    .any(|r| r != q && !t.roles[r] && here.red.last_change[r][b] > s[r])
                || (0..here.entries.len()).any(|k| !t.entries[k] && here.lands_on[k] == Some(b));
            if written {
                return false;
            }
            let want = self.phase_of(i, *phase_offset);
            let phase = s[self.bar(b)] as i64;
            if phase == want {
                return true;
            }
            if phase != want + 1 {
                return false;
            }
        }
        false
    }

    /// Whether the reach of `q` outside `t` touches an object of `touched`.
    fn reaches(&self, s: &[u32], q: usize, t: &Members, here: &Here, touched: &Objects) -> bool {
        if !here.red.role_objects[q].meets(touched) {
            return false;
        }
        let len = self.program_len(q);
        let mut changed = Objects::new(self.barriers);
        let mut pc = s[q];
        while pc < len {
            let end = self.block_end(q, pc);
            let wait = matches!(
                self.locate(q, pc).2,
                Step::Wait { .. } | Step::WaitAsyncReads
            );
            if wait && self.frozen(s, q, pc, t, here, &changed) {
                return false;
            }
            for x in pc..end {
                let (_, stage, step) = self.locate(q, x);
                let mut hit = false;
                self.step_objects(q, stage, step, |o| hit |= touched.has(o));
                if hit {
                    return true;
                }
                if let Some(b) = self.changes(stage, step) {
                    changed.add(b);
                }
            }
            pc = end;
        }
        false
    }

    /// The closed set grown from `seed` (see the module's rule).
    /// `None` once it holds `cap` enabled events or more.
    fn closure(
        &self,
        s: &[u32],
        seed: Event,
        here: &Here,
        enabled: &[bool],
        cap: usize,
    ) -> Option<Members> {
        let mut t = Members {
            roles: vec![false; self.roles],
            entries: vec![false; here.entries.len()],
        };
        match seed {
            Event::Step(r) => t.roles[r as usize] = true,
            Event::Land(k) => t.entries[k as usize] = true,
        }
        let start = self.copies_at();
        loop {
            // Identical entries are one event.
            let explored = (0..self.roles)
                .filter(|&r| t.roles[r] && enabled[r])
                .count()
                + (0..here.entries.len())
                    .filter(|&k| t.entries[k] && (k == 0 || s[start + k] != s[start + k - 1]))
                    .count();
            if explored >= cap {
                return None;
            }
            let mut touched = Objects::new(self.objects());
            for (r, block) in here.blocks.iter().enumerate() {
                if let (true, Some(o)) = (t.roles[r], block) {
                    touched.add_all(o);
                }
            }
            for (k, o) in here.entries.iter().enumerate() {
                if t.entries[k] {
                    touched.add_all(o);
                }
            }
            let mut grew = false;
            for k in 0..here.entries.len() {
                if !t.entries[k] && here.entries[k].meets(&touched) {
                    t.entries[k] = true;
                    grew = true;
                }
            }
            if grew {
                continue;
            }
            // Roles whose reach meets the set. Reaches only shrink as the
            // set grows, so blocked roles join first (they add no explored
            // event and may freeze others), then one enabled role at a time.
            let meets: Vec<usize> = (0..self.roles)
                .filter(|&q| {
                    !t.roles[q]
                        && here.blocks[q].is_some()
                        && self.reaches(s, q, &t, here, &touched)
                })
                .collect();
            let blocked: Vec<usize> = meets.iter().copied().filter(|&q| !enabled[q]).collect();
            if !blocked.is_empty() {
                blocked.into_iter().for_each(|q| t.roles[q] = true);
                continue;
            }
            // Of the enabled ones, the one after which the fewest others
            // still meet the set (it may freeze them); among many, the first.
            let mut still_meeting = |q: usize| {
                t.roles[q] = true;
                let mut with_q = touched.clone();
                if let Some(o) = &here.blocks[q] {
                    with_q.add_all(o);
                }
                let n = meets
                    .iter()
                    .filter(|&&o| o != q && self.reaches(s, o, &t, here, &with_q))
                    .count();
                t.roles[q] = false;
                n
            };
            let pick = if meets.len() == 1 || meets.len() > 8 {
                meets.first().copied()
            } else {
                meets.iter().copied().min_by_key(|&q| still_meeting(q))
            };
            match pick {
                Some(q) => t.roles[q] = true,
                None => return Some(t),
            }
        }
    }

    /// The events of `s` to explore, as indices into `events`
    /// (`enabled[i]`: whether `events[i]` does not block): the enabled
    /// events of the closed set with the fewest of them.
    pub(super) fn persistent(
        &self,
        red: &Reduction,
        s: &[u32],
        events: &[Event],
        enabled: &[bool],
    ) -> Vec<usize> {
        let mut best: Vec<usize> = (0..events.len()).filter(|&i| enabled[i]).collect();
        if best.len() <= 1 {
            return best;
        }
        let mut role_enabled = vec![false; self.roles];
        for (i, e) in events.iter().enumerate() {
            if let Event::Step(r) = e {
                role_enabled[*r as usize] = enabled[i];
            }
        }
        let here = self.here(red, s, &role_enabled);
        for seed in best.clone() {
            let Some(t) = self.closure(s, events[seed], &here, &role_enabled, best.len()) else {
                continue;
            };
            let chosen: Vec<usize> = (0..events.len())
                .filter(|&i| {
                    enabled[i]
                        && match events[i] {
                            Event::Step(r) => t.roles[r as usize],
                            Event::Land(k) => t.entries[k as usize],
                        }
                })
                .collect();
            if chosen.len() < best.len() {
                best = chosen;
                if best.len() == 1 {
                    break;
                }
            }
        }
        best
    }
}
