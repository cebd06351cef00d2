//! PEs as threads of this process (Host slots, or a GPU each), and the
//! cases whose GPU outputs must equal a Host run's bit for bit.

use std::time::Duration;

use xcall_core::testing::{run_threads, watchdog};
use xcall_core::{Device, Platform};
use xcall_ep::{Capacity, EpConfig, EpGroup, Precision};
use xcall_shmem::{World, WorldConfig};

use super::cuda::CudaMem;
use super::run::{round, HostMem, Mem, Outputs};
use super::*;

/// A world of `n` PEs that are threads of this process.
pub fn world(
    group: &str,
    rank: usize,
    n: usize,
    device: Device,
    heap: usize,
    timeout: Duration,
) -> World {
    let mut c = WorldConfig::in_process(group, rank, n, device);
    c.heap_bytes = Some(heap + (2 << 20));
    c.timeout = timeout;
    let mut w = World::new();
    w.init(&c).unwrap();
    w
}

/// Runs `case` on its PEs as threads, on GPUs (`cuda`: PE r on cuda:r)
/// or Host, and returns each PE's outputs (every one checked by `round`).
pub fn run(name: &str, case: &Case, cuda: bool) -> Vec<Outputs> {
    let heap = case.config.layout(case.pes).unwrap().heap_bytes;
    let group = format!("ep-{name}-{cuda}-{}", std::process::id());
    let case = case.clone();
    run_threads(name, case.pes, watchdog(), move |rank| {
        let device = match cuda {
            true => Device::cuda(rank as u32),
            false => Device::new(Platform::Host, rank as u32),
        };
        let mut w = world(
            &group,
            rank,
            case.pes,
            device,
            heap,
            Duration::from_secs(30),
        );
        let mut g = EpGroup::new(&mut w, case.config).unwrap();
        let out = {
            let mut m: Box<dyn Mem> = match cuda {
                true => Box::new(CudaMem::new(device)),
                false => Box::new(HostMem::default()),
            };
            round(&case, rank, &mut g, m.as_mut(), true)
        };
        g.destroy(&mut w).unwrap();
        assert!(w.finalize().unwrap().leaked.is_empty());
        out
    })
}

/// PE `rank`'s outputs on a GPU (`g`) equal its Host run's (`h`): every
/// byte the Host wrote (padding rows aside), the probs' gradient within
/// rounding.
pub fn same_outputs(name: &str, case: &Case, rank: usize, g: &Outputs, h: &Outputs) {
    let what = |s: &str| format!("{name}: PE {rank}: {s} differs from the Host run");
    assert!(
        g.expert_rows == h.expert_rows || rows_equal_where_written(case, rank, g, h),
        "{}",
        what("expert rows")
    );
    assert_eq!(g.y, h.y, "{}", what("combine"));
    assert_eq!(g.grad_x, h.grad_x, "{}", what("dispatch_backward"));
    assert_eq!(g.grad_expert_out.len(), h.grad_expert_out.len());
    for (i, (a, b)) in g.grad_probs.iter().zip(&h.grad_probs).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "{}: {i}: {a} vs {b}",
            what("grad_probs")
        );
    }
}

/// Padding rows are never written: compare only the kept rows.
fn rows_equal_where_written(case: &Case, rank: usize, g: &Outputs, h: &Outputs) -> bool {
    let all: Vec<PeData> = (0..case.pes).map(|r| data(case, r)).collect();
    let row = case.config.hidden * case.config.precision.wire_bytes();
    received(case, &all, rank).kept.iter().all(|k| {
        g.expert_rows[k.row * row..(k.row + 1) * row]
            == h.expert_rows[k.row * row..(k.row + 1) * row]
    })
}

/// The cases a GPU run of `pes` PEs must match a Host run of bit for bit,
/// each with its name: f32, bf16 and FP8 dispatch with alignment; FP8
/// writing the bf16 rows alone; FP8 rows of an odd number of 128-element
/// blocks, more than one pass of the quantize's warps (67 blocks) and
/// fewer (9); a capacity; ragged sends with holes; k = 1 with holes; every
/// token's experts on one PE.
pub fn host_equal_cases(pes: usize) -> Vec<(String, Case)> {
    let mut cases = Vec::new();
    for precision in [Precision::F32, Precision::Bf16, Precision::Fp8Dispatch] {
        let c = EpConfig {
            align: 8,
            ..cfg(300, 256, 4, 8 * pes, precision)
        };
        cases.push((
            format!("{pes}-{}", precision.name()),
            Case::new(c, pes, Routing::Random, 40 + pes as u64),
        ));
    }
    let fp8 = EpConfig {
        align: 8,
        ..cfg(300, 256, 4, 8 * pes, Precision::Fp8Dispatch)
    };
    cases.push((
        format!("{pes}-fp8-bf16-alone"),
        Case {
            bf16_only: true,
            ..Case::new(fp8, pes, Routing::Random, 50 + pes as u64)
        },
    ));
    for (hidden, seed) in [(67 * 128, 60), (9 * 128, 61)] {
        cases.push((
            format!("{pes}-fp8-h{hidden}"),
            Case::new(
                cfg(100, hidden, 4, 8 * pes, Precision::Fp8Dispatch),
                pes,
                Routing::Random,
                seed + pes as u64,
            ),
        ));
    }
    let capped = EpConfig {
        capacity: Capacity::PerExpert(20),
        ..cfg(200, 64, 3, 4 * pes, Precision::Bf16)
    };
    cases.push((
        format!("cap-{pes}"),
        Case::new(capped, pes, Routing::Random, 3),
    ));
    let mut ragged = Case::new(
        cfg(130, 64, 2, 2 * pes, Precision::Bf16),
        pes,
        Routing::Holes,
        5,
    );
    ragged.sent[0] = 1;
    cases.push((format!("ragged-{pes}"), ragged));
    cases.push((
        format!("k1-holes-{pes}"),
        Case::new(
            cfg(90, 64, 1, 2 * pes, Precision::Bf16),
            pes,
            Routing::Holes,
            7,
        ),
    ));
    cases.push((
        format!("onepe-{pes}"),
        Case::new(
            cfg(100, 64, 2, 2 * pes, Precision::F32),
            pes,
            Routing::OnePe,
            6,
        ),
    ));
    cases
}
