// Over 600 lines: one search, whose state encoding, step semantics and trace reports depend on each other's layout.
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
//! so a violation comes with a shortest trace.
//!
//! Granularity (what keeps the state space small): a role's consecutive
//! waits are one atomic step (it proceeds when all of them pass), and so are
//! its consecutive non-blocking operations (arrivals, copy issues, reads);
//! copy completions stay separate events that interleave anywhere. This can
//! only add reports for designs that read or overwrite without waiting, never
//! hide a race between blocking points. Roles with identical programs that
//! issue no copies (the compute warpgroups) are interchangeable, so states
//! that differ only by permuting them are explored once.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::error::PlanError;

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

/// The explored states, each stored once: one flat arena of u32 words,
/// where each state starts, and an open-addressing index of state ids
/// (compared word for word, never by hash alone). Ids are given in
/// discovery order, which is also the breadth-first order of the search.
struct StateSet {
    arena: Vec<u32>,
    starts: Vec<u64>,
    /// `id + 1` per slot, 0 for empty; a power of two long.
    table: Vec<u32>,
}

fn hash_words(s: &[u32]) -> u64 {
    // FNV-1a over the words: fixed, so a search is reproducible.
    s.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &w| {
        (h ^ u64::from(w)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl StateSet {
    fn new() -> Self {
        StateSet {
            arena: Vec::new(),
            starts: vec![0],
            table: vec![0; 1024],
        }
    }

    fn len(&self) -> usize {
        self.starts.len() - 1
    }

    fn get(&self, id: u32) -> &[u32] {
        let (a, b) = (self.starts[id as usize], self.starts[id as usize + 1]);
        &self.arena[a as usize..b as usize]
    }

    /// Bytes held by the set's tables.
    fn bytes(&self) -> u64 {
        (self.arena.capacity() * 4 + self.starts.capacity() * 8 + self.table.len() * 4) as u64
    }

    fn slot_of(&self, s: &[u32]) -> (usize, Option<u32>) {
        let mask = self.table.len() - 1;
        let mut i = hash_words(s) as usize & mask;
        loop {
            match self.table[i] {
                0 => return (i, None),
                id if self.get(id - 1) == s => return (i, Some(id - 1)),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// The id of `s`, and whether it is new. Allocation failures are
    /// errors (the budget normally stops the search long before).
    fn insert(&mut self, s: &[u32]) -> Result<(u32, bool), PlanError> {
        let (slot, found) = self.slot_of(s);
        if let Some(id) = found {
            return Ok((id, false));
        }
        let held = self.len();
        self.arena
            .try_reserve(s.len())
            .map_err(|_| PlanError::Limit(format!("no memory for a state past {held}")))?;
        self.starts
            .try_reserve(1)
            .map_err(|_| PlanError::Limit("no memory for the state list".into()))?;
        let id = self.len() as u32;
        self.arena.extend_from_slice(s);
        self.starts.push(self.arena.len() as u64);
        self.table[slot] = id + 1;
        if self.len() * 2 > self.table.len() {
            self.grow()?;
        }
        Ok((id, true))
    }

    fn grow(&mut self) -> Result<(), PlanError> {
        let n = self.table.len() * 2;
        let mut table = Vec::new();
        table
            .try_reserve_exact(n)
            .map_err(|_| PlanError::Limit(format!("no memory for an index of {n} states")))?;
        table.resize(n, 0);
        let old = std::mem::replace(&mut self.table, table);
        for id in old.into_iter().filter(|&id| id != 0) {
            let (slot, _) = self.slot_of(self.get(id - 1));
            self.table[slot] = id;
        }
        Ok(())
    }
}

// State layout (all u32): [pc per role] [phase, pending, tx per barrier]
// [version, outstanding, readers per buffer] [in-flight copies, sorted].
// An in-flight copy is (role << 24 | iteration << 8 | step).
struct Model<'a> {
    p: &'a Protocol,
    roles: usize,
    barriers: usize,
    buffers: usize,
    /// Buffer index of `[group][stage]`.
    buffer_index: Vec<Vec<usize>>,
    /// Readers per buffer group.
    readers: Vec<u32>,
    buffer_names: Vec<String>,
    /// Groups of interchangeable roles (identical programs, no copies).
    symmetric: Vec<Vec<usize>>,
}

const NONE: u32 = u32::MAX;

enum Outcome {
    Blocked,
    Next(Vec<u32>),
    Violation(ViolationKind, String),
}

impl<'a> Model<'a> {
    fn new(p: &'a Protocol) -> Result<Self, PlanError> {
        let bad = |m: String| Err(PlanError::Protocol(m));
        if p.stages == 0 {
            return bad("stages must be at least 1".into());
        }
        if p.roles.is_empty() || p.roles.len() > 255 {
            return bad("between 1 and 255 roles".into());
        }
        if p.iterations == 0 || p.iterations > 0xffff {
            return bad("iterations must be in 1..=65535".into());
        }
        for (g, group) in p.barrier_groups.iter().enumerate() {
            if group.len() != p.stages as usize || group.iter().any(|&b| b >= p.barriers.len()) {
                return bad(format!(
                    "barrier group {g} needs one valid barrier per stage"
                ));
            }
        }
        for (g, group) in p.buffer_groups.iter().enumerate() {
            if group.len() != p.stages as usize {
                return bad(format!("buffer group {g} needs one buffer per stage"));
            }
        }
        let mut buffer_index = Vec::new();
        let mut buffer_names = Vec::new();
        for group in &p.buffer_groups {
            buffer_index.push((0..group.len()).map(|s| buffer_names.len() + s).collect());
            buffer_names.extend(group.iter().cloned());
        }
        let mut readers = vec![0u32; p.buffer_groups.len()];
        for role in &p.roles {
            if role.body.len() > 255 || role.prologue.len() > 255 {
                return bad(format!("{}: at most 255 steps", role.name));
            }
            let steps = role
                .prologue
                .iter()
                .map(|(s, st)| (Some(*s), st))
                .chain(role.body.iter().map(|st| (None, st)));
            let mut reads_here = vec![false; p.buffer_groups.len()];
            for (stage, step) in steps {
                if stage.is_some_and(|s| s >= p.stages) {
                    return bad(format!("{}: prologue stage out of range", role.name));
                }
                let (group, buffer) = match step {
                    Step::Wait { group, .. }
                    | Step::Arrive { group, .. }
                    | Step::ExpectTxArrive { group, .. } => (Some(*group), None),
                    Step::Copy {
                        group,
                        buffer_group,
                        ..
                    } => (Some(*group), Some(*buffer_group)),
                    Step::Read { buffer_group } => {
                        if *buffer_group < reads_here.len() {
                            reads_here[*buffer_group] = true;
                        }
                        (None, Some(*buffer_group))
                    }
                };
                if group.is_some_and(|g| g >= p.barrier_groups.len()) {
                    return bad(format!("{}: barrier group out of range", role.name));
                }
                if buffer.is_some_and(|b| b >= p.buffer_groups.len()) {
                    return bad(format!("{}: buffer group out of range", role.name));
                }
            }
            for (g, r) in reads_here.into_iter().enumerate() {
                readers[g] += r as u32;
            }
        }
        let mut symmetric: Vec<Vec<usize>> = Vec::new();
        for (r, role) in p.roles.iter().enumerate() {
            let copies = role.body.iter().any(|st| matches!(st, Step::Copy { .. }));
            if copies {
                continue;
            }
            match symmetric.iter_mut().find(|g| {
                let o = &p.roles[g[0]];
                o.prologue == role.prologue && o.body == role.body
            }) {
                Some(g) => g.push(r),
                None => symmetric.push(vec![r]),
            }
        }
        symmetric.retain(|g| g.len() > 1);
        Ok(Model {
            p,
            symmetric,
            roles: p.roles.len(),
            barriers: p.barriers.len(),
            buffers: buffer_names.len(),
            buffer_index,
            readers,
            buffer_names,
        })
    }

    fn initial(&self) -> Vec<u32> {
        let mut s = vec![0u32; self.roles];
        for b in &self.p.barriers {
            s.extend([0, b.init_count, 0]);
        }
        for _ in 0..self.buffers {
            s.extend([NONE, 0, 0]);
        }
        s
    }

    fn bar(&self, b: usize) -> usize {
        self.roles + 3 * b
    }

    fn buf(&self, b: usize) -> usize {
        self.roles + 3 * self.barriers + 3 * b
    }

    fn copies_at(&self) -> usize {
        self.roles + 3 * self.barriers + 3 * self.buffers
    }

    fn program_len(&self, role: usize) -> u32 {
        let r = &self.p.roles[role];
        r.prologue.len() as u32 + self.p.iterations * r.body.len() as u32
    }

    /// (iteration, stage, step) of `role` at program counter `pc`.
    fn locate(&self, role: usize, pc: u32) -> (u32, u32, &Step) {
        let r = &self.p.roles[role];
        let pro = r.prologue.len() as u32;
        if pc < pro {
            let (stage, step) = &r.prologue[pc as usize];
            (0, *stage, step)
        } else {
            let k = pc - pro;
            let i = k / r.body.len() as u32;
            (
                i,
                i % self.p.stages,
                &r.body[(k % r.body.len() as u32) as usize],
            )
        }
    }

    /// End (exclusive) of the atomic block starting at `pc`: a run of waits,
    /// or a run of non-blocking operations.
    fn block_end(&self, role: usize, pc: u32) -> u32 {
        let len = self.program_len(role);
        let is_wait = |pc| matches!(self.locate(role, pc).2, Step::Wait { .. });
        let kind = is_wait(pc);
        let mut end = pc + 1;
        while end < len && is_wait(end) == kind {
            end += 1;
        }
        end
    }

    /// Sorts the program counters of interchangeable roles.
    fn canonical(&self, mut s: Vec<u32>) -> Vec<u32> {
        for group in &self.symmetric {
            let mut pcs: Vec<u32> = group.iter().map(|&r| s[r]).collect();
            pcs.sort_unstable();
            for (&r, pc) in group.iter().zip(pcs) {
                s[r] = pc;
            }
        }
        s
    }

    fn phase_of(&self, iteration: u32, offset: i32) -> i64 {
        (iteration / self.p.stages) as i64 + offset as i64
    }

    fn describe_barrier(&self, s: &[u32], b: usize) -> String {
        let at = self.bar(b);
        format!(
            "{} (phase {}, {} arrival(s) and {} tx byte(s) pending)",
            self.p.barriers[b].name,
            s[at],
            s[at + 1] as i32,
            s[at + 2] as i32
        )
    }

    /// Completes the barrier's phase when arrivals and bytes are both zero.
    fn settle(&self, s: &mut [u32], b: usize) {
        let at = self.bar(b);
        if s[at + 1] == 0 && s[at + 2] == 0 {
            s[at] += 1;
            s[at + 1] = self.p.barriers[b].init_count;
        }
    }

    /// Applies one arrival/expect on barrier `b` meant for `phase`.
    fn arrive(
        &self,
        s: &mut [u32],
        b: usize,
        phase: i64,
        count: u32,
        tx: i64,
        who: &str,
    ) -> Result<(), (ViolationKind, String)> {
        let at = self.bar(b);
        if s[at] as i64 != phase {
            return Err((
                ViolationKind::WrongPhase,
                format!(
                    "{who}: arrival meant for phase {phase} landed in {}",
                    self.describe_barrier(s, b)
                ),
            ));
        }
        let pending = s[at + 1] as i32 as i64 - count as i64;
        if pending < 0 {
            return Err((
                ViolationKind::ExcessArrival,
                format!(
                    "{who}: {count} arrival(s) exceed the init count {} of {} in phase {phase}",
                    self.p.barriers[b].init_count, self.p.barriers[b].name
                ),
            ));
        }
        s[at + 1] = pending as u32;
        s[at + 2] = (s[at + 2] as i32 as i64 + tx) as i32 as u32;
        self.settle(s, b);
        Ok(())
    }

    /// Runs the atomic block of `role` at its program counter.
    fn step(&self, s: &[u32], role: usize) -> Outcome {
        let end = self.block_end(role, s[role]);
        let mut cur = s.to_vec();
        while cur[role] < end {
            match self.step_one(&cur, role) {
                Outcome::Next(n) => cur = n,
                other => return other,
            }
        }
        Outcome::Next(cur)
    }

    fn step_one(&self, s: &[u32], role: usize) -> Outcome {
        let pc = s[role];
        let name = &self.p.roles[role].name;
        let (i, stage, step) = self.locate(role, pc);
        let who = format!("{name} (iteration {i})");
        let mut n = s.to_vec();
        n[role] += 1;
        let fail = |(k, m): (ViolationKind, String)| Outcome::Violation(k, m);
        match step {
            Step::Wait {
                group,
                phase_offset,
            } => {
                let b = self.p.barrier_groups[*group][stage as usize];
                let want = self.phase_of(i, *phase_offset);
                let phase = s[self.bar(b)] as i64;
                if phase == want {
                    Outcome::Blocked
                } else if phase == want + 1 {
                    Outcome::Next(n)
                } else {
                    Outcome::Violation(
                        ViolationKind::ParityOutOfRange,
                        format!(
                            "{who}: try_wait.parity({}) for phase {want} while {}: only the current or the preceding phase can be waited on",
                            want.rem_euclid(2),
                            self.describe_barrier(s, b)
                        ),
                    )
                }
            }
            Step::Arrive {
                group,
                phase_offset,
                count,
            } => {
                let b = self.p.barrier_groups[*group][stage as usize];
                match self.arrive(&mut n, b, self.phase_of(i, *phase_offset), *count, 0, &who) {
                    Ok(()) => Outcome::Next(n),
                    Err(v) => fail(v),
                }
            }
            Step::ExpectTxArrive {
                group,
                phase_offset,
                bytes,
            } => {
                let b = self.p.barrier_groups[*group][stage as usize];
                match self.arrive(
                    &mut n,
                    b,
                    self.phase_of(i, *phase_offset),
                    1,
                    *bytes as i64,
                    &who,
                ) {
                    Ok(()) => Outcome::Next(n),
                    Err(v) => fail(v),
                }
            }
            Step::Copy { buffer_group, .. } => {
                let buf = self.buffer_index[*buffer_group][stage as usize];
                let at = self.buf(buf);
                if n[at] != i {
                    if n[at + 2] > 0 {
                        return Outcome::Violation(
                            ViolationKind::Overwrite,
                            format!(
                                "{who}: copy into {} while {} reader(s) of iteration {} have not released it",
                                self.buffer_names[buf], n[at + 2], n[at] as i32
                            ),
                        );
                    }
                    n[at] = i;
                    n[at + 1] = 0;
                    n[at + 2] = self.readers[*buffer_group];
                }
                n[at + 1] += 1;
                let copy = (role as u32) << 24
                    | i << 8
                    | (pc
                        - self.p.roles[role].prologue.len() as u32
                        - i * self.p.roles[role].body.len() as u32);
                let start = self.copies_at();
                let pos = n[start..].partition_point(|&c| c < copy) + start;
                n.insert(pos, copy);
                Outcome::Next(n)
            }
            Step::Read { buffer_group } => {
                let buf = self.buffer_index[*buffer_group][stage as usize];
                let at = self.buf(buf);
                if n[at] != i || n[at + 1] > 0 {
                    let state = if n[at] != i {
                        format!("it holds iteration {}", n[at] as i32)
                    } else {
                        format!("{} copy(ies) still in flight", n[at + 1])
                    };
                    return Outcome::Violation(
                        ViolationKind::ReadBeforeLoad,
                        format!(
                            "{who}: reads {} before its load landed ({state})",
                            self.buffer_names[buf]
                        ),
                    );
                }
                n[at + 2] = n[at + 2].saturating_sub(1);
                Outcome::Next(n)
            }
        }
    }

    /// The in-flight copy at index `k` of the copy list.
    fn in_flight(&self, s: &[u32], k: usize) -> InFlight<'_> {
        let copy = s[self.copies_at() + k];
        let (role, i, step) = (
            (copy >> 24) as usize,
            (copy >> 8) & 0xffff,
            (copy & 0xff) as usize,
        );
        let Step::Copy {
            group,
            buffer_group,
            phase_offset,
            bytes,
        } = &self.p.roles[role].body[step]
        else {
            unreachable!("in-flight entries are copies");
        };
        InFlight {
            iteration: i,
            stage: (i % self.p.stages) as usize,
            group: *group,
            buffer_group: *buffer_group,
            phase_offset: *phase_offset,
            bytes: *bytes,
            name: &self.p.roles[role].name,
        }
    }

    /// Lands the in-flight copy at index `k` of the copy list.
    fn land(&self, s: &[u32], k: usize) -> Outcome {
        let c = self.in_flight(s, k);
        let b = self.p.barrier_groups[c.group][c.stage];
        let mut n = s.to_vec();
        n.remove(self.copies_at() + k);
        let buf = self.buffer_index[c.buffer_group][c.stage];
        n[self.buf(buf) + 1] -= 1;
        let phase = self.phase_of(c.iteration, c.phase_offset);
        let at = self.bar(b);
        if n[at] as i64 != phase {
            return Outcome::Violation(
                ViolationKind::WrongPhase,
                format!(
                    "copy of {} (iteration {}) completed {} tx byte(s) meant for phase {phase} in {}",
                    c.name,
                    c.iteration,
                    c.bytes,
                    self.describe_barrier(s, b)
                ),
            );
        }
        n[at + 2] = (n[at + 2] as i32 as i64 - c.bytes as i64) as i32 as u32;
        self.settle(&mut n, b);
        Outcome::Next(n)
    }

    fn describe_block(&self, s: &[u32], role: usize) -> String {
        let mut cur = s.to_vec();
        let end = self.block_end(role, s[role]);
        let mut out = String::new();
        let mut last_prefix = String::new();
        while cur[role] < end {
            let line = self.describe_step(&cur, role);
            let (prefix, action) = line.split_once(": ").unwrap_or(("", &line));
            if prefix == last_prefix {
                out.push_str("; ");
                out.push_str(action);
            } else {
                if !out.is_empty() {
                    out.push_str("; ");
                }
                out.push_str(&line);
                last_prefix = prefix.to_string();
            }
            match self.step_one(&cur, role) {
                Outcome::Next(n) => cur = n,
                _ => break,
            }
        }
        out
    }

    fn describe_step(&self, s: &[u32], role: usize) -> String {
        let (i, stage, step) = self.locate(role, s[role]);
        let name = &self.p.roles[role].name;
        let bname = |g: &usize| &self.p.barriers[self.p.barrier_groups[*g][stage as usize]].name;
        match step {
            Step::Wait {
                group,
                phase_offset,
            } => {
                let want = self.phase_of(i, *phase_offset);
                format!(
                    "{name} (iteration {i}): wait {} phase {want} (parity {})",
                    bname(group),
                    want.rem_euclid(2)
                )
            }
            Step::Arrive { group, count, .. } => format!(
                "{name} (iteration {i}): arrive x{count} on {}",
                bname(group)
            ),
            Step::ExpectTxArrive { group, bytes, .. } => {
                format!(
                    "{name} (iteration {i}): arrive.expect_tx({bytes}) on {}",
                    bname(group)
                )
            }
            Step::Copy {
                group,
                buffer_group,
                bytes,
                ..
            } => format!(
                "{name} (iteration {i}): cp.async.bulk {bytes} B -> {} (completes on {})",
                self.p.buffer_groups[*buffer_group][stage as usize],
                bname(group)
            ),
            Step::Read { buffer_group } => {
                format!(
                    "{name} (iteration {i}): read {}",
                    self.p.buffer_groups[*buffer_group][stage as usize]
                )
            }
        }
    }

    fn describe_land(&self, s: &[u32], k: usize) -> String {
        let c = self.in_flight(s, k);
        format!(
            "copy of {} (iteration {}) lands: {} B in {}, complete_tx on {}",
            c.name,
            c.iteration,
            c.bytes,
            self.p.buffer_groups[c.buffer_group][c.stage],
            self.p.barriers[self.p.barrier_groups[c.group][c.stage]].name
        )
    }

    fn describe_event(&self, s: &[u32], e: Event) -> String {
        match e {
            Event::Step(r) => self.describe_block(s, r as usize),
            Event::Land(k) => self.describe_land(s, k as usize),
        }
    }

    fn apply(&self, s: &[u32], e: Event) -> Outcome {
        match e {
            Event::Step(r) => self.step(s, r as usize),
            Event::Land(k) => self.land(s, k as usize),
        }
    }

    fn events(&self, s: &[u32]) -> Vec<Event> {
        let mut events: Vec<Event> = (0..self.roles)
            .filter(|&r| s[r] < self.program_len(r))
            .map(|r| Event::Step(r as u16))
            .collect();
        let start = self.copies_at();
        // Identical in-flight entries land the same way: try one of each.
        events.extend(
            (0..s.len() - start)
                .filter(|&k| k == 0 || s[start + k] != s[start + k - 1])
                .map(|k| Event::Land(k as u16)),
        );
        events
    }
}

/// A decoded in-flight copy: which role issued it at which iteration, and
/// its step's fields. Encoded in the state as
/// `role << 24 | iteration << 8 | body step`.
struct InFlight<'a> {
    iteration: u32,
    stage: usize,
    group: usize,
    buffer_group: usize,
    phase_offset: i32,
    bytes: u64,
    name: &'a str,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Step(u16),
    Land(u16),
}

/// Bytes of a search's tables: the states and the search tree.
fn table_bytes(states: &StateSet, parents: &Vec<(u32, Event)>) -> u64 {
    states.bytes() + (parents.capacity() * std::mem::size_of::<(u32, Event)>()) as u64
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
    let started = Instant::now();
    let model = Model::new(protocol)?;
    let init = model.canonical(model.initial());
    let mut states = StateSet::new();
    let mut parents: Vec<(u32, Event)> = Vec::new();
    states.insert(&init)?;
    parents.push((u32::MAX, Event::Step(0)));
    let limit = |what: &str, states: &StateSet, parents: &Vec<(u32, Event)>| {
        let bytes = table_bytes(states, parents);
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
    let trace_to = |id: u32, parents: &[(u32, Event)]| -> Vec<Event> {
        let mut events = Vec::new();
        let mut at = id;
        while parents[at as usize].0 != u32::MAX {
            events.push(parents[at as usize].1);
            at = parents[at as usize].0;
        }
        events.reverse();
        events
    };
    let replay = |events: &[Event]| -> (Vec<String>, Vec<u32>) {
        let mut s = init.clone();
        let mut lines = Vec::new();
        for &e in events {
            lines.push(model.describe_event(&s, e));
            if let Outcome::Next(n) = model.apply(&s, e) {
                s = model.canonical(n);
            }
        }
        (lines, s)
    };
    // Ids are in breadth-first order: the queue is the ids not yet expanded.
    let mut next = 0u32;
    while (next as usize) < states.len() {
        let id = next;
        next += 1;
        if id % 4096 == 0 {
            if table_bytes(&states, &parents) > budget.bytes {
                return Err(limit("memory budget reached", &states, &parents));
            }
            if started.elapsed() > budget.time {
                return Err(limit("time budget reached", &states, &parents));
            }
        }
        let s = states.get(id).to_vec();
        let mut moved = false;
        let events = model.events(&s);
        for e in events {
            match model.apply(&s, e) {
                Outcome::Blocked => {}
                Outcome::Next(n) => {
                    moved = true;
                    let n = model.canonical(n);
                    if states.len() as u64 >= budget.states.min(u32::MAX as u64 - 1) {
                        if states.slot_of(&n).1.is_none() {
                            return Err(limit("state budget reached", &states, &parents));
                        }
                        continue;
                    }
                    if states.insert(&n)?.1 {
                        parents.push((id, e));
                    }
                }
                Outcome::Violation(kind, message) => {
                    let mut events = trace_to(id, &parents);
                    events.push(e);
                    let (trace, _) = replay(&events);
                    return Ok(Verdict {
                        violation: Some(Violation {
                            kind,
                            message,
                            trace,
                        }),
                        states: parents.len() as u64,
                        bytes: table_bytes(&states, &parents),
                        elapsed: started.elapsed(),
                    });
                }
            }
        }
        let finished = (0..model.roles).all(|r| s[r] >= model.program_len(r));
        if !moved && !finished {
            let events = trace_to(id, &parents);
            let (trace, end) = replay(&events);
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
                states: parents.len() as u64,
                bytes: table_bytes(&states, &parents),
                elapsed: started.elapsed(),
            });
        }
    }
    Ok(Verdict {
        violation: None,
        states: parents.len() as u64,
        bytes: table_bytes(&states, &parents),
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_sets_bytes_count_every_table() {
        let mut set = StateSet::new();
        // Empty: one start offset (8 bytes) and the 1024-slot index.
        assert_eq!(set.bytes(), 8 + 1024 * 4);
        // 1000 states of 10 words each: at least the words themselves, one
        // start per state and an index of at least two slots per state.
        for i in 0..1000u32 {
            let state: Vec<u32> = (0..10).map(|w| i * 10 + w).collect();
            assert_eq!(set.insert(&state).unwrap(), (i, true));
        }
        assert_eq!(
            set.insert(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap(),
            (0, false)
        );
        let least = 1000 * 10 * 4 + 1001 * 8 + 2048 * 4;
        assert!(set.bytes() >= least, "{} < {least}", set.bytes());
        // ... and not wildly more (amortized growth at most doubles each).
        assert!(set.bytes() <= 2 * least, "{} > 2 x {least}", set.bytes());
    }

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
