// Small SIMD helpers shared by the kernels.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace fastdecode {

// The sum of 8 floats, always in the same order (results must not depend on where a value sits in a batch).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The fp16 at p (unaligned, as packed tiles hold their scales) as a float.
inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Asks for the cache lines of [p, p + bytes) ahead of use. The hardware prefetcher follows a stream only within a
// 4 KB page, and a KV block or a weight tile often starts a new page: without this each one starts with a miss.
template <int HINT = _MM_HINT_T0>
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, static_cast<_mm_hint>(HINT));
}

// A weight tile read by one pass (one or two activation rows) is streamed once, and the core would wait on each
// cache line: every step of such a pass asks for the `bytes` it will read STREAM_AHEAD later, so that memory works
// while it computes. Whole-tile prefetches (above) suit the passes that read a tile several times; here they come in
// bursts the line-fill buffers cannot take. On Sapphire Rapids (2 threads, huge pages) Q4_0 at one row went from
// 21 to 28 GB/s for an 8B model's matrices (30 probed) with 1 KB into L1. Into L2 (whose queue holds more lines in
// flight than L1's fill buffers) and 3 KB ahead did better where memory answered slowly: an 8B model's Q4_K gate/up
// matrices 23.4 against 21.3 GB/s, its Q8_0 ones 26.4 against 22.7, SmolLM2-135M's decode step 147 against 125
// tok/s, Q4_0 the same (alternating runs of one build; 2 KB was between).
// Q6_K's pass, which does more work per byte, streamed 7-13% slower that way (bench/stream.py): it keeps 1 KB into L1.
constexpr int64_t STREAM_AHEAD = 3072, STREAM_AHEAD_L1 = 1024;
inline void prefetch_stream(const uint8_t* p, int64_t bytes) { prefetch<_MM_HINT_T1>(p + STREAM_AHEAD, bytes); }
inline void prefetch_stream_l1(const uint8_t* p, int64_t bytes) { prefetch(p + STREAM_AHEAD_L1, bytes); }

// vecf: the widest float vector of the build, VW lanes (16 where the build has AVX-512, else 8), for the loops whose
// cost is FMAs (float matmuls, attention). A build sums in its own lane order, the same for every row and batch.
#ifdef __AVX512F__
constexpr int VW = 16;
using vecf = __m512;
inline vecf vzero() { return _mm512_setzero_ps(); }
inline vecf vset1(float x) { return _mm512_set1_ps(x); }
inline vecf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vecf v) { _mm512_storeu_ps(p, v); }
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
inline vecf vmul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
inline vecf vadd(vecf a, vecf b) { return _mm512_add_ps(a, b); }
inline vecf vfnma(vecf a, vecf b, vecf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
// Lanes i and i + 8 added: the 8 lanes the AVX2 reductions take.
inline __m256 halve(vecf v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
inline float hsum(__m512 v) { return hsum(halve(v)); }
#else
constexpr int VW = 8;
using vecf = __m256;
inline vecf vzero() { return _mm256_setzero_ps(); }
inline vecf vset1(float x) { return _mm256_set1_ps(x); }
inline vecf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vecf v) { _mm256_storeu_ps(p, v); }
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
inline vecf vmul(vecf a, vecf b) { return _mm256_mul_ps(a, b); }
inline vecf vadd(vecf a, vecf b) { return _mm256_add_ps(a, b); }
inline vecf vfnma(vecf a, vecf b, vecf c) { return _mm256_fnmadd_ps(a, b, c); }
inline __m256 halve(vecf v) { return v; }
#endif

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

#ifdef __AVX512F__
// exp_in_range on 16 lanes: the same operations, so each lane's result is the same bits.
inline __m512 exp_in_range(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

}  // namespace fastdecode
