//! CUDA worlds: one GPU (a world of one PE), two GPUs in one process
//! (SPMT, direct pointers + peer access) and two processes (IPC handles;
//! on one GPU both processes take it). Skips without a GPU unless
//! XCALL_REQUIRE_CUDA=1; the tests of two GPUs in one process skip on a
//! one-GPU machine with a SKIP line.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use xcall_core::testing::{cuda_devices_or_skip, run_threads, skip, watchdog, XorShift};
use xcall_core::{Device, KernelCache, KernelSource, Status};
use xcall_shmem::{Cmp, SignalOp, World, WorldConfig};

mod common;

const PE_ENV: &str = "XCALL_SHMEM_CUDA_TEST_PE";

/// Tests of this file bind devices (one live PE per device per process):
/// they run one at a time, whatever the harness's thread count.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}
fn two_gpus(test: &str) -> bool {
    match cuda_devices_or_skip(test) {
        Some(n) if n >= 2 => true,
        Some(n) => {
            skip(test, &format!("needs 2 GPUs, this machine has {n}"));
            false
        }
        None => false,
    }
}

fn random(seed: u64, bytes: usize) -> Vec<u8> {
    let mut g = XorShift::new(seed);
    (0..bytes).map(|_| g.next_u64() as u8).collect()
}

fn stream(device: Device) -> (Arc<CudaContext>, Arc<cudarc::driver::CudaStream>) {
    let ctx = CudaContext::new(device.ordinal as usize).unwrap();
    let s = ctx.new_stream().unwrap();
    (ctx, s)
}

/// Reads `bytes` of this PE's heap at `addr` through `get` from itself.
fn read_own(w: &mut World, addr: u64, bytes: usize) -> Vec<u8> {
    let mut v = vec![0xa5u8; bytes];
    let me = w.rank().unwrap();
    // SAFETY: `v` has `bytes` bytes.
    unsafe { w.get(v.as_mut_ptr() as u64, addr, bytes, me) }.unwrap();
    v
}

