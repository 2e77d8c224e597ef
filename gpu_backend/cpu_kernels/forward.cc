// The decoder stack of a quantized Llama model for one step of decode rows, in one call and one
// OpenMP parallel region (blink_forward_decode; KernelForward calls it where it applies).
//
//   x [T, hidden] (the embedded tokens: the residual stream) -> first RMSNorm -> per layer:
//     codes(normed) -> qkv blocks -> RoPE + k/v into the pool -> decode attention
//     -> codes(attn) -> o blocks -> residual += o; RMSNorm
//     -> codes(normed) -> gate|up blocks -> SiLU * up + codes(act), one phase over column chunks
//     -> down blocks -> residual += down; the next layer's RMSNorm (the final norm after the last)
//   -> normed [T, hidden], as KernelForward's per-call loop returns it, bit for bit: the same
//      kernels (the team bodies of kernels.cc and quant.cc) in the same order on the same data.
//
// A step may also hand over its token ids and positions instead of x and cos/sin (executors/
// cpu_decode_step.py, the runner's decode-only steps): the embedding rows and the RoPE table's rows
// are then copied here, in the first phase; and ask for the logits (the tied Q8_0 head on float
// activations, blink_quant_matmul_fx, after the parallel region) and each row's greedy pick. What
// that saves is Python, not arithmetic: on a 2-core Zen 1 a 1-row step's torch calls around the
// stack (embedding, RoPE gathers, the head's row select and buffers, the sampler's argmax) took
// ~0.5 ms of an ~8.2 ms step, 5-10x their warm cost, run between two weight streams that leave the
// caches cold.
//
// Why one call: a 1-row decode step of SmolLM2 made ~14 ctypes calls a layer (30 layers) and opened
// a parallel region for each matmul and the attention: ~420 Python -> C crossings and ~150 fork/joins
// whose waits a loaded 2-core machine stretches, where every byte of work is ~3 MB a layer of weight
// streaming. Here the team is forked once; the phases are separated by the barriers of their `omp for`
// loops (a 1-row phase, the norms and activation codes, runs on one thread while the others wait at
// its barrier: ~1 us). That is how llama.cpp's graph runs, one thread pool and a barrier between ops.
//
// Applies to decode rows only (one query row per sequence; prefill chunks keep the per-call loop and
// its prefill attention kernel) with every projection on quant.cc's int8 matmul, at any batch size
// (executors/cpu_decode.py says why); the descriptors are built once per model by KernelForward.
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace blink_team {     // kernels.cc and quant.cc
void add_rms_norm(bool bf16, void* x, const void* delta, const void* w, void* out, int64_t rows, int64_t n,
                  float eps);
void rope_cache(bool bf16, bool kv_bf16, void* qkv, const void* cos, const void* sin, const int64_t* slots,
                void* kc, void* vc, int64_t tokens, int64_t heads_total, int64_t rope_heads, int64_t k_head,
                int64_t kv_heads, int64_t d, int64_t pool_slots);
void decode_attention(bool bf16, bool kv_bf16, const void* q, int64_t q_stride, const void* kc, const void* vc,
                      const int64_t* tables, int64_t max_blocks, const int64_t* context_lens, void* o,
                      int64_t batch, int64_t heads, int64_t kv_heads, int64_t d, int64_t num_blocks, int64_t bs,
                      float scale);
void silu_mul_cols(bool bf16, const void* gate_up, void* out, int64_t r, int64_t c0, int64_t c1, int64_t n);
void quantize_blocks(const void* x, int x_bf16, int64_t b0, int64_t b1, int8_t* qs, float* d, float* s);
void quantize_act(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* qs, float* d, float* s);
int quant_matmul(int wtype, const void* w, const int8_t* qs, const float* d, const float* s, const float* bias,
                 void* y, int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, int isa);
}  // namespace blink_team

extern "C" int blink_quant_matmul_fx(int wtype, const void* w, const float* x, int64_t ldx, const float* bias,
                                     void* y, int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, int isa,
                                     int threads);                // quant.cc

