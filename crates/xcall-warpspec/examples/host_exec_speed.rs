//! Times the Host executors of `silu(x) * scale` on one PE's expert buffer
//! of the default `xcall moe` (bf16, 4 slots of 2 x 320 rows of 1024), the
//! two alternated: `cargo run --release -p xcall-warpspec --example
//! host_exec_speed [rounds]`.

use std::time::Instant;

use xcall_core::DType;
use xcall_warpspec::ops::{silu_scale_host, HostExecutor, OpConfig, Scale};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    let (groups, group_elems) = (8usize, 320 * 1024);
    let n = groups * group_elems;
    let x: Vec<u8> = (0..n)
        .flat_map(|i| half_bits(((i * 7919) % 2001) as f32 / 250.0 - 4.0).to_le_bytes())
        .collect();
    let scales: Vec<f32> = (0..groups).map(|g| 0.5 + g as f32 * 0.125).collect();
    let mut out = vec![0u8; x.len()];
    let config = OpConfig::default();
    let only = std::env::args().nth(2);
    for exec in [HostExecutor::Vectorized, HostExecutor::Pipeline] {
        if only.as_ref().is_some_and(|o| *o != format!("{exec:?}")) {
            continue;
        }
        let mut ms = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            let scale = Scale::PerGroup {
                scales: &scales,
                group_bytes: group_elems * 2,
            };
            silu_scale_host(DType::Bf16, &x, scale, &mut out, &config, exec).unwrap();
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        println!(
            "{exec:?}: median {:.2} ms over {n} bf16 elements",
            ms[ms.len() / 2]
        );
    }
}

/// `v` as bf16 bits (truncated; any bf16 value will do).
fn half_bits(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}
