// What the links of one host give an all-to-all, as a ceiling for the
// expert-parallel exchange's figures: every GPU moves C bytes to (or
// from) every other GPU at once, by SM loads from the peers (pull), SM
// stores into the peers (push), or the copy engines (cudaMemcpyPeerAsync,
// one stream per peer). Prints, per case, the median over rounds of the
// slowest GPU's time and the bytes each GPU took in over its links per
// second. Built and run on the GPU machine:
//
//   nvcc -O3 -arch=sm_90 -o link-ceiling scripts/link-ceiling.cu && ./link-ceiling
//
// Launches start from one host thread per GPU released together, so the
// GPUs' kernels overlap within a few microseconds; sizes are large enough
// (from 53 MB per peer, the DeepSeek-V3-like dispatch on four GPUs) that
// the skew is about 1% of a round.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,             \
                         cudaGetErrorString(e_));                                      \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

constexpr int MAXG = 8;
constexpr int UNROLL = 4;
struct Ptrs {
    uint4 *p[MAXG];
};

// This GPU (d) moves a chunk of n 16-byte units with each peer q.
// Pull: loads peer q's chunk for d (peers.p[q] + d*n) into its own
// mine + q*n. Push: loads its own mine + q*n and stores it into peer q's
// peers.p[q] + d*n. Items of 32*UNROLL units go round the peers, starting
// with the next rank up (every moment's traffic spread over the peers).
// `self_too`: d's own chunk as well (a local copy), as a dispatch moves
// its own rows among its peers'.
template <bool PUSH>
__global__ void __launch_bounds__(512) move(Ptrs peers, uint4 *mine, int g, int d, long long n, int self_too) {
    const int lane = threadIdx.x % 32;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const long long per = (n + 32 * UNROLL - 1) / (32 * UNROLL);
    const int turns = self_too ? g : g - 1;
    for (long long item = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; item < per * turns;
         item += warps) {
        const int q = (int)((item % turns + d + 1) % g);
        const long long c0 = item / turns * 32 * UNROLL + lane;
        const uint4 *from = PUSH ? mine + (long long)q * n : peers.p[q] + (long long)d * n;
        uint4 *to = PUSH ? peers.p[q] + (long long)d * n : mine + (long long)q * n;
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (c0 + 32 * u < n) v[u] = from[c0 + 32 * u];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            if (c0 + 32 * u < n) to[c0 + 32 * u] = v[u];
    }
}

enum Mode { PULL, PUSH, COPY_ENGINE };
static const char *mode_name[] = {"pull (SM loads)", "push (SM stores)", "copy engines"};

struct Gpu {
    uint4 *src = nullptr, *dst = nullptr;
    cudaStream_t s[MAXG];
    cudaEvent_t a, z;
};

