//! The JAX side of the XLA FFI handlers, as part of `cargo test`:
//! - `python/tests` (pytest) through `jax.jit` against this build's
//!   `libxcall.so`;
//! - the mirrored ABI (`xcall::xla::abi`) against the `c_api.h` that the
//!   installed jaxlib ships, compiled here with the C compiler together
//!   with `include/xcall.h` (each handler must be an `XLA_FFI_Handler`).
//!
//! Both need a Python with jax and pytest: `$XCALL_PYTHON`, else `python3`.
//! Without one they print a SKIP line on stderr and pass, unless
//! `XCALL_REQUIRE_JAX=1` (CI sets it after installing its pinned jax). A
//! suite that passes no test at all fails.

mod common;

use std::mem::offset_of;
use std::process::Command;

use xcall::xla::abi::*;

/// A Python that imports jax and pytest, or None (after a SKIP line).
fn python(test: &str) -> Option<String> {
    let py = std::env::var("XCALL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import jax, pytest"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        return Some(py);
    }
    let why = format!("{py} cannot import jax and pytest (set XCALL_PYTHON)");
    if xcall_core::testing::required("XCALL_REQUIRE_JAX") {
        panic!("XCALL_REQUIRE_JAX=1 but {why}");
    }
    xcall_core::testing::skip(test, &why);
    None
}

