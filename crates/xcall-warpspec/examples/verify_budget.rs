//! Verifies the plan of a pipeline given on the command line (within the
//! default budget) and prints the states explored, the time, states per
//! second and the bytes of the search's tables:
//! `cargo run --release -p xcall-warpspec --example verify_budget -- STAGES WARPS BYTES COMPUTE_WARPGROUPS [ITERATIONS]`.

use xcall_warpspec::verify::{verify_within, Budget};
use xcall_warpspec::{PipelinePlan, PipelineSpec};

fn main() {
    let a: Vec<u32> = std::env::args()
        .skip(1)
        .map(|v| v.parse().expect("integer arguments"))
        .collect();
    let (stages, warps, bytes, compute) = (a[0], a[1] as usize, a[2], a[3]);
    let iterations = a.get(4).copied().unwrap_or(2 * stages + 1);
    let plan = PipelinePlan::new(&PipelineSpec::new(stages, &vec![bytes; warps], compute))
        .expect("a valid plan");
    let t0 = std::time::Instant::now();
    match verify_within(&plan.protocol(iterations), &Budget::default()) {
        Ok(v) => {
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "{stages} stages, {warps} async warps x {bytes} B, {compute} compute warpgroup(s), {iterations} iterations: {} states in {secs:.3} s ({:.0} states/s, {} bytes of tables, {} bytes/state), clean: {}",
                v.states,
                v.states as f64 / secs,
                v.bytes,
                v.bytes / v.states.max(1),
                v.is_clean()
            );
        }
        Err(e) => println!("{e}"),
    }
}
