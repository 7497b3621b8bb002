// One decode step (one token, batch 1, float32 activations) through every layer, in C++.
//
// At one token the matmuls are small and PyTorch's per-op dispatch (~40 ops and 10 module calls per layer from
// Python) costs more than the arithmetic around them. Here a layer is: RMSNorm, one packed qkv matmul, q/k norm,
// rotary, a cache write, attention over the cache, o matmul, residual, RMSNorm, one packed gate/up matmul, the
// activation, down matmul, residual; the elementwise work is plain loops, the matmuls call the quantized kernels
// (quant.cpp) or ATen's float linear. Weight layout per layer is fixed by fastdecode/kernels/__init__.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

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

// A float weight (N, K), or a packed quantized one (quant.cpp): int8 (N/4, K/32, 136) or int4 (N/4, K/64, 160).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  c10::optional<at::Tensor> bias = present(b) ? c10::optional<at::Tensor>(b) : c10::nullopt;
  if (w.scalar_type() != at::kByte) return at::linear(x, w, bias);
  return w.size(2) == 136 ? fastdecode::q8_linear(x, w, bias) : fastdecode::q4_linear(x, w, bias);
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

// q (H, hd) against cache positions [start, end) of k, v (K, S, hd) -> out (H, hd). Heads run in parallel.
void attention(const float* q, const float* k, const float* v, int64_t H, int64_t K, int64_t S, int64_t hd,
               int64_t start, int64_t end, float scale, float* out) {
  const int64_t group = H / K, L = end - start;
  at::parallel_for(0, H, L * hd >= 16384 ? 1 : H, [&](int64_t h0, int64_t h1) {
    std::vector<float> p(L);
    for (int64_t h = h0; h < h1; ++h) {
      const float* qh = q + h * hd;
      const float* kh = k + (h / group) * S * hd;
      const float* vh = v + (h / group) * S * hd;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < L; ++j) {
        const float* kj = kh + (start + j) * hd;
        float s = 0.f;
#pragma omp simd reduction(+ : s)  // a float reduction only vectorizes when told it may reorder
        for (int64_t i = 0; i < hd; ++i) s += qh[i] * kj[i];
        p[j] = s * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < L; ++j) sum += (p[j] = std::exp(p[j] - mx));
      float* oh = out + h * hd;
      for (int64_t i = 0; i < hd; ++i) oh[i] = 0.f;
      for (int64_t j = 0; j < L; ++j) {
        const float pj = p[j] / sum;
        const float* vj = vh + (start + j) * hd;
        for (int64_t i = 0; i < hd; ++i) oh[i] += pj * vj[i];
      }
    }
  });
}

inline float gelu_tanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

}  // namespace

// x (1, D) float32 embedding of the token at `pos` -> (1, D) residual stream after the last layer (before the final
// norm). rope_* are (2, S, hd) cos/sin tables; windows[l] is layer l's sliding window (0: attends to everything).
at::Tensor decode_layers(at::Tensor x, const std::vector<at::Tensor>& weights, int64_t pos,
                         const at::Tensor& rope_global, const at::Tensor& rope_local,
                         const std::vector<int64_t>& windows, int64_t H, int64_t K, int64_t hd, double eps,
                         double attn_scale, bool sandwich, bool gelu) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1, "x must be (1, D) float32");
  TORCH_CHECK(weights.size() == windows.size() * SLOTS, "weights do not match the layer count");
  x = x.contiguous().clone();
  const int64_t D = x.size(1), L = windows.size(), qn = H * hd, kn = K * hd;
  float* X = x.data_ptr<float>();
  at::Tensor h = at::empty({1, D}, x.options()), attn = at::empty({1, qn}, x.options());
  float* Hs = h.data_ptr<float>();
  const float epsf = static_cast<float>(eps), scale = static_cast<float>(attn_scale);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * SLOTS;
    const int64_t S = w[K_CACHE].size(2), window = windows[l];
    TORCH_CHECK(pos < S, "position ", pos, " is past the cache of ", S);
    const at::Tensor& rope = window ? rope_local : rope_global;
    const float* cos = rope.data_ptr<float>() + pos * hd;
    const float* sin = cos + rope.size(1) * hd;

    rms_norm(X, w[IN_NORM].data_ptr<float>(), D, epsf, Hs);
    at::Tensor qkv = linear(h, w[QKV_W], w[QKV_B]);
    float* q = qkv.data_ptr<float>();
    float* k = q + qn;
    const float* v = k + kn;
    float* kc = w[K_CACHE].data_ptr<float>();
    float* vc = w[V_CACHE].data_ptr<float>();
    for (int64_t i = 0; i < H; ++i) {
      if (present(w[Q_NORM])) rms_norm(q + i * hd, w[Q_NORM].data_ptr<float>(), hd, epsf, q + i * hd);
      rotary(q + i * hd, cos, sin, hd);
    }
    for (int64_t g = 0; g < K; ++g) {
      if (present(w[K_NORM])) rms_norm(k + g * hd, w[K_NORM].data_ptr<float>(), hd, epsf, k + g * hd);
      rotary(k + g * hd, cos, sin, hd);
      std::copy(k + g * hd, k + (g + 1) * hd, kc + (g * S + pos) * hd);
      std::copy(v + g * hd, v + (g + 1) * hd, vc + (g * S + pos) * hd);
    }
    const int64_t start = window ? std::max<int64_t>(0, pos - window + 1) : 0;
    attention(q, kc, vc, H, K, S, hd, start, pos + 1, scale, attn.data_ptr<float>());
    at::Tensor o = linear(attn, w[O_W], w[O_B]);
    float* O = o.data_ptr<float>();
    if (sandwich) {
      rms_norm(O, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, O);
      for (int64_t i = 0; i < D; ++i) X[i] += O[i];
      rms_norm(X, w[PRE_FF_NORM].data_ptr<float>(), D, epsf, Hs);
    } else {
      for (int64_t i = 0; i < D; ++i) X[i] += O[i];
      rms_norm(X, w[POST_ATTN_NORM].data_ptr<float>(), D, epsf, Hs);
    }
    at::Tensor gu = linear(h, w[GU_W], w[GU_B]);
    const int64_t I = gu.size(1) / 2;
    float* G = gu.data_ptr<float>();
    for (int64_t i = 0; i < I; ++i) {
      const float a = G[i];
      G[i] = (gelu ? gelu_tanh(a) : a / (1.f + std::exp(-a))) * G[I + i];
    }
    at::Tensor d = linear(gu.narrow(1, 0, I), w[DOWN_W], w[DOWN_B]);
    float* Dn = d.data_ptr<float>();
    if (sandwich) rms_norm(Dn, w[POST_FF_NORM].data_ptr<float>(), D, epsf, Dn);
    for (int64_t i = 0; i < D; ++i) X[i] += Dn[i];
  }
  return x;
}
