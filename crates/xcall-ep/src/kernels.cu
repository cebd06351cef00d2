// Over 700 lines: one NVRTC program, whose steps and the two low-latency kernels share the phase, push, copy and reduce device functions.
// The expert-parallel steps on CUDA; each mirrors the function of the
// same name in host.rs (same order, same arithmetic: products and sums
// rounded separately, never fused, so a Host run matches bit for bit),
// but for where a pulled dispatch (p.pull) reads peers' rows: their send
// rows here, their `x` on Host (host_pull.rs); the bytes are the same.
// Every kernel takes EpParams (defined before this file by cuda.rs), and
// CONVERT (bf16 / fp8 conversions) comes first.
//
// Peers' memory is reached through p.bases (direct pointers: peer access
// inside a process, CUDA IPC across processes). A phase is announced with
// a system-scope release store of the PE's epoch into every PE's ready
// word for it, after a system-scope fence; a wait is an acquire load
// spinning until every PE's word reaches the epoch, giving up after
// p.timeout_ns (the PE's error word then names the peer).

#define EP_TILE 16
#define EP_FP8_BLOCK 128
#define EP_WORD_TOKENS 0
#define EP_WORD_EPOCH 1
#define EP_WORD_ERROR 2
#define EP_WORD_DROPPED 3
#define EP_WORD_BAR 4
#define EP_WORD_PULL 5
#define EP_MAX_PES 64
// The exchange kernels work on items of one token's 32 * EP_UNROLL
// 16-byte chunks: a warp per item, EP_UNROLL chunks per lane in flight.
#define EP_UNROLL 4
// FP8 publish: blocks of 128 elements a warp has in flight.
#define EP_PUB_UNROLL 4

typedef unsigned long long u64;
typedef long long i64;

// FP8 needs sm_89 or newer; the group refuses FP8 on older devices.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define EP_FP8 1
#else
#define EP_FP8 0
#endif

__device__ __forceinline__ unsigned char *ep_at(const EpParams &p, int q, i64 off) {
    return (unsigned char *)(q < 0 ? (u64)p.base : p.bases[q]) + off;
}
__device__ __forceinline__ u64 *ep_words(const EpParams &p) {
    return (u64 *)(p.base + p.off_words);
}
__device__ __forceinline__ u64 ep_load_acquire(const u64 *a) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
    return v;
}
__device__ __forceinline__ void ep_store_release(u64 *a, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ uint4 ep_load_peer(const void *a) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(a));
    return v;
}
__device__ __forceinline__ float ep_load(int prec, const unsigned char *row, i64 i) {
    return prec == 0 ? ((const float *)row)[i] : bf16_to_f32(((const unsigned short *)row)[i]);
}
__device__ __forceinline__ void ep_store(int prec, unsigned char *row, i64 i, float v) {
    if (prec == 0) ((float *)row)[i] = v;
    else ((unsigned short *)row)[i] = f32_to_bf16(v);
}
// The first error wins: kind << 32 | (1 + rank).
__device__ __forceinline__ void ep_error(const EpParams &p, u64 kind, i64 rank) {
    atomicCAS(ep_words(p) + EP_WORD_ERROR, 0ull, (kind << 32) | (u64)(rank + 1));
}

__device__ void ep_publish_routing(const EpParams &p);

#if EP_FP8
// A block's eight quotients v / scale as fp8.rs's fp8_divide_by computes
// them: from the scale's reciprocal, a product and one fused correction,
// which a Host test shows equal to the division for every bf16 element of
// a block wherever fp8 does not round it to zero (and in the fp8 byte
// always). A scale below 2^-80 is scaled by 2^64 first (exactly, with the
// elements), so that the correction's remainder stays a normal f32; an
// infinite scale (a block holding an infinity) divides.
__device__ __forceinline__ void ep_quotients(float scale, const float *v, float *q) {
    if (!(scale <= 3.40282347e38f)) {
        for (int e = 0; e < 8; ++e) q[e] = __fdiv_rn(v[e], scale);
        return;
    }
    const float k = scale < 0x1p-80f ? 0x1p64f : 1.0f;
    const float s = __fmul_rn(scale, k), inv = __frcp_rn(s);
    for (int e = 0; e < 8; ++e) {
        const float a = __fmul_rn(fabsf(v[e]), k), q0 = __fmul_rn(a, inv);
        q[e] = copysignf(__fmaf_rn(__fmaf_rn(-s, q0, a), inv, q0), v[e]);
    }
}
#endif

