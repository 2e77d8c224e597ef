// Fused CPU kernels for the CPU executor's decoder layer (bfloat16 and float32).
//
// Everything between two matmuls of a Llama layer, one pass over memory each:
//   rms_norm / add_rms_norm   residual add + RMSNorm (HF numerics: normalise in f32,
//                             round to the model dtype, then scale by the weight)
//   rope_cache                RoPE in place over the q and k heads of the fused qkv rows,
//                             then k and v written into the paged KV pool by slot
//   decode_attention          single-query rows over their paged context, straight from
//                             the pool's blocks (no gather copy), GQA groups share each K/V row:
//                             decodes, and the rows of a prefill chunk, each row with its own
//                             causal length (table_index maps rows to a shared block table)
//   silu_mul                  SwiGLU: silu(gate) * up from the fused gate|up rows
//
// Layouts (row-major, contiguous unless a stride is given):
//   qkv   [T, H + 2*KV, D]       q heads, then k heads, then v heads of each token
//   pool  [KV, blocks, bs, D]    one layer of KVPool.k / KVPool.v
//   cos/sin [T, D]               HF rotate_half convention, in the model dtype
// The pool is in the model dtype, or bf16 under float32 activations (the _f32kv16 entries: a CPU
// without bf16 math still halves its KV bytes); bf16 K/V rows are widened exactly as they are read.
// Rounding follows the PyTorch ops these replace, step by step (every bf16 op rounds its
// result), so the kernel path and the PyTorch path agree to the last bit in all but rare
// reduction-order cases. Attention accumulates in float32 and rounds once (with bf16 hardware dot
// products, P . V multiplies P rounded to bf16, as PyTorch's bf16 matmul and GPU flash attention do).
//
// Threads: OpenMP over rows / (sequence, kv head) pairs with the caller's thread count; the
// process shares PyTorch's libgomp (same soname), so there is one OpenMP runtime.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BLINK_AVX512_BF16 1      // -march=native on a CPU with vdpbf16ps: bf16 dot products in hardware
// GCC 12's AVX-512 headers initialise their "undefined" registers with `__Y = __Y`, which
// -W(maybe-)uninitialized reports at every inlined cast/shuffle: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#else
#define BLINK_AVX512_BF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>          // the float32 attention's 8-row dots
#endif

namespace {

struct BF16 {
    using T = uint16_t;
    static inline float load(T v) {
        uint32_t u = uint32_t(v) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static inline T store(float f) {          // round to nearest even, NaN kept quiet
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return T((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return T(u >> 16);
    }
    static inline float round(float f) { return load(store(f)); }
};

struct F32 {
    using T = float;
    static inline float load(T v) { return v; }
    static inline T store(float f) { return f; }
    static inline float round(float f) { return f; }
};

// exp for the softmax and SiLU loops (Cephes expf: Cody-Waite reduction, degree-5 polynomial,
// within 2 ulp of expf): plain arithmetic, so the loops vectorize (libm's expf does not
// without -ffast-math). Inputs are clamped to expf's finite range.
static inline float vexp(float x) {
    x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const int32_t bits = (int32_t(n) + 127) << 23;     // 2^n, n in [-126, 128)
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// x [rows, n] -> out = weight * dtype(x * rsqrt(mean(x^2) + eps)); with delta, first
// x = dtype(x + delta) in place (the residual stream), as `x + sublayer(x)` then the norm.
template <class P>
void add_rms_norm(typename P::T* x, const typename P::T* delta, const typename P::T* weight,
                  typename P::T* out, int64_t rows, int64_t n, float eps) {
    #pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
        typename P::T* xr = x + r * n;
        typename P::T* yr = out + r * n;
        if (delta) {
            const typename P::T* dr = delta + r * n;
            for (int64_t i = 0; i < n; ++i) xr[i] = P::store(P::load(xr[i]) + P::load(dr[i]));
        }
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
            float v = P::load(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / float(n) + eps);
        for (int64_t i = 0; i < n; ++i)
            yr[i] = P::store(P::load(weight[i]) * P::round(P::load(xr[i]) * inv));
    }
}

// RoPE on heads [0, rope_heads) of each qkv row, in place; then the row's k and v heads
// (at k_head, k_head + kv_heads) go to pool slot slots[t] = block * bs + offset.
// KV: the pool's type; a bf16 pool under float32 activations gets each k/v value rounded to bf16
// (nearest even), as a tensor's .to(torch.bfloat16) does.
template <class P, class KV>
void rope_cache(typename P::T* qkv, const typename P::T* cos, const typename P::T* sin,
                const int64_t* slots, typename KV::T* kc, typename KV::T* vc,
                int64_t tokens, int64_t heads_total, int64_t rope_heads, int64_t k_head, int64_t kv_heads,
                int64_t d, int64_t pool_slots) {
    const int64_t half = d / 2;
    #pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
        typename P::T* row = qkv + t * heads_total * d;
        const typename P::T* c = cos + t * d;
        const typename P::T* s = sin + t * d;
        for (int64_t h = 0; h < rope_heads; ++h) {
            typename P::T* x = row + h * d;
            float lo[512], hi[512];           // d <= 1024 (checked by the caller)
            for (int64_t i = 0; i < half; ++i) {
                lo[i] = P::load(x[i]);
                hi[i] = P::load(x[i + half]);
            }
            for (int64_t i = 0; i < half; ++i) {
                // x*cos + rotate_half(x)*sin, rotate_half = cat(-x[half:], x[:half])
                x[i] = P::store(P::round(lo[i] * P::load(c[i])) + P::round(-hi[i] * P::load(s[i])));
                x[i + half] = P::store(P::round(hi[i] * P::load(c[i + half])) +
                                       P::round(lo[i] * P::load(s[i + half])));
            }
        }
        const int64_t slot = slots[t];
        for (int64_t g = 0; g < kv_heads; ++g) {
            typename KV::T* kd = kc + (g * pool_slots + slot) * d;
            typename KV::T* vd = vc + (g * pool_slots + slot) * d;
            const typename P::T* ks = row + (k_head + g) * d;
            const typename P::T* vs = row + (k_head + kv_heads + g) * d;
            if constexpr (std::is_same_v<P, KV>) {
                std::memcpy(kd, ks, d * sizeof(typename P::T));
                std::memcpy(vd, vs, d * sizeof(typename P::T));
            } else {
                for (int64_t i = 0; i < d; ++i) kd[i] = KV::store(P::load(ks[i]));
                for (int64_t i = 0; i < d; ++i) vd[i] = KV::store(P::load(vs[i]));
            }
        }
    }
}

// q . k for one bf16 query head and one bf16 key row of DC elements: vdpbf16ps multiplies
// bf16 pairs exactly and accumulates in float32, 32 elements an instruction.
template <class P, int DC>
constexpr bool kHardwareDot = BLINK_AVX512_BF16 && std::is_same_v<P, BF16> && DC > 0 && DC % 32 == 0;

template <int DC>
static inline float dot_bf16(const uint16_t* q, const uint16_t* k) {
#if BLINK_AVX512_BF16
    __m512 acc = _mm512_setzero_ps();
    for (int v = 0; v < DC / 32; ++v)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * v),
                               (__m512bh)_mm512_loadu_si512(k + 32 * v));
    const __m256 h = _mm512_castps512_ps256(_mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4e)));
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_hadd_ps(x, x));
#else
    (void)q, (void)k;
    return 0.f;                  // never called: kHardwareDot is false without the instruction