/// The exchange every CUDA world runs: ring put with signal, get back,
/// barrier_on_stream rounds with stream-ordered puts, and a kernel that
/// reads a peer's object through `ptr`.
fn exchange(w: &mut World, rank: usize, n: usize) {
    let device = w.device_of(rank).unwrap();
    let (_ctx, s) = stream(device);
    let raw: *mut c_void = s.cu_stream().cast();
    let bytes = 3 << 20;
    let buf = w.malloc(bytes).unwrap();
    let sig = w.malloc(8).unwrap();
    let zero = 0u64;
    // SAFETY: 8 bytes of a live local.
    unsafe { w.put(sig, &zero as *const u64 as u64, 8, rank) }.unwrap();
    w.barrier_all().unwrap();
    let right = (rank + 1) % n;
    let left = (rank + n - 1) % n;
    let data = random(50 + rank as u64, bytes);
    // SAFETY: `data` lives across the blocking call.
    unsafe {
        w.put_signal(
            buf,
            data.as_ptr() as u64,
            bytes,
            sig,
            1,
            SignalOp::Add,
            right,
        )
    }
    .unwrap();
    assert_eq!(w.wait_until(sig, Cmp::Ge, 1).unwrap(), 1);
    assert!(
        read_own(w, buf, bytes) == random(50 + left as u64, bytes),
        "rank {rank}: put_signal data"
    );
    let mut back = vec![0u8; bytes];
    // SAFETY: `back` has `bytes` bytes.
    unsafe { w.get(back.as_mut_ptr() as u64, buf, bytes, right) }.unwrap();
    assert!(back == data, "rank {rank}: get");
    w.barrier_all().unwrap();

    // Stream-ordered rounds: put_nbi, barrier_on_stream, read back.
    for round in 0..20u64 {
        let data = random(1000 * round + rank as u64, bytes);
        let mut got = vec![0u8; bytes];
        // SAFETY: `data` and `got` outlive the synchronisation below.
        unsafe {
            w.put_nbi(buf, data.as_ptr() as u64, bytes, right, raw)
                .unwrap();
            w.barrier_on_stream(raw).unwrap();
            w.get_nbi(got.as_mut_ptr() as u64, buf, bytes, rank, raw)
                .unwrap();
        }
        s.synchronize().unwrap();
        assert!(
            got == random(1000 * round + left as u64, bytes),
            "rank {rank} round {round}: barrier_on_stream ordering"
        );
        // Nobody overwrites `buf` before everyone read it.
        w.barrier_on_stream(raw).unwrap();
        s.synchronize().unwrap();
    }
    w.quiet().unwrap();

    // A kernel on this PE's GPU reads the right neighbour's `buf` through
    // the peer pointer and writes its bytes + 1 into this PE's `buf`.
    let peer = w.ptr(right, buf).unwrap();
    let cache = KernelCache::new();
    let module = cache
        .module(
            device,
            &KernelSource {
                name: "peer_read.cu",
                code: "extern \"C\" __global__ void peer_read(const unsigned char* peer, unsigned char* out, unsigned long long n) { for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = peer[i] + 1; }",
                options: &[],
            },
        )
        .unwrap();
    let f = module.function("peer_read").unwrap();
    let fresh = random(77 + rank as u64, bytes);
    // SAFETY: `fresh` lives across the blocking put.
    unsafe { w.put(buf, fresh.as_ptr() as u64, bytes, rank) }.unwrap();
    let out = w.malloc(bytes).unwrap();
    w.barrier_all().unwrap();
    let mut params = [peer, out, bytes as u64];
    let mut ptrs: Vec<*mut c_void> = params.iter_mut().map(|p| (p as *mut u64).cast()).collect();
    xcall_core::cuda::with_context(device, |_| {
        // SAFETY: matches peer_read's signature; both ranges are `bytes`.
        unsafe {
            xcall_core::cuda::launch_raw(
                &f,
                xcall_core::cuda::Launch::linear(64, 256, raw.cast()),
                &mut ptrs,
            )
        }
        .map_err(|e| xcall_core::cuda::driver_error("launch", device, e))
    })
    .unwrap();
    s.synchronize().unwrap();
    let want: Vec<u8> = random(77 + right as u64, bytes)
        .iter()
        .map(|b| b.wrapping_add(1))
        .collect();
    assert!(
        read_own(w, out, bytes) == want,
        "rank {rank}: kernel through the peer pointer"
    );
    w.barrier_all().unwrap();
    w.free(out).unwrap();
    w.free(sig).unwrap();
    w.free(buf).unwrap();
}

/// Rank `rank`'s world: PEs that are threads take a GPU each; processes
/// (`socket`) take GPU `rank` mod the machine's GPUs, sharing one where
/// there are fewer (CUDA IPC maps a heap of the same GPU too).
fn config(socket: Option<&str>, rank: usize, n: usize) -> WorldConfig {
    let mut c = match socket {
        Some(p) => WorldConfig::unix_socket(p, rank, n, xcall_core::testing::process_gpu(rank)),
        None => WorldConfig::in_process("cuda-spmt", rank, n, Device::cuda(rank as u32)),
    };
    c.heap_bytes = Some(64 << 20);
    c.timeout = Duration::from_secs(30);
    c
}

#[test]
fn one_gpu_world_of_one_pe() {
    let _serial = serial();
    if cuda_devices_or_skip("shmem cuda one pe").is_none() {
        return;
    }
    let mut w = World::new();
    let mut c = WorldConfig::in_process("cuda-one", 0, 1, Device::cuda(0));
    c.heap_bytes = Some(32 << 20);
    c.timeout = Duration::from_millis(500);
    w.init(&c).unwrap();
    exchange(&mut w, 0, 1);
    // Host memory is not a symmetric address.
    let x = [0u8; 8];
    // SAFETY: `x` has 8 bytes.
    let e = unsafe { w.put(x.as_ptr() as u64, x.as_ptr() as u64, 8, 0) }.unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(w.finalize().unwrap().leaked.is_empty());
    // init / finalize cycles on a GPU.
    for _ in 0..20 {
        w.init(&c).unwrap();
        let a = w.malloc(1 << 20).unwrap();
        w.barrier_all().unwrap();
        w.free(a).unwrap();
        w.finalize().unwrap();
    }
}

