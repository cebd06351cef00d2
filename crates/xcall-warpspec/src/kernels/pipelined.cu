// The warp-specialized kernel of one op and plan (see codegen.rs). Its
// holes (a capitalised name between at-signs) are filled from the plan
// (tables, stages, phases, register split) and the op (operands, element
// type, expression).

@TABLES@
#define STAGES @STAGES@u
#define WARPS @WARPS@u
#define WGS @WGS@u
#define PRODUCER_PHASE @PRODUCER_PHASE@u
#define CONSUMER_PHASE @CONSUMER_PHASE@u
#define TILE @TILE@ull
#define PRODUCER_THREADS @PRODUCER_THREADS@u
#define TABLE_OFF @TABLE_OFF@u

// The shared-memory address of async warp `w`'s entry at stage `s` of a
// table of offsets (FULL_OFF, EMPTY_OFF, BUF_OFF).
__device__ __forceinline__ u32 stage_addr(const unsigned char *smem, const u32 *table, u32 w, u32 s) {
    return smem_addr(smem + table[w * STAGES + s]);
}

extern "C" __global__ void __launch_bounds__(@THREADS@, 1) @NAME@(const WsParams p) {
@OPERANDS@    unsigned char *__restrict__ dst = p.dst;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 tid = threadIdx.x;
    if (tid == 0) {
        for (u32 i = 0; i < WARPS * STAGES; ++i) {
            mbar_init(smem_addr(smem + FULL_OFF[i]), FULL_INIT[i]);
            mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT[i]);
        }
        fence_mbarrier_init();
    }
    // Ragged groups: their table, past the pipeline's shared memory.
    u64 *tab = (u64 *)(smem + TABLE_OFF);
    const u32 G = p.segments * p.groups;
    if (p.rows) ragged_table(p, tab, TILE);
    __syncthreads();
    // Work items: the tiles of every scale group (one group when the op
    // has one scale) or of every ragged group; every role walks them in
    // the same order.
    const u64 group = p.group_bytes;
    const u64 tiles_per_group = (group + TILE - 1) / TILE;
    const u64 items = p.rows ? tab[3 * G] : p.bytes / group * tiles_per_group;
    if (tid < PRODUCER_THREADS) {
        @DEC@
        const u32 warp = tid / 32, lane = tid % 32;
        if (warp < WARPS && lane == 0) {
            const unsigned char *src = @SRC_SELECT@;
            PipelineState st = {0u, PRODUCER_PHASE};
            u32 g = 0;
            for (u64 i = blockIdx.x; i < items; i += gridDim.x, advance(st, STAGES)) {
                const u32 s = st.index;
                // The EMPTY barrier (release by the compute warps, acquire
                // here) orders their reads of this stage before the next bulk
                // copy into it, as in CUTLASS's TMA pipeline. A proxy fence
                // here cost ~3% bandwidth on H100 (it waits for this
                // producer's copies in flight) and changed no result.
                producer_acquire(stage_addr(smem, EMPTY_OFF, warp, s), st);
                const Item it = p.rows ? ragged_item(tab, G, i, TILE, g) : item_of(i, tiles_per_group, group, TILE);
                // The tile's whole 16-byte vectors; compute reads a tail
                // from global memory.
                const u32 bulk = it.n & ~15u;
                producer_commit(stage_addr(smem, FULL_OFF, warp, s), stage_addr(smem, BUF_OFF, warp, s), src + it.base, bulk);
            }
        }
    } else {
        @INC@
        const u32 ct = tid - PRODUCER_THREADS;
        PipelineState st = {0u, CONSUMER_PHASE};
        u32 g = 0;
        for (u64 i = blockIdx.x; i < items; i += gridDim.x, advance(st, STAGES)) {
            const u32 s = st.index;
            const Item it = p.rows ? ragged_item(tab, G, i, TILE, g) : item_of(i, tiles_per_group, group, TILE);
            const float scale = p.rows ? ragged_scale(tab, G, it.group) : p.scales ? p.scales[it.group] : p.scale;
            (void)scale;
            for (u32 w = 0; w < WARPS; ++w) consumer_wait(stage_addr(smem, FULL_OFF, w, s), st);
            // The tile's whole 16-byte vectors come from shared memory.
            const u32 vecs = it.n / 16u;
            #pragma unroll 4
            for (u32 c = ct; c < vecs; c += WGS * 128u) {
@VEC_LOADS@                float out[@PER_VEC@];
                #pragma unroll
                for (u32 k = 0; k < @PER_VEC@u; ++k) {
@VEC_VALS@                    out[k] = @EXPR@;
                }
                *(uint4 *)(dst + it.base + c * 16) = pack(out);
            }
            // A tail of less than 16 bytes (a buffer that is one group of
            // any size) is read from global memory.
            if (ct == 0) {
                for (u32 b = vecs * 16u; b < it.n; b += @ELEM@u) {
@TAIL_VALS@                    *(@CTYPE@ *)(dst + it.base + b) = @STORE@(@EXPR@);
                }
            }
            // Every compute thread releases the stage after its own reads
            // (the EMPTY count is the number of compute threads).
            for (u32 w = 0; w < WARPS; ++w) consumer_release(stage_addr(smem, EMPTY_OFF, w, s));
        }
    }
    __syncthreads();
    if (tid == 0) {
        for (u32 i = 0; i < WARPS * STAGES; ++i) {
            mbar_inval(smem_addr(smem + FULL_OFF[i]));
            mbar_inval(smem_addr(smem + EMPTY_OFF[i]));
        }
    }
}
