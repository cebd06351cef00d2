//! Trace lines: what an event does, in the words of the protocol.

use super::model::{Event, Model, One};
use super::protocol::Step;

impl Model<'_> {
    pub(super) fn describe_block(&self, s: &[u32], role: usize) -> String {
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
            if !matches!(self.step_one(&mut cur, role), One::Moved) {
                break;
            }
        }
        out
    }

    pub(super) fn describe_step(&self, s: &[u32], role: usize) -> String {
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
            Step::ReadAsync { buffer_group } => {
                format!(
                    "{name} (iteration {i}): issue an asynchronous read of {}",
                    self.p.buffer_groups[*buffer_group][stage as usize]
                )
            }
            Step::Write { buffer_group } => {
                format!(
                    "{name} (iteration {i}): store into {}",
                    self.p.buffer_groups[*buffer_group][stage as usize]
                )
            }
            Step::WaitAsyncReads => {
                format!("{name} (iteration {i}): wait for its asynchronous reads")
            }
        }
    }

    pub(super) fn describe_land(&self, s: &[u32], k: usize) -> String {
        let c = self.in_flight(s, k);
        let buffer = &self.p.buffer_groups[c.buffer_group][c.stage];
        match c.copy {
            Some((group, _, bytes)) => format!(
                "copy of {} (iteration {}) lands: {bytes} B in {buffer}, complete_tx on {}",
                c.name, c.iteration, self.p.barriers[self.p.barrier_groups[group][c.stage]].name
            ),
            None => format!(
                "asynchronous read of {buffer} by {} (iteration {}) completes",
                c.name, c.iteration
            ),
        }
    }

    pub(super) fn describe_event(&self, s: &[u32], e: Event) -> String {
        match e {
            Event::Step(r) => self.describe_block(s, r as usize),
            Event::Land(k) => self.describe_land(s, k as usize),
        }
    }
}
