//! The Host executor: warps as OS threads on a software mbarrier.
//!
//! Each async warp of a plan is a thread that streams its source through
//! its stage buffers; each compute warpgroup is a thread that waits on every
//! producer's FULL barrier, hands the stage's bytes to the compute closure
//! and releases the buffers on the EMPTY barriers. The software barrier
//! follows the PTX rules the verifier models (phase, pending arrivals,
//! signed tx-count, completion when both reach zero, parity waits). Every
//! wait has a deadline: a hang becomes an error that lists what every role
//! was waiting for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::pipeline::{Action, RoleKind};
use crate::plan::PipelinePlan;

/// A hang (or a role that failed) turned into an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// Some wait did not complete within the timeout.
    #[error("pipeline stalled for {timeout:?}; waits: {}", waits.join("; "))]
    Stalled {
        /// The watchdog's timeout.
        timeout: Duration,
        /// What every role was doing when the watchdog fired.
        waits: Vec<String>,
    },
    /// Inputs that do not fit the plan.
    #[error("invalid input: {0}")]
    Input(String),
}

#[derive(Debug)]
struct BarrierState {
    phase: u64,
    pending: i64,
    tx: i64,
}

/// A software mbarrier with PTX semantics.
#[derive(Debug)]
pub struct SoftBarrier {
    init: u32,
    state: Mutex<BarrierState>,
    changed: Condvar,
}

impl SoftBarrier {
    /// A barrier expecting `init` arrivals per phase, in phase 0.
    pub fn new(init: u32) -> Self {
        SoftBarrier {
            init,
            state: Mutex::new(BarrierState {
                phase: 0,
                pending: init as i64,
                tx: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut BarrierState)) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
        if s.pending == 0 && s.tx == 0 {
            s.phase += 1;
            s.pending = self.init as i64;
        }
        drop(s);
        self.changed.notify_all();
    }

    /// `mbarrier.arrive` (count arrivals).
    pub fn arrive(&self, count: u32) {
        self.update(|s| s.pending -= count as i64);
    }

    /// `mbarrier.arrive.expect_tx`: expect `bytes`, then arrive once.
    pub fn arrive_expect_tx(&self, bytes: u64) {
        self.update(|s| {
            s.tx += bytes as i64;
            s.pending -= 1;
        });
    }

    /// `complete_tx`: an async copy of `bytes` landed.
    pub fn complete_tx(&self, bytes: u64) {
        self.update(|s| s.tx -= bytes as i64);
    }

    /// The current phase (number of completed phases).
    pub fn phase(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).phase
    }

