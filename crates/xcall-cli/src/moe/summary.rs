//! The report of a run: the step times, the exchange, the phases against
//! their byte floors, the verification, as text and as JSON.

use std::time::Duration;

use serde_json::json;
use xcall_core::{Device, Platform};

use super::data::{Check, Shape};
use super::flags::{host_executor, Run, PHASE_STEPS};
use super::log::{distinct_gpus, GraphLine, PeLog};
use super::pe::{phases, Pe};
use super::verify::{check_threads, Verify};
use crate::report::JsonOut;

/// The bytes each phase must move through one PE's memory at the least
/// (reads plus writes, [`phases`] order). Per-route, with `N = P*S` permuted rows (`P`
/// slots of `S` rows): the map reads the routing and writes the map;
/// permute reads the tokens and writes every permuted row; copied,
/// dispatch and combine read the `P - 1` slots for peers and take the
/// `P - 1` slots peers write (a PE's own slot stays in place: nothing on
/// one PE), fused they move nothing (the permute's stores and the
/// unpermute's loads reach the peers' slots); the
/// experts read and write `N` rows with a capacity, dropless only the
/// `T*k` rows routed to them (on average); unpermute reads the map, the
/// probs and the routed rows and writes `y`. Waits move nothing.
///
/// Token-once (uniform routing on average, `R = T*P*(1 - (1 - 1/P)^k)`
/// token rows received, `W` the wire row): dispatch reads the tokens and
/// stores the `R - R/P` peers' rows, reads the `R` received rows and
/// writes `T*k` expert rows; the experts read and write `T*k` rows;
/// combine reads the `T*k` rows, stores `R` partial rows, reads them and
/// writes `y`.
pub(super) fn phase_bytes(s: &Shape) -> Vec<f64> {
    let (t, e, row) = (s.tokens as f64, s.experts as f64, s.row_bytes() as f64);
    if let Some(ep) = s.ep {
        let p = s.pes as f64;
        let received = t * p * (1.0 - (1.0 - 1.0 / p).powi(s.topk as i32));
        let wire = if ep.fp8 {
            s.hidden as f64 * (1.0 + 4.0 / 128.0)
        } else {
            row
        };
        let routed = t * s.topk as f64;
        return vec![
            t * row + received * (1.0 - 1.0 / p) * wire + received * wire + routed * wire,
            2.0 * routed * row,
            routed * row + 2.0 * received * row + t * row,
        ];
    }
    let n = (s.pes * s.slot_rows()) as f64;
    let expert_rows = if s.dropless { t * s.topk as f64 } else { n };
    let map = t * (2.0 * e + 1.0) * 4.0;
    // Fused, the permute and the unpermute move the peers' rows themselves.
    let peers = match s.fused {
        true => 0.0,
        false => 2.0 * n * row * (s.pes - 1) as f64 / s.pes as f64,
    };
    vec![
        t * e + map + (2.0 * e + 1.0) * 8.0,
        t * row + n * row + map,
        peers,
        0.0,
        2.0 * expert_rows * row,
        peers,
        0.0,
        map + t * e * 4.0 + (t * s.topk as f64).min(n) * row + t * row,
    ]
}

/// How much of the exchange a forked step hid behind the experts: graph
/// replays of the forked step against the same step in turn, alternated
/// in one run (each the slowest PE's median), and the exchange's share of
/// the step in turn (all but the experts' phase).
struct Overlap {
    forked: Option<f64>,
    in_turn: f64,
    exchange: f64,
}

fn overlap(s: &Shape, phase_ms: &[f64], pes: &[PeLog]) -> Overlap {
    let slowest = |i: usize| {
        pes.iter()
            .filter(|p| !p.forked.is_empty())
            .map(|p| median(&mut p.forked.iter().map(|f| f[i]).collect::<Vec<_>>()))
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    };
    let in_turn = slowest(1).unwrap_or(0.0);
    // The token-once phases: dispatch, experts, combine.
    let experts = match s.ep {
        Some(_) if phase_ms.len() == 3 => phase_ms[1],
        _ => 0.0,
    };
    Overlap {
        forked: slowest(0),
        in_turn,
        exchange: (in_turn - experts).max(0.0),
    }
}

