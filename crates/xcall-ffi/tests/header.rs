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
    String::from_utf8(out).expect("header is UTF-8")
}

#[test]
fn checked_in_header_is_current() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../include/xcall.h");
    let generated = generate();
    if std::env::var_os("XCALL_BLESS_HEADER").is_some() {
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
        "xcall_status xcall_device_count(uint32_t platform, size_t *out_count);",
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
