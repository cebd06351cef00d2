// Bulk copies (cp.async.bulk, sm_90 and newer) between global and shared
// memory. Needs the mbarrier helpers (MBARRIER) before it. Sizes and
// addresses are multiples of 16 bytes. Part of
// xcall_core::cuda::device::BULK_COPY.
#ifndef XCALL_BULK_COPY_CUH
#define XCALL_BULK_COPY_CUH
// Copies `bytes` from global `src` to shared `dst`; completes as `bytes`
// of transactions on the barrier `bar` (which must expect them).
__device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// mbar_arrive_expect_tx for `bytes`, then bulk_load of them.
__device__ __forceinline__ void bulk_load_arrive(u32 dst, const void *src, u32 bytes, u32 bar) {
    mbar_arrive_expect_tx(bar, bytes);
    bulk_load(dst, src, bytes, bar);
}
// Copies `bytes` from shared `src` to global `dst`, in the current bulk
// group (see bulk_commit / bulk_wait_read / bulk_wait).
__device__ __forceinline__ void bulk_store(void *dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// Closes the current bulk group.
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most N bulk groups still read their shared memory.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
// Waits until at most N bulk groups are still in flight.
template <int N> __device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
#endif