impl Overlap {
    /// The ms the fork saved, at least 0.
    fn hidden_ms(&self) -> f64 {
        self.forked.map_or(0.0, |f| (self.in_turn - f).max(0.0))
    }

    /// The share of the exchange's time hidden, 0 to 1.
    fn fraction(&self) -> f64 {
        match self.exchange > 0.0 {
            true => (self.hidden_ms() / self.exchange).clamp(0.0, 1.0),
            false => 0.0,
        }
    }

    fn line(&self, s: &Shape) -> String {
        let n = s.ep.map_or(1, |e| e.microbatches);
        match self.forked {
            Some(f) => format!(
                "{n} micro-batches forked: {:.3} of the exchange's {:.3} ms hidden behind the experts ({:.0}%; graph replays: forked {f:.3} ms, the same step in turn {:.3} ms)",
                self.hidden_ms(),
                self.exchange,
                100.0 * self.fraction(),
                self.in_turn
            ),
            None if n > 1 => format!("{n} micro-batches in turn, not overlapped with the experts (0% hidden)"),
            None => "not overlapped with the experts (0% hidden)".to_string(),
        }
    }
}

pub(super) fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The run's verdict: OFF when nothing was checked, else PASS or FAIL.
pub(super) fn verdict(verify: Verify, mismatches: usize) -> &'static str {
    match (verify, mismatches) {
        (Verify::Off, _) => "OFF",
        (_, 0) => "PASS",
        _ => "FAIL",
    }
}

/// The median of the first and of the last tenth of `times` (at least one
/// value each), to show a drift over a long run.
pub(super) fn tenths(times: &[f64]) -> (f64, f64) {
    let n = (times.len() / 10).max(1);
    (
        median(&mut times[..n].to_vec()),
        median(&mut times[times.len() - n..].to_vec()),
    )
}

pub(super) fn mib(bytes: Option<u64>) -> String {
    bytes.map_or("-".to_string(), |b| {
        format!("{:.0} MiB", b as f64 / (1u64 << 20) as f64)
    })
}

