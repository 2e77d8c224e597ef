// Quantized matmul for the CPU executor: y[M, N] = x[M, K] . W[N, K]^T with W kept in its
// GGUF block format (ggml's Q4_0, Q4_1, Q8_0, Q4_K), read straight from the blocks.
//
//   x (f32 or bf16) --quantize_act--> int8 activations, one scale per 32 values (d) and
//   d * sum(q) per 32 values (s), as ggml's q8_1 (float scales here, not f16)
//   --quant_matmul--> per weight row and 32-value block: an integer dot product of the
//   block's codes with the activation codes (AVX2 vpmaddubsw + vpmaddwd, or AVX512-VNNI
//   vpdpbusd), scaled by d_w * d_x, plus m_w * s_x for the formats with an offset
//   (w = d_w * q + m_w: Q4_1's min, Q4_0's -8 d, Q4_K's -dmin * m of each sub-block).
//
// That is ggml's scheme (ggml_vec_dot_q4_1_q8_1 / _q8_0_q8_0 in ggml-cpu's x86 quants.c),
// arranged as a small GEMM: a tile of NR weight rows meets MR activation rows per block, so
// a weight block is unpacked once for MR rows and read from memory once per chunk of x that
// fits L1 (decode batches, prefill chunks), not once per row. Threads (OpenMP, the caller's count)
// split the weight rows.
//
// Layouts (the same bytes; CpuKernels.repack rearranges a GGUF matrix once, at load):
//   GGUF      rows of blocks as the file has them
//   SPLIT     each row's f16 scales first, then its codes: a tile's scales convert 8 at a time
//   X8        Q4_0/Q4_1, N % 8 == 0: 8 rows interleaved a block at a time, so the 8 int32 lanes of a
//             ymm are 8 weight rows: no horizontal sums, one conversion and scale per 8 rows of a
//             block (ggml's q4_0_8x8 arrangement); what the CPU executor serves Q4 matrices as
//             where the CPU has no AVX512-VNNI
//   X16       the same with 16 rows, a zmm's 16 lanes: what it serves them as with AVX512-VNNI
//
// Paths, picked per call by `isa` (the caller clamps it to blink_quant_isa_max()):
//   0 scalar   plain C++, the reference the others are tested against
//   1 avx2     AVX2 + FMA + F16C, 16 ymm registers: tiles of up to 4 x 2 / 1 x 4
//   2 avx512   AVX512-VNNI on ymm (vpdpbusd: one instruction for maddubs + madd), 32 registers:
//              tiles of up to 4 x 4 (X8: 8 rows of x a group); X16 on zmm (8 rows of x a group);
//              compiled only where -march=native has AVX512-VNNI + VL. X16 has no ymm path: below
//              avx512 it takes the scalar loop (CpuKernels.repack picks X8 there)
// Integer sums are exact on every path and the activation codes are computed by one scalar
// routine, so the paths differ only in the order of the float additions.
// quant_matmul_fx (float activations, the tied logits head's): x float32 against the dequantized
// weights on every path, except Q8_0 on avx2, which codes x in int16 per 32 values first
// (matmul_q8_x16: on Zen 1 the float path's int-to-float conversions bound it).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BLINK_Q_AVX2 1
#else
#define BLINK_Q_AVX2 0
#endif
#if BLINK_Q_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BLINK_Q_AVX512 1
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"    // GCC 12 AVX-512 headers' `__Y = __Y`
#pragma GCC diagnostic ignored "-Wuninitialized"
#else
#define BLINK_Q_AVX512 0
#endif

namespace {

constexpr int QK = 32;                       // values per activation block and per (sub-)block of W
enum WType { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12 };      // ggml_type ids, as GGUF stores them
// SPLIT | type: the same rows repacked (blink_quant_repack) with every block's f16 scales first, then
// every block's codes: [d x nb][m x nb, Q4_1 only][codes x nb]. Same bytes; the scales of 8 blocks
// convert in one instruction instead of one at a time (most of a 1-row matmul's work at K = 576).
constexpr int SPLIT = 0x100;
// X8 | type (Q4_0, Q4_1): groups of 8 rows interleaved block by block, so a ymm's 8 int32 lanes are
// 8 weight rows: per block of a group, [d x 8 f16][m x 8 f16, Q4_1 only][codes: 4 x 32 bytes, the
// q-th holding bytes 4q..4q+3 of rows 0..7]. A 1-row matmul then needs no horizontal sums and one
// float conversion and multiply per 8 rows of a block, not per row (ggml's q4_0_8x8 idea). N % 8 == 0.
constexpr int X8 = 0x200;
// X16 | type (Q4_0, Q4_1): the same with groups of 16 rows, for zmm (AVX512-VNNI): per block of a group
// [d x 16 f16][m x 16 f16, Q4_1 only][codes: 4 x 64 bytes, the q-th holding bytes 4q..4q+3 of rows
// 0..15]. One vpdpbusd covers 16 weight rows, so each broadcast of x, conversion and scale serves 16
// rows, and the matrix is still one sequential stream. N % 16 == 0.
constexpr int X16 = 0x400;
// P8 | Q8_0: groups of 8 rows interleaved block by block for int16 activation codes (the AVX2 logits
// head, matmul_p8): per block of a group [d x 8 f16][codes: 16 x 16 bytes, the j-th holding bytes 2j,
// 2j + 1 of rows 0..7]. One vpmovsxbw of 16 bytes makes 8 int32 lanes of (w[2j], w[2j + 1]) pairs, one
// per row, and one vpmaddwd against x's codes 2j, 2j + 1 (broadcast) sums a pair in each: a block of 8
// rows is 16 of them and no horizontal sums, one conversion and one FMA per 8 rows of a block. The same
// bytes as the rows (272 a group's block). N % 8 == 0.
constexpr int P8 = 0x800;
constexpr int base_type(int t) { return t & 0xff; }
constexpr bool is_split(int t) { return (t & SPLIT) != 0; }
constexpr bool is_x8(int t) { return (t & (X8 | X16)) != 0; }             // rows interleaved in groups
constexpr int group_rows(int t) { return (t & X16) ? 16 : 8; }             // ... of this many rows
constexpr int code_bytes(int t) { return base_type(t) == Q8_0 ? 32 : 16; }       // codes of a split block
constexpr int scale_bytes(int t) { return base_type(t) == Q4_1 ? 4 : 2; }        // f16 d (and m) of one

float f16(const uint8_t* p) {                // IEEE half at p (little endian) -> float, exactly
    uint16_t h;
    std::memcpy(&h, p, 2);
#if BLINK_Q_AVX2
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                 // subnormal: normalise
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; --exp; }
        bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Where the 32 codes of the block at 32-value index b of a row are, per format:
//   Q4_0/Q4_1  16 bytes: value i in the low nibble of byte i (i < 16), value 16 + i in its high nibble
//   Q4_K       32 bytes shared by sub-blocks 2j and 2j + 1: low nibbles, then (high) high nibbles
//   Q8_0       32 signed bytes
// and how they decode: w = d * q + m (Q8_0's codes are signed, the 4-bit ones 0..15).
struct Codes {
    const uint8_t* qs;
    bool high;
};

int64_t row_bytes(int t, int64_t k) {
    if ((t & P8) && t != (P8 | Q8_0)) return -1;
    if ((is_split(t) && base_type(t) == Q4_K) || (is_x8(t) && base_type(t) != Q4_0 && base_type(t) != Q4_1)) return -1;
    if ((is_split(t) && is_x8(t)) || ((t & X8) && (t & X16))) return -1;
    switch (base_type(t)) {
        case Q4_0: return k / 32 * 18;
        case Q4_1: return k / 32 * 20;
        case Q8_0: return k / 32 * 34;
        case Q4_K: return k / 256 * 144;
    }
    return -1;
}

inline void q4k_scale_min(int j, const uint8_t* q, int* sc, int* m) {   // ggml's get_scale_min_k4
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int T>
inline Codes codes_at(const uint8_t* row, int64_t b, int64_t nb) {
    if constexpr (is_split(T)) return {row + nb * scale_bytes(T) + b * code_bytes(T), false};
    else if constexpr (T == Q4_0) return {row + b * 18 + 2, false};
    else if constexpr (T == Q4_1) return {row + b * 20 + 4, false};
    else if constexpr (T == Q8_0) return {row + b * 34 + 2, false};
    else return {row + (b / 8) * 144 + 16 + 32 * ((b % 8) / 2), (b & 1) != 0};
}

template <int T>
inline void scales_at(const uint8_t* row, int64_t b, int64_t nb, float* d, float* m) {
    if constexpr (is_split(T)) {
        *d = f16(row + 2 * b);
        *m = base_type(T) == Q4_1 ? f16(row + 2 * (nb + b)) : (base_type(T) == Q4_0 ? -8.f * *d : 0.f);
    } else if constexpr (T == Q4_0) {
        *d = f16(row + b * 18);
        *m = -8.f * *d;
    } else if constexpr (T == Q4_1) {
        *d = f16(row + b * 20);
        *m = f16(row + b * 20 + 2);
    } else if constexpr (T == Q8_0) {
        *d = f16(row + b * 34);
        *m = 0.f;
    } else {
        const uint8_t* p = row + (b / 8) * 144;
        int sc, mn;
        q4k_scale_min(int(b % 8), p + 4, &sc, &mn);
        *d = f16(p) * float(sc);
        *m = -f16(p + 2) * float(mn);
    }
}

// The scales d and offsets m of a row's nb blocks, decoded into d[nb], m[nb] (a tile's prologue).
template <int T>
inline void scales_row(const uint8_t* row, int64_t nb, float* d, float* m) {
    int64_t b = 0;
#if BLINK_Q_AVX2
    if constexpr (is_split(T)) {                 // 8 f16 scales a load and a conversion
        for (; b + 8 <= nb; b += 8) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * b)));
            _mm256_storeu_ps(d + b, dv);
            if constexpr (base_type(T) == Q4_1)
                _mm256_storeu_ps(m + b, _mm256_cvtph_ps(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * (nb + b)))));
            else
                _mm256_storeu_ps(m + b, _mm256_mul_ps(dv, _mm256_set1_ps(base_type(T) == Q4_0 ? -8.f : 0.f)));
        }
    }
