//! `cuda::peer_readable`: a `cuMemAlloc` buffer of a device's primary
//! context is readable by peers over any range inside it, and so is a
//! virtual-memory mapping exactly where it grants every peer read access;
//! nothing else is: a range past either's end, host memory, an address no
//! one allocated, the buffer asked about as another device's, or memory a
//! peer is not granted (a mapping, stream-ordered pool memory).
//! Skips without a GPU unless XCALL_REQUIRE_CUDA=1.

use cudarc::driver::sys;
use xcall_core::testing::cuda_devices_or_skip;
use xcall_core::{cuda, Device};

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

#[test]
fn a_plain_allocation_and_mappings_peers_may_read_are_peer_readable() {
    let Some(n) = cuda_devices_or_skip("cuda peer_readable") else {
        return;
    };
    let d = Device::cuda(0);
    let other = Device::cuda(1);
    let mib = 1 << 20;
    let base = cuda::mem_alloc(d, mib).unwrap();
    let host = [0u8; 64];
    for (what, address, bytes, want) in [
        ("the whole buffer", base, mib, true),
        ("a range inside it", base + 4096, 1000, true),
        ("its last 16 bytes", base + mib as u64 - 16, 16, true),
        ("one byte past its end", base, mib + 1, false),
        ("a range over its end", base + mib as u64 - 16, 32, false),
        ("host memory", host.as_ptr() as u64, 64, false),
        ("address 0", 0, 16, false),
        ("a range that wraps", base, usize::MAX, false),
    ] {
        let got = cuda::peer_readable(d, &[d], address, bytes).unwrap();
        assert_eq!(got, want, "{what}");
    }
    if n > 1 {
        // Device 0's memory is not device 1's to offer.
        assert!(!cuda::peer_readable(other, &[d, other], base, 16).unwrap());
    }
    let stream = cuda::OwnedStream::new(d).unwrap();
    // SAFETY: a live stream of `d`, dropped after the allocation.
    let pooled = unsafe { cuda::StreamAlloc::new(d, stream.raw(), 4096) }.unwrap();
    // The device itself needs no grant; a peer is granted nothing by the
    // default pool.
    assert!(cuda::peer_readable(d, &[d], pooled.address(), 4096).unwrap());
    if n > 1 {
        let both = [d, other];
        assert!(
            !cuda::peer_readable(d, &both, pooled.address(), 4096).unwrap(),
            "pool memory"
        );
    }
    drop(pooled);
    stream.stream().sync().unwrap();
    // SAFETY: allocated above, no work uses it.
    unsafe { cuda::mem_free(d, base) }.unwrap();

    // A mapping of device 0's memory, read-write for device 0; then for
    // device 1 too, where there is one.
    cuda::with_context(d, |_| {
        let prop = sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            // SAFETY: all-zero is a valid value of the remaining fields.
            ..unsafe { std::mem::zeroed() }
        };
        let mut gran = 0usize;
        // SAFETY: writes one size; `prop` is a valid value.
        ok(
            unsafe {
                sys::cuMemGetAllocationGranularity(
                    &mut gran,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                )
            },
            "granularity",
        );
        let (mut handle, mut va) = (0, 0);
        // SAFETY: each writes one handle or address; the mapping covers
        // the reservation, made of the handle's `gran` bytes.
        unsafe {
            ok(sys::cuMemCreate(&mut handle, gran, &prop, 0), "cuMemCreate");
            ok(sys::cuMemAddressReserve(&mut va, gran, 0, 0, 0), "reserve");
            ok(sys::cuMemMap(va, gran, 0, handle, 0), "cuMemMap");
        }
        let grant = |dev: i32| {
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: dev,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: one descriptor for the mapped range.
            ok(unsafe { sys::cuMemSetAccess(va, gran, &desc, 1) }, "access");
        };
        grant(0);
        assert!(cuda::peer_readable(d, &[d], va, gran).unwrap(), "mapped");
        assert!(
            !cuda::peer_readable(d, &[d], va, gran + 1).unwrap(),
            "past it"
        );
        if n > 1 {
            let both = [d, other];
            assert!(
                !cuda::peer_readable(d, &both, va, gran).unwrap(),
                "no grant"
            );
            grant(1);
            assert!(cuda::peer_readable(d, &both, va, gran).unwrap(), "granted");
        }
        // SAFETY: nothing uses the mapping any more.
        unsafe {
            ok(sys::cuMemUnmap(va, gran), "unmap");
            ok(sys::cuMemAddressFree(va, gran), "free");
            ok(sys::cuMemRelease(handle), "release");
        }
        Ok(())
    })
    .unwrap();
}