pub(super) fn report(
    run: &Run,
    pes: &[PeLog],
    graphs: &[GraphLine],
    wall: Duration,
    json: Option<JsonOut>,
) -> Result<bool, String> {
    let s = run.shape;
    // A step takes as long as its slowest PE (they start together).
    let mut times: Vec<f64> = (0..run.steps)
        .map(|i| pes.iter().map(|p| p.steps[i].0).fold(0.0, f64::max))
        .collect();
    let first = times[0];
    let (first_tenth, last_tenth) = tenths(&times);
    let (min, max) = (
        times.iter().copied().fold(f64::INFINITY, f64::min),
        times.iter().copied().fold(0.0, f64::max),
    );
    let med = median(&mut times);
    // `times` is sorted now: the 99th percentile step.
    let p99 = times[((times.len() * 99).div_ceil(100)).clamp(1, times.len()) - 1];
    let tokens_per_s = (s.pes * s.tokens) as f64 / (med / 1e3);
    let checks: Vec<&Check> = pes
        .iter()
        .flat_map(|p| &p.checks)
        .map(|c| &c.check)
        .collect();
    let bad: usize = checks.iter().map(|c| c.mismatches).sum();
    let dropped: usize = pes.iter().flat_map(|p| &p.dropped).sum();
    let total = run.total();
    let routes = (s.pes * s.tokens * s.topk * total) as f64;
    let fill = (routes - dropped as f64) / ((s.pes * s.pes * s.slot_rows() * total) as f64);
    // Copied, whole slots cross both ways; fused, only the routed rows
    // (the slots' fill on average); token-once, each token once to each
    // other PE hosting its experts (its FP8 scales too) and one row back.
    let slot = Pe::slot_bytes(&s) as f64 * if s.fused { fill } else { 1.0 };
    let between = match s.ep {
        Some(ep) => {
            let wire = match ep.fp8 {
                true => (s.hidden + s.hidden / 128 * 4) as f64,
                false => s.row_bytes() as f64,
            };
            let link: f64 = pes
                .iter()
                .map(|p| {
                    p.link_tokens.iter().sum::<usize>() as f64 / p.link_tokens.len().max(1) as f64
                })
                .sum();
            link * (wire + s.row_bytes() as f64)
        }
        None => 2.0 * slot * (s.pes * (s.pes - 1)) as f64,
    };
    let gbps = between / (med / 1e3) / 1e9;
    let checked_steps = pes.first().map_or(0, |p| p.checks.len());
    let check_time: Duration = pes.iter().flat_map(|p| &p.checks).map(|c| c.took).sum();
    let draw_time: Duration = pes.iter().map(|p| p.draw_time).sum();
    let queue_wait = pes.iter().map(|p| p.queue_wait).max().unwrap_or_default();
    let input_wait = pes.iter().map(|p| p.input_wait).max().unwrap_or_default();
    let memory = |f: fn(&PeLog) -> Option<u64>| pes.iter().filter_map(f).max();
    let memory = (memory(|p| p.memory.0), memory(|p| p.memory.1));
    let max_rel = checks.iter().map(|c| c.max_relative).fold(0.0, f64::max);
    let devices: Vec<Device> = match run.platform {
        Platform::Host => vec![Device::HOST],
        Platform::Cuda => {
            let mut d = run.devices.clone();
            d.sort_by_key(|d| d.ordinal);
            d.dedup();
            d
        }
    };
    let mut outcomes = std::collections::BTreeMap::<String, usize>::new();
    for p in pes {
        for (_, o) in &p.steps {
            *outcomes.entry(o.name().to_string()).or_default() += 1;
        }
    }
    // Each phase: the median over the instrumented steps per PE, and the
    // slowest PE's; its floor at the PEs' median copy rate (CUDA).
    let names = phases(&s);
    let per_pe: Vec<Vec<f64>> = (0..names.len())
        .map(|i| {
            pes.iter()
                .map(|p| median(&mut p.phases.iter().map(|v| v[i]).collect::<Vec<_>>()))
                .collect()
        })
        .collect();
    let phase_ms: Vec<f64> = per_pe
        .iter()
        .map(|v| v.iter().copied().fold(0.0, f64::max))
        .collect();
    let overlap = overlap(&s, &phase_ms, pes);
    let mut copies: Vec<f64> = pes.iter().filter_map(|p| p.copy_ms).collect();
    let copied = 2.0 * Pe::copy_bytes(&s) as f64;
    // Bytes per ms.
    let copy_rate = (!copies.is_empty()).then(|| copied / median(&mut copies));
    let bytes = phase_bytes(&s);
    let floors: Vec<Option<f64>> = bytes.iter().map(|b| copy_rate.map(|r| b / r)).collect();
    let step_floor = copy_rate.map(|r| bytes.iter().sum::<f64>() / r);
    let verdict = verdict(run.verify, bad);
    let platform = run.platform.name();
    let remote = pes.iter().find_map(|l| l.remote);
    let layout = match (&run.launched, run.platform) {
        (Some(l), _) => format!(
            " ({} processes under {}, {} PE(s) each, one thread per PE)",
            l.processes,
            l.launcher,
            run.devices.len()
        ),
        (None, Platform::Host) => " (threads)".into(),
        (None, _) => " (one thread per GPU)".into(),
    };
    println!(
        "xcall moe: {platform}, {} PE(s){layout}, {} tokens/PE, hidden {}, {} experts ({} per PE), top-{}, {}",
        s.pes,
        s.tokens,
        s.hidden,
        s.experts,
        s.local_experts(),
        s.topk,
        s.dtype
    );
    let heap_bytes = Pe::heap_bytes(&s).unwrap_or_default();
    let heap_mib = heap_bytes as f64 / (1u64 << 20) as f64;
    if s.dropless {
        println!(
            "  dropless: slots of {} rows (tokens x min(top-k, experts per PE)) per sender, {heap_mib:.0} MiB of symmetric heap per PE; {} timed steps after 1 warm-up step",
            s.slot_rows(),
            run.steps
        );
    } else {
        println!(
            "  capacity {} rows per expert per PE (factor {}), {heap_mib:.0} MiB of symmetric heap per PE; {} timed steps after 1 warm-up step",
            s.capacity, run.capacity_factor, run.steps
        );
    }
    // Processes that share a GPU take turns on it: their times are the
    // turns'.
    let gpus = distinct_gpus(pes);
    if let Some(g) = gpus.filter(|&g| g < s.pes) {
        println!(
            "  shared GPUs    {} PEs ran on {g} GPU(s): processes that share a GPU take turns on it, so the times below measure the turns, not the exchange (the outputs are checked all the same)",
            s.pes
        );
    }
    let memory_kind = match run.platform {
        Platform::Host => "process resident set",
        Platform::Cuda => "device memory in use (most of any GPU)",
    };
    println!();
    println!("  step time      median {med:.3} ms   min {min:.3} ms   p99 {p99:.3} ms   max {max:.3} ms   (first timed step {first:.3} ms)");
    println!(
        "  steady state   median of the first tenth of timed steps {first_tenth:.3} ms, of the last tenth {last_tenth:.3} ms; {memory_kind} {} after the warm-up, {} at the end",
        mib(memory.0),
        mib(memory.1)
    );
    println!("  tokens/s       {tokens_per_s:.0}");
    if let Some(e) = host_executor(run) {
        println!("  experts        on the Host, {e}");
    }
    println!(
        "  exchange       {}: {:.1} MB/step between PEs (each PE's own rows stay in place), {gbps:.2} GB/s at the median",
        if s.ep.is_some_and(|e| e.fp8) {
            "token-once, FP8 dispatch (each token stored once into each PE hosting its experts, one bf16 row back)"
        } else if s.ep.is_some() {
            "token-once (each token stored once into each PE hosting its experts, one row back)"
        } else if s.fused {
            "fused (permute writes the peers' slots, unpermute reads them)"
        } else if remote.is_some_and(|r| r.starts_with("nccl")) {
            "copy (whole slots, one World::exchange per phase, through NCCL)"
        } else if remote.is_some() {
            "copy (whole slots, one World::exchange per phase, through TCP)"
        } else {
            "copy (whole slots with put_signal)"
        },
        between / 1e6,
    );
    if s.ep.is_some() {
        println!(
            "  per PE         {:.1} MB/step between PEs (both ways), {:.2} GB/s at the median; exchange kernels on {}{}; {}",
            between / s.pes as f64 / 1e6,
            gbps / s.pes as f64,
            pes.iter()
                .find_map(|p| p.sms)
                .map_or("the Host".to_string(), |n| format!("at most {n} SMs")),
            match pes.iter().find_map(|p| p.kernels.as_deref()) {
                Some("low-latency") => " (the low-latency kernels: one per call)",
                Some("pull") => " (a kernel per step, dispatch pulling)",
                Some(_) => " (a kernel per step)",
                None => "",
            },
            overlap.line(&s),
        );
    }
    println!(
        "  {:<15}{:.1}% of the permuted rows used, {} route(s) dropped over all steps",
        if s.dropless {
            "slot fill"
        } else {
            "capacity fill"
        },
        fill * 100.0,
        dropped
    );
    for g in graphs {
        println!("  graph cache    {}: {}", g.label, g.line);
    }
    println!(
        "  phases         median of {PHASE_STEPS} eager steps with each phase's end marked, slowest PE{}",
        copy_rate.map_or(String::new(), |r| format!(
            "; floor = its bytes through one PE's memory at the copy rate ({:.0} GB/s)",
            r / 1e6
        ))
    );
    let cell = |f: Option<f64>| f.map_or("-".to_string(), |f| format!("{f:.3}"));
    for ((name, ms), floor) in names.iter().zip(&phase_ms).zip(&floors) {
        println!("    {name:<14} {ms:>8.3} ms   floor {:>7}", cell(*floor));
    }
    println!(
        "    {:<14} {:>8.3} ms   floor {:>7}   (graph step median {med:.3} ms)",
        "sum",
        phase_ms.iter().sum::<f64>(),
        cell(step_floor)
    );
    let per_check = check_time.as_secs_f64() * 1e3 / (checks.len().max(1) as f64);
    println!(
        "  verification   {verdict}: {} PE(s) x {checked_steps} of {total} step(s) (--verify {}) against the f64 reference, {bad} mismatching element(s), max relative error {max_rel:.2e}",
        s.pes, run.verify,
    );
    println!(
        "  check cost     checks {:.2} s ({per_check:.1} ms per checked PE-step on {} thread(s)), draws {:.2} s, {}; the PEs waited {:.2} s for inputs and {:.2} s for the checker queues; wall time {:.2} s",
        check_time.as_secs_f64(),
        check_threads(run.devices.len()),
        draw_time.as_secs_f64(),
        match run.platform {
            Platform::Host => "between the steps (outside their times)",
            Platform::Cuda => "on threads beside the GPU work",
        },
        input_wait.as_secs_f64(),
        queue_wait.as_secs_f64(),
        wall.as_secs_f64()
    );
    if bad > 0 {
        for (rank, p) in pes.iter().enumerate() {
            for c in &p.checks {
                if let Some((t, j, got, want)) = c.check.first {
                    println!(
                        "    PE {rank} step {}: {} mismatch(es), first at token {t} column {j}: {got} vs {want}",
                        c.step, c.check.mismatches
                    );
                }
            }
        }
    }
    if let Some(out) = json {
        let mut doc = json!({
            "platform": platform,
            "pes": s.pes, "tokens": s.tokens, "hidden": s.hidden, "experts": s.experts,
            "topk": s.topk, "dtype": s.dtype.name(), "capacity": s.capacity,
            "dropless": s.dropless,
            "exchange": if s.ep.is_some() { "token" } else if s.fused { "fused" } else { "copy" },
            "slot_rows": s.slot_rows(), "heap_bytes": heap_bytes,
            "capacity_factor": run.capacity_factor, "steps": run.steps, "seed": run.seed,
            "step_ms": {"median": med, "min": min, "max": max, "p99": p99, "first": first,
                "first_tenth": first_tenth, "last_tenth": last_tenth},
            "memory_bytes": {"kind": if run.platform == Platform::Host { "host_resident" } else { "device_in_use" },
                "after_warmup": memory.0, "at_end": memory.1},
            "wall_s": wall.as_secs_f64(),
            "tokens_per_s": tokens_per_s,
            "exchange_bytes_per_step": between,
            "exchange_gb_per_s": gbps,
            "capacity_fill": fill, "dropped_routes": dropped,
            "phases": names.iter().enumerate().map(|(i, name)| json!({
                "name": name.replace(' ', "_"), "ms": phase_ms[i], "ms_per_pe": per_pe[i],
                "bytes": bytes[i], "floor_ms": floors[i],
            })).collect::<Vec<_>>(),
            "phase_steps": PHASE_STEPS,
            "copy_gb_per_s": copy_rate.map(|r| r / 1e6),
            "step_floor_ms": step_floor,
            "outcomes": outcomes,
            "graph_cache": graphs.iter()
                .map(|g| (g.label.clone(), g.stats.clone()))
                .collect::<serde_json::Map<_, _>>(),
            "verification": {"verdict": verdict, "mismatches": bad, "max_relative_error": max_rel,
                "mode": run.verify.to_string(), "checked_steps": checked_steps, "total_steps": total,
                "check_s": check_time.as_secs_f64(), "draw_s": draw_time.as_secs_f64(),
                "wait_s": queue_wait.as_secs_f64(), "input_wait_s": input_wait.as_secs_f64()},
        });
        // Past json!'s recursion limit in one literal.
        doc["remote_transport"] = json!(remote);
        doc["processes"] = json!(run.launched.as_ref().map_or(1, |l| l.processes));
        doc["launcher"] = json!(run.launched.as_ref().map(|l| l.launcher));
        doc["host_executor"] = json!(host_executor(run));
        doc["gpus"] = json!(gpus);
        doc["exchange_per_pe"] = json!({
            "bytes_per_step": between / s.pes as f64,
            "gb_per_s": gbps / s.pes as f64,
            "sms": pes.iter().find_map(|p| p.sms),
            "kernels": pes.iter().find_map(|p| p.kernels.as_deref()),
            "hidden_fraction": overlap.fraction(),
            "microbatches": s.ep.map(|e| e.microbatches),
            "forked_step_ms": overlap.forked,
            "in_turn_step_ms": overlap.forked.map(|_| overlap.in_turn),
            "fp8_dispatch": s.ep.is_some_and(|e| e.fp8),
            "align": s.ep.map(|e| e.align),
        });
        out.write("moe", &devices, doc)?;
    }
    Ok(bad == 0)
}
