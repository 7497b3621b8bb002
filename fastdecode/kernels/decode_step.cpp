// One decode step or one verify step (T new tokens, batch 1, float32 activations) through every layer, in C++.
//
// At one token the matmuls are small and PyTorch's per-op dispatch (~40 ops and 10 module calls per layer from
// Python) costs more than the arithmetic around them. Here a layer is: RMSNorm, one packed qkv matmul, q/k norm,
// rotary, a cache write, attention over the cache (attention.h), o matmul, residual, RMSNorm, one packed gate/up
// matmul, the activation, down matmul, residual; the elementwise work is plain loops, the matmuls call the quantized
// kernels (quant.cpp) or ATen's float linear. The weights per layer come in the Slot order below, which
// fastdecode/runners/native_layers.py follows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include "attention.h"
#include "model_shape.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fastdecode {
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
}  // namespace fastdecode

namespace {

// Tensors of one layer, in this order (an empty tensor stands for "absent").
enum Slot {
  IN_NORM, POST_ATTN_NORM, PRE_FF_NORM, POST_FF_NORM, Q_NORM, K_NORM, SINKS,
  QKV_W, QKV_B, QKV2_W, QKV2_B, O_W, O_B, GU_W, GU_B, DOWN_W, DOWN_B,
  ROUTER_W, ROUTER_B, EXPERT_GU_W, EXPERT_GU_B, EXPERT_DOWN_W, EXPERT_DOWN_B, K_CACHE, V_CACHE, SLOTS
};
// SINKS: gpt-oss's learned logit per head, which joins each softmax's denominator (attention may go to no token).
// QKV2: the q/k/v's second part where its rows come in two formats (a Q4_K_M file's Q6_K v beside Q4_K q/k).
// A mixture-of-experts layer has ROUTER_W (E, D) in place of GU_W, and its experts' gate/up and down weights stacked
// along a first dimension of E (each expert's slice in the layout linear() takes; biases (E, N) or absent).

inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// A float weight (N, K), or a packed quantized one, told apart by its tile size: 8-bit (N/4, K/32, 144 or N/4, K/64,
// 272) or int4 (N/4, K/64, 160) (quant.cpp), a GGUF K-quant (N/4, K/256, 592 | 720 | 840) (kquant.cpp), MXFP4
// (N/4, K/64, 136) (fp4.cpp).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  c10::optional<at::Tensor> bias = present(b) ? c10::optional<at::Tensor>(b) : c10::nullopt;
  if (w.scalar_type() != at::kByte) return at::linear(x, w, bias);
  switch (w.size(2)) {
    case 144: case 272: return fastdecode::q8_linear(x, w, bias);
    case 160: return fastdecode::q4_linear(x, w, bias);
    case 136: return fastdecode::fp4_linear(x, w, bias);
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

using fastdecode::attention;
using fastdecode::exp_in_range;
using fastdecode::hsum;
using fastdecode::SeqRows;
using fastdecode::vecf;
using fastdecode::vfma;
using fastdecode::vload;
using fastdecode::VW;
using fastdecode::vzero;

inline __m256 exp_any(__m256 x) {
  return exp_in_range(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)));
}

