// Over 600 lines: one NVRTC program, whose kernels share the map-fault word, the codecs and the vector types.
// CUDA kernels of xcall-permute, compiled at run time with NVRTC. Each kernel
// takes one parameter struct by value; the structs (`RowIdMapParams`, ...)
// are defined in cuda/params.rs and their C definitions, checked field by
// field with static_assert, come before this file. The Rust side appends
// the `extern "C"` instantiations a module needs.
//
// Every kernel mirrors a Host op of the crate exactly: data movement is
// bit-exact; arithmetic uses __fmul_rn/__fadd_rn (never contracted into an
// FMA) in the Host's order, and conversions round to nearest even, so the
// results are bit-identical to the Host's. Destinations read from a map are
// bounds-checked: a malformed map never writes out of bounds.

typedef long long i64;
typedef unsigned long long u64;

// ------------------------------------------------------------ map faults
// Every kernel that follows a map checks each entry it uses and skips one
// that points outside its tensors, recording why in this module's fault
// word (bits of xcall_permute_fault); the Host reads and clears it (see
// cuda::take_faults). The rim_check kernels set the bits only checking can
// find (kept rows, duplicate rows, counts).
__device__ unsigned int xcall_map_faults;
#define FAULT_ROUTE_COUNT 1u
#define FAULT_EXPERT 2u
#define FAULT_ROW 4u
#define FAULT_CHUNK_ROW 8u
#define FAULT_DUPLICATE_ROW 16u
#define FAULT_COUNTS 32u
#define FAULT_SORT_MAP 64u

// A route count n, or 0 (recording a fault in *word) outside [0, E].
__device__ __forceinline__ int count_ok(int n, int E, unsigned int* word = &xcall_map_faults) {
    if (n < 0 || n > E) {
        atomicOr(word, FAULT_ROUTE_COUNT);
        return 0;
    }
    return n;
}

// The route count of map row m, checked as count_ok.
__device__ __forceinline__ int route_count(const int* m, int E, unsigned int* word = &xcall_map_faults) {
    return count_ok(m[2 * E], E, word);
}

// Whether the route (row d, expert e) lies in [0, N) x [0, E); records the
// fault of a route that does not in *word.
__device__ __forceinline__ bool entry_ok(int d, int e, int E, i64 N, unsigned int* word = &xcall_map_faults) {
    if (e < 0 || e >= E) {
        atomicOr(word, FAULT_EXPERT);
        return false;
    }
    if (d < 0 || d >= N) {
        atomicOr(word, FAULT_ROW);
        return false;
    }
    return true;
}

// Whether route k of map row m lies in [0, N) x [0, E); records the fault
// of a route that does not in *word.
__device__ __forceinline__ bool route_ok(const int* m, int k, int E, i64 N, unsigned int* word = &xcall_map_faults) {
    return entry_ok(m[k], m[E + k], E, N, word);
}

// Checked mode, before an op that follows a map (one thread per token):
// every route in bounds and, with the chunks (tpe not NULL), inside its
// expert's kept rows [offsets[e], offsets[e] + tpe[e]), no row written
// twice (taken: N bits, zeroed) and counts[e] (zeroed) the routes of e.
// Faults go to *word.
extern "C" __global__ void rim_check(const MapCheckParams p) {
    const int* map = p.map;
    const i64* tpe = p.tpe;
    const i64 T = p.tokens, N = p.out_rows;
    const int E = (int)p.experts;
    unsigned int* word = p.word;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < T; t += (i64)gridDim.x * blockDim.x) {
        const int* m = map + t * (2 * E + 1);
        const int n = route_count(m, E, word);
        for (int k = 0; k < n; ++k) {
            if (!route_ok(m, k, E, N, word) || !tpe) continue;
            const int d = m[k], e = m[E + k];
            const i64 start = p.offsets[e], kept = tpe[e];
            if (start < 0 || kept < 0 || d < start || d - start >= kept) {
                atomicOr(word, FAULT_CHUNK_ROW);
                continue;
            }
            const unsigned int bit = 1u << (d & 31);
            if (atomicOr(&p.taken[d >> 5], bit) & bit) atomicOr(word, FAULT_DUPLICATE_ROW);
            atomicAdd(&p.counts[e], 1ull);
        }
    }
}

// Checked mode, after rim_check (one thread per expert): each chunk valid
// (0 <= start, start + kept <= end) and keeping exactly the routes the
// map sends to it.
extern "C" __global__ void rim_check_counts(const MapCheckParams p) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.experts; e += gridDim.x * blockDim.x) {
        const i64 start = p.offsets[e], end = p.offsets[e + 1], kept = p.tpe[e];
        if (start < 0 || kept < 0 || end < start || kept > end - start || (i64)p.counts[e] != kept)
            atomicOr(p.word, FAULT_COUNTS);
    }
}

// ---------------------------------------------------------------- vectors
template <int V> struct VecT;
template <> struct VecT<16> { typedef uint4 T; };
template <> struct VecT<8> { typedef uint2 T; };
template <> struct VecT<4> { typedef unsigned int T; };
template <> struct VecT<2> { typedef unsigned short T; };
template <> struct VecT<1> { typedef unsigned char T; };

// ---------------------------------------------------------------- codecs
// Each codec: load (S -> f32, exact) and store (f32 -> S, rounded); fp8
// also load4 / store4 (a word of four values at once, the same results).
struct F32 {
    typedef float S;
    static __device__ __forceinline__ float load(S v) { return v; }
    static __device__ __forceinline__ S store(float v) { return v; }
};
// bf16 and the f16 load are xcall-core's device helpers (CONVERT),
// prepended to this source.
struct F16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float load(S v) { return xcall_f16_bits_to_f32(v); }
    static __device__ __forceinline__ S store(float v) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};
struct BF16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float load(S v) { return bf16_to_f32(v); }
    static __device__ __forceinline__ S store(float v) { return f32_to_bf16(v); }
};

// fp8, the steps of xcall_core::fp8_decode / fp8_encode: round to nearest
// even, finite values saturate to MAXB, any NaN stores as 0x7f.
__device__ __forceinline__ float pow2f(int k) { return __uint_as_float((unsigned int)(k + 127) << 23); }
template <int MB, int BIAS, int MAXB, bool FN> struct F8 {
    typedef unsigned char S;
    static __device__ __forceinline__ float load(S b) {
#if __CUDA_ARCH__ >= 890
        // Every fp8 value is exact in f16; a NaN stays a NaN.
        unsigned int h2;
        unsigned short in = b;
        if (FN) asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
        else asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h2 & 0xffff)));
        return f;
#else
        const float sign = (b & 0x80) ? -1.0f : 1.0f;
        const int exp = (b & 0x7f) >> MB, man = b & ((1 << MB) - 1), top = (1 << (7 - MB)) - 1;
        float mag;
        if (FN && exp == top && man == (1 << MB) - 1) mag = __uint_as_float(0x7fc00000u);
        else if (!FN && exp == top) mag = man ? __uint_as_float(0x7fc00000u) : __uint_as_float(0x7f800000u);
        else if (exp == 0) mag = (float)man * pow2f(1 - BIAS - MB);
        else mag = (float)((1 << MB) + man) * pow2f(exp - BIAS - MB);
        return sign * mag;
#endif
    }
    // Four values packed in a word (the first in its low byte), as they
    // lie in memory.
    static __device__ __forceinline__ void load4(unsigned int w, float* x) {
#if __CUDA_ARCH__ >= 890
        const unsigned short in[2] = {(unsigned short)(w & 0xffff), (unsigned short)(w >> 16)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            unsigned int h2;
            if (FN) asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in[h]));
            else asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in[h]));
            asm("cvt.f32.f16 %0, %1;" : "=f"(x[2 * h]) : "h"((unsigned short)(h2 & 0xffff)));
            asm("cvt.f32.f16 %0, %1;" : "=f"(x[2 * h + 1]) : "h"((unsigned short)(h2 >> 16)));
        }
#else
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = load((S)(w >> (8 * i)));
#endif
    }
    // A NaN converts to some NaN encoding (any sign); those bytes of a
    // saturating conversion's word become 0x7f with a carry-free add on
    // the low seven bits of each byte (e4m3: NaN is 0x7f; e5m2:
    // 0x7d..0x7f, and 0x7c, an infinity, never comes out of a saturating
    // conversion).
    static __device__ __forceinline__ unsigned int nan_to_7f(unsigned int r) {
        const unsigned int nan = ((r & 0x7f7f7f7fu) + (FN ? 0x01010101u : 0x04040404u)) & 0x80808080u;
        const unsigned int mask = (nan >> 7) * 0xffu;
        return (r & ~mask) | (0x7f7f7f7fu & mask);
    }
    // store of four values into one word, two conversions.
    static __device__ __forceinline__ unsigned int store4(const float* x) {
#if __CUDA_ARCH__ >= 890
        unsigned short lo, hi;
        if (FN) {
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x[1]), "f"(x[0]));
            asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x[3]), "f"(x[2]));
        } else {
            asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x[1]), "f"(x[0]));
            asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x[3]), "f"(x[2]));
        }
        return nan_to_7f((unsigned int)lo | ((unsigned int)hi << 16));
