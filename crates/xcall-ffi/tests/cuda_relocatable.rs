//! `XCALL_CALL_RELOCATABLE` through the C ABI on CUDA: a call whose record
//! function runs an xcall op (`xcall_ws_run`) is patched to new buffers
//! without calling it again, writes the new output and leaves the old one
//! alone; without the flag the same calls take the exec-update path.

use std::ffi::c_void;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use xcall::{
    xcall_buffer, xcall_call, xcall_graph_cache, xcall_graph_cache_execute, xcall_graph_cache_free,
    xcall_graph_cache_new, xcall_target, xcall_ws_run, BufferRoleCode, DTypeCode, PlatformCode,
    WsOpCode, XCALL_CALL_RELOCATABLE,
};
use xcall_core::testing::{cuda_devices_or_skip, XorShift};
use xcall_core::{DType, Platform, Status};
use xcall_graph::{BufferRole, Outcome};
use xcall_warpspec::codegen::ElementwiseOp;

const N: usize = 1 << 16;

/// `out = a * b` over `N` f32 on one stream: the record function's data.
struct Mul {
    stream: *mut c_void,
    a: u64,
    b: u64,
    out: u64,
    records: usize,
}

unsafe extern "C" fn record(user_data: *mut c_void, stream: *mut c_void) -> u32 {
    // SAFETY: the test passes a live `Mul` as user_data.
    let m = unsafe { &mut *(user_data as *mut Mul) };
    m.records += 1;
    let target = xcall_target {
        platform: PlatformCode(Platform::Cuda as u32),
        ordinal: 0,
        stream,
    };
    let inputs = [m.a as *const c_void, m.b as *const c_void];
    xcall_ws_run(
        &target,
        WsOpCode(ElementwiseOp::Mul as u32),
        DTypeCode(DType::F32 as u32),
        std::ptr::null(),
        inputs.as_ptr(),
        2,
        m.out as *mut c_void,
        N * 4,
        0.0,
    ) as u32
}

struct Set {
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    out: CudaSlice<f32>,
    want: Vec<f32>,
}

fn addr(s: &CudaSlice<f32>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

fn set(stream: &std::sync::Arc<CudaStream>, g: &mut XorShift) -> Set {
    let a: Vec<f32> = (0..N).map(|_| g.next_f32() * 4.0 - 2.0).collect();
    let b: Vec<f32> = (0..N).map(|_| g.next_f32() * 4.0 - 2.0).collect();
    let want = a.iter().zip(&b).map(|(x, y)| x * y).collect();
    Set {
        a: stream.clone_htod(&a).unwrap(),
        b: stream.clone_htod(&b).unwrap(),
        out: stream.clone_htod(&vec![f32::NAN; N]).unwrap(),
        want,
    }
}

/// Runs `m` through `cache` on the buffers of `s`; returns the outcome.
fn execute(
    cache: *mut xcall_graph_cache,
    m: &mut Mul,
    s: &Set,
    st: &CudaStream,
    flags: u32,
) -> Outcome {
    (m.a, m.b, m.out) = (addr(&s.a, st), addr(&s.b, st), addr(&s.out, st));
    let role = |r: BufferRole| BufferRoleCode(r as u32);
    let buffers = [
        xcall_buffer {
            address: m.a,
            bytes: (N * 4) as u64,
            role: role(BufferRole::In),
        },
        xcall_buffer {
            address: m.b,
            bytes: (N * 4) as u64,
            role: role(BufferRole::In),
        },
        xcall_buffer {
            address: m.out,
            bytes: (N * 4) as u64,
            role: role(BufferRole::Out),
        },
    ];
    let call = xcall_call {
        target: xcall_target {
            platform: PlatformCode(Platform::Cuda as u32),
            ordinal: 0,
            stream: m.stream,
        },
        target_id: 0x006d_756c, // "mul"
        attributes: 1,
        buffers: buffers.as_ptr(),
        num_buffers: buffers.len(),
        flags,
    };
    let mut outcome = u32::MAX;
    let status = xcall_graph_cache_execute(
        cache,
        &call,
        Some(record),
        m as *mut Mul as *mut c_void,
        &mut outcome,
    );
    assert_eq!(status, Status::Ok, "xcall_graph_cache_execute");
    Outcome::from_code(outcome).unwrap_or_else(|| panic!("outcome {outcome}"))
}

fn download(s: &CudaSlice<f32>, stream: &std::sync::Arc<CudaStream>) -> Vec<f32> {
    stream.clone_dtoh(s).unwrap()
}

#[test]
fn a_relocatable_call_is_patched_and_writes_only_the_new_buffers() {
    if cuda_devices_or_skip("ffi relocatable call").is_none() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    if ctx.compute_capability().unwrap().0 < 9 {
        xcall_core::testing::skip("ffi relocatable call", "xcall_ws_run needs Hopper (sm_90)");
        return;
    }
    let stream = ctx.new_stream().unwrap();
    let mut g = XorShift::new(17);
    for (flags, second) in [
        (XCALL_CALL_RELOCATABLE, Outcome::Patched),
        (0, Outcome::Updated),
    ] {
        let mut cache: *mut xcall_graph_cache = std::ptr::null_mut();
        assert_eq!(
            xcall_graph_cache_new(std::ptr::null(), &mut cache),
            Status::Ok
        );
        let (mut first, mut next) = (set(&stream, &mut g), set(&stream, &mut g));
        let mut m = Mul {
            stream: stream.cu_stream().cast(),
            a: addr(&next.a, &stream),
            b: addr(&next.b, &stream),
            out: addr(&next.out, &stream),
            records: 0,
        };
        // Compile and load the kernel outside any capture (its output is
        // poisoned again below).
        // SAFETY: `m` is live; its buffers are N floats on the stream's
        // device.
        assert_eq!(unsafe { record((&mut m as *mut Mul).cast(), m.stream) }, 0);
        stream
            .memcpy_htod(&vec![f32::NAN; N], &mut next.out)
            .unwrap();
        m.records = 0;
        let o = execute(cache, &mut m, &first, &stream, flags);
        assert_eq!((o, m.records), (Outcome::Captured, 1), "flags {flags}");
        assert_eq!(
            download(&first.out, &stream),
            first.want,
            "flags {flags}: first call"
        );
        // Poison the first output: a graph still pointing at it would
        // overwrite the NaNs.
        stream
            .memcpy_htod(&vec![f32::NAN; N], &mut first.out)
            .unwrap();
        let o = execute(cache, &mut m, &next, &stream, flags);
        let records = if second == Outcome::Patched { 1 } else { 2 };
        assert_eq!(
            (o, m.records),
            (second, records),
            "flags {flags}: moved buffers"
        );
        assert_eq!(
            download(&next.out, &stream),
            next.want,
            "flags {flags}: new output"
        );
        assert!(
            download(&first.out, &stream).iter().all(|v| v.is_nan()),
            "flags {flags}: the old output was written"
        );
        // The patched graph replays on the new buffers.
        let o = execute(cache, &mut m, &next, &stream, flags);
        assert_eq!(
            (o, m.records),
            (Outcome::Replayed, records),
            "flags {flags}: replay"
        );
        stream.synchronize().unwrap();
        xcall_graph_cache_free(cache);
    }
}
