//! `cuda::peer_readable`: a `cuMemAlloc` buffer of a device's primary
//! context is readable by peers over any range inside it, and nothing
//! else is: a range past its end, host memory, an address no one
//! allocated, the same buffer asked about as another device's, or
//! stream-ordered pool memory (`cuMemAllocAsync`). Skips without a GPU
//! unless XCALL_REQUIRE_CUDA=1.

use xcall_core::testing::cuda_devices_or_skip;
use xcall_core::{cuda, Device};

#[test]
fn only_a_plain_allocation_of_the_device_is_peer_readable() {
    let Some(n) = cuda_devices_or_skip("cuda peer_readable") else {
        return;
    };
    let d = Device::cuda(0);
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
        assert_eq!(
            cuda::peer_readable(d, address, bytes).unwrap(),
            want,
            "{what}"
        );
    }
    if n > 1 {
        // Device 0's memory is not device 1's to offer.
        assert!(!cuda::peer_readable(Device::cuda(1), base, 16).unwrap());
    }
    let stream = cuda::OwnedStream::new(d).unwrap();
    // SAFETY: a live stream of `d`, dropped after the allocation.
    let pooled = unsafe { cuda::StreamAlloc::new(d, stream.raw(), 4096) }.unwrap();
    assert!(
        !cuda::peer_readable(d, pooled.address(), 4096).unwrap(),
        "pool memory"
    );
    drop(pooled);
    stream.stream().sync().unwrap();
    // SAFETY: allocated above, no work uses it.
    unsafe { cuda::mem_free(d, base) }.unwrap();
}