#else
        unsigned int r = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) r |= (unsigned int)store(x[i]) << (8 * i);
        return r;
#endif
    }
    // Four values' bytes of 0 + x, what a token with one route and no
    // probs stores, with no conversion: x itself, except -0 (0x80) -> +0,
    // any NaN -> 0x7f and (e5m2) an infinity -> the largest finite value
    // of its sign, as store() saturates it.
    static __device__ __forceinline__ unsigned int alone4(unsigned int w) {
        const unsigned int low = w & 0x7f7f7f7fu;
        // Bit 7 of a byte set where its low seven bits are 0: that sign
        // bit goes (-0 -> +0).
        const unsigned int zero = ~(low + 0x7f7f7f7fu) & 0x80808080u;
        w &= ~(zero & w);
        unsigned int nan;
        if (FN) {
            nan = (low + 0x01010101u) & 0x80808080u;  // low bits 0x7f
        } else {
            const unsigned int special = (low + 0x04040404u) & 0x80808080u;  // 0x7c..0x7f
            const unsigned int inf = ~((low ^ 0x7c7c7c7cu) + 0x7f7f7f7fu) & 0x80808080u;
            nan = special & ~inf;
            const unsigned int im = (inf >> 7) * 0xffu;
            w = (w & ~(im & 0x7f7f7f7fu)) | (im & (unsigned int)(MAXB * 0x01010101u));
        }
        const unsigned int nm = (nan >> 7) * 0xffu;
        return (w & ~nm) | (0x7f7f7f7fu & nm);
    }
    // Four values' bytes of (0 + a) + b, what a token with two routes and
    // no probs stores, summed in f16 rather than f32: the same bytes.
    // Every fp8 value is exact in f16 and 0 + a is exact; a + b rounds
    // once to f16 (11 significant bits) and then to fp8 (4 or 3), and a
    // sum of two values of p bits rounded first to p' >= 2p + 1 bits and
    // then to p rounds as the exact sum would (the f32 path's sum of two
    // fp8 values is exact or, for e5m2, also such a double rounding).
    // Sums beyond f16's range become infinities, which saturate as the
    // f32 path's large sums do. The test runs every pair of bytes.
    static __device__ __forceinline__ unsigned int pair4(unsigned int a, unsigned int b) {
#if __CUDA_ARCH__ >= 890
        unsigned int r = 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned short ah = (unsigned short)(a >> (16 * h)), bh = (unsigned short)(b >> (16 * h));
            unsigned int fa, fb, s;
            unsigned short d;
            if (FN) {
                asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(fa) : "h"(ah));
                asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(fb) : "h"(bh));
            } else {
                asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(fa) : "h"(ah));
                asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(fb) : "h"(bh));
            }
            // 0 + a first: -0 + -0 would keep its sign; 0 + -0 + -0 is +0.
            asm("add.rn.f16x2 %0, %1, %2;" : "=r"(s) : "r"(fa), "r"(0u));
            asm("add.rn.f16x2 %0, %1, %2;" : "=r"(s) : "r"(s), "r"(fb));
            if (FN) asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(d) : "r"(s));
            else asm("cvt.rn.satfinite.e5m2x2.f16x2 %0, %1;" : "=h"(d) : "r"(s));
            r |= (unsigned int)d << (16 * h);
        }
        return nan_to_7f(r);
#else
        float x[4], y[4];
        load4(a, x);
        load4(b, y);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = __fadd_rn(__fadd_rn(0.0f, x[i]), y[i]);
        return store4(x);
#endif
    }
    static __device__ __forceinline__ S store(float x) {
        if (isnan(x)) return 0x7f;
#if __CUDA_ARCH__ >= 890
        // Round to nearest even, saturating finite values and infinities to
        // the largest finite value: the steps below, in one instruction.
        unsigned short r;
        if (FN) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
        else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
        return (S)(r & 0xff);
#else
        const unsigned int sign = (__float_as_uint(x) >> 24) & 0x80;
        const float a = fabsf(x);
        const int emin = 1 - BIAS, emax = MAXB >> MB;
        int bits;
        if (a < pow2f(emin)) {
            bits = (int)rintf(a * pow2f(MB - emin));
        } else {
            int e = (int)(__float_as_uint(a) >> 23) - 127;
            if (e > emax - BIAS) return (S)(sign | MAXB);
            int m = (int)rintf(a * pow2f(MB - e));
            if (m == (2 << MB)) { e += 1; m = 1 << MB; }
            bits = ((e + BIAS) << MB) | (m - (1 << MB));
        }
        return (S)(sign | (unsigned int)min(bits, MAXB));
#endif
    }
};
typedef F8<3, 7, 0x7e, true> F8E4M3;
typedef F8<2, 15, 0x7b, false> F8E5M2;

