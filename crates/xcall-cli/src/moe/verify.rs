//! Which steps' outputs `xcall moe` checks (`--verify`), and the threads
//! that draw the inputs and check the outputs beside the PEs' GPU work.
//!
//! A run numbers its steps `0..total`: the warm-up step 0, the timed steps
//! `1..=steps`, then the instrumented ones. A checked step gets fresh
//! inputs, a poisoned output and, once it ran, a check of that output; an
//! unchecked step runs again on the inputs already on the device, so it
//! costs the host nothing. On CUDA the inputs are drawn ahead on the PE's
//! drawer thread and the outputs checked on its checker thread, beside
//! the GPU work; the queues between the threads are bounded, so a PE runs
//! at most [`QUEUE`] checked steps ahead of its checker. On Host, where
//! the PEs are the CPU's threads, both happen between the steps.

use std::fmt;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::data::{check_with, draw_into, dropped_routes, kept_routes_into, Check, Inputs, Shape};
use crate::alloc::{self, AllocError, RunError};

/// Checked steps a PE may run ahead of its checker (and inputs its drawer
/// may draw ahead of the PE).
pub const QUEUE: usize = 2;

/// Timed steps up to which the default checks every step.
pub const EVERY_UP_TO: usize = 100;

/// Which steps' outputs are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Every step.
    Every,
    /// Steps `0..n` (the warm-up step and the first `n - 1` after it).
    First(usize),
    /// Steps `0, k, 2k, ...` and the last step.
    Sample(usize),
    /// None.
    Off,
}

impl Verify {
    /// Parses `every`, `first:N`, `sample:K` (N, K >= 1) or `off`.
    pub fn parse(text: &str) -> Result<Verify, String> {
        let count = |n: &str, what: &str| -> Result<usize, String> {
            match n.parse::<usize>() {
                Ok(0) => Err(format!("{what}:0 checks nothing; say off")),
                Ok(v) => Ok(v),
                Err(_) => Err(format!("{what}:{n}: {n:?} is not a step count")),
            }
        };
        match text.split_once(':') {
            None if text == "every" => Ok(Verify::Every),
            None if text == "off" => Ok(Verify::Off),
            Some(("first", n)) => count(n, "first").map(Verify::First),
            Some(("sample", k)) => count(k, "sample").map(Verify::Sample),
            _ => Err(format!(
                "{text:?}: expected every, first:N, sample:K or off"
            )),
        }
    }

    /// The default for `steps` timed steps: every step up to
    /// [`EVERY_UP_TO`], else about that many steps spread over the run.
    pub fn default_for(steps: usize) -> Verify {
        if steps <= EVERY_UP_TO {
            Verify::Every
        } else {
            Verify::Sample(steps.div_ceil(EVERY_UP_TO))
        }
    }

    /// Whether step `n` of a run of `total` steps is checked.
    pub fn checks(self, n: usize, total: usize) -> bool {
        match self {
            Verify::Every => n < total,
            Verify::First(k) => n < k.min(total),
            Verify::Sample(k) => n < total && (n % k == 0 || n + 1 == total),
            Verify::Off => false,
        }
    }

    /// The steps of a run of `total` that get fresh inputs: the checked
    /// ones and step 0 (the device never runs on unwritten inputs).
    pub fn drawn(self, total: usize) -> impl Iterator<Item = usize> + Send {
        (0..total).filter(move |&n| n == 0 || self.checks(n, total))
    }
}

impl fmt::Display for Verify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verify::Every => write!(f, "every"),
            Verify::First(n) => write!(f, "first:{n}"),
            Verify::Sample(k) => write!(f, "sample:{k}"),
            Verify::Off => write!(f, "off"),
        }
    }
}

/// Threads each PE's checker splits one output's check over.
pub fn check_threads(pes: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / pes).max(1)
}

/// Inputs drawn for step `step`, with the routes the capacity drops and
/// the time the draw took.
pub struct Drawn {
    /// The step they are for.
    pub step: usize,
    /// The inputs.
    pub inputs: Arc<Inputs>,
    /// Routes the layer's capacity drops from them.
    pub dropped: usize,
    /// Token rows the token-once dispatch moves to other PEs (0 for
    /// the per-route exchanges).
    pub link_tokens: usize,
    /// The time drawing them took.
    pub took: Duration,
}

/// An output to check.
pub struct Job {
    /// The step it is of.
    pub step: usize,
    /// The inputs the step ran on.
    pub inputs: Arc<Inputs>,
    /// The output `y`.
    pub y: Vec<u8>,
}