#[test]
fn pytest_suite_through_jax() {
    let Some(py) = python("pytest_suite_through_jax") else {
        return;
    };
    let out = Command::new(&py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .arg(common::repo().join("python/tests"))
        .env("XCALL_LIB", common::built_library("libxcall.so"))
        .env(
            "XCALL_JAX_PLATFORMS",
            std::env::var("XCALL_JAX_PLATFORMS").unwrap_or_else(|_| "cpu".into()),
        )
        .output()
        .expect("run pytest");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    match out.status.code() {
        Some(0) => {
            let passed = passed_count(&text);
            assert!(
                passed > 0,
                "pytest passed no test in python/tests (all skipped?)"
            );
        }
        // pytest's "no tests collected": a suite that ran nothing failed.
        Some(5) => panic!("pytest collected no tests in python/tests"),
        code => panic!("pytest failed ({code:?})"),
    }
}

/// The `N passed` of pytest's summary line (0 when absent).
fn passed_count(summary: &str) -> u64 {
    summary
        .lines()
        .rev()
        .find_map(|line| {
            let words: Vec<&str> = line.split([' ', ',']).collect();
            words
                .windows(2)
                .find(|w| w[1] == "passed")
                .and_then(|w| w[0].parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn pytest_summaries_are_read() {
    assert_eq!(passed_count("....\n12 passed, 3 skipped in 4.2s\n"), 12);
    assert_eq!(passed_count("sss\n3 skipped in 0.1s\n"), 0);
    assert_eq!(passed_count("1 failed, 2 passed in 1s"), 2);
}

#[test]
fn mirrored_abi_matches_the_installed_jaxlib_header() {
    let Some(py) = python("mirrored_abi_matches_the_installed_jaxlib_header") else {
        return;
    };
    let include = Command::new(&py)
        .args(["-c", "import jax.ffi; print(jax.ffi.include_dir())"])
        .output()
        .expect("ask jax for its include dir");
    let include = String::from_utf8_lossy(&include.stdout).trim().to_string();
    let dir = std::env::temp_dir().join(format!("xcall-xla-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let probe =
        |name: &str, expr: &str| format!("  printf(\"{name} %zu\\n\", (size_t)({expr}));\n");
    // xcall.h after XLA's header: the two combine, and every handler's
    // declaration is exactly XLA's handler type.
    let mut source = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include \"xla/ffi/api/c_api.h\"\n#include \"xcall.h\"\n",
    );
    for op in [
        "make_row_id_map",
        "permute",
        "unpermute",
        "unpermute_backward",
        "make_chunk_sort_map",
        "sort_chunks_by_map",
        "ep_dispatch",
        "ep_combine",
        "ep_combine_backward",
        "ep_dispatch_backward",
    ] {
        for side in ["host", "cuda"] {
            source.push_str(&format!(
                "_Static_assert(__builtin_types_compatible_p(__typeof__(xcall_xla_{op}_{side}), XLA_FFI_Handler), \"xcall_xla_{op}_{side} is an XLA_FFI_Handler\");\n"
            ));
        }
    }
    source.push_str("int main(void) {\n");
    // (name, C expression, the mirror's value)
    let checks: Vec<(&str, &str, usize)> = vec![
        (
            "frame_size",
            "XLA_FFI_CallFrame_STRUCT_SIZE",
            CALL_FRAME_SIZE,
        ),
        (
            "frame_api",
            "offsetof(XLA_FFI_CallFrame, api)",
            offset_of!(XLA_FFI_CallFrame, api),
        ),
        (
            "frame_stage",
            "offsetof(XLA_FFI_CallFrame, stage)",
            offset_of!(XLA_FFI_CallFrame, stage),
        ),
        (
            "frame_args",
            "offsetof(XLA_FFI_CallFrame, args)",
            offset_of!(XLA_FFI_CallFrame, args),
        ),
        (
            "frame_rets",
            "offsetof(XLA_FFI_CallFrame, rets)",
            offset_of!(XLA_FFI_CallFrame, rets),
        ),
        (
            "frame_attrs",
            "offsetof(XLA_FFI_CallFrame, attrs)",
            offset_of!(XLA_FFI_CallFrame, attrs),
        ),
        (
            "frame_future",
            "offsetof(XLA_FFI_CallFrame, future)",
            offset_of!(XLA_FFI_CallFrame, future),
        ),
        ("args_size", "XLA_FFI_Args_STRUCT_SIZE", ARGS_SIZE),
        ("rets_size", "XLA_FFI_Rets_STRUCT_SIZE", RETS_SIZE),
        ("attrs_size", "XLA_FFI_Attrs_STRUCT_SIZE", ATTRS_SIZE),
        (
            "attrs_names",
            "offsetof(XLA_FFI_Attrs, names)",
            offset_of!(XLA_FFI_Attrs, names),
        ),
        ("buffer_size", "XLA_FFI_Buffer_STRUCT_SIZE", BUFFER_SIZE),
        (
            "buffer_data",
            "offsetof(XLA_FFI_Buffer, data)",
            offset_of!(XLA_FFI_Buffer, data),
        ),
        (
            "buffer_rank",
            "offsetof(XLA_FFI_Buffer, rank)",
            offset_of!(XLA_FFI_Buffer, rank),
        ),
        (
            "scalar_value",
            "offsetof(XLA_FFI_Scalar, value)",
            offset_of!(XLA_FFI_Scalar, value),
        ),
        (
            "api_version_size",
            "XLA_FFI_Api_Version_STRUCT_SIZE",
            API_VERSION_SIZE,
        ),
        (
            "error_create_args",
            "XLA_FFI_Error_Create_Args_STRUCT_SIZE",
            ERROR_CREATE_ARGS_SIZE,
        ),
        (
            "error_get_message_args",
            "XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE",
            ERROR_GET_MESSAGE_ARGS_SIZE,
        ),
        (
            "error_destroy_args",
            "XLA_FFI_Error_Destroy_Args_STRUCT_SIZE",
            ERROR_DESTROY_ARGS_SIZE,
        ),
        (
            "api_error_get_message",
            "offsetof(XLA_FFI_Api, XLA_FFI_Error_GetMessage)",
            offset_of!(XLA_FFI_Api, error_get_message),
        ),
        (
            "api_error_destroy",
            "offsetof(XLA_FFI_Api, XLA_FFI_Error_Destroy)",
            offset_of!(XLA_FFI_Api, error_destroy),
        ),
        (
            "stream_get_args",
            "XLA_FFI_Stream_Get_Args_STRUCT_SIZE",
            STREAM_GET_ARGS_SIZE,
        ),
        (
            "ordinal_get_args",
            "XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE",
            DEVICE_ORDINAL_GET_ARGS_SIZE,
        ),
        (
            "metadata_size",
            "XLA_FFI_Metadata_STRUCT_SIZE",
            METADATA_SIZE,
        ),
        (
            "metadata_traits",
            "offsetof(XLA_FFI_Metadata, traits)",
            offset_of!(XLA_FFI_Metadata, traits),
        ),
        (
            "metadata_state",
            "offsetof(XLA_FFI_Metadata, state_type_id)",
            offset_of!(XLA_FFI_Metadata, state_type_id),
        ),
        (
            "metadata_ext_size",
            "XLA_FFI_Metadata_Extension_STRUCT_SIZE",
            METADATA_EXTENSION_SIZE,
        ),
        (
            "api_error_create",
            "offsetof(XLA_FFI_Api, XLA_FFI_Error_Create)",
            offset_of!(XLA_FFI_Api, error_create),
        ),
        (
            "api_stream_get",
            "offsetof(XLA_FFI_Api, XLA_FFI_Stream_Get)",
            offset_of!(XLA_FFI_Api, stream_get),
        ),
        (
            "api_ordinal_get",
            "offsetof(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get)",
            offset_of!(XLA_FFI_Api, device_ordinal_get),
        ),
        (
            "api_size",
            "XLA_FFI_Api_STRUCT_SIZE",
            API_SIZE_DEVICE_ORDINAL_GET,
        ),
        ("api_major", "XLA_FFI_API_MAJOR", API_MAJOR as usize),
        ("api_minor", "XLA_FFI_API_MINOR", API_MINOR as usize),
        (
            "metadata_ext_type",
            "XLA_FFI_Extension_Metadata",
            EXTENSION_METADATA as usize,
        ),
        (
            "stage_execute",
            "XLA_FFI_ExecutionStage_EXECUTE",
            STAGE_EXECUTE as usize,
        ),
        (
            "cbc",
            "XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE",
            TRAIT_COMMAND_BUFFER_COMPATIBLE as usize,
        ),
        ("dtype_pred", "XLA_FFI_DataType_PRED", dtype::PRED as usize),
        ("dtype_bf16", "XLA_FFI_DataType_BF16", dtype::BF16 as usize),
        (
            "dtype_f8e4m3fn",
            "XLA_FFI_DataType_F8E4M3FN",
            dtype::F8E4M3FN as usize,
        ),
    ];
    for (name, expr, _) in &checks {
        source.push_str(&probe(name, expr));
    }
    source.push_str("  return 0;\n}\n");
    let c = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c, source).unwrap();
    let tool = common::compiler(false);
    let built = Command::new(tool.path())
        .args(["-std=c11", "-Wall", "-Werror"])
        .arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(common::repo().join("include"))
        .arg(&c)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(
        built.status.success(),
        "compiling against {include}/xla/ffi/api/c_api.h failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&exe).output().expect("run the layout probe");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut wrong = Vec::new();
    for ((name, _, ours), line) in checks.iter().zip(text.lines()) {
        let theirs: usize = line
            .strip_prefix(&format!("{name} "))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unexpected probe line {line:?}"));
        if theirs != *ours {
            wrong.push(format!("{name}: c_api.h {theirs}, xcall {ours}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        wrong.is_empty(),
        "the mirror disagrees with {include}:\n{}",
        wrong.join("\n")
    );
    assert_eq!(text.lines().count(), checks.len());
}