#endif
    for (; b < nb; ++b) scales_at<T>(row, b, nb, d + b, m + b);
}

// GGUF rows of type T -> the SPLIT | T layout (same row bytes): the f16 scales, then the codes.
template <int T>
void repack(const uint8_t* w, uint8_t* out, int64_t N, int64_t K) {
    const int64_t nb = K / QK, rb = row_bytes(T, K), gb = rb / nb;   // gb: bytes of a GGUF block
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* src = w + n * rb;
        uint8_t* dst = out + n * rb;
        for (int64_t b = 0; b < nb; ++b) {
            std::memcpy(dst + 2 * b, src + b * gb, 2);                                     // d
            if constexpr (T == Q4_1) std::memcpy(dst + 2 * (nb + b), src + b * gb + 2, 2);  // m
            constexpr int sb = scale_bytes(T);
            std::memcpy(dst + nb * sb + b * code_bytes(T), src + b * gb + sb, code_bytes(T));
        }
    }
}

template <int T>
inline void codes(const Codes& c, int32_t* q) {     // the block's 32 integer codes
    for (int i = 0; i < QK; ++i) {
        if constexpr (base_type(T) == Q8_0) q[i] = int8_t(c.qs[i]);
        else if constexpr (T == Q4_K) q[i] = c.high ? c.qs[i] >> 4 : c.qs[i] & 15;
        else q[i] = i < 16 ? c.qs[i] & 15 : c.qs[i - 16] >> 4;
    }
}

// ---- activations: x [M, K] -> qs [M, K] int8, d and s [M, K/32] ----
float load_x(const void* x, int bf16, int64_t i) {
    if (!bf16) return static_cast<const float*>(x)[i];
    const uint32_t u = uint32_t(static_cast<const uint16_t*>(x)[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// One block of QK values -> its int8 codes (round half to even, within +-127), d = amax / 127
// and s = d * the codes' sum, as ggml's q8_1. Scalar reference:
static inline void quantize_block_scalar(const void* x, int bf16, int64_t i, int8_t* qs, float* d, float* s) {
    float v[QK], amax = 0.f;
    for (int j = 0; j < QK; ++j) {
        v[j] = load_x(x, bf16, i * QK + j);
        const float a = std::fabs(v[j]);
        amax = a > amax ? a : amax;                          // fmax without its call: NaN skipped alike
    }
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
        const int q = int(std::nearbyint(v[j] * id));        // round half to even, as vroundps
        qs[i * QK + j] = int8_t(q < -127 ? -127 : (q > 127 ? 127 : q));
        sum += qs[i * QK + j];
    }
    d[i] = amax / 127.f;
    s[i] = d[i] * float(sum);
}

#if BLINK_Q_AVX2
// The same block on 4 ymm, the same bits for finite values: the product v * id in float32, then
// vcvtps2dq in the default rounding mode (to nearest, ties to even, as nearbyint), max / min as
// the clamp, and the codes packed to int8 as ggml's quantize_row_q8_0 does. The scalar loop took
// ~10% of a decode step at 8-16 rows (34 ns a block).
static inline void quantize_block_avx2(const void* x, int bf16, int64_t i, int8_t* qs, float* d, float* s) {
    __m256 v[4];
    if (bf16) {
        const uint16_t* p = static_cast<const uint16_t*>(x) + i * QK;
        for (int k = 0; k < 4; ++k)
            v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * k))), 16));
    } else {
        const float* p = static_cast<const float*>(x) + i * QK;
        for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(p + 8 * k);
    }
    const __m256 sign = _mm256_set1_ps(-0.f);
    // max(a, m) keeps m where a is NaN, as the scalar loop skips NaNs
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
    __m128 h = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i q[4];
    for (int k = 0; k < 4; ++k)
        q[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid)), hi), lo);
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    // packs interleave the 128-bit lanes; the permute puts the 32 codes back in order
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i codes = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + i * QK), codes);
    d[i] = amax / 127.f;
    s[i] = d[i] * float(_mm_cvtsi128_si32(s4));
}
#endif

// Blocks [b0, b1) of x's QK-value blocks (row-major over rows) -> their codes, d and d * sum.
void quantize_blocks(const void* x, int bf16, int64_t b0, int64_t b1, int8_t* qs, float* d, float* s) {
    for (int64_t i = b0; i < b1; ++i) {
#if BLINK_Q_AVX2
        quantize_block_avx2(x, bf16, i, qs, d, s);
#else
        quantize_block_scalar(x, bf16, i, qs, d, s);
#endif
    }
}

// A team body (see the C ABI's note on teams): the blocks are shared out among the team's threads.
void quantize_act(const void* x, int bf16, int64_t M, int64_t K, int8_t* qs, float* d, float* s) {
    const int64_t nb = K / QK;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < M * nb; ++i) quantize_blocks(x, bf16, i, i + 1, qs, d, s);
}

struct Act {                 // quantized activations, row-major over blocks
    const int8_t* qs;        // [M, K]
    const float* d;          // [M, nb]
    const float* s;          // [M, nb]
};

struct Out {                 // y [M, N] (row stride ldy), f32 or bf16, + optional float32 bias [N]
    void* y;
    int bf16;
    int64_t ldy;
    const float* bias;
    inline void put(int64_t m, int64_t n, float v) const {
        if (bias) v += bias[n];
        if (!bf16) {
            static_cast<float*>(y)[m * ldy + n] = v;
            return;
        }
        uint32_t u;
        std::memcpy(&u, &v, 4);
        u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
        static_cast<uint16_t*>(y)[m * ldy + n] = uint16_t(u >> 16);
    }
};

// ---- scalar reference ----
template <int T>
void matmul_scalar(const uint8_t* w, int64_t rb, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                float wd, wm;
                scales_at<T>(w + n * rb, b, nb, &wd, &wm);
                int32_t q[QK];
                codes<T>(codes_at<T>(w + n * rb, b, nb), q);
                const int8_t* xq = a.qs + m * K + b * QK;
                int32_t dot = 0;
                for (int i = 0; i < QK; ++i) dot += q[i] * xq[i];
                acc += wd * a.d[m * nb + b] * float(dot) + wm * a.s[m * nb + b];
            }
            out.put(m, n, acc);
        }
    }
}

#if BLINK_Q_AVX2
// The 32 codes of a block in one ymm: unsigned 0..15 for the 4-bit formats, signed for Q8_0.
template <int T>
inline __m256i load_codes(const Codes& blk) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if constexpr (base_type(T) == Q8_0) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
    } else if constexpr (T == Q4_K) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs));
        return _mm256_and_si256(blk.high ? _mm256_srli_epi16(v, 4) : v, low4);
    } else {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
    }
}

// sum over groups of 4 of u8 x s8 products -> 8 int32 lanes
template <bool VNNI>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if BLINK_Q_AVX512
    if constexpr (VNNI) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// A tile's accumulators (ymm or zmm) to zero.
template <class V, int MR, int NR>
inline void zero_tile(V (&acc)[MR][NR]) {
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) acc[m][r] = V{};
}

inline float hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// NR weight rows (scales wd, offsets wm [NR][nb] decoded beforehand) against MR activation
// rows: MR * NR accumulators in registers; each block's codes unpacked once for all MR rows.
// Q8_0's signed codes go through ggml's sign trick: |w| (unsigned) x sign(x, w).
template <int T, bool VNNI, int MR, int NR>
void tile(const uint8_t* const* rows, const float* wd, const float* wm, const Act& a, int64_t m0, int64_t nb,
          int64_t K, const Out& out, int64_t n0) {
    __m256 acc[MR][NR];
    zero_tile(acc);
    for (int64_t b = 0; b < nb; ++b) {          // (unrolled: GCC kept the accumulators on the stack)
        __m256i wq[NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
            wq[r] = load_codes<T>(codes_at<T>(rows[r], b, nb));
            if constexpr (base_type(T) == Q8_0) wq[r] = _mm256_sign_epi8(wq[r], wq[r]);
        }
        #pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
            const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + (m0 + m) * K + b * QK));
            const __m256 dx = _mm256_broadcast_ss(a.d + (m0 + m) * nb + b);
            #pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) {
                __m256i p;
                if constexpr (base_type(T) == Q8_0) {
                    const __m256i raw = load_codes<T>(codes_at<T>(rows[r], b, nb));
                    p = dot_u8s8<VNNI>(wq[r], _mm256_sign_epi8(xq, raw));
                } else {
                    p = dot_u8s8<VNNI>(wq[r], xq);
                }
                const __m256 scale = _mm256_mul_ps(dx, _mm256_broadcast_ss(wd + r * nb + b));
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; ++m) {
        const float* sx = a.s + (m0 + m) * nb;
        for (int r = 0; r < NR; ++r) {
            float off = 0.f;
            if constexpr (base_type(T) != Q8_0) {
                const float* wmr = wm + r * nb;
                #pragma omp simd reduction(+ : off)
                for (int64_t b = 0; b < nb; ++b) off += wmr[b] * sx[b];
            }
            out.put(m0 + m, n0 + r, hsum(acc[m][r]) + off);
        }
    }
}

