// Shared-memory barriers (mbarrier) and the async-proxy fences around them,
// sm_90 and newer. A barrier is named by its shared-memory address
// (smem_addr). Part of xcall_core::cuda::device::MBARRIER.
#ifndef XCALL_MBARRIER_CUH
#define XCALL_MBARRIER_CUH
typedef unsigned int u32;
typedef unsigned long long u64;

// The 32-bit shared-memory address of a pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void *p) {
    return (u32)__cvta_generic_to_shared(p);
}
// Sets the barrier up for `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// Invalidates the barrier (before its memory is used for anything else).
__device__ __forceinline__ void mbar_inval(u32 bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
// One arrival.
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// One arrival that also expects `bytes` more of transactions (bulk copies
// completing on the barrier) in the current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// Whether the phase of parity `parity` has completed (one try).
__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
// Makes barrier initialisation visible to the async proxy and the cluster
// (after mbar_init, before the first bulk copy that completes on it).
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Orders this thread's generic-proxy shared-memory accesses before later
// async-proxy ones (bulk copies) and the other way round.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif
