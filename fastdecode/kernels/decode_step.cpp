// One decode step or one verify step (T new tokens, batch 1, float32 activations) through every layer, in C++.
//
// At one token the matmuls are small and PyTorch's per-op dispatch (~40 ops and 10 module calls per layer from
// Python) costs more than the arithmetic around them. Here a layer is: RMSNorm, one packed qkv matmul, q/k norm,
// rotary, a cache write, attention over the cache, o matmul, residual, RMSNorm, one packed gate/up matmul, the
// activation, down matmul, residual; the elementwise work is plain loops, the matmuls call the quantized kernels
// (quant.cpp) or ATen's float linear. Weight layout per layer is fixed by fastdecode/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include "simd.h"

#include <cmath>
#include <limits>
#include <vector>

namespace fastdecode {
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
}  // namespace fastdecode

namespace {

// Tensors of one layer, in this order (an empty tensor stands for "absent").
enum Slot {
  IN_NORM, POST_ATTN_NORM, PRE_FF_NORM, POST_FF_NORM, Q_NORM, K_NORM,
  QKV_W, QKV_B, O_W, O_B, GU_W, GU_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, SLOTS
};

inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// A float weight (N, K), or a packed quantized one, told apart by its tile size: 8-bit (N/4, K/32, 144 or 136) or int4
// (N/4, K/64, 160) (quant.cpp), a GGUF K-quant (N/4, K/256, 592 | 720 | 840) (kquant.cpp).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  c10::optional<at::Tensor> bias = present(b) ? c10::optional<at::Tensor>(b) : c10::nullopt;
  if (w.scalar_type() != at::kByte) return at::linear(x, w, bias);
  switch (w.size(2)) {
    case 136: case 144: return fastdecode::q8_linear(x, w, bias);
    case 160: return fastdecode::q4_linear(x, w, bias);
    default: return fastdecode::kq_linear(x, w, bias);
  }
}

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// Half-split rotary on one head: cos and sin hold head_dim values (each half repeated).
void rotary(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

using fastdecode::hsum;

// e^x for x in [-87, 88] (where 2^n stays a normal float), as in Cephes' expf: 2^n * p(r) with r = x - n ln 2,
// |error| about 1 ulp. std::exp per element cost more than the arithmetic around it (attention scores, the MLP's
// activation).
inline __m256 exp_in_range(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// e^x for x <= 0 (scores minus their maximum): e^-87 is 0 next to the maximum's 1.
inline __m256 exp_nonpositive(__m256 x) { return exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

inline __m256 exp_any(__m256 x) {
  return exp_in_range(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}

// The KV cache holds float32 or float16 (its bits as uint16_t, converted with F16C): one attention kernel reads either.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(float x) { return x; }
inline float load1(uint16_t x) { return _cvtsh_ss(x); }

// n floats -> the cache's type (float16: rounded to nearest even).
inline void store_kv(const float* x, int64_t n, float* out) { std::copy(x, x + n, out); }
inline void store_kv(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// Attention in tiles of keys: a work item is a few queries of one KV group (the heads of a group and the tokens of a
// verify step read the same keys), and each tile of KEY_TILE keys and values is read by all of them while it sits in
// L1, instead of once per query from L2. Every key's score is one FMA chain over hd and the same horizontal sum, and
// every output element one FMA chain over the keys in order, whatever the tiling, the number of tokens in the call
// or the queries that share an item, so a token's result is the same in a decode step and in a verify step.
constexpr int64_t KEY_TILE = 32;  // 32 keys of 64 floats: 8 KB of keys and 8 KB of values

// p[r][i] = (q[r] . key i) * scale for NQ queries and n keys, key i at k + slot(i) * hd (hd % 8 == 0). Two queries
// over four keys are eight independent FMA chains, enough to keep both FMA units busy through their latency; one
// query takes four keys at a time (eight streams of keys were slower where the keys come from memory).
template <int NQ, typename KV, typename Slot>
void scores(const float* const* q, const KV* k, Slot slot, int64_t n, int64_t hd, float scale, float* const* p) {
  constexpr int NK = 4;
  int64_t i = 0;
  for (; i + NK <= n; i += NK) {
    const KV* key[NK];
    for (int b = 0; b < NK; ++b) key[b] = k + slot(i + b) * hd;
    __m256 a[NQ][NK];
    for (int r = 0; r < NQ; ++r)
      for (int b = 0; b < NK; ++b) a[r][b] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 qd[NQ];
      for (int r = 0; r < NQ; ++r) qd[r] = _mm256_loadu_ps(q[r] + d);
      for (int b = 0; b < NK; ++b) {
        const __m256 kd = load8(key[b] + d);
        for (int r = 0; r < NQ; ++r) a[r][b] = _mm256_fmadd_ps(qd[r], kd, a[r][b]);
      }
    }
    for (int r = 0; r < NQ; ++r)
      for (int b = 0; b < NK; ++b) p[r][i + b] = hsum(a[r][b]) * scale;
  }
  for (; i < n; ++i) {
    const KV* ki = k + slot(i) * hd;
    for (int r = 0; r < NQ; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), load8(ki + d), a);
      p[r][i] = hsum(a) * scale;
    }
  }
}

// p[0..n) <- e^(p - max p), in place (p has room for a whole last vector; lanes past n become 0) -> 1 / their sum.
float softmax_weights(float* p, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    const __m256 e = _mm256_and_ps(live, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx)));
    _mm256_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return 1.f / hsum(vsum);
}

