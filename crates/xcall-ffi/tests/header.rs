//! `include/xcall.h` must be exactly what cbindgen generates from this crate.

use std::path::PathBuf;

const REGENERATE: &str = "XCALL_BLESS_HEADER=1 cargo test -p xcall-ffi --test header";

/// The version macros, from the crate version this header is generated with.
fn version_macros() -> String {
    format!(
        "\n/** Major version of the xcall library this header belongs to. */\n#define XCALL_VERSION_MAJOR {}\n\
         /** Minor version of the xcall library this header belongs to. */\n#define XCALL_VERSION_MINOR {}\n\
         /** Patch version of the xcall library this header belongs to. */\n#define XCALL_VERSION_PATCH {}\n\
         /** Version of the xcall library this header belongs to; compare with xcall_version(). */\n\
         #define XCALL_VERSION_STRING \"{}\"\n\n\
         /* XLA FFI types of the xcall_xla_* handlers (xla/ffi/api/c_api.h). */\n\
         struct XLA_FFI_CallFrame;\n\
         struct XLA_FFI_Error;",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION"),
    )
}

fn generate() -> String {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    config.after_includes = Some(version_macros());
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    with_sections(&String::from_utf8(out).expect("header is UTF-8"))
}

/// One section per capability: (the first function of the section, its
/// title, its paragraph on ownership and threading). cbindgen emits the
/// functions in source order, module by module, so each section's functions
/// follow its first one.
const SECTIONS: &[(&str, &str, &str)] = &[
    (
        "xcall_version",
        "The library: version, status codes, errors, devices, dtypes",
        "Nothing here allocates. The last error message is per thread: it\n * describes the calling thread's last xcall call and stays valid until\n * that thread's next call.",
    ),
    (
        "xcall_graph_cache_config_default",
        "Graph cache",
        "An xcall_graph_cache belongs to the caller from xcall_graph_cache_new\n * to xcall_graph_cache_free (the XLA handlers' cache is the library's).\n * Its graphs are per device and owned by the cache; buffers stay the\n * caller's. Any number of threads may call into one cache at once (state\n * is sharded per device, and no lock is held while a record callback\n * runs); _free must be the last call.",
    ),
    (
        "xcall_permute_alias_table",
        "Permutation kernels",
        "No handles: every tensor is the caller's memory on the target's device,\n * and no output may overlap an input or another output unless the call\n * says in_place. CUDA calls enqueue on the target's stream and return;\n * Host calls finish before they return. Calls are thread-safe (kernels\n * are compiled once per device and cached).",
    ),
    (
        "xcall_shmem_world_new",
        "Symmetric memory",
        "An xcall_shmem_world is one PE's: one thread uses it (another thread's\n * call gets XCALL_STATUS_BUSY). Collective calls (init, finalize,\n * malloc, free, barriers) are made by every PE of the world in the same\n * order. Symmetric allocations belong to the world until\n * xcall_shmem_free or finalize.",
    ),
    (
        "xcall_ep_layout",
        "Expert parallelism",
        "An xcall_ep_group is one PE's, made and freed collectively on an\n * xcall_shmem_world (every PE, same config, same order), and used by one\n * thread (another thread's call gets XCALL_STATUS_BUSY). Its calls are\n * collective too: every PE makes them in the same order. CUDA calls\n * enqueue on the caller's stream and are capturable; Host calls finish\n * before they return. Buffers stay the caller's; their sizes follow from\n * the config alone (xcall_ep_layout).",
    ),
    (
        "xcall_ws_plan_new",
        "Warp specialization",
        "An xcall_ws_plan is the caller's from xcall_ws_plan_new to\n * xcall_ws_plan_free and never changes in between: any thread may read\n * it. Text outputs (reports, generated source) are written into the\n * caller's buffers; xcall_ws_run's kernels are compiled once per device\n * and shared by every thread.",
    ),
    (
        "xcall_xla_graph_cache",
        "XLA FFI handlers",
        "Handlers for XLA's typed FFI, registered by the caller (the frame\n * layout is XLA's C API). They run on XLA's threads and stream, on the\n * frame's device; the graph cache they use is the library's.",
    ),
];

/// `header` with a banner before each [`SECTIONS`] entry's first function
/// (before its doc comment).
fn with_sections(header: &str) -> String {
    let mut lines: Vec<String> = header.lines().map(str::to_string).collect();
    for (first, title, paragraph) in SECTIONS.iter().rev() {
        let at = lines
            .iter()
            .position(|l| {
                !l.starts_with([' ', '#', '/', '*'])
                    && l.split('(').next().is_some_and(|head| {
                        l.contains('(')
                            && head.split([' ', '*']).rfind(|w| !w.is_empty()) == Some(first)
                    })
            })
            .unwrap_or_else(|| panic!("no declaration of {first} for section {title:?}"));
        let doc = (0..at)
            .rev()
            .take_while(|&i| lines[i].starts_with(" *") || lines[i].starts_with("/**"))
            .last()
            .unwrap_or(at);
        let rule = "=".repeat(70);
        lines.insert(
            doc,
            format!("/* {rule}\n * {title}\n *\n * {paragraph}\n * {rule} */\n"),
        );
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

#[test]
fn checked_in_header_is_current() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../include/xcall.h");
    let generated = generate();
    if xcall_core::testing::required("XCALL_BLESS_HEADER") {
        std::fs::write(&path, &generated).expect("write include/xcall.h");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        let first = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "include/xcall.h is stale (first difference at line {}).\nRegenerate it with:\n    {REGENERATE}",
            first + 1
        );
    }
}