// A vector loaded from global memory by an address the compiler cannot
// place (one read back from shared memory is generic): ld.global, as a
// load through a kernel argument compiles to, not a generic load.
__device__ __forceinline__ void load_global(uint4& v, const uint4* a) {
    asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
}
__device__ __forceinline__ void load_global(uint2& v, const uint2* a) {
    asm("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(a));
}
__device__ __forceinline__ void load_global(unsigned int& v, const unsigned int* a) {
    asm("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(a));
}
__device__ __forceinline__ void load_global(unsigned short& v, const unsigned short* a) {
    asm("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(a));
}
__device__ __forceinline__ void load_global(unsigned char& v, const unsigned char* a) {
    unsigned short h;
    asm("ld.global.u8 %0, [%1];" : "=h"(h) : "l"(a));
    v = (unsigned char)h;
}
// The same as a streaming load (ld.global.cs: read once, evicted first).
__device__ __forceinline__ void load_streaming(uint4& v, const uint4* a) {
    asm("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
}

// 16 bytes copied from global to shared memory without passing through
// registers (cp.async, sm_80 and newer; before, a load and a store).
// copy_async16's copies since the last commit_async form one group;
// wait_async<N> returns once at most N groups of this thread are pending,
// the others' bytes then visible to this thread.
__device__ __forceinline__ void copy_async16(uint4* dst, const uint4* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned int d = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
#else
    uint4 v;
    load_global(v, src);
    *dst = v;
#endif
}
__device__ __forceinline__ void commit_async() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wait_async() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// V bytes of elements of codec C, loaded and stored as one vector.
template <typename C, int V> union Pack {
    typename VecT<V>::T raw;
    typename C::S v[V / sizeof(typename C::S)];
};

// ------------------------------------------------------------ row-id map
// Phase 1: per-block expert counts over TB tokens, stored at the start of
// the block's own rows of the map (it holds at least E ints; phase 3
// overwrites them last).
__device__ void load_tile(const unsigned char* routing, unsigned char* tile, i64 t0, int nt, int E) {
    const unsigned char* src = routing + t0 * E;
    for (i64 i = threadIdx.x; i < (i64)nt * E; i += blockDim.x) tile[i] = src[i] != 0;
}

extern "C" __global__ void rim_count(const RowIdMapParams p) {
    extern __shared__ unsigned char tile[];
    const int E = (int)p.experts, TB = (int)p.block_tokens;
    i64 t0 = (i64)blockIdx.x * TB;
    int nt = (int)min((i64)TB, p.tokens - t0);
    load_tile(p.routing, tile, t0, nt, E);
    __syncthreads();
    int* slot = p.map + t0 * (2 * E + 1);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = 0;
        for (int i = 0; i < nt; ++i) c += tile[i * E + e];
        slot[e] = c;
    }
}

// Inclusive scan of x over the block (blockDim a multiple of 32, <= 1024);
// `total` receives the block's sum. Uses `warps[32]` of shared memory.
__device__ i64 block_scan(i64 x, i64* warps, i64* total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int off = 1; off < 32; off <<= 1) {
        i64 y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) warps[warp] = x;
    __syncthreads();
    if (warp == 0) {
        i64 w = lane < nw ? warps[lane] : 0;
        for (int off = 1; off < 32; off <<= 1) {
            i64 y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        warps[lane] = w;
    }
    __syncthreads();
    i64 incl = x + (warp > 0 ? warps[warp - 1] : 0);
    *total = warps[nw - 1];
    __syncthreads();
    return incl;
}

// Phase 2: one block per expert turns the block counts into exclusive
// block bases (in place) and writes the expert's route count to tpe[e].
extern "C" __global__ void rim_scan_blocks(const RowIdMapParams p) {
    __shared__ i64 warps[32];
    const int E = (int)p.experts, TB = (int)p.block_tokens;
    const i64 nblocks = p.blocks;
    int* map = p.map;
    int e = blockIdx.x;
    i64 carry = 0;
    for (i64 base = 0; base < nblocks; base += blockDim.x) {
        i64 b = base + threadIdx.x;
        int* slot = map + b * TB * (2 * E + 1) + e;
        int v = b < nblocks ? *slot : 0;
        i64 total;
        i64 incl = block_scan(v, warps, &total);
        if (b < nblocks) *slot = (int)(carry + incl - v);
        carry += total;
    }
    if (threadIdx.x == 0) p.tpe[e] = carry;
}

// Phase 2b, one block per expert group (one group of all E without
// groups): padded expert offsets, and the routes each expert keeps under
// the cap, the capacity and its group's end (tpe holds raw counts on entry,
// kept on exit). capacity > 0: every chunk is exactly capacity rows. With
// groups (group_rows > 0), group g's chunks are packed from row
// g * group_rows and clamped to the group's end.
extern "C" __global__ void rim_offsets(const RowIdMapParams p) {
    __shared__ i64 warps[32];
    i64* tpe = p.tpe;
    i64* offsets = p.offsets;
    const int E = (int)p.experts, GE = (int)p.group_experts;
    const int first = blockIdx.x * GE, last = min(E, first + GE);
    const i64 align = p.align, capacity = p.capacity, rows = p.group_rows;
    const i64 base = rows > 0 ? (i64)blockIdx.x * rows : 0;
    const i64 end = rows > 0 ? base + rows : p.cap;
    i64 carry = base;
    for (int at = first; at < last; at += blockDim.x) {
        int e = at + threadIdx.x;
        i64 count = e < last ? tpe[e] : 0;
        i64 padded = e >= last ? 0 : capacity > 0 ? capacity : (count + align - 1) / align * align;
        i64 total;
        i64 incl = block_scan(padded, warps, &total);
        if (e < last) {
            i64 off = carry + incl - padded;
            if (rows > 0) off = min(off, end);
            offsets[e] = off;
            tpe[e] = max((i64)0, min(min(count, end - off), capacity > 0 ? capacity : count));
        }
        carry += total;
    }
    if (threadIdx.x == 0 && last == E) offsets[E] = rows > 0 ? (i64)gridDim.x * rows : carry;
}

// Phase 3: ranks within the block, then one warp per token writes its row.
extern "C" __global__ void rim_write(const RowIdMapParams p) {
    extern __shared__ i64 start[];  // E values, then the TB x E tile
    const i64* offsets = p.offsets;
    const int E = (int)p.experts, TB = (int)p.block_tokens;
    const i64 T = p.tokens, cap = p.cap, capacity = p.capacity;
    unsigned char* tile = (unsigned char*)(start + E);
    i64 t0 = (i64)blockIdx.x * TB;
    int nt = (int)min((i64)TB, T - t0);
    const int W = 2 * E + 1;
    int* rows = p.map + t0 * W;
    for (int e = threadIdx.x; e < E; e += blockDim.x) start[e] = offsets[e] + rows[e];
    load_tile(p.routing, tile, t0, nt, E);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int r = 0;
        for (int i = 0; i < nt; ++i) {
            if (tile[i * E + e]) tile[i * E + e] = (unsigned char)(++r);
        }
    }
    __syncthreads();
    int lane = threadIdx.x & 31;
    for (int i = threadIdx.x >> 5; i < nt; i += blockDim.x >> 5) {
        int* row = rows + (i64)i * W;
        int n = 0;
        for (int base = 0; base < E; base += 32) {
            int e = base + lane;
            bool kept = false;
            i64 dst = 0;
            if (e < E) {
                int v = tile[i * E + e];
                if (v) {
                    dst = start[e] + v - 1;
                    kept = dst < cap && (capacity <= 0 || dst - offsets[e] < capacity) &&
                           (p.group_rows <= 0 || dst < (i64)(e / (int)p.group_experts + 1) * p.group_rows);
                }
            }
            unsigned mask = __ballot_sync(0xffffffffu, kept);
            if (kept) {
                int k = n + __popc(mask & ((1u << lane) - 1));
                row[k] = (int)dst;
                row[E + k] = e;
            }
            n += __popc(mask);
        }
        for (int j = n + lane; j < E; j += 32) {
            row[j] = -1;
            row[E + j] = -1;
        }
        if (lane == 0) row[2 * E] = n;
    }
}

// ---------------------------------------------------------- chunk sort map
// Every block checks the split (sizes in [0, T] summing to <= T, indices a
// permutation) and computes the chunk starts in shared memory, in parallel:
// each thread owns a contiguous run of chunks (and of sorted positions),
// sums it, and one block_scan per order gives every run its start. An
// invalid split leaves the map untouched. Then one thread per row, which
// finds its chunk by binary search over the starts.
extern "C" __global__ void chunk_map(const ChunkMapParams p) {
    extern __shared__ i64 in_start[];  // S + 1 starts, then S out starts, then ceil(S/32) seen bits
    const int S = (int)p.chunks;
    const i64 T = p.tokens;
    i64* out_start = in_start + S + 1;
    unsigned int* seen = (unsigned int*)(out_start + S);
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    for (int w = threadIdx.x; w < (S + 31) / 32; w += blockDim.x) seen[w] = 0;
    __syncthreads();
    const int per = (S + (int)blockDim.x - 1) / (int)blockDim.x;
    const int lo = min(S, (int)threadIdx.x * per), hi = min(S, lo + per);
    i64 sum = 0, sum_sorted = 0;
    for (int c = lo; c < hi; ++c) {
        const i64 size = p.sizes[c];
        if (size < 0 || size > T) atomicOr(&bad, 1);
        else sum += size;
        const i64 k = p.sorted[c];
        if (k < 0 || k >= S || ((atomicOr(&seen[k >> 5], 1u << (k & 31)) >> (k & 31)) & 1u)) {
            atomicOr(&bad, 1);
        } else {
            const i64 ks = p.sizes[k];
            if (ks >= 0 && ks <= T) sum_sorted += ks;  // a bad size is reported by its owner
        }
    }
    __shared__ i64 warps[32];
    i64 total, total_sorted;
    i64 run = block_scan(sum, warps, &total) - sum;
    i64 run_sorted = block_scan(sum_sorted, warps, &total_sorted) - sum_sorted;
    // The same for every thread: bad was set before the scans' barriers,
    // and every thread holds the total.
    if (bad || total > T) return;
    for (int c = lo; c < hi; ++c) {
        in_start[c] = run;
        run += p.sizes[c];
    }
    for (int i = lo; i < hi; ++i) {
        const i64 k = p.sorted[i];
        out_start[k] = run_sorted;
        run_sorted += p.sizes[k];
    }
    if (threadIdx.x == 0) in_start[S] = total;
    __syncthreads();
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < T; t += (i64)gridDim.x * blockDim.x) {
        i64 dst = t;
        if (t < total) {
            int lo = 0, hi = S - 1;  // last chunk with in_start <= t and a row at t
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if (in_start[mid] <= t) lo = mid; else hi = mid - 1;
            }
            dst = out_start[lo] + (t - in_start[lo]);
        }
        p.map[t] = dst;
    }
}

// Zeroes the rows no route writes: region c < E is expert c's padding,
// region E the rows past the last chunk. zero_region zeroes slice `part` of
// `parts` of region c with the whole block; zero_body takes region
// blockIdx.x whole.
__device__ __forceinline__ i64 slice_at(i64 n, int part, int parts) { return n * part / parts; }

template <int V>
__device__ void zero_region(const PermuteParams& p, int c, int part, int parts) {
    typedef typename VecT<V>::T Vt;
    const i64* tpe = p.tpe;
    const i64* offsets = p.offsets;
    const i64 N = p.out_rows, row = p.row, S = p.nscales;
    const int E = (int)p.experts;
    i64 lo = c < E ? offsets[c] + tpe[c] : offsets[E];
    i64 hi = c < E ? offsets[c + 1] : N;
    lo = max((i64)0, min(lo, N));
    hi = max((i64)0, min(hi, N));
    if (lo >= hi) return;
    const i64 rows = hi - lo;
    Vt* o = (Vt*)(p.out + lo * row);
    const i64 nv = rows * row / V;
    Vt z;
    memset(&z, 0, sizeof z);
    for (i64 i = slice_at(nv, part, parts) + threadIdx.x; i < slice_at(nv, part + 1, parts); i += blockDim.x) o[i] = z;
    if (p.pprobs)
        for (i64 r = lo + slice_at(rows, part, parts) + threadIdx.x; r < lo + slice_at(rows, part + 1, parts); r += blockDim.x)
            p.pprobs[r] = 0.0f;
    if (p.pscales)
        for (i64 i = lo * S + slice_at(rows * S, part, parts) + threadIdx.x; i < lo * S + slice_at(rows * S, part + 1, parts);
             i += blockDim.x)
            p.pscales[i] = 0.0f;
}

template <int V>
__device__ void zero_body(const PermuteParams& p) { zero_region<V>(p, blockIdx.x, 0, 1); }

