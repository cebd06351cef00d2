//! The model checker on planner output: the 8-stage pipeline of 4 async
//! warps x 4 KiB and one compute warpgroup (over 2 iterations, every
//! interleaving of its first lap; its default of 17 iterations passes the
//! time budget), and the 4-stage, 2-warp one over its default 9
//! iterations. Each iteration of the bench is one whole search; the states
//! and table bytes are printed once per plan.

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use xcall_warpspec::verify::{verify_within, Budget};
use xcall_warpspec::{PipelinePlan, PipelineSpec};

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify");
    group.sample_size(10);
    for (stages, warps, iterations) in [(8u32, 4usize, 2u32), (4, 2, 9)] {
        let plan = PipelinePlan::new(&PipelineSpec::new(stages, &vec![4096; warps], 1))
            .expect("a valid plan");
        let protocol = plan.protocol(iterations);
        let v = verify_within(&protocol, &Budget::default()).expect("within the budget");
        assert!(v.is_clean(), "{}", v.report());
        println!(
            "{stages} stages, {warps} async warps x 4 KiB, 1 compute warpgroup, {iterations} iterations: {} states, {} bytes of tables ({} bytes/state)",
            v.states,
            v.bytes,
            v.bytes / v.states.max(1)
        );
        group.bench_function(
            format!("{stages}_stages_{warps}_warps_{iterations}_iterations"),
            |b| b.iter(|| verify_within(black_box(&protocol), &Budget::default()).unwrap()),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