/// A checked output, with the time its check took.
pub struct Checked {
    /// The step it is of.
    pub step: usize,
    /// The check.
    pub check: Check,
    /// Its cost.
    pub took: Duration,
}

/// The kept routes of PE `rank`'s inputs, `[T, E]`.
fn kept_buffer(shape: &Shape, rank: usize) -> Result<Vec<bool>, AllocError> {
    let what = || format!("PE {rank}'s kept routes");
    let len = alloc::count::<bool>(what, shape.tokens, shape.experts)?;
    alloc::zeroed(what, len)
}

/// The output `y` of PE `rank`, `[T, H]`, to download into.
fn output_buffer(shape: &Shape, rank: usize) -> Result<Vec<u8>, AllocError> {
    let what = || format!("PE {rank}'s output");
    let len = alloc::count::<u8>(what, shape.tokens, shape.row_bytes())?;
    alloc::zeroed(what, len)
}

/// Draws PE `rank`'s inputs of step `step` on `threads` threads into
/// `inputs`, with `kept` (`[T, E]`) to count the routes dropped.
pub fn draw_for(
    shape: &Shape,
    (seed, rank, step, threads): (u64, usize, usize, usize),
    mut inputs: Inputs,
    kept: &mut [bool],
) -> Result<Drawn, AllocError> {
    let start = Instant::now();
    draw_into(shape, seed, step, rank, threads, &mut inputs)?;
    kept_routes_into(shape, &inputs.routing, kept);
    let dropped = dropped_routes(&inputs.routing, kept);
    let link_tokens = match shape.ep {
        Some(_) => super::data::link_tokens(shape, rank, &inputs.routing),
        None => 0,
    };
    Ok(Drawn {
        step,
        inputs: Arc::new(inputs),
        dropped,
        link_tokens,
        took: start.elapsed(),
    })
}

/// Checks one output, with `kept` (`[T, E]`) to hold its kept routes.
pub fn check_job(
    shape: &Shape,
    job: &Job,
    threads: usize,
    kept: &mut [bool],
) -> Result<Checked, AllocError> {
    let start = Instant::now();
    let check = check_with(shape, &job.inputs, &job.y, threads, kept)?;
    Ok(Checked {
        step: job.step,
        check,
        took: start.elapsed(),
    })
}

