//! The XLA FFI handlers driven with call frames built here, as a runtime
//! would build them, with a fake API table that records what the handler
//! asked of it. Host only: no test here loads CUDA (the CUDA handlers are
//! exercised up to the point where they would).

// The frames point into their parts: each part is boxed so its address
// stays put while the vectors that own them grow.
#![allow(clippy::vec_box)]

use xcall::xla::abi::*;
use xcall::*;

mod xla_fake;
use std::ffi::CStr;
use xla_fake::*;

#[test]
fn host_make_row_id_map_gives_the_known_map() {
    let mut m = MapBufs::new(99);
    let mut f = m.frame(dtype::U8, &[("graph_cache", Attr::Pred(true))]);
    let before = (
        STREAM_GETS.with(|c| c.get()),
        ORDINAL_GETS.with(|c| c.get()),
    );
    call(xcall_xla_make_row_id_map_host, &mut f).unwrap();
    // Expert 0 gets t0, t2 (rows 0, 1); expert 1 gets t0, t1 (rows 2, 3).
    assert_eq!(m.map, [0, 2, 0, 1, 2, 3, -1, 1, -1, 1, 1, -1, 0, -1, 1]);
    assert_eq!(m.tpe, [2, 2]);
    assert_eq!(m.off, [0, 2, 4]);
    // The Host handler asked the runtime for no stream and no device.
    assert_eq!(
        before,
        (
            STREAM_GETS.with(|c| c.get()),
            ORDINAL_GETS.with(|c| c.get())
        )
    );
    assert!(!xcall_cuda_load_attempted());
}

#[test]
fn host_permute_refuses_an_output_over_its_input() {
    let mut m = MapBufs::new(0);
    call(xcall_xla_make_row_id_map_host, &mut m.frame(dtype::U8, &[])).unwrap();
    let mut x: Vec<f32> = (0..12).map(|i| i as f32 + 0.5).collect();
    let snapshot = x.clone();
    let xp = ptr(&mut x);
    let mut args = vec![buf(dtype::F32, xp, &[3, 4])];
    args.extend(m.maps());
    let mut f = frame(
        fake_api(API_SIZE_DEVICE_ORDINAL_GET),
        args,
        // Output rows 0..3 of 4 floats: the same memory as the input.
        vec![buf(dtype::F32, xp, &[3, 4])],
        &[],
    );
    let (code, message) = call(xcall_xla_permute_host, &mut f).unwrap_err();
    assert_eq!(code, 3, "INVALID_ARGUMENT");
    assert!(
        message.starts_with("xcall_permute: output overlaps input")
            && message.ends_with("[XCALL_STATUS_ALIASED]"),
        "{message}"
    );
    assert_eq!(x, snapshot, "nothing written");
}

#[test]
fn host_permute_with_probs_runs_and_bad_shapes_are_errors() {
    let mut m = MapBufs::new(0);
    call(xcall_xla_make_row_id_map_host, &mut m.frame(dtype::U8, &[])).unwrap();
    let mut x = [1.0f32, 2.0, 3.0];
    let mut probs = [0.25f32, 0.75, 0.0, 0.5, 0.125, 0.0];
    let mut out = [f32::NAN; 5];
    let mut out_probs = [f32::NAN; 5];
    let (xp, pp, outp, outpp) = (
        ptr(&mut x),
        ptr(&mut probs),
        ptr(&mut out),
        ptr(&mut out_probs),
    );
    let mut make = |out_rows: i64, probs_experts: i64, has_probs: bool| {
        let mut args = vec![buf(dtype::F32, xp, &[3, 1])];
        args.extend(m.maps());
        let mut rets = vec![buf(dtype::F32, outp, &[out_rows, 1])];
        if has_probs {
            args.push(buf(dtype::F32, pp, &[3, probs_experts]));
            rets.push(buf(dtype::F32, outpp, &[out_rows]));
        }
        frame(
            fake_api(API_SIZE_DEVICE_ORDINAL_GET),
            args,
            rets,
            &[("has_probs", Attr::Pred(has_probs))],
        )
    };
    call(xcall_xla_permute_host, &mut make(5, 2, true)).unwrap();
    // Rows: expert 0 <- t0, t2; expert 1 <- t0, t1; row 4 is past the chunks.
    assert_eq!(out, [1.0, 3.0, 1.0, 2.0, 0.0]);
    assert_eq!(out_probs, [0.25, 0.125, 0.75, 0.5, 0.0]);
    let (code, message) = call(xcall_xla_permute_host, &mut make(5, 3, true)).unwrap_err();
    assert_eq!(code, 3);
    assert_eq!(
        message,
        "xcall_permute: probs dim 1 is 3, expected 2 (experts) [XCALL_STATUS_INVALID_ARGUMENT]"
    );
    // has_probs=false but a probs operand: the count is wrong.
    let mut f = make(5, 2, true);
    f.frame.attrs.size = 0;
    let (_, message) = call(xcall_xla_permute_host, &mut f).unwrap_err();
    assert!(
        message.contains("xcall_permute takes 4 operands (input, row_id_map, tokens_per_expert, expert_offsets) with these attributes, got 5"),
        "{message}"
    );
}