// out (hd) += sum over i of p[i] * value i (at v + slot(i) * hd), each element's chain continuing in i order.
template <int NV, typename KV, typename Slot>  // NV 8-float vectors of out in registers at a time (hd % (8 NV) == 0)
void accumulate(const float* p, const KV* v, Slot slot, int64_t n, int64_t hd, float* out) {
  for (int64_t d0 = 0; d0 < hd; d0 += 8 * NV) {
    __m256 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_loadu_ps(out + d0 + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i]);
      const KV* vi = v + slot(i) * hd + d0;
      for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pi, load8(vi + 8 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
  }
}

// Which keys a query sees, in position order: the logical cache positions [first, last) of its sequence, read through
// the sequence's block table, then (in a token tree being verified) the new tokens of its tree that are its ancestors,
// at their own slots (`tail`). A chain's new tokens are already written at logical positions ctx, ctx + 1, ..., so a
// chain's query reads them through the table like the cache before it: [first, its own position + 1). A tree query
// sees [first, ctx) and its ancestors: the same keys in the same order that a decode step at its position would see
// once the accepted path sits at ctx, ctx + 1, ...
struct Visible {
  int64_t first, last;
  std::vector<int64_t> tail;
};

// One sequence's rows [r0, r1) of the batch, with ctx tokens already in the cache and its block table.
struct SeqRows {
  int64_t r0, r1, ctx;
  const int64_t* table;
};

Visible visible_keys(int64_t t, const SeqRows& s, const int64_t* positions, const int64_t* slots, const bool* mask,
                     int64_t R, int64_t window) {
  const int64_t pos = positions[t];
  if (!mask) {
    const int64_t last = s.ctx + (t - s.r0) + 1;
    return {window ? std::max<int64_t>(0, pos - window + 1) : 0, last, {}};
  }
  Visible out{window ? std::min(s.ctx, std::max<int64_t>(0, pos - window + 1)) : 0, s.ctx, {}};
  for (int64_t j = s.r0; j < s.r1; ++j)
    if (mask[t * R + j] && (!window || pos - positions[j] < window)) out.tail.push_back(slots[j]);
  return out;
}

// Logical position a of a sequence -> its physical cache slot.
inline int64_t physical(const SeqRows& s, int64_t block_size, int64_t a) {
  return s.table[a / block_size] * block_size + a % block_size;
}