// permute's own zero fill, before its tokens, each region in ZERO_PARTS
// slices spread over the grid: the regions are disjoint from every routed
// row, so no ordering is needed between the two. The block's slices are
// looked at all at once, a thread each, and only the non-empty ones are
// zeroed: most regions are empty (an expert without padding), and a block
// of a persistent grid would otherwise wait on one round of map loads per
// slice, (E + 1) * ZERO_PARTS / grid of them in turn.
#define ZERO_PARTS 16
#define MAX_WARPS 16
template <int V>
__device__ void zero_regions(const PermuteParams& p) {
    if (p.seg_rows > 0) return;  // a segmented output keeps its unwritten rows
    const i64 E = p.experts, N = p.out_rows;
    const i64 work = (E + 1) * ZERO_PARTS, grid = gridDim.x;
    __shared__ int todo[MAX_WARPS * 32];
    __shared__ int ntodo;
    for (i64 w0 = blockIdx.x; w0 < work; w0 += grid * blockDim.x) {
        if (threadIdx.x == 0) ntodo = 0;
        __syncthreads();
        const i64 w = w0 + (i64)threadIdx.x * grid;
        if (w < work) {
            const i64 c = w / ZERO_PARTS;
            i64 lo = c < E ? p.offsets[c] + p.tpe[c] : p.offsets[E];
            i64 hi = c < E ? p.offsets[c + 1] : N;
            if (max((i64)0, min(lo, N)) < max((i64)0, min(hi, N))) todo[atomicAdd(&ntodo, 1)] = (int)threadIdx.x;
        }
        __syncthreads();
        const int n = ntodo;
        for (int i = 0; i < n; ++i) {
            const i64 wi = w0 + (i64)todo[i] * grid;
            zero_region<V>(p, (int)(wi / ZERO_PARTS), (int)(wi % ZERO_PARTS), ZERO_PARTS);
        }
        __syncthreads();  // todo is refilled
    }
}

// ------------------------------------------------------------- movement
// Who works on one token: the whole block (one token per block, grid-
// stride), or, for the `*_w_*` kernels (WARP), each warp its own token
// (grid-stride over all warps), so a block keeps blockDim / 32 tokens in
// flight with no block barrier between them. `staged` is the group's slice
// of a kernel's shared staging arrays.
template <bool WARP> struct Group {
    int first, step, slot;
    i64 t0, tstep;
    __device__ Group() {
        const int wpb = blockDim.x >> 5;
        first = WARP ? (int)(threadIdx.x & 31) : (int)threadIdx.x;
        step = WARP ? 32 : (int)blockDim.x;
        slot = WARP ? (int)(threadIdx.x >> 5) : 0;
        t0 = WARP ? (i64)blockIdx.x * wpb + slot : (i64)blockIdx.x;
        tstep = WARP ? (i64)gridDim.x * wpb : (i64)gridDim.x;
    }
    __device__ void sync() const {
        if (WARP) __syncwarp();
        else __syncthreads();
    }
};

// Row d of a permuted tensor: dense at `base`, or (seg_rows > 0) row
// d % seg_rows of segment d / seg_rows. Rows fit an int (the map is i32),
// so past the first segment seg_rows does too.
template <typename B>
__device__ __forceinline__ B* row_at(B* base, B* const* segs, i64 seg_rows, int d, i64 row) {
    if (seg_rows == 0) return base + (i64)d * row;
    if (d < seg_rows) return segs[0] + (i64)d * row;
    const int s = d / (int)seg_rows;
    return segs[s] + (i64)(d - s * (int)seg_rows) * row;
}

// A store that evicts first: the outputs are written once and not read
// again by the kernel.
template <typename Vt>
__device__ __forceinline__ void store_once(Vt* dst, Vt v) { __stcs(dst, v); }

// permute: a token's row is read once per ROUTE_CHUNK routes (once for
// top-k <= 32), U vectors per thread at a time, and written to each route.
// The chunk's routes are checked once and staged in shared memory (-1: a
// route skipped as invalid), so the copy loop reads rows from shared memory
// and checks nothing. The unwritten rows are zeroed first.
#define ROUTE_CHUNK 32
template <int V, int U, bool WARP>
__device__ void permute_body(const PermuteParams& p) {
    typedef typename VecT<V>::T Vt;
    const Group<WARP> g;
    const i64 T = p.tokens, row = p.row, N = p.out_rows;
    const int E = (int)p.experts, S = (int)p.nscales;
    __shared__ int staged[MAX_WARPS][ROUTE_CHUNK];
    int* rows = staged[g.slot];
    const i64 nv = row / V;
    zero_regions<V>(p);
    // The map is read ahead, so that a token starts with its row loads,
    // not a chain of map reads: the route count two tokens ahead and,
    // for this thread's first route (k = g.first), the (row, expert) of
    // the next token (read only below the count, and inside the row).
    const int* const map = p.map;
    const i64 stride = 2 * (i64)E + 1;
    auto count_at = [&](i64 t) { return t < T ? map[t * stride + 2 * E] : 0; };
    auto entry_at = [&](i64 t, int c, int& d, int& e) {
        d = -1;
        e = -1;
        if (t < T && g.first < min(c, E)) {
            d = map[t * stride + g.first];
            e = map[t * stride + E + g.first];
        }
    };
    int c1 = count_at(g.t0), c2 = count_at(g.t0 + g.tstep), d1, e1;
    entry_at(g.t0, c1, d1, e1);
    for (i64 t = g.t0; t < T; t += g.tstep) {
        const int* m = map + t * stride;
        const int n = count_ok(c1, E), my_d = d1, my_e = e1;
        entry_at(t + g.tstep, c2, d1, e1);
        c1 = c2;
        c2 = count_at(t + 2 * g.tstep);
        for (int k0 = 0; k0 < n; k0 += ROUTE_CHUNK) {
            const int kn = min(ROUTE_CHUNK, n - k0);
            g.sync();  // the previous chunk's readers are done
            for (int j = g.first; j < kn; j += g.step) {
                const int k = k0 + j;
                // k < n <= the count read ahead, so k == g.first was read.
                const int d = k == g.first ? my_d : m[k], e = k == g.first ? my_e : m[E + k];
                const bool ok = entry_ok(d, e, E, N);
                rows[j] = ok ? d : -1;
                if (ok && p.pprobs) p.pprobs[d] = p.probs[t * E + e];
            }
            g.sync();
            if (p.pscales) {
                for (i64 i = g.first; i < (i64)kn * S; i += g.step) {
                    const int d = rows[i / S];
                    if (d >= 0) p.pscales[(i64)d * S + i % S] = p.scales[t * S + i % S];
                }
            }
            const Vt* src = (const Vt*)(p.input + t * row);
            for (i64 base = g.first; base < nv; base += (i64)g.step * U) {
                Vt r[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    i64 i = base + (i64)u * g.step;
                    if (i < nv) r[u] = src[i];
                }
                for (int k = 0; k < kn; ++k) {
                    const int d = rows[k];
                    if (d < 0) continue;
                    Vt* dst = (Vt*)row_at(p.out, p.segs, p.seg_rows, d, row);
#pragma unroll
                    for (int u = 0; u < U; ++u) {
                        i64 i = base + (i64)u * g.step;
                        if (i < nv) store_once(dst + i, r[u]);
                    }
                }
            }
        }
    }
}