// publish: the rows peers read from the send buffer (FP8: quantized
// there, a scale per 128 elements; combine_backward: the output gradient,
// which peers pull), then the routing, one warp per token (lane j: slot j).
__device__ void ep_publish_body(const EpParams &p) {
    const i64 h = p.hidden, n = p.n;
    const bool fp8 = p.wire && p.precision == 2;
    const int elem = p.precision == 0 ? 4 : 2;
    unsigned char *send = p.base + p.off_send;
    if (fp8) {
#if EP_FP8
        // A block per token; each half-warp takes a block of 128 elements
        // of its row (8 a lane, in one 16-byte load: x is 16-byte aligned,
        // H a multiple of 128), so a warp takes two neighbouring blocks;
        // EP_PUB_UNROLL of the warp's pairs are loaded before any is
        // reduced.
        float *scales = (float *)(p.base + p.off_send_scales);
        const i64 nb = h / EP_FP8_BLOCK, nw = blockDim.x / 32;
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int half = lane / 16, hl = lane % 16;
        for (i64 t = blockIdx.x; t < n; t += gridDim.x) {
            const unsigned char *row = p.src + t * h * 2;
            // Pair u of the warp: blocks p0 + 2 * nw * u and the one after.
            for (i64 p0 = 2 * warp; p0 < nb; p0 += 2 * nw * EP_PUB_UNROLL) {
                uint4 raw[EP_PUB_UNROLL];
#pragma unroll
                for (int u = 0; u < EP_PUB_UNROLL; ++u) {
                    const i64 b = p0 + u * 2 * nw + half;
                    if (b < nb) raw[u] = ((const uint4 *)(row + (b * EP_FP8_BLOCK + hl * 8) * 2))[0];
                }
#pragma unroll
                for (int u = 0; u < EP_PUB_UNROLL; ++u) {
                    // The warp goes on while its pair's first block is in
                    // the row; a half past the row's end reduces zeros
                    // and stores nothing.
                    if (p0 + u * 2 * nw >= nb) break;
                    const i64 b = p0 + u * 2 * nw + half;
                    const bool in = b < nb;
                    float v[8], amax = 0.0f;
                    if (in) {
                        bf16x2_to_f32(raw[u].x, v[0], v[1]);
                        bf16x2_to_f32(raw[u].y, v[2], v[3]);
                        bf16x2_to_f32(raw[u].z, v[4], v[5]);
                        bf16x2_to_f32(raw[u].w, v[6], v[7]);
                        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
                    }
                    for (int o = 8; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
                    if (!in) continue;
                    const float scale = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
                    if (hl == 0) scales[t * nb + b] = scale;
                    float q[8];
                    ep_quotients(scale, v, q);
                    unsigned int w[4];
                    for (int e = 0; e < 4; ++e) w[e] = f32x2_to_fp8e4m3x2(q[2 * e], q[2 * e + 1]);
                    const unsigned int lo = w[0] | w[1] << 16, hi = w[2] | w[3] << 16;
                    ((uint2 *)(send + t * h + b * EP_FP8_BLOCK))[hl] = make_uint2(lo, hi);
                }
            }
        }
#endif
    } else if ((!p.wire || p.pull == 1) && p.src != send) {
        // Pushed, dispatch stores f32 and bf16 rows from the caller's
        // buffer: no copy; nor for rows the caller wrote into the send
        // buffer itself, or that peers read in place (p.pull == 2).
        // Pulled, peers read them from the send buffer.
        for (i64 t = blockIdx.x; t < n; t += gridDim.x) {
            const uint4 *s = (const uint4 *)(p.src + t * h * elem);
            uint4 *d = (uint4 *)(send + t * h * elem);
            for (i64 c = threadIdx.x; c < h * elem / 16; c += blockDim.x) d[c] = s[c];
        }
    }
    // Pulled, where peers read this PE's rows: the caller's buffer
    // (p.pull == 2), or the send buffer (0).
    if (p.wire && p.pull && blockIdx.x == 0 && threadIdx.x == 0)
        ep_words(p)[EP_WORD_PULL] = p.pull == 2 ? (u64)p.src : 0;
    if (p.src_ids != 0) ep_publish_routing(p);
}
extern "C" __global__ void __launch_bounds__(256) ep_publish(EpParams p) { ep_publish_body(p); }

// The routing part of publish: one warp per token (lane j: slot j); ids
// outside -1..E or repeated within a token become -1 (and an error); then
// the count peers read.
__device__ void ep_publish_routing(const EpParams &p) {
    const i64 n = p.n, k = p.topk;
    int *ids = (int *)(p.base + p.off_ids);
    float *probs = (float *)(p.base + p.off_probs);
    const int lane = threadIdx.x % 32;
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    for (i64 t = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; t < n; t += warps) {
        // Lanes past k hold ids no slot can (-2 - lane).
        const int id = lane < k ? p.src_ids[t * k + lane] : -2 - lane;
        const unsigned same = __match_any_sync(0xffffffffu, id);
        const bool repeated = (same & ((1u << lane) - 1)) != 0;
        const bool ok = id == -1 || (id >= 0 && id < p.experts && !repeated);
        if (lane < k) {
            ids[t * k + lane] = ok ? id : -1;
            probs[t * k + lane] = p.src_probs[t * k + lane];
        }
        if (__any_sync(0xffffffffu, lane < k && !ok) && lane == 0) ep_error(p, 2, p.rank);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) ep_words(p)[EP_WORD_TOKENS] = (u64)n;
}

// One item of push: slice `grp` of this PE's token t (its rows, FP8: and
// scales) stored once into the receive rows of each other PE hosting one
// of its experts.
__device__ __forceinline__ void ep_push_item(const EpParams &p, i64 t, i64 grp) {
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, h = p.hidden;
    const bool fp8 = p.precision == 2;
    const int elem = p.precision == 0 ? 4 : 2;
    const i64 wire_row = fp8 ? h : h * elem;
    const i64 chunks = wire_row / 16;
    const int *ids = (const int *)(p.base + p.off_ids);
    const unsigned char *src = fp8 ? p.base + p.off_send : p.src;
    const int id = lane < k ? ids[t * k + lane] : -1;
    u64 mask = id >= 0 && id < p.experts ? 1ull << (id / p.local_experts) : 0ull;
    for (int o = 16; o > 0; o /= 2) mask |= __shfl_xor_sync(0xffffffffu, mask, o);
    mask &= ~(1ull << p.rank);
    if (mask == 0) return;
    const i64 c0 = grp * 32 * EP_UNROLL + lane;
    const uint4 *row = (const uint4 *)(src + t * wire_row);
    uint4 v[EP_UNROLL];
#pragma unroll
    for (int u = 0; u < EP_UNROLL; ++u)
        if (c0 + 32 * u < chunks) v[u] = row[c0 + 32 * u];
    const i64 blocks = h / EP_FP8_BLOCK;
    // Each PE starts with the next rank up, so the PEs' stores spread
    // over the destinations.
    const u64 rot = ((p.rank + 1 < 64 ? mask >> (p.rank + 1) : 0ull) | (mask << (p.pes - p.rank - 1))) & (p.pes == 64 ? ~0ull : (1ull << p.pes) - 1);
    for (u64 m = rot; m; m &= m - 1) {
        const int q = (int)((__ffsll((long long)m) - 1 + p.rank + 1) % p.pes);
        uint4 *d = (uint4 *)(ep_at(p, q, p.off_recv) + ((i64)p.rank * T + t) * wire_row);
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            if (c0 + 32 * u < chunks) d[c0 + 32 * u] = v[u];
        if (fp8) {
            const i64 b0 = grp * 32 * EP_UNROLL / 8, b1 = b0 + 32 * EP_UNROLL / 8;
            const float *sc = (const float *)(p.base + p.off_send_scales) + t * blocks;
            float *ds = (float *)(ep_at(p, q, p.off_recv_scales)) + ((i64)p.rank * T + t) * blocks;
            for (i64 b = b0 + lane; b < b1 && b < blocks; b += 32) ds[b] = sc[b];
        }
    }
}

// Items of a row of `chunks` 16-byte chunks: a warp moves 32 * EP_UNROLL.
__device__ __forceinline__ i64 ep_items(i64 chunks) {
    return (chunks + 32 * EP_UNROLL - 1) / (32 * EP_UNROLL);
}

// Items of one token's rows on the wire.
__device__ __forceinline__ i64 ep_groups(const EpParams &p) {
    const i64 wire_row = p.precision == 2 ? p.hidden : p.hidden * (p.precision == 0 ? 4 : 2);
    return ep_items(wire_row / 16);
}

// push: per item of one of this PE's tokens (a 32 * EP_UNROLL-chunk
// slice), ep_push_item.
extern "C" __global__ void __launch_bounds__(512) ep_push(EpParams p) {
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const i64 groups = ep_groups(p);
    for (i64 item = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < p.n * groups; item += warps)
        ep_push_item(p, item / groups, item % groups);
}

// signal: one block, thread q announces to PE q.
extern "C" __global__ void __launch_bounds__(64) ep_signal(EpParams p) {
    __shared__ u64 epoch;
    if (threadIdx.x == 0) epoch = ep_words(p)[EP_WORD_EPOCH] + 1;
    __syncthreads();
    __threadfence_system();
    if (threadIdx.x < p.pes) ep_store_release((u64 *)(ep_at(p, threadIdx.x, p.off_ready)) + p.rank, epoch);
    __syncthreads();
    if (threadIdx.x == 0) ep_words(p)[EP_WORD_EPOCH] = epoch;
}

// wait: one block, thread s waits for PE s.
// The wait of a phase, by one block (thread s waits for PE s): the kernels
// that read what peers wrote in the phase begin with it, so no kernel of
// its own runs between them and the announcement (`ep_wait` is the same
// wait alone, for an empty phase).
__device__ void ep_await_epoch(const EpParams &p, u64 epoch) {
    if (threadIdx.x < p.pes) {
        const u64 *ready = (const u64 *)(p.base + p.off_ready) + threadIdx.x;
        u64 started_ns;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(started_ns));
        while (ep_load_acquire(ready) < epoch) {
            u64 now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - started_ns > p.timeout_ns) {
                ep_error(p, 1, threadIdx.x);
                break;
            }
            __nanosleep(64);
        }
    }
    __syncthreads();
    __threadfence_system();
}
__device__ void ep_await(const EpParams &p) { ep_await_epoch(p, ep_words(p)[EP_WORD_EPOCH]); }

// wait: one block.
extern "C" __global__ void __launch_bounds__(64) ep_wait(EpParams p) { ep_await(p); }

// count: one warp per tile of one sender; lane = token of the tile.
extern "C" __global__ void __launch_bounds__(256) ep_count(EpParams p) {
    ep_await(p);
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, L = p.local_experts;
    const i64 tiles = p.pes * p.tiles_per_pe;
    int *local = (int *)(p.base + p.off_local);
    float *probs = (float *)(p.base + p.off_recv_probs);
    int *counts = (int *)(p.base + p.off_tile_counts);
    for (i64 tile = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; tile < tiles; tile += warps) {
        const int s = (int)(tile / p.tiles_per_pe);
        const i64 t0 = (tile % p.tiles_per_pe) * EP_TILE;
        const unsigned char *bs = ep_at(p, s, 0);
        const u64 sent = ((const volatile u64 *)(bs + p.off_words))[EP_WORD_TOKENS];
        const i64 n = sent < (u64)T ? (i64)sent : T;
        if (t0 == 0 && lane == 0) ((int *)(p.base + p.off_sent))[s] = (int)n;
        int *c = counts + tile * L;
        for (i64 e = lane; e < L; e += 32) c[e] = 0;
        __syncwarp();
        // The tile's route slots are contiguous: read them coalesced,
        // four per lane in flight.
        const i64 t1 = t0 + EP_TILE < T ? t0 + EP_TILE : T;
        const i64 first = t0 * k, last = t1 * k, row0 = (i64)s * T * k;
        const int *ids = (const int *)(bs + p.off_ids);
        const float *pr = (const float *)(bs + p.off_probs);
        for (i64 e0 = first + lane; e0 < last; e0 += 128) {
            int id[4];
            float pv[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const i64 e = e0 + 32 * u;
                const bool live = e < last && e / k < n;
                id[u] = live ? ids[e] : -1;
                pv[u] = live ? pr[e] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const i64 e = e0 + 32 * u;
                if (e >= last) break;
                const bool mine = id[u] >= 0 && id[u] < p.experts && id[u] / L == p.rank;
                const int loc = mine ? (int)(id[u] % L) : -1;
                local[row0 + e] = loc;
                probs[row0 + e] = pv[u];
                if (loc >= 0) atomicAdd(c + loc, 1);
            }
        }
    }
}

// scan: one block per local expert: its counts over the tiles become
// each tile's first rank (a block-wide exclusive scan, each thread a run
// of consecutive tiles); its kept count and dropped routes follow.
extern "C" __global__ void __launch_bounds__(256) ep_scan(EpParams p) {
    __shared__ i64 sums[256];
    const i64 L = p.local_experts, tiles = p.pes * p.tiles_per_pe;
    int *counts = (int *)(p.base + p.off_tile_counts);
    const i64 per = (tiles + blockDim.x - 1) / blockDim.x;
    for (i64 e = blockIdx.x; e < L; e += gridDim.x) {
        const i64 t0 = threadIdx.x * per, t1 = t0 + per < tiles ? t0 + per : tiles;
        i64 mine = 0;
        for (i64 tile = t0; tile < t1; ++tile) mine += counts[tile * L + e];
        sums[threadIdx.x] = mine;
        __syncthreads();
        // Hillis-Steele inclusive scan of the runs' sums.
        for (int o = 1; o < blockDim.x; o *= 2) {
            const i64 v = threadIdx.x >= o ? sums[threadIdx.x - o] : 0;
            __syncthreads();
            sums[threadIdx.x] += v;
            __syncthreads();
        }
        i64 run = sums[threadIdx.x] - mine;
        for (i64 tile = t0; tile < t1; ++tile) {
            const int v = counts[tile * L + e];
            counts[tile * L + e] = (int)run;
            run += v;
        }
        if (threadIdx.x == blockDim.x - 1) {
            const i64 total = sums[threadIdx.x];
            const i64 kept = p.capacity > 0 && total > p.capacity ? p.capacity : total;
            if (total > kept) atomicAdd(ep_words(p) + EP_WORD_DROPPED, (u64)(total - kept));
            p.tokens_per_expert[e] = kept;
        }
        __syncthreads();
    }
}

// The experts' first rows (padded), in shared memory: a block-wide
// exclusive scan over the local experts of their kept counts rounded up
// to `align` (each thread a run of consecutive experts). Block 0 also
// writes the caller's padded counts and offsets.
#define EP_MAX_LOCAL 4096
template <class Kept> __device__ void ep_starts_of(const EpParams &p, Kept kept, i64 *start) {
    __shared__ i64 sums[512];
    const i64 L = p.local_experts;
    const i64 per = (L + blockDim.x - 1) / blockDim.x;
    const i64 e0 = threadIdx.x * per, e1 = e0 + per < L ? e0 + per : L;
    i64 mine = 0;
    for (i64 e = e0; e < e1; ++e) mine += (kept(e) + p.align - 1) / p.align * p.align;
    sums[threadIdx.x] = mine;
    __syncthreads();
    for (int o = 1; o < blockDim.x; o *= 2) {
        const i64 v = threadIdx.x >= o ? sums[threadIdx.x - o] : 0;
        __syncthreads();
        sums[threadIdx.x] += v;
        __syncthreads();
    }
    i64 next = sums[threadIdx.x] - mine;
    for (i64 e = e0; e < e1; ++e) {
        const i64 padded = (kept(e) + p.align - 1) / p.align * p.align;
        start[e] = next;
        if (blockIdx.x == 0) {
            ((i64 *)(p.base + p.off_expert_start))[e] = next;
            if (p.padded_per_expert) p.padded_per_expert[e] = padded;
            if (p.expert_offsets) p.expert_offsets[e] = next;
        }
        next += padded;
    }
    if (blockIdx.x == 0 && threadIdx.x == blockDim.x - 1 && p.expert_offsets) p.expert_offsets[L] = sums[threadIdx.x];
    __syncthreads();
}
__device__ void ep_starts(const EpParams &p, i64 *start) {
    ep_starts_of(p, [&](i64 e) { return p.tokens_per_expert[e]; }, start);
}

// assign: one warp per tile; 32 route slots at a time, in order.
extern "C" __global__ void __launch_bounds__(256) ep_assign(EpParams p) {
    __shared__ i64 start[EP_MAX_LOCAL];
    ep_starts(p, start);
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, L = p.local_experts;
    const i64 tiles = p.pes * p.tiles_per_pe;
    const int *local = (const int *)(p.base + p.off_local);
    int *rows = (int *)(p.base + p.off_route_row);
    int *counts = (int *)(p.base + p.off_tile_counts);
    for (i64 tile = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; tile < tiles; tile += warps) {
        const i64 s = tile / p.tiles_per_pe;
        const i64 t0 = (tile % p.tiles_per_pe) * EP_TILE;
        const i64 t1 = t0 + EP_TILE < T ? t0 + EP_TILE : T;
        int *c = counts + tile * L;
        const i64 first = (s * T + t0) * k, last = (s * T + t1) * k;
        for (i64 base = first; base < last; base += 32) {
            const i64 r = base + lane;
            const int loc = r < last ? local[r] : -1;
            const unsigned active = __ballot_sync(0xffffffffu, loc >= 0);
            const unsigned same = __match_any_sync(0xffffffffu, loc) & active;
            int row = -1;
            if (loc >= 0) {
                const int before = __popc(same & ((1u << lane) - 1));
                const i64 taken = (i64)c[loc] + before;
                if (p.capacity == 0 || taken < p.capacity) {
                    const i64 at = start[loc] + taken;
                    row = at < p.expert_rows ? (int)at : -1;
                }
            }
            __syncwarp();
            // The group's highest lane moves the expert's rank on.
            if (loc >= 0 && (same >> lane) == 1u) c[loc] += __popc(same);
            __syncwarp();
            if (r < last) rows[r] = row;
        }
    }
}

// A lane's route j (j < k) of route slot block `slots`: its row, or -1.
__device__ __forceinline__ int ep_route(const int *slots, i64 k, int lane) {
    return lane < k ? slots[lane] : -1;
}

// The received token (sender s, token t) of a PE's n-th turn: the PEs'
// tokens in turns, each PE's turns starting with the next rank up, so
// that at every moment the PEs' stores into (or loads from) their token's
// PE spread over all PEs instead of all going to the same one.
__device__ __forceinline__ void ep_turn(const EpParams &p, i64 n, int &s, i64 &t) {
    s = (int)((n % p.pes + p.rank + 1) % p.pes);
    t = n / p.pes;
}

// Chunks of copy: 16 bytes of the rows it writes (bf16 or f32), so the
// warp's stores are contiguous; FP8 reads 8 fp8 bytes for each 16 bytes
// of bf16 it writes.
__device__ __forceinline__ i64 ep_copy_chunks(const EpParams &p) {
    return p.precision == 2 ? p.hidden / 8 : p.hidden * (p.precision == 0 ? 4 : 2) / 16;
}
__device__ __forceinline__ i64 ep_copy_groups(const EpParams &p) {
    return ep_items(ep_copy_chunks(p));
}

// One item of copy: slice `grp` of received token `tok` (sender tok / T)
// written to each kept route's row (lane j: route j's row, or -1), in
// slot order. Pulled, `rows` are the sender's f32 or bf16 rows (see
// ep_copy).
__device__ __forceinline__ void ep_copy_item(const EpParams &p, i64 tok, i64 grp, int mine,
                                             const unsigned char *rows) {
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, h = p.hidden;
    const int elem = p.precision == 0 ? 4 : 2;
    const bool fp8 = p.precision == 2;
    const i64 chunks = ep_copy_chunks(p);
    const int s = (int)(tok / T);
    const i64 t = tok % T;
    unsigned kept = __ballot_sync(0xffffffffu, mine >= 0);
    if (kept == 0) return;
    // Pushed, peers' rows are in the receive rows; pulled, in their
    // send rows or (f32, bf16) their callers' buffers; this PE's own are
    // in the caller's buffer (FP8: the send rows).
    const bool own = s == p.rank;
    const bool pulled = !own && p.pull;
    const i64 c0 = grp * 32 * EP_UNROLL + lane;
    if (fp8) {
#if EP_FP8
        // Chunk c: fp8 elements [8c, 8c + 8), one uint2 of the fp8 row and
        // one uint4 of the bf16 row; 16 chunks a scale block.
        const i64 blocks = h / EP_FP8_BLOCK;
        const uint2 *src = (const uint2 *)(own      ? p.base + p.off_send + t * h
                                           : pulled ? ep_at(p, s, p.off_send) + t * h
                                                    : p.base + p.off_recv + tok * h);
        const float *sc = own      ? (const float *)(p.base + p.off_send_scales) + t * blocks
                          : pulled ? (const float *)(ep_at(p, s, p.off_send_scales)) + t * blocks
                                   : (const float *)(p.base + p.off_recv_scales) + tok * blocks;
        uint2 v[EP_UNROLL];
        float scale[EP_UNROLL];
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u) {
            const i64 c = c0 + 32 * u;
            if (c < chunks) {
                v[u] = src[c];
                scale[u] = sc[c * 8 / EP_FP8_BLOCK];
            }
        }
        // The bf16 rows, dequantized once per chunk (not once per route).
        uint4 w[EP_UNROLL];
        if (p.out_bf16) {
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                if (c0 + 32 * u >= chunks) break;
                const unsigned short *b = (const unsigned short *)&v[u];
                unsigned int q[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x0, x1;
                    fp8e4m3x2_to_f32(b[e], x0, x1);
                    q[e] = f32_to_bf16x2(__fmul_rn(x0, scale[u]), __fmul_rn(x1, scale[u]));
                }
                w[u] = make_uint4(q[0], q[1], q[2], q[3]);
            }
        }
        // This item's scale blocks.
        const i64 b0 = grp * 32 * EP_UNROLL * 8 / EP_FP8_BLOCK, b1 = b0 + 32 * EP_UNROLL * 8 / EP_FP8_BLOCK;
        for (unsigned m = kept; m; m &= m - 1) {
            const i64 r = __shfl_sync(0xffffffffu, mine, __ffs(m) - 1);
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                const i64 c = c0 + 32 * u;
                if (c >= chunks) break;
                if (p.out) ((uint2 *)(p.out + r * h))[c] = v[u];
                if (p.out_bf16) ((uint4 *)(p.out_bf16 + r * h))[c] = w[u];
            }
            if (p.out)
                for (i64 b = b0 + lane; b < b1 && b < blocks; b += 32) p.out_scales[r * blocks + b] = sc[b];
        }
#endif
    } else {
        const uint4 *src = (const uint4 *)(own      ? p.src + t * h * elem
                                           : pulled ? rows + t * h * elem
                                                    : p.base + p.off_recv + tok * h * elem);
        uint4 v[EP_UNROLL];
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            if (c0 + 32 * u < chunks) v[u] = src[c0 + 32 * u];
        for (unsigned m = kept; m; m &= m - 1) {
            const i64 r = __shfl_sync(0xffffffffu, mine, __ffs(m) - 1);
            uint4 *d = (uint4 *)(p.out + r * h * elem);
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u)
                if (c0 + 32 * u < chunks) d[c0 + 32 * u] = v[u];
        }
    }
}

// copy: per item of a received token, its chunks read once and written
// to each kept route's row (in slot order). Pulled, the tokens go in
// turns (ep_turn), so every moment's loads spread over the PEs, peers'
// (over NVLink) among this PE's own.
extern "C" __global__ void __launch_bounds__(512) ep_copy(EpParams p) {
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk;
    const i64 groups = ep_copy_groups(p);
    const int *rows = (const int *)(p.base + p.off_route_row);
    const int *sent = (const int *)(p.base + p.off_sent);
    // Pulled, each sender's rows: where its publish said peers read them
    // (the wait before this kernel made its word visible here), else its
    // send buffer.
    __shared__ const unsigned char *from[EP_MAX_PES];
    if (p.pull) {
        for (int s = threadIdx.x; s < p.pes; s += blockDim.x) {
            const u64 at = *(volatile const u64 *)(ep_at(p, s, p.off_words) + EP_WORD_PULL * 8);
            from[s] = at != 0 ? (const unsigned char *)at : ep_at(p, s, p.off_send);
        }
        __syncthreads();
    }
    for (i64 item = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < p.pes * T * groups;
         item += warps) {
        int s;
        i64 t;
        if (p.pull) {
            ep_turn(p, item / groups, s, t);
        } else {
            s = (int)(item / groups / T);
            t = item / groups % T;
        }
        if (t >= sent[s]) continue;
        const i64 tok = (i64)s * T + t;
        ep_copy_item(p, tok, item % groups, ep_route(rows + tok * k, k, lane), p.pull ? from[s] : nullptr);
    }
}

// Two bf16 or one f32 lane values of a 16-byte chunk as floats: chunk c
// of a row holds elements [c*per, (c+1)*per).
__device__ __forceinline__ void ep_unpack(int prec, uint4 v, float *f) {
    if (prec == 0) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    } else {
        bf16x2_to_f32(v.x, f[0], f[1]); bf16x2_to_f32(v.y, f[2], f[3]);
        bf16x2_to_f32(v.z, f[4], f[5]); bf16x2_to_f32(v.w, f[6], f[7]);
    }
}
__device__ __forceinline__ uint4 ep_pack(int prec, const float *f) {
    if (prec == 0)
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    return make_uint4(f32_to_bf16x2(f[0], f[1]), f32_to_bf16x2(f[2], f[3]), f32_to_bf16x2(f[4], f[5]),
                      f32_to_bf16x2(f[6], f[7]));
}

// The next two set bits of `m` (lowest first; -1 where none), cleared:
// two rows in flight at once, still added in bit order.
__device__ __forceinline__ int ep_lowest(unsigned m) { return __ffs(m) - 1; }
__device__ __forceinline__ int ep_lowest(u64 m) { return __ffsll((long long)m) - 1; }
template <class M> __device__ __forceinline__ void ep_take_two(M &m, int &a, int &b) {
    a = ep_lowest(m);
    m &= m - 1;
    b = m ? ep_lowest(m) : -1;
    if (m) m &= m - 1;
}

// reduce: per item of a received token routed here, its kept routes'
// chunks summed in slot order (weighted or not), stored into its partial
// row at the token's PE.
__device__ void ep_reduce_body(const EpParams &p) {
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, h = p.hidden;
    const int prec = p.precision == 0 ? 0 : 1;
    const int elem = prec == 0 ? 4 : 2, per = 16 / elem;
    const i64 chunks = h / per;
    const i64 groups = ep_items(chunks);
    const int *rows = (const int *)(p.base + p.off_route_row);
    const int *local = (const int *)(p.base + p.off_local);
    const float *probs = (const float *)(p.base + p.off_recv_probs);
    const int *sent = (const int *)(p.base + p.off_sent);
    for (i64 item = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < p.pes * T * groups;
         item += warps) {
        const i64 grp = item % groups;
        int s;
        i64 t;
        ep_turn(p, item / groups, s, t);
        const i64 tok = (i64)s * T + t;
        if (t >= sent[s]) continue;
        // One PE: the sums are the outputs (a token with no route: zeros).
        const bool solo = p.pes == 1;
        const i64 c0 = grp * 32 * EP_UNROLL + lane;
        const bool here = __any_sync(0xffffffffu, lane < k && local[tok * k + lane] >= 0);
        if (!here) {
            if (solo) {
#pragma unroll
                for (int u = 0; u < EP_UNROLL; ++u)
                    if (c0 + 32 * u < chunks) ((uint4 *)(p.out + t * h * elem))[c0 + 32 * u] = make_uint4(0, 0, 0, 0);
            }
            continue;
        }
        const int mine = ep_route(rows + tok * k, k, lane);
        const float wmine = lane < k && p.weighted ? probs[tok * k + lane] : 1.0f;
        const unsigned kept = __ballot_sync(0xffffffffu, mine >= 0);
        float acc[EP_UNROLL][8];
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
        // Two routes' chunks in flight at once, added in slot order.
        for (unsigned m = kept; m;) {
            int j0, j1;
            ep_take_two(m, j0, j1);
            const i64 r0 = __shfl_sync(0xffffffffu, mine, j0);
            const float w0 = __shfl_sync(0xffffffffu, wmine, j0);
            const i64 r1 = __shfl_sync(0xffffffffu, mine, j1 < 0 ? 0 : j1);
            const float w1 = __shfl_sync(0xffffffffu, wmine, j1 < 0 ? 0 : j1);
            const uint4 *s0 = (const uint4 *)(p.src + r0 * h * elem);
            const uint4 *s1 = (const uint4 *)(p.src + r1 * h * elem);
            uint4 v0[EP_UNROLL], v1[EP_UNROLL];
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                if (c0 + 32 * u < chunks) {
                    v0[u] = s0[c0 + 32 * u];
                    if (j1 >= 0) v1[u] = s1[c0 + 32 * u];
                }
            }
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                float f[8];
                ep_unpack(prec, v0[u], f);
                for (int e = 0; e < per; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w0, f[e]));
                if (j1 >= 0) {
                    ep_unpack(prec, v1[u], f);
                    for (int e = 0; e < per; ++e) acc[u][e] = __fadd_rn(acc[u][e], __fmul_rn(w1, f[e]));
                }
            }
        }
        // Into the token's PE: its partial row from this PE.
        uint4 *out = (uint4 *)(solo ? p.out + t * h * elem
                                    : ep_at(p, s, p.off_partial) + ((i64)p.rank * T + t) * h * elem);
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            if (c0 + 32 * u < chunks) out[c0 + 32 * u] = ep_pack(prec, acc[u]);
    }
}

extern "C" __global__ void __launch_bounds__(512) ep_reduce(EpParams p) { ep_reduce_body(p); }

// gather_sum: per item of this PE's token, the partial chunks the PEs
// hosting its experts stored here, added in rank order.
__device__ void ep_gather_sum_body(const EpParams &p) {
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, h = p.hidden;
    const int prec = p.precision == 0 ? 0 : 1;
    const int elem = prec == 0 ? 4 : 2, per = 16 / elem;
    const i64 chunks = h / per;
    const i64 groups = ep_items(chunks);
    const int *ids = (const int *)(p.base + p.off_ids);
    // A lane's route's expert, loaded one item ahead: an item then waits
    // on one round of memory latency (its partial rows), not two.
    const auto expert = [&](i64 item) { return item < p.n * groups && lane < k ? ids[item / groups * k + lane] : -1; };
    int next = expert((i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32);
    for (i64 item = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < p.n * groups; item += warps) {
        const i64 t = item / groups, grp = item % groups;
        const int id = next;
        next = expert(item + warps);
        u64 mask = id >= 0 && id < p.experts ? 1ull << (id / p.local_experts) : 0ull;
        for (int o = 16; o > 0; o /= 2) mask |= __shfl_xor_sync(0xffffffffu, mask, o);
        const i64 c0 = grp * 32 * EP_UNROLL + lane;
        float acc[EP_UNROLL][8];
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            for (int e = 0; e < 8; ++e) acc[u][e] = 0.0f;
        // Two PEs' chunks in flight at once, added in rank order.
        for (u64 m = mask; m;) {
            int q0, q1;
            ep_take_two(m, q0, q1);
            const uint4 *s0 = (const uint4 *)(p.base + p.off_partial + ((i64)q0 * T + t) * h * elem);
            const uint4 *s1 = (const uint4 *)(p.base + p.off_partial + ((i64)(q1 < 0 ? q0 : q1) * T + t) * h * elem);
            uint4 v0[EP_UNROLL], v1[EP_UNROLL];
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                if (c0 + 32 * u < chunks) {
                    v0[u] = s0[c0 + 32 * u];
                    if (q1 >= 0) v1[u] = s1[c0 + 32 * u];
                }
            }
#pragma unroll
            for (int u = 0; u < EP_UNROLL; ++u) {
                float f[8];
                ep_unpack(prec, v0[u], f);
                for (int e = 0; e < per; ++e) acc[u][e] = __fadd_rn(acc[u][e], f[e]);
                if (q1 >= 0) {
                    ep_unpack(prec, v1[u], f);
                    for (int e = 0; e < per; ++e) acc[u][e] = __fadd_rn(acc[u][e], f[e]);
                }
            }
        }
        uint4 *out = (uint4 *)(p.out + t * h * elem);
#pragma unroll
        for (int u = 0; u < EP_UNROLL; ++u)
            if (c0 + 32 * u < chunks) out[c0 + 32 * u] = ep_pack(prec, acc[u]);
    }
}