// Queries q[i] (hd) of one sequence that share one KV group's cache k, v (slots, hd) -> out[i] (hd). Keys are walked
// in tiles that never cross a block, so each tile is contiguous in memory.
template <int NV, typename KV>
void attend_tiled(const std::vector<const float*>& q, const std::vector<float*>& out, const std::vector<Visible>& seen,
                  const KV* k, const KV* v, const SeqRows& sr, int64_t block_size, int64_t hd, float scale) {
  const int64_t n = q.size(), tile = std::min(KEY_TILE, block_size);
  std::vector<int64_t> offset(n + 1, 0);  // query i's weights p[offset[i]..]: its cache keys, then its tail
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    offset[i + 1] = offset[i] + (seen[i].last - seen[i].first) + seen[i].tail.size() + 8;
    lo = std::min(lo, seen[i].first);
    hi = std::max(hi, seen[i].last);
  }
  lo -= lo % tile;
  std::vector<float> p(offset[n]);
  const auto keys = [](int64_t a) { return [a](int64_t j) { return a + j; }; };  // the slots a, a + 1, ...
  // The part of tile [s, s + tile) that query i sees: [a, e), inside one block.
  const auto span = [&](int64_t i, int64_t s, int64_t& a, int64_t& e) {
    a = std::max(s, seen[i].first);
    e = std::min({s + tile, seen[i].last, (a / block_size + 1) * block_size});
  };
  for (int64_t s = lo; s < hi; s += tile) {
    for (int64_t i = 0; i < n; ++i) {
      int64_t a, e, a2, e2;
      span(i, s, a, e);
      if (a >= e) continue;
      float* pi[2] = {p.data() + offset[i] + a - seen[i].first, nullptr};
      const int64_t base = physical(sr, block_size, a);
      if (i + 1 < n && (span(i + 1, s, a2, e2), a2 == a && e2 == e)) {  // two queries over the same keys
        const float* qi[2] = {q[i], q[i + 1]};
        pi[1] = p.data() + offset[i + 1] + a - seen[i + 1].first;
        scores<2>(qi, k, keys(base), e - a, hd, scale, pi);
        ++i;
      } else {
        scores<1>(&q[i], k, keys(base), e - a, hd, scale, pi);
      }
    }
  }
  std::vector<float> inv(n);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t>& tail = seen[i].tail;
    float* pi = p.data() + offset[i];
    const int64_t cached = seen[i].last - seen[i].first;
    float* pt = pi + cached;
    scores<1>(&q[i], k, [&tail](int64_t j) { return tail[j]; }, tail.size(), hd, scale, &pt);
    inv[i] = softmax_weights(pi, cached + tail.size());
    std::fill(out[i], out[i] + hd, 0.f);
  }
  for (int64_t s = lo; s < hi; s += tile) {
    for (int64_t i = 0; i < n; ++i) {
      int64_t a, e;
      span(i, s, a, e);
      if (a < e)
        accumulate<NV>(p.data() + offset[i] + a - seen[i].first, v, keys(physical(sr, block_size, a)), e - a, hd,
                       out[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t>& tail = seen[i].tail;
    const auto slot = [&tail](int64_t j) { return tail[j]; };
    accumulate<NV>(p.data() + offset[i] + seen[i].last - seen[i].first, v, slot, tail.size(), hd, out[i]);
    const __m256 vinv = _mm256_set1_ps(inv[i]);
    for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(out[i] + d, _mm256_mul_ps(_mm256_loadu_ps(out[i] + d), vinv));
  }
}

// The same for any hd, in plain loops, one query at a time.
template <typename KV>
void attend_plain(const std::vector<const float*>& q, const std::vector<float*>& out, const std::vector<Visible>& seen,
                  const KV* k, const KV* v, const SeqRows& sr, int64_t block_size, int64_t hd, float scale) {
  std::vector<int64_t> slots;
  std::vector<float> p;
  for (size_t i = 0; i < q.size(); ++i) {
    slots.clear();
    for (int64_t j = seen[i].first; j < seen[i].last; ++j) slots.push_back(physical(sr, block_size, j));
    slots.insert(slots.end(), seen[i].tail.begin(), seen[i].tail.end());
    const int64_t L = slots.size();
    p.resize(L);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      const KV* kj = k + slots[j] * hd;
      float s = 0.f;
      for (int64_t d = 0; d < hd; ++d) s += q[i][d] * load1(kj[d]);
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) sum += (p[j] = std::exp(p[j] - mx));
    float* o = out[i];
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const KV* vj = v + slots[j] * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p[j] * load1(vj[d]);
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
  }
}

// Queries q (R, H, hd) of the new rows of every sequence against the cache k, v (K, slots, hd) -> out (R, H, hd). Work
// items run in parallel: each sequence's queries of each KV group (token by token, its heads in order) cut into equal
// runs, the runs of all groups a multiple of the thread count (at least three per thread), so that the threads get
// even shares and the queries of a run share the tiles they read. A query's arithmetic does not depend on the items
// it shares, so a sequence's result is the same alone or in a batch.
template <typename KV>
void attention(const float* q, const KV* k, const KV* v, int64_t H, int64_t K, int64_t S, int64_t hd,
               const std::vector<SeqRows>& seqs, int64_t block_size, const int64_t* positions, const int64_t* slots,
               const bool* mask, int64_t R, int64_t window, float scale, float* out) {
  const int64_t group = H / K, threads = at::get_num_threads();
  struct Item { int64_t seq, g, lo, hi; };  // rows lo..hi of the sequence's (token, head) queries of group g
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    const int64_t T = seqs[s].r1 - seqs[s].r0, per_group = T * group;
    if (T == 0) continue;
    int64_t runs = (3 * threads + K - 1) / K;  // per group
    while (K * runs % threads) ++runs;
    runs = std::min(runs, per_group);
    for (int64_t g = 0; g < K; ++g)
      for (int64_t run = 0; run < runs; ++run) items.push_back({s, g, per_group * run / runs, per_group * (run + 1) / runs});
    work += (seqs[s].ctx + T) * hd * T * H;
  }
  const auto kernel = hd % 64 == 0 ? attend_tiled<8, KV> : hd % 32 == 0 ? attend_tiled<4, KV>
                      : hd % 16 == 0 ? attend_tiled<2, KV> : hd % 8 == 0 ? attend_tiled<1, KV> : attend_plain<KV>;
  const int64_t n_items = items.size();
  at::parallel_for(0, n_items, work >= 16384 ? 1 : std::max<int64_t>(n_items, 1), [&](int64_t i0, int64_t i1) {
    std::vector<const float*> qs;
    std::vector<float*> outs;
    std::vector<Visible> seen;
    for (int64_t it = i0; it < i1; ++it) {
      const Item& item = items[it];
      const SeqRows& sr = seqs[item.seq];
      qs.clear(), outs.clear(), seen.clear();
      for (int64_t r = item.lo; r < item.hi; ++r) {
        const int64_t t = sr.r0 + r / group, h = item.g * group + r % group;
        qs.push_back(q + (t * H + h) * hd);
        outs.push_back(out + (t * H + h) * hd);
        seen.push_back(visible_keys(t, sr, positions, slots, mask, R, window));
      }
      kernel(qs, outs, seen, k + item.g * S * hd, v + item.g * S * hd, sr, block_size, hd, scale);
    }
  });
}