template <int T, bool VNNI, int NR>
void tile_rows(const uint8_t* const* rows, const float* wd, const float* wm, const Act& a, int64_t m0, int64_t mc,
               int64_t nb, int64_t K, const Out& out, int64_t n0) {
    constexpr int MR = VNNI ? 4 : (NR >= 4 ? 1 : 4);       // AVX2: 16 ymm -> 4 x 2 or 1 x 4 tiles
    int64_t m = 0;
    for (; m + MR <= mc; m += MR) tile<T, VNNI, MR, NR>(rows, wd, wm, a, m0 + m, nb, K, out, n0);
    switch (mc - m) {                       // the last rows of the chunk
        case 3: tile<T, VNNI, 3, NR>(rows, wd, wm, a, m0 + m, nb, K, out, n0); break;
        case 2: tile<T, VNNI, 2, NR>(rows, wd, wm, a, m0 + m, nb, K, out, n0); break;
        case 1: tile<T, VNNI, 1, NR>(rows, wd, wm, a, m0 + m, nb, K, out, n0); break;
        default: break;
    }
}

// How far ahead of the tile being multiplied for_each_tile asks for the lines of W (software prefetch).
// Row-major layouts (SPLIT, GGUF) stream a tile's rows side by side, which the hardware prefetchers
// followed poorly: the tied Q8_0 head of SmolLM2 (49152 x 576, 30 MB, from DRAM), one row of x, one
// thread, AVX512 EPYC: 5.3 ms without, 1.7 ms with (17 GB/s), about the same from 0 to 8 KiB ahead
// (4 KiB best by a hair, 16 KiB worse). The X8 layout is one sequential stream and gained nothing.
constexpr int64_t kPrefetchBytes = 4096;

// Rows of x per pass over W: their codes (rows x K bytes) stay in L1 (32 KiB on every x86 core
// since 2011; half of it for them) while every tile of W passes. 64 rows of 576 (36 KiB) ran at
// half the speed of 32 rows (Zen 3, Q4_1 3072 x 576): x then streamed from L2 for every tile.
inline int64_t chunk_rows(int64_t K) {
    const int64_t rows = 16384 / K / 4 * 4;
    return rows < 4 ? 4 : rows;
}

// This thread's share of the tiles of nr weight rows (the last may be short), each with its rows'
// scales decoded into wd, wm first: besides the conversion, that touches every line of the rows
// ahead of the main loop (one row of x streaming W from DRAM ran ~1.5x faster with it than with the
// scales converted inside the loop, Q8_0 49152 x 576). Called inside an omp parallel region: the
// loop is shared out among its threads. fn(rows, rows_here, n0) runs the tile.
template <int T, typename Fn>
inline void for_each_tile(const uint8_t* w, int64_t rb, int64_t N, int64_t nb, int nr, float* wd, float* wm,
                          Fn&& fn) {
    const int64_t groups = (N + nr - 1) / nr;
    const char* end = reinterpret_cast<const char*>(w + N * rb);
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t n0 = g * nr;
        const int rows_here = int(N - n0 < nr ? N - n0 : nr);
        const char* ahead = reinterpret_cast<const char*>(w + n0 * rb) + kPrefetchBytes;
        for (int64_t off = 0; off < nr * rb && ahead + off < end; off += 64) __builtin_prefetch(ahead + off, 0, 3);
        const uint8_t* rows[4];
        for (int r = 0; r < rows_here; ++r) {
            rows[r] = w + (n0 + r) * rb;
            scales_row<T>(rows[r], nb, &wd[r * nb], &wm[r * nb]);
        }
        fn(rows, rows_here, n0);
    }
}

template <int T, bool VNNI>
void matmul_simd(const uint8_t* w, int64_t rb, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    // AVX2: one row of x is memory-bound (4 rows of W a tile: more loads in flight), several are
    // compute-bound (2 rows of W x 4 of x: fewer unpacks and loads per multiply). VNNI: 4 x 4.
    const int nr = VNNI ? 4 : (M == 1 ? 4 : 2);
    std::vector<float> wd(4 * nb), wm(4 * nb);
    const int64_t chunk = chunk_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
        for_each_tile<T>(w, rb, N, nb, nr, wd.data(), wm.data(), [&](const uint8_t* const* rows, int rows_here,
                                                                     int64_t n0) {
            if (rows_here == 4) tile_rows<T, VNNI, 4>(rows, wd.data(), wm.data(), a, m0, mc, nb, K, out, n0);
            else if (rows_here == nr && nr == 2)
                tile_rows<T, VNNI, 2>(rows, wd.data(), wm.data(), a, m0, mc, nb, K, out, n0);
            else
                for (int r = 0; r < rows_here; ++r)
                    tile_rows<T, VNNI, 1>(rows + r, wd.data() + r * nb, wm.data() + r * nb, a, m0, mc, nb, K,
                                          out, n0 + r);
        });
    }
}

// ---- float activations: y = x . dequant(W)^T, x float32, W's codes converted in registers ----
// y = sum over blocks of d * (codes . x) + m * sum(x): the weights are exactly those of the
// dequantized float matrix (Q8_0: d * q is exact in float), so this is the float32 matmul of that
// matrix up to summation order, at the blocks' bytes (Q8_0: 34 per 32 weights, not 128). For
// matmuls whose outputs are compared near ties (the logits head), where int8 activation codes
// move sums by more than float rounding does.
template <int T>
inline __m256 codes8(const uint8_t* qs, __m256i q, int j) {   // codes 8j .. 8j+7 of a block, as floats
    if constexpr (base_type(T) == Q8_0) {          // straight from memory: one sign-extending load
        (void)q;
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j))));
    } else {
        (void)qs;
        __m128i part = j < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        if (j & 1) part = _mm_srli_si128(part, 8);
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
    }
}

// NR weight rows against MR rows of x: per block, MR x NR sums of codes x values (8 lanes each),
// then acc += d * sum; the offsets m * sum(x) after the last block, from xs (x's block sums).
template <int T, int MR, int NR>
void tile_fx(const uint8_t* const* rows, const float* wd, const float* wm, const float* x, int64_t ldx,
             const float* xs, int64_t m0, int64_t nb, const Out& out, int64_t n0) {
    __m256 acc[MR][NR];
    zero_tile(acc);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qs[NR];
        __m256i wq[NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
            const Codes c = codes_at<T>(rows[r], b, nb);
            qs[r] = c.qs;
            if constexpr (base_type(T) != Q8_0) wq[r] = load_codes<T>(c);
            else wq[r] = _mm256_setzero_si256();
        }
        __m256 sum[MR][NR];
        #pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            #pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) {
                const __m256 wf = codes8<T>(qs[r], wq[r], j);
                #pragma GCC unroll 4
                for (int m = 0; m < MR; ++m) {
                    const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * ldx + b * QK + 8 * j);
                    sum[m][r] = j == 0 ? _mm256_mul_ps(wf, xv) : _mm256_fmadd_ps(wf, xv, sum[m][r]);
                }
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
            const __m256 d = _mm256_broadcast_ss(wd + r * nb + b);
            #pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) acc[m][r] = _mm256_fmadd_ps(sum[m][r], d, acc[m][r]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        for (int r = 0; r < NR; ++r) {
            float off = 0.f;
            if constexpr (base_type(T) != Q8_0) {
                const float* wmr = wm + r * nb;
                const float* sx = xs + (m0 + m) * nb;
                for (int64_t b = 0; b < nb; ++b) off += wmr[b] * sx[b];
            }
            out.put(m0 + m, n0 + r, hsum(acc[m][r]) + off);
        }
    }
}

template <int T, int NR>
void tile_rows_fx(const uint8_t* const* rows, const float* wd, const float* wm, const float* x, int64_t ldx,
                  const float* xs, int64_t M, int64_t nb, const Out& out, int64_t n0) {
    constexpr int MR = 2;                        // 2 x NR accumulators and block sums of 16 ymm
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile_fx<T, MR, NR>(rows, wd, wm, x, ldx, xs, m, nb, out, n0);
    if (m < M) tile_fx<T, 1, NR>(rows, wd, wm, x, ldx, xs, m, nb, out, n0);
}

// The weight rows two at a time over `threads` (each thread its share of the pairs, their scales
// decoded): fn(rows, rows_here, n0, wd, wm) for each pair (the last may be a single row).
template <int T, typename Fn>
void in_pairs(const uint8_t* w, int64_t rb, int64_t N, int64_t nb, int threads, Fn&& fn) {
    constexpr int nr = 2;
    const int64_t groups = (N + nr - 1) / nr;
    #pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        std::vector<float> wd(nr * nb), wm(nr * nb);
        for_each_tile<T>(w, rb, N, nb, nr, wd.data(), wm.data(), [&](const uint8_t* const* rows, int rows_here,
                                                                     int64_t n0) {
            fn(rows, rows_here, n0, wd.data(), wm.data());
        });
    }
}

template <int T>
void matmul_fx_simd(const uint8_t* w, int64_t rb, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
                    int64_t K, int threads) {
    const int64_t nb = K / QK;
    std::vector<float> xs(base_type(T) == Q8_0 ? 0 : M * nb);        // x's block sums, for the offsets
    for (int64_t i = 0; i < int64_t(xs.size()); ++i) {
        float t = 0.f;
        for (int k = 0; k < QK; ++k) t += x[(i / nb) * ldx + (i % nb) * QK + k];
        xs[i] = t;
    }
    // 2 weight rows a tile at every M (each row's sums in the same order at any tile width, so the
    // same bits). One row of x used to take 4, for more loads in flight; on the AVX2-only EPYC
    // (Zen 1, 2.0 GHz, ymm split in two 128-bit halves) SmolLM2's tied Q8_0 head (49152 x 576)
    // at one row then ran 3.71 ms on 2 threads, 7.24 on one; with 2 rows 2.98 / 5.57 ms, with 1 row
    // (one FMA chain a block) 3.26 / 6.19 ms (python -m bench.decode_split, 2026-11-27).
    in_pairs<T>(w, rb, N, nb, threads, [&](const uint8_t* const* rows, int rows_here, int64_t n0, const float* wd,
                                           const float* wm) {
        if (rows_here == 2) tile_rows_fx<T, 2>(rows, wd, wm, x, ldx, xs.data(), M, nb, out, n0);
        else tile_rows_fx<T, 1>(rows, wd, wm, x, ldx, xs.data(), M, nb, out, n0);
    });
}