extern "C" __global__ void __launch_bounds__(512) ep_gather_sum(EpParams p) {
    ep_await(p);
    ep_gather_sum_body(p);
}

// scatter_grad: one warp per received token; per route, the scaled row and
// the dot product (summed per lane, then across the warp).
extern "C" __global__ void __launch_bounds__(512) ep_scatter_grad(EpParams p) {
    ep_await(p);
    const i64 warps = (i64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    const i64 T = p.tokens, k = p.topk, h = p.hidden;
    const int prec = p.precision == 0 ? 0 : 1;
    const int elem = prec == 0 ? 4 : 2, per = 16 / elem;
    const int *rows = (const int *)(p.base + p.off_route_row);
    const int *local = (const int *)(p.base + p.off_local);
    const float *probs = (const float *)(p.base + p.off_recv_probs);
    const int *sent = (const int *)(p.base + p.off_sent);
    float *gp = (float *)(p.base + p.off_grad_probs);
    for (i64 slot = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; slot < p.pes * T; slot += warps) {
        int s;
        i64 t;
        ep_turn(p, slot, s, t);
        const i64 item = (i64)s * T + t;
        if (t >= sent[s]) continue;
        const uint4 *g = (const uint4 *)(ep_at(p, s, p.off_send) + t * h * elem);
        for (i64 j = 0; j < k; ++j) {
            if (local[item * k + j] < 0) continue;
            const int r = rows[item * k + j];
            float dot = 0.0f;
            if (r >= 0) {
                const float w = probs[item * k + j];
                uint4 *out = (uint4 *)(p.out + (i64)r * h * elem);
                const uint4 *y = (const uint4 *)(p.expert_out + (i64)r * h * elem);
                for (i64 c = lane; c < h / per; c += 32) {
                    float f[8], o[8], yy[8];
                    ep_unpack(prec, ep_load_peer(g + c), f);
                    ep_unpack(prec, y[c], yy);
                    for (int e = 0; e < per; ++e) {
                        o[e] = __fmul_rn(w, f[e]);
                        dot = __fadd_rn(dot, __fmul_rn(yy[e], f[e]));
                    }
                    out[c] = ep_pack(prec, o);
                }
                for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            }
            if (lane == 0) gp[item * k + j] = dot;
        }
    }
}

// gather_probs: one thread per (token, slot) of this PE.
extern "C" __global__ void __launch_bounds__(256) ep_gather_probs(EpParams p) {
    ep_await(p);
    const i64 T = p.tokens, k = p.topk;
    const int *ids = (const int *)(p.base + p.off_ids);
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < p.n * k; r += (i64)gridDim.x * blockDim.x) {
        const i64 t = r / k;
        const int id = ids[r];
        float v = 0.0f;
        if (id >= 0 && id < p.experts) {
            const int q = (int)(id / p.local_experts);
            v = ((const float *)(ep_at(p, q, p.off_grad_probs)))[((i64)p.rank * T + t) * k + r % k];
        }
        p.grad_probs_out[r] = v;
    }
}

// ---- Low-latency mode: a whole dispatch in one kernel and a whole
// combine in another, for decode-sized groups. Their blocks (one per SM of
// the budget, never more than the device's SMs, so all are resident at
// once) meet at grid-wide barriers on the PE's barrier word, and the last
// block to finish a phase announces it to every PE. The results are the
// steps' results, byte for byte.

#define EP_LL_MAX_EXPERTS 2048

__device__ __forceinline__ u64 ep_load_acquire_gpu(const u64 *a) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
    return v;
}

// Every block of the kernel waits here until all have arrived. The word
// only grows, by gridDim.x per barrier (every low-latency kernel of a
// group runs the same number of blocks). A block that waits past the
// timeout records error 3 (blocks not all resident) and goes on.
__device__ void ep_grid_sync(const EpParams &p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 *bar = ep_words(p) + EP_WORD_BAR;
        __threadfence();
        const u64 old = atomicAdd((unsigned long long *)bar, 1ull);
        const u64 target = (old / gridDim.x + 1) * gridDim.x;
        u64 started_ns;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(started_ns));
        while (ep_load_acquire_gpu(bar) < target) {
            u64 now;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
            if (now - started_ns > p.timeout_ns) {
                ep_error(p, 3, p.rank);
                break;
            }
            __nanosleep(32);
        }
        __threadfence();
    }
    __syncthreads();
}

// The last block of the kernel to get here announces phase `epoch` to
// every PE (as ep_signal does). Each block fences its stores, the peers'
// included, at system scope before it arrives; the last block's fence
// after its arrival (the blocks are on one GPU) orders them before its
// release stores, which carry them to the peers.
__device__ void ep_announce_last(const EpParams &p, u64 epoch) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        const u64 old = atomicAdd((unsigned long long *)(ep_words(p) + EP_WORD_BAR), 1ull);
        last = (old + 1) % gridDim.x == 0;
        if (last) __threadfence();
    }
    __syncthreads();
    if (last) {
        if (threadIdx.x < p.pes) ep_store_release((u64 *)(ep_at(p, threadIdx.x, p.off_ready)) + p.rank, epoch);
        if (threadIdx.x == 0) ep_words(p)[EP_WORD_EPOCH] = epoch;
    }
}