// n floats -> the cache's type (float16: rounded to nearest even).
inline void store_kv(const float* x, int64_t n, float* out) { std::copy(x, x + n, out); }
inline void store_kv(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// An MLP's gated activation: SiLU or GELU's tanh approximation times the up branch, or (limit > 0) gpt-oss's clamped
// SwiGLU, x sigmoid(alpha x) (u + 1) with the gate x clamped above at limit and the up branch u to +-limit.
struct Gate {
  bool gelu;
  float limit, alpha;
};

// In place on the first half of g (2 I): g[i] = act(x) * y with x = g[i], y = g[I + i], where act(x) = x / (1 + e^-z):
// z = x for SiLU, 2u with u = sqrt(2 / pi) (x + 0.044715 x^3) for GELU; gpt-oss: x, y clamped, z = alpha x, y + 1.
void gated_activation(float* g, int64_t I, Gate gate) {
  const __m256 one = _mm256_set1_ps(1.0f), limit = _mm256_set1_ps(gate.limit), alpha = _mm256_set1_ps(gate.alpha);
  const bool clamped = gate.limit > 0;
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    __m256 x = _mm256_loadu_ps(g + i), y = _mm256_loadu_ps(g + I + i);
    __m256 z = x;  // act(x) = x / (1 + e^-z)
    if (clamped) {
      x = _mm256_min_ps(x, limit);
      y = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(y, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit)), one);
      z = _mm256_mul_ps(x, alpha);
    } else if (gate.gelu) {
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    }
    const __m256 e = exp_any(_mm256_sub_ps(_mm256_setzero_ps(), z));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), y));
  }
  for (; i < I; ++i) {
    float x = g[i], y = g[I + i], z = x;
    if (clamped) {
      x = std::min(x, gate.limit);
      y = std::max(std::min(y, gate.limit), -gate.limit) + 1.f;
      z = x * gate.alpha;
    } else if (gate.gelu) {
      z = 2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x);
    }
    g[i] = x / (1.f + std::exp(-z)) * y;
  }
}

// An MoE block (Qwen3-MoE, gpt-oss), as models/moe.py computes it: h (T, D) -> sum over each row's top-k experts of
// the router weight times that expert's gated MLP. The weights: a softmax over all experts' logits, then the top k
// (renormalised when norm_topk), or (softmax_after_topk, gpt-oss) the top k logits, then their softmax. Rows are
// grouped by expert, so each routed expert's weights are read once per call however many rows chose it, and experts
// no row chose are not read at all.
at::Tensor moe(const at::Tensor& h, const at::Tensor* w, int64_t top_k, bool norm_topk, bool softmax_after_topk,
               Gate gate) {
  const int64_t T = h.size(0), D = h.size(1), E = w[ROUTER_W].size(0);
  TORCH_CHECK(w[ROUTER_W].scalar_type() == at::kFloat && w[ROUTER_W].is_contiguous() && w[ROUTER_W].size(1) == D,
              "the router must be a contiguous float32 (E, D) matrix");
  // The router's logits row by row, in one fixed order: a float GEMM's sums depend on how many rows it is given, and
  // an ulp there moves the int8-rounded activations of the experts after it, so a row verified beside draft tokens
  // would not get the logits it gets alone (greedy speculation would stop being lossless).
  at::Tensor logits = at::empty({T, E}, h.options());
  const float* RW = w[ROUTER_W].data_ptr<float>();
  at::parallel_for(0, T * E, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const float* x = h.data_ptr<float>() + i / E * D;
      const float* r = RW + i % E * D;
      vecf acc = vzero();
      int64_t j = 0;
      for (; j + VW <= D; j += VW) acc = vfma(vload(x + j), vload(r + j), acc);
      float sum = hsum(acc);
      for (; j < D; ++j) sum += x[j] * r[j];
      logits.data_ptr<float>()[i] = sum + (present(w[ROUTER_B]) ? w[ROUTER_B].data_ptr<float>()[i % E] : 0.f);
    }
  });
  at::Tensor weight, expert;  // (T, k): torch.topk's order, so ties break as in PyTorch
  if (softmax_after_topk) {
    std::tie(weight, expert) = at::topk(logits, top_k);
    weight = at::softmax(weight, -1);
  } else {
    std::tie(weight, expert) = at::topk(at::softmax(logits, -1, at::kFloat), top_k);
    if (norm_topk) weight = weight / weight.sum(-1, true);
  }
  weight = weight.contiguous();
  const float* WT = weight.data_ptr<float>();
  const int64_t* ID = expert.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> chosen(E);  // expert -> indices t * k + j of the choices routed to it
  for (int64_t i = 0; i < T * top_k; ++i) {
    TORCH_CHECK(0 <= ID[i] && ID[i] < E, "router chose expert ", ID[i], " of ", E);
    chosen[ID[i]].push_back(i);
  }
  std::vector<int64_t> routed;  // the experts some row chose
  size_t most = 0;
  for (int64_t e = 0; e < E; ++e)
    if (!chosen[e].empty()) routed.push_back(e), most = std::max(most, chosen[e].size());
  const auto part = [](const at::Tensor& t, int64_t e) { return present(t) ? t[e] : t; };
  std::vector<at::Tensor> rows(routed.size()), outs(routed.size());
  const auto run = [&](size_t i) {  // routed expert i's SwiGLU over its rows -> outs[i] (n, D)
    const int64_t e = routed[i], n = chosen[e].size();
    rows[i] = at::empty({n}, at::kLong);
    for (int64_t r = 0; r < n; ++r) rows[i].data_ptr<int64_t>()[r] = chosen[e][r] / top_k;
    at::Tensor gu = linear(n == T ? h : h.index_select(0, rows[i]), w[EXPERT_GU_W][e], part(w[EXPERT_GU_B], e));
    const int64_t I = gu.size(1) / 2;
    for (int64_t r = 0; r < n; ++r) gated_activation(gu.data_ptr<float>() + r * 2 * I, I, gate);
    outs[i] = linear(gu.narrow(1, 0, I), w[EXPERT_DOWN_W][e], part(w[EXPERT_DOWN_B], e));
  };
  if (most <= 4) {
    // A decode or verify step: each expert is a few rows through matrices of ~1-2 MB, where a parallel region per
    // matmul costs more than it splits. The threads take whole experts instead (the kernels inside run on one
    // thread, with the same result: they split over output rows, never over a sum).
    at::parallel_for(0, routed.size(), 1, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) run(i);
    });
  } else {
    for (size_t i = 0; i < routed.size(); ++i) run(i);
  }
  at::Tensor out = at::zeros_like(h);
  float* OUT = out.data_ptr<float>();
  for (size_t i = 0; i < routed.size(); ++i) {  // in expert order, whichever thread ran each
    const std::vector<int64_t>& choices = chosen[routed[i]];
    for (size_t r = 0; r < choices.size(); ++r) {
      const float g = WT[choices[r]];
      const float* src = outs[i].data_ptr<float>() + r * D;
      float* dst = OUT + rows[i].data_ptr<int64_t>()[r] * D;
      for (int64_t j = 0; j < D; ++j) dst[j] += src[j] * g;
    }
  }
  return out;
}

