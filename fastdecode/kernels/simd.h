// Small AVX2 helpers shared by the kernels.
#pragma once
#include <immintrin.h>

namespace fastdecode {

// The sum of 8 floats, always in the same order (results must not depend on where a value sits in a batch).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace fastdecode