#endif
}

// Four consecutive key rows (DC apart) against one query head: four dot products in one
// register, the horizontal sums shared (one reduction tree for four instead of four).
template <int DC>
static inline void dot4_bf16(const uint16_t* q, const uint16_t* k, float scale, float* out) {
#if BLINK_AVX512_BF16
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int v = 0; v < DC / 32; ++v) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + 32 * v);
        a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(k + 32 * v));
        a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(k + DC + 32 * v));
        a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(k + 2 * DC + 32 * v));
        a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(k + 3 * DC + 32 * v));
    }
    auto half = [](__m512 a) {        // upper 256 bits added onto the lower
        return _mm512_castps512_ps256(_mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4e)));
    };
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
    const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_mul_ps(sums, _mm_set1_ps(scale)));
#else
    (void)q, (void)k, (void)scale, (void)out;
#endif
}

// float32 K (CPUs without bf16 math): eight consecutive key rows (DC apart) against one
// pre-scaled query head, eight independent FMA chains (one per row) and one reduction tree
// for all eight, where a dot product per row chained DC / 8 FMAs and reduced each row alone.
// K and V rows may be bf16 under float32 activations (a bf16 pool: half the bytes a step streams):
// load8 widens them, 8 values at a time, exactly (bf16 is float32's upper half).
#if defined(__AVX2__) && defined(__FMA__)
template <class P, int DC>
constexpr bool kFloatDot8 = std::is_same_v<P, F32> && DC > 0 && DC % 8 == 0;

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <int DC, class KT>
static inline void dot8_f32(const float* q, const KT* k, float* out) {
    __m256 a[8];
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    for (int v = 0; v < DC / 8; ++v) {
        const __m256 qv = _mm256_loadu_ps(q + 8 * v);
        for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(k + t * DC + 8 * v), a[t]);
    }
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                        _mm256_permute2f128_ps(s0123, s4567, 0x31)));
}

// o[j] = sum_t p[j][t] v[t] for a group's heads over float32 V rows read in place through the
// table, a head and 64 dimensions a pass: 8 accumulators in registers, each position one
// broadcast and 8 FMAs (a float a[DC] accumulator went through the stack). Measured against 32
// dimensions x 3 heads a pass (each V chunk loaded once for the three): that read V's rows half
// a row at a time and was ~5% slower in the 1-row decode step, where V arrives cold.
template <int DC, class VT>
static inline void pv_f32(const float* p, int64_t len, const VT* vbase, const int64_t* table, int64_t bs,
                          int64_t group, float* out) {
    constexpr int C = DC % 64 == 0 ? 64 : (DC % 32 == 0 ? 32 : 8);
    for (int64_t j = 0; j < group; ++j) {
        const float* pj = p + j * len;
        for (int c0 = 0; c0 < DC; c0 += C) {
            __m256 a[C / 8];
            for (int v = 0; v < C / 8; ++v) a[v] = _mm256_setzero_ps();
            for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += bs) {
                const int64_t n = len - t0 < bs ? len - t0 : bs;
                const VT* vb = vbase + table[blk] * bs * DC + c0;
                for (int64_t o = 0; o < n; ++o) {
                    const __m256 pv = _mm256_broadcast_ss(pj + t0 + o);
                    for (int v = 0; v < C / 8; ++v) a[v] = _mm256_fmadd_ps(pv, load8(vb + o * DC + 8 * v), a[v]);
                }
            }
            for (int v = 0; v < C / 8; ++v) _mm256_storeu_ps(out + j * DC + c0 + 8 * v, a[v]);
        }
    }
}

// Scores of H <= 3 query heads (a GQA group, pre-scaled float32 queries qf [H, DC]) against bf16 key
// rows, four positions a pass: each K row's 8 values widened once in a register for the H heads (12
// accumulators). Before, each block was widened into a float32 scratch block and each head's dot8_f32
// loaded it back (P . V likewise): on Zen 1 those stores and reloads were ~45% of the attention's
// samples, and this kernel took 30 layers at 192 positions from 1.25-1.36 to 0.81-0.99 ms (2 threads;
// 1.54-1.75 from 2.09-2.18 ms at 256 on one). Each position's sum is
// dot8_f32's: its 8-lane FMA chain over the dimensions in order, then the same hadd tree, so the
// same bits. out[j * ld + t] for t < 4.
template <int DC, int H>
static inline void dot4_heads_bf16(const float* qf, const uint16_t* k, float* out, int64_t ld) {
    __m256 a[H][4];
    for (int j = 0; j < H; ++j)
        for (int t = 0; t < 4; ++t) a[j][t] = _mm256_setzero_ps();
    for (int v = 0; v < DC / 8; ++v) {
        __m256 q[H];
        for (int j = 0; j < H; ++j) q[j] = _mm256_loadu_ps(qf + j * DC + 8 * v);
        for (int t = 0; t < 4; ++t) {
            const __m256 kv = load8(k + t * DC + 8 * v);
            for (int j = 0; j < H; ++j) a[j][t] = _mm256_fmadd_ps(q[j], kv, a[j][t]);
        }
    }
    for (int j = 0; j < H; ++j) {
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[j][0], a[j][1]), _mm256_hadd_ps(a[j][2], a[j][3]));
        _mm_storeu_ps(out + j * ld, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
    }
}