// ---- Q8_0 rows against int16 activation codes (AVX2; the logits head's path there) ----
// x is coded per 32-value block as int16 (e = amax / 32767, round half to even), and each weight
// block's 32 signed codes, sign-extended to int16, meet them in two vpmaddwd: exact int32 sums, one
// conversion and one FMA (d_w * e_x) a block, where the float path converts and FMAs every 8 codes.
// On the AVX2-only EPYC (Zen 1: cvtdq2ps on one pipe, ymm in two halves) that conversion bound the
// float path. Every weight is still the dequantized table's own (d * q, exact), and only x is
// rounded, to 1 part in 65534 of its block's largest magnitude: with an outlier channel (SmolLM2's
// final hidden state has one) the error stays in that channel's block, not the whole row, as a
// per-row scale would make it. SmolLM2's head on its own hidden states: logits within 2.0e-3 of
// the float64 product (the float path: 1.1e-5), against the ~0.05 (one standard deviation) by which
// Q8_0's rounding of the table moves them; 2.68 ms a 1-row step against the float path's 3.35
// (python -m bench.decode_split; bench/results/2026-11-28-cpu2-epyc-avx2-head-x16.md).
// Integer sums cannot overflow: 4 products a lane of at most 128 * 32767, 16,776,704 < 2^24, so
// their float conversion is exact too. A block of x holding a NaN or an infinity gets e = NaN: its
// rows' outputs are NaN, as the float product's would be non-finite (the sampler's check sees them).
inline void quantize_x16(const float* x, int64_t ldx, int64_t M, int64_t K, int16_t* q, float* e) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            const float* v = x + m * ldx + b * QK;
            float amax = 0.f;
            bool finite = true;
            for (int j = 0; j < QK; ++j) {
                finite = finite && std::isfinite(v[j]);
                amax = std::fabs(v[j]) > amax ? std::fabs(v[j]) : amax;
            }
            int16_t* qb = q + m * K + b * QK;
            if (!finite) {
                std::memset(qb, 0, QK * sizeof(int16_t));
                e[m * nb + b] = NAN;
                continue;
            }
            const float id = amax > 0.f ? 32767.f / amax : 0.f;
            for (int j = 0; j < QK; ++j) {
                const float r = std::nearbyint(v[j] * id);        // |r| <= 32767: v * (32767 / amax)
                qb[j] = int16_t(r > 32767.f ? 32767.f : (r < -32767.f ? -32767.f : r));
            }
            e[m * nb + b] = amax / 32767.f;
        }
}

template <int T, int MR, int NR>
void tile_q8_x16(const uint8_t* const* rows, const float* wd, const int16_t* xq, const float* xe, int64_t K,
                 int64_t m0, int64_t nb, const Out& out, int64_t n0) {
    __m256 acc[MR][NR];
    zero_tile(acc);
    for (int64_t b = 0; b < nb; ++b) {
        __m256i lo[NR], hi[NR];
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
            const uint8_t* qs = codes_at<T>(rows[r], b, nb).qs;
            lo[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
            hi[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
        }
        #pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
            const int16_t* xb = xq + (m0 + m) * K + b * QK;
            const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
            const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
            const float e = xe[(m0 + m) * nb + b];
            #pragma GCC unroll 4
            for (int r = 0; r < NR; ++r) {
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo[r], xl), _mm256_madd_epi16(hi[r], xh));
                acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[r * nb + b] * e), acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) out.put(m0 + m, n0 + r, hsum(acc[m][r]));
}

template <int T>
void matmul_q8_x16(const uint8_t* w, int64_t rb, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
                   int64_t K, int threads) {
    const int64_t nb = K / QK;
    std::vector<int16_t> xq(M * K);
    std::vector<float> xe(M * nb);
    quantize_x16(x, ldx, M, K, xq.data(), xe.data());
    // 2 weight rows a tile, as the float path: 1 and 3 rows measured slower at one row of x, 4 much
    // slower (2.68 / 2.74 / 2.86 / 4.04 ms for the 49152 x 576 head, 2 threads, Zen 1)
    in_pairs<T>(w, rb, N, nb, threads, [&](const uint8_t* const* rows, int rows_here, int64_t n0, const float* wd,
                                           const float*) {
        int64_t m = 0;
        if (rows_here == 2) {
            for (; m + 2 <= M; m += 2) tile_q8_x16<T, 2, 2>(rows, wd, xq.data(), xe.data(), K, m, nb, out, n0);
            if (m < M) tile_q8_x16<T, 1, 2>(rows, wd, xq.data(), xe.data(), K, m, nb, out, n0);
        } else {
            for (; m + 2 <= M; m += 2) tile_q8_x16<T, 2, 1>(rows, wd, xq.data(), xe.data(), K, m, nb, out, n0);
            if (m < M) tile_q8_x16<T, 1, 1>(rows, wd, xq.data(), xe.data(), K, m, nb, out, n0);
        }
    });
}
#endif

template <int T>
void matmul_fx_scalar(const uint8_t* w, int64_t rb, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
                      int64_t K, int threads) {
    const int64_t nb = K / QK;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                float wd, wm;
                scales_at<T>(w + n * rb, b, nb, &wd, &wm);
                int32_t q[QK];
                codes<T>(codes_at<T>(w + n * rb, b, nb), q);
                const float* xb = x + m * ldx + b * QK;
                for (int i = 0; i < QK; ++i) acc += std::fma(float(q[i]), wd, wm) * xb[i];
            }
            out.put(m, n, acc);
        }
    }
}

#if BLINK_Q_AVX512
// Q8_0 rows against 4+ rows of float x on zmm (a decode batch's logits head: SmolLM2's tied 49152 x 576
// head at 16 rows took 8.4 ms on the ymm tiles above, a third of the step). Each block's codes are
// converted and scaled once for up to 8 rows of x: d * q is exact in float32 (an 8-bit integer times
// an f16), so these are the dequantized matrix's own weights, and each row's sum is plain FMAs of them
// with x, the float32 matmul of that matrix in another summation order. Cache blocking: a thread takes
// FX_SUPER weight rows at a time (~20 KB of Q8_0 at K = 576, prefetched while the previous ones run)
// and every 8-row chunk of x (18 KB at K = 576, in L1) passes over them, so W streams from DRAM once
// and x from L2 once per super-tile.
constexpr int64_t FX_SUPER = 32;

template <int T, int MR, int NR>
void tile_fx512(const uint8_t* const* rows, const float* wd, int64_t nb, const float* x, int64_t ldx, int64_t m0,
                const Out& out, int64_t n0) {
    __m512 acc[MR][NR];
    zero_tile(acc);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 wv[NR][2];
        #pragma GCC unroll 2
        for (int r = 0; r < NR; ++r) {
            const uint8_t* q = codes_at<T>(rows[r], b, nb).qs;
            const __m512 d = _mm512_set1_ps(wd[r * nb + b]);
            #pragma GCC unroll 2
            for (int h = 0; h < 2; ++h)
                wv[r][h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)))), d);
        }
        #pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
            const float* xr = x + (m0 + m) * ldx + b * QK;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            #pragma GCC unroll 2
            for (int r = 0; r < NR; ++r) {
                acc[m][r] = _mm512_fmadd_ps(wv[r][0], x0, acc[m][r]);
                acc[m][r] = _mm512_fmadd_ps(wv[r][1], x1, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) out.put(m0 + m, n0 + r, _mm512_reduce_add_ps(acc[m][r]));
}

template <int T, int NR>
void rows_fx512(const uint8_t* const* rows, const float* wd, int64_t nb, const float* x, int64_t ldx, int64_t m0,
                int64_t mr, const Out& out, int64_t n0) {
    switch (mr) {
        case 8: tile_fx512<T, 8, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 7: tile_fx512<T, 7, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 6: tile_fx512<T, 6, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 5: tile_fx512<T, 5, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 4: tile_fx512<T, 4, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 3: tile_fx512<T, 3, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        case 2: tile_fx512<T, 2, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
        default: tile_fx512<T, 1, NR>(rows, wd, nb, x, ldx, m0, out, n0); break;
    }
}

template <int T>
void matmul_fx512(const uint8_t* w, int64_t rb, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
                  int64_t K, int threads) {
    static_assert(base_type(T) == Q8_0, "codes as int8: Q8_0 only");
    const int64_t nb = K / QK, supers = (N + FX_SUPER - 1) / FX_SUPER;
    const char* end = reinterpret_cast<const char*>(w + N * rb);
    #pragma omp parallel num_threads(threads) if (threads > 1 && supers > 1)
    {
        std::vector<float> wd(FX_SUPER * nb), wm(FX_SUPER * nb);
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < supers; ++s) {
            const int64_t n_lo = s * FX_SUPER, n_hi = N < n_lo + FX_SUPER ? N : n_lo + FX_SUPER;
            const char* next = reinterpret_cast<const char*>(w + n_hi * rb);       // the next super-tile's rows
            for (int64_t off = 0; off < FX_SUPER * rb && next + off < end; off += 64) __builtin_prefetch(next + off, 0, 3);
            for (int64_t n = n_lo; n < n_hi; ++n) scales_row<T>(w + n * rb, nb, &wd[(n - n_lo) * nb], &wm[(n - n_lo) * nb]);
            for (int64_t m0 = 0; m0 < M; m0 += 8) {
                const int64_t mr = M - m0 < 8 ? M - m0 : 8;
                for (int64_t n = n_lo; n < n_hi; n += 2) {
                    const uint8_t* rows[2] = {w + n * rb, w + (n + 1 < n_hi ? n + 1 : n) * rb};
                    const float* wdn = &wd[(n - n_lo) * nb];
                    if (n + 1 < n_hi) rows_fx512<T, 2>(rows, wdn, nb, x, ldx, m0, mr, out, n);
                    else rows_fx512<T, 1>(rows, wdn, nb, x, ldx, m0, mr, out, n);
                }
            }
        }
    }
}
#endif