// f(t) for the rows t of a step, spread over the threads where there are enough of them (a prompt chunk): the
// per-row work between the matmuls (norms, rotary and cache writes, activations, residuals) took one thread
// otherwise. Each row is computed alike wherever it runs.
template <typename F>
void each_row(int64_t T, int64_t floats_per_row, F f) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, floats_per_row));
  at::parallel_for(0, T, grain, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) f(t);
  });
}

// Where forward_batch's time goes, summed over calls until read (forward_profile): the matmuls (a mixture-of-experts
// layer's routing and experts whole), attention, and the whole call; the rest is norms, rotary, the cache writes,
// the activations and the residual adds. A clock read per part and layer costs nothing next to them; the lock is
// for two engines (or ranks) of one process stepping at once.
struct Profile {
  double matmul = 0, attention = 0, total = 0;
  int64_t calls = 0, rows = 0;
};
Profile profile;
std::mutex profile_lock;

struct Timed {  // adds the seconds from its construction to its destruction to `into`
  double& into;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  explicit Timed(double& into) : into(into) {}
  ~Timed() {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::lock_guard<std::mutex> hold(profile_lock);
    into += s;
  }
};

}  // namespace

// x (R, D) float32 embeddings of the new rows of a batch of sequences -> (R, D) residual stream after the last layer
// (before the final norm). Sequence b owns rows seq_rows[b]..seq_rows[b + 1], has context[b] tokens in the cache and
// maps logical position a to slot block_table[b][a / block_size] * block_size + a % block_size, and its positions
// below prompt_end[b] are its prompt (their attention may take the prompt kernel; empty: no row is); row r sits at
// positions[r] and its keys and values are written to slot slots[r]. A sequence's rows are one decode step, a chunk
// of its prompt, or a chain or token tree being verified (tree_mask (R, R) bool: row r sees row j of its own sequence
// iff j is r or an ancestor; empty: every sequence's rows are a causal chain). rope_* are (2, P, hd) cos/sin tables;
// `shape` (model_shape.h) holds the model-wide rest: the heads, each layer's sliding window, the MLPs' gate, the MoE
// routing (see moe). Caches are (..., K, slots, hd) per layer, all float32 or all float16. `reduce`, when set, sums
// a (R, D) partial output across tensor-parallel ranks in place: each layer's attention output projection and MLP are
// one rank's shard of the whole (parallel/shard.py), so their outputs go through it before the residual add.
at::Tensor forward_batch(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& seq_rows, const at::Tensor& context,
                         const at::Tensor& prompt_end, const at::Tensor& block_table, int64_t block_size,
                         const at::Tensor& tree_mask,
                         const at::Tensor& rope_global, const at::Tensor& rope_local,
                         const fastdecode::ModelShape& shape, const std::function<void(at::Tensor)>& reduce) {
  const std::vector<int64_t>& windows = shape.windows;
  const int64_t H = shape.heads, K = shape.kv_heads, hd = shape.head_dim;
  TORCH_CHECK(H > 0 && K > 0 && hd > 0 && H % K == 0, "the model shape needs heads, kv_heads and head_dim");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (R, D) float32");
  TORCH_CHECK(weights.size() == windows.size() * SLOTS, "weights do not match the layer count");
  const Timed whole(profile.total);
  {
    const std::lock_guard<std::mutex> hold(profile_lock);
    ++profile.calls, profile.rows += x.size(0);
  }
  const int64_t T = x.size(0), D = x.size(1), L = windows.size(), qn = H * hd, kn = K * hd, B = context.numel();
  for (const at::Tensor* t : {&positions, &slots, &seq_rows, &context, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "batch index tensors must be contiguous int64");
  TORCH_CHECK(!present(prompt_end) || (prompt_end.scalar_type() == at::kLong && prompt_end.is_contiguous() &&
                                       prompt_end.numel() == context.numel()), "prompt_end must be (B,) int64");
  const int64_t* PE = present(prompt_end) ? prompt_end.data_ptr<int64_t>() : nullptr;
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
  const float epsf = static_cast<float>(shape.eps), scale = static_cast<float>(shape.attn_scale);
  const Gate gate{shape.gelu, static_cast<float>(shape.swiglu_limit), static_cast<float>(shape.swiglu_alpha)};
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * SLOTS;
    const int64_t S = w[K_CACHE].size(-2), window = windows[l];
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= SL[t] && SL[t] < S, "slot ", SL[t], " is past the cache of ", S);
    const at::Tensor& rope = window ? rope_local : rope_global;
    TORCH_CHECK(!present(w[SINKS]) || (w[SINKS].scalar_type() == at::kFloat && w[SINKS].numel() == H &&
                                       w[SINKS].is_contiguous()), "sinks must be (H,) float32");
    const float* sinks = present(w[SINKS]) ? w[SINKS].data_ptr<float>() : nullptr;

    each_row(T, D, [&](int64_t t) { rms_norm(X + t * D, w[IN_NORM].data_ptr<float>(), D, epsf, Hs + t * D); });
    at::Tensor qkv;
    {
      const Timed timed(profile.matmul);
      qkv = linear(h, w[QKV_W], w[QKV_B]);  // (T, qn + 2 kn)
      if (present(w[QKV2_W])) qkv = at::cat({qkv, linear(h, w[QKV2_W], w[QKV2_B])}, 1);
    }
    void* kc = w[K_CACHE].data_ptr();
    void* vc = w[V_CACHE].data_ptr();
    const auto write = [half](const float* x, int64_t n, void* cache, int64_t at) {
      if (half) store_kv(x, n, static_cast<uint16_t*>(cache) + at);
      else store_kv(x, n, static_cast<float*>(cache) + at);
    };
    at::Tensor qs = at::empty({T, qn}, x.options());
    each_row(T, qn + 2 * kn, [&](int64_t t) {
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
    });
    {
      const Timed timed(profile.attention);
      if (half)
        attention(qs.data_ptr<float>(), static_cast<const uint16_t*>(kc), static_cast<const uint16_t*>(vc), H, K, S,
                  hd, seqs, PE, block_size, P, SL, M, T, window, scale, sinks, attn.data_ptr<float>());
      else
        attention(qs.data_ptr<float>(), static_cast<const float*>(kc), static_cast<const float*>(vc), H, K, S, hd,
                  seqs, PE, block_size, P, SL, M, T, window, scale, sinks, attn.data_ptr<float>());
    }
    at::Tensor o;
    {
      const Timed timed(profile.matmul);
      o = linear(attn, w[O_W], w[O_B]);
    }
    if (reduce) reduce(o);
    float* O = o.data_ptr<float>();
    each_row(T, 2 * D, [&](int64_t t) {
      float* Xt = X + t * D;
      float* Ot = O + t * D;
      if (shape.sandwich) {
        rms_norm(Ot, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, Ot);
        for (int64_t i = 0; i < D; ++i) Xt[i] += Ot[i];
        rms_norm(Xt, w[PRE_FF_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
      } else {
        for (int64_t i = 0; i < D; ++i) Xt[i] += Ot[i];
        rms_norm(Xt, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, Hs + t * D);
      }
    });
    at::Tensor d;
    if (present(w[ROUTER_W])) {
      TORCH_CHECK(0 < shape.top_k && shape.top_k <= w[ROUTER_W].size(0), "top_k must be within the expert count");
      const Timed timed(profile.matmul);
      d = moe(h, w, shape.top_k, shape.norm_topk, shape.softmax_after_topk, gate);
    } else {
      at::Tensor gu;
      {
        const Timed timed(profile.matmul);
        gu = linear(h, w[GU_W], w[GU_B]);  // (T, 2 I)
      }
      const int64_t I = gu.size(1) / 2;
      each_row(T, 2 * I, [&](int64_t t) { gated_activation(gu.data_ptr<float>() + t * 2 * I, I, gate); });
      const Timed timed(profile.matmul);
      d = linear(gu.narrow(1, 0, I), w[DOWN_W], w[DOWN_B]);
    }
    if (reduce) reduce(d);
    float* Dn = d.data_ptr<float>();
    each_row(T, D, [&](int64_t t) {
      float* Dt = Dn + t * D;
      if (shape.sandwich) rms_norm(Dt, w[POST_FF_NORM].data_ptr<float>(), D, epsf, Dt);
      for (int64_t i = 0; i < D; ++i) X[t * D + i] += Dt[i];
    });
  }
  return x;
}

// The kernel prompt rows' attention takes here, "bf16" (attention_bf16.h) or "float32 lanes" (attention_lanes.h), and
// the head sizes it takes (multiples of that); ("", 0) where it is switched off: the float kernel, as for decode rows.
std::tuple<std::string, int64_t> prompt_attention() {
  if (!fastdecode::prompt_attention_ready()) return {"", 0};
  return {fastdecode::PROMPT_ATTENTION, fastdecode::PROMPT_HD_MULTIPLE};
}

// (forward_batch's calls, their rows, and seconds in matmuls, in attention and in all) since the last reset.
std::vector<double> forward_profile(bool reset) {
  const std::lock_guard<std::mutex> hold(profile_lock);
  const std::vector<double> out{double(profile.calls), double(profile.rows), profile.matmul, profile.attention,
                                profile.total};
  if (reset) profile = Profile{};
  return out;
}
