//! The state layout of a search and the semantics of one step.

use super::protocol::{Protocol, Step, ViolationKind};
use crate::error::PlanError;

// State layout (all u32): [pc per role] [phase, pending, tx per barrier]
// [version, outstanding, readers per buffer] [in-flight copies, sorted].
// An in-flight copy is (role << 24 | iteration << 8 | step).
pub(super) struct Model<'a> {
    pub(super) p: &'a Protocol,
    pub(super) roles: usize,
    pub(super) barriers: usize,
    pub(super) buffers: usize,
    /// Buffer index of `[group][stage]`.
    pub(super) buffer_index: Vec<Vec<usize>>,
    /// Readers per buffer group.
    pub(super) readers: Vec<u32>,
    pub(super) buffer_names: Vec<String>,
    /// Groups of interchangeable roles (identical programs, no copies).
    pub(super) symmetric: Vec<Vec<usize>>,
}

pub(super) const NONE: u32 = u32::MAX;

/// What one step of a role did to the state it was given.
pub(super) enum One {
    /// It ran.
    Moved,
    /// It waits (the state is to be dropped).
    Blocked,
    /// It broke a rule (the state is to be dropped).
    Violation(ViolationKind, String),
}

pub(super) enum Outcome {
    Blocked,
    Next(Vec<u32>),
    Violation(ViolationKind, String),
}

impl<'a> Model<'a> {
    pub(super) fn new(p: &'a Protocol) -> Result<Self, PlanError> {
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
                    Step::Read { buffer_group } | Step::ReadAsync { buffer_group } => {
                        if *buffer_group < reads_here.len() {
                            reads_here[*buffer_group] = true;
                        }
                        (None, Some(*buffer_group))
                    }
                    Step::Write { buffer_group } => (None, Some(*buffer_group)),
                    Step::WaitAsyncReads => (None, None),
                };
                if stage.is_some() && matches!(step, Step::Copy { .. } | Step::ReadAsync { .. }) {
                    return bad(format!(
                        "{}: copies and asynchronous reads belong in the body",
                        role.name
                    ));
                }
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
            // In-flight entries name their role: roles that issue them are
            // not interchangeable.
            let copies = role
                .body
                .iter()
                .any(|st| matches!(st, Step::Copy { .. } | Step::ReadAsync { .. }));
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

    pub(super) fn initial(&self) -> Vec<u32> {
        let mut s = vec![0u32; self.roles];
        for b in &self.p.barriers {
            s.extend([0, b.init_count, 0]);
        }
        for _ in 0..self.buffers {
            s.extend([NONE, 0, 0]);
        }
        s
    }

    pub(super) fn bar(&self, b: usize) -> usize {
        self.roles + 3 * b
    }

    pub(super) fn buf(&self, b: usize) -> usize {
        self.roles + 3 * self.barriers + 3 * b
    }

    pub(super) fn copies_at(&self) -> usize {
        self.roles + 3 * self.barriers + 3 * self.buffers
    }

    pub(super) fn program_len(&self, role: usize) -> u32 {
        let r = &self.p.roles[role];
        r.prologue.len() as u32 + self.p.iterations * r.body.len() as u32
    }