// permute through the bulk-copy engine (sm_90+; rows and every address in
// 16-byte units): a block's items (a token's row, or a piece of it of
// p.piece bytes) land in shared memory by `cp.async.bulk` loads, STAGES of
// them in flight, and leave by one bulk store per route, so no thread
// moves row data. A block is two warps:
// - the mover (warp 0): lane 0 issues every bulk copy, item j's load into
//   stage j % STAGES (completing on full[stage]), its stores once that
//   completes and, once item j - 1's stores have read their stage, the
//   load of item j - 1 + STAGES there. Each stage's map row (count, and
//   lane k: route k's row and expert) is read into the lanes' registers
//   STAGES items ahead and checked when used, so no iteration waits on a
//   map read, and no thread reads what another wrote: the only hand-off
//   is the bulk copies' own, through full[].
// - the router (warp 1) copies the probs and scales of the block's tokens
//   (first pieces), on its own.
// Routes past the 32nd are read from the map when used. The unwritten
// rows are zeroed first, as in permute_body.
// The barriers and bulk copies are xcall-core's device helpers (MBARRIER,
// BULK_COPY), prepended to this source.
template <int STAGES>
__device__ void permute_bulk_body(const PermuteParams& p) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char bulk_buf[];
    __shared__ __align__(8) unsigned long long full[STAGES];
    const i64 T = p.tokens, row = p.row, N = p.out_rows, piece = p.piece, S = p.nscales;
    const int E = (int)p.experts, lane = (int)(threadIdx.x & 31);
    const i64 slices = (row + piece - 1) / piece, items = T * slices;
    const i64 mine = (i64)blockIdx.x < items ? (items - 1 - (i64)blockIdx.x) / gridDim.x + 1 : 0;
    const i64 stride = 2 * (i64)E + 1;
    auto item = [&](i64 j) { return (i64)blockIdx.x + j * gridDim.x; };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s)
            mbar_init(smem_addr(&full[s]), 1);
        fence_mbarrier_init();
    }
    zero_regions<16>(p);
    __syncthreads();  // the barriers are set
    if (threadIdx.x < 32) {
        // Item j's piece into stage s (lane 0).
        auto load = [&](int s, i64 j) {
            const i64 it = item(j), t = it / slices, off = (it % slices) * piece;
            const unsigned int bytes = (unsigned int)min(piece, row - off);
            const unsigned int bar = smem_addr(&full[s]), dst = smem_addr(bulk_buf + s * piece);
            bulk_load_arrive(dst, p.input + t * row + off, bytes, bar);
        };
        // Item j's map row, unchecked: count, and lane k's route k (lanes
        // below E; the row holds 2E + 1 entries whatever the count).
        int cnt[STAGES], rd[STAGES], re[STAGES];
        auto fetch = [&](int s, i64 j) {
            const int* m = p.map + (item(j) / slices) * stride;
            cnt[s] = m[2 * E];
            rd[s] = lane < E ? m[lane] : -1;
            re[s] = lane < E ? m[E + lane] : -1;
        };
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            if (s < mine) {
                fetch(s, s);
                if (lane == 0) load(s, s);
            }
        }
        for (i64 j0 = 0; j0 < mine; j0 += STAGES) {
#pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                const i64 j = j0 + s;
                if (j >= mine) break;
                const i64 it = item(j), t = it / slices, off = (it % slices) * piece;
                const unsigned int bytes = (unsigned int)min(piece, row - off), src = smem_addr(bulk_buf + s * piece);
                const int n = count_ok(cnt[s], E);
                const int d = lane < n && entry_ok(rd[s], re[s], E, N) ? rd[s] : -1;
                if (lane == 0) mbar_wait(smem_addr(&full[s]), (unsigned int)(j / STAGES) & 1u);
                __syncwarp();
                for (int k = 0; k < min(n, 32); ++k) {
                    const int dk = __shfl_sync(0xffffffffu, d, k);
                    if (lane == 0 && dk >= 0) {
                        bulk_store(row_at(p.out, p.segs, p.seg_rows, dk, row) + off, src, bytes);
                    }
                }
                if (lane == 0) {
                    const int* m = p.map + t * stride;
                    for (int k = 32; k < n; ++k) {
                        if (!entry_ok(m[k], m[E + k], E, N)) continue;
                        bulk_store(row_at(p.out, p.segs, p.seg_rows, m[k], row) + off, src, bytes);
                    }
                    bulk_commit();
                }
                if (j + STAGES < mine) fetch(s, j + STAGES);
                if (lane == 0) {
                    // Item j - 1's stores have read their stage: load into it.
                    bulk_wait_read<1>();
                    if (j >= 1 && j - 1 + STAGES < mine) load((s + STAGES - 1) % STAGES, j - 1 + STAGES);
                }
            }
        }
        if (lane == 0) bulk_wait<0>();
    } else if (threadIdx.x < 64 && (p.pprobs || p.pscales)) {
        for (i64 j = 0; j < mine; ++j) {
            const i64 it = item(j), t = it / slices;
            if (it % slices != 0) continue;
            const int* m = p.map + t * stride;
            const int n = route_count(m, E);
            for (int k0 = 0; k0 < n; k0 += 32) {
                const int k = k0 + lane;
                int d = -1, e = -1;
                if (k < n && entry_ok(m[k], m[E + k], E, N)) {
                    d = m[k];
                    e = m[E + k];
                }
                if (d >= 0 && p.pprobs) p.pprobs[d] = p.probs[t * E + e];
                if (p.pscales) {
                    for (int q = 0; q < min(32, n - k0); ++q) {
                        const int dq = __shfl_sync(0xffffffffu, d, q);
                        if (dq < 0) continue;
                        for (i64 i = lane; i < S; i += 32) p.pscales[(i64)dq * S + i] = p.scales[t * S + i];
                    }
                }
            }
        }
    }
#endif
}

// sort_chunks_by_map: forward scatters, backward gathers.
template <int V, int U, bool WARP>
__device__ void sort_body(const SortParams& p) {
    typedef typename VecT<V>::T Vt;
    const Group<WARP> g;
    const i64 T = p.tokens, row = p.row;
    const i64 nv = row / V;
    for (i64 t = g.t0; t < T; t += g.tstep) {
        i64 m = p.map[t];
        if (m < 0 || m >= T) {
            if (g.first == 0) atomicOr(&xcall_map_faults, FAULT_SORT_MAP);
            continue;
        }
        i64 s = p.backward ? m : t, d = p.backward ? t : m;
        if (p.pprobs && g.first == 0) p.pprobs[d] = p.probs[s];
        const Vt* src = (const Vt*)(p.input + s * row);
        Vt* dst = (Vt*)(p.out + d * row);
        for (i64 base = g.first; base < nv; base += (i64)g.step * U) {
            Vt r[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                i64 i = base + (i64)u * g.step;
                if (i < nv) r[u] = src[i];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                i64 i = base + (i64)u * g.step;
                if (i < nv) store_once(dst + i, r[u]);
            }
        }
    }
}

