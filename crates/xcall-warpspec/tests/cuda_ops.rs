//! The generated Hopper kernels against the Host executor. Skips without a
//! GPU unless XCALL_REQUIRE_CUDA=1; skips (loudly) on a non-Hopper GPU.

mod common;

use common::{decode, random_bytes};
use cudarc::driver::{CudaContext, DevicePtr};
use xcall_core::testing::{cuda_devices_or_skip, skip};
use xcall_core::{cuda, DType, Device, Status};
use xcall_warpspec::codegen::ElementwiseOp;
use xcall_warpspec::cuda::{DeviceBuffers, Variant, WsKernels};
use xcall_warpspec::ops::{mul_host, silu_scale_host, OpConfig};

fn hopper() -> Option<()> {
    cuda_devices_or_skip("warpspec cuda ops")?;
    let info = cuda::device_info(Device::cuda(0)).unwrap();
    if info.compute_capability.0 != 9 {
        skip(
            "warpspec cuda ops",
            &format!("{} is {}, not Hopper", info.name, info.arch()),
        );
        return None;
    }
    Some(())
}

#[test]
fn generated_kernels_equal_the_host_executor() {
    if hopper().is_none() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let kernels = WsKernels::new();
    let configs = [
        OpConfig {
            stages: 1,
            tile_bytes: 4096,
            compute_warpgroups: 1,
        },
        OpConfig {
            stages: 2,
            tile_bytes: 8192,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 4,
            tile_bytes: 16384,
            compute_warpgroups: 2,
        },
        OpConfig {
            stages: 3,
            tile_bytes: 1040,
            compute_warpgroups: 1,
        },
    ];
    let mut seed = 7;
    for dtype in [DType::F32, DType::Bf16] {
        for config in &configs {
            for n in [1usize, 5, 1000, 65_536 + 3, (1 << 20) + 7] {
                for op in [ElementwiseOp::Mul, ElementwiseOp::SiluScale] {
                    seed += 1;
                    let a = random_bytes(dtype, n, seed);
                    let b = random_bytes(dtype, n, seed + 1000);
                    let mut want = vec![0u8; a.len()];
                    match op {
                        ElementwiseOp::Mul => mul_host(dtype, &a, &b, &mut want, config).unwrap(),
                        ElementwiseOp::SiluScale => {
                            silu_scale_host(dtype, &a, 0.75, &mut want, config).unwrap()
                        }
                    }
                    let (da, db) = (
                        stream.clone_htod(&a).unwrap(),
                        stream.clone_htod(&b).unwrap(),
                    );
                    let out = stream.clone_htod(&vec![0xa5u8; a.len()]).unwrap(); // poisoned
                    let inputs: Vec<u64> = match op {
                        ElementwiseOp::Mul => {
                            vec![da.device_ptr(&stream).0, db.device_ptr(&stream).0]
                        }
                        ElementwiseOp::SiluScale => vec![da.device_ptr(&stream).0],
                    };
                    let bufs = DeviceBuffers {
                        inputs: &inputs,
                        output: out.device_ptr(&stream).0,
                        bytes: a.len() as u64,
                    };
                    for variant in [Variant::WarpSpecialized, Variant::Plain] {
                        // SAFETY: a live stream of cuda:0 and allocations of a.len() bytes.
                        unsafe {
                            kernels.launch(
                                Device::cuda(0),
                                stream.cu_stream(),
                                op,
                                dtype,
                                variant,
                                config,
                                &bufs,
                                0.75,
                            )
                        }
                        .unwrap();
                        let got = stream.clone_dtoh(&out).unwrap();
                        stream.synchronize().unwrap();
                        let what = format!("{op:?} {dtype} {variant:?} {config:?} n={n}");
                        if op == ElementwiseOp::Mul {
                            assert_eq!(got, want, "{what}");
                        } else {
                            // expf differs from the Host's exp by an ulp or two.
                            let tol = if dtype == DType::F32 { 4e-6 } else { 8e-3 };
                            for (i, (g, w)) in decode(dtype, &got)
                                .iter()
                                .zip(decode(dtype, &want))
                                .enumerate()
                            {
                                assert!(
                                    (g - w).abs() <= tol * w.abs().max(1.0),
                                    "{what}: element {i}: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn bad_buffers_are_refused() {
    if hopper().is_none() {
        return;
    }
    let kernels = WsKernels::new();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let c = OpConfig::default();
    let run = |inputs: &[u64], output: u64, bytes: u64, dtype: DType| {
        let b = DeviceBuffers {
            inputs,
            output,
            bytes,
        };
        // SAFETY: every call below is refused before anything launches.
        unsafe {
            kernels.launch(
                Device::cuda(0),
                stream.cu_stream(),
                ElementwiseOp::Mul,
                dtype,
                Variant::WarpSpecialized,
                &c,
                &b,
                1.0,
            )
        }
        .unwrap_err()
    };
    assert_eq!(
        run(&[0x1000, 0x2008], 0x3000, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000], 0x3000, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x1010, 64, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x3000, 6, DType::F32).status(),
        Status::InvalidArgument
    );
    assert_eq!(
        run(&[0x1000, 0x2000], 0x3000, 64, DType::I32).status(),
        Status::Unsupported
    );
}
