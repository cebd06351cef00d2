// Conversions between f32 and bf16 / fp8 bit patterns, rounding to nearest
// even as xcall_core's Host codecs do (bf16: sm_80 and newer; the fp8
// encoders and the e4m3 decoder: sm_89 and newer). Part of
// xcall_core::cuda::device::CONVERT.
#ifndef XCALL_CONVERT_CUH
#define XCALL_CONVERT_CUH
typedef unsigned int u32;

// bf16 -> f32 (exact).
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((u32)h) << 16);
}
// f32 -> bf16, round to nearest even in one instruction; a NaN becomes
// the canonical NaN 0x7fff.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// A 32-bit word of two bf16 (the lower address in the lower half) -> two
// f32.
__device__ __forceinline__ void bf16x2_to_f32(u32 w, float &lo, float &hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
// Two f32 -> a word of two bf16 (`lo` in the lower half).
__device__ __forceinline__ u32 f32_to_bf16x2(float lo, float hi) {
    u32 w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}
// f16 bits -> f32 (exact), without cuda_fp16.h.
__device__ __forceinline__ float xcall_f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// fp8 e5m2 -> f32 (exact: e5m2 is the upper byte of an f16).
__device__ __forceinline__ float fp8e5m2_to_f32(unsigned char b) {
    return xcall_f16_bits_to_f32((unsigned short)(b << 8));
}
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
// fp8 e4m3 (fn: no infinities, NaN 0x7f / 0xff) -> f32 (exact, through
// f16).
__device__ __forceinline__ float fp8e4m3_to_f32(unsigned char b) {
    u32 h2;
    unsigned short in = b;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
    return xcall_f16_bits_to_f32((unsigned short)(h2 & 0xffffu));
}
// Two fp8 e4m3 (the lower address in the lower byte) -> two f32 (exact,
// through f16x2: one conversion for the pair).
__device__ __forceinline__ void fp8e4m3x2_to_f32(unsigned short two, float &lo, float &hi) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
    lo = xcall_f16_bits_to_f32((unsigned short)(h2 & 0xffffu));
    hi = xcall_f16_bits_to_f32((unsigned short)(h2 >> 16));
}
// f32 -> fp8 e4m3, round to nearest even, saturating to +-448 (a NaN stays
// a NaN).
__device__ __forceinline__ unsigned char f32_to_fp8e4m3(float x) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return (unsigned char)(r & 0xffu);
}
// Two f32 -> two fp8 e4m3 (lo in the lower byte: the lower address), as
// f32_to_fp8e4m3 each, in one conversion.
__device__ __forceinline__ unsigned short f32x2_to_fp8e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
// f32 -> fp8 e5m2, round to nearest even, saturating to +-57344 (a NaN
// stays a NaN).
__device__ __forceinline__ unsigned char f32_to_fp8e5m2(float x) {
    unsigned short r;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return (unsigned char)(r & 0xffu);
}
#endif
#endif