#[test]
fn attributes_are_checked() {
    let mut m = MapBufs::new(7);
    let run = |m: &mut MapBufs, attrs: &[(&str, Attr)]| {
        call(
            xcall_xla_make_row_id_map_host,
            &mut m.frame(dtype::PRED, attrs),
        )
    };
    let e = run(&mut m, &[("capacityy", Attr::I64(4))]).unwrap_err();
    assert!(e.1.contains("has no attribute \"capacityy\" (it takes: num_out_tokens, align, capacity, group_experts, group_rows, graph_cache)"), "{}", e.1);
    let e = run(&mut m, &[("capacity", Attr::F32(2.0))]).unwrap_err();
    assert!(
        e.1.contains("attribute capacity: expected an integer scalar, got XLA dtype code 11"),
        "{}",
        e.1
    );
    let e = run(&mut m, &[("graph_cache", Attr::I64(2))]).unwrap_err();
    assert!(
        e.1.contains("attribute graph_cache must be 0 or 1, got 2"),
        "{}",
        e.1
    );
    let e = run(&mut m, &[("align", Attr::I64(-3))]).unwrap_err();
    assert!(e.1.contains("attribute align is negative (-3)"), "{}", e.1);
    let e = run(
        &mut m,
        &[("align", Attr::I64(4)), ("capacity", Attr::I64(2))],
    )
    .unwrap_err();
    assert_eq!(e.0, 3);
    assert_eq!(m.map, [7; 15], "failed calls write nothing");
    // A capacity of 1: t0 keeps expert 0 (row 0) and expert 1 (row 1); t1's
    // route to expert 1 and t2's to expert 0 are dropped.
    run(&mut m, &[("capacity", Attr::I64(1))]).unwrap();
    assert_eq!(m.map, [0, 1, 0, 1, 2, -1, -1, -1, -1, 0, -1, -1, -1, -1, 0]);
    assert_eq!((m.tpe, m.off), ([1, 1], [0, 1, 2]));
}

#[test]
fn metadata_query_reports_version_and_traits() {
    let query = |h: Handler, struct_size: usize| {
        // SAFETY: integers and pointers; all-zero is valid.
        let mut m: XLA_FFI_Metadata = unsafe { std::mem::zeroed() };
        m.struct_size = struct_size;
        m.traits = 0xdead;
        m.state_type_id = 77;
        let mut ext = XLA_FFI_Metadata_Extension {
            extension_base: XLA_FFI_Extension_Base {
                struct_size: METADATA_EXTENSION_SIZE,
                kind: EXTENSION_METADATA,
                next: std::ptr::null_mut(),
            },
            metadata: &mut m,
        };
        let mut f = frame(fake_api(API_SIZE_DEVICE_ORDINAL_GET), vec![], vec![], &[]);
        // As XLA builds it: no API table, the extension first in the chain.
        f.frame.api = std::ptr::null();
        f.frame.extension_start = &mut ext.extension_base;
        assert!(h(&mut *f.frame).is_null());
        (
            m.api_version.major_version,
            m.api_version.minor_version,
            m.api_version.struct_size,
            m.traits,
            m.state_type_id,
        )
    };
    assert_eq!(query(xcall_xla_permute_host, 48), (0, 3, 24, 0, 0));
    assert_eq!(query(xcall_xla_permute_cuda, 48), (0, 3, 24, 1, 0));
    assert_eq!(
        query(xcall_xla_unpermute_backward_cuda, 48),
        (0, 3, 24, 1, 0)
    );
    assert_eq!(
        query(xcall_xla_make_chunk_sort_map_cuda, 48),
        (0, 3, 24, 0, 0)
    );
    // An older runtime's metadata without state_type_id: that field is left alone.
    assert_eq!(
        query(xcall_xla_sort_chunks_by_map_cuda, 36),
        (0, 3, 24, 1, 77)
    );
}

