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
}  // namespace fastdecode

namespace {

// Tensors of one layer, in this order (an empty tensor stands for "absent").
enum Slot {
  IN_NORM, POST_ATTN_NORM, PRE_FF_NORM, POST_FF_NORM, Q_NORM, K_NORM,
  QKV_W, QKV_B, O_W, O_B, GU_W, GU_B, DOWN_W, DOWN_B, K_CACHE, V_CACHE, SLOTS
};

inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// A float weight (N, K), or a packed quantized one (quant.cpp): 8-bit (N/4, K/32, 144 or 136) or int4 (N/4, K/64, 160).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  c10::optional<at::Tensor> bias = present(b) ? c10::optional<at::Tensor>(b) : c10::nullopt;
  if (w.scalar_type() != at::kByte) return at::linear(x, w, bias);
  return w.size(2) != 160 ? fastdecode::q8_linear(x, w, bias) : fastdecode::q4_linear(x, w, bias);
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

// Attention in tiles of keys: a work item is a few queries of one KV group (the heads of a group and the tokens of a
// verify step read the same keys), and each tile of KEY_TILE keys and values is read by all of them while it sits in
// L1, instead of once per query from L2. Every key's score is one FMA chain over hd and the same horizontal sum, and
// every output element one FMA chain over the keys in order, whatever the tiling, the number of tokens in the call
// or the queries that share an item, so a token's result is the same in a decode step and in a verify step.
constexpr int64_t KEY_TILE = 32;  // 32 keys of 64 floats: 8 KB of keys and 8 KB of values

// p[r][i] = (q[r] . key i) * scale for NQ queries and n keys, key i at k + slot(i) * hd (hd % 8 == 0). Two queries
// over four keys are eight independent FMA chains, enough to keep both FMA units busy through their latency; one
// query takes four keys at a time (eight streams of keys were slower where the keys come from memory).
template <int NQ, typename Slot>
void scores(const float* const* q, const float* k, Slot slot, int64_t n, int64_t hd, float scale, float* const* p) {
  constexpr int NK = 4;
  int64_t i = 0;
  for (; i + NK <= n; i += NK) {
    const float* key[NK];
    for (int b = 0; b < NK; ++b) key[b] = k + slot(i + b) * hd;
    __m256 a[NQ][NK];
    for (int r = 0; r < NQ; ++r)
      for (int b = 0; b < NK; ++b) a[r][b] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 qd[NQ];
      for (int r = 0; r < NQ; ++r) qd[r] = _mm256_loadu_ps(q[r] + d);
      for (int b = 0; b < NK; ++b) {
        const __m256 kd = _mm256_loadu_ps(key[b] + d);
        for (int r = 0; r < NQ; ++r) a[r][b] = _mm256_fmadd_ps(qd[r], kd, a[r][b]);
      }
    }
    for (int r = 0; r < NQ; ++r)
      for (int b = 0; b < NK; ++b) p[r][i + b] = hsum(a[r][b]) * scale;
  }
  for (; i < n; ++i) {
    const float* ki = k + slot(i) * hd;
    for (int r = 0; r < NQ; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + d), _mm256_loadu_ps(ki + d), a);
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
template <int NV, typename Slot>  // NV 8-float vectors of out in registers at a time (hd % (8 NV) == 0)
void accumulate(const float* p, const float* v, Slot slot, int64_t n, int64_t hd, float* out) {
  for (int64_t d0 = 0; d0 < hd; d0 += 8 * NV) {
    __m256 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_loadu_ps(out + d0 + 8 * c);
    for (int64_t i = 0; i < n; ++i) {
      const __m256 pi = _mm256_set1_ps(p[i]);
      const float* vi = v + slot(i) * hd + d0;
      for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vi + 8 * c), acc[c]);
    }
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + d0 + 8 * c, acc[c]);
  }
}

// Which keys a query sees: the cache slots [first, slot0) (positions 0..slot0-1 in order) inside its sliding window,
// then the new tokens (slots slot0 + j) that the tree mask allows (mask (T, T), row t: its ancestors and itself;
// null means a causal chain) and that lie inside the window: the same list a decode step at its position would see.
struct Visible {
  int64_t first;
  std::vector<int64_t> tail;
};