// o[j] += sum_t p[j][t] v[t] over one block's n bf16 V rows for H <= 3 heads, 32 dimensions a pass
// (12 accumulators): each V row's values widened once in a register for the H heads. Each head and
// dimension sums the positions in order, the accumulators through `out` between blocks: the bits of
// pv_f32 over the widened rows.
template <int DC, int H>
static inline void pv_heads_bf16(const float* p, int64_t ld, const uint16_t* vb, int64_t n, bool first, float* out) {
    static_assert(DC % 32 == 0, "32 dimensions a pass");
    for (int c0 = 0; c0 < DC; c0 += 32) {
        __m256 a[H][4];
        for (int j = 0; j < H; ++j)
            for (int u = 0; u < 4; ++u)
                a[j][u] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + j * DC + c0 + 8 * u);
        for (int64_t o = 0; o < n; ++o) {
            __m256 pj[H];
            for (int j = 0; j < H; ++j) pj[j] = _mm256_broadcast_ss(p + j * ld + o);
            for (int u = 0; u < 4; ++u) {
                const __m256 vv = load8(vb + o * DC + c0 + 8 * u);
                for (int j = 0; j < H; ++j) a[j][u] = _mm256_fmadd_ps(pj[j], vv, a[j][u]);
            }
        }
        for (int j = 0; j < H; ++j)
            for (int u = 0; u < 4; ++u) _mm256_storeu_ps(out + j * DC + c0 + 8 * u, a[j][u]);
    }
}

// The group's heads three at a time (then two, then one) through the kernels above.
template <int DC>
static inline void dot4_group_bf16(const float* qf, int64_t hn, const uint16_t* k, float* out, int64_t ld) {
    int64_t j = 0;
    for (; j + 3 <= hn; j += 3) dot4_heads_bf16<DC, 3>(qf + j * DC, k, out + j * ld, ld);
    if (hn - j == 2) dot4_heads_bf16<DC, 2>(qf + j * DC, k, out + j * ld, ld);
    else if (hn - j == 1) dot4_heads_bf16<DC, 1>(qf + j * DC, k, out + j * ld, ld);
}

template <int DC>
static inline void pv_group_bf16(const float* p, int64_t len, const uint16_t* vbase, const int64_t* table,
                                 int64_t bs, int64_t hn, float* out) {
    for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += bs) {
        const int64_t n = len - t0 < bs ? len - t0 : bs;
        const uint16_t* vb = vbase + table[blk] * bs * DC;
        int64_t j = 0;
        for (; j + 3 <= hn; j += 3) pv_heads_bf16<DC, 3>(p + j * len + t0, len, vb, n, t0 == 0, out + j * DC);
        if (hn - j == 2) pv_heads_bf16<DC, 2>(p + j * len + t0, len, vb, n, t0 == 0, out + j * DC);
        else if (hn - j == 1) pv_heads_bf16<DC, 1>(p + j * len + t0, len, vb, n, t0 == 0, out + j * DC);
    }
}
#else
template <class P, int DC>
constexpr bool kFloatDot8 = false;

template <int DC, class KT>
static inline void dot8_f32(const float*, const KT*, float*) {}

template <int DC, class VT>
static inline void pv_f32(const float*, int64_t, const VT*, const int64_t*, int64_t, int64_t, float*) {}

template <int DC>
static inline void dot4_group_bf16(const float*, int64_t, const uint16_t*, float*, int64_t) {}

template <int DC>
static inline void pv_group_bf16(const float*, int64_t, const uint16_t*, const int64_t*, int64_t, int64_t, float*) {}
#endif

// A row's K and V blocks live wherever the table puts them, and a decode step reaches them cold
// (the step's ~100 MB of weights streamed through the caches since the last step): waiting on
// them one block at a time leaves the memory bus idle. So a (row, kv head) item asks for its
// first kPrefetchBlocks blocks of K and of V into L2 when it starts, and for block blk + that
// while its scores reach block blk: by the time the scores and P . V need a block it is near.
constexpr int64_t kPrefetchBlocks = 4;     // 8, 16 and 64 measured slower (the prefetches queue)

static inline void prefetch_block(const void* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 2);
}

// K and V of the table's blocks [from, min(to, blocks)).
static inline void prefetch_kv(const void* kbase, const void* vbase, const int64_t* table, int64_t from, int64_t to,
                               int64_t blocks, int64_t block_bytes) {
    for (int64_t i = from; i < to && i < blocks; ++i) {
        prefetch_block(static_cast<const char*>(kbase) + table[i] * block_bytes, block_bytes);
        prefetch_block(static_cast<const char*>(vbase) + table[i] * block_bytes, block_bytes);
    }
}