    /// (iteration, stage, step) of `role` at program counter `pc`.
    pub(super) fn locate(&self, role: usize, pc: u32) -> (u32, u32, &Step) {
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
    pub(super) fn block_end(&self, role: usize, pc: u32) -> u32 {
        let len = self.program_len(role);
        let is_wait = |pc| {
            matches!(
                self.locate(role, pc).2,
                Step::Wait { .. } | Step::WaitAsyncReads
            )
        };
        let kind = is_wait(pc);
        let mut end = pc + 1;
        while end < len && is_wait(end) == kind {
            end += 1;
        }
        end
    }

    /// Sorts the program counters of interchangeable roles.
    pub(super) fn canonical(&self, mut s: Vec<u32>) -> Vec<u32> {
        for group in &self.symmetric {
            let mut pcs: Vec<u32> = group.iter().map(|&r| s[r]).collect();
            pcs.sort_unstable();
            for (&r, pc) in group.iter().zip(pcs) {
                s[r] = pc;
            }
        }
        s
    }

    /// The event of the state `real` that `e` is in `canonical`, its
    /// canonical form: a step of a role that is interchangeable with others
    /// is the step of one of them at the same program counter (entries name
    /// no interchangeable role, so they are the same in both).
    pub(super) fn real_event(&self, canonical: &[u32], real: &[u32], e: Event) -> Event {
        let Event::Step(r) = e else { return e };
        self.symmetric
            .iter()
            .find(|g| g.contains(&(r as usize)))
            .and_then(|g| g.iter().find(|&&q| real[q] == canonical[r as usize]))
            .map_or(e, |&q| Event::Step(q as u16))
    }

    pub(super) fn phase_of(&self, iteration: u32, offset: i32) -> i64 {
        (iteration / self.p.stages) as i64 + offset as i64
    }

    pub(super) fn describe_barrier(&self, s: &[u32], b: usize) -> String {
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
    pub(super) fn settle(&self, s: &mut [u32], b: usize) {
        let at = self.bar(b);
        if s[at + 1] == 0 && s[at + 2] == 0 {
            s[at] += 1;
            s[at + 1] = self.p.barriers[b].init_count;
        }
    }

    /// Applies one arrival/expect on barrier `b` meant for `phase`.
    pub(super) fn arrive(
        &self,
        s: &mut [u32],
        b: usize,
        phase: i64,
        count: u32,
        tx: i64,
        who: &Who<'_>,
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
    pub(super) fn step(&self, s: &[u32], role: usize) -> Outcome {
        let end = self.block_end(role, s[role]);
        let mut cur = s.to_vec();
        while cur[role] < end {
            match self.step_one(&mut cur, role) {
                One::Moved => {}
                One::Blocked => return Outcome::Blocked,
                One::Violation(k, m) => return Outcome::Violation(k, m),
            }
        }
        Outcome::Next(cur)
    }

    pub(super) fn step_one(&self, n: &mut Vec<u32>, role: usize) -> One {
        let pc = n[role];
        let name = &self.p.roles[role].name;
        let (i, stage, step) = self.locate(role, pc);
        let who = Who { name, iteration: i };
        n[role] += 1;
        let fail = |(k, m): (ViolationKind, String)| One::Violation(k, m);
        match step {
            Step::Wait {
                group,
                phase_offset,
            } => {
                let b = self.p.barrier_groups[*group][stage as usize];
                let want = self.phase_of(i, *phase_offset);
                let phase = n[self.bar(b)] as i64;
                if phase == want {
                    One::Blocked
                } else if phase == want + 1 {
                    One::Moved
                } else {
                    One::Violation(
                        ViolationKind::ParityOutOfRange,
                        format!(
                            "{who}: try_wait.parity({}) for phase {want} while {}: only the current or the preceding phase can be waited on",
                            want.rem_euclid(2),
                            self.describe_barrier(n, b)
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
                match self.arrive(n, b, self.phase_of(i, *phase_offset), *count, 0, &who) {
                    Ok(()) => One::Moved,
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
                    n,
                    b,
                    self.phase_of(i, *phase_offset),
                    1,
                    *bytes as i64,
                    &who,
                ) {
                    Ok(()) => One::Moved,
                    Err(v) => fail(v),
                }
            }
            Step::Copy { buffer_group, .. } => {
                let at = match self.claim(n, *buffer_group, stage, i, "copy", &who) {
                    Ok(at) => at,
                    Err(v) => return fail(v),
                };
                n[at + 1] += 1;
                self.issue(n, role, pc, i);
                One::Moved
            }
            Step::Write { buffer_group } => {
                match self.claim(n, *buffer_group, stage, i, "stores", &who) {
                    Ok(_) => One::Moved,
                    Err(v) => fail(v),
                }
            }
            Step::WaitAsyncReads => {
                let start = self.copies_at();
                let reading = n[start..].iter().any(|&e| {
                    (e >> 24) as usize == role
                        && matches!(
                            self.p.roles[role].body[(e & 0xff) as usize],
                            Step::ReadAsync { .. }
                        )
                });
                if reading {
                    One::Blocked
                } else {
                    One::Moved
                }
            }
            Step::Read { buffer_group } | Step::ReadAsync { buffer_group } => {
                let buf = self.buffer_index[*buffer_group][stage as usize];
                let at = self.buf(buf);
                if n[at] != i || n[at + 1] > 0 {
                    let state = if n[at] != i {
                        format!("it holds iteration {}", n[at] as i32)
                    } else {
                        format!("{} copy(ies) still in flight", n[at + 1])
                    };
                    return One::Violation(
                        ViolationKind::ReadBeforeLoad,
                        format!(
                            "{who}: reads {} before its load landed ({state})",
                            self.buffer_names[buf]
                        ),
                    );
                }
                if matches!(step, Step::ReadAsync { .. }) {
                    // The claim is held until the read completes.
                    self.issue(n, role, pc, i);
                } else {
                    n[at + 2] = n[at + 2].saturating_sub(1);
                }
                One::Moved
            }
        }
    }

    /// Makes the stage's buffer of `group` hold iteration `i` for a writer
    /// (`what`: a copy or stores): refused while the readers of another
    /// iteration have not released it. Returns the buffer's place in `n`.
    fn claim(
        &self,
        n: &mut [u32],
        group: usize,
        stage: u32,
        i: u32,
        what: &str,
        who: &Who<'_>,
    ) -> Result<usize, (ViolationKind, String)> {
        let buf = self.buffer_index[group][stage as usize];
        let at = self.buf(buf);
        if n[at] != i {
            if n[at + 2] > 0 {
                return Err((
                    ViolationKind::Overwrite,
                    format!(
                        "{who}: {what} into {} while {} reader(s) of iteration {} have not released it",
                        self.buffer_names[buf],
                        n[at + 2],
                        n[at] as i32
                    ),
                ));
            }
            n[at] = i;
            n[at + 1] = 0;
            n[at + 2] = self.readers[group];
        }
        Ok(at)
    }

    /// Adds the in-flight entry of the body step at `pc` of `role`
    /// (iteration `i`), keeping the list sorted.
    fn issue(&self, n: &mut Vec<u32>, role: usize, pc: u32, i: u32) {
        let entry = (role as u32) << 24
            | i << 8
            | (pc
                - self.p.roles[role].prologue.len() as u32
                - i * self.p.roles[role].body.len() as u32);
        let start = self.copies_at();
        let pos = n[start..].partition_point(|&c| c < entry) + start;
        n.insert(pos, entry);
    }

    /// The in-flight copy at index `k` of the copy list.
    pub(super) fn in_flight(&self, s: &[u32], k: usize) -> InFlight<'_> {
        let copy = s[self.copies_at() + k];
        let (role, i, step) = (
            (copy >> 24) as usize,
            (copy >> 8) & 0xffff,
            (copy & 0xff) as usize,
        );
        let (copy, buffer_group) = match &self.p.roles[role].body[step] {
            Step::Copy {
                group,
                buffer_group,
                phase_offset,
                bytes,
            } => (Some((*group, *phase_offset, *bytes)), *buffer_group),
            Step::ReadAsync { buffer_group } => (None, *buffer_group),
            _ => unreachable!("in-flight entries are copies and asynchronous reads"),
        };
        InFlight {
            iteration: i,
            stage: (i % self.p.stages) as usize,
            copy,
            buffer_group,
            name: &self.p.roles[role].name,
        }
    }

    /// Lands the in-flight copy at index `k` of the copy list.
    pub(super) fn land(&self, s: &[u32], k: usize) -> Outcome {
        let c = self.in_flight(s, k);
        let mut n = s.to_vec();
        n.remove(self.copies_at() + k);
        let buf = self.buffer_index[c.buffer_group][c.stage];
        let Some((group, phase_offset, bytes)) = c.copy else {
            // An asynchronous read completes: it releases its claim (an
            // overwrite before this point was reported at the write).
            let at = self.buf(buf);
            if n[at] == c.iteration {
                n[at + 2] = n[at + 2].saturating_sub(1);
            }
            return Outcome::Next(n);
        };
        let b = self.p.barrier_groups[group][c.stage];
        n[self.buf(buf) + 1] -= 1;
        let phase = self.phase_of(c.iteration, phase_offset);
        let at = self.bar(b);
        if n[at] as i64 != phase {
            return Outcome::Violation(
                ViolationKind::WrongPhase,
                format!(
                    "copy of {} (iteration {}) completed {} tx byte(s) meant for phase {phase} in {}",
                    c.name,
                    c.iteration,
                    bytes,
                    self.describe_barrier(s, b)
                ),
            );
        }
        n[at + 2] = (n[at + 2] as i32 as i64 - bytes as i64) as i32 as u32;
        self.settle(&mut n, b);
        Outcome::Next(n)
    }

    pub(super) fn apply(&self, s: &[u32], e: Event) -> Outcome {
        match e {
            Event::Step(r) => self.step(s, r as usize),
            Event::Land(k) => self.land(s, k as usize),
        }
    }

    pub(super) fn events(&self, s: &[u32]) -> Vec<Event> {
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

/// A decoded in-flight entry (a copy or an asynchronous read): which role
/// issued it at which iteration, and its step's fields. Encoded in the
/// state as `role << 24 | iteration << 8 | body step`.
pub(super) struct InFlight<'a> {
    pub(super) iteration: u32,
    pub(super) stage: usize,
    /// A copy's barrier group, phase offset and bytes; `None` for a read.
    pub(super) copy: Option<(usize, i32, u64)>,
    pub(super) buffer_group: usize,
    pub(super) name: &'a str,
}

/// The role and iteration a violation names (`compute wg0 (iteration 3)`),
/// formatted only when a violation is reported.
pub(super) struct Who<'a> {
    name: &'a str,
    iteration: u32,
}

impl std::fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (iteration {})", self.name, self.iteration)
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Event {
    Step(u16),
    Land(u16),
}
