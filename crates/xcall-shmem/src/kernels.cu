// CUDA kernels of xcall-shmem, compiled at run time with NVRTC after the
// generated parameter structs (cuda.rs: u64, BarrierParams, WaitParams,
// SignalParams).

__device__ __forceinline__ u64 load_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// One block. Thread i tells PE i that this PE arrived (writes the new epoch
// into slot `rank` of PE i's arrival words), then waits until PE i did the
// same here. The epoch lives in device memory, so a captured graph of this
// kernel replays correctly. A PE that does not arrive within timeout_ns
// sets error_word to 1 + its rank and the kernel returns (the Host reports
// it at the next quiet or barrier_all).
extern "C" __global__ void xcall_shmem_barrier(BarrierParams p) {
    u64* const* peer_arrivals = p.peer_arrivals;
    const u64* my_arrivals = p.my_arrivals;
    const long long rank = p.rank, n = p.n;
    __shared__ u64 epoch;
    if (threadIdx.x == 0) epoch = *p.epoch_word + 1;
    __syncthreads();
    const u64 e = epoch;
    __threadfence_system();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) store_release(peer_arrivals[i] + rank, e);
    const u64 start = now_ns();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        while ((long long)(load_acquire(my_arrivals + i) - e) < 0) {
            if (now_ns() - start > p.timeout_ns) {
                atomicCAS(p.error_word, 0ull, (u64)(1 + i));
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) *p.epoch_word = e;
    __threadfence_system();
}

// Sets (op 0) or adds to (op 1) a 64-bit signal word, after every earlier
// write of the stream is visible system-wide.
extern "C" __global__ void xcall_shmem_signal(SignalParams p) {
    __threadfence_system();
    if (p.op == 0) store_release(p.signal, p.value);
    else atomicAdd_system(p.signal, p.value);
}

// Waits until *signal == value (eq) or >= value, then adds `take` to it
// (0: nothing). A word that does not hold within timeout_ns sets
// error_word to `code` (unless an earlier error is there) and the kernel
// returns without taking anything: the stream goes on, and the Host
// reports the timeout at the next quiet or barrier_all.
extern "C" __global__ void xcall_shmem_wait(WaitParams p) {
    if (threadIdx.x != 0) return;
    const u64 start = now_ns();
    for (;;) {
        const u64 v = load_acquire(p.signal);
        if (p.eq ? v == p.value : v >= p.value) break;
        if (now_ns() - start > p.timeout_ns) {
            atomicCAS(p.error_word, 0ull, p.code);
            return;
        }
        __nanosleep(200);
    }
    if (p.take != 0) atomicAdd_system((u64*)p.signal, p.take);
    __threadfence_system();
}