#if BLINK_AVX512_BF16
// o[j] = sum_t p[j][t] v[t] for heads j < group of one (row, kv head) item, on vdpbf16ps: two
// positions at a time, their V rows interleaved as bf16 pairs (unpacklo/hi_epi16) against the
// pair (p[t], p[t+1]) broadcast, so one instruction takes two positions of 16 dimensions and no V
// row is converted to float32. P is rounded to bf16 first (pb), as GPU flash attention and
// PyTorch's bf16 matmul do; the sums stay float32. Up to 256 / DC heads share each pass over V
// (their accumulators stay in registers: 16 zmm), so the positions feed independent chains.
// The interleave permutes dimensions within each 128-bit lane (lo: 0-3 of the lane's 8, hi: 4-7);
// the stores put them back.
template <int DC>
static inline void pv_bf16(const uint16_t* pb, int64_t len, const uint16_t* vbase, const int64_t* table, int64_t bs,
                           int64_t group, float* acc_out) {
    constexpr int V = DC / 32;                    // zmm of bf16 per V row
    constexpr int HC = DC <= 256 ? 256 / DC : 1;  // heads per pass
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t j0 = 0; j0 < group; j0 += HC) {
        const int hc = int(group - j0 < HC ? group - j0 : HC);
        __m512 lo[HC][V], hi[HC][V];
        for (int h = 0; h < HC; ++h)
            for (int v = 0; v < V; ++v) lo[h][v] = hi[h][v] = _mm512_setzero_ps();
        for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += bs) {
            const int64_t n = len - t0 < bs ? len - t0 : bs;
            const uint16_t* vb = vbase + table[blk] * bs * DC;
            for (int64_t o = 0; o < n; o += 2) {
                const bool pair = o + 1 < n;
                __m512i il[V], ih[V];
                for (int v = 0; v < V; ++v) {
                    const __m512i r0 = _mm512_loadu_si512(vb + o * DC + 32 * v);
                    const __m512i r1 = pair ? _mm512_loadu_si512(vb + (o + 1) * DC + 32 * v) : zero;
                    il[v] = _mm512_unpacklo_epi16(r0, r1);
                    ih[v] = _mm512_unpackhi_epi16(r0, r1);
                }
                for (int h = 0; h < HC; ++h) {
                    if (h >= hc) break;
                    const uint16_t* pj = pb + (j0 + h) * len + t0 + o;
                    const uint32_t pp = uint32_t(pj[0]) | (pair ? uint32_t(pj[1]) << 16 : 0u);
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pp));
                    for (int v = 0; v < V; ++v) {
                        lo[h][v] = _mm512_dpbf16_ps(lo[h][v], pv, (__m512bh)il[v]);
                        hi[h][v] = _mm512_dpbf16_ps(hi[h][v], pv, (__m512bh)ih[v]);
                    }
                }
            }
        }
        for (int h = 0; h < hc; ++h)
            for (int v = 0; v < V; ++v) {      // lanes [lo.L0 lo.L1 hi.L0 hi.L1] -> [lo.L0 hi.L0 lo.L1 hi.L1]
                const __m512 a = _mm512_shuffle_f32x4(lo[h][v], hi[h][v], 0x44);
                const __m512 b = _mm512_shuffle_f32x4(lo[h][v], hi[h][v], 0xee);
                float* out = acc_out + (j0 + h) * DC + 32 * v;
                _mm512_storeu_ps(out, _mm512_shuffle_f32x4(a, a, 0xd8));
                _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(b, b, 0xd8));
            }
    }
}
#endif

// Positions a work item covers at most: a row's context is cut into chunks of this many (whole
// blocks), each a (row, kv head, chunk) item with its own softmax partials, combined afterwards
// (flash-decoding). Before, one row's context was one item per kv head, and a row short of
// items was cut by query head (head_parts) instead: each part then read and widened its kv head's
// whole K/V again, so on two threads one row's attention ran no faster than on one (the AVX2-only
// EPYC, Zen 1: 30 layers at 1,024 positions 6.5 / 6.1 ms on 1 / 2 threads). The cut depends on
// the lengths alone, never on the team or the batch: a row's bits are the same on any team and
// beside any other rows. Rows of at most kChunkPositions are one chunk: the single-pass softmax as
// before.
constexpr int64_t kChunkPositions = 128;

// Softmax partials a chunk item leaves for the combine pass: its max score, its sum of exp(s - max)
// and its unnormalised sums of p . v, for each of the row's query heads and chunks.
static inline float* chunk_partials(size_t floats) {       // called by one thread of the team
    static thread_local std::vector<float> buf;
    if (buf.size() < floats) buf.resize(floats);
    return buf.data();
}

// Parts a (row, kv head, chunk) item's group of query heads is cut into: enough items for twice the
// team (dynamic scheduling evens them out), never more parts than heads. Called inside the team.
static inline int64_t head_parts(int64_t items, int64_t group) {
    const int64_t want = 2 * int64_t(omp_get_num_threads());
    if (items >= want || group <= 1) return 1;
    const int64_t parts = (want + items - 1) / items;
    return parts < group ? parts : group;
}

