// Helpers of every generated kernel, after xcall-core's device helpers
// (mbarrier, bulk copy, bf16 conversions): the stage walk, the four verbs
// of a pipeline stage, 16-byte vectors as floats, and the work items of a
// grouped buffer.

// A role's walk over the stages (stage index, parity waited on there): the
// Rust side's PipelineState.
struct PipelineState { u32 index, phase; };
__device__ __forceinline__ void advance(PipelineState &s, u32 stages) {
    if (++s.index == stages) { s.index = 0; s.phase ^= 1u; }
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
        bulk_load_arrive(buf, src, bytes, full);
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

// 16 bytes as floats and back: four f32, or eight bf16 (two per word,
// the lower address in the lower half).
__device__ __forceinline__ void unpack(const uint4 &q, float (&v)[4]) {
    v[0] = __uint_as_float(q.x); v[1] = __uint_as_float(q.y);
    v[2] = __uint_as_float(q.z); v[3] = __uint_as_float(q.w);
}
__device__ __forceinline__ uint4 pack(const float (&v)[4]) {
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}
__device__ __forceinline__ void unpack(const uint4 &q, float (&v)[8]) {
    bf16x2_to_f32(q.x, v[0], v[1]); bf16x2_to_f32(q.y, v[2], v[3]);
    bf16x2_to_f32(q.z, v[4], v[5]); bf16x2_to_f32(q.w, v[6], v[7]);
}
__device__ __forceinline__ uint4 pack(const float (&v)[8]) {
    return make_uint4(f32_to_bf16x2(v[0], v[1]), f32_to_bf16x2(v[2], v[3]), f32_to_bf16x2(v[4], v[5]),
                      f32_to_bf16x2(v[6], v[7]));
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