// ------------------------------------------------------------ arithmetic
// One fp8 token's output row from its one route's row s0 (bytes mapped,
// F8::alone4) or (TWO) its two routes' rows s0 and s1 (summed in f16,
// F8::pair4), U vectors per thread at a time.
template <typename C, int V, int U, bool TWO>
__device__ __forceinline__ void few_row(int first, int step, i64 nv, const Pack<C, V>* s0, const Pack<C, V>* s1,
                                        Pack<C, V>* dst) {
    for (i64 base = first; base < nv; base += (i64)step * U) {
        Pack<C, V> a[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 i = base + (i64)u * step;
            if (i < nv) {
                load_global(a[u].raw, &s0[i].raw);
                if (TWO) load_global(b[u].raw, &s1[i].raw);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 i = base + (i64)u * step;
            if (i >= nv) continue;
            unsigned int* w = reinterpret_cast<unsigned int*>(&a[u].raw);
            const unsigned int* x = reinterpret_cast<const unsigned int*>(&b[u].raw);
#pragma unroll
            for (int q = 0; q < V / 4; ++q) w[q] = TWO ? C::pair4(w[q], x[q]) : C::alone4(w[q]);
            store_once(&dst[i].raw, a[u].raw);
        }
    }
}

// acc += the elements of pk (times wk where `weighted`; else wk is 1 and
// x * 1 is x, NaN included, so the multiply is left out), in f32.
template <typename C, int V>
__device__ __forceinline__ void accumulate(float (&acc)[V / sizeof(typename C::S)], const Pack<C, V>& pk, float wk,
                                           bool weighted) {
    constexpr int EV = V / sizeof(typename C::S);
    if (weighted) {
#pragma unroll
        for (int j = 0; j < EV; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(C::load(pk.v[j]), wk));
    } else if constexpr (sizeof(typename C::S) == 1 && V % 4 == 0) {
        // fp8: converted a word (four values) at a time.
        const unsigned int* w = reinterpret_cast<const unsigned int*>(&pk.raw);
#pragma unroll
        for (int q = 0; q < V / 4; ++q) {
            float x[4];
            C::load4(w[q], x);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[4 * q + j] = __fadd_rn(acc[4 * q + j], x[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < EV; ++j) acc[j] = __fadd_rn(acc[j], C::load(pk.v[j]));
    }
}

// The sums acc in codec C's elements.
template <typename C, int V>
__device__ __forceinline__ Pack<C, V> sums(const float (&acc)[V / sizeof(typename C::S)]) {
    Pack<C, V> pk;
    if constexpr (sizeof(typename C::S) == 1 && V % 4 == 0) {
        unsigned int* w = reinterpret_cast<unsigned int*>(&pk.raw);
#pragma unroll
        for (int q = 0; q < V / 4; ++q) w[q] = C::store4(&acc[4 * q]);
    } else {
#pragma unroll
        for (int j = 0; j < (int)(V / sizeof(typename C::S)); ++j) pk.v[j] = C::store(acc[j]);
    }
    return pk;
}

// Routes whose vectors one stage of unpermute's async path holds.
#define ASYNC_ROUTES 8

// unpermute's async path, one warp's token of n <= ASYNC_ROUTES staged
// routes (srcs, wts; a null source: a skipped route). The routes' 16-byte
// vectors are copied into `buf` (the warp's S stages of ASYNC_ROUTES x 32
// vectors) by cp.async, which holds no registers, so the next S - 1
// chunks of the row (32 vectors of every route each) are in flight while
// one is summed. A lane copies and reads only its own vectors, so no lane
// waits on another. Routes are summed in route order, as on the other
// paths.
template <typename C, int S>
__device__ __forceinline__ void async_sum(int lane, i64 nv, const Pack<C, 16>* const* srcs, const float* wts, int n,
                                          bool weighted, uint4* buf, Pack<C, 16>* dst) {
    typedef Pack<C, 16> P;
    constexpr int EV = 16 / sizeof(typename C::S);
    const P* src[ASYNC_ROUTES];
    float w[ASYNC_ROUTES];
#pragma unroll
    for (int r = 0; r < ASYNC_ROUTES; ++r) {
        src[r] = r < n ? srcs[r] : nullptr;
        w[r] = r < n ? wts[r] : 1.0f;
    }
    // Chunk c's vectors into stage `stage` (nothing past the row; the
    // group is committed either way, so the count of groups stays even).
    auto issue = [&](i64 c, int stage) {
        const i64 i = c * 32 + lane;
        if (i < nv) {
#pragma unroll
            for (int r = 0; r < ASYNC_ROUTES; ++r)
                if (src[r]) copy_async16(buf + (stage * ASYNC_ROUTES + r) * 32 + lane, &src[r][i].raw);
        }
        commit_async();
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j, j);
    int next = S - 1, stage = 0;  // the stages of chunk c + S - 1 and of chunk c
    for (i64 i = lane, c = 0; c * 32 < nv; i += 32, ++c) {
        issue(c + S - 1, next);
        next = next + 1 == S ? 0 : next + 1;
        wait_async<S - 1>();  // chunk c has landed
        if (i < nv) {
            float acc[EV];
#pragma unroll
            for (int j = 0; j < EV; ++j) acc[j] = 0.0f;
#pragma unroll
            for (int r = 0; r < ASYNC_ROUTES; ++r) {
                if (src[r]) {
                    P pk;
                    pk.raw = buf[(stage * ASYNC_ROUTES + r) * 32 + lane];
                    accumulate<C, 16>(acc, pk, w[r], weighted);
                }
            }
            store_once(&dst[i].raw, sums<C, 16>(acc).raw);
        }
        stage = stage + 1 == S ? 0 : stage + 1;
    }
}

// unpermute: each element sums its routes in route order in f32:
// acc = acc + x * w (weight 1 without merging probs). A warp stages its
// first ROUTE_CHUNK routes' source rows (their addresses, segments
// resolved; null: a route skipped as invalid) and weights in shared
// memory; other routes are read from the map. The unpermuted probs are
// zeroed and then each valid route writes its expert's (the last valid
// route of an expert wins).
// fp8 is unpermuted without merging probs only (the launch refuses them),
// so its kernels carry no weighted path.
// FEW (fp8 without probs): 1 (launched when the map has at most one
// route per token on average): a token with one valid route maps its
// row's bytes instead of converting them; 2 (at most two on average): a
// token with two valid routes also sums them in f16 (see F8::pair4). The
// other tokens take the summing path. A template argument, so that each
// kernel keeps the registers of the paths it needs.
// LOADS (1 or 2): routes whose loads go out together in the summing path;
// 2 (the `l2_` kernels) pays at many routes per token and costs at one or
// two, so the launch picks it by routes per token.
// ASYNC (warp kernels, 16-byte vectors; the `a{S}_` kernels): a token's
// routes are summed by async_sum with ASYNC stages in the block's dynamic
// shared memory (ASYNC x ASYNC_ROUTES x 512 bytes per warp), unless it
// has more than ASYNC_ROUTES routes.
// STREAM (fp8's `s_` kernels, 16-byte vectors, launched at three or more
// routes per token on average): the summing path reads the routes' rows
// with streaming loads (load_streaming). Each permuted row is read once.
template <typename C, int V, int U, bool WARP, int FEW = 0, int LOADS = 1, int ASYNC = 0, bool STREAM = false>
__device__ void unpermute_body(const UnpermuteParams& p) {
    static_assert(ASYNC == 0 || (WARP && V == 16 && FEW == 0 && LOADS == 1), "the async path is a warp's, 16-byte vectors");
    static_assert(!STREAM || V == 16, "streaming loads are 16-byte vectors");
    typedef Pack<C, V> P;
    constexpr bool FP8 = sizeof(typename C::S) == 1;
    const Group<WARP> g;
    const int* map = p.map;
    const float* mprobs = FP8 ? nullptr : p.mprobs;
    const i64 T = p.tokens, H = p.hidden, N = p.out_rows;
    const int E = (int)p.experts;
    const int EV = V / sizeof(typename C::S);
    const i64 row = H * (i64)sizeof(typename C::S);
    const i64 nv = row / V;
    __shared__ const P* staged_src[MAX_WARPS][ROUTE_CHUNK];
    __shared__ float staged_w[MAX_WARPS][ROUTE_CHUNK];
    const P** srcs = staged_src[g.slot];
    float* wts = staged_w[g.slot];
    for (i64 t = g.t0; t < T; t += g.tstep) {
        const int* m = map + t * (2 * E + 1);
        const int n = route_count(m, E);
        if (p.oprobs) {
            for (int e = g.first; e < E; e += g.step) p.oprobs[t * E + e] = 0.0f;
            g.sync();
            for (int k = g.first; k < n; k += g.step) {
                if (!route_ok(m, k, E, N)) continue;
                bool last = true;
                for (int j = k + 1; j < n; ++j) last &= !(m[E + j] == m[E + k] && route_ok(m, j, E, N));
                if (last) p.oprobs[t * E + m[E + k]] = p.pprobs[m[k]];
            }
        }
        // Route k's source row (null: skipped as invalid) and weight, from
        // the map.
        auto from_map = [&](int k, float& wk) -> const P* {
            const bool ok = route_ok(m, k, E, N);
            wk = ok && mprobs ? mprobs[t * E + m[E + k]] : 1.0f;
            return ok ? (const P*)row_at(p.input, p.segs, p.seg_rows, m[k], row) : nullptr;
        };
        // A warp stages its first routes; a block reads them from the map
        // (two block barriers per token cost more than the reads).
        const int staged_n = WARP ? min(n, ROUTE_CHUNK) : 0;
        if (WARP) {
            g.sync();  // the previous token's readers are done
            for (int k = g.first; k < staged_n; k += g.step) srcs[k] = from_map(k, wts[k]);
            g.sync();
        }
        // Route k's source row (null: skipped) and weight.
        auto route_at = [&](int k, float& wk) -> const P* {
            if (k < staged_n) {
                wk = wts[k];
                return srcs[k];
            }
            return from_map(k, wk);
        };
        if constexpr (FEW > 0 && FP8 && V % 4 == 0) {
            // fp8, few routes and no probs: a word (four values) at a
            // time, with no f32 steps (the conversions, not the memory,
            // bound the summing path). s0, s1: the valid routes' rows in
            // route order, null past them.
            const P *s0 = nullptr, *s1 = nullptr;
            if (n >= 1 && n <= FEW) {
                for (int k = 0; k < n; ++k) {
                    float unused;  // 1: fp8 has no weights
                    const P* s = route_at(k, unused);
                    if (s) (s0 ? s1 : s0) = s;
                }
            }
            if (s0) {
                P* dst = (P*)(p.out + t * row);
                if (!s1) few_row<C, V, U, false>(g.first, g.step, nv, s0, s0, dst);
                else if constexpr (FEW >= 2) few_row<C, V, U, true>(g.first, g.step, nv, s0, s1, dst);
                continue;
            }
        }
        if constexpr (ASYNC > 0) {
            if (n <= ASYNC_ROUTES) {  // every route staged, one stage's worth
                extern __shared__ uint4 async_buf[];
                async_sum<C, ASYNC>(g.first, nv, srcs, wts, n, mprobs != nullptr,
                                    async_buf + g.slot * ASYNC * ASYNC_ROUTES * 32, (P*)(p.out + t * row));
                continue;
            }
        }
        for (i64 base = g.first; base < nv; base += (i64)g.step * U) {
            float acc[U][EV];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < EV; ++j) acc[u][j] = 0.0f;
            auto load = [&](P (&pk)[U], const P* src) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    i64 i = base + (i64)u * g.step;
                    if (i >= nv) continue;
                    if constexpr (STREAM) load_streaming(pk[u].raw, &src[i].raw);
                    else load_global(pk[u].raw, &src[i].raw);
                }
            };
            auto add = [&](const P (&pk)[U], float wk) {
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (base + (i64)u * g.step < nv) accumulate<C, V>(acc[u], pk[u], wk, mprobs != nullptr);
            };
            // A route's vectors added, or two routes' loads out before
            // either is added (LOADS 2); null: a skipped route.
            auto one = [&](const P* s, float wk) {
                if (!s) return;
                P a[U];
                load(a, s);
                add(a, wk);
            };
            auto two = [&](const P* s0, float w0, const P* s1, float w1) {
                P a[U], b[U];
                if (s0) load(a, s0);
                if (s1) load(b, s1);
                if (s0) add(a, w0);
                if (s1) add(b, w1);
            };
            // The routes in route order: the staged ones, which check
            // nothing but a skipped route, then the rest from the map.
            if constexpr (LOADS == 2) {
                for (int k = 0; k < staged_n; k += 2) {
                    const bool pair = k + 1 < staged_n;
                    two(srcs[k], wts[k], pair ? srcs[k + 1] : nullptr, pair ? wts[k + 1] : 1.0f);
                }
                for (int k = staged_n; k < n; k += 2) {
                    float w0, w1 = 1.0f;
                    const P* s0 = from_map(k, w0);
                    const P* s1 = k + 1 < n ? from_map(k + 1, w1) : nullptr;
                    two(s0, w0, s1, w1);
                }
            } else {
                for (int k = 0; k < staged_n; ++k) one(srcs[k], wts[k]);
                for (int k = staged_n; k < n; ++k) {
                    float wk;
                    const P* s = from_map(k, wk);
                    one(s, wk);
                }
            }
            P* dst = (P*)(p.out + t * row);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                i64 i = base + (i64)u * g.step;
                if (i < nv) store_once(&dst[i].raw, sums<C, V>(acc[u]).raw);
            }
        }
    }
}