/// Draws PE `rank`'s inputs for the `steps` in order (each on `threads`
/// threads) into a queue of [`QUEUE`]; stops when the receiver goes away,
/// or after sending a buffer it could not allocate.
pub fn drawer(
    shape: Shape,
    seed: u64,
    rank: usize,
    steps: impl Iterator<Item = usize> + Send,
    threads: usize,
) -> (Receiver<Result<Drawn, AllocError>>, impl FnOnce() + Send) {
    let (tx, rx) = sync_channel(QUEUE);
    let work = move || {
        let mut kept = match kept_buffer(&shape, rank) {
            Ok(k) => k,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        for step in steps {
            let drawn = Inputs::alloc(&shape, rank).and_then(|inputs| {
                draw_for(&shape, (seed, rank, step, threads), inputs, &mut kept)
            });
            let failed = drawn.is_err();
            if tx.send(drawn).is_err() || failed {
                return;
            }
        }
    };
    (rx, work)
}

/// Checks every output sent to the returned queue (of [`QUEUE`]) on
/// `threads` threads per output, until the sender goes away; the work
/// returns the checks in the order they came, or the buffer it could not
/// allocate (it stops then, and the queue with it).
pub fn checker(
    shape: Shape,
    rank: usize,
    threads: usize,
) -> (
    SyncSender<Job>,
    impl FnOnce() -> Result<Vec<Checked>, AllocError> + Send,
) {
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let work = move || {
        let mut kept = kept_buffer(&shape, rank)?;
        rx.into_iter()
            .map(|job| check_job(&shape, &job, threads, &mut kept))
            .collect()
    };
    (tx, work)
}

/// The host buffers of a PE that draws and checks on its own thread,
/// allocated once and used for every step.
pub struct InlineBuffers {
    /// Inputs to draw into (`None` while a step's inputs hold them).
    spare: Option<Inputs>,
    /// The output to download into (`None` while a check holds it).
    y: Option<Vec<u8>>,
    /// The kept routes of a draw or a check.
    kept: Vec<bool>,
}

/// Where a PE gets its inputs and sends its outputs.
pub enum Checks {
    /// Threads of their own beside the PE (queues to a drawer and a
    /// checker): on CUDA, where the PE's thread only feeds its GPU.
    Beside {
        /// Inputs, in step order.
        inputs: Receiver<Result<Drawn, AllocError>>,
        /// Outputs to check.
        jobs: SyncSender<Job>,
        /// The layer.
        shape: Shape,
        /// The PE.
        rank: usize,
    },
    /// On the PE's thread between its steps: on Host, where the PE's
    /// thread is the device and a check beside it would slow its steps.
    Inline {
        /// The layer.
        shape: Shape,
        /// The run's seed.
        seed: u64,
        /// The PE.
        rank: usize,
        /// Threads of one draw or check.
        threads: usize,
        /// Its buffers.
        buffers: Box<InlineBuffers>,
    },
}

impl Checks {
    /// Draws and checks on PE `rank`'s own thread, its buffers allocated
    /// now.
    pub fn inline(
        shape: Shape,
        seed: u64,
        rank: usize,
        threads: usize,
    ) -> Result<Checks, AllocError> {
        let buffers = InlineBuffers {
            spare: Some(Inputs::alloc(&shape, rank)?),
            y: Some(output_buffer(&shape, rank)?),
            kept: kept_buffer(&shape, rank)?,
        };
        Ok(Checks::Inline {
            shape,
            seed,
            rank,
            threads,
            buffers: Box::new(buffers),
        })
    }

    /// The inputs of step `n`, the next step that gets some, and how long
    /// the PE waited for them (zero when drawn now: the draw's own time is
    /// in its [`Drawn`]). `previous`: the inputs of the step before, whose
    /// buffers a draw on this thread reuses once nothing else holds them.
    pub fn inputs(
        &mut self,
        n: usize,
        previous: Option<Arc<Inputs>>,
    ) -> Result<(Drawn, Duration), RunError> {
        let start = Instant::now();
        let (d, waited) = match self {
            Checks::Beside { inputs, .. } => {
                let d = inputs
                    .recv()
                    .map_err(|_| format!("step {n}: the input drawer stopped"))??;
                (d, start.elapsed())
            }
            Checks::Inline {
                shape,
                seed,
                rank,
                threads,
                buffers,
            } => {
                let into = match buffers.spare.take() {
                    Some(spare) => spare,
                    None => match previous.map(Arc::try_unwrap) {
                        Some(Ok(inputs)) => inputs,
                        _ => Inputs::alloc(shape, *rank)?,
                    },
                };
                let at = (*seed, *rank, n, *threads);
                let d = draw_for(shape, at, into, &mut buffers.kept)?;
                (d, Duration::ZERO)
            }
        };
        if d.step != n {
            return Err(format!("step {n}: the drawer sent step {}", d.step).into());
        }
        Ok((d, waited))
    }

    /// A buffer for a step's output `y`: the one the last check on this
    /// thread gave back, else a new one.
    pub fn output(&mut self) -> Result<Vec<u8>, AllocError> {
        match self {
            Checks::Beside { shape, rank, .. } => output_buffer(shape, *rank),
            Checks::Inline {
                shape,
                rank,
                buffers,
                ..
            } => match buffers.y.take() {
                Some(y) => Ok(y),
                None => output_buffer(shape, *rank),
            },
        }
    }

    /// Checks `job`: queues it for the checker thread (returning how long
    /// the queue kept the PE waiting, and no check: the thread returns it)
    /// or checks it now (returning zero and the check, whose own time is
    /// in it; its output buffer serves the next one).
    pub fn submit(&mut self, job: Job) -> Result<(Duration, Option<Checked>), RunError> {
        match self {
            Checks::Beside { jobs, .. } => {
                let (start, step) = (Instant::now(), job.step);
                jobs.send(job)
                    .map_err(|_| format!("step {step}: the output checker stopped"))?;
                Ok((start.elapsed(), None))
            }
            Checks::Inline {
                shape,
                threads,
                buffers,
                ..
            } => {
                let checked = check_job(shape, &job, *threads, &mut buffers.kept)?;
                buffers.y = Some(job.y);
                Ok((Duration::ZERO, Some(checked)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::data::{check, draw};
    use super::*;
    use xcall_core::DType;

    #[test]
    fn modes_parse_print_and_pick_their_steps() {
        for (text, mode) in [
            ("every", Verify::Every),
            ("off", Verify::Off),
            ("first:3", Verify::First(3)),
            ("sample:10", Verify::Sample(10)),
        ] {
            assert_eq!(Verify::parse(text), Ok(mode));
            assert_eq!(mode.to_string(), text);
        }
        for (bad, want) in [
            ("first:0", "first:0 checks nothing; say off"),
            ("sample:0", "sample:0 checks nothing; say off"),
            ("sample:-1", "sample:-1: \"-1\" is not a step count"),
            ("first:", "first:: \"\" is not a step count"),
            ("all", "\"all\": expected every, first:N, sample:K or off"),
            ("every:2", "expected every"),
            ("", "expected every"),
        ] {
            let e = Verify::parse(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        let picked = |v: Verify, total| -> Vec<usize> {
            (0..total + 2).filter(|&n| v.checks(n, total)).collect()
        };
        assert_eq!(picked(Verify::Every, 4), [0, 1, 2, 3]);
        assert_eq!(picked(Verify::Off, 4), Vec::<usize>::new());
        assert_eq!(picked(Verify::First(2), 5), [0, 1]);
        assert_eq!(picked(Verify::First(9), 3), [0, 1, 2]);
        assert_eq!(picked(Verify::Sample(3), 8), [0, 3, 6, 7]);
        assert_eq!(picked(Verify::Sample(3), 7), [0, 3, 6]);
        assert_eq!(picked(Verify::Sample(1), 3), [0, 1, 2]);
        // Step 0 always gets inputs, checked or not.
        let drawn = |v: Verify, total| v.drawn(total).collect::<Vec<_>>();
        assert_eq!(drawn(Verify::Off, 5), [0]);
        assert_eq!(drawn(Verify::First(2), 5), [0, 1]);
        assert_eq!(drawn(Verify::Sample(2), 6), [0, 2, 4, 5]);
    }

    #[test]
    fn the_default_checks_short_runs_fully_and_about_a_hundred_steps_of_long_ones() {
        assert_eq!(Verify::default_for(1), Verify::Every);
        assert_eq!(Verify::default_for(100), Verify::Every);
        assert_eq!(Verify::default_for(101), Verify::Sample(2));
        assert_eq!(Verify::default_for(1000), Verify::Sample(10));
        assert_eq!(Verify::default_for(1001), Verify::Sample(11));
        let total = 1000 + 4;
        let n = (0..total)
            .filter(|&s| Verify::default_for(1000).checks(s, total))
            .count();
        assert_eq!(n, 102);
    }

    #[test]
    fn the_drawer_and_the_checker_see_every_step_in_order() {
        let shape = Shape {
            pes: 1,
            tokens: 40,
            hidden: 8,
            experts: 4,
            topk: 2,
            capacity: 12,
            dropless: false,
            fused: true,
            dtype: DType::F32,
            ep: None,
        };
        let (inputs, draw_work) = drawer(shape, 3, 0, [0, 2, 5].into_iter(), 2);
        let (jobs, check_work) = checker(shape, 0, 2);
        let (drawn, checked) = std::thread::scope(|s| {
            let d = s.spawn(draw_work);
            let c = s.spawn(check_work);
            let drawn: Vec<Drawn> = inputs.iter().map(Result::unwrap).collect();
            for (i, d) in drawn.iter().enumerate() {
                // A wrong output for the middle step.
                let bytes = if i == 1 { 0xffu8 } else { 0 };
                let y = vec![bytes; shape.tokens * shape.row_bytes()];
                jobs.send(Job {
                    step: d.step,
                    inputs: d.inputs.clone(),
                    y,
                })
                .unwrap();
            }
            drop(jobs);
            d.join().unwrap();
            (drawn, c.join().unwrap().unwrap())
        });
        let steps: Vec<usize> = drawn.iter().map(|d| d.step).collect();
        assert_eq!(steps, [0, 2, 5]);
        for d in &drawn {
            let again = draw(&shape, 3, d.step, 0, 1).unwrap();
            assert_eq!(d.inputs.x, again.x, "step {}", d.step);
            let c = check(&shape, &d.inputs, &vec![0; 40 * 32], 1);
            assert_eq!(d.dropped, c.dropped, "step {}", d.step);
        }
        // 12 rows per expert for 80 routes over 4 experts: some drop.
        assert!(drawn.iter().any(|d| d.dropped > 0));
        let steps: Vec<usize> = checked.iter().map(|c| c.step).collect();
        assert_eq!(steps, [0, 2, 5]);
        assert_eq!(checked[1].check.mismatches, 40 * 8, "NaN everywhere");
        // Zeros match nowhere a route is kept (silu(x) of x in (0, 3) > 0).
        assert!(checked[0].check.mismatches > 0);
    }

    #[test]
    fn a_drawer_whose_reader_left_stops() {
        let shape = Shape {
            pes: 1,
            tokens: 4,
            hidden: 8,
            experts: 2,
            topk: 1,
            capacity: 4,
            dropless: false,
            fused: true,
            dtype: DType::F32,
            ep: None,
        };
        let (inputs, work) = drawer(shape, 1, 0, 0..1_000_000, 1);
        drop(inputs);
        let start = Instant::now();
        work();
        assert!(start.elapsed() < Duration::from_secs(10));
    }
}