#[test]
fn cuda_handler_checks_the_api_table_before_calling_it() {
    let mut f = frame(
        // An API 0.1 table ends after Future_SetError: no DeviceOrdinal_Get.
        fake_api(API_SIZE_STREAM_GET + 11 * 8),
        vec![],
        vec![],
        &[],
    );
    let (code, message) = call(xcall_xla_unpermute_cuda, &mut f).unwrap_err();
    assert_eq!(code, 12, "UNIMPLEMENTED");
    assert!(
        message.contains("has no DeviceOrdinal_Get (needs 192 bytes): xcall's CUDA handlers need XLA FFI API 0.3"),
        "{message}"
    );
    assert!(message.ends_with("[XCALL_STATUS_UNSUPPORTED]"), "{message}");
    // A full table whose Stream_Get fails (as it does for a handler
    // registered for the wrong platform): a clear error, no CUDA load.
    let mut f = frame(fake_api(API_SIZE_DEVICE_ORDINAL_GET), vec![], vec![], &[]);
    let destroyed = ERRORS_DESTROYED.with(|c| c.get());
    let (_, message) = call(xcall_xla_permute_cuda, &mut f).unwrap_err();
    assert!(
        message.contains("the runtime's Stream_Get failed: unimplemented"),
        "{message}"
    );
    // The runtime's error was read and destroyed, not leaked.
    assert_eq!(ERRORS_DESTROYED.with(|c| c.get()), destroyed + 1);
    // A table of another major version is refused outright.
    let mut api = fake_api(API_SIZE_DEVICE_ORDINAL_GET);
    api.api_version.major_version = 1;
    let mut f = frame(api, vec![], vec![], &[]);
    let (_, message) = call(xcall_xla_permute_host, &mut f).unwrap_err();
    assert!(message.contains("XLA FFI API 1.3"), "{message}");
    assert!(!xcall_cuda_load_attempted());
}

#[test]
fn non_execute_stages_do_nothing() {
    let mut m = MapBufs::new(5);
    let mut f = m.frame(dtype::U8, &[]);
    for stage in 0..3 {
        f.frame.stage = stage;
        call(xcall_xla_make_row_id_map_host, &mut f).unwrap();
    }
    assert_eq!(m.map, [5; 15]);
}

#[test]
fn the_handler_cache_survives_free() {
    let cache = xcall_xla_graph_cache();
    assert!(!cache.is_null());
    xcall_graph_cache_free(cache as *mut _);
    let mut stats = xcall_graph::Stats::default();
    let host = xcall_target {
        platform: PlatformCode(0),
        ordinal: 0,
        stream: std::ptr::null_mut(),
    };
    assert_eq!(
        xcall_graph_cache_stats(cache, &host, &mut stats),
        xcall_core::Status::Ok
    );
}