#[test]
fn header_declares_the_published_constants() {
    let h = generate();
    for needle in [
        &format!(
            "#define XCALL_VERSION_MAJOR {}",
            env!("CARGO_PKG_VERSION_MAJOR")
        ),
        &format!(
            "#define XCALL_VERSION_STRING \"{}\"",
            env!("CARGO_PKG_VERSION")
        ),
        "XCALL_STATUS_OK = 0",
        "XCALL_STATUS_NULL_ARGUMENT = 1",
        "XCALL_STATUS_PANIC = 3",
        "XCALL_STATUS_CUDA_UNAVAILABLE = 4",
        "XCALL_PLATFORM_HOST = 0",
        "XCALL_PLATFORM_CUDA = 1",
        "XCALL_DTYPE_BF16 = 3",
        "xcall_status xcall_device_count(xcall_platform platform, size_t *out_count);",
        "xcall_status xcall_dtype_size(xcall_dtype dtype, size_t *out_size);",
        "xcall_shmem_bootstrap bootstrap;",
    ] {
        let needle: &str = needle;
        assert!(
            h.contains(needle),
            "generated header lacks {needle:?}:\n{h}"
        );
    }
    for absent in [
        "struct Device",
        "Device Device",
        "_ALL",
        "CallKey",
        "StreamState",
        "[`",
    ] {
        assert!(
            !h.contains(absent),
            "Rust-only item {absent:?} leaked into the header"
        );
    }
}

#[test]
fn every_function_says_what_bad_input_gets() {
    // Each declaration's doc comment (the block right above it) has a
    // "Bad input:" paragraph.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../include/xcall.h");
    let header = std::fs::read_to_string(path).unwrap();
    let mut missing = Vec::new();
    let mut functions = 0;
    let mut doc = String::new();
    let mut in_doc = false;
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with("/**") {
            in_doc = true;
            doc.clear();
        }
        if t.starts_with('*') && !in_doc || t.starts_with("/*") && !t.starts_with("/**") {
            continue; // the file's plain comments
        }
        if in_doc {
            doc.push_str(t);
            doc.push(' ');
            if t.ends_with("*/") {
                in_doc = false;
            }
            continue;
        }
        if let Some(name) = t
            .split('(')
            .next()
            .filter(|_| t.contains('('))
            .and_then(|head| head.split([' ', '*']).rfind(|w| !w.is_empty()))
            .filter(|name| name.starts_with("xcall_") && !t.starts_with("typedef"))
        {
            functions += 1;
            if !doc.contains("Bad input:") {
                missing.push(name.to_string());
            }
        }
        if !t.is_empty() {
            doc.clear();
        }
    }
    assert!(
        functions >= 50,
        "found only {functions} function declarations"
    );
    assert!(missing.is_empty(), "no \"Bad input:\" for {missing:?}");
}

/// The Python package mirrors `xcall_graph_stats` with ctypes: its fields
/// must be the header's, in order (a shorter mirror lets the library write
/// past the Python buffer).
#[test]
fn the_python_stats_mirror_matches_the_header() {
    let header = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../include/xcall.h"
    ))
    .unwrap();
    let end = header
        .find("} xcall_graph_stats;")
        .expect("xcall_graph_stats in the header");
    let start = header[..end].rfind("typedef struct").expect("its typedef");
    let c_fields: Vec<&str> = header[start..end]
        .lines()
        .filter_map(|l| l.trim().strip_prefix("uint64_t "))
        .map(|f| f.trim_end_matches(';'))
        .collect();
    let python = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../python/xcall/jax.py"
    ))
    .unwrap();
    let at = python
        .find("class _Stats(ctypes.Structure):")
        .expect("_Stats in python/xcall/jax.py");
    let body = &python[at..at + python[at..].find("\n\n\n").expect("end of _Stats")];
    let py_fields: Vec<&str> = body
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"') && l.ends_with("\","))
        .map(|l| l.trim_matches(|c| c == '"' || c == ','))
        .collect();
    assert!(c_fields.len() >= 15, "{c_fields:?}");
    assert_eq!(py_fields, c_fields);
}

#[test]
fn report_names_of_graph_outcomes_are_the_c_enumerators_in_lower_case() {
    use xcall_graph::Outcome;
    let header = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../include/xcall.h"
    ))
    .unwrap();
    let declared = header.matches("  XCALL_GRAPH_OUTCOME_").count();
    assert_eq!(
        declared,
        Outcome::ALL.len(),
        "the header and Outcome disagree"
    );
    for o in Outcome::ALL {
        let line = format!(
            "  XCALL_GRAPH_OUTCOME_{} = {},",
            o.name().to_uppercase(),
            o as u32
        );
        assert!(header.contains(&line), "{line} not in the header");
    }
}