#[test]
fn two_gpus_one_process() {
    let _serial = serial();
    if !two_gpus("shmem cuda spmt") {
        return;
    }
    run_threads("cuda spmt", 2, watchdog(), |rank| {
        let mut w = World::new();
        w.init(&config(None, rank, 2)).unwrap();
        exchange(&mut w, rank, 2);
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

#[test]
fn two_processes() {
    let _serial = serial();
    if let Ok(spec) = std::env::var(PE_ENV) {
        let mut w = World::new();
        w.init(&config(Some(&spec), 1, 2)).unwrap();
        exchange(&mut w, 1, 2);
        assert!(w.finalize().unwrap().leaked.is_empty());
        return;
    }
    if xcall_core::testing::gpus_for_processes("shmem cuda multi-process", 2).is_none() {
        return;
    }
    let socket = std::env::temp_dir().join(format!("xcall-cuda-{}.sock", std::process::id()));
    let socket = socket.to_str().unwrap().to_string();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "two_processes", "--nocapture"])
        .env(PE_ENV, &socket)
        .spawn()
        .unwrap();
    let mut w = World::new();
    w.init(&config(Some(&socket), 0, 2)).unwrap();
    exchange(&mut w, 0, 2);
    assert!(w.finalize().unwrap().leaked.is_empty());
    assert_eq!(
        xcall_core::testing::wait_children("rank 1 (child process)", vec![child], watchdog()),
        [true],
        "rank 1 (child process) failed"
    );
}

#[test]
fn barrier_on_stream_reports_a_pe_that_never_arrives() {
    let _serial = serial();
    if !two_gpus("shmem cuda barrier timeout") {
        return;
    }
    // Rank 1 skips the barrier kernel and waits (outside the world) until
    // rank 0 saw the timeout, so the bootstrap never times out here.
    let seen = Arc::new(std::sync::Barrier::new(2));
    run_threads("cuda barrier timeout", 2, watchdog(), move |rank| {
        let mut w = World::new();
        let mut c = config(None, rank, 2);
        c.bootstrap = xcall_shmem::BootstrapKind::InProcess {
            group: "cuda-late".into(),
        };
        c.timeout = Duration::from_millis(300);
        w.init(&c).unwrap();
        let (_ctx, s) = stream(Device::cuda(rank as u32));
        if rank == 0 {
            w.barrier_on_stream(s.cu_stream().cast()).unwrap();
            s.synchronize().unwrap();
            let e = w.quiet().unwrap_err();
            assert_eq!(e.status(), Status::Timeout);
            assert!(e.to_string().contains("rank 1 did not arrive"), "{e}");
        }
        seen.wait();
        w.barrier_all().unwrap();
        w.finalize().unwrap();
    });
}

/// Writes `bytes` (host memory) to device memory at `addr` of device 0
/// from the calling thread, through the driver.
fn write_from_thread(ctx: &Arc<CudaContext>, addr: u64, bytes: &[u8]) {
    ctx.bind_to_thread().unwrap();
    // SAFETY: `addr` is `bytes.len()` bytes of a live heap allocation of
    // this device; `bytes` is live host memory.
    unsafe { xcall_core::cuda::copy_htod_sync(xcall_core::Device::cuda(0), addr, bytes) }.unwrap();
}

#[test]
fn wait_until_on_stream_orders_the_stream_and_gives_up_after_the_timeout() {
    let _serial = serial();
    if cuda_devices_or_skip("shmem cuda stream wait").is_none() {
        return;
    }
    run_threads("cuda stream wait", 1, watchdog(), |_| {
        let timeout = Duration::from_millis(400);
        let mut w = World::new();
        let mut c = WorldConfig::in_process("cuda-wait", 0, 1, Device::cuda(0));
        c.heap_bytes = Some(32 << 20);
        c.timeout = timeout;
        w.init(&c).unwrap();
        let (ctx, s) = stream(Device::cuda(0));
        let raw: *mut c_void = s.cu_stream().cast();
        let bytes = 1 << 20;
        let sig = w.malloc(8).unwrap();
        let src = w.malloc(bytes).unwrap();
        let dst = w.malloc(bytes).unwrap();
        let zero = 0u64;
        // SAFETY: 8 bytes of a live local.
        unsafe { w.put(sig, &zero as *const u64 as u64, 8, 0) }.unwrap();
        let poison = vec![0xeeu8; bytes];
        for a in [src, dst] {
            // SAFETY: `poison` has `bytes` bytes.
            unsafe { w.put(a, poison.as_ptr() as u64, bytes, 0) }.unwrap();
        }

        // A signal set from another thread releases the stream, and the
        // copy after the wait sees the data written before the signal.
        let data = random(71, bytes);
        let started = std::time::Instant::now();
        w.wait_until_on_stream(sig, Cmp::Ge, 3, raw).unwrap();
        // SAFETY: `src` and `dst` are `bytes` bytes of this PE's heap.
        unsafe { w.put_nbi(dst, src, bytes, 0, raw) }.unwrap();
        let setter = {
            let (ctx, data) = (ctx.clone(), data.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                write_from_thread(&ctx, src, &data);
                write_from_thread(&ctx, sig, &5u64.to_ne_bytes());
            })
        };
        s.synchronize().unwrap();
        setter.join().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(100));
        w.quiet().unwrap();
        assert!(
            read_own(&mut w, dst, bytes) == data,
            "the copy ran before the wait held"
        );

        // A value that never comes: the stream goes on after the timeout
        // and quiet reports it, once.
        let started = std::time::Instant::now();
        w.wait_until_on_stream(sig, Cmp::Eq, 9, raw).unwrap();
        // SAFETY: as above.
        unsafe { w.put_nbi(dst, src, bytes, 0, raw) }.unwrap();
        s.synchronize().unwrap();
        let waited = started.elapsed();
        assert!(
            waited >= timeout,
            "gave up after {waited:?}, before the timeout"
        );
        let e = w.quiet().unwrap_err();
        assert_eq!(e.status(), Status::Timeout, "{e}");
        assert!(e.to_string().contains("the signal did not hold"), "{e}");
        w.quiet().unwrap();

        // The word (5) holds for >= 5 and == 5, not for == 4; Ge is
        // unsigned, as on Host.
        for (cmp, v, holds) in [
            (Cmp::Ge, 5, true),
            (Cmp::Eq, 5, true),
            (Cmp::Eq, 4, false),
            (Cmp::Ge, u64::MAX, false),
        ] {
            w.wait_until_on_stream(sig, cmp, v, raw).unwrap();
            s.synchronize().unwrap();
            assert_eq!(w.quiet().is_ok(), holds, "{cmp:?} {v}");
        }
        // A wait leaves the word as it was.
        assert_eq!(read_own(&mut w, sig, 8), 5u64.to_ne_bytes());
        // Only Eq and Ge run on a stream.
        let e = w.wait_until_on_stream(sig, Cmp::Ne, 1, raw).unwrap_err();
        assert_eq!(e.status(), Status::Unsupported);
        for a in [sig, src, dst] {
            w.free(a).unwrap();
        }
        assert!(w.finalize().unwrap().leaked.is_empty());
    });
}