// Route k's expert when k < n and the route is valid (route_ok), else -1.
__device__ __forceinline__ int valid_expert(const int* m, int k, int n, int E, i64 N) {
    return k < n && route_ok(m, k, E, N) ? m[E + k] : -1;
}

// unpermute_backward's probs gradient of token row `m`: 0 for each expert
// that no valid route reaches, for the experts of chunks first, first +
// step, ... (chunk c: experts 32 c .. 32 c + 31, expert 32 c + l written by
// lane l). A whole warp calls it, uniformly; `lane_e` is
// valid_expert(m, lane, n, E, N), which the caller may have loaded early.
// Up to 32 chunks (E <= 1024), the routes' experts go once to the lanes
// that own them (n shuffles, whatever E); beyond, each lane looks through
// the routes for each of its experts.
__device__ void zero_unrouted(const int* m, int n, int E, i64 N, float* row, int first, int step, int lane_e) {
    const int lane = threadIdx.x & 31;
    const int chunks = (E + 31) / 32;
    if (chunks > 32) {
        for (int e = 32 * first + lane; e < E; e += 32 * step) {
            bool routed = false;
            for (int k = 0; k < n; ++k) routed |= m[E + k] == e && route_ok(m, k, E, N);
            if (!routed) row[e] = 0.0f;
        }
        return;
    }
    unsigned int routed = 0;  // bit c: expert 32 c + lane
    for (int base = 0; base < n; base += 32) {
        const int mine = base == 0 ? lane_e : valid_expert(m, base + lane, n, E, N);
        for (int j = 0; j < 32 && base + j < n; ++j) {
            const int e = __shfl_sync(0xffffffffu, mine, j);
            if (e >= 0 && (e & 31) == lane) routed |= 1u << (e >> 5);
        }
    }
    for (int c = first; c < chunks; c += step) {
        const int e = 32 * c + lane;
        if (e < E && !((routed >> c) & 1u)) row[e] = 0.0f;
    }
}

// A token's route count and its first 32 routes, loaded at once (lane k:
// route k's row, expert and weight) rather than the routes after the count:
// with many experts the count and the routes lie in different lines, and
// with short rows those waits, not the rows, set the pace. Entries past the
// count are read (the row has 2E + 1) but checked and used only below it.
// A whole warp builds it and calls route(), uniformly.
struct TokenRoutes {
    int n, d, x;
    bool ok;
    float w;
    __device__ TokenRoutes(const int* m, i64 t, int E, i64 N, const float* mprobs) {
        const int lane = threadIdx.x & 31;
        const int raw_n = m[2 * E];
        d = lane < E ? m[lane] : -1;
        x = lane < E ? m[E + lane] : -1;
        n = count_ok(raw_n, E);
        ok = lane < n && entry_ok(d, x, E, N);
        w = ok ? mprobs[t * E + x] : 0.0f;
    }
    // This lane's route's expert, or -1 (see zero_unrouted).
    __device__ int lane_expert() const { return ok ? x : -1; }
    // Route k < n: whether it is valid (route_ok), and its row, expert and
    // weight if so.
    __device__ bool route(const int* m, int k, i64 t, int E, i64 N, const float* mprobs, int& rd, int& re,
                          float& rw) const {
        if (k < 32) {
            if (!__shfl_sync(0xffffffffu, ok, k)) return false;
            rd = __shfl_sync(0xffffffffu, d, k);
            re = __shfl_sync(0xffffffffu, x, k);
            rw = __shfl_sync(0xffffffffu, w, k);
            return true;
        }
        if (!route_ok(m, k, E, N)) return false;
        rd = m[k];
        re = m[E + k];
        rw = mprobs[t * E + re];
        return true;
    }
};

// unpermute_backward: one block of 256 / A threads per token. For each
// route: act_grad[dst] = g * w, and the dot(fwd_input[dst], g) in the
// crate's fixed order: 16-byte group q adds element by element into slot
// q % 256, then the 256 slots fold pairwise (see ops::DOT_SLOTS).
template <typename C, int V, int A>
__device__ void unpermute_bwd_body(const UnpermuteParams& p) {
    typedef typename C::S S;
    const unsigned char* grad = p.input;
    const int* map = p.map;
    const float* mprobs = p.mprobs;
    float* pgrad = p.oprobs;
    const i64 T = p.tokens, H = p.hidden, N = p.out_rows;
    const int E = (int)p.experts;
    typedef Pack<C, V> P;
    const int GE = 16 / sizeof(S);  // elements per group
    const int EV = V / sizeof(S);   // elements per vector (divides GE)
    const i64 groups = (H + GE - 1) / GE;
    __shared__ float part[256];
    for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
        const int* m = map + t * (2 * E + 1);
        const TokenRoutes r(m, t, E, N, mprobs);
        const int n = r.n;
        zero_unrouted(m, n, E, N, pgrad + t * E, threadIdx.x >> 5, blockDim.x >> 5, r.lane_expert());
        const S* g = (const S*)(grad + t * H * sizeof(S));
        for (int k = 0; k < n; ++k) {
            int d, e;
            float w;
            if (!r.route(m, k, t, E, N, mprobs, d, e, w)) continue;  // uniform across the block
            const S* x = (const S*)(p.fwd + (i64)d * H * sizeof(S));
            S* a = (S*)(p.out + (i64)d * H * sizeof(S));
            float acc[A];
#pragma unroll
            for (int s = 0; s < A; ++s) acc[s] = 0.0f;
            int slot = 0;
            for (i64 q = threadIdx.x; q < groups; q += blockDim.x) {
                i64 j0 = q * GE;
                float sum = acc[0];
#pragma unroll
                for (int s = 1; s < A; ++s)
                    if (slot == s) sum = acc[s];
                if (j0 + GE <= H) {
#pragma unroll
                    for (int v = 0; v < GE / EV; ++v) {
                        P pg, px, pa;
                        pg.raw = ((const P*)(g + j0))[v].raw;
                        px.raw = ((const P*)(x + j0))[v].raw;
#pragma unroll
                        for (int j = 0; j < EV; ++j) {
                            float gv = C::load(pg.v[j]);
                            pa.v[j] = C::store(__fmul_rn(gv, w));
                            sum = __fadd_rn(sum, __fmul_rn(C::load(px.v[j]), gv));
                        }
                        ((P*)(a + j0))[v].raw = pa.raw;
                    }
                } else {
                    for (i64 j = j0; j < H; ++j) {
                        float gv = C::load(g[j]);
                        a[j] = C::store(__fmul_rn(gv, w));
                        sum = __fadd_rn(sum, __fmul_rn(C::load(x[j]), gv));
                    }
                }
#pragma unroll
                for (int s = 0; s < A; ++s)
                    if (slot == s) acc[s] = sum;
                slot = slot + 1 == A ? 0 : slot + 1;
            }
#pragma unroll
            for (int s = 0; s < A; ++s) part[threadIdx.x + s * blockDim.x] = acc[s];
            __syncthreads();
            for (int width = 128; width > 0; width >>= 1) {
                for (int s = threadIdx.x; s < width; s += blockDim.x) part[s] = __fadd_rn(part[s], part[s + width]);
                __syncthreads();
            }
            if (threadIdx.x == 0) pgrad[t * E + e] = part[0];
            __syncthreads();
        }
    }
}

// The fold of 256 dot slots a warp holds eight per lane (lane l: slots
// l + 32 s): the halves 128, 64 and 32 within the lane, then 16 .. 1 by
// shuffles, the crate's order (see ops::DOT_SLOTS); lane 0 gets the sum.
// The slots are folded in place.
__device__ __forceinline__ float fold_slots(float (&s)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = __fadd_rn(s[i], s[i + 4]);
#pragma unroll
    for (int i = 0; i < 2; ++i) s[i] = __fadd_rn(s[i], s[i + 2]);
    float v = __fadd_rn(s[0], s[1]);
#pragma unroll
    for (int width = 16; width > 0; width >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, width));
    return v;
}