// One query row at a time: o[b, h] = softmax(q[b, h] . K^T * scale) V over the first
// context_lens[b] cached positions of row b's sequence, found through block table
// tables[table_index[b]] (tables[b] when table_index is null). A decode is one row; a prefill
// chunk of n tokens ending at position c - 1 is n rows sharing one table, with lengths
// c - n + 1 .. c: causal attention without a mask, and one work list for the whole step.
// q rows are strided (q_stride elements between tokens: the fused qkv rows); o is [B, H, D].
// A work item is a (row, kv head, chunk of kChunkPositions) triple with its group of query heads,
// or, where a step has fewer such items than twice the team, a part of that group (head_parts):
// a 100-position decode row of SmolLM2 is 3 items for 2 threads, so one thread ran two while the
// other waited at the next barrier. Each query head's sums are its own whichever part it falls in:
// the same bits either way. Rows of more than one chunk combine their chunks' partials after the
// items (a second loop over (row, query head), in chunk order).
template <class P, class KV, int DC>
void decode_attention_impl(const typename P::T* q, int64_t q_stride, const typename KV::T* kc,
                           const typename KV::T* vc, const int64_t* tables, const int64_t* table_index,
                           int64_t max_blocks, const int64_t* context_lens, typename P::T* o,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t d_rt,
                           int64_t num_blocks, int64_t bs, float scale) {
    const int64_t d = DC ? DC : d_rt;
    const int64_t group = heads / kv_heads;
    const int64_t pool_slots = num_blocks * bs;
    const int64_t chunk_blocks = std::max<int64_t>(1, kChunkPositions / bs), chunk = chunk_blocks * bs;
    int64_t max_len = 0, items = 0;
    for (int64_t b = 0; b < batch; ++b) {
        max_len = std::max(max_len, context_lens[b]);
        items += std::max<int64_t>(1, (context_lens[b] + chunk - 1) / chunk);
    }
    const int64_t chunks = std::max<int64_t>(1, (max_len + chunk - 1) / chunk);   // a row's at most
    const int64_t parts = head_parts(items * kv_heads, group);
    const int64_t per_part = (group + parts - 1) / parts;     // query heads an item (the last may have fewer)
    const int64_t pstride = d + 2;                            // a partial: max, sum, then d sums
    float* partials = nullptr;
    if (chunks > 1) {
        #pragma omp single copyprivate(partials)
        partials = chunk_partials(size_t(batch * heads * chunks * pstride));
    }
    {
        std::vector<float> qf, scores, acc, row;
        std::vector<uint16_t> pb;           // P in bf16 (the hardware-dot path)
        #pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < batch * kv_heads * chunks * parts; ++w) {
            const int64_t b = w / (kv_heads * chunks * parts), g = w / (chunks * parts) % kv_heads;
            const int64_t c = w / parts % chunks;                              // the item's chunk of the row
            const int64_t h0 = g * group + w % parts * per_part;              // the item's first query head
            const int64_t hn = std::min(per_part, (g + 1) * group - h0);      // ... and how many
            const int64_t full = context_lens[b];
            if (hn <= 0 || (c > 0 && c * chunk >= full)) continue;
            const bool split = full > chunk;                                  // partials, combined below
            const int64_t len = split ? std::min(chunk, full - c * chunk) : full;   // this chunk's positions
            scores.resize(hn * (len > 0 ? len : 1));
            acc.assign(hn * d, 0.f);
            row.resize(bs * d);            // one block of K or V rows in float32
            if constexpr (!kHardwareDot<P, DC>) {     // the hardware dot reads the bf16 query itself
                qf.resize(hn * d);
                for (int64_t j = 0; j < hn; ++j)
                    for (int64_t i = 0; i < d; ++i)
                        qf[j * d + i] = P::load(q[b * q_stride + (h0 + j) * d + i]) * scale;
            }
            const typename P::T* qh = q + b * q_stride;                 // this token's query heads
            const int64_t* table = tables + (table_index ? table_index[b] : b) * max_blocks + c * chunk_blocks;
            const typename KV::T* kbase = kc + g * pool_slots * d;
            const typename KV::T* vbase = vc + g * pool_slots * d;
            const int64_t blocks = (len + bs - 1) / bs;
            const int64_t block_bytes = bs * d * int64_t(sizeof(typename KV::T));
            prefetch_kv(kbase, vbase, table, 0, kPrefetchBlocks, blocks, block_bytes);
            // Block by block through the table: no division per position.
            for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += bs) {    // scores = q . k
                const int64_t n = len - t0 < bs ? len - t0 : bs;
                const typename KV::T* kb = kbase + table[blk] * bs * d;
                prefetch_kv(kbase, vbase, table, blk + kPrefetchBlocks, blk + kPrefetchBlocks + 1, blocks, block_bytes);
                int64_t o = 0;
                if constexpr (kHardwareDot<P, DC>) {
                    for (; o + 4 <= n; o += 4)
                        for (int64_t j = 0; j < hn; ++j)
                            dot4_bf16<DC>(qh + (h0 + j) * d, kb + o * d, scale, &scores[j * len + t0 + o]);
                } else if constexpr (kFloatDot8<P, DC>) {
                    if constexpr (std::is_same_v<KV, F32>) {
                        for (; o + 8 <= n; o += 8)
                            for (int64_t j = 0; j < hn; ++j)
                                dot8_f32<DC>(qf.data() + j * d, kb + o * d, &scores[j * len + t0 + o]);
                    } else {                 // bf16 K: each row widened in registers for the item's heads
                        const int64_t n8 = n / 8 * 8;
                        for (; o < n8; o += 4) dot4_group_bf16<DC>(qf.data(), hn, kb + o * d, &scores[t0 + o], len);
                    }
                }
                for (; o < n; ++o) {
                    const typename KV::T* __restrict k = kb + o * d;
                    if constexpr (kHardwareDot<P, DC>) {
                        for (int64_t j = 0; j < hn; ++j)
                            scores[j * len + t0 + o] = dot_bf16<DC>(qh + (h0 + j) * d, k) * scale;
                        continue;
                    }
                    float* __restrict r = row.data();
                    for (int64_t i = 0; i < d; ++i) r[i] = KV::load(k[i]);
                    for (int64_t j = 0; j < hn; ++j) {
                        const float* __restrict qj = qf.data() + j * d;
                        float dot = 0.f;
                        #pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < d; ++i) dot += qj[i] * r[i];
                        scores[j * len + t0 + o] = dot;
                    }
                }
            }
            if constexpr (kHardwareDot<P, DC>) pb.resize(hn * len);
            for (int64_t j = 0; j < hn; ++j) {           // softmax over the context
                float* sj = scores.data() + j * len;
                float mx = -INFINITY;
                #pragma omp simd reduction(max : mx)
                for (int64_t t = 0; t < len; ++t) mx = sj[t] > mx ? sj[t] : mx;
                float sum = 0.f;
                #pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; ++t) {
                    sj[t] = vexp(sj[t] - mx);
                    sum += sj[t];
                }
                if (split) {                       // the combine pass normalises
                    float* part = partials + ((b * heads + h0 + j) * chunks + c) * pstride;
                    part[0] = mx;
                    part[1] = sum;
                }
                const float inv = split ? 1.f : (sum > 0.f ? 1.f / sum : 0.f);
                if constexpr (kHardwareDot<P, DC>) {      // P . V on bf16 pairs: P rounded once
                    uint16_t* pj = pb.data() + j * len;
                    for (int64_t t = 0; t < len; ++t) pj[t] = BF16::store(sj[t] * inv);
                } else {
                    for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
                }
            }
            if constexpr (kHardwareDot<P, DC>) {
#if BLINK_AVX512_BF16
                pv_bf16<DC>(pb.data(), len, vbase, table, bs, hn, acc.data());
#endif
            } else if constexpr (kFloatDot8<P, DC> && !std::is_same_v<KV, F32>) {
                pv_group_bf16<DC>(scores.data(), len, vbase, table, bs, hn, acc.data());
            } else if constexpr (kFloatDot8<P, DC>) {
                pv_f32<DC>(scores.data(), len, vbase, table, bs, hn, acc.data());
            } else
            // o = p . v, a block at a time: its rows converted once, then per query head an
            // accumulator that stays in registers across the block (a memory accumulator
            // chains every position through store-to-load forwarding: 3x slower).
            for (int64_t blk = 0, t0 = 0; t0 < len; ++blk, t0 += bs) {
                const int64_t n = len - t0 < bs ? len - t0 : bs;
                const typename KV::T* __restrict vb = vbase + table[blk] * bs * d;
                const float* __restrict vf;
                if constexpr (std::is_same_v<KV, F32>) {
                    vf = vb;                          // float32 rows: read in place
                } else {
                    float* conv = row.data();
                    for (int64_t i = 0; i < n * d; ++i) conv[i] = KV::load(vb[i]);
                    vf = conv;
                }
                for (int64_t j = 0; j < hn; ++j) {
                    const float* __restrict pj = scores.data() + j * len + t0;
                    float* __restrict aj = acc.data() + j * d;
                    if constexpr (DC > 0) {
                        float a[DC];
                        for (int64_t i = 0; i < DC; ++i) a[i] = aj[i];
                        for (int64_t o = 0; o < n; ++o)
                            for (int64_t i = 0; i < DC; ++i) a[i] += pj[o] * vf[o * DC + i];
                        for (int64_t i = 0; i < DC; ++i) aj[i] = a[i];
                    } else {
                        for (int64_t o = 0; o < n; ++o)
                            for (int64_t i = 0; i < d; ++i) aj[i] += pj[o] * vf[o * d + i];
                    }
                }
            }
            for (int64_t j = 0; j < hn; ++j) {
                if (split) {
                    float* part = partials + ((b * heads + h0 + j) * chunks + c) * pstride + 2;
                    std::memcpy(part, acc.data() + j * d, size_t(d) * sizeof(float));
                } else {
                    for (int64_t i = 0; i < d; ++i) o[(b * heads + h0 + j) * d + i] = P::store(acc[j * d + i]);
                }
            }
        }
    }
    if (chunks == 1) return;
    // Rows of several chunks: o = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, M = max_c m_c, the
    // chunks in order (after the items' loop and its barrier).
    std::vector<float> out(d);
    #pragma omp for schedule(static)
    for (int64_t bh = 0; bh < batch * heads; ++bh) {
        const int64_t b = bh / heads, full = context_lens[b];
        if (full <= chunk) continue;
        const int64_t nc = (full + chunk - 1) / chunk;
        const float* part = partials + bh * chunks * pstride;
        float m = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) m = std::max(m, part[c * pstride]);
        float l = 0.f;
        std::fill(out.begin(), out.end(), 0.f);
        for (int64_t c = 0; c < nc; ++c) {
            const float* pc = part + c * pstride;
            const float f = vexp(pc[0] - m);
            l += f * pc[1];
            for (int64_t i = 0; i < d; ++i) out[i] += f * pc[2 + i];
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t i = 0; i < d; ++i) o[bh * d + i] = P::store(out[i] * inv);
    }
}

