//! The model checker on planner output: the 8-stage pipeline of 4 async
//! warps x 4 KiB and one compute warpgroup at its default 17 iterations
//! (2 x stages + 1) within 1 s and 100 MB of tables, its figures printed
//! (or the bound it reached); then, timed, that search, the same plan over
//! its first 4 iterations and the 4-stage, 2-warp plan over its default 9
//! iterations. Each iteration of the bench is one whole search; the states
//! and table bytes are printed once per plan, with and without the
//! partial-order reduction (the full search within 10 s).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::time::Duration;
use xcall_warpspec::verify::{verify_unreduced, verify_within, Budget};
use xcall_warpspec::{PipelinePlan, PipelineSpec};

fn plan(stages: u32, warps: usize) -> PipelinePlan {
    PipelinePlan::new(&PipelineSpec::new(stages, &vec![4096; warps], 1)).expect("a valid plan")
}

fn bench(c: &mut Criterion) {
    let target = Budget {
        bytes: 100 << 20,
        time: Duration::from_secs(1),
        ..Budget::default()
    };
    match verify_within(&plan(8, 4).protocol(17), &target) {
        Ok(v) => println!(
            "8 stages, 4 async warps x 4 KiB, 1 compute warpgroup, 17 iterations, within 1 s and 100 MB: clean {}, {} states, {} bytes of tables, {:.2} ms",
            v.is_clean(),
            v.states,
            v.bytes,
            v.elapsed.as_secs_f64() * 1e3
        ),
        Err(e) => println!(
            "8 stages, 4 async warps x 4 KiB, 1 compute warpgroup, 17 iterations, within 1 s and 100 MB: {e}"
        ),
    }
    let mut group = c.benchmark_group("verify");
    group.sample_size(10);
    for (stages, warps, iterations) in [(8u32, 4usize, 17u32), (8, 4, 4), (4, 2, 9)] {
        let protocol = plan(stages, warps).protocol(iterations);
        let v = verify_within(&protocol, &target).expect("within 1 s and 100 MB");
        assert!(v.is_clean(), "{}", v.report());
        let ten_seconds = Budget {
            time: Duration::from_secs(10),
            ..Budget::default()
        };
        let full = verify_unreduced(&protocol, &ten_seconds)
            .map(|f| format!("{} states", f.states))
            .unwrap_or_else(|e| e.to_string());
        println!(
            "{stages} stages, {warps} async warps x 4 KiB, 1 compute warpgroup, {iterations} iterations: {} states, {} bytes of tables ({} bytes/state); without the reduction: {full}",
            v.states,
            v.bytes,
            v.bytes / v.states.max(1)
        );
        group.bench_function(
            format!("{stages}_stages_{warps}_warps_{iterations}_iterations"),
            |b| b.iter(|| verify_within(black_box(&protocol), &target).unwrap()),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