namespace {

constexpr int kMaxSegments = 4;

// One projection (layouts as in cpu_kernels/__init__.py: ctypes Structures of the same fields).
struct QMat {
    int64_t n, k;                       // output columns (all segments), values per row
    int64_t nseg;
    const float* bias;                  // float32 [n] or null
    int64_t wtype[kMaxSegments];        // each segment's type id (quant.cc: | SPLIT, | X8)
    int64_t col[kMaxSegments];          // its first output column
    int64_t rows[kMaxSegments];         // its output columns
    const void* w[kMaxSegments];        // its repacked blocks
};

struct Layer {
    QMat qkv, o, gate_up, down;
    void* kc;                           // this layer's pool [KV, blocks, bs, D]
    void* vc;
    const void* post_w;                 // post-attention norm weight
    const void* next_w;                 // the next layer's input norm (the final norm after the last)
    double post_eps, next_eps;
};

struct Model {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size;
    int64_t bf16, isa;
    int64_t kv_bf16;                    // the pool is bf16 (under float32 activations too)
    const void* first_w;                // the first layer's input norm
    double first_eps;
    double scale;                       // attention's 1 / sqrt(D)
    const Layer* layer;
    const void* embed;                  // [vocab, hidden] embedding table, the model's dtype (Step.ids)
    int64_t vocab;
    int64_t head_wtype, head_isa;       // the logits head (Step.logits): quant_matmul_fx's type and path
    const void* head_w;                 // its blocks [vocab rows], or null: no head here
};

struct Step {
    int64_t tokens;                     // T decode rows
    void* x;                            // [T, hidden] embedded tokens in; the residual stream after
    void* normed;                       // [T, hidden] out: the final norm's output
    void* cos;                          // [T, D] each (filled here from rope_cos / rope_sin when ids)
    void* sin;
    const int64_t* slots;               // [T] pool slot of each row's k/v
    const int64_t* tables;              // [T, width] block tables
    int64_t width;
    const int64_t* context_lens;        // [T]
    void* qkv;                          // scratch [T, (H + 2 KV) D]
    void* attn;                         // scratch [T, H D]
    void* proj;                         // scratch [T, hidden]: o and down outputs
    void* gate_up;                      // scratch [T, 2 I]
    void* act;                          // scratch [T, I]
    int8_t* qs;                         // scratch [T, max(hidden, H D, I)] activation codes
    float* d;                           // scratch [T, max / 32] each
    float* s;
    const int64_t* ids;                 // [T] token ids, or null: x, cos and sin come filled
    const int64_t* positions;           // [T] (with ids)
    const void* rope_cos;               // [cap, D] RoPE tables over positions 0..cap-1 (with ids)
    const void* rope_sin;
    float* logits;                      // [T, vocab] out, or null: normed is the step's output
    float* hx;                          // scratch [T, hidden] float32 (bf16 models' head input)
    int64_t* picks;                     // [T] out: each row's first largest logit, -1 for a row with a
                                        // NaN (as sampling.argmax_rows + nan_rows), or null
};

constexpr int64_t kQK = 32;             // values per activation-code block (quant.cc's QK)
constexpr int64_t kSiluCols = 256;       // columns of one SiLU x up + codes item (8 code blocks)

// y [T, n] = codes . W^T, segment by segment (shared codes, already in st.qs / d / s), in the
// model's dtype.
inline int matmul_coded(const Model& m, const Step& st, const QMat& w, void* y) {
    const int64_t t = st.tokens;
    const int bf16 = int(m.bf16);
    const int64_t esize = bf16 ? 2 : 4;
    int rc = 0;
    for (int64_t i = 0; i < w.nseg; ++i) {
        const float* bias = w.bias ? w.bias + w.col[i] : nullptr;
        rc |= blink_team::quant_matmul(int(w.wtype[i]), w.w[i], st.qs, st.d, st.s, bias,
                                       static_cast<char*>(y) + esize * w.col[i], bf16, w.n, t, w.rows[i], w.k,
                                       int(m.isa));
    }
    return rc;
}

// y = codes(x [T, k]) . W^T.
inline int matmul(const Model& m, const Step& st, const QMat& w, const void* x, void* y) {
    blink_team::quantize_act(x, int(m.bf16), st.tokens, w.k, st.qs, st.d, st.s);
    return matmul_coded(m, st, w, y);
}

// SiLU(gate) x up and the product's codes, kSiluCols columns an item: both element-wise (codes per
// 32 columns), so one row's work spreads over the team, in one phase where there were two.
inline void silu_codes(const Model& m, const Step& st) {
    const int64_t n = m.inter, chunks = (n + kSiluCols - 1) / kSiluCols, nb = n / kQK;
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < st.tokens * chunks; ++i) {
        const int64_t r = i / chunks, c0 = i % chunks * kSiluCols, c1 = c0 + kSiluCols < n ? c0 + kSiluCols : n;
        blink_team::silu_mul_cols(m.bf16 != 0, st.gate_up, st.act, r, c0, c1, n);
        blink_team::quantize_blocks(st.act, int(m.bf16), r * nb + c0 / kQK, r * nb + c1 / kQK, st.qs, st.d, st.s);
    }
}

// Rows r of the embedding and of the RoPE tables into x, cos and sin.
inline void gather_inputs(const Model& m, const Step& st) {
    const size_t es = m.bf16 ? 2 : 4;
    const size_t row = size_t(m.hidden) * es, rope_row = size_t(m.head_dim) * es;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < st.tokens; ++r) {
        std::memcpy(static_cast<char*>(st.x) + r * row, static_cast<const char*>(m.embed) + st.ids[r] * row, row);
        const int64_t p = st.positions[r];
        std::memcpy(static_cast<char*>(st.cos) + r * rope_row, static_cast<const char*>(st.rope_cos) + p * rope_row,
                    rope_row);
        std::memcpy(static_cast<char*>(st.sin) + r * rope_row, static_cast<const char*>(st.rope_sin) + p * rope_row,
                    rope_row);
    }
}