Visible visible_keys(int64_t t, int64_t T, int64_t slot0, const int64_t* positions, const bool* mask, int64_t window) {
  const int64_t pos = positions[t];
  Visible out{window ? std::min(slot0, std::max<int64_t>(0, pos - window + 1)) : 0, {}};
  for (int64_t j = 0; j < T; ++j) {
    const bool visible = mask ? mask[t * T + j] : j <= t;
    if (visible && (!window || pos - positions[j] < window)) out.tail.push_back(slot0 + j);
  }
  return out;
}

// Queries q[i] (hd) that share one KV group's cache k, v (S, hd) -> out[i] (hd).
template <int NV>
void attend_tiled(const std::vector<const float*>& q, const std::vector<float*>& out, const std::vector<Visible>& seen,
                  const float* k, const float* v, int64_t slot0, int64_t hd, float scale) {
  const int64_t n = q.size();
  std::vector<int64_t> offset(n + 1, 0);  // query i's weights p[offset[i]..]: its cache keys, then its tail
  int64_t lo = slot0;
  for (int64_t i = 0; i < n; ++i) {
    offset[i + 1] = offset[i] + (slot0 - seen[i].first) + seen[i].tail.size() + 8;
    lo = std::min(lo, seen[i].first);
  }
  std::vector<float> p(offset[n]);
  const auto keys = [](int64_t a) { return [a](int64_t j) { return a + j; }; };  // the cache slots a, a + 1, ...
  for (int64_t s = lo; s < slot0; s += KEY_TILE) {
    const int64_t e = std::min(s + KEY_TILE, slot0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = std::max(s, seen[i].first);
      float* pi[2] = {p.data() + offset[i] + a - seen[i].first, nullptr};
      if (i + 1 < n && std::max(s, seen[i + 1].first) == a && a < e) {  // two queries over the same keys
        const float* qi[2] = {q[i], q[i + 1]};
        pi[1] = p.data() + offset[i + 1] + a - seen[i + 1].first;
        scores<2>(qi, k, keys(a), e - a, hd, scale, pi);
        ++i;
      } else if (a < e) {
        scores<1>(&q[i], k, keys(a), e - a, hd, scale, pi);
      }
    }
  }
  std::vector<float> inv(n);
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t>& tail = seen[i].tail;
    float* pi = p.data() + offset[i];
    const int64_t cached = slot0 - seen[i].first;
    float* pt = pi + cached;
    scores<1>(&q[i], k, [&tail](int64_t j) { return tail[j]; }, tail.size(), hd, scale, &pt);
    inv[i] = softmax_weights(pi, cached + tail.size());
    std::fill(out[i], out[i] + hd, 0.f);
  }
  for (int64_t s = lo; s < slot0; s += KEY_TILE) {
    const int64_t e = std::min(s + KEY_TILE, slot0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t a = std::max(s, seen[i].first);
      if (a < e) accumulate<NV>(p.data() + offset[i] + a - seen[i].first, v, keys(a), e - a, hd, out[i]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const std::vector<int64_t>& tail = seen[i].tail;
    const auto slot = [&tail](int64_t j) { return tail[j]; };
    accumulate<NV>(p.data() + offset[i] + slot0 - seen[i].first, v, slot, tail.size(), hd, out[i]);
    const __m256 vinv = _mm256_set1_ps(inv[i]);
    for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(out[i] + d, _mm256_mul_ps(_mm256_loadu_ps(out[i] + d), vinv));
  }
}

// The same for any hd, in plain loops, one query at a time.
void attend_plain(const std::vector<const float*>& q, const std::vector<float*>& out, const std::vector<Visible>& seen,
                  const float* k, const float* v, int64_t slot0, int64_t hd, float scale) {
  std::vector<int64_t> slots;
  std::vector<float> p;
  for (size_t i = 0; i < q.size(); ++i) {
    slots.clear();
    for (int64_t j = seen[i].first; j < slot0; ++j) slots.push_back(j);
    slots.insert(slots.end(), seen[i].tail.begin(), seen[i].tail.end());
    const int64_t L = slots.size();
    p.resize(L);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      const float* kj = k + slots[j] * hd;
      float s = 0.f;
      for (int64_t d = 0; d < hd; ++d) s += q[i][d] * kj[d];
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) sum += (p[j] = std::exp(p[j] - mx));
    float* o = out[i];
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const float* vj = v + slots[j] * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p[j] * vj[d];
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
  }
}

