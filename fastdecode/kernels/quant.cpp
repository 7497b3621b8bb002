// Quantized matmuls for x86 with AVX2 (+FMA, F16C). q8_linear is weight-only: float activations times int8
// weights dequantized in registers. q4_linear works as llama.cpp's Q4_1 dot product: each activation row is
// quantized to int8 in blocks of 32 (scale d = amax / 127), and the u4 x int8 products are summed with
// vpmaddubsw / vpmaddwd, then scaled per block in float.
//
// Weights are stored tile-major, in the order the kernel reads them, so that each thread reads one sequential
// stream (the hardware prefetcher's best case):
// q8_linear: W 8-bit in blocks of 32 along K, packed as (N/4, K/32, 144) bytes: for each tile of 4 rows and block,
//   the 4 rows' fp16 scales d, their fp16 offsets m, then each row's 32 values q in 0..255, w = d * q + m; or, where
//   every block is symmetric (Q8_0: m = -128 d), without the offsets as (N/4, K/32, 136) bytes of int8 q, w = d * q.
// q4_linear: W 4-bit in blocks of 32 along K, w = d * q + m with q in 0..15 (asymmetric, like Q4_1), packed as
//   (N/4, K/64, 160) bytes: for each tile of 4 rows and pair of blocks, 8 fp16 scales d and 8 fp16 mins m in
//   (row, block) order, then each row's 32 bytes; byte j of a block holds q[j] | q[j + 16] << 4.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t QK = 32;

using fastdecode::hsum;

// x (rows, K) float -> xq (rows, K) int8 and, per block of 32, ds = (d, d * sum(q)) as float pairs.
void quantize_rows(const float* x, int64_t blocks, int8_t* xq, float* ds) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < blocks; ++i, x += QK, xq += QK) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float d = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0f;
    const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // round to nearest even
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    // packs interleave 128-bit lanes; the permute restores element order.
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)xq, _mm256_permutevar8x32_epi32(p, perm));
    ds[2 * i] = d;
    ds[2 * i + 1] = d * hsum(_mm256_cvtepi32_ps(sum));
  }
}

// A tile of 4 rows of 4-bit weights against one quantized activation row, two blocks per step -> the 4 dot products.
inline void q4_tile(const uint8_t* w, int64_t K, const int8_t* xq, const float* ds, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // Picks row r's (block b, block b+1) scales out of the 8 (row, block) lanes: b's into lanes 0-3, b+1's into 4-7.
  const __m256i bcast[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                            _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; b += 2, w += 160) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));          // weight scales, (row, block)
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16)));  // weight mins, (row, block)
    const __m256i x0 = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
    const __m256i x1 = _mm256_loadu_si256((const __m256i*)(xq + b * QK + QK));
    const __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20);  // elements 0..15 of block b | of block b+1
    const __m256i xhi = _mm256_permute2x128_si256(x0, x1, 0x31);  // elements 16..31 of each
    // ds holds (d_x, s_x) per block with s_x = d_x * sum(q_x); spread as (b, b+1) pairs to match (row, block).
    const __m128 v = _mm_loadu_ps(ds + 2 * b);
    const __m128 d2 = _mm_shuffle_ps(v, v, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 s2 = _mm_shuffle_ps(v, v, _MM_SHUFFLE(3, 1, 3, 1));
    const __m256 scale = _mm256_mul_ps(d, _mm256_set_m128(d2, d2));
    acc_min = _mm256_fmadd_ps(mins, _mm256_set_m128(s2, s2), acc_min);
    for (int r = 0; r < 4; ++r) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(w + 32 + 32 * r));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      // u4 * i8 pair sums stay far inside int16, so both halves add before widening.
      const __m256i p = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(scale, bcast[r]), acc[r]);
    }
  }
  alignas(32) float mn[8];
  _mm256_store_ps(mn, acc_min);
  for (int r = 0; r < 4; ++r) out[r] = hsum(acc[r]) + mn[2 * r] + mn[2 * r + 1];
}

