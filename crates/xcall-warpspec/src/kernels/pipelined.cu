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

extern "C" __global__ void __launch_bounds__(@THREADS@, 1) @NAME@(const WsParams p) {
@OPERANDS@    unsigned char *__restrict__ dst = p.dst;
    const u64 bytes = p.bytes;
    const float scale = p.scale;
    (void)scale;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 tid = threadIdx.x;
    if (tid == 0) {
        for (u32 i = 0; i < WARPS * STAGES; ++i) {
            mbar_init(smem_addr(smem + FULL_OFF[i]), FULL_INIT[i]);
            mbar_init(smem_addr(smem + EMPTY_OFF[i]), EMPTY_INIT[i]);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const u64 tiles = (bytes + TILE - 1) / TILE;
    if (tid < PRODUCER_THREADS) {
        @DEC@
        const u32 warp = tid / 32, lane = tid % 32;
        if (warp < WARPS && lane == 0) {
            const unsigned char *src = @SRC_SELECT@;
            PipeState st = {0u, PRODUCER_PHASE};
            for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, advance(st, STAGES)) {
                const u32 s = st.index;
                // The EMPTY barrier (release by the compute warps, acquire
                // here) orders their reads of this stage before the next bulk
                // copy into it, as in CUTLASS's TMA pipeline. A proxy fence
                // here cost ~3% bandwidth on H100 (it waits for this
                // producer's copies in flight) and changed no result.
                mbar_wait(smem_addr(smem + EMPTY_OFF[warp * STAGES + s]), st.phase);
                const u64 base = t * TILE;
                const u32 n = (u32)((bytes - base < TILE) ? bytes - base : TILE);
                const u32 bulk = n & ~15u;
                const u32 full = smem_addr(smem + FULL_OFF[warp * STAGES + s]);
                if (bulk) {
                    mbar_arrive_expect_tx(full, bulk);
                    bulk_load(smem_addr(smem + BUF_OFF[warp * STAGES + s]), src + base, bulk, full);
                } else {
                    mbar_arrive(full);
                }
            }
        }
    } else {
        @INC@
        const u32 ct = tid - PRODUCER_THREADS;
        const u32 wg = ct / 128, lt = ct % 128;
        PipeState st = {0u, CONSUMER_PHASE};
        for (u64 t = blockIdx.x; t < tiles; t += gridDim.x, advance(st, STAGES)) {
            const u32 s = st.index;
            for (u32 w = 0; w < WARPS; ++w) mbar_wait(smem_addr(smem + FULL_OFF[w * STAGES + s]), st.phase);
            const u64 base = t * TILE;
            const u32 n = (u32)((bytes - base < TILE) ? bytes - base : TILE);
            const u32 bulk = n & ~15u;
            const u32 chunks = (n + 15u) / 16u;
            for (u32 c = wg * 128u + lt; c < chunks; c += WGS * 128u) {
@VEC_PTRS@                const u32 count = (c * 16 + 16 <= n) ? @PER_VEC@u : (n - c * 16) / @ELEM@u;
                if (count == @PER_VEC@u) {
                    @CTYPE@ out[@PER_VEC@];
                    @VEC_LOADS@
                    #pragma unroll
                    for (u32 k = 0; k < @PER_VEC@u; ++k) {
@VEC_COMPUTE@                    }
                    *(uint4 *)(dst + base + c * 16) = *(const uint4 *)out;
                } else {
                    for (u32 k = 0; k < count; ++k) {
@LOADS@                        ((@CTYPE@ *)(dst + base + c * 16))[k] = @STORE@(@EXPR@);
                    }
                }
            }
            // Every compute thread releases the stage after its own reads
            // (the EMPTY count is the number of compute threads).
            for (u32 w = 0; w < WARPS; ++w) mbar_arrive(smem_addr(smem + EMPTY_OFF[w * STAGES + s]));
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