#if BLINK_Q_AVX512
// Q8_0 rows against 1-3 rows of float x on zmm (the logits head of a 1-3 stream decode): per block and
// weight row two 16-code conversions, a multiply and two FMAs, where the ymm tiles above take 4 of
// each. SmolLM2's 49152 x 576 head at one row, 3 alternating runs: 1.70-1.76 -> 1.59-1.60 ms on one
// thread, 0.87-0.90 -> 0.81-0.84 ms on two.
template <int T, int MR, int NR>
void tile_fx512_rows(const uint8_t* const* rows, const float* wd, const float* x, int64_t ldx, int64_t m0,
                     int64_t nb, const Out& out, int64_t n0) {
    __m512 acc[MR][NR];
    zero_tile(acc);
    for (int64_t b = 0; b < nb; ++b) {
        __m512 xv[MR][2];
        #pragma GCC unroll 3
        for (int m = 0; m < MR; ++m) {
            xv[m][0] = _mm512_loadu_ps(x + (m0 + m) * ldx + b * QK);
            xv[m][1] = _mm512_loadu_ps(x + (m0 + m) * ldx + b * QK + 16);
        }
        #pragma GCC unroll 4
        for (int r = 0; r < NR; ++r) {
            const uint8_t* q = codes_at<T>(rows[r], b, nb).qs;
            const __m128i* q16 = reinterpret_cast<const __m128i*>(q);
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q16)));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q16 + 1)));
            const __m512 d = _mm512_set1_ps(wd[r * nb + b]);
            #pragma GCC unroll 3
            for (int m = 0; m < MR; ++m)
                acc[m][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(w1, xv[m][1], _mm512_mul_ps(w0, xv[m][0])), d, acc[m][r]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r) out.put(m0 + m, n0 + r, _mm512_reduce_add_ps(acc[m][r]));
}

template <int T>
void matmul_fx512_rows(const uint8_t* w, int64_t rb, const float* x, int64_t ldx, const Out& out, int64_t M,
                       int64_t N, int64_t K, int threads) {
    static_assert(base_type(T) == Q8_0, "codes as int8: Q8_0 only");
    const int64_t nb = K / QK, groups = (N + 3) / 4;
    #pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        std::vector<float> wd(4 * nb), wm(4 * nb);
        for_each_tile<T>(w, rb, N, nb, 4, wd.data(), wm.data(), [&](const uint8_t* const* rows, int rows_here,
                                                                    int64_t n0) {
            if (rows_here == 4) {
                if (M == 1) tile_fx512_rows<T, 1, 4>(rows, wd.data(), x, ldx, 0, nb, out, n0);
                else if (M == 2) tile_fx512_rows<T, 2, 4>(rows, wd.data(), x, ldx, 0, nb, out, n0);
                else tile_fx512_rows<T, 3, 4>(rows, wd.data(), x, ldx, 0, nb, out, n0);
                return;
            }
            for (int r = 0; r < rows_here; ++r)            // a short last tile: a row at a time
                for (int64_t m = 0; m < M; ++m)
                    tile_fx512_rows<T, 1, 1>(rows + r, wd.data() + r * nb, x, ldx, m, nb, out, n0 + r);
        });
    }
}
#endif

template <int T>
void matmul_fx_type(int isa, const uint8_t* w, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
                    int64_t K, int threads) {
    const int64_t rb = row_bytes(T, K);
#if BLINK_Q_AVX512
    if constexpr (base_type(T) == Q8_0) {      // a decode batch's rows: the zmm tiles (8 rows of x, or 1-3)
        if (isa >= 2 && M >= 4) return matmul_fx512<T>(w, rb, x, ldx, out, M, N, K, threads);
        if (isa >= 2) return matmul_fx512_rows<T>(w, rb, x, ldx, out, M, N, K, threads);
    }
#endif
#if BLINK_Q_AVX2
    if constexpr (base_type(T) == Q8_0)
        if (isa == 1) return matmul_q8_x16<T>(w, rb, x, ldx, out, M, N, K, threads);
    if (isa >= 1) return matmul_fx_simd<T>(w, rb, x, ldx, out, M, N, K, threads);
#endif
    (void)isa;
    matmul_fx_scalar<T>(w, rb, x, ldx, out, M, N, K, threads);
}


// ---- Rows in groups (X8, X16, P8) ----
// The block b of group g (rows R g .. R g + R - 1, R = group_rows(T)) starts at w + g * R * rb + b * BB,
// BB = x8_block_bytes<T>(): the group's scales, then its codes.
template <int T>
constexpr int64_t x8_block_bytes() { return group_rows(T) * (scale_bytes(T) + code_bytes(T)); }

template <int T>
inline const uint8_t* x8_block(const uint8_t* w, int64_t rb, int64_t n, int64_t b) {
    constexpr int R = group_rows(T);
    return w + (n / R) * R * rb + b * x8_block_bytes<T>();
}

#if BLINK_Q_AVX2
// A tile's 8 lanes as y[m, n0 .. n0 + 7]: one store where put would only copy them (float32, no bias).
inline void put8(const Out& out, int64_t m, int64_t n0, __m256 v) {
    if (!out.bias && !out.bf16) {
        _mm256_storeu_ps(static_cast<float*>(out.y) + m * out.ldy + n0, v);
        return;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int r = 0; r < 8; ++r) out.put(m, n0 + r, lanes[r]);
}
#endif

typedef float float_alias __attribute__((may_alias));

// ---- P8 | Q8_0: 8 weight rows a ymm against int16 activation codes (the AVX2 logits head) ----
constexpr int64_t P8_BB = x8_block_bytes<P8 | Q8_0>();   // 272: 8 scales, 8 x 32 codes

void repack_p8(const uint8_t* w, uint8_t* out, int64_t N, int64_t K) {
    const int64_t nb = K / QK, rb = row_bytes(Q8_0, K);
    for (int64_t n = 0; n < N; ++n) {
        const int r = int(n % 8);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* src = w + n * rb + b * 34;
            uint8_t* blk = out + (n / 8) * 8 * rb + b * P8_BB;      // x8_block's place
            std::memcpy(blk + 2 * r, src, 2);
            for (int j = 0; j < 16; ++j) std::memcpy(blk + 16 + 16 * j + 2 * r, src + 2 + 2 * j, 2);
        }
    }
}

// Row n's block b: its scale and 32 signed codes in order.
inline float p8_row_block(const uint8_t* w, int64_t rb, int64_t n, int64_t b, int8_t* q) {
    const uint8_t* blk = x8_block<P8 | Q8_0>(w, rb, n, b);
    const int r = int(n % 8);
    for (int j = 0; j < 16; ++j) std::memcpy(q + 2 * j, blk + 16 + 16 * j + 2 * r, 2);
    return f16(blk + 2 * r);
}

void dequantize_p8(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
    const int64_t nb = K / QK, rb = row_bytes(Q8_0, K);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t b = 0; b < nb; ++b) {
            int8_t q[QK];
            const float d = p8_row_block(w, rb, n, b, q);
            for (int i = 0; i < QK; ++i) out[n * K + b * QK + i] = d * float(q[i]);
        }
}

// Float activations, plain C++: matmul_fx_scalar's sums for Q8_0, the same products in the same order (the
// compiler may contract the two loops differently: within the last bit of the row layout's; equal in the
// -march=native build here).
void matmul_p8_scalar(const uint8_t* w, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N, int64_t K,
                      int threads) {
    const int64_t nb = K / QK, rb = row_bytes(Q8_0, K);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t n = 0; n < N; ++n)
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                int8_t q[QK];
                const float d = p8_row_block(w, rb, n, b, q);
                const float* xb = x + m * ldx + b * QK;
                for (int i = 0; i < QK; ++i) acc += std::fma(float(q[i]), d, 0.f) * xb[i];
            }
            out.put(m, n, acc);
        }
}

#if BLINK_Q_AVX2
// One group (8 weight rows) against MR rows of x's int16 codes (quantize_x16): per block, 16 pairs of
// codes, each sign-extended once (vpmovsxbw) for the MR rows, one vpmaddwd and one add a row: a lane's
// 32 products summed as integers (at most 32 * 128 * 32767 < 2^31), then converted (exact below 2^24,
// else rounded once) and scaled by d_w * e_x in one FMA. The row layout's tile (tile_q8_x16) converts
// 4 products a lane, one FMA per row and block, and sums the 8 lanes at the end: the same integer
// products, summed in another order (float sums of the lanes there), so results differ in the last
// bits. Why: on the AVX2-only EPYC (Zen 1) that tile ran ~9 cycles a row and block against the 4 that
// its two vpmaddwd (one pipe, two halves each) need; this one ~7 at 1 row of x and ~4 from 4 rows.
template <int MR>
void tile_p8(const uint8_t* grp, const int16_t* xq, const float* xe, int64_t K, int64_t nb, int64_t m0,
             const Out& out, int64_t n0) {
    __m256 acc[MR];
    #pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = grp + b * P8_BB;
        const char* pf = reinterpret_cast<const char*>(blk) + 4 * P8_BB;   // 4 blocks ahead, 5 lines
        #pragma GCC unroll 5
        for (int l = 0; l < 5; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
        __m256i s[MR];
        #pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) s[m] = _mm256_setzero_si256();
        #pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 + 16 * j)));
            #pragma GCC unroll 4
            for (int m = 0; m < MR; ++m) {       // x's codes 2j, 2j + 1 in every int32 lane (vbroadcastss: a load)
                const float_alias* xp = reinterpret_cast<const float_alias*>(xq + (m0 + m) * K + b * QK + 2 * j);
                s[m] = _mm256_add_epi32(s[m], _mm256_madd_epi16(wv, _mm256_castps_si256(_mm256_broadcast_ss(xp))));
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
        #pragma GCC unroll 4
        for (int m = 0; m < MR; ++m)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m]), _mm256_mul_ps(dw, _mm256_set1_ps(xe[(m0 + m) * nb + b])),
                                     acc[m]);
    }
    for (int m = 0; m < MR; ++m) put8(out, m0 + m, n0, acc[m]);
}