// unpermute_backward, one warp per token with the block variant's 256 dot
// slots in registers: lane l holds slots l + 32 s (s < 8), so group q goes
// to lane q % 32, register (q / 32) % 8, as in the block variant; the fold
// halves 128, 64 and 32 stay in a lane and 16 .. 1 are shuffles, the same
// additions in the same order. With p.split = S > 1, S warps share a token:
// warp j takes routes j, j + S, ... and the probs gradient's expert chunks
// j, j + S, ... (T x S warps' worth of work, each route's dot in one warp as
// before). The token's routes come from TokenRoutes.
template <typename C, int V>
__device__ void unpermute_bwd_warp_body(const UnpermuteParams& p) {
    typedef typename C::S S;
    typedef Pack<C, V> P;
    const int* map = p.map;
    const i64 T = p.tokens, H = p.hidden, N = p.out_rows;
    const int E = (int)p.experts;
    const int GE = 16 / sizeof(S);
    const int EV = V / sizeof(S);
    const i64 full = H / GE;  // whole 16-byte groups
    const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    const int split = p.split > 1 ? (int)p.split : 1;
    for (i64 item = (i64)blockIdx.x * wpb + (threadIdx.x >> 5); item < T * split; item += (i64)gridDim.x * wpb) {
        const i64 t = item / split;
        const int part = (int)(item % split);
        const int* m = map + t * (2 * E + 1);
        const TokenRoutes r(m, t, E, N, p.mprobs);
        const int n = r.n;
        zero_unrouted(m, n, E, N, p.oprobs + t * E, part, split, r.lane_expert());
        const S* g = (const S*)(p.input + t * H * sizeof(S));
        for (int k = part; k < n; k += split) {
            int d, e;
            float w;
            if (!r.route(m, k, t, E, N, p.mprobs, d, e, w)) continue;  // uniform across the warp
            const S* x = (const S*)(p.fwd + (i64)d * H * sizeof(S));
            S* a = (S*)(p.out + (i64)d * H * sizeof(S));
            float acc[8];
#pragma unroll
            for (int s = 0; s < 8; ++s) acc[s] = 0.0f;
            // Whole groups: the eight groups of a lane are loaded before any
            // store (a store may alias the loads, so the compiler would not
            // move them ahead of one).
            for (i64 q0 = lane; q0 < full; q0 += 256) {
                P pg[8][GE / EV], px[8][GE / EV];
#pragma unroll
                for (int s = 0; s < 8; ++s) {
                    const i64 q = q0 + 32 * s;
                    if (q < full) {
#pragma unroll
                        for (int v = 0; v < GE / EV; ++v) {
                            pg[s][v].raw = ((const P*)(g + q * GE))[v].raw;
                            px[s][v].raw = ((const P*)(x + q * GE))[v].raw;
                        }
                    }
                }
#pragma unroll
                for (int s = 0; s < 8; ++s) {
                    const i64 q = q0 + 32 * s;
                    if (q < full) {
#pragma unroll
                        for (int v = 0; v < GE / EV; ++v) {
                            P pa;
#pragma unroll
                            for (int j = 0; j < EV; ++j) {
                                float gv = C::load(pg[s][v].v[j]);
                                pa.v[j] = C::store(__fmul_rn(gv, w));
                                acc[s] = __fadd_rn(acc[s], __fmul_rn(C::load(px[s][v].v[j]), gv));
                            }
                            store_once(&((P*)(a + q * GE))[v].raw, pa.raw);
                        }
                    }
                }
            }
            // A partial last group comes last in its slot, as in the block
            // variant.
            if (full * GE < H && lane == (int)(full % 32)) {
                const int slot = (int)((full / 32) % 8);
#pragma unroll
                for (int s = 0; s < 8; ++s) {
                    if (s != slot) continue;
                    for (i64 j = full * GE; j < H; ++j) {
                        float gv = C::load(g[j]);
                        a[j] = C::store(__fmul_rn(gv, w));
                        acc[s] = __fadd_rn(acc[s], __fmul_rn(C::load(x[j]), gv));
                    }
                }
            }
            const float v = fold_slots(acc);
            if (lane == 0) p.oprobs[t * E + e] = v;
        }
    }
}

// unpermute_backward holding the gradient row: one block of 256 threads per
// token; thread i keeps groups i + 256 j (j < G) of the token's gradient in
// registers for every route of the token (the row is read once, not once
// per route) and sums them into dot slot i, the crate's order (the block
// variant's with one slot per thread). Up to HELD_ROUTES valid routes at a
// time: their x loads go in batches of R, issued before the batch's
// stores; then warp w folds route w's 256 slots as the warp variant does.
// The launch checks that a row is whole 16-byte groups, at most 256 * G.
#define HELD_ROUTES 8
template <typename C, int G, int R>
__device__ void unpermute_bwd_held_body(const UnpermuteParams& p) {
    typedef typename C::S S;
    typedef Pack<C, 16> P;
    const int* map = p.map;
    const i64 T = p.tokens, H = p.hidden, N = p.out_rows;
    const int E = (int)p.experts;
    const int GE = 16 / sizeof(S);
    const i64 full = H / GE;
    __shared__ float part[HELD_ROUTES][256];
    __shared__ int rows[HELD_ROUTES], experts[HELD_ROUTES], taken, next;
    __shared__ float weights[HELD_ROUTES];
    const int i = threadIdx.x, lane = i & 31;
    for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
        const int* m = map + t * (2 * E + 1);
        const int n = route_count(m, E);
        zero_unrouted(m, n, E, N, p.oprobs + t * E, i >> 5, blockDim.x >> 5, valid_expert(m, lane, n, E, N));
        const S* g = (const S*)(p.input + t * H * sizeof(S));
        P pg[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const i64 q = i + 256 * j;
            if (q < full) pg[j].raw = __ldcs((const uint4*)(g + q * GE));
        }
        for (int from = 0;;) {
            // Warp 0 takes the next HELD_ROUTES valid routes from `from`
            // on, in route order: 32 routes checked at once (their map and
            // prob loads in flight together, not one route's after
            // another's), each valid one placed by its rank among them;
            // `next` is the route after the last one taken.
            if (i < 32) {
                int c = 0, after = n;
                for (int base = from; base < n && c < HELD_ROUTES; base += 32) {
                    const int k = base + lane;
                    const bool ok = k < n && route_ok(m, k, E, N);
                    const int d = ok ? m[k] : 0, e = ok ? m[E + k] : 0;
                    const float w = ok ? p.mprobs[t * E + e] : 0.0f;
                    const unsigned int valid = __ballot_sync(0xffffffffu, ok);
                    const int pos = c + __popc(valid & ((1u << lane) - 1u));
                    if (ok && pos < HELD_ROUTES) {
                        rows[pos] = d;
                        experts[pos] = e;
                        weights[pos] = w;
                    }
                    const unsigned int last = __ballot_sync(0xffffffffu, ok && pos == HELD_ROUTES - 1);
                    if (last) after = base + __ffs(last);
                    c = min(c + __popc(valid), HELD_ROUTES);
                }
                if (i == 0) {
                    taken = c;
                    next = after;
                }
            }
            __syncthreads();
            const int c = taken;
            from = next;
            if (c == 0) {
                __syncthreads();  // every thread read `taken` before the next write
                break;
            }
            for (int k0 = 0; k0 < c; k0 += R) {
                P px[R][G];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (k0 + r >= c) continue;
                    const S* x = (const S*)(p.fwd + (i64)rows[k0 + r] * H * sizeof(S));
#pragma unroll
                    for (int j = 0; j < G; ++j) {
                        const i64 q = i + 256 * j;
                        if (q < full) px[r][j].raw = __ldcs((const uint4*)(x + q * GE));
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (k0 + r >= c) continue;
                    const float w = weights[k0 + r];
                    S* a = (S*)(p.out + (i64)rows[k0 + r] * H * sizeof(S));
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < G; ++j) {
                        const i64 q = i + 256 * j;
                        if (q >= full) continue;
                        P pa;
#pragma unroll
                        for (int e = 0; e < GE; ++e) {
                            const float gv = C::load(pg[j].v[e]);
                            pa.v[e] = C::store(__fmul_rn(gv, w));
                            sum = __fadd_rn(sum, __fmul_rn(C::load(px[r][j].v[e]), gv));
                        }
                        store_once((uint4*)(a + q * GE), pa.raw);
                    }
                    part[k0 + r][i] = sum;
                }
            }
            __syncthreads();
            for (int r = i >> 5; r < c; r += blockDim.x >> 5) {
                float s8[8];
#pragma unroll
                for (int s = 0; s < 8; ++s) s8[s] = part[r][lane + 32 * s];
                const float v = fold_slots(s8);
                if (lane == 0) p.oprobs[t * E + experts[r]] = v;
            }
            __syncthreads();  // part, rows and weights are free again
            if (from >= n) break;
        }
    }
}