    /// `try_wait.parity` in a loop: returns once the phase with `parity` has
    /// completed (the current phase's parity differs), `false` when
    /// `deadline` passes or `abort` is raised first.
    pub fn wait_parity(&self, parity: u32, deadline: Instant, abort: &AtomicBool) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if (s.phase & 1) as u32 != parity {
                return true;
            }
            let now = Instant::now();
            if now >= deadline || abort.load(Ordering::SeqCst) {
                return false;
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            s = self
                .changed
                .wait_timeout(s, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// One tile handed to the compute closure.
pub struct Tile<'a> {
    /// Tile index (iteration).
    pub index: usize,
    /// The calling compute warpgroup.
    pub warpgroup: u32,
    /// Compute warpgroups sharing the tile.
    pub warpgroups: u32,
    /// The tile's bytes of every async warp's source (shorter for a tail).
    pub inputs: Vec<&'a [u8]>,
}

/// Runs `plan` over `sources` (one byte stream per async warp, each split
/// into tiles of that warp's bytes per stage; all must have the same number
/// of tiles) and calls `compute` for every tile on every compute warpgroup.
/// `timeout` bounds every wait.
pub fn run<F>(
    plan: &PipelinePlan,
    sources: &[&[u8]],
    timeout: Duration,
    compute: F,
) -> Result<usize, HostError>
where
    F: Fn(Tile<'_>) + Sync,
{
    let warps = plan.spec.async_warps.len();
    if sources.len() != warps {
        return Err(HostError::Input(format!(
            "{} sources for {warps} async warps",
            sources.len()
        )));
    }
    let tiles: Vec<usize> = sources
        .iter()
        .zip(&plan.bytes_per_stage)
        .map(|(s, &b)| s.len().div_ceil(b as usize))
        .collect();
    let count = tiles[0];
    if tiles.iter().any(|&t| t != count) {
        return Err(HostError::Input(format!(
            "sources split into different tile counts: {tiles:?}"
        )));
    }
    plan.check_tables()
        .map_err(|e| HostError::Input(e.to_string()))?;
    let stages = plan.spec.stages as usize;
    let wgs = plan.spec.compute_warpgroups;
    let barriers: Vec<SoftBarrier> = plan
        .barriers
        .iter()
        .map(|b| SoftBarrier::new(b.init_count))
        .collect();
    let buffers: Vec<Vec<RwLock<Vec<u8>>>> = plan
        .bytes_per_stage
        .iter()
        .map(|&b| {
            (0..stages)
                .map(|_| RwLock::new(vec![0u8; b as usize]))
                .collect()
        })
        .collect();
    // The bytes of warp `w`'s source that iteration `i` moves.
    let chunk = |w: usize, i: usize| -> &[u8] {
        let b = plan.bytes_per_stage[w] as usize;
        &sources[w][i * b..((i + 1) * b).min(sources[w].len())]
    };
    let status: Mutex<Vec<String>> = Mutex::new(vec!["not started".into(); plan.roles.len()]);
    let abort = AtomicBool::new(false);
    let set_status =
        |role: usize, text: String| status.lock().unwrap_or_else(|p| p.into_inner())[role] = text;
    // Waits on barrier `b`; on timeout raises `abort` and reports.
    let wait = |role: usize, who: &str, b: usize, parity: u32, i: usize| -> bool {
        set_status(
            role,
            format!(
                "{who} (iteration {i}) waits {} parity {parity} (barrier in phase {})",
                plan.barrier_name(b),
                barriers[b].phase()
            ),
        );
        let ok = barriers[b].wait_parity(parity, Instant::now() + timeout, &abort);
        if ok {
            set_status(role, format!("{who} (iteration {i}) running"));
        } else {
            abort.store(true, Ordering::SeqCst);
        }
        ok
    };
    std::thread::scope(|scope| {
        for (r, role) in plan.roles.iter().enumerate() {
            let (wait, barriers, buffers, set_status, chunk, compute) =
                (&wait, &barriers, &buffers, &set_status, &chunk, &compute);
            scope.spawn(move || {
                let who = role.name();
                let mut state = role.start;
                for i in 0..count {
                    let stage = state.index as usize;
                    let at = |group: usize| plan.groups[group].barriers[stage];
                    // Where the next copy into each buffer starts in its chunk.
                    let mut copied = vec![0usize; buffers.len()];
                    let mut reads = Vec::new();
                    for (k, action) in role.body.iter().enumerate() {
                        match *action {
                            Action::Wait { group } => {
                                if !wait(r, &who, at(group), state.phase, i) {
                                    return;
                                }
                            }
                            Action::ArriveExpectTx { group, bytes } => {
                                // A tail tile expects what its copies move: at
                                // most the chunk of the buffer they fill.
                                let landing = role.body[k..].iter().find_map(|a| match *a {
                                    Action::Copy {
                                        group: g, buffer, ..
                                    } if g == group => Some(chunk(buffer, i).len() as u64),
                                    _ => None,
                                });
                                barriers[at(group)]
                                    .arrive_expect_tx(bytes.min(landing.unwrap_or(0)));
                            }
                            Action::Copy {
                                group,
                                buffer,
                                bytes,
                            } => {
                                // The "async copy": data lands, then its
                                // bytes complete on the barrier.
                                let from = chunk(buffer, i);
                                let start = copied[buffer].min(from.len());
                                let end = (start + bytes as usize).min(from.len());
                                buffers[buffer][stage]
                                    .write()
                                    .unwrap_or_else(|p| p.into_inner())
                                    [start..end]
                                    .copy_from_slice(&from[start..end]);
                                copied[buffer] = end;
                                barriers[at(group)].complete_tx((end - start) as u64);
                            }
                            Action::Read { buffer } => {
                                reads.push(buffer);
                                let more =
                                    matches!(role.body.get(k + 1), Some(Action::Read { .. }));
                                if let (false, RoleKind::Compute { warpgroup }) = (more, role.kind)
                                {
                                    let guards: Vec<_> = reads
                                        .iter()
                                        .map(|&b| {
                                            buffers[b][stage]
                                                .read()
                                                .unwrap_or_else(|p| p.into_inner())
                                        })
                                        .collect();
                                    let inputs: Vec<&[u8]> = reads
                                        .iter()
                                        .zip(&guards)
                                        .map(|(&b, g)| &g[..chunk(b, i).len()])
                                        .collect();
                                    compute(Tile {
                                        index: i,
                                        warpgroup,
                                        warpgroups: wgs,
                                        inputs,
                                    });
                                    reads.clear();
                                }
                            }
                            Action::Arrive { group, count } => barriers[at(group)].arrive(count),
                        }
                    }
                    state = state.advance(plan.spec.stages);
                }
                set_status(r, format!("{who} done"));
            });
        }
    });
    if abort.load(Ordering::SeqCst) {
        return Err(HostError::Stalled {
            timeout,
            waits: status.into_inner().unwrap_or_else(|p| p.into_inner()),
        });
    }
    Ok(count)
}
