// Prefill attention over the paged KV pool, flash-attention style (float32 math; bf16 or f32 data).
//
//   q rows of the step (the fused qkv rows, RoPE applied) + the pool's K/V blocks through each
//   span's block table (this step's k/v already written there by rope_cache)
//   -> per (span, kv head, tile of QT query tokens): the tile's QT x G query rows (the G query
//      heads of one KV head share every K/V row) walk the keys KT (64) at a time, straight from
//      the blocks: S = Q . K^T (a small GEMM: rows x KT, in register tiles of KB keys), the
//      causal mask on the diagonal tiles only, an online softmax (running max m and sum l per row, earlier sums rescaled by
//      exp(m_old - m_new)), O += P . V; at the end O / l -> o [T, H, D]
//
// Each K/V row is read once per tile of QT * G query rows instead of once per query row (the
// decode kernel's row-at-a-time walk, which prefill used before: ~n^2 / 2 row reads of K and V
// per head, a horizontal sum per score), and no score row of the whole context is materialised:
// a tile's working set (Q, O, one KV tile, S) stays in L1/L2 whatever the context length.
//
// Paths, picked per call by `isa` (the caller clamps it to blink_attention_isa_max(), which
// BLINK_CPU_ISA narrows): 0 scalar (plain C++, W = 1), 1 avx2 (AVX2 + FMA, ymm), 2 avx512
// (AVX512F, zmm; compiled only where -march=native has it). One template over a small vector
// type, so the paths differ only in register width and float summation order.
//
// Threads: OpenMP over (span, kv head, query tile) items, the costliest (latest) tiles first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BLINK_A_AVX2 1
#else
#define BLINK_A_AVX2 0
#endif
#if BLINK_A_AVX2 && defined(__AVX512F__)
#define BLINK_A_AVX512 1
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"    // GCC 12 AVX-512 headers' `__Y = __Y`
#pragma GCC diagnostic ignored "-Wuninitialized"
#else
#define BLINK_A_AVX512 0
#endif
#if BLINK_A_AVX512 && defined(__AVX512BF16__)
#define BLINK_A_BF16 1
#else
#define BLINK_A_BF16 0
#endif

