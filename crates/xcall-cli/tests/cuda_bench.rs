//! `xcall bench --platform cuda`: the GPU set runs in one process, every
//! bandwidth figure is a ratio to a copy of the same run, and the graph
//! cache replays.

mod common;

use common::{json_path, read_json, run};

#[test]
fn cuda_set_runs_and_the_graph_cache_replays() {
    let Some(gpus) = xcall_core::testing::cuda_devices_or_skip("cuda_bench") else {
        return;
    };
    let path = json_path("bench-cuda");
    let (out, stdout) = run(&[
        "bench",
        "--platform",
        "cuda",
        "--rounds",
        "5",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{stdout}");
    let j = read_json(&path);
    let rows = j["rows"].as_array().unwrap();
    let item = |name: &str| {
        rows.iter()
            .find(|r| r["item"].as_str().unwrap().starts_with(name))
    };
    assert!(item("silu(x)*scale, plain kernel").is_some());
    assert!(item("the same through the graph cache").is_some());
    assert_eq!(item("put GPU 0 -> GPU 1").is_some(), gpus > 1);
    for r in rows.iter().filter(|r| r["crate"] != "reference") {
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    }
}