void matmul_p8_x16(const uint8_t* w, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N, int64_t K,
                   int threads) {
    const int64_t nb = K / QK, rb = row_bytes(Q8_0, K), groups = N / 8;
    std::vector<int16_t> xq(M * K);
    std::vector<float> xe(M * nb);
    quantize_x16(x, ldx, M, K, xq.data(), xe.data());
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* grp = w + g * 8 * rb;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) tile_p8<4>(grp, xq.data(), xe.data(), K, nb, m, out, 8 * g);
        switch (M - m) {
            case 3: tile_p8<3>(grp, xq.data(), xe.data(), K, nb, m, out, 8 * g); break;
            case 2: tile_p8<2>(grp, xq.data(), xe.data(), K, nb, m, out, 8 * g); break;
            case 1: tile_p8<1>(grp, xq.data(), xe.data(), K, nb, m, out, 8 * g); break;
            default: break;
        }
    }
}
#endif

// isa >= 1: the int16 codes (AVX2; the AVX-512 build too, where it is asked for), else float activations.
void matmul_p8(int isa, const uint8_t* w, const float* x, int64_t ldx, const Out& out, int64_t M, int64_t N,
               int64_t K, int threads) {
#if BLINK_Q_AVX2
    if (isa >= 1) return matmul_p8_x16(w, x, ldx, out, M, N, K, threads);
#endif
    (void)isa;
    matmul_p8_scalar(w, x, ldx, out, M, N, K, threads);
}

// ---- X8 / X16: 8 weight rows a ymm, 16 a zmm ----

// Row n's block b as a GGUF-style 16 code bytes (scalar paths, dequantization) and its scales.
template <int T>
inline void x8_row_block(const uint8_t* w, int64_t rb, int64_t n, int64_t b, uint8_t* qs16, float* d, float* m) {
    constexpr int R = group_rows(T);
    const uint8_t* blk = x8_block<T>(w, rb, n, b);
    const int r = int(n % R);
    *d = f16(blk + 2 * r);
    *m = base_type(T) == Q4_1 ? f16(blk + 2 * R + 2 * r) : -8.f * *d;
    const uint8_t* codes = blk + R * scale_bytes(T);
    for (int q = 0; q < 4; ++q) std::memcpy(qs16 + 4 * q, codes + 4 * R * q + 4 * r, 4);
}

template <int T>
void repack_x8(const uint8_t* w, uint8_t* out, int64_t N, int64_t K) {
    constexpr int R = group_rows(T);
    const int64_t nb = K / QK, rb = row_bytes(base_type(T), K), gb = rb / nb;
    constexpr int sb = scale_bytes(T);
    for (int64_t n = 0; n < N; ++n) {
        const int r = int(n % R);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* src = w + n * rb + b * gb;
            uint8_t* blk = out + (n / R) * R * rb + b * x8_block_bytes<T>();
            std::memcpy(blk + 2 * r, src, 2);
            if constexpr (base_type(T) == Q4_1) std::memcpy(blk + 2 * R + 2 * r, src + 2, 2);
            for (int q = 0; q < 4; ++q) std::memcpy(blk + R * sb + 4 * R * q + 4 * r, src + sb + 4 * q, 4);
        }
    }
}

template <int T>
void matmul_x8_scalar(const uint8_t* w, int64_t rb, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK;
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t m = 0; m < M; ++m) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t qs[16];
                float wd, wm;
                x8_row_block<T>(w, rb, n, b, qs, &wd, &wm);
                const int8_t* xq = a.qs + m * K + b * QK;
                int32_t dot = 0;
                for (int i = 0; i < 16; ++i) dot += (qs[i] & 15) * xq[i] + (qs[i] >> 4) * xq[i + 16];
                acc += wd * a.d[m * nb + b] * float(dot) + wm * a.s[m * nb + b];
            }
            out.put(m, n, acc);
        }
    }
}

// One block's 32 values, w = d * q + m, into o (Q4_0 / Q4_1 / Q4_K / Q8_0 codes as `c` finds them).
template <int T>
inline void dequantize_block(const Codes& c, float d, float m, float* __restrict o) {
#if BLINK_Q_AVX2
    const __m256i q = load_codes<T>(c);              // 32 codes, unpacked as the matmul does
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 2; ++j) {
            const __m128i part = j ? _mm_srli_si128(halves[h], 8) : halves[h];
            const __m256i wide = base_type(T) == Q8_0 ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
            _mm256_storeu_ps(o + 16 * h + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), dv, mv));
        }
    }
#else
    if constexpr (base_type(T) == Q8_0) {
        for (int i = 0; i < QK; ++i) o[i] = d * float(int8_t(c.qs[i]));
    } else if constexpr (T == Q4_K) {
        const int shift = c.high ? 4 : 0;
        for (int i = 0; i < QK; ++i) o[i] = d * float((c.qs[i] >> shift) & 15) + m;
    } else {
        for (int i = 0; i < 16; ++i) {
            o[i] = d * float(c.qs[i] & 15) + m;
            o[i + 16] = d * float(c.qs[i] >> 4) + m;
        }
    }
#endif
}

template <int T>
void dequantize_x8(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
    const int64_t nb = K / QK, rb = row_bytes(T, K);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 8)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t qs[16];
            float d, m;
            x8_row_block<T>(w, rb, n, b, qs, &d, &m);
            dequantize_block<base_type(T)>(Codes{qs, false}, d, m, out + n * K + b * QK);   // a GGUF Q4 block now
        }
    }
}

#if BLINK_Q_AVX2
// 8 weight rows (one group) against MR rows of x: per block the 8 code vectors are unpacked once
// (c[q]: the rows' codes at k = 4q .. 4q+3, matching x's bytes 4q .. 4q+3), and per row of x 8
// u8 x s8 pair products summed in int16 (|sum| <= 8 * 2 * 15 * 127 < 32768), one int32 pair sum,
// one conversion and two FMAs (scale, offset) for the 8 rows.
// VNNI: vpdpbusd sums the four u8 x s8 products of each int32 lane and accumulates, one instruction for
// AVX2's maddubs + add (and the final madd): the same integer sums, so the same floats; and 32 ymm
// registers let a tile take 8 rows of x, unpacking each block's codes once for all of them.

// Bytes ahead of the block being summed that the AVX2 tile asks the cache for (its 160-byte Q4_1
// blocks: 8 ahead, three lines each; a prefetch changes no value). On the AVX2-only EPYC (Zen 1, 2
// threads) a 1-row decode step's 30 layers spent ~2/3 of their time in this tile at ~14 GB/s, its
// samples piled on the first use of each block's codes (perf): the hardware prefetcher left the
// loads exposed. Asking 1,280 bytes ahead: the layers 6.71 -> 5.88 ms a step (median of 5 alternating
// runs; 640 bytes slower, 1,920 and 2,560 no better), served TPOT 11.4-11.5 -> 9.9-10.3 ms
// (bench/results/2026-11-28-cpu2-epyc-avx2-x8-prefetch.md). Measured at one row of x; the AVX2
// tiles for more rows take it unmeasured. The VNNI tiles (AVX512 CPUs) were not measured with it
// and go without.
constexpr int64_t kX8Prefetch = 1280;

// 4 bytes of x's codes (group q of a block) in every int32 lane.
inline __m256i quad_at(const float_alias* xq, int q) { return _mm256_castps_si256(_mm256_broadcast_ss(xq + q)); }

template <int T, int MR, bool VNNI>
void x8_tile(const uint8_t* grp, const Act& a, int64_t m0, int64_t nb, int64_t K, const Out& out, int64_t n0) {
    constexpr int64_t BB = x8_block_bytes<T>();
    constexpr int SB = scale_bytes(T);
    // Up to 4 rows of x with VNNI: the high nibbles stay in place (16 h, one AND, no shift), summed in
    // a chain of their own (two chains of 4 vpdpbusd, not one of 8: a row's latency halved) and
    // shifted back once (16 h x sums to a multiple of 16: exact). Same integers, same floats; a
    // 1-row decode ran 8-9% faster, 2 rows 5% (Zen 4, Q4_1 24576 x 576 from L3, 1 thread). With
    // 5-8 rows the extra accumulators spill (32 ymm) and it ran slower, so those keep one chain.
    constexpr bool kHigh16 = VNNI && MR <= 4;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[MR];
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = grp + b * BB;
        if constexpr (!VNNI) {          // AVX2: the blocks kX8Prefetch bytes ahead asked for
            const char* pf = reinterpret_cast<const char*>(blk) + kX8Prefetch;
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            _mm_prefetch(pf + 128, _MM_HINT_T0);
        }
        __m256i c[8];
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 * SB + 32 * q));
            c[q] = _mm256_and_si256(v, low4);
            c[q + 4] = kHigh16 ? _mm256_andnot_si256(low4, v) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
        const __m256 mw = base_type(T) == Q4_1
            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)))
            : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
        // x's 4-byte groups broadcast straight from memory (vbroadcastss: a load, no ALU uop); a
        // memcpy into int32s made GCC load them into general registers and move each across
        // (vpbroadcastd from a GPR), which held the tile to ~27% of vpdpbusd's rate.
        const float_alias* xb = reinterpret_cast<const float_alias*>(a.qs + m0 * K + b * QK);
        const int64_t kq = K / 4;                                   // x's rows apart, in 4-byte groups
        __m256i sums[MR];
        if constexpr (VNNI) {
#if BLINK_Q_AVX512
            // q outer, rows inner: MR independent vpdpbusd chains side by side, so each one's
            // latency hides behind the others (one row's chain of 8 ran them back to back)
            if constexpr (kHigh16) {
                __m256i hi[MR];
                #pragma GCC unroll 8
                for (int m = 0; m < MR; ++m) {
                    sums[m] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[0], quad_at(xb + m * kq, 0));
                    hi[m] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[4], quad_at(xb + m * kq, 4));
                }
                #pragma GCC unroll 8
                for (int q = 1; q < 4; ++q)
                    #pragma GCC unroll 8
                    for (int m = 0; m < MR; ++m) {
                        sums[m] = _mm256_dpbusd_epi32(sums[m], c[q], quad_at(xb + m * kq, q));
                        hi[m] = _mm256_dpbusd_epi32(hi[m], c[q + 4], quad_at(xb + m * kq, q + 4));
                    }
                #pragma GCC unroll 8
                for (int m = 0; m < MR; ++m) sums[m] = _mm256_add_epi32(sums[m], _mm256_srai_epi32(hi[m], 4));
            } else {
                #pragma GCC unroll 8
                for (int m = 0; m < MR; ++m)
                    sums[m] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c[0], quad_at(xb + m * kq, 0));
                #pragma GCC unroll 8
                for (int q = 1; q < 8; ++q)
                    #pragma GCC unroll 8
                    for (int m = 0; m < MR; ++m) sums[m] = _mm256_dpbusd_epi32(sums[m], c[q], quad_at(xb + m * kq, q));
            }
