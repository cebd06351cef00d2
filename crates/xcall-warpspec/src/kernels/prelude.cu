// Helpers of every generated kernel: the stage walk, mbarrier and bulk-copy
// wrappers, the four verbs of a pipeline stage, bf16 conversions (round to
// nearest even), 16-byte vectors as floats, and the work items of a grouped
// buffer.
typedef unsigned long long u64;
typedef unsigned int u32;

// A role's walk over the stages (stage index, parity waited on there): the
// Rust side's PipelineState.
struct PipelineState { u32 index, phase; };
__device__ __forceinline__ void advance(PipelineState &s, u32 stages) {
    if (++s.index == stages) { s.index = 0; s.phase ^= 1u; }
}
__device__ __forceinline__ u32 smem_addr(const void *p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_inval(u32 bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void bulk_load(u32 dst, const void *src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The four verbs of a stage, on the shared-memory addresses of one async
// warp's FULL and EMPTY barriers (and buffer) at the state's stage.
// A producer waits until every compute thread released the stage's buffer.
__device__ __forceinline__ void producer_acquire(u32 empty, const PipelineState &st) {
    mbar_wait(empty, st.phase);
}
// A producer commits the stage: it arrives on FULL expecting the `bytes` of
// the bulk copy of `src` into `buf`, which complete on FULL as they land;
// with nothing to copy it arrives alone.
__device__ __forceinline__ void producer_commit(u32 full, u32 buf, const void *src, u32 bytes) {
    if (bytes) {
        mbar_arrive_expect_tx(full, bytes);
        bulk_load(buf, src, bytes, full);
    } else {
        mbar_arrive(full);
    }
}
// A compute thread waits until the stage's data landed.
__device__ __forceinline__ void consumer_wait(u32 full, const PipelineState &st) {
    mbar_wait(full, st.phase);
}
// A compute thread releases the stage after its own reads (the EMPTY
// barrier counts every compute thread).
__device__ __forceinline__ void consumer_release(u32 empty) {
    mbar_arrive(empty);
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}
// Round to nearest even in one instruction (sm_80+); a NaN becomes the
// canonical NaN 0x7fff.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// 16 bytes as floats and back: four f32, or eight bf16 (two per word,
// the lower address in the lower half).
__device__ __forceinline__ void unpack(const uint4 &q, float (&v)[4]) {
    v[0] = __uint_as_float(q.x); v[1] = __uint_as_float(q.y);
    v[2] = __uint_as_float(q.z); v[3] = __uint_as_float(q.w);
}
__device__ __forceinline__ uint4 pack(const float (&v)[4]) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
__device__ __forceinline__ void unpack_word(u32 w, float &lo, float &hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack(const uint4 &q, float (&v)[8]) {
    unpack_word(q.x, v[0], v[1]); unpack_word(q.y, v[2], v[3]);
    unpack_word(q.z, v[4], v[5]); unpack_word(q.w, v[6], v[7]);
}
__device__ __forceinline__ u32 pack_word(float lo, float hi) {
    u32 w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}
__device__ __forceinline__ uint4 pack(const float (&v)[8]) {
    return make_uint4(pack_word(v[0], v[1]), pack_word(v[2], v[3]), pack_word(v[4], v[5]), pack_word(v[6], v[7]));
}

// Work item `i` of a buffer cut into groups of `group` bytes (each with
// its own scale), each group into tiles of `tile` bytes: the group, the
// tile's first byte and its length (shorter at a group's end).
struct Item { u64 group, base; u32 n; };
__device__ __forceinline__ Item item_of(u64 i, u64 tiles_per_group, u64 group, u64 tile) {
    Item it;
    it.group = i / tiles_per_group;
    const u64 t = i - it.group * tiles_per_group;
    it.base = it.group * group + t * tile;
    const u64 left = group - t * tile;
    it.n = (u32)(left < tile ? left : tile);
    return it;
}