// The index of x's first largest value (numpy's argmax), or -1 where x holds a NaN.
int64_t argmax_or_nan(const float* x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    if (n >= 8) {
        __m256 mx = _mm256_loadu_ps(x), nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(x + i);
            mx = _mm256_max_ps(mx, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        if (_mm256_movemask_ps(nan)) return -1;
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        float best = lanes[0];
        for (int l = 1; l < 8; ++l) best = lanes[l] > best ? lanes[l] : best;
        for (; i < n; ++i) {                     // the tail
            if (x[i] != x[i]) return -1;
            best = x[i] > best ? x[i] : best;
        }
        for (int64_t j = 0; j < n; ++j)
            if (x[j] == best) return j;
        return 0;                                // not reached
    }
#endif
    int64_t arg = 0;
    for (; i < n; ++i) {
        if (x[i] != x[i]) return -1;
        if (x[i] > x[arg]) arg = i;
    }
    return arg;
}

// logits = the head's product with the final normed rows; picks = their argmax (Step.logits / picks).
int head_and_picks(const Model& m, const Step& st, int threads) {
    const int64_t t = st.tokens, k = m.hidden;
    const float* x = static_cast<const float*>(st.normed);
    if (m.bf16) {                                // widen (exact): the head reads float32 rows
        const uint16_t* src = static_cast<const uint16_t*>(st.normed);
        for (int64_t i = 0; i < t * k; ++i) {
            const uint32_t bits = uint32_t(src[i]) << 16;
            std::memcpy(st.hx + i, &bits, 4);
        }
        x = st.hx;
    }
    if (blink_quant_matmul_fx(int(m.head_wtype), m.head_w, x, k, nullptr, st.logits, 0, m.vocab, t, m.vocab, k,
                              int(m.head_isa), threads) != 0)
        return -1;
    if (st.picks) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (t > 1)
        for (int64_t r = 0; r < t; ++r) st.picks[r] = argmax_or_nan(st.logits + r * m.vocab, m.vocab);
    }
    return 0;
}

}  // namespace

// Runs the decoder stack of `model` over the step's decode rows with `threads` threads.
// With st.ids, the embedding and RoPE rows are gathered first; with st.logits (and m.head_w), the head
// and st.picks follow. Returns 0, or -1 where a segment's or the head's type is not one quant.cc reads
// (checked at setup, so never).
extern "C" int blink_forward_decode(const Model* model, const Step* step, int threads) {
    const Model& m = *model;
    const Step& st = *step;
    const bool bf16 = m.bf16 != 0, kv_bf16 = m.kv_bf16 != 0;
    const int64_t t = st.tokens, h = m.heads, kvh = m.kv_heads, d = m.head_dim;
    const int64_t heads_total = h + 2 * kvh;
    int rc = 0;
    #pragma omp parallel num_threads(threads) reduction(| : rc)
    {
        if (st.ids) gather_inputs(m, st);
        blink_team::add_rms_norm(bf16, st.x, nullptr, m.first_w, st.normed, t, m.hidden, float(m.first_eps));
        for (int64_t l = 0; l < m.layers; ++l) {
            const Layer& p = m.layer[l];
            rc |= matmul(m, st, p.qkv, st.normed, st.qkv);
            blink_team::rope_cache(bf16, kv_bf16, st.qkv, st.cos, st.sin, st.slots, p.kc, p.vc, t, heads_total,
                                   h + kvh, h, kvh, d, m.num_blocks * m.block_size);
            blink_team::decode_attention(bf16, kv_bf16, st.qkv, heads_total * d, p.kc, p.vc, st.tables,
                                         st.width, st.context_lens, st.attn, t, h, kvh, d, m.num_blocks,
                                         m.block_size, float(m.scale));
            rc |= matmul(m, st, p.o, st.attn, st.proj);
            blink_team::add_rms_norm(bf16, st.x, st.proj, p.post_w, st.normed, t, m.hidden, float(p.post_eps));
            rc |= matmul(m, st, p.gate_up, st.normed, st.gate_up);
            silu_codes(m, st);
            rc |= matmul_coded(m, st, p.down, st.proj);
            blink_team::add_rms_norm(bf16, st.x, st.proj, p.next_w, st.normed, t, m.hidden, float(p.next_eps));
        }
    }
    if (!rc && st.logits && m.head_w) rc = head_and_picks(m, st, threads);
    return rc ? -1 : 0;
}