#endif
        } else {
            #pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
                __m256i s16 = _mm256_maddubs_epi16(c[0], quad_at(xb + m * kq, 0));
                #pragma GCC unroll 8
                for (int q = 1; q < 8; ++q)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(c[q], quad_at(xb + m * kq, q)));
                sums[m] = _mm256_madd_epi16(s16, ones);
            }
        }
        #pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
            const __m256 dot = _mm256_cvtepi32_ps(sums[m]);
            const __m256 dx = _mm256_broadcast_ss(a.d + (m0 + m) * nb + b);
            acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, dx), acc[m]);
            acc[m] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(a.s + (m0 + m) * nb + b), acc[m]);
        }
    }
    for (int m = 0; m < MR; ++m) put8(out, m0 + m, n0, acc[m]);
}

#if BLINK_Q_AVX512
// X16: one group (16 weight rows) against MR rows of x on zmm. The integer sums and the float
// operations per lane are x8_tile's (VNNI), so are the bits; each x quad's broadcast, each row's
// conversion and scale FMAs serve 16 weight rows instead of 8. Why: x8_tile peaked at ~330 G int8
// ops/s on 2 Zen 4 cores with the matrix in cache (43% of ymm vpdpbusd's rate), held by the
// instructions around the dot products, not by them. (Two X8 groups joined into a zmm ran ~40% faster
// from cache too, but read W as two streams, and from DRAM a 1-row matmul took ~1.5x as long.)
//
// sums += c . (the x quad at xq[q], broadcast to every lane by the instruction: {1to16}); GCC 12 emits
// a separate vbroadcastss for _mm512_dpbusd_epi32 over a _mm512_broadcastss_ps of the quad.
inline __m512i dpbusd_quad(__m512i sums, __m512i c, const float_alias* xq, int q) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums) : "v"(c), "m"(*reinterpret_cast<const int32_t*>(xq + q)));
    return sums;
}

template <int T, int MR>
void x16_tile(const uint8_t* grp, const Act& a, int64_t m0, int64_t nb, int64_t K, const Out& out, int64_t n0) {
    constexpr int64_t BB = x8_block_bytes<T>();
    constexpr int SB = scale_bytes(T);
    constexpr bool kHigh16 = MR <= 4;               // as x8_tile: two chains a row where registers allow
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[MR];
    #pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = grp + b * BB;
        __m512i c[8];
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            const __m512i v = _mm512_loadu_si512(blk + 16 * SB + 64 * q);
            c[q] = _mm512_and_si512(v, low4);
            c[q + 4] = kHigh16 ? _mm512_andnot_si512(low4, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        const __m512 mw = base_type(T) == Q4_1
            ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
            : _mm512_mul_ps(dw, _mm512_set1_ps(-8.f));
        const float_alias* xb = reinterpret_cast<const float_alias*>(a.qs + m0 * K + b * QK);
        const int64_t kq = K / 4;
        __m512i sums[MR];
        if constexpr (kHigh16) {
            __m512i hi[MR];
            #pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
                sums[m] = dpbusd_quad(_mm512_setzero_si512(), c[0], xb + m * kq, 0);
                hi[m] = dpbusd_quad(_mm512_setzero_si512(), c[4], xb + m * kq, 4);
            }
            #pragma GCC unroll 8
            for (int q = 1; q < 4; ++q)
                #pragma GCC unroll 8
                for (int m = 0; m < MR; ++m) {
                    sums[m] = dpbusd_quad(sums[m], c[q], xb + m * kq, q);
                    hi[m] = dpbusd_quad(hi[m], c[q + 4], xb + m * kq, q + 4);
                }
            #pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) sums[m] = _mm512_add_epi32(sums[m], _mm512_srai_epi32(hi[m], 4));
        } else {
            #pragma GCC unroll 8
            for (int m = 0; m < MR; ++m)
                sums[m] = dpbusd_quad(_mm512_setzero_si512(), c[0], xb + m * kq, 0);
            #pragma GCC unroll 8
            for (int q = 1; q < 8; ++q)
                #pragma GCC unroll 8
                for (int m = 0; m < MR; ++m) sums[m] = dpbusd_quad(sums[m], c[q], xb + m * kq, q);
        }
        #pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
            const __m512 dot = _mm512_cvtepi32_ps(sums[m]);
            const __m512 dx = _mm512_set1_ps(a.d[(m0 + m) * nb + b]);
            acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, dx), acc[m]);
            acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[(m0 + m) * nb + b]), acc[m]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc[m]);
        for (int r = 0; r < 16; ++r) out.put(m0 + m, n0 + r, lanes[r]);
    }
}

template <int T>
void matmul_x16_vnni(const uint8_t* w, int64_t rb, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    constexpr int MR = 8;
    const int64_t nb = K / QK, groups = N / 16, chunk = chunk_rows(K);
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {              // rows of x whose codes stay in L1
        const int64_t c1 = M - c0 < chunk ? M : c0 + chunk;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t* grp = w + g * 16 * rb;
            int64_t m = c0;
            for (; m + MR <= c1; m += MR) x16_tile<T, MR>(grp, a, m, nb, K, out, 16 * g);
            switch (c1 - m) {
                case 7: x16_tile<T, 7>(grp, a, m, nb, K, out, 16 * g); break;
                case 6: x16_tile<T, 6>(grp, a, m, nb, K, out, 16 * g); break;
                case 5: x16_tile<T, 5>(grp, a, m, nb, K, out, 16 * g); break;
                case 4: x16_tile<T, 4>(grp, a, m, nb, K, out, 16 * g); break;
                case 3: x16_tile<T, 3>(grp, a, m, nb, K, out, 16 * g); break;
                case 2: x16_tile<T, 2>(grp, a, m, nb, K, out, 16 * g); break;
                case 1: x16_tile<T, 1>(grp, a, m, nb, K, out, 16 * g); break;
                default: break;
            }
        }
    }
}
#endif

template <int T, bool VNNI>
void matmul_x8_simd(const uint8_t* w, int64_t rb, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = K / QK, groups = N / 8, chunk = chunk_rows(K);
    constexpr int MR = VNNI ? 8 : 4;                         // rows of x a tile (16 ymm on AVX2, 32 with VL)
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {              // rows of x whose codes stay in L1
        const int64_t c1 = M - c0 < chunk ? M : c0 + chunk;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t* grp = w + g * 8 * rb;
            int64_t m = c0;
            for (; m + MR <= c1; m += MR) x8_tile<T, MR, VNNI>(grp, a, m, nb, K, out, 8 * g);
            switch (c1 - m) {
                case 7: x8_tile<T, VNNI ? 7 : 1, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 6: x8_tile<T, VNNI ? 6 : 1, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 5: x8_tile<T, VNNI ? 5 : 1, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 4: x8_tile<T, 4, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 3: x8_tile<T, 3, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 2: x8_tile<T, 2, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                case 1: x8_tile<T, 1, VNNI>(grp, a, m, nb, K, out, 8 * g); break;
                default: break;
            }
        }
    }
}
#endif

// X8: the ymm tiles (AVX2, or VNNI where asked for); X16: the zmm tiles (VNNI), else the scalar loop.
template <int T>
void matmul_x8(int isa, const uint8_t* w, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t rb = row_bytes(T, K);
    if constexpr (group_rows(T) == 16) {
#if BLINK_Q_AVX512
        if (isa >= 2) return matmul_x16_vnni<T>(w, rb, a, out, M, N, K);
#endif
    } else {
#if BLINK_Q_AVX512
        if (isa >= 2) return matmul_x8_simd<T, true>(w, rb, a, out, M, N, K);
#endif
#if BLINK_Q_AVX2
        if (isa >= 1) return matmul_x8_simd<T, false>(w, rb, a, out, M, N, K);
#endif
    }
    (void)isa;
    matmul_x8_scalar<T>(w, rb, a, out, M, N, K);
}

template <int T>
void matmul_type(int isa, const uint8_t* w, const Act& a, const Out& out, int64_t M, int64_t N, int64_t K) {
    const int64_t rb = row_bytes(T, K);
#if BLINK_Q_AVX512
    if (isa >= 2) return matmul_simd<T, true>(w, rb, a, out, M, N, K);
#endif
#if BLINK_Q_AVX2
    if (isa >= 1) return matmul_simd<T, false>(w, rb, a, out, M, N, K);
#endif
    (void)isa;
    matmul_scalar<T>(w, rb, a, out, M, N, K);
}

