//! The Host path runs the record function directly and never loads CUDA
//! (a Host-only program must not need, or fail in, the driver). Its own test process, so nothing else loaded the driver.

use xcall_graph::cuda::{CudaGraphs, CudaStreamHandle};
use xcall_graph::{
    Buffer, BufferRole, CacheConfig, Call, CallKey, Device, GraphCache, Outcome, Platform,
};

#[test]
fn host_calls_run_directly_and_never_touch_cuda() {
    let cache = GraphCache::new(CudaGraphs, CacheConfig::default()).unwrap();
    let key = CallKey {
        device: Device::HOST,
        target: 1,
        attributes: 2.into(),
        buffers: vec![Buffer::new(0x1000, 16, BufferRole::Out)],
    };
    // A stream given on Host is ignored, never queried.
    let call = Call::new(key.clone(), Some(CudaStreamHandle(0xdead as _)));
    let mut runs = 0;
    for _ in 0..3 {
        let outcome = cache
            .execute(&call, |stream| {
                assert!(stream.is_none(), "Host work gets no stream");
                runs += 1;
                Ok::<(), std::io::Error>(())
            })
            .unwrap();
        assert_eq!(outcome, Outcome::EagerHost);
    }
    assert_eq!(runs, 3);
    assert_eq!(cache.stats(Device::HOST).eager_host, 3);
    assert_eq!(cache.invalidate_range(Device::HOST, 0x1000, 1).unwrap(), 0);
    let other_host = Call::new(
        CallKey {
            device: Device::new(Platform::Host, 1),
            ..key
        },
        None,
    );
    assert!(cache
        .execute(&other_host, |_| Ok::<(), std::io::Error>(()))
        .is_err());
    assert!(
        !xcall_core::cuda::driver_load_attempted(),
        "the Host path loaded CUDA"
    );
}