// Queries q (T, H, hd) of the new tokens against the cache k, v (K, S, hd) -> out (T, H, hd). Work items run in
// parallel: each KV group's queries (token by token, its heads in order) cut into equal runs, the runs of all groups
// a multiple of the thread count (at least three per thread), so that the threads get even shares and the queries
// of a run share the tiles they read.
void attention(const float* q, const float* k, const float* v, int64_t T, int64_t H, int64_t K, int64_t S,
               int64_t hd, int64_t slot0, const int64_t* positions, const bool* mask, int64_t window, float scale,
               float* out) {
  const int64_t group = H / K, per_group = T * group, threads = at::get_num_threads();
  int64_t runs = (3 * threads + K - 1) / K;  // per group
  while (K * runs % threads) ++runs;
  runs = std::min(runs, per_group);
  const auto kernel = hd % 64 == 0 ? attend_tiled<8> : hd % 32 == 0 ? attend_tiled<4> : hd % 16 == 0 ? attend_tiled<2>
                      : hd % 8 == 0 ? attend_tiled<1> : attend_plain;
  at::parallel_for(0, K * runs, (slot0 + T) * hd * T * H >= 16384 ? 1 : K * runs, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> qs;
    std::vector<float*> outs;
    std::vector<Visible> seen;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t g = item / runs, run = item % runs;
      qs.clear(), outs.clear(), seen.clear();
      for (int64_t r = per_group * run / runs; r < per_group * (run + 1) / runs; ++r) {
        const int64_t t = r / group, h = g * group + r % group;
        qs.push_back(q + (t * H + h) * hd);
        outs.push_back(out + (t * H + h) * hd);
        seen.push_back(visible_keys(t, T, slot0, positions, mask, window));
      }
      kernel(qs, outs, seen, k + g * S * hd, v + g * S * hd, slot0, hd, scale);
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

// x (T, D) float32 embeddings of new tokens at `positions` (T,), written to cache slots slot0..slot0+T-1 ->
// (T, D) residual stream after the last layer (before the final norm). One token is a decode step; several are a
// chain or a token tree being verified (tree_mask (T, T) bool, empty for a causal chain). rope_* are (2, S, hd)
// cos/sin tables; windows[l] is layer l's sliding window (0: attends to everything).
at::Tensor forward_layers(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                          int64_t slot0, const at::Tensor& tree_mask, const at::Tensor& rope_global,
                          const at::Tensor& rope_local, const std::vector<int64_t>& windows, int64_t H, int64_t K,
                          int64_t hd, double eps, double attn_scale, bool sandwich, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (T, D) float32");
  TORCH_CHECK(weights.size() == windows.size() * SLOTS, "weights do not match the layer count");
  const int64_t T = x.size(0), D = x.size(1), L = windows.size(), qn = H * hd, kn = K * hd;
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == T && positions.is_contiguous(),
              "positions must be (T,) int64");
  const bool tree = present(tree_mask);
  TORCH_CHECK(!tree || (tree_mask.scalar_type() == at::kBool && tree_mask.numel() == T * T &&
                        tree_mask.is_contiguous()), "tree_mask must be (T, T) bool");
  x = x.contiguous().clone();
  float* X = x.data_ptr<float>();
  const int64_t* P = positions.data_ptr<int64_t>();
  const bool* M = tree ? tree_mask.data_ptr<bool>() : nullptr;
  at::Tensor h = at::empty({T, D}, x.options()), attn = at::empty({T, qn}, x.options());
  float* Hs = h.data_ptr<float>();
  const float epsf = static_cast<float>(eps), scale = static_cast<float>(attn_scale);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * SLOTS;
    const int64_t S = w[K_CACHE].size(2), window = windows[l];
    TORCH_CHECK(slot0 + T <= S, "slot ", slot0 + T - 1, " is past the cache of ", S);
    const at::Tensor& rope = window ? rope_local : rope_global;

    for (int64_t t = 0; t < T; ++t) rms_norm(X + t * D, w[IN_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
    at::Tensor qkv = linear(h, w[QKV_W], w[QKV_B]);  // (T, qn + 2 kn)
    float* kc = w[K_CACHE].data_ptr<float>();
    float* vc = w[V_CACHE].data_ptr<float>();
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
        std::copy(k + g * hd, k + (g + 1) * hd, kc + (g * S + slot0 + t) * hd);
        std::copy(v + g * hd, v + (g + 1) * hd, vc + (g * S + slot0 + t) * hd);
      }
    }
    attention(qs.data_ptr<float>(), kc, vc, T, H, K, S, hd, slot0, P, M, window, scale, attn.data_ptr<float>());
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