// ll_dispatch: publish; then each block sends its own tokens: every PE
// gets each token's routing (its local expert, prob, and the route's rank
// among this PE's routes to that expert, token order), the PEs hosting
// its experts its row, and the last block every PE's counts per local
// expert; the phase is announced; then each block lays the received rows
// out itself (a sender's routes to an expert follow the senders before
// it: the layout of count, scan and assign) and copies its share.
extern "C" __global__ void __launch_bounds__(512, 1) ep_ll_dispatch(EpParams p) {
    // Send: routes per expert so far; receive: rows of each (sender, local
    // expert) before that sender's.
    __shared__ int table[EP_LL_MAX_EXPERTS];
    __shared__ i64 start[EP_LL_MAX_EXPERTS];
    const u64 epoch = ep_words(p)[EP_WORD_EPOCH] + 1;
    const i64 T = p.tokens, k = p.topk, L = p.local_experts, n = p.n;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const i64 groups = ep_groups(p);
    ep_publish_body(p);
    ep_grid_sync(p);
    const i64 per = (n + gridDim.x - 1) / gridDim.x;
    const i64 t0 = (i64)blockIdx.x * per < n ? (i64)blockIdx.x * per : n;
    const i64 t1 = t0 + per < n ? t0 + per : n;
    for (i64 e = threadIdx.x; e < p.experts; e += blockDim.x) table[e] = 0;
    __syncthreads();
    const int *ids = (const int *)(p.base + p.off_ids);
    const float *probs = (const float *)(p.base + p.off_probs);
    for (i64 r = threadIdx.x; r < t0 * k; r += blockDim.x) {
        const int id = ids[r];
        if (id >= 0) atomicAdd(table + id, 1);
    }
    __syncthreads();
    // Token by token (a token's ids are distinct: its lanes take their
    // ranks at once), its routing to every PE: -1 where it does not land.
    if (warp == 0) {
        for (i64 t = t0; t < t1; ++t) {
            const int id = lane < k ? ids[t * k + lane] : -1;
            const float pr = lane < k ? probs[t * k + lane] : 0.0f;
            int rank = 0;
            if (id >= 0) {
                rank = table[id];
                table[id] = rank + 1;
            }
            if (lane < k) {
                const i64 slot = ((i64)p.rank * T + t) * k + lane;
                for (int q = 0; q < p.pes; ++q) {
                    unsigned char *b = ep_at(p, q, 0);
                    ((int *)(b + p.off_local))[slot] = id >= 0 && id / L == q ? (int)(id % L) : -1;
                    ((float *)(b + p.off_recv_probs))[slot] = pr;
                    ((int *)(b + p.off_ll_rank))[slot] = rank;
                }
            }
            __syncwarp();
        }
    }
    __syncthreads();
    // The last block's range ends at n: its table holds every count.
    if (blockIdx.x == gridDim.x - 1) {
        for (i64 e = threadIdx.x; e < p.experts; e += blockDim.x)
            ((int *)(ep_at(p, (int)(e / L), p.off_tile_counts)))[(i64)p.rank * L + e % L] = table[e];
        if (threadIdx.x < p.pes) ((int *)(ep_at(p, threadIdx.x, p.off_sent)))[p.rank] = (int)n;
    }
    for (i64 item = warp; item < (t1 - t0) * groups; item += nwarps) ep_push_item(p, t0 + item / groups, item % groups);
    ep_announce_last(p, epoch);
    ep_await_epoch(p, epoch);

    const int *counts = (const int *)(p.base + p.off_tile_counts);
    for (i64 l = threadIdx.x; l < L; l += blockDim.x) {
        int run = 0;
        for (int s = 0; s < p.pes; ++s) {
            table[s * L + l] = run;
            run += counts[s * L + l];
        }
        start[l] = run;
    }
    __syncthreads();
    // start holds each expert's routes until ep_starts_of turns it into
    // first rows (each thread reads an expert's count before writing it).
    auto kept = [&](i64 e) -> i64 { return p.capacity > 0 && start[e] > p.capacity ? p.capacity : start[e]; };
    if (blockIdx.x == 0) {
        for (i64 l = threadIdx.x; l < L; l += blockDim.x) {
            const i64 total = start[l], kk = kept(l);
            p.tokens_per_expert[l] = kk;
            if (total > kk) atomicAdd(ep_words(p) + EP_WORD_DROPPED, (u64)(total - kk));
        }
    }
    __syncthreads();
    ep_starts_of(p, kept, start);
    const int *local = (const int *)(p.base + p.off_local);
    const int *ranks = (const int *)(p.base + p.off_ll_rank);
    int *rows = (int *)(p.base + p.off_route_row);
    const int *sent = (const int *)(p.base + p.off_sent);
    const i64 warps = (i64)gridDim.x * nwarps;
    const i64 copy_groups = ep_copy_groups(p);
    for (i64 item = (i64)blockIdx.x * nwarps + warp; item < p.pes * T * copy_groups; item += warps) {
        const i64 tok = item / copy_groups, grp = item % copy_groups;
        const int s = (int)(tok / T);
        if (tok % T >= sent[s]) continue;
        const int loc = lane < k ? local[tok * k + lane] : -1;
        int row = -1;
        if (loc >= 0) {
            const i64 g = (i64)table[s * L + loc] + ranks[tok * k + lane];
            if (p.capacity == 0 || g < p.capacity) {
                const i64 at = start[loc] + g;
                row = at < p.expert_rows ? (int)at : -1;
            }
        }
        if (grp == 0 && lane < k) rows[tok * k + lane] = row;
        // The low-latency kernels never pull: no peer's rows to read.
        ep_copy_item(p, tok, grp, row, nullptr);
    }
}

// ll_combine: reduce, the last block announces, then gather_sum.
extern "C" __global__ void __launch_bounds__(512, 1) ep_ll_combine(EpParams p) {
    const u64 epoch = ep_words(p)[EP_WORD_EPOCH] + 1;
    ep_reduce_body(p);
    ep_announce_last(p, epoch);
    ep_await_epoch(p, epoch);
    ep_gather_sum_body(p);
}
