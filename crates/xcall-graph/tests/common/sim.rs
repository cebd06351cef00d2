//! Fixtures of the tests on the simulated backend: streams, keys, a cache
//! and calls whose work adds to the buffers' first cells.

// Each test binary that includes these uses only some.
#![allow(dead_code)]

use xcall_graph::sim::{SimBackend, SimOp, SimStream};
use xcall_graph::{Buffer, BufferRole, CacheConfig, Call, CallKey, Device, GraphCache, Outcome};

pub fn stream(ordinal: u32) -> SimStream {
    SimStream {
        device: Device::cuda(ordinal),
        context: 100 + ordinal as u64,
        id: 1,
    }
}

pub fn key(ordinal: u32, target: u64, addresses: &[u64]) -> CallKey {
    CallKey {
        device: Device::cuda(ordinal),
        target,
        attributes: 0xa77.into(),
        buffers: addresses
            .iter()
            .map(|&a| Buffer::new(a, 64, BufferRole::InOut))
            .collect(),
    }
}

pub fn cache(config: CacheConfig) -> GraphCache<SimBackend> {
    GraphCache::new(SimBackend::new(), config).unwrap()
}

/// Runs `key` on `s` with a record function that enqueues `ops`.
pub fn run_ops(c: &GraphCache<SimBackend>, key: &CallKey, s: SimStream, ops: &[SimOp]) -> Outcome {
    let call = Call::new(key.clone(), Some(s));
    c.execute(&call, |stream| {
        for &op in ops {
            c.backend().enqueue(stream.unwrap(), op);
        }
        Ok::<(), std::io::Error>(())
    })
    .unwrap()
}

pub fn add(address: u64, value: i64) -> SimOp {
    SimOp::Add { address, value }
}

/// Runs `key` on `s`: the work adds `value` to every buffer's first cell.
pub fn run(c: &GraphCache<SimBackend>, key: &CallKey, s: SimStream, value: i64) -> Outcome {
    let ops: Vec<SimOp> = key.buffers.iter().map(|b| add(b.address, value)).collect();
    run_ops(c, key, s, &ops)
}