int main() {
    int g = 0;
    CK(cudaGetDeviceCount(&g));
    if (g < 2) {
        std::printf("SKIP: link-ceiling needs 2 or more GPUs, found %d\n", g);
        return 0;
    }
    g = std::min(g, MAXG);
    const long long max_bytes = 212LL << 20;  // per peer
    std::vector<Gpu> gpu(g);
    Ptrs srcs{}, dsts{};
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    for (int d = 0; d < g; ++d) {
        CK(cudaSetDevice(d));
        for (int q = 0; q < g; ++q)
            if (q != d) {
                int ok = 0;
                CK(cudaDeviceCanAccessPeer(&ok, d, q));
                if (!ok) {
                    std::printf("SKIP: GPU %d cannot reach GPU %d\n", d, q);
                    return 0;
                }
                CK(cudaDeviceEnablePeerAccess(q, 0));
            }
        CK(cudaMalloc(&gpu[d].src, max_bytes * g));
        CK(cudaMalloc(&gpu[d].dst, max_bytes * g));
        // Never time zeros: fill the sources with bytes that differ per GPU.
        CK(cudaMemset(gpu[d].src, 0x3c + d, max_bytes * g));
        CK(cudaMemset(gpu[d].dst, 0, max_bytes * g));
        for (int q = 0; q < g; ++q) CK(cudaStreamCreateWithFlags(&gpu[d].s[q], cudaStreamNonBlocking));
        CK(cudaEventCreate(&gpu[d].a));
        CK(cudaEventCreate(&gpu[d].z));
        srcs.p[d] = gpu[d].src;
        dsts.p[d] = gpu[d].dst;
    }
    for (int d = 0; d < g; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceSynchronize());
    }
    std::printf("%d x %s, every GPU to every other at once; GB/s = bytes each GPU took in over its links "
                "/ the slowest GPU's time (median of rounds)\n",
                g, prop.name);
    const int rounds = 15, warm = 3;
    struct Case {
        Mode m;
        int sms;
        long long bytes;
        int self_too;
    };
    std::vector<Case> cases;
    for (long long bytes : {53LL << 20, 212LL << 20}) {
        for (int sms : {16, 24, 32, 64, prop.multiProcessorCount}) {
            cases.push_back({PULL, sms, bytes, 0});
            cases.push_back({PUSH, sms, bytes, 0});
        }
        cases.push_back({PULL, prop.multiProcessorCount, bytes, 1});
        cases.push_back({PUSH, prop.multiProcessorCount, bytes, 1});
        cases.push_back({COPY_ENGINE, 0, bytes, 0});
    }
    for (const Case &c : cases) {
        const long long n = c.bytes / 16;
        std::vector<double> slowest;
        for (int r = 0; r < warm + rounds; ++r) {
            std::atomic<int> ready{0};
            std::vector<std::thread> th;
            for (int d = 0; d < g; ++d)
                th.emplace_back([&, d] {
                    CK(cudaSetDevice(d));
                    Gpu &G = gpu[d];
                    ready.fetch_add(1);
                    while (ready.load() < g) {
                    }
                    CK(cudaEventRecord(G.a, G.s[0]));
                    if (c.m == PULL) {
                        move<false><<<c.sms, 512, 0, G.s[0]>>>(srcs, G.dst, g, d, n, c.self_too);
                    } else if (c.m == PUSH) {
                        move<true><<<c.sms, 512, 0, G.s[0]>>>(dsts, G.src, g, d, n, c.self_too);
                    } else {
                        for (int q = 0; q < g; ++q) {
                            if (q == d) continue;
                            if (q != 0) CK(cudaStreamWaitEvent(G.s[q], G.a, 0));
                            CK(cudaMemcpyPeerAsync(G.dst + (long long)q * n, d, gpu[q].src + (long long)d * n, q,
                                                   c.bytes, G.s[q]));
                            if (q != 0) {
                                cudaEvent_t e;
                                CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                                CK(cudaEventRecord(e, G.s[q]));
                                CK(cudaStreamWaitEvent(G.s[0], e, 0));
                                CK(cudaEventDestroy(e));
                            }
                        }
                    }
                    CK(cudaGetLastError());
                    CK(cudaEventRecord(G.z, G.s[0]));
                    CK(cudaEventSynchronize(G.z));
                });
            for (auto &t : th) t.join();
            double worst = 0;
            for (int d = 0; d < g; ++d) {
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, gpu[d].a, gpu[d].z));
                worst = std::max(worst, (double)ms);
            }
            if (r >= warm) slowest.push_back(worst);
        }
        std::sort(slowest.begin(), slowest.end());
        const double med = slowest[slowest.size() / 2];
        const double in = (double)c.bytes * (g - 1);
        std::printf("%-18s %3d SMs %s %4lld MB per peer: %.3f ms, %.0f GB/s in over links per GPU\n",
                    mode_name[c.m], c.m == COPY_ENGINE ? 0 : c.sms, c.self_too ? "+own" : "    ",
                    c.bytes >> 20, med, in / med / 1e6);
    }
    // The last pull's bytes arrived: GPU 0's chunk from GPU 1 holds GPU 1's fill.
    unsigned char probe = 0;
    CK(cudaSetDevice(0));
    CK(cudaMemcpy(&probe, (unsigned char *)gpu[0].dst + max_bytes / 16 * 16, 1, cudaMemcpyDeviceToHost));
    std::printf("check: GPU 0 received 0x%02x from GPU 1 (want 0x%02x)\n", probe, 0x3c + 1);
    return probe == 0x3c + 1 ? 0 : 1;
}