// Quantizes the rows of x (..., K), then runs tile(t, xq, ds, sums) for every tile t of 4 output rows and every
// activation row, on all threads, and returns y (..., N) = sums + bias. (Two activation rows per tile call, sharing
// each weight load, measured no faster at M = 4..16 on Zen 3.)
template <typename Tile>
at::Tensor run(const at::Tensor& x, int64_t N, int64_t K, int64_t tile_bytes, const c10::optional<at::Tensor>& bias,
               const Tile& tile) {
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const at::Tensor x2d = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x2d.size(0);
  const at::Tensor xq = at::empty({M, K}, x2d.options().dtype(at::kChar));
  const at::Tensor ds = at::empty({M, K / QK, 2}, x2d.options());
  quantize_rows(x2d.data_ptr<float>(), M * K / QK, xq.data_ptr<int8_t>(), ds.data_ptr<float>());
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x2d.options());
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* DS = ds.data_ptr<float>();
  const bool has_bias = bias && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "bias must be float32 of out_features");
  const float* B = has_bias ? bias->data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  // Tiny matrices (under ~64 KB of weights a thread) stay on one thread: forking would cost more than it saves.
  at::parallel_for(0, N / 4, std::max<int64_t>(1, (64 << 10) / tile_bytes), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m = 0; m < M; ++m) {
        float sums[4];
        tile(t, XQ + m * K, DS + m * K / QK * 2, sums);
        for (int r = 0; r < 4; ++r) Y[m * N + 4 * t + r] = sums[r] + (B ? B[4 * t + r] : 0.0f);
      }
    }
  });
  return y;
}

// MR activation rows (float) against one tile of 4 8-bit weight rows -> y[m][4 t + r]. Each block's weights are
// dequantized to float once (one FMA: q * d is exact in float, 8 + 11 significant bits) and serve every row; each
// output is one FMA chain over K, whatever MR, so a row's result does not depend on how many rows share the call.
template <int MR, bool OFFSET>
void q8f_rows(const uint8_t* w, int64_t K, const float* x, int64_t N, int64_t t, float* y) {
  constexpr int64_t head = OFFSET ? 16 : 8;  // scales (and offsets) before the values
  __m256 acc[4][MR];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b, w += head + 4 * QK) {
    alignas(16) float d[4], mn[4];
    _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)w)));
    if (OFFSET) _mm_store_ps(mn, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(w + 8))));
    for (int c = 0; c < QK; c += 8) {
      __m256 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + b * QK + c);
      for (int r = 0; r < 4; ++r) {
        const __m128i raw = _mm_loadl_epi64((const __m128i*)(w + head + r * QK + c));
        __m256 wf;
        if (OFFSET)
          wf = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), _mm256_set1_ps(d[r]), _mm256_set1_ps(mn[r]));
        else
          wf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), _mm256_set1_ps(d[r]));
        for (int m = 0; m < MR; ++m) acc[r][m] = _mm256_fmadd_ps(wf, xv[m], acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 4; ++r) y[m * N + 4 * t + r] = hsum(acc[r][m]);
}

template <bool OFFSET>
void q8f_tile(const uint8_t* wt, int64_t K, const float* X, int64_t M, int64_t N, int64_t t, float* Y) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) q8f_rows<3, OFFSET>(wt, K, X + m * K, N, t, Y + m * N);
  if (M - m == 2) q8f_rows<2, OFFSET>(wt, K, X + m * K, N, t, Y + m * N);
  if (M - m == 1) q8f_rows<1, OFFSET>(wt, K, X + m * K, N, t, Y + m * N);
}

}  // namespace

namespace fastdecode {

// w (N/4, K/32, 144 or 136) uint8. Weight-only: the activations stay float (int8 activations cost about 2% top-1
// agreement with the float model, see docs/quantization.md), which costs little where weights dominate the time.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t N = w.size(0) * 4, K = w.size(1) * QK;
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && (w.size(2) == 144 || w.size(2) == 136),
              "bad q8 weight");
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const bool has_bias = bias && bias->defined();
  TORCH_CHECK(!has_bias || (bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous()),
              "bias must be float32 of out_features");
  const at::Tensor x2d = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = x2d.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x2d.options());
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* X = x2d.data_ptr<float>();
  const int64_t tile_bytes = w.size(2);
  const bool offset = tile_bytes == 144;
  const float* B = has_bias ? bias->data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N / 4, std::max<int64_t>(1, (64 << 10) / (4 * K)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = W + t * K / QK * tile_bytes;
      if (offset) q8f_tile<true>(wt, K, X, M, N, t, Y);
      else q8f_tile<false>(wt, K, X, M, N, t, Y);
      if (B)
        for (int64_t i = 0; i < M; ++i)
          for (int r = 0; r < 4; ++r) Y[i * N + 4 * t + r] += B[4 * t + r];
    }
  });
  return y;
}

// w (N/4, K/64, 160) uint8.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t N = w.size(0) * 4, K = w.size(1) * 2 * QK;
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.size(2) == 160, "bad q4 weight");
  const uint8_t* W = w.data_ptr<uint8_t>();
  return run(x, N, K, 4 * K * 5 / 8, bias, [&](int64_t t, const int8_t* xq, const float* ds, float* sums) {
    q4_tile(W + t * K / 64 * 160, K, xq, ds, sums);
  });
}

}  // namespace fastdecode
