//! Trace lines: what an event does, in the words of the protocol.

use super::model::{Event, Model, Outcome};
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
            match self.step_one(&cur, role) {
                Outcome::Next(n) => cur = n,
                _ => break,
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
        }
    }

    pub(super) fn describe_land(&self, s: &[u32], k: usize) -> String {
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

    pub(super) fn describe_event(&self, s: &[u32], e: Event) -> String {
        match e {
            Event::Step(r) => self.describe_block(s, r as usize),
            Event::Land(k) => self.describe_land(s, k as usize),
        }
    }
}