template <class P, class KV = P>
void decode_attention(const typename P::T* q, int64_t q_stride, const typename KV::T* kc,
                      const typename KV::T* vc, const int64_t* tables, const int64_t* table_index,
                      int64_t max_blocks, const int64_t* context_lens, typename P::T* o,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t num_blocks,
                      int64_t bs, float scale) {
    // The common head sizes get a compile-time D, so the inner loops unroll into whole vectors.
    auto run = [&](auto impl) {
        impl(q, q_stride, kc, vc, tables, table_index, max_blocks, context_lens, o, batch, heads, kv_heads, d,
             num_blocks, bs, scale);
    };
    if (d == 64) run(decode_attention_impl<P, KV, 64>);
    else if (d == 128) run(decode_attention_impl<P, KV, 128>);
    else run(decode_attention_impl<P, KV, 0>);
}

// gate_up [rows, 2n] (gate, then up) -> out [rows, n] = dtype(silu(gate)) * up, rounded.
template <class P>
void silu_mul_cols(const typename P::T* gate_up, typename P::T* out, int64_t r, int64_t c0, int64_t c1, int64_t n) {
    const typename P::T* gate = gate_up + r * 2 * n;
    const typename P::T* up = gate + n;
    typename P::T* y = out + r * n;
    #pragma omp simd
    for (int64_t i = c0; i < c1; ++i) {
        const float x = P::load(gate[i]);
        y[i] = P::store(P::round(x / (1.f + vexp(-x))) * P::load(up[i]));
    }
}

template <class P>
void silu_mul(const typename P::T* gate_up, typename P::T* out, int64_t rows, int64_t n) {
    #pragma omp for
    for (int64_t r = 0; r < rows; ++r) silu_mul_cols<P>(gate_up, out, r, 0, n, n);
}


#if BLINK_AVX512_BF16
// ---- Small-batch bf16 matmul: y[M, N] = x[M, K] . w[N, K]^T (+ bias), float32 accumulation ----
// Decode multiplies a handful of rows by every weight once a step, so the weights stream
// from DRAM and the arithmetic should hide under that stream. Each weight row is read
// exactly once (two rows of w against up to 8 rows of x: 16 accumulators in registers,
// vdpbf16ps over 32 elements), with software prefetch 8 KiB ahead. Above 8 rows the
// arithmetic no longer hides (one vdpbf16ps a cycle) and oneDNN's blocked GEMM wins.

// Four accumulators -> their four sums, sharing one reduction tree.
static inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    auto half = [](__m512 a) {
        return _mm512_castps512_ps256(_mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4e)));
    };
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

constexpr int kMaxRowsX = 8;        // rows of x in one pass (x stays in L1); larger M: oneDNN
constexpr int kAccumulators = 16;   // zmm accumulators per micro-kernel: rows of w x rows of x
constexpr int64_t kPrefetchAhead = 4096;   // elements of w (8 KiB) the prefetches run ahead