/// Two processes on device 0 (IPC within one GPU): rank 1 lists the
/// segment rank 0 waits for on its stream (the lists agree), but its own
/// stream holds the copy back past rank 0's timeout. Rank 0's stream goes
/// on after the timeout, quiet reports it, and the world is failed for
/// both (the exchange counts are off).
#[test]
fn an_exchange_on_the_stream_fails_the_world_when_a_sender_never_comes() {
    let _serial = serial();
    let config = |socket: &str, rank: usize| {
        let mut c = WorldConfig::unix_socket(socket, rank, 2, Device::cuda(0));
        c.heap_bytes = Some(16 << 20);
        c.timeout = Duration::from_millis(500);
        c
    };
    // The child (rank 1) runs only this test, with the socket in PE_ENV.
    if let Ok(socket) = std::env::var(PE_ENV) {
        let mut c = config(&socket, 1);
        // Rank 1's own stream waits hold for 1.5 s, past rank 0's 500 ms.
        c.timeout = Duration::from_millis(1500);
        let mut w = World::new();
        w.init(&c).unwrap();
        let buf = w.malloc(4096).unwrap();
        let zero = 0u64;
        // SAFETY: `zero` is 8 readable bytes; `buf` this PE's object.
        unsafe { w.put(buf, &zero as *const u64 as u64, 8, 1) }.unwrap();
        let (_ctx, s) = stream(Device::cuda(0));
        let raw: *mut c_void = s.cu_stream().cast();
        // A wait that never holds keeps the stream until rank 1's timeout;
        // the exchange's copy and signal queue behind it.
        w.wait_until_on_stream(buf, Cmp::Eq, 1, raw).unwrap();
        let outgoing = [xcall_shmem::Outgoing {
            pe: 0,
            src: buf,
            dest: buf,
            bytes: 4096,
        }];
        // SAFETY: `buf` is this PE's object of 4096 bytes, alive until
        // the stream is synchronized below.
        unsafe { w.exchange_on_stream(&outgoing, &[], raw) }.unwrap();
        // Wait (polling the state page) until rank 0 fails the world.
        let deadline = std::time::Instant::now() + watchdog();
        let e = loop {
            match w.wait_until(buf, Cmp::Eq, 1) {
                Err(e) if e.status() == Status::Timeout => {}
                r => break r.unwrap_err(),
            }
            assert!(
                std::time::Instant::now() < deadline,
                "watchdog: rank 0 never failed the world"
            );
        };
        assert_eq!(e.status(), Status::PeerFailed, "{e}");
        assert!(
            e.to_string().contains("rank 0 timed out in an exchange"),
            "{e}"
        );
        s.synchronize().unwrap();
        assert_eq!(w.finalize().unwrap_err().status(), Status::PeerFailed);
        return;
    }
    if cuda_devices_or_skip("shmem cuda exchange timeout").is_none() {
        return;
    }
    let socket =
        std::env::temp_dir().join(format!("xcall-cuda-silent-{}.sock", std::process::id()));
    let socket = socket.to_str().unwrap().to_string();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_exchange_on_the_stream_fails_the_world_when_a_sender_never_comes",
            "--nocapture",
        ])
        .env(PE_ENV, &socket)
        .spawn()
        .unwrap();
    // Rank 0 under a watchdog: a stream wait that cannot time out would
    // hang its synchronize.
    let rank0 = {
        let socket = socket.clone();
        std::panic::catch_unwind(move || {
            run_threads("cuda exchange timeout", 1, watchdog(), move |_| {
                let mut w = World::new();
                w.init(&config(&socket, 0)).unwrap();
                let buf = w.malloc(4096).unwrap();
                let (_ctx, s) = stream(Device::cuda(0));
                let raw: *mut c_void = s.cu_stream().cast();
                let incoming = [xcall_shmem::Incoming {
                    pe: 1,
                    dest: buf,
                    bytes: 4096,
                }];
                // SAFETY: nothing goes out.
                unsafe { w.exchange_on_stream(&[], &incoming, raw) }.unwrap();
                s.synchronize().unwrap();
                let e = w.quiet().unwrap_err();
                assert_eq!(e.status(), Status::Timeout, "{e}");
                assert!(
                    e.to_string().contains("PE 1's segments did not land"),
                    "{e}"
                );
                // Nothing more crosses: a later exchange could take stale
                // counts.
                // SAFETY: nothing goes out.
                let e = unsafe { w.exchange_on_stream(&[], &incoming, raw) }.unwrap_err();
                assert_eq!(e.status(), Status::PeerFailed, "{e}");
                // Rank 1's held-back copy lands in this heap once its
                // stream goes on (1.5 s after its exchange): keep the heap
                // until then.
                std::thread::sleep(Duration::from_secs(3));
                assert_eq!(w.finalize().unwrap_err().status(), Status::PeerFailed);
            })
        })
    };
    if let Err(p) = rank0 {
        let _ = child.kill();
        std::panic::resume_unwind(p);
    }
    assert_eq!(
        xcall_core::testing::wait_children("rank 1 (child process)", vec![child], watchdog()),
        [true],
        "rank 1 (child process) failed"
    );
}