/// The last error message of this thread.
fn last_error() -> String {
    // SAFETY: always a valid NUL-terminated string.
    unsafe { CStr::from_ptr(xcall_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

unsafe extern "C" fn null_error_create(_: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    std::ptr::null_mut()
}

/// Frames that give the handler no way to report an error still never
/// read as success: the handler returns the unreportable-error marker, the
/// thread's last error says why, and nothing is written.
#[test]
fn frames_that_cannot_report_get_the_unreportable_marker() {
    let marker = xcall_xla_unreportable_error();
    assert!(!marker.is_null());
    assert_eq!(marker, xcall_xla_unreportable_error(), "one value");

    assert_eq!(
        xcall_xla_permute_host(std::ptr::null_mut()),
        marker,
        "NULL frame"
    );
    assert!(
        last_error().contains("the call frame is NULL"),
        "{}",
        last_error()
    );

    let mut m = MapBufs::new(3);
    type Spoil = Box<dyn Fn(&mut Frame)>;
    let cases: Vec<(&str, Spoil, &str)> = vec![
        (
            "a frame too short to hold its API table",
            Box::new(|f: &mut Frame| f.frame.struct_size = 8),
            "XLA_FFI_CallFrame of 8 bytes",
        ),
        (
            "no API table at the execute stage",
            Box::new(|f: &mut Frame| f.frame.api = std::ptr::null()),
            "no XLA FFI API table",
        ),
        (
            "a table too short for Error_Create",
            Box::new(|f: &mut Frame| {
                // SAFETY: the frame's table is the Box in f._api.
                unsafe { (*(f.frame.api as *mut XLA_FFI_Api)).struct_size = 16 }
            }),
            "table of 16 bytes",
        ),
        (
            "no Error_Create",
            Box::new(|f: &mut Frame| {
                // SAFETY: as above.
                unsafe { (*(f.frame.api as *mut XLA_FFI_Api)).error_create = None }
            }),
            "",
        ),
        (
            "an Error_Create that returns NULL",
            Box::new(|f: &mut Frame| {
                // SAFETY: as above.
                unsafe {
                    (*(f.frame.api as *mut XLA_FFI_Api)).error_create = Some(null_error_create)
                }
            }),
            "",
        ),
    ];
    for (what, spoil, says) in cases {
        let mut f = m.frame(dtype::U8, &[]);
        spoil(&mut f);
        if says.is_empty() {
            // A valid frame with a broken reporting path: make it fail.
            f.frame.stage = 99;
        }
        let e = xcall_xla_make_row_id_map_host(&mut *f.frame);
        assert_eq!(e, marker, "{what}");
        let wanted = if says.is_empty() {
            "unknown execution stage 99"
        } else {
            says
        };
        assert!(last_error().contains(wanted), "{what}: {}", last_error());
        assert_eq!(m.map, [3; 15], "{what}: nothing written");
    }
}

#[test]
fn malformed_frames_get_an_xla_error_and_write_nothing() {
    let mut m = MapBufs::new(4);
    // An unknown stage.
    let mut f = m.frame(dtype::U8, &[]);
    f.frame.stage = 99;
    let e = call(xcall_xla_make_row_id_map_host, &mut f).unwrap_err();
    assert!(e.1.contains("unknown execution stage 99"), "{}", e.1);
    // An attribute given twice.
    let e = call(
        xcall_xla_make_row_id_map_host,
        &mut m.frame(
            dtype::U8,
            &[("align", Attr::I64(1)), ("align", Attr::I64(2))],
        ),
    )
    .unwrap_err();
    assert!(
        e.1.contains("attribute \"align\" is given twice"),
        "{}",
        e.1
    );
    // An attribute count no op takes: refused before anything is read or
    // allocated for it.
    let mut f = m.frame(dtype::U8, &[("align", Attr::I64(1))]);
    f.frame.attrs.size = 1 << 40;
    let e = call(xcall_xla_make_row_id_map_host, &mut f).unwrap_err();
    assert!(e.1.contains("1099511627776 attributes"), "{}", e.1);
    // A buffer of rank 2 whose dims pointer is NULL.
    let mut f = m.frame(dtype::U8, &[]);
    f._bufs[0].raw.dims = std::ptr::null_mut();
    let e = call(xcall_xla_make_row_id_map_host, &mut f).unwrap_err();
    assert!(
        e.1.contains("operand routing has rank 2 but its dims pointer is NULL"),
        "{}",
        e.1
    );
    assert_eq!(m.map, [4; 15], "nothing written");
    assert_eq!((m.tpe, m.off), ([4; 2], [4; 3]));
}

#[test]
fn malformed_metadata_queries_and_endless_chains_are_not_success() {
    let marker = xcall_xla_unreportable_error();
    // SAFETY: integers and pointers; all-zero is valid.
    let mut meta: XLA_FFI_Metadata = unsafe { std::mem::zeroed() };
    meta.struct_size = 48;
    meta.traits = 0xdead;
    let mut ext = XLA_FFI_Metadata_Extension {
        extension_base: XLA_FFI_Extension_Base {
            struct_size: METADATA_EXTENSION_SIZE,
            kind: EXTENSION_METADATA,
            next: std::ptr::null_mut(),
        },
        metadata: &mut meta,
    };
    let query = |spoil: &dyn Fn(&mut XLA_FFI_Metadata_Extension), says: &str| {
        let mut f = frame(fake_api(API_SIZE_DEVICE_ORDINAL_GET), vec![], vec![], &[]);
        f.frame.api = std::ptr::null();
        let mut e = XLA_FFI_Metadata_Extension {
            extension_base: XLA_FFI_Extension_Base {
                struct_size: ext.extension_base.struct_size,
                kind: ext.extension_base.kind,
                next: std::ptr::null_mut(),
            },
            metadata: ext.metadata,
        };
        spoil(&mut e);
        f.frame.extension_start = &mut e.extension_base;
        assert_eq!(xcall_xla_permute_cuda(&mut *f.frame), marker, "{says}");
        assert!(last_error().contains(says), "{says}: {}", last_error());
    };
    query(
        &|e| e.extension_base.struct_size = 8,
        "the metadata extension has 8 bytes",
    );
    query(
        &|e| e.metadata = std::ptr::null_mut(),
        "has no metadata to fill",
    );
    query(
        // SAFETY: the metadata is `meta`, alive.
        &|e| unsafe { (*e.metadata).struct_size = 8 },
        "XLA_FFI_Metadata of 8 bytes",
    );
    meta.struct_size = 48;
    assert_eq!(meta.traits, 0xdead, "nothing written");
    // A chain whose node points at itself (not a metadata extension).
    ext.extension_base.kind = 77;
    let mut f = frame(fake_api(API_SIZE_DEVICE_ORDINAL_GET), vec![], vec![], &[]);
    ext.extension_base.next = &mut ext.extension_base;
    f.frame.extension_start = &mut ext.extension_base;
    let e = call(xcall_xla_permute_host, &mut f).unwrap_err();
    assert!(e.1.contains("extension chain is longer than 64"), "{}", e.1);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Random attribute lists on make_row_id_map (names from the pool,
    /// repeats, odd values): the handler never panics or reports success
    /// wrongly. A list with a repeated or unknown name, or a flag outside
    /// 0/1, is an XLA error; an accepted call wrote a map of [`ROUTING`]
    /// (every route's destination inside its chunk).
    #[test]
    fn attribute_lists_are_decoded_or_refused(
        picks in proptest::collection::vec(
            (0usize..NAMES.len(), proptest::prelude::prop_oneof![
                -2i64..6,
                proptest::prelude::Just(i64::MAX),
                proptest::prelude::Just(1i64 << 62),
            ]),
            0..6,
        ),
    ) {
        let attrs: Vec<(&str, Attr)> = picks.iter().map(|&(n, v)| (NAMES[n], Attr::I64(v))).collect();
        let mut m = MapBufs::new(-9);
        let mut f = m.frame(dtype::U8, &attrs);
        let r = call(xcall_xla_make_row_id_map_host, &mut f);
        let names: Vec<&str> = attrs.iter().map(|(n, _)| *n).collect();
        let repeated = names.iter().enumerate().any(|(i, n)| names[..i].contains(n));
        let unknown = names.iter().any(|n| !["num_out_tokens", "align", "capacity", "graph_cache"].contains(n));
        let bad_flag = attrs.iter().any(|(n, a)| *n == "graph_cache" && !matches!(a, Attr::I64(0 | 1)));
        if repeated || unknown || bad_flag {
            proptest::prop_assert!(r.is_err(), "{:?} accepted", names);
        }
        match r {
            Ok(()) => {
                for t in 0..3 {
                    let n = m.map[t * 5 + 4];
                    proptest::prop_assert!((0..=2).contains(&n));
                    for k in 0..n as usize {
                        let (dst, e) = (m.map[t * 5 + k] as i64, m.map[t * 5 + 2 + k] as usize);
                        proptest::prop_assert!(dst >= m.off[e] && dst < m.off[e] + m.tpe[e]);
                    }
                }
            }
            Err(_) => proptest::prop_assert_eq!(m.map, [-9; 15], "a refused call wrote"),
        }
    }
}

/// 64-bit slots as s32 pairs (JAX without `jax_enable_x64`): the same
/// values as s64 buffers, low word first; a pair form anywhere else, or
/// with a trailing dim other than 2, is refused with nothing written.
#[test]
fn int64_slots_take_s32_pairs_and_nothing_else_does() {
    let mut m = MapBufs::new(0);
    call(xcall_xla_make_row_id_map_host, &mut m.frame(dtype::U8, &[])).unwrap();
    let mut map = [-7i32; 15];
    let mut tpe = [-7i32; 4];
    let mut off = [-7i32; 6];
    let mut routing = m.routing;
    let (mapp, tpep, offp) = (ptr(&mut map), ptr(&mut tpe), ptr(&mut off));
    let mut f = frame(
        fake_api(API_SIZE_DEVICE_ORDINAL_GET),
        vec![buf(dtype::U8, ptr(&mut routing), &[3, 2])],
        vec![
            buf(dtype::S32, mapp, &[3, 5]),
            buf(dtype::S32, tpep, &[2, 2]),
            buf(dtype::S32, offp, &[3, 2]),
        ],
        &[],
    );
    call(xcall_xla_make_row_id_map_host, &mut f).unwrap();
    assert_eq!(map, m.map);
    let words = |v: &[i64]| -> Vec<i32> {
        v.iter()
            .flat_map(|x| [*x as i32, (*x >> 32) as i32])
            .collect()
    };
    assert_eq!(tpe.to_vec(), words(&m.tpe));
    assert_eq!(off.to_vec(), words(&m.off));

    // permute reads the pairs as it reads the s64 chunks.
    let mut x = [1.0f32, 2.0, 3.0];
    let mut out = [f32::NAN; 5];
    let outp = ptr(&mut out);
    let mut f = frame(
        fake_api(API_SIZE_DEVICE_ORDINAL_GET),
        vec![
            buf(dtype::F32, ptr(&mut x), &[3, 1]),
            buf(dtype::S32, mapp, &[3, 5]),
            buf(dtype::S32, tpep, &[2, 2]),
            buf(dtype::S32, offp, &[3, 2]),
        ],
        vec![buf(dtype::F32, outp, &[5, 1])],
        &[],
    );
    call(xcall_xla_permute_host, &mut f).unwrap();
    assert_eq!(out, [1.0, 3.0, 1.0, 2.0, 0.0]);

    // A trailing dim of 3, and the pair form in a 32-bit slot (the
    // row-id map as [3, 5, 2] would be 30 words): dtype or rank errors.
    let refused = |rets: Vec<Box<xla_fake::Buf>>, routing: &mut [u8; 6]| {
        let mut f = frame(
            fake_api(API_SIZE_DEVICE_ORDINAL_GET),
            vec![buf(dtype::U8, ptr(routing), &[3, 2])],
            rets,
            &[],
        );
        call(xcall_xla_make_row_id_map_host, &mut f).unwrap_err()
    };
    let mut wide = [-7i32; 30];
    let before = (map, tpe, off);
    let (code, message) = refused(
        vec![
            buf(dtype::S32, mapp, &[3, 5]),
            buf(dtype::S32, tpep, &[2, 3]),
            buf(dtype::S32, offp, &[3, 2]),
        ],
        &mut routing,
    );
    assert_eq!(code, 12, "UNIMPLEMENTED: {message}");
    assert!(
        message.contains("tokens_per_expert") && message.contains("i32"),
        "{message}"
    );
    let (code, message) = refused(
        vec![
            buf(dtype::S32, ptr(&mut wide), &[3, 5, 2]),
            buf(dtype::S32, tpep, &[2, 2]),
            buf(dtype::S32, offp, &[3, 2]),
        ],
        &mut routing,
    );
    assert_eq!(code, 3, "{message}");
    assert!(message.contains("row_id_map"), "{message}");
    assert_eq!((map, tpe, off), before, "nothing written");
    assert!(wide.iter().all(|&w| w == -7));
}
