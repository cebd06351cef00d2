// The plain kernel of one op (the reference the pipelined kernel is
// measured against): blocks walk the same work items as the pipelined
// kernel (tiles of PLAIN_TILE bytes within each scale group), every thread
// loading its 16-byte vectors of a tile before it computes any.

#define PLAIN_THREADS 256u
#define PLAIN_VECS 2u
#define PLAIN_TILE (PLAIN_THREADS * PLAIN_VECS * 16ull)

extern "C" __global__ void __launch_bounds__(PLAIN_THREADS) @NAME@(const WsParams p) {
@OPERANDS@    unsigned char *__restrict__ dst = p.dst;
    // Ragged groups: their table (the kernel's only shared memory).
    extern __shared__ __align__(16) unsigned char smem[];
    u64 *tab = (u64 *)smem;
    const u32 G = p.segments * p.groups;
    if (p.rows) ragged_table(p, tab, PLAIN_TILE);
    const u64 group = p.group_bytes;
    const u64 tiles_per_group = (group + PLAIN_TILE - 1) / PLAIN_TILE;
    const u64 items = p.rows ? tab[3 * G] : p.bytes / group * tiles_per_group;
    u32 g = 0;
    for (u64 i = blockIdx.x; i < items; i += gridDim.x) {
        const Item it = p.rows ? ragged_item(tab, G, i, PLAIN_TILE, g) : item_of(i, tiles_per_group, group, PLAIN_TILE);
        const float scale = p.rows ? ragged_scale(tab, G, it.group) : p.scales ? p.scales[it.group] : p.scale;
        (void)scale;
        const u32 vecs = it.n / 16u;
@VEC_LOADS@        #pragma unroll
        for (u32 r = 0; r < PLAIN_VECS; ++r) {
            const u32 c = threadIdx.x + r * PLAIN_THREADS;
            if (c < vecs) {
                float out[@PER_VEC@];
                #pragma unroll
                for (u32 k = 0; k < @PER_VEC@u; ++k) {
@VEC_VALS@                    out[k] = @EXPR@;
                }
                *(uint4 *)(dst + it.base + c * 16) = pack(out);
            }
        }
        if (threadIdx.x == 0) {
            for (u32 b = vecs * 16u; b < it.n; b += @ELEM@u) {
@TAIL_VALS@                *(@CTYPE@ *)(dst + it.base + b) = @STORE@(@EXPR@);
            }
        }
    }
}