// NR consecutive rows of w against MC rows of x: NR * MC accumulators in registers; each
// 32-element step of K loads NR weight vectors once and every x vector once (from L1).
template <int MC, int NR>
static void gemm_rows(const uint16_t* x, int64_t K, const uint16_t* w, bool prefetch, float* out) {
    static_assert(MC * NR <= kAccumulators, "more accumulators than registers");
    __m512 a[NR][MC];
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < MC; ++m) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NR];
        for (int r = 0; r < NR; ++r) {
            if (prefetch) __builtin_prefetch(w + r * K + k + kPrefetchAhead, 0, 3);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        }
        for (int m = 0; m < MC; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
            for (int r = 0; r < NR; ++r) a[r][m] = _mm512_dpbf16_ps(a[r][m], xv, wv[r]);
        }
    }
    // out[r * MC + m]; sums four accumulators at a time
    alignas(16) float s[4];
    constexpr int total = NR * MC;
    const __m512* flat = &a[0][0];
    int i = 0;
    for (; i + 4 <= total; i += 4) {
        _mm_store_ps(s, hsum4(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]));
        for (int j = 0; j < 4; ++j) out[i + j] = s[j];
    }
    for (; i < total; ++i) {
        _mm_store_ps(s, hsum4(flat[i], flat[i], flat[i], flat[i]));
        out[i] = s[0];
    }
}

using GemmFn = void (*)(const uint16_t*, int64_t, const uint16_t*, bool, float*);

template <int NR, int... MC>
static constexpr GemmFn pick(int mc, std::integer_sequence<int, MC...>) {
    GemmFn fn = nullptr;
    ((fn = (MC + 1 == mc && (MC + 1) * NR <= kAccumulators) ? gemm_rows<(MC + 1) * NR <= kAccumulators ? MC + 1 : 1, NR> : fn), ...);
    return fn;
}

// Rows of w per micro-kernel: two (measured on Zen 4 with weights streaming from DRAM, 30
// SmolLM2 layers: 4 rows with up to 4 rows of x, or 1 row with 16, were slower at every M).
static inline int rows_of_w(int) { return 2; }

static GemmFn gemm_fn(int mc, int nr) {
    const auto seq = std::make_integer_sequence<int, kMaxRowsX>{};
    return nr == 4 ? pick<4>(mc, seq) : (nr == 2 ? pick<2>(mc, seq) : pick<1>(mc, seq));
}

// y [M, N] = x [M, K] . w [N, K]^T (+ bias), the weight streamed once: each group of w rows
// (in L1 after the first chunk) meets x in chunks of up to kMaxRowsX rows. OutT uint16_t rounds
// to bf16 (the projections); float keeps the float32 sums (the logits: rounded to bf16, logits
// near 25 are 0.125 apart, which turns near-ties into exact ties that argmax breaks by token id).
template <class OutT>
void linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, OutT* y,
                 int64_t M, int64_t N, int64_t K, int threads) {
    const int full = int(M < kMaxRowsX ? M : kMaxRowsX);          // rows of x in every chunk but the last
    const int last = int(M - (M - 1) / kMaxRowsX * kMaxRowsX);     // ... and in the last
    const int nr = rows_of_w(full);
    // The micro-kernels, picked once: [0] for full chunks, [1] for the last one.
    const GemmFn main_fn[2] = {gemm_fn(full, nr), gemm_fn(last, nr)};
    const GemmFn tail_fn[2] = {gemm_fn(full, 1), gemm_fn(last, 1)};
    const int64_t groups = (N + nr - 1) / nr;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && groups > 1)
    for (int64_t g = 0; g < groups; ++g) {
        float acc[kAccumulators];
        const int64_t n0 = g * nr;
        const int rows = int(N - n0 < nr ? N - n0 : nr);
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRowsX) {
            const bool is_last = m0 + kMaxRowsX >= M;
            const int mc = is_last ? last : full;
            const uint16_t* xc = x + m0 * K;
            if (rows == nr) {
                main_fn[is_last](xc, K, w + n0 * K, m0 == 0 && n0 + nr < N, acc);
            } else {
                for (int r = 0; r < rows; ++r) tail_fn[is_last](xc, K, w + (n0 + r) * K, false, acc + r * mc);
            }
            for (int r = 0; r < rows; ++r) {
                const float b = bias ? BF16::load(bias[n0 + r]) : 0.f;
                for (int m = 0; m < mc; ++m) {
                    const float v = acc[r * mc + m] + b;
                    if constexpr (std::is_same_v<OutT, float>) y[(m0 + m) * N + n0 + r] = v;
                    else y[(m0 + m) * N + n0 + r] = BF16::store(v);
                }
            }
        }
    }
}
#endif

}  // namespace

// C ABI for ctypes: one entry per kernel and dtype (suffix _bf16 / _f32); pointers are raw
// tensor data pointers, sizes int64. Returns nothing: the Python side validates shapes.
#define BLINK_EXPORT(SUF, P)                                                                             \
    extern "C" void blink_add_rms_norm_##SUF(void* x, const void* delta, const void* w, void* out,       \
                                             int64_t rows, int64_t n, float eps, int threads) {          \
        _Pragma("omp parallel num_threads(threads) if (threads > 1 && rows > 1)")                       \
        add_rms_norm<P>((P::T*)x, (const P::T*)delta, (const P::T*)w, (P::T*)out, rows, n, eps);          \
    }                                                                                                    \
    extern "C" void blink_silu_mul_##SUF(const void* gate_up, void* out, int64_t rows, int64_t n,        \
                                         int threads) {                                                  \
        _Pragma("omp parallel num_threads(threads) if (threads > 1 && rows > 1)")                       \
        silu_mul<P>((const P::T*)gate_up, (P::T*)out, rows, n);                                          \
    }

BLINK_EXPORT(bf16, BF16)
BLINK_EXPORT(f32, F32)

