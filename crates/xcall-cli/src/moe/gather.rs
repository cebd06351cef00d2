//! A PE's log as JSON, for a run whose PEs are processes: every PE hands
//! its log to every other through the world's `allgather`, and process 0
//! reports the whole world from them.

use std::time::Duration;

use serde_json::{json, Value};
use xcall_graph::Outcome;
use xcall_shmem::Transport;

use super::data::Check;
use super::log::{GraphLine, PeLog};
use super::verify::Checked;

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn duration(v: &Value) -> Option<Duration> {
    Duration::try_from_secs_f64(v.as_f64()?).ok()
}

fn count(v: &Value) -> Option<usize> {
    usize::try_from(v.as_u64()?).ok()
}

fn floats(v: &Value) -> Option<Vec<f64>> {
    v.as_array()?.iter().map(Value::as_f64).collect()
}

/// `log` as JSON.
pub fn encode(log: &PeLog) -> Value {
    json!({
        "steps": log.steps.iter().map(|(ms, o)| json!([ms, *o as u32])).collect::<Vec<_>>(),
        "phases": log.phases,
        "forked": log.forked,
        "copy_ms": log.copy_ms,
        "checks": log.checks.iter().map(|c| json!({
            "step": c.step,
            "mismatches": c.check.mismatches,
            "first": c.check.first.map(|(t, j, got, want)| json!([t, j, got, want])),
            "max_relative": c.check.max_relative,
            "dropped": c.check.dropped,
            "took": secs(c.took),
        })).collect::<Vec<_>>(),
        "dropped": log.dropped,
        "link_tokens": log.link_tokens,
        "sms": log.sms,
        "kernels": log.kernels,
        "draw": secs(log.draw_time),
        "queue_wait": secs(log.queue_wait),
        "input_wait": secs(log.input_wait),
        "memory": [log.memory.0, log.memory.1],
        "remote": log.remote,
        "gpu": log.gpu,
        "graphs": log.graphs.iter().map(|g| json!({
            "label": g.label, "line": g.line, "stats": g.stats,
        })).collect::<Vec<_>>(),
    })
}

fn check(v: &Value) -> Option<Checked> {
    let first = match &v["first"] {
        Value::Null => None,
        f => {
            let f = f.as_array()?;
            match f.as_slice() {
                [t, j, got, want] => Some((count(t)?, count(j)?, got.as_f64()?, want.as_f64()?)),
                _ => return None,
            }
        }
    };
    Some(Checked {
        step: count(&v["step"])?,
        check: Check {
            mismatches: count(&v["mismatches"])?,
            first,
            max_relative: v["max_relative"].as_f64()?,
            dropped: count(&v["dropped"])?,
        },
        took: duration(&v["took"])?,
    })
}

/// The names of the transports that reach a PE on another host (a log's
/// `remote`).
const REMOTE: [&str; 3] = [
    Transport::Nccl.name(),
    Transport::NcclOneSided.name(),
    Transport::Tcp.name(),
];

