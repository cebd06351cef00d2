//! What one PE saw over a run ([`PeLog`]), and the graph caches' lines
//! of the report.

use std::time::Duration;

use serde_json::json;
use xcall_core::{Device, Platform};
use xcall_graph::cuda::CudaGraphs;
use xcall_graph::{GraphCache, Outcome, Stats};

use super::flags::Launched;
use super::verify::Checked;

/// What one PE saw.
#[derive(Default)]
pub(super) struct PeLog {
    /// Per timed step: ms and the cache's outcome.
    pub(super) steps: Vec<(f64, Outcome)>,
    /// Per instrumented step: each phase's ms (`pe::phases` order).
    pub(super) phases: Vec<Vec<f64>>,
    /// Per instrumented step with micro-batches on CUDA: the median ms of
    /// graph replays of the step forked and of the same step in turn.
    pub(super) forked: Vec<[f64; 2]>,
    /// The median ms of a copy of the permuted tensor (CUDA).
    pub(super) copy_ms: Option<f64>,
    /// The checked steps' checks, in step order.
    pub(super) checks: Vec<Checked>,
    /// Per step of the run: the routes its inputs lose to the capacity.
    pub(super) dropped: Vec<usize>,
    /// Per step of the run: the token rows its dispatch moves to other
    /// PEs (token-once exchange; combine returns as many).
    pub(super) link_tokens: Vec<usize>,
    /// SMs the exchange kernels may occupy (token-once exchange on CUDA).
    pub(super) sms: Option<usize>,
    /// The kernels of the exchange (token-once exchange on CUDA):
    /// `low-latency`, `steps` or `pull` ([`xcall_ep::EpKernels::name`]).
    pub(super) kernels: Option<String>,
    /// Time the drawer thread spent drawing inputs.
    pub(super) draw_time: Duration,
    /// Time the PE waited for room in its checker's queue.
    pub(super) queue_wait: Duration,
    /// Time the PE waited for its drawer's inputs.
    pub(super) input_wait: Duration,
    /// Memory in use after the warm-up step and after the last step.
    pub(super) memory: (Option<u64>, Option<u64>),
    /// The transport of the PE's pairs without pointers ("nccl", "tcp"),
    /// when some pair took one.
    pub(super) remote: Option<&'static str>,
    /// The GPU this PE ran on, as its host and PCI address (CUDA): PEs of
    /// different processes that share one take turns on it.
    pub(super) gpu: Option<String>,
    /// The graph cache lines this PE reports: its device's on CUDA; on
    /// Host, its process's (the first PE of a launched process only).
    pub(super) graphs: Vec<GraphLine>,
}

/// The distinct GPUs `pes` ran on; `None` unless every PE named its GPU
/// (Host, or a GPU that could not be read).
pub(super) fn distinct_gpus(pes: &[PeLog]) -> Option<usize> {
    let mut gpus: Vec<&str> = pes
        .iter()
        .map(|p| p.gpu.as_deref())
        .collect::<Option<_>>()?;
    gpus.sort_unstable();
    gpus.dedup();
    (!gpus.is_empty()).then_some(gpus.len())
}

/// One device's graph cache as the report shows it.
#[derive(Clone, Debug)]
pub(super) struct GraphLine {
    /// "cuda:0", or "process 1 cuda:0" in a launched run.
    pub(super) label: String,
    /// Its stats as a line of text.
    pub(super) line: String,
    /// Its stats as JSON.
    pub(super) stats: serde_json::Value,
}

/// The graph caches of this process's `devices` (Host: one), labelled
/// with the process in a launched run.
pub(super) fn graph_lines(
    cache: &GraphCache<CudaGraphs>,
    devices: &[Device],
    launched: Option<&Launched>,
) -> Vec<GraphLine> {
    let mut devices = devices.to_vec();
    if devices
        .first()
        .is_some_and(|d| d.platform == Platform::Host)
    {
        devices = vec![Device::HOST];
    }
    devices.sort_by_key(|d| d.ordinal);
    devices.dedup();
    devices
        .iter()
        .map(|d| GraphLine {
            label: match launched {
                None => d.to_string(),
                Some(l) => format!("process {} {d}", l.process),
            },
            line: stats_line(&cache.stats(*d)),
            stats: stats_json(&cache.stats(*d)),
        })
        .collect()
}

pub(super) fn stats_json(s: &Stats) -> serde_json::Value {
    json!({
        "hits": s.hits, "captures": s.captures, "updates": s.updates,
        "instantiations": s.instantiations, "entries": s.entries, "nodes": s.nodes,
        "eager_host": s.eager_host,
        "eager_fallbacks": s.eager_disabled + s.eager_caller_capturing
            + s.eager_capture_in_progress + s.eager_not_capturable + s.eager_capture_failed,
    })
}

pub(super) fn stats_line(s: &Stats) -> String {
    if s.eager_host > 0 {
        return format!("{} run directly (Host has no graphs)", s.eager_host);
    }
    let eager = s.eager_disabled
        + s.eager_caller_capturing
        + s.eager_capture_in_progress
        + s.eager_not_capturable
        + s.eager_capture_failed;
    format!(
        "{} capture(s), {} replay(s), {} instantiation(s), {} eager; {} graph(s) of {} nodes",
        s.captures, s.hits, s.instantiations, eager, s.entries, s.nodes
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(gpu: Option<&str>) -> PeLog {
        PeLog {
            gpu: gpu.map(str::to_string),
            ..PeLog::default()
        }
    }

    #[test]
    fn gpus_are_told_apart_by_host_and_address() {
        let a = Some("h0/0000:19:00.0");
        let b = Some("h0/0000:3b:00.0");
        let other_host = Some("h1/0000:19:00.0");
        assert_eq!(distinct_gpus(&[on(None), on(None)]), None);
        assert_eq!(distinct_gpus(&[on(a)]), Some(1));
        assert_eq!(distinct_gpus(&[on(a), on(b), on(a), on(b)]), Some(2));
        assert_eq!(distinct_gpus(&[on(b), on(a), on(b)]), Some(2));
        assert_eq!(distinct_gpus(&[on(a), on(other_host)]), Some(2));
        // One PE that could not name its GPU: no count at all.
        assert_eq!(distinct_gpus(&[on(a), on(None), on(a)]), None);
        assert_eq!(distinct_gpus(&[]), None);
    }
}