// The kernels that touch the pool, per (activations, pool) type pair: f32 / bf16 (alike) and
// f32kv16 (float32 activations over a bf16 pool: a CPU without bf16 math still halves its KV bytes).
#define BLINK_POOL_EXPORT(SUF, P, KV)                                                                    \
    extern "C" void blink_rope_cache_##SUF(void* qkv, const void* cos, const void* sin,                  \
                                           const int64_t* slots, void* kc, void* vc, int64_t tokens,     \
                                           int64_t heads_total, int64_t rope_heads, int64_t k_head,      \
                                           int64_t kv_heads, int64_t d, int64_t pool_slots, int threads) { \
        _Pragma("omp parallel num_threads(threads) if (threads > 1 && tokens > 1)")                     \
        rope_cache<P, KV>((P::T*)qkv, (const P::T*)cos, (const P::T*)sin, slots, (KV::T*)kc, (KV::T*)vc, \
                          tokens, heads_total, rope_heads, k_head, kv_heads, d, pool_slots);             \
    }                                                                                                    \
    extern "C" void blink_decode_attention_##SUF(const void* q, int64_t q_stride, const void* kc,        \
                                                 const void* vc, const int64_t* tables,                  \
                                                 const int64_t* table_index, int64_t max_blocks,         \
                                                 const int64_t* context_lens, void* o, int64_t batch,    \
                                                 int64_t heads, int64_t kv_heads, int64_t d,             \
                                                 int64_t num_blocks, int64_t bs, float scale,            \
                                                 int threads) {                                          \
        _Pragma("omp parallel num_threads(threads) if (threads > 1 && batch * heads > 1)")                \
        decode_attention<P, KV>((const P::T*)q, q_stride, (const KV::T*)kc, (const KV::T*)vc, tables,    \
                                table_index, max_blocks, context_lens, (P::T*)o, batch, heads, kv_heads, \
                                d, num_blocks, bs, scale);                                               \
    }

BLINK_POOL_EXPORT(bf16, BF16, BF16)
BLINK_POOL_EXPORT(f32, F32, F32)
BLINK_POOL_EXPORT(f32kv16, F32, BF16)

// Team bodies for blink_forward (forward.cc), bf16 or float32 by `bf16`: called by every thread of
// an OpenMP team, the rows (attention: sequence x kv head pairs) shared out with orphaned `omp for`
// loops, each complete for every thread when it returns (the loops' implicit barriers).
namespace blink_team {
template <class Fn>
static inline void by_dtype(bool bf16, Fn&& fn) {
    if (bf16) fn(BF16{});
    else fn(F32{});
}

// (activations, pool): bf16 activations keep a bf16 pool; float32 ones a float32 or a bf16 pool.
template <class Fn>
static inline void by_dtypes(bool bf16, bool kv_bf16, Fn&& fn) {
    if (bf16) fn(BF16{}, BF16{});
    else if (kv_bf16) fn(F32{}, BF16{});
    else fn(F32{}, F32{});
}

void add_rms_norm(bool bf16, void* x, const void* delta, const void* w, void* out, int64_t rows, int64_t n,
                  float eps) {
    by_dtype(bf16, [&](auto p) {
        using P = decltype(p);
        ::add_rms_norm<P>((typename P::T*)x, (const typename P::T*)delta, (const typename P::T*)w,
                          (typename P::T*)out, rows, n, eps);
    });
}

void rope_cache(bool bf16, bool kv_bf16, void* qkv, const void* cos, const void* sin, const int64_t* slots,
                void* kc, void* vc, int64_t tokens, int64_t heads_total, int64_t rope_heads, int64_t k_head,
                int64_t kv_heads, int64_t d, int64_t pool_slots) {
    by_dtypes(bf16, kv_bf16, [&](auto p, auto kv) {
        using P = decltype(p);
        using KV = decltype(kv);
        ::rope_cache<P, KV>((typename P::T*)qkv, (const typename P::T*)cos, (const typename P::T*)sin, slots,
                            (typename KV::T*)kc, (typename KV::T*)vc, tokens, heads_total, rope_heads, k_head,
                            kv_heads, d, pool_slots);
    });
}

void decode_attention(bool bf16, bool kv_bf16, const void* q, int64_t q_stride, const void* kc, const void* vc,
                      const int64_t* tables, int64_t max_blocks, const int64_t* context_lens, void* o,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t bs,
                      float scale) {
    by_dtypes(bf16, kv_bf16, [&](auto p, auto kv) {
        using P = decltype(p);
        using KV = decltype(kv);
        ::decode_attention<P, KV>((const typename P::T*)q, q_stride, (const typename KV::T*)kc,
                                  (const typename KV::T*)vc, tables, nullptr, max_blocks, context_lens,
                                  (typename P::T*)o, batch, heads, kv_heads, d, num_blocks, bs, scale);
    });
}

void silu_mul_cols(bool bf16, const void* gate_up, void* out, int64_t r, int64_t c0, int64_t c1, int64_t n) {
    by_dtype(bf16, [&](auto p) {
        using P = decltype(p);
        ::silu_mul_cols<P>((const typename P::T*)gate_up, (typename P::T*)out, r, c0, c1, n);
    });
}

void silu_mul(bool bf16, const void* gate_up, void* out, int64_t rows, int64_t n) {
    by_dtype(bf16, [&](auto p) {
        using P = decltype(p);
        ::silu_mul<P>((const typename P::T*)gate_up, (typename P::T*)out, rows, n);
    });
}
}  // namespace blink_team

// y = x . w^T (+ bias) for bf16 [M, K] x [N, K]; K a multiple of 32. Only where vdpbf16ps exists:
// blink_has_bf16_linear() says whether this build has it (the caller uses oneDNN otherwise).
extern "C" int blink_has_bf16_linear() { return BLINK_AVX512_BF16; }
extern "C" void blink_linear_bf16(const void* x, const void* w, const void* bias, void* y, int64_t M, int64_t N,
                                  int64_t K, int threads) {
#if BLINK_AVX512_BF16
    linear_bf16((const uint16_t*)x, (const uint16_t*)w, (const uint16_t*)bias, (uint16_t*)y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
#endif
}
// The same product with float32 outputs (y is float*), for any M: the logits head.
extern "C" void blink_linear_bf16_f32out(const void* x, const void* w, const void* bias, void* y, int64_t M,
                                         int64_t N, int64_t K, int threads) {
#if BLINK_AVX512_BF16
    linear_bf16((const uint16_t*)x, (const uint16_t*)w, (const uint16_t*)bias, (float*)y, M, N, K, threads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)threads;
#endif
}