// W [N, K] in blocks -> float32 [N, K] (for large batches: one dequantization, then a float GEMM).
// Branch-free inner loops per format, so the compiler vectorizes them.
template <int T>
void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
    const int64_t nb = K / QK, rb = row_bytes(T, K);
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N > 1)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t b = 0; b < nb; ++b) {
            float d, m;
            scales_at<T>(w + n * rb, b, nb, &d, &m);
            const Codes c = codes_at<T>(w + n * rb, b, nb);
            dequantize_block<T>(c, d, m, out + n * K + b * QK);
        }
    }
}

}  // namespace

// The IEEE half at p (little endian) as a float, exactly: f16 above, for q8_bf16.cc (the same library).
extern "C" float blink_f16_to_float(const uint8_t* p) { return f16(p); }

// C ABI for ctypes (gpu_backend/cpu_kernels/__init__.py checks shapes and types).
// The widest path this build has: 2 avx512 (VNNI), 1 avx2, 0 scalar only.
extern "C" int blink_quant_isa_max() { return BLINK_Q_AVX512 ? 2 : (BLINK_Q_AVX2 ? 1 : 0); }

// Bytes of one row of K values in ggml type `wtype`; -1 for a type this file does not read.
extern "C" int64_t blink_quant_row_bytes(int wtype, int64_t K) { return row_bytes(wtype, K); }

// x [M, K] (float32, or bf16 when x_bf16) -> qs [M, K] int8, d [M, K/32], s [M, K/32]; K % 32 == 0.
extern "C" void blink_quantize_act(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* qs, float* d, float* s,
                                   int threads) {
    #pragma omp parallel num_threads(threads) if (threads > 1 && M * (K / QK) >= 256)
    quantize_act(x, x_bf16, M, K, qs, d, s);
}

// Team bodies for blink_forward (forward.cc): called by every thread of an OpenMP team (or by one
// thread outside any parallel region), the work shared out with orphaned `omp for` loops; each
// returns after the loop's implicit barrier, so its output is complete for every thread.
namespace blink_team {
void quantize_act(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* qs, float* d, float* s) {
    ::quantize_act(x, x_bf16, M, K, qs, d, s);
}

void quantize_blocks(const void* x, int x_bf16, int64_t b0, int64_t b1, int8_t* qs, float* d, float* s) {
    ::quantize_blocks(x, x_bf16, b0, b1, qs, d, s);
}

int quant_matmul(int wtype, const void* w, const int8_t* qs, const float* d, const float* s, const float* bias,
                 void* y, int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, int isa) {
    const Act a{qs, d, s};
    const Out out{y, y_bf16, ldy, bias};
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    switch (wtype) {
        case Q4_0: matmul_type<Q4_0>(isa, wb, a, out, M, N, K); return 0;
        case Q4_1: matmul_type<Q4_1>(isa, wb, a, out, M, N, K); return 0;
        case Q8_0: matmul_type<Q8_0>(isa, wb, a, out, M, N, K); return 0;
        case Q4_K: matmul_type<Q4_K>(isa, wb, a, out, M, N, K); return 0;
        case SPLIT | Q4_0: matmul_type<SPLIT | Q4_0>(isa, wb, a, out, M, N, K); return 0;
        case SPLIT | Q4_1: matmul_type<SPLIT | Q4_1>(isa, wb, a, out, M, N, K); return 0;
        case SPLIT | Q8_0: matmul_type<SPLIT | Q8_0>(isa, wb, a, out, M, N, K); return 0;
        case X8 | Q4_0: if (N % 8) return -1; matmul_x8<X8 | Q4_0>(isa, wb, a, out, M, N, K); return 0;
        case X8 | Q4_1: if (N % 8) return -1; matmul_x8<X8 | Q4_1>(isa, wb, a, out, M, N, K); return 0;
        case X16 | Q4_0: if (N % 16) return -1; matmul_x8<X16 | Q4_0>(isa, wb, a, out, M, N, K); return 0;
        case X16 | Q4_1: if (N % 16) return -1; matmul_x8<X16 | Q4_1>(isa, wb, a, out, M, N, K); return 0;
    }
    return -1;
}
}  // namespace blink_team

// y [M, N] (row stride ldy; float32, or bf16 when y_bf16) = act [M, K] . W[N, K]^T (+ bias, float32 [N]),
// W as N rows of blink_quant_row_bytes(wtype, K) bytes. Returns 0, or -1 for an unknown wtype.
extern "C" int blink_quant_matmul(int wtype, const void* w, const int8_t* qs, const float* d, const float* s,
                                  const float* bias, void* y, int y_bf16, int64_t ldy, int64_t M, int64_t N,
                                  int64_t K, int isa, int threads) {
    if (row_bytes(wtype, K) < 0 || (wtype & P8) || (is_x8(wtype) && N % group_rows(wtype))) return -1;
    #pragma omp parallel num_threads(threads) if (threads > 1 && N > 8)
    blink_team::quant_matmul(wtype, w, qs, d, s, bias, y, y_bf16, ldy, M, N, K, isa);
    return 0;
}

// out [N, K] float32 = W dequantized (w = d * q + m per block). Returns 0, or -1 for an unknown wtype.
extern "C" int blink_quant_dequantize(int wtype, const void* w, float* out, int64_t N, int64_t K, int threads) {
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    switch (wtype) {
        case Q4_0: dequantize<Q4_0>(wb, out, N, K, threads); return 0;
        case Q4_1: dequantize<Q4_1>(wb, out, N, K, threads); return 0;
        case Q8_0: dequantize<Q8_0>(wb, out, N, K, threads); return 0;
        case Q4_K: dequantize<Q4_K>(wb, out, N, K, threads); return 0;
        case SPLIT | Q4_0: dequantize<SPLIT | Q4_0>(wb, out, N, K, threads); return 0;
        case SPLIT | Q4_1: dequantize<SPLIT | Q4_1>(wb, out, N, K, threads); return 0;
        case SPLIT | Q8_0: dequantize<SPLIT | Q8_0>(wb, out, N, K, threads); return 0;
        case X8 | Q4_0: if (N % 8) return -1; dequantize_x8<X8 | Q4_0>(wb, out, N, K, threads); return 0;
        case X8 | Q4_1: if (N % 8) return -1; dequantize_x8<X8 | Q4_1>(wb, out, N, K, threads); return 0;
        case X16 | Q4_0: if (N % 16) return -1; dequantize_x8<X16 | Q4_0>(wb, out, N, K, threads); return 0;
        case X16 | Q4_1: if (N % 16) return -1; dequantize_x8<X16 | Q4_1>(wb, out, N, K, threads); return 0;
        case P8 | Q8_0: if (N % 8) return -1; dequantize_p8(wb, out, N, K, threads); return 0;
    }
    return -1;
}

// y [M, N] (row stride ldy; float32, or bf16 when y_bf16) = x [M, K] (float32, row stride ldx) . W^T
// (+ bias), W dequantized in registers (w = d * q + m), the sums in float32. Returns 0, or -1 for an
// unknown wtype. isa: 0 scalar, >= 1 avx2 (the AVX-512 build takes the AVX2 path: memory-bound at
// the row counts it serves).
extern "C" int blink_quant_matmul_fx(int wtype, const void* w, const float* x, int64_t ldx, const float* bias,
                                     void* y, int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, int isa,
                                     int threads) {
    const Out out{y, y_bf16, ldy, bias};
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    switch (wtype) {
        case Q4_0: matmul_fx_type<Q4_0>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case Q4_1: matmul_fx_type<Q4_1>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case Q8_0: matmul_fx_type<Q8_0>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case Q4_K: matmul_fx_type<Q4_K>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case SPLIT | Q4_0: matmul_fx_type<SPLIT | Q4_0>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case SPLIT | Q4_1: matmul_fx_type<SPLIT | Q4_1>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case SPLIT | Q8_0: matmul_fx_type<SPLIT | Q8_0>(isa, wb, x, ldx, out, M, N, K, threads); return 0;
        case P8 | Q8_0: if (N % 8) return -1; matmul_p8(isa, wb, x, ldx, out, M, N, K, threads); return 0;
    }
    return -1;
}

// out = W (N GGUF rows of type wtype, K values each) repacked as SPLIT | wtype: the same bytes, each
// row's f16 scales first; or, asked for X8 | Q4_0 / X8 | Q4_1 (N % 8 == 0), with 8 rows interleaved
// (X16: N % 16 == 0, 16 rows); or, asked for P8 | Q8_0 (N % 8 == 0), 8 rows interleaved in pairs of codes.
// Returns the new type id, or -1 where that layout does not exist for the type or N.
extern "C" int blink_quant_repack(int wtype, const void* w, void* out, int64_t N, int64_t K) {
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    uint8_t* ob = static_cast<uint8_t*>(out);
    switch (wtype) {
        case X8 | Q4_0: if (N % 8) return -1; repack_x8<X8 | Q4_0>(wb, ob, N, K); return X8 | Q4_0;
        case X8 | Q4_1: if (N % 8) return -1; repack_x8<X8 | Q4_1>(wb, ob, N, K); return X8 | Q4_1;
        case X16 | Q4_0: if (N % 16) return -1; repack_x8<X16 | Q4_0>(wb, ob, N, K); return X16 | Q4_0;
        case X16 | Q4_1: if (N % 16) return -1; repack_x8<X16 | Q4_1>(wb, ob, N, K); return X16 | Q4_1;
        case P8 | Q8_0: if (N % 8) return -1; repack_p8(wb, ob, N, K); return P8 | Q8_0;
        case Q4_0:
        case SPLIT | Q4_0: repack<Q4_0>(wb, ob, N, K); return SPLIT | Q4_0;
        case Q4_1:
        case SPLIT | Q4_1: repack<Q4_1>(wb, ob, N, K); return SPLIT | Q4_1;
        case Q8_0:
        case SPLIT | Q8_0: repack<Q8_0>(wb, ob, N, K); return SPLIT | Q8_0;
    }
    return -1;
}