namespace {

constexpr int KB = 16;       // keys per score micro-tile (the registers' width)
constexpr int KT = 64;       // keys per softmax step: one running-max update and O rescale per 64 keys
constexpr int QT = 32;       // query tokens per tile (x the GQA group: the tile's rows, each K/V row's reuse)

struct F32In {
    using T = float;
    static inline float load(T v) { return v; }
    static inline T store(float f) { return f; }
};

struct BF16In {
    using T = uint16_t;
    static inline float load(T v) {
        const uint32_t u = uint32_t(v) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static inline T store(float f) {          // round to nearest even, NaN kept quiet (as kernels.cc)
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return T((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return T(u >> 16);
    }
};

// Cephes expf (kernels.cc's vexp): clamp, Cody-Waite reduction, degree-5 polynomial, 2^n.
constexpr float kExpLo = -87.33654f, kExpHi = 88.72283f, kLog2e = 1.44269504088896341f;
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

struct Scalar {              // the reference path: a "vector" of one float
    using R = float;
    static constexpr int W = 1, MR_S = 4;
    static inline R zero() { return 0.f; }
    static inline R set1(float x) { return x; }
    static inline R load(const float* p) { return *p; }
    static inline void store(float* p, R v) { *p = v; }
    static inline R fmadd(R a, R b, R c) { return a * b + c; }
    static inline R mul(R a, R b) { return a * b; }
    static inline R add(R a, R b) { return a + b; }
    static inline R max(R a, R b) { return a > b ? a : b; }
    static inline float hmax(R a) { return a; }
    static inline float hadd(R a) { return a; }
    static inline R exp(float x) {
        x = x < kExpLo ? kExpLo : (x > kExpHi ? kExpHi : x);
        const float n = std::floor(x * kLog2e + 0.5f);
        const float r = x - n * kC1 - n * kC2;
        float y = kP0;
        y = y * r + kP1;
        y = y * r + kP2;
        y = y * r + kP3;
        y = y * r + kP4;
        y = y * r + kP5;
        y = y * (r * r) + r + 1.0f;
        const int32_t bits = (int32_t(n) + 127) << 23;
        float scale;
        std::memcpy(&scale, &bits, 4);
        return y * scale;
    }
};

#if BLINK_A_AVX2
struct Avx2 {
    using R = __m256;
    static constexpr int W = 8, MR_S = 6;        // scores: 6 rows x 2 ymm of keys = 12 accumulators
    static inline R zero() { return _mm256_setzero_ps(); }
    static inline R set1(float x) { return _mm256_set1_ps(x); }
    static inline R load(const float* p) { return _mm256_loadu_ps(p); }
    static inline void store(float* p, R v) { _mm256_storeu_ps(p, v); }
    static inline R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
    static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
    static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
    static inline R max(R a, R b) { return _mm256_max_ps(a, b); }
    static inline float hmax(R v) {
        __m128 r = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        r = _mm_max_ps(r, _mm_movehl_ps(r, r));
        return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
    }
    static inline float hadd(R v) {
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
    }
    static inline R exp(R x) {
        x = _mm256_min_ps(_mm256_max_ps(x, set1(kExpLo)), set1(kExpHi));
        const R n = _mm256_floor_ps(_mm256_fmadd_ps(x, set1(kLog2e), set1(0.5f)));
        const R r = _mm256_fnmadd_ps(n, set1(kC2), _mm256_fnmadd_ps(n, set1(kC1), x));
        R y = set1(kP0);
        y = fmadd(y, r, set1(kP1));
        y = fmadd(y, r, set1(kP2));
        y = fmadd(y, r, set1(kP3));
        y = fmadd(y, r, set1(kP4));
        y = fmadd(y, r, set1(kP5));
        y = add(fmadd(y, mul(r, r), r), set1(1.0f));
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return mul(y, _mm256_castsi256_ps(bits));
    }
};
#endif

#if BLINK_A_AVX512
struct Avx512 {
    using R = __m512;
    static constexpr int W = 16, MR_S = 12;      // scores: 12 rows x 1 zmm of keys
    static inline R zero() { return _mm512_setzero_ps(); }
    static inline R set1(float x) { return _mm512_set1_ps(x); }
    static inline R load(const float* p) { return _mm512_loadu_ps(p); }
    static inline void store(float* p, R v) { _mm512_storeu_ps(p, v); }
    static inline R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
    static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
    static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
    static inline R max(R a, R b) { return _mm512_max_ps(a, b); }
    static inline float hmax(R v) { return _mm512_reduce_max_ps(v); }
    static inline float hadd(R v) { return _mm512_reduce_add_ps(v); }
    static inline R exp(R x) {
        x = _mm512_min_ps(_mm512_max_ps(x, set1(kExpLo)), set1(kExpHi));
        const R n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, set1(kLog2e), set1(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const R r = _mm512_fnmadd_ps(n, set1(kC2), _mm512_fnmadd_ps(n, set1(kC1), x));
        R y = set1(kP0);
        y = fmadd(y, r, set1(kP1));
        y = fmadd(y, r, set1(kP2));
        y = fmadd(y, r, set1(kP3));
        y = fmadd(y, r, set1(kP4));
        y = fmadd(y, r, set1(kP5));
        y = add(fmadd(y, mul(r, r), r), set1(1.0f));
        const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
        return mul(y, _mm512_castsi512_ps(bits));
    }
};
#endif

// s[r, 0..KB) = q[r, :] . kt[:, 0..KB) for MR rows (kt and s rows KT apart): MR x KB/W accumulators
// in registers, each key vector loaded once per d for all MR rows, each q value broadcast once.
template <class V, int MR>
inline void scores_rows(const float* q, int64_t d, const float* kt, float* s) {
    constexpr int NV = KB / V::W;
    typename V::R acc[MR][NV];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NV; ++c) acc[m][c] = V::zero();
    for (int64_t i = 0; i < d; ++i) {
        typename V::R k[NV];
        for (int c = 0; c < NV; ++c) k[c] = V::load(kt + i * KT + c * V::W);
        for (int m = 0; m < MR; ++m) {
            const typename V::R qb = V::set1(q[m * d + i]);
            for (int c = 0; c < NV; ++c) acc[m][c] = V::fmadd(qb, k[c], acc[m][c]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NV; ++c) V::store(s + m * KT + c * V::W, acc[m][c]);
}

// s[r, 0..nk) (rounded up to KB) for every row of the tile
template <class V>
void scores(const float* q, int64_t rows, int64_t d, const float* kt, int64_t nk, float* s) {
    for (int64_t j0 = 0; j0 < nk; j0 += KB) {
        int64_t r = 0;
        for (; r + V::MR_S <= rows; r += V::MR_S) scores_rows<V, V::MR_S>(q + r * d, d, kt + j0, s + r * KT + j0);
        for (; r < rows; ++r) scores_rows<V, 1>(q + r * d, d, kt + j0, s + r * KT + j0);
    }
}

// o[r, i0 .. i0 + NC * W) += p[r, 0..nk) . v[0..nk, same columns] for MR rows: MR x NC accumulators,
// each V vector loaded once per key for all MR rows.
template <class V, int MR, int NC>
inline void pv_cols(const float* p, const float* v, int64_t nk, int64_t d, int64_t i0, float* o) {
    typename V::R acc[MR][NC];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) acc[m][c] = V::load(o + m * d + i0 + c * V::W);
    for (int64_t j = 0; j < nk; ++j) {
        typename V::R vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = V::load(v + j * d + i0 + c * V::W);
        for (int m = 0; m < MR; ++m) {
            const typename V::R pb = V::set1(p[m * KT + j]);
            for (int c = 0; c < NC; ++c) acc[m][c] = V::fmadd(pb, vv[c], acc[m][c]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) V::store(o + m * d + i0 + c * V::W, acc[m][c]);
}

template <class V, int MR>
inline void pv_rows(const float* p, const float* v, int64_t nk, int64_t d, float* o) {
    int64_t i0 = 0;
    for (; i0 + 4 * V::W <= d; i0 += 4 * V::W) pv_cols<V, MR, 4>(p, v, nk, d, i0, o);
    for (; i0 < d; i0 += V::W) pv_cols<V, MR, 1>(p, v, nk, d, i0, o);      // d % W == 0 (the dispatch's)
}

template <class V>
void pv(const float* p, const float* v, int64_t rows, int64_t nk, int64_t d, float* o) {
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) pv_rows<V, 3>(p + r * KT, v, nk, d, o + r * d);
    for (; r < rows; ++r) pv_rows<V, 1>(p + r * KT, v, nk, d, o + r * d);
}

// One row's online-softmax step over a score tile s[0..KT) (masked keys already -inf): the new
// running max, p = exp(s - max) in place, the running sum, and o rescaled by exp(m_old - m_new).
template <class V>
inline void softmax_step(float* s, float* m, float* l, float* o, int64_t d) {
    constexpr int NV = KT / V::W;
    typename V::R sv[NV];
    typename V::R mx = V::load(s);
    sv[0] = mx;
    for (int c = 1; c < NV; ++c) {
        sv[c] = V::load(s + c * V::W);
        mx = V::max(mx, sv[c]);
    }
    const float m_new = std::max(*m, V::hmax(mx));
    if (m_new == -INFINITY) return;              // nothing visible yet (cannot happen at key 0)
    const typename V::R mb = V::set1(-m_new);
    typename V::R sum = V::zero();
    for (int c = 0; c < NV; ++c) {
        const typename V::R e = V::exp(V::add(sv[c], mb));
        V::store(s + c * V::W, e);
        sum = V::add(sum, e);
    }
    if (m_new > *m) {
        const float alpha = *m == -INFINITY ? 0.f : Scalar::exp(*m - m_new);
        const typename V::R ab = V::set1(alpha);
        for (int64_t i = 0; i < d; i += V::W) V::store(o + i, V::mul(V::load(o + i), ab));
        *l *= alpha;
        *m = m_new;
    }
    *l += V::hadd(sum);
}

struct Item {                // one unit of work: a tile of one span's queries for one kv head
    int64_t span, kv_head, t0;
    int64_t row0;                // the span's first row in q and out
    int64_t tokens;              // the tile's query tokens (QT, or the span's rest)
    int64_t first_pos;           // the position of its first query token
    int64_t kmax;                // keys 0 .. kmax - 1 are read (first_pos + tokens): its cost
};

// Every (span, query tile, kv head) of the call, the costliest (latest: most keys) first.
std::vector<Item> work_items(const int64_t* spans, int64_t num_spans, int64_t kv_heads) {
    std::vector<Item> items;
    for (int64_t s = 0; s < num_spans; ++s) {
        const int64_t row0 = spans[3 * s], n = spans[3 * s + 1], ctx = spans[3 * s + 2];
        for (int64_t t0 = 0; t0 < n; t0 += QT) {
            const int64_t tokens = std::min<int64_t>(QT, n - t0), first_pos = ctx - n + t0;
            for (int64_t g = 0; g < kv_heads; ++g)
                items.push_back({s, g, t0, row0, tokens, first_pos, first_pos + tokens});
        }
    }
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.kmax > b.kmax; });
    return items;
}

// One row's scores of the key tile at k0 (nk keys) -> p in place: keys past the row's position
// (diagonal tiles) and the padding masked, the online-softmax step, the masked entries zeroed.
template <class V>
inline void masked_softmax(float* sr, bool diagonal, int64_t pos, int64_t k0, int64_t nk, float* m, float* l,
                           float* o, int64_t d) {
    const int64_t visible = std::max<int64_t>(0, diagonal ? std::min(nk, pos - k0 + 1) : nk);
    for (int64_t j = visible; j < KT; ++j) sr[j] = -INFINITY;   // later keys, padding
    softmax_step<V>(sr, m, l, o, d);
    for (int64_t j = visible; j < KT; ++j) sr[j] = 0.f;         // exp's clamp leaves ~1e-38
}

// A tile's rows O / l into out [T, H, D] (tokens t0 .. of the span from row0; G query heads a kv head).
template <class P>
inline void store_rows(const float* of, const float* lrow, typename P::T* out, int64_t row0, int64_t t0,
                       int64_t tokens, int64_t heads, int64_t kv_head, int64_t group, int64_t d) {
    for (int64_t t = 0; t < tokens; ++t) {
        typename P::T* ot = out + ((row0 + t0 + t) * heads + kv_head * group) * d;
        for (int64_t j = 0; j < group; ++j) {
            const int64_t r = t * group + j;
            const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
            for (int64_t i = 0; i < d; ++i) ot[j * d + i] = P::store(of[r * d + i] * inv);
        }
    }
}

// P: the activations' type (q, out); KV: the pool's (bf16 under float32 activations halves the bytes).
template <class P, class KV, class V>
void prefill_attention_impl(const typename P::T* q, int64_t q_stride, const typename KV::T* kc,
                            const typename KV::T* vc, const int64_t* tables, int64_t max_blocks,
                            const int64_t* spans, int64_t num_spans, typename P::T* out, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t bs, float scale, int threads) {
    const int64_t group = heads / kv_heads, pool_slots = num_blocks * bs;
    const std::vector<Item> items = work_items(spans, num_spans, kv_heads);
    const int64_t max_rows = QT * group;
    #pragma omp parallel num_threads(threads) if (threads > 1 && items.size() > 1)
    {
        std::vector<float> qf(max_rows * d), of(max_rows * d), kt(d * KT), vf(KT * d), sc(max_rows * KT);
        std::vector<float> mrow(max_rows), lrow(max_rows);
        std::vector<int64_t> pos(max_rows);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < int64_t(items.size()); ++it) {
            const Item& w = items[it];
            const int64_t row0 = w.row0, tokens = w.tokens, rows = tokens * group;
            const int64_t first_pos = w.first_pos, kmax = w.kmax;
            const int64_t* table = tables + w.span * max_blocks;
            for (int64_t t = 0; t < tokens; ++t) {
                const typename P::T* qt = q + (row0 + w.t0 + t) * q_stride + w.kv_head * group * d;
                for (int64_t j = 0; j < group; ++j) {
                    const int64_t r = t * group + j;
                    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = P::load(qt[j * d + i]) * scale;
                    pos[r] = first_pos + t;
                }
            }
            std::fill(of.begin(), of.begin() + rows * d, 0.f);
            std::fill(mrow.begin(), mrow.begin() + rows, -INFINITY);
            std::fill(lrow.begin(), lrow.begin() + rows, 0.f);
            const typename KV::T* kbase = kc + w.kv_head * pool_slots * d;
            const typename KV::T* vbase = vc + w.kv_head * pool_slots * d;
            for (int64_t k0 = 0; k0 < kmax; k0 += KT) {
                const int64_t nk = std::min<int64_t>(KT, kmax - k0);
                for (int64_t j = 0; j < nk; ++j) {          // K tile transposed: kt[i, j], zero-padded
                    const int64_t kp = k0 + j;
                    const typename KV::T* kr = kbase + (table[kp / bs] * bs + kp % bs) * d;
                    for (int64_t i = 0; i < d; ++i) kt[i * KT + j] = KV::load(kr[i]);
                }
                for (int64_t j = nk; j < (nk + KB - 1) / KB * KB; ++j)
                    for (int64_t i = 0; i < d; ++i) kt[i * KT + j] = 0.f;
                scores<V>(qf.data(), rows, d, kt.data(), nk, sc.data());
                const bool diagonal = k0 + nk - 1 > first_pos;             // some row sees only part
                for (int64_t r = 0; r < rows; ++r)
                    masked_softmax<V>(sc.data() + r * KT, diagonal, pos[r], k0, nk, &mrow[r], &lrow[r],
                                      of.data() + r * d, d);
                // O += P . V over the tile's keys, one run of consecutive slots (a block) at a time
                for (int64_t j0 = 0; j0 < nk;) {
                    const int64_t kp = k0 + j0, run = std::min(nk - j0, bs - kp % bs);
                    const typename KV::T* vb = vbase + (table[kp / bs] * bs + kp % bs) * d;
                    const float* vrows;
                    if constexpr (sizeof(typename KV::T) == sizeof(float)) {
                        vrows = reinterpret_cast<const float*>(vb);             // f32: read in place
                    } else {
                        for (int64_t i = 0; i < run * d; ++i) vf[i] = KV::load(vb[i]);
                        vrows = vf.data();
                    }
                    pv<V>(sc.data() + j0, vrows, rows, run, d, of.data());
                    j0 += run;
                }
            }
            store_rows<P>(of.data(), lrow.data(), out, row0, w.t0, tokens, heads, w.kv_head, group, d);
        }
    }
}

#if BLINK_A_BF16
// The avx512bf16 path (bf16 data, d % 32 == 0): the two GEMMs of a tile on vdpbf16ps, which multiplies
// pairs of bf16 values exactly and adds them into float32 lanes: twice the multiply-adds of an
// fp32 FMA per instruction, and no conversion of K/V to float.
//
//   pack (once a call, per span x kv head x key tile of KT keys, in parallel): K as bf16 pairs
//   transposed, kp[i'][j] = (k[j][2i'], k[j][2i'+1]) (a score vector: 16 keys of one pair of dims),
//   V as pairs of keys, vp[j'][i] = (v[2j'][i], v[2j'+1][i]) (an output vector: 16 dims of one pair
//   of keys); keys past the context are zero
//   -> per item, as the float path: S = Q . K^T (q's bf16 pairs broadcast, float32 sums, times the
//   scale), the same online softmax in float32, P rounded to bf16 pairs, O += P . V in float32
//
// Against the float path: the scores are the same products in another summation order (q is not
// pre-scaled, so not rounded there); P is rounded to bf16 (2^-9 relative), as GPU flash attention
// rounds it; the running sums l add the unrounded p. K/V are read once a call in packed form, not
// converted to float once per query tile.
constexpr int KP = KT / 2;       // key pairs a tile

inline uint32_t word(const uint16_t* p, int64_t i) {
    uint32_t w;
    std::memcpy(&w, p + 2 * i, 4);
    return w;
}

// s[r, j0 .. j0 + 16 NV) = scale * q[r] . k[j] for MR rows: MR x NV accumulators, each K vector loaded
// once per pair of dims for all MR rows.
template <int MR, int NV>
inline void scores_bf16(const uint32_t* qp, int64_t dp, const uint32_t* kp, float scale, float* s) {
    __m512 acc[MR][NV];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NV; ++c) acc[m][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dp; ++i) {
        __m512i k[NV];
        for (int c = 0; c < NV; ++c) k[c] = _mm512_loadu_si512(kp + i * KT + 16 * c);
        for (int m = 0; m < MR; ++m) {
            const __m512i qb = _mm512_set1_epi32(int(qp[m * dp + i]));
            for (int c = 0; c < NV; ++c)
                acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)qb, (__m512bh)k[c]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(s + m * KT + 16 * c, _mm512_mul_ps(acc[m][c], sc));
}

// o[r, i0 .. i0 + 16 NC) += p[r] . v over the tile's key pairs 0 .. np for MR rows.
template <int MR, int NC>
inline void pv_bf16(const uint32_t* pp, const uint32_t* vp, int64_t np, int64_t d, int64_t i0, float* o) {
    __m512 acc[MR][NC];
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_loadu_ps(o + m * d + i0 + 16 * c);
    for (int64_t j = 0; j < np; ++j) {
        __m512i v[NC];
        for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_si512(vp + j * d + i0 + 16 * c);
        for (int m = 0; m < MR; ++m) {
            const __m512i pb = _mm512_set1_epi32(int(pp[m * KP + j]));
            for (int c = 0; c < NC; ++c)
                acc[m][c] = _mm512_dpbf16_ps(acc[m][c], (__m512bh)pb, (__m512bh)v[c]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + m * d + i0 + 16 * c, acc[m][c]);
}

template <int MR>
inline void pv_bf16_rows(const uint32_t* pp, const uint32_t* vp, int64_t np, int64_t d, float* o) {
    int64_t i0 = 0;
    for (; i0 + 64 <= d; i0 += 64) pv_bf16<MR, 4>(pp, vp, np, d, i0, o);
    for (; i0 < d; i0 += 32) pv_bf16<MR, 2>(pp, vp, np, d, i0, o);          // d % 32 == 0 (the dispatch's)
}

void prefill_attention_bf16dot(const uint16_t* q, int64_t q_stride, const uint16_t* kc, const uint16_t* vc,
                               const int64_t* tables, int64_t max_blocks, const int64_t* spans, int64_t num_spans,
                               uint16_t* out, int64_t heads, int64_t kv_heads, int64_t d, int64_t num_blocks,
                               int64_t bs, float scale, int threads) {
    const int64_t group = heads / kv_heads, pool_slots = num_blocks * bs, dp = d / 2;
    const int64_t tile_words = dp * KT;                      // a packed K tile; a packed V tile is as large
    // packed tiles: (span, kv head) -> first tile; a tile's K then its V
    std::vector<int64_t> first_tile(num_spans * kv_heads + 1, 0);
    for (int64_t s = 0; s < num_spans; ++s)
        for (int64_t g = 0; g < kv_heads; ++g)
            first_tile[s * kv_heads + g + 1] = first_tile[s * kv_heads + g] + (spans[3 * s + 2] + KT - 1) / KT;
    const int64_t total_tiles = first_tile.back();
    static thread_local std::vector<uint32_t> packed;
    if (int64_t(packed.size()) < 2 * total_tiles * tile_words) packed.resize(2 * total_tiles * tile_words);
    uint32_t* const pk = packed.data();
    const std::vector<Item> items = work_items(spans, num_spans, kv_heads);
    const int64_t max_rows = QT * group;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < total_tiles; ++tile) {
            const int64_t sg = std::upper_bound(first_tile.begin(), first_tile.end(), tile) - first_tile.begin() - 1;
            const int64_t s = sg / kv_heads, g = sg % kv_heads, k0 = (tile - first_tile[sg]) * KT;
            const int64_t nk = std::min<int64_t>(KT, spans[3 * s + 2] - k0);
            const int64_t* table = tables + s * max_blocks;
            uint32_t* kt = pk + 2 * tile * tile_words;
            uint32_t* vt = kt + tile_words;
            const uint16_t* kbase = kc + g * pool_slots * d;
            const uint16_t* vbase = vc + g * pool_slots * d;
            for (int64_t j = 0; j < KT; ++j) {
                const int64_t kp = k0 + j;
                if (j < nk) {
                    const uint16_t* kr = kbase + (table[kp / bs] * bs + kp % bs) * d;
                    for (int64_t i = 0; i < dp; ++i) kt[i * KT + j] = word(kr, i);
                } else {
                    for (int64_t i = 0; i < dp; ++i) kt[i * KT + j] = 0;
                }
            }
            for (int64_t j = 0; j < KP; ++j) {
                const int64_t ka = k0 + 2 * j, kb = ka + 1;
                const uint16_t* va = 2 * j < nk ? vbase + (table[ka / bs] * bs + ka % bs) * d : nullptr;
                const uint16_t* vb = 2 * j + 1 < nk ? vbase + (table[kb / bs] * bs + kb % bs) * d : nullptr;
                for (int64_t i = 0; i < d; ++i)
                    vt[j * d + i] = uint32_t(va ? va[i] : 0) | uint32_t(vb ? vb[i] : 0) << 16;
            }
        }
        std::vector<uint32_t> qp(max_rows * dp), pp(max_rows * KP);
        std::vector<float> of(max_rows * d), sc(max_rows * KT), mrow(max_rows), lrow(max_rows);
        std::vector<int64_t> pos(max_rows);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < int64_t(items.size()); ++it) {
            const Item& w = items[it];
            const int64_t row0 = w.row0, tokens = w.tokens, rows = tokens * group;
            const int64_t first_pos = w.first_pos, kmax = w.kmax;
            for (int64_t t = 0; t < tokens; ++t) {
                const uint16_t* qt = q + (row0 + w.t0 + t) * q_stride + w.kv_head * group * d;
                for (int64_t j = 0; j < group; ++j) {
                    const int64_t r = t * group + j;
                    for (int64_t i = 0; i < dp; ++i) qp[r * dp + i] = word(qt + j * d, i);
                    pos[r] = first_pos + t;
                }
            }
            std::fill(of.begin(), of.begin() + rows * d, 0.f);
            std::fill(mrow.begin(), mrow.begin() + rows, -INFINITY);
            std::fill(lrow.begin(), lrow.begin() + rows, 0.f);
            const uint32_t* tiles = pk + 2 * first_tile[w.span * kv_heads + w.kv_head] * tile_words;
            for (int64_t k0 = 0; k0 < kmax; k0 += KT) {
                const int64_t nk = std::min<int64_t>(KT, kmax - k0);
                const uint32_t* kt = tiles + 2 * (k0 / KT) * tile_words;
                const uint32_t* vt = kt + tile_words;
                for (int64_t j0 = 0; j0 < nk; j0 += 32) {                 // scores, 32 keys (or 16) at a time
                    const bool two = j0 + 16 < nk;
                    int64_t r = 0;
                    for (; r + 12 <= rows; r += 12)
                        two ? scores_bf16<12, 2>(qp.data() + r * dp, dp, kt + j0, scale, sc.data() + r * KT + j0)
                            : scores_bf16<12, 1>(qp.data() + r * dp, dp, kt + j0, scale, sc.data() + r * KT + j0);
                    for (; r < rows; ++r)
                        two ? scores_bf16<1, 2>(qp.data() + r * dp, dp, kt + j0, scale, sc.data() + r * KT + j0)
                            : scores_bf16<1, 1>(qp.data() + r * dp, dp, kt + j0, scale, sc.data() + r * KT + j0);
                }
                const bool diagonal = k0 + nk - 1 > first_pos;
                for (int64_t r = 0; r < rows; ++r) {
                    float* sr = sc.data() + r * KT;
                    masked_softmax<Avx512>(sr, diagonal, pos[r], k0, nk, &mrow[r], &lrow[r], of.data() + r * d, d);
                    for (int64_t j = 0; j < KT; j += 32)                   // p as bf16 pairs (RNE)
                        _mm512_storeu_si512(pp.data() + r * KP + j / 2, (__m512i)_mm512_cvtne2ps_pbh(
                                                _mm512_loadu_ps(sr + j + 16), _mm512_loadu_ps(sr + j)));
                }
                const int64_t np = (nk + 1) / 2;
                int64_t r = 0;
                for (; r + 6 <= rows; r += 6) pv_bf16_rows<6>(pp.data() + r * KP, vt, np, d, of.data() + r * d);
                for (; r < rows; ++r) pv_bf16_rows<1>(pp.data() + r * KP, vt, np, d, of.data() + r * d);
            }
            store_rows<BF16In>(of.data(), lrow.data(), out, row0, w.t0, tokens, heads, w.kv_head, group, d);
        }
    }
}
#endif

template <class P, class KV>
void prefill_attention(int isa, const void* q, int64_t q_stride, const void* kc, const void* vc,
                       const int64_t* tables, int64_t max_blocks, const int64_t* spans, int64_t num_spans, void* o,
                       int64_t heads, int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t bs, float scale,
                       int threads) {
    using T = typename P::T;
    using KT_ = typename KV::T;
    auto run = [&](auto impl) {
        impl(static_cast<const T*>(q), q_stride, static_cast<const KT_*>(kc), static_cast<const KT_*>(vc), tables,
             max_blocks, spans, num_spans, static_cast<T*>(o), heads, kv_heads, d, num_blocks, bs, scale, threads);
    };
#if BLINK_A_BF16
    if constexpr (sizeof(T) == 2 && sizeof(KT_) == 2) {
        if (isa >= 3 && d % 32 == 0) return run(prefill_attention_bf16dot);
    }
#endif
#if BLINK_A_AVX512
    if (isa >= 2 && d % 16 == 0) return run(prefill_attention_impl<P, KV, Avx512>);
#endif
#if BLINK_A_AVX2
    if (isa >= 1 && d % 8 == 0) return run(prefill_attention_impl<P, KV, Avx2>);
#endif
    (void)isa;
    run(prefill_attention_impl<P, KV, Scalar>);
}

}  // namespace

// C ABI for ctypes (gpu_backend/cpu_kernels/__init__.py checks shapes and types).
// The widest path this build has: 3 avx512bf16 (bf16 data; f32 data takes avx512), 2 avx512, 1 avx2,
// 0 scalar only.
extern "C" int blink_attention_isa_max() {
    return BLINK_A_BF16 ? 3 : (BLINK_A_AVX512 ? 2 : (BLINK_A_AVX2 ? 1 : 0));
}

// Causal attention of prefill spans over the pool: span s (spans[3s .. 3s+2] = first row in q,
// tokens n, context length c after this step) has query rows first .. first + n - 1 at positions
// c - n .. c - 1 and reads keys 0 .. position through block table tables[s] (max_blocks wide).
// q rows are q_stride elements apart (the fused qkv rows), heads query heads of d first;
// kc / vc one pool layer [kv_heads, num_blocks, bs, d]; o [T, heads, d] (rows of the spans
// written). Any d: the avx2 path takes d % 8 == 0, avx512 d % 16 == 0, the scalar path the rest.
// Suffixes: f32 / bf16 (activations and pool alike), f32kv16 (float32 activations over a bf16 pool).
#define BLINK_PREFILL_EXPORT(SUF, P, KV)                                                                      \
    extern "C" void blink_prefill_attention_##SUF(const void* q, int64_t q_stride, const void* kc,            \
                                                  const void* vc, const int64_t* tables, int64_t max_blocks,  \
                                                  const int64_t* spans, int64_t num_spans, void* o,           \
                                                  int64_t heads, int64_t kv_heads, int64_t d,                 \
                                                  int64_t num_blocks, int64_t bs, float scale, int isa,       \
                                                  int threads) {                                              \
        prefill_attention<P, KV>(isa, q, q_stride, kc, vc, tables, max_blocks, spans, num_spans, o, heads,    \
                             kv_heads, d, num_blocks, bs, scale, threads);                                    \
    }
BLINK_PREFILL_EXPORT(f32, F32In, F32In)
BLINK_PREFILL_EXPORT(bf16, BF16In, BF16In)
BLINK_PREFILL_EXPORT(f32kv16, F32In, BF16In)
