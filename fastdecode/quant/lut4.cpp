// lut4_linear: y = x @ W^T (+ bias) for 4-bit codes whose value is a per-block table lookup, for a few rows of x
// (decode). W never exists in float. Per block, the 16 possible weights sit in two AVX2 registers:
//   FP4 (MXFP4, NVFP4): values[c] = E2M1(c) (codes 8..15 negative), times the block's scale, read through a
//     256-entry table from its scale byte (E8M0, or E4M3 times the tensor scale);
//   int4 (Q4_1 layout, any group size): values[c] = c, times the fp16 scale, plus the fp16 min.
// `vpermps` looks 8 weights up at once in each half-table (it reads a code's low 3 bits) and `vblendvps` picks the
// half by bit 3, moved to the sign bit. A byte holds elements 2i (low nibble) and 2i+1 (high nibble), so 4 bytes
// broadcast and shifted by 0, 4, ..., 28 in the 8 lanes give 8 consecutive codes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t kMaxRows = 16;  // rows of x per call; for more, dequantize + GEMM is the better plan

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x (M, K) float32; codes (N, K/2) uint8; values (16,) float32; per block either scale_bytes (N, K/block) uint8 with
// scale_table (256,) float32, or scales and mins (N, K/block) fp16 (mins may be empty: zero).
at::Tensor lut4_linear(const at::Tensor& x, const at::Tensor& codes, int64_t block, const at::Tensor& values,
                       const at::Tensor& scale_bytes, const at::Tensor& scale_table, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be (M, K) float32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / block;
  TORCH_CHECK(M <= kMaxRows && codes.size(1) * 2 == K && block % 8 == 0 && K % block == 0, "bad lut4 shapes");
  const bool by_byte = scale_bytes.numel() > 0;
  TORCH_CHECK(by_byte ? (scale_bytes.is_contiguous() && scale_bytes.numel() == N * nb && scale_table.numel() == 256)
                      : (scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * nb &&
                         (mins.numel() == 0 || (mins.is_contiguous() && mins.numel() == N * nb))),
              "bad lut4 scales");
  auto y = at::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const uint8_t* C = codes.data_ptr<uint8_t>();
  const uint8_t* SB = by_byte ? scale_bytes.data_ptr<uint8_t>() : nullptr;
  const float* ST = by_byte ? scale_table.data_ptr<float>() : nullptr;
  const uint16_t* SH = by_byte ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* MH =
      (by_byte || mins.numel() == 0) ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* B = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* Y = y.data_ptr<float>();
  const __m256 lo = _mm256_loadu_ps(values.data_ptr<float>()), hi = _mm256_loadu_ps(values.data_ptr<float>() + 8);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibble = _mm256_set1_epi32(0xF);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    __m256 acc[kMaxRows];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = C + n * K / 2;
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = n * nb + b;
        const __m256 s = _mm256_set1_ps(by_byte ? ST[SB[i]] : _cvtsh_ss(SH[i]));
        const __m256 off = _mm256_set1_ps(MH ? _cvtsh_ss(MH[i]) : 0.0f);
        const __m256 lut_lo = _mm256_fmadd_ps(lo, s, off), lut_hi = _mm256_fmadd_ps(hi, s, off);
        for (int64_t k = b * block; k < (b + 1) * block; k += 8) {
          uint32_t packed;
          std::memcpy(&packed, row + k / 2, 4);
          const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(packed), shifts), nibble);
          const __m256 w = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut_lo, c), _mm256_permutevar8x32_ps(lut_hi, c),
                                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
          for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(X + m * K + k), acc[m]);
        }
      }
      for (int64_t m = 0; m < M; ++m) Y[m * N + n] = hsum(acc[m]) + (B ? B[n] : 0.0f);
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut4_linear", &lut4_linear, "4-bit codes through a per-block lookup table, times a few rows of x (AVX2)");
  m.attr("max_rows") = kMaxRows;
}