/// The log [`encode`] made, or `None` when `v` is not one.
pub fn decode(v: &Value) -> Option<PeLog> {
    let steps = v["steps"]
        .as_array()?
        .iter()
        .map(|s| match s.as_array()?.as_slice() {
            [ms, o] => Some((
                ms.as_f64()?,
                Outcome::from_code(u32::try_from(o.as_u64()?).ok()?)?,
            )),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    let memory = match v["memory"].as_array()?.as_slice() {
        [a, b] => (a.as_u64(), b.as_u64()),
        _ => return None,
    };
    Some(PeLog {
        steps,
        phases: v["phases"]
            .as_array()?
            .iter()
            .map(floats)
            .collect::<Option<_>>()?,
        forked: v["forked"]
            .as_array()?
            .iter()
            .map(|p| floats(p)?.try_into().ok())
            .collect::<Option<_>>()?,
        copy_ms: v["copy_ms"].as_f64(),
        checks: v["checks"]
            .as_array()?
            .iter()
            .map(check)
            .collect::<Option<_>>()?,
        dropped: v["dropped"]
            .as_array()?
            .iter()
            .map(count)
            .collect::<Option<_>>()?,
        link_tokens: v["link_tokens"]
            .as_array()?
            .iter()
            .map(count)
            .collect::<Option<_>>()?,
        sms: v["sms"].as_u64().map(|n| n as usize),
        kernels: v["kernels"].as_str().map(str::to_string),
        draw_time: duration(&v["draw"])?,
        queue_wait: duration(&v["queue_wait"])?,
        input_wait: duration(&v["input_wait"])?,
        memory,
        remote: match &v["remote"] {
            Value::Null => None,
            r => {
                let name = r.as_str()?;
                Some(*REMOTE.iter().find(|&&t| t == name)?)
            }
        },
        gpu: match &v["gpu"] {
            Value::Null => None,
            g => Some(g.as_str()?.to_string()),
        },
        graphs: v["graphs"]
            .as_array()?
            .iter()
            .map(|g| {
                Some(GraphLine {
                    label: g["label"].as_str()?.to_string(),
                    line: g["line"].as_str()?.to_string(),
                    stats: g["stats"].clone(),
                })
            })
            .collect::<Option<_>>()?,
    })
}

/// Every PE's log, by rank, from what `allgather` gave (`what` names the
/// run in errors).
pub fn decode_all(all: &[Vec<u8>]) -> Result<Vec<PeLog>, String> {
    all.iter()
        .enumerate()
        .map(|(rank, bytes)| {
            serde_json::from_slice(bytes)
                .ok()
                .as_ref()
                .and_then(decode)
                .ok_or_else(|| format!("PE {rank}'s log did not arrive whole"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log with every field set to a value of its own survives the trip
    /// through bytes; one with a field missing or of the wrong kind is
    /// refused by rank.
    #[test]
    fn a_log_survives_the_trip_and_a_damaged_one_is_named() {
        let log = PeLog {
            steps: vec![(1.25, Outcome::Replayed), (0.5, Outcome::Patched)],
            phases: vec![vec![0.1, 0.2], vec![0.3, 0.4]],
            forked: vec![[0.9, 1.1], [0.8, 1.0]],
            copy_ms: Some(0.75),
            checks: vec![
                Checked {
                    step: 3,
                    check: Check {
                        mismatches: 2,
                        first: Some((4, 5, 1.5, -2.5)),
                        max_relative: 3e-3,
                        dropped: 7,
                    },
                    took: Duration::from_millis(12),
                },
                Checked {
                    step: 4,
                    check: Check {
                        mismatches: 0,
                        first: None,
                        max_relative: 0.0,
                        dropped: 0,
                    },
                    took: Duration::from_micros(5),
                },
            ],
            dropped: vec![7, 0, 9],
            link_tokens: vec![11, 12, 13],
            sms: Some(24),
            kernels: Some("pull".into()),
            draw_time: Duration::from_millis(30),
            queue_wait: Duration::from_millis(2),
            input_wait: Duration::from_millis(4),
            memory: (Some(1 << 30), None),
            remote: Some("tcp"),
            gpu: Some("host-a/0000:19:00.0".into()),
            graphs: vec![GraphLine {
                label: "process 1 cuda:0".into(),
                line: "2 capture(s)".into(),
                stats: json!({"hits": 3}),
            }],
        };
        let bytes = serde_json::to_vec(&encode(&log)).unwrap();
        let back = decode_all(&[bytes.clone(), bytes.clone()]).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(encode(&back[1]), encode(&log));
        let b = &back[0];
        assert_eq!(b.steps[1].1, Outcome::Patched);
        assert_eq!(b.checks[0].check.first, Some((4, 5, 1.5, -2.5)));
        assert_eq!(b.checks[0].took, Duration::from_millis(12));
        assert_eq!(b.memory, (Some(1 << 30), None));
        assert_eq!(b.forked, [[0.9, 1.1], [0.8, 1.0]]);
        assert_eq!(b.graphs[0].label, "process 1 cuda:0");
        assert_eq!(b.gpu.as_deref(), Some("host-a/0000:19:00.0"));
        assert_eq!(
            (b.link_tokens.clone(), b.sms, b.kernels.as_deref()),
            (vec![11, 12, 13], Some(24), Some("pull"))
        );

        for (field, bad) in [
            ("steps", json!([[1.0, 99]])),
            ("checks", json!([{"step": 1}])),
            ("memory", json!([1])),
            ("draw", json!(-1.0)),
            ("remote", json!("carrier pigeon")),
            ("link_tokens", json!([-1])),
            ("forked", json!([[1.0]])),
            ("gpu", json!(7)),
        ] {
            let mut v = encode(&log);
            v[field] = bad;
            let damaged = serde_json::to_vec(&v).unwrap();
            let e = decode_all(&[bytes.clone(), damaged]).err();
            assert_eq!(
                e.as_deref(),
                Some("PE 1's log did not arrive whole"),
                "{field}"
            );
        }
        // Every transport to another host's PE comes back by name.
        for remote in ["nccl", "nccl_one_sided", "tcp"] {
            let mut v = encode(&log);
            v["remote"] = json!(remote);
            let back = decode_all(&[serde_json::to_vec(&v).unwrap()]).unwrap();
            assert_eq!(back[0].remote, Some(remote));
        }
        let e = decode_all(&[b"not json".to_vec()]).err();
        assert_eq!(e.as_deref(), Some("PE 0's log did not arrive whole"));
    }
}