// The gated activation of the MLP, in place on the first half of g (2 I): g[i] = act(g[i]) * g[I + i], where act is
// SiLU, x / (1 + e^-x), or GELU's tanh approximation, x / (1 + e^(-2u)) with u = sqrt(2 / pi) (x + 0.044715 x^3).
void gated_activation(float* g, int64_t I, bool gelu) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    __m256 z = x;  // act(x) = x / (1 + e^-z)
    if (gelu) {
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    }
    const __m256 e = exp_any(_mm256_sub_ps(_mm256_setzero_ps(), z));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(g + I + i)));
  }
  for (; i < I; ++i) {
    const float x = g[i];
    const float z = gelu ? 2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x) : x;
    g[i] = x / (1.f + std::exp(-z)) * g[I + i];
  }
}

}  // namespace

// x (R, D) float32 embeddings of the new rows of a batch of sequences -> (R, D) residual stream after the last layer
// (before the final norm). Sequence b owns rows seq_rows[b]..seq_rows[b + 1], has context[b] tokens in the cache and
// maps logical position a to slot block_table[b][a / block_size] * block_size + a % block_size; row r sits at
// positions[r] and its keys and values are written to slot slots[r]. A sequence's rows are one decode step, a chunk
// of its prompt, or a chain or token tree being verified (tree_mask (R, R) bool: row r sees row j of its own sequence
// iff j is r or an ancestor; empty: every sequence's rows are a causal chain). rope_* are (2, P, hd) cos/sin tables;
// windows[l] is layer l's sliding window (0: attends to everything). Caches are (..., K, slots, hd) per layer, all
// float32 or all float16.
at::Tensor forward_batch(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& seq_rows, const at::Tensor& context,
                         const at::Tensor& block_table, int64_t block_size, const at::Tensor& tree_mask,
                         const at::Tensor& rope_global, const at::Tensor& rope_local, const std::vector<int64_t>& windows,
                         int64_t H, int64_t K, int64_t hd, double eps, double attn_scale, bool sandwich, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (R, D) float32");
  TORCH_CHECK(weights.size() == windows.size() * SLOTS, "weights do not match the layer count");
  const int64_t T = x.size(0), D = x.size(1), L = windows.size(), qn = H * hd, kn = K * hd, B = context.numel();
  for (const at::Tensor* t : {&positions, &slots, &seq_rows, &context, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "batch index tensors must be contiguous int64");
  TORCH_CHECK(positions.numel() == T && slots.numel() == T, "positions and slots must be (R,)");
  TORCH_CHECK(seq_rows.numel() == B + 1 && block_table.dim() == 2 && block_table.size(0) == B && block_size > 0,
              "seq_rows (B + 1,), block_table (B, W)");
  const bool tree = present(tree_mask);
  TORCH_CHECK(!tree || (tree_mask.scalar_type() == at::kBool && tree_mask.numel() == T * T &&
                        tree_mask.is_contiguous()), "tree_mask must be (R, R) bool");
  const int64_t* SR = seq_rows.data_ptr<int64_t>();
  const int64_t* CTX = context.data_ptr<int64_t>();
  const int64_t W = block_table.size(1);
  std::vector<SeqRows> seqs(B);
  for (int64_t b = 0; b < B; ++b) {
    seqs[b] = {SR[b], SR[b + 1], CTX[b], block_table.data_ptr<int64_t>() + b * W};
    TORCH_CHECK(0 <= SR[b] && SR[b] <= SR[b + 1] && SR[b + 1] <= T, "seq_rows must be ascending within the rows");
    TORCH_CHECK(CTX[b] + (SR[b + 1] - SR[b]) <= W * block_size, "sequence ", b, " runs past its block table");
  }
  x = x.contiguous().clone();
  float* X = x.data_ptr<float>();
  const int64_t* P = positions.data_ptr<int64_t>();
  const int64_t* SL = slots.data_ptr<int64_t>();
  const bool* M = tree ? tree_mask.data_ptr<bool>() : nullptr;
  const at::ScalarType kv_type = weights[K_CACHE].scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kHalf, "the KV cache must be float32 or float16");
  for (int64_t l = 0; l < L; ++l)
    for (int c : {K_CACHE, V_CACHE})
      TORCH_CHECK(weights[l * SLOTS + c].scalar_type() == kv_type && weights[l * SLOTS + c].is_contiguous(),
                  "every layer's cache must be contiguous and of one type");
  const bool half = kv_type == at::kHalf;
  at::Tensor h = at::empty({T, D}, x.options()), attn = at::empty({T, qn}, x.options());
  float* Hs = h.data_ptr<float>();
  const float epsf = static_cast<float>(eps), scale = static_cast<float>(attn_scale);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * SLOTS;
    const int64_t S = w[K_CACHE].size(-2), window = windows[l];
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= SL[t] && SL[t] < S, "slot ", SL[t], " is past the cache of ", S);
    const at::Tensor& rope = window ? rope_local : rope_global;

    for (int64_t t = 0; t < T; ++t) rms_norm(X + t * D, w[IN_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
    at::Tensor qkv = linear(h, w[QKV_W], w[QKV_B]);  // (T, qn + 2 kn)
    void* kc = w[K_CACHE].data_ptr();
    void* vc = w[V_CACHE].data_ptr();
    const auto write = [half](const float* x, int64_t n, void* cache, int64_t at) {
      if (half) store_kv(x, n, static_cast<uint16_t*>(cache) + at);
      else store_kv(x, n, static_cast<float*>(cache) + at);
    };
    at::Tensor qs = at::empty({T, qn}, x.options());
    for (int64_t t = 0; t < T; ++t) {
      float* q = qkv.data_ptr<float>() + t * (qn + 2 * kn);
      float* k = q + qn;
      const float* v = k + kn;
      const float* cos = rope.data_ptr<float>() + P[t] * hd;
      const float* sin = cos + rope.size(1) * hd;
      for (int64_t i = 0; i < H; ++i) {
        if (present(w[Q_NORM])) rms_norm(q + i * hd, w[Q_NORM].data_ptr<float>(), hd, epsf, q + i * hd);
        rotary(q + i * hd, cos, sin, hd);
      }
      std::copy(q, q + qn, qs.data_ptr<float>() + t * qn);
      for (int64_t g = 0; g < K; ++g) {
        if (present(w[K_NORM])) rms_norm(k + g * hd, w[K_NORM].data_ptr<float>(), hd, epsf, k + g * hd);
        rotary(k + g * hd, cos, sin, hd);
        write(k + g * hd, hd, kc, (g * S + SL[t]) * hd);
        write(v + g * hd, hd, vc, (g * S + SL[t]) * hd);
      }
    }
    if (half)
      attention(qs.data_ptr<float>(), static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), H, K, S, hd,
                seqs, block_size, P, SL, M, T, window, scale, attn.data_ptr<float>());
    else
      attention(qs.data_ptr<float>(), static_cast<const float*>(kc), static_cast<const float*>(vc), H, K, S, hd, seqs,
                block_size, P, SL, M, T, window, scale, attn.data_ptr<float>());
    at::Tensor o = linear(attn, w[O_W], w[O_B]);
    float* O = o.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* Xt = X + t * D;
      float* Ot = O + t * D;
      if (sandwich) {
        rms_norm(Ot, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, Ot);
        for (int64_t i = 0; i < D; ++i) Xt[i] += Ot[i];
        rms_norm(Xt, w[PRE_FF_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
      } else {
        for (int64_t i = 0; i < D; ++i) Xt[i] += Ot[i];
        rms_norm(Xt, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
      }
    }
    at::Tensor gu = linear(h, w[GU_W], w[GU_B]);  // (T, 2 I)
    const int64_t I = gu.size(1) / 2;
    for (int64_t t = 0; t < T; ++t) gated_activation(gu.data_ptr<float>() + t * 2 * I, I, gelu);
    at::Tensor d = linear(gu.narrow(1, 0, I), w[DOWN_W], w[DOWN_B]);
    float* Dn = d.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      float* Dt = Dn + t * D;
      if (sandwich) rms_norm(Dt, w[POST_FF_NORM].data_ptr<float>(), D, epsf, Dt);
      for (int64_t i = 0; i < D; ++i) X[t * D + i] += Dt[i];
    }
  }
  return x;
}
