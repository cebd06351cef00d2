// Ragged groups (WsParams.rows != 0): the buffer is `segments` segments of
// `segment_bytes`, segment s holding `groups` groups of whole rows packed
// from its start, group (s, g) of rows[s * groups + g] rows. Before any
// role starts, every thread of the block builds a table in shared memory:
// each group's first byte and length (a negative count taken as 0, groups
// cut at their segment's end), then each group's first work item (tiles of
// `tile` bytes within a group) and the item count, then each group's
// scale (read once here, not once per item).

// Inclusive sum over the warp.
__device__ __forceinline__ u64 warp_scan(u64 x, u32 lane) {
    #pragma unroll
    for (u32 o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    return x;
}

// Called by every thread of the block (it synchronizes the block three
// times). The table: base[G], len[G], first[G + 1] (G = segments *
// groups), then scale[G] (f32). Every thread first loads counts and
// scales (the counts into len), so that all of the loads are in flight at
// once; each segment's warp then scans its counts from shared memory.
__device__ void ragged_table(const WsParams p, u64 *tab, u64 tile) {
    const u32 G = p.segments * p.groups;
    u64 *base = tab, *len = tab + G, *first = tab + 2 * G;
    float *scale = (float *)(tab + 3 * G + 1);
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
    for (u32 g = threadIdx.x; g < G; g += blockDim.x) {
        len[g] = (u64)p.rows[g];
        scale[g] = p.scales[g];
    }
    __syncthreads();
    const u64 seg_rows = p.segment_bytes / p.row_bytes;
    for (u32 s = warp; s < p.segments; s += nwarps) {
        u64 carry = 0;
        for (u32 g0 = 0; g0 < p.groups; g0 += 32) {
            const u32 g = g0 + lane;
            const long long c = g < p.groups ? (long long)len[s * p.groups + g] : 0;
            const u64 n = c > 0 ? ((u64)c < seg_rows ? (u64)c : seg_rows) : 0;
            const u64 incl = warp_scan(n, lane);
            const u64 lo = carry + incl - n, hi = carry + incl;
            const u64 start = lo < seg_rows ? lo : seg_rows, end = hi < seg_rows ? hi : seg_rows;
            if (g < p.groups) {
                base[s * p.groups + g] = s * p.segment_bytes + start * p.row_bytes;
                len[s * p.groups + g] = (end - start) * p.row_bytes;
            }
            const u64 sum = carry + __shfl_sync(0xffffffffu, incl, 31);
            carry = sum < seg_rows ? sum : seg_rows;
        }
    }
    __syncthreads();
    if (warp == 0) {
        u64 carry = 0;
        for (u32 g0 = 0; g0 < G; g0 += 32) {
            const u32 g = g0 + lane;
            const u64 n = g < G ? (len[g] + tile - 1) / tile : 0;
            const u64 incl = warp_scan(n, lane);
            if (g < G) first[g] = carry + incl - n;
            carry += __shfl_sync(0xffffffffu, incl, 31);
        }
        if (lane == 0) first[G] = carry;
    }
    __syncthreads();
}

// Work item i (< first[G]) of the table, for a role whose items only
// grow: `g` holds the group of the role's previous item (0 before the
// first) and moves up to the last group whose first item is at most i (a
// group without items shares its successor's first). It gallops (steps
// of 1, 2, 4, ... while the group's first item is at most i, then halves
// back), so that staying in a group takes one load and crossing many
// small groups (a role's items are a grid apart) a few, not one per
// group. Then the tile's first byte and its length.
__device__ __forceinline__ Item ragged_item(const u64 *tab, u32 G, u64 i, u64 tile, u32 &g) {
    const u64 *base = tab, *len = tab + G, *first = tab + 2 * G;
    u32 step = 1;
    while (g + step < G && first[g + step] <= i) {
        g += step;
        step *= 2;
    }
    while (step > 1) {
        step /= 2;
        if (g + step < G && first[g + step] <= i) g += step;
    }
    Item it;
    it.group = g;
    const u64 t = i - first[g];
    it.base = base[g] + t * tile;
    const u64 left = len[g] - t * tile;
    it.n = (u32)(left < tile ? left : tile);
    return it;
}

// Group g's scale, from the table.
__device__ __forceinline__ float ragged_scale(const u64 *tab, u32 G, u64 g) {
    return ((const float *)(tab + 3 * G + 1))[g];
}
