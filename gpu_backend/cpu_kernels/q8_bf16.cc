// A Q8_0 matrix times bf16 activations with AVX512-BF16 dot products, float32 sums: the tied logits
// head of a decode batch (SmolLM2's 49152 x 576 token-embedding table, Q8_0 in the GGUF).
//
//   Q8_0 GGUF rows --blink_q8bf16_pack (once, at load)--> groups of 16 rows, per 32-value block:
//     [d: 16 float32, one per row][codes: 16 pairs x 16 rows x 2 bf16]   (G16 layout, 1088 bytes)
//   x [M, K] bf16 --blink_q8bf16_matmul--> y [M, N] float32 = x . dequant(W)^T
//
// Why: the head's float-activation matmul (quant.cc's matmul_fx512) is bound by float32 FMAs, 16
// multiply-adds an instruction, and took a third of a 16-row decode step; oneDNN's bf16 GEMM is 2x
// faster but rounds the weights and the logits to bf16, which turns near-ties into ties. Here each
// zmm lane is one weight row: vdpbf16ps multiplies a pair of that row's codes by a pair of x values
// broadcast to every lane (32 multiply-adds an instruction), a block's 16 pairs sum in a float32
// temporary, and one FMA scales the 16 rows' sums by their d. The codes (integers in -127..127) and
// x (bf16 already: the model's activations) are exact in bf16, so every product is exact in float32
// and the result is the dequantized matrix's float32 matmul in another summation order, as
// matmul_fx512's is; d * sum is a float32 multiply of the block's sum (d is an f16, exact in float32).
// The codes take 2 bytes a weight (SmolLM2: 57 MB beside the 30 MB of blocks), so the caller keeps
// the blocks for 1-3 rows, where reading the bytes is the cost, not the arithmetic.
//
// Threads (OpenMP, the caller's count) split the groups; each group's 19.6 KB (K = 576) stay in L1
// while every 8-row chunk of x passes over them.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BLINK_Q8BF16 1
#else
#define BLINK_Q8BF16 0
#endif

extern "C" float blink_f16_to_float(const uint8_t* p);   // quant.cc: an IEEE half, exactly

namespace {

constexpr int64_t QK = 32;                                  // values per Q8_0 block
constexpr int64_t G = 16;                                   // weight rows per group: the lanes of a zmm
constexpr int64_t Q8_BYTES = 2 + QK;                        // a GGUF Q8_0 block: f16 d, 32 int8 codes
constexpr int64_t BLOCK_BYTES = G * 4 + G * QK * 2;         // a group's block in the G16 layout
constexpr int MR = 8;                                       // rows of x a tile

uint16_t int_to_bf16(int v) {                               // |v| <= 256: exact, the top half of the float
    const float f = float(v);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return uint16_t(bits >> 16);
}

#if BLINK_Q8BF16
// y[m0 .. m0+R, n0 .. n0+16) for one group (gp: its first block), x rows m0.. (bf16, row stride ldx).
template <int R>
void tile(const uint8_t* gp, int64_t nb, const uint16_t* x, int64_t ldx, int64_t m0, float* y, int64_t ldy,
          int64_t n0) {
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = gp + b * BLOCK_BYTES;
        const uint16_t* xb = x + m0 * ldx + b * QK;
        __m512 sum[R];
        #pragma GCC unroll 8
        for (int m = 0; m < R; ++m) sum[m] = _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int p = 0; p < QK / 2; ++p) {
            const __m512bh w = (__m512bh)_mm512_loadu_si512(blk + G * 4 + 64 * p);
            // sum[m] += w . (x[m][2p], x[m][2p + 1]) in every lane: the pair broadcast from memory by
            // the instruction itself ({1to16}); GCC 12 loads _mm512_set1_epi32 with a separate
            // vpbroadcastd (5-15% slower at 4-64 rows, alternating runs on Zen 4).
            #pragma GCC unroll 8
            for (int m = 0; m < R; ++m)
                asm("vdpbf16ps %2%{1to16%}, %1, %0"
                    : "+v"(sum[m]) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(xb + m * ldx + 2 * p)));
        }
        const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
        #pragma GCC unroll 8
        for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(sum[m], d, acc[m]);
    }
    #pragma GCC unroll 8
    for (int m = 0; m < R; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + n0, acc[m]);
}

