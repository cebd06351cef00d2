// The plain grid-stride kernel of one op (the reference the pipelined
// kernel is measured against): 16-byte vector loads and stores.

extern "C" __global__ void @NAME@(const WsParams p) {
@OPERANDS@    unsigned char *__restrict__ dst = p.dst;
    const u64 bytes = p.bytes;
    const float scale = p.scale;
    (void)scale;
    const u64 chunks = (bytes + 15) / 16;
    for (u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (u64)gridDim.x * blockDim.x) {
        if (c * 16 + 16 <= bytes) {
@VLOADS@        @CTYPE@ out[@PER_VEC@];
        #pragma unroll
        for (u32 k = 0; k < @PER_VEC@u; ++k) {
@VALS@            out[k] = @STORE@(@EXPR@);
        }
        *(uint4 *)(dst + c * 16) = *(const uint4 *)out;
        } else {
        for (u32 k = 0; k < (u32)(bytes - c * 16) / @ELEM@u; ++k) {
@TAIL_VALS@            ((@CTYPE@ *)(dst + c * 16))[k] = @STORE@(@EXPR@);
        }
        }
    }
}