void tile_rows(const uint8_t* gp, int64_t nb, const uint16_t* x, int64_t ldx, int64_t m0, int64_t rows, float* y,
               int64_t ldy, int64_t n0) {
    switch (rows) {
        case 8: tile<8>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 7: tile<7>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 6: tile<6>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 5: tile<5>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 4: tile<4>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 3: tile<3>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        case 2: tile<2>(gp, nb, x, ldx, m0, y, ldy, n0); break;
        default: tile<1>(gp, nb, x, ldx, m0, y, ldy, n0); break;
    }
}
#endif

}  // namespace

// 1 where this build multiplies the G16 layout (the CPU has AVX512-BF16), else 0.
extern "C" int blink_q8bf16_available() { return BLINK_Q8BF16; }

// Bytes of the G16 layout of an N x K Q8_0 matrix, or -1 where it does not exist (N % 16, K % 32).
extern "C" int64_t blink_q8bf16_bytes(int64_t N, int64_t K) {
    if (N <= 0 || K <= 0 || N % G || K % QK) return -1;
    return (N / G) * (K / QK) * BLOCK_BYTES;
}

// out (blink_q8bf16_bytes(N, K) bytes) = the N GGUF Q8_0 rows at w (K values each) in the G16 layout.
// Returns 0, or -1 where the layout does not exist. Plain C++: any CPU can pack.
extern "C" int blink_q8bf16_pack(const void* w, void* out, int64_t N, int64_t K, int threads) {
    if (blink_q8bf16_bytes(N, K) < 0) return -1;
    const auto* src = static_cast<const uint8_t*>(w);
    auto* dst = static_cast<uint8_t*>(out);
    const int64_t nb = K / QK, groups = N / G, rb = nb * Q8_BYTES;
    #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* blk = dst + (g * nb + b) * BLOCK_BYTES;
            float d[G];
            uint16_t codes[QK / 2][G][2];
            for (int64_t r = 0; r < G; ++r) {
                const uint8_t* q8 = src + (g * G + r) * rb + b * Q8_BYTES;
                d[r] = blink_f16_to_float(q8);
                for (int64_t i = 0; i < QK; ++i) codes[i / 2][r][i % 2] = int_to_bf16(int8_t(q8[2 + i]));
            }
            std::memcpy(blk, d, sizeof d);
            std::memcpy(blk + sizeof d, codes, sizeof codes);
        }
    }
    return 0;
}

// y [M, N] float32 (row stride ldy) = x [M, K] bf16 (row stride ldx) . W^T, W packed by blink_q8bf16_pack.
// Returns 0, or -1 where the layout does not exist or this build lacks AVX512-BF16.
extern "C" int blink_q8bf16_matmul(const void* packed, const void* x, int64_t ldx, float* y, int64_t ldy, int64_t M,
                                   int64_t N, int64_t K, int threads) {
    if (blink_q8bf16_bytes(N, K) < 0 || M < 0) return -1;
#if BLINK_Q8BF16
    const auto* wp = static_cast<const uint8_t*>(packed);
    const auto* xs = static_cast<const uint16_t*>(x);
    const int64_t nb = K / QK, groups = N / G;
    #pragma omp parallel for num_threads(threads) if (threads > 1 && groups > 1) schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* gp = wp + g * nb * BLOCK_BYTES;     // (software prefetch of the next group: slower)
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            tile_rows(gp, nb, xs, ldx, m0, M - m0 < MR ? M - m0 : MR, y, ldy, g * G);
    }
    return 0;
#else
    (void)packed, (void)x, (void)ldx, (void)y, (void)ldy, (void)threads;
    return -1;
#endif
}
