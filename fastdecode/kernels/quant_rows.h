// Activation quantization and the u4 x int8 pair dot product shared by the int4 (quant.cpp) and K-quant
// (kquant.cpp) kernels: each activation row is quantized to int8 per block of 32 (d = amax / 127), so that weight
// times activation sums are exact integers and only the per-block scaling is float.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "simd.h"

namespace fastdecode {

// 32 floats -> their int8 values in element order (round to nearest even of x / d, d = amax / 127); d,
// sx = d * sum(q), the factor a weight block's min or offset multiplies, and sum(q) itself.
inline __m256i quantize_block(const float* x, float& d, float& sx, int32_t& qsum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  d = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0f;
  const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // round to nearest even
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  qsum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
  sx = d * hsum(_mm256_cvtepi32_ps(sum));
  // packs interleave 128-bit lanes; the permute restores element order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x (rows, K) float, K a multiple of 64 -> xq (rows, K) int8 quantized per block of 32, and per pair of blocks
// (b, b+1) 16 floats xs: (d_b x4, d_b+1 x4) to scale the pair's dot products, then (s_b, s_b+1) x4 with
// s = d * sum(q), the weight mins' factor. xq is stored in the order pair_dot reads it: per pair of blocks, elements
// 0..15 of b, of b+1, then elements 16..31 of b, of b+1 (the halves that a weight byte's two nibbles meet).
// xc (optional), per pair 8 int32: 128 sum(q_b) x4, 128 sum(q_b+1) x4, what int8 weights taken as q + 128 (the
// unsigned operand of vpdpbusd) add to the block sums (q8_linear's pair tiles).
inline void quantize_rows(const float* x, int64_t blocks, int8_t* xq, float* xs, int32_t* xc = nullptr) {
  for (int64_t i = 0; i < blocks; ++i, x += 32) {
    float d, sx;
    int32_t qsum;
    const __m256i p = quantize_block(x, d, sx, qsum);
    const int64_t pair = i / 2, half = i % 2;
    int8_t* out = xq + 64 * pair + 16 * half;
    _mm_storeu_si128((__m128i*)out, _mm256_castsi256_si128(p));
    _mm_storeu_si128((__m128i*)(out + 32), _mm256_extracti128_si256(p, 1));
    float* s = xs + 16 * pair;
    for (int j = 0; j < 4; ++j) {
      s[4 * half + j] = d;
      s[8 + 2 * j + half] = sx;
      if (xc) xc[8 * pair + 4 * half + j] = 128 * qsum;
    }
  }
}

// M rows (M, K) -> xq and xs as quantize_rows lays them out, rows spread over the threads, and xt (M / 4, K / 64, 8):
// per group of 4 rows and pair of blocks, the 4 rows' d_x of block b, then of b + 1, as block_sums lays out 4 rows'
// sums (for the kernels that take activation rows 4 at a time).
inline void quantize_rows_grouped(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, float* xt) {
  const int64_t pairs = K / 64;
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_rows(x + m * K, K / 32, xq + m * K, xs + m * pairs * 16);
  });
  for (int64_t g = 0; g < M / 4; ++g)
    for (int64_t p = 0; p < pairs; ++p)
      for (int i = 0; i < 4; ++i) {
        const float* s = xs + ((4 * g + i) * pairs + p) * 16;
        xt[(g * pairs + p) * 8 + i] = s[0];
        xt[(g * pairs + p) * 8 + 4 + i] = s[4];
      }
}

// The same values in element order: xq (rows, K) int8, xd (rows, K / 32) the blocks' d (no sums: the formats that
// read this layout have no per-block min).
inline void quantize_rows_plain(const float* x, int64_t blocks, int8_t* xq, float* xd) {
  for (int64_t i = 0; i < blocks; ++i, x += 32) {
    float sx;
    int32_t qsum;
    _mm256_storeu_si256((__m256i*)(xq + 32 * i), quantize_block(x, xd[i], sx, qsum));
  }
}

#ifdef __AVX512F__
// The activation rows as the chunked kernels (q4_rows_t, q8_rows_t) read them, for a number of rows that is even:
// - xk (rows, K): per row and pair of blocks, 4 chunk quads of 16 bytes, quad k the 4 values of each of: block b at
//   4k.., b+1 at 4k.., b at 16+4k.., b+1 at 16+4k.. (a 4 x 4 transpose of quantize_rows' dwords);
// - per pair of rows and pair of blocks, quads of 4 values, (block b, block b+1) of the first row, then of the second:
//   xd the blocks' d_x; xsx (if given) their s = d sum(q), the weight mins' factors; xcq (if given) 128 sum(q) as
//   int32, what unsigned weights (q + 128) add to the block sums.
inline void chunk_rows(const int8_t* xq, const float* xs, const int32_t* xc, int64_t rows, int64_t pairs, int8_t* xk,
                       float* xd, float* xsx, int32_t* xcq) {
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t i = 0; i < rows * pairs; ++i)
    _mm512_storeu_si512(xk + 64 * i, _mm512_permutexvar_epi32(order, _mm512_loadu_si512(xq + 64 * i)));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t i = m * pairs + p, o = ((m / 2) * pairs + p) * 4 + 2 * (m % 2);
      xd[o] = xs[16 * i], xd[o + 1] = xs[16 * i + 4];
      if (xsx) xsx[o] = xs[16 * i + 8], xsx[o + 1] = xs[16 * i + 9];
      if (xcq) xcq[o] = xc[8 * i], xcq[o + 1] = xc[8 * i + 4];
    }
}

// The lanes of a chunked kernel's float work, (weight row r, activation row h, block parity) = 4 r + 2 h + parity:
// one pair of blocks' 8 values of the tile in (row, parity) lanes put there; tile_halves: as 8 fp16 (d or the mins).
inline __m512 row_pair_lanes(__m256 v) {
  const __m512i by_lane = _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7);
  return _mm512_permutexvar_ps(by_lane, _mm512_castps256_ps512(v));
}
inline __m512 tile_halves(const uint8_t* h) {
  return row_pair_lanes(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h)));
}

// 4 weight rows' 128 bytes of nibbles for a pair of blocks (32 a row: byte j = q[j] | q[j + 16] << 4 of block b, then
// of b+1) -> the 4 registers of the chunked 4-bit kernels: quad k's 128-bit lane r holds row r's dwords k (block b)
// and 4 + k (b+1) twice, as low nibbles, then as high ones: the values an activation row's chunk quad k meets.
// With fifth bits (Q5_K: 32 bytes a row, bit `shift` of byte j for the low nibble of byte j, shift + 1 the high), the
// values gain their bit 4.
inline void nibble_quads(const uint8_t* q, __m512i c[4], const uint8_t* fifth = nullptr, int shift = 0) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4);
  const __m512i r01 = _mm512_loadu_si512(q), r23 = _mm512_loadu_si512(q + 64);
  for (int k = 0; k < 4; ++k) {
    // row r's dwords k and 4 + k, twice; rows 0, 1 from the first source, 2, 3 from the second (+16)
    const __m512i pick = _mm512_add_epi32(_mm512_setr_epi32(0, 4, 0, 4, 8, 12, 8, 12, 16, 20, 16, 20, 24, 28, 24, 28),
                                          _mm512_set1_epi32(k));
    c[k] = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutex2var_epi32(r01, pick, r23), shifts), low4);
    if (fifth) {
      const __m512i f = _mm512_permutex2var_epi32(_mm512_loadu_si512(fifth), pick, _mm512_loadu_si512(fifth + 64));
      const __m512i at = _mm512_add_epi32(_mm512_srli_epi32(shifts, 2), _mm512_set1_epi32(shift));  // shift, shift + 1
      const __m512i bits = _mm512_srlv_epi32(f, at);
      c[k] = _mm512_or_si512(c[k], _mm512_and_si512(_mm512_slli_epi32(bits, 4), bit4));
    }
  }
}

// Two activation rows (x0, x1: a pair of blocks' 4 chunk quads of each, chunk_rows' xk) against a tile's 4
// rearranged weight registers (128-bit lane r for weight row r, its lanes meeting a quad's (b, b+1, b, b+1)) -> the
// exact block sums in lanes (r, activation row, parity): each block's low and high chunks added.
inline __m512i chunk_pair_sums(const __m512i c[4], const int8_t* x0, const int8_t* x1) {
  __m512i s[2];
  for (int h = 0; h < 2; ++h) {
    const __m128i* x = reinterpret_cast<const __m128i*>(h ? x1 : x0);
    s[h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], _mm512_broadcast_i32x4(_mm_loadu_si128(x)));
    for (int k = 1; k < 4; ++k) s[h] = _mm512_dpbusd_epi32(s[h], c[k], _mm512_broadcast_i32x4(_mm_loadu_si128(x + k)));
  }
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s[0], s[1]), _mm512_unpackhi_epi64(s[0], s[1]));
}

// One chunked group's outputs: acc (and mins, if given) per pair of rows in the lanes above -> y, each output
// E + O (+ ME + MO), the order of the row-at-a-time kernels.
template <int R>
inline void store_row_pairs(const __m512* acc, const __m512* mins, int64_t N, int64_t t, float* y) {
  for (int j = 0; j < R / 2; ++j) {
    alignas(64) float a[16], mn[16];
    _mm512_store_ps(a, acc[j]);
    if (mins) _mm512_store_ps(mn, mins[j]);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < 4; ++r) {
        const int e = 4 * r + 2 * h;  // E, then O in the next lane
        y[(2 * j + h) * N + 4 * t + r] = mins ? a[e] + a[e + 1] + mn[e] + mn[e + 1] : a[e] + a[e + 1];
      }
  }
}
#endif

// Row r's (block b, block b+1) scales out of a pair's 8 (row, block) lanes: b's into lanes 0-3, b+1's into 4-7, as
// the pair's dot products come out of vpmaddwd.
inline __m256i row_scales(int r) {
  return _mm256_setr_epi32(2 * r, 2 * r, 2 * r, 2 * r, 2 * r + 1, 2 * r + 1, 2 * r + 1, 2 * r + 1);
}

// A pair of blocks' weights as two registers of unsigned values (lo: elements 0..15 of b, of b+1; hi: elements
// 16..31 of b, of b+1) times one activation row's 64 int8 as quantize_rows lays them out -> the 8 int32 partial dot
// products: lanes 0-3 block b, 4-7 block b+1. Values up to 5 bits: u5 * i8 pair sums (<= 2 * 31 * 127) of both
// halves still fit int16, so they add before widening.
// With VNNI each vpdpbusd sums four products straight into int32: the same exact integers in two instructions.
inline __m256i pair_dot(__m256i lo, __m256i hi, const int8_t* x) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i*)x), x1 = _mm256_loadu_si256((const __m256i*)(x + 32));
#ifdef __AVX512VNNI__
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0), hi, x1);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                           _mm256_set1_epi16(1));
#endif
}

// One weight row's 64 int8 q of a pair tile (Q8_0) times x, in pair_dot's lanes, exact. With VNNI vpdpbusd takes the
// weights unsigned, as q + 128: the lanes hold sum (q + 128) x, and the caller takes 128 sum(x) off each block (xc).
// Without it, |q| times x with q's sign, as llama.cpp's AVX2 dot products do (pair sums up to 2 * 128 * 127 fit
// vpmaddubsw's int16): sum q x directly, with half the instructions of splitting unsigned bytes into nibbles.
#ifdef __AVX512VNNI__
constexpr bool Q8_DOT_OFFSET = true;
#else
constexpr bool Q8_DOT_OFFSET = false;
#endif
inline __m256i q8_row_dot(const uint8_t* q, const int8_t* x) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i*)x), x1 = _mm256_loadu_si256((const __m256i*)(x + 32));
  const __m256i q0 = _mm256_loadu_si256((const __m256i*)q), q1 = _mm256_loadu_si256((const __m256i*)(q + 32));
#ifdef __AVX512VNNI__
  const __m256i offset = _mm256_set1_epi8(-128);  // q ^ 0x80 = q + 128
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(q0, offset), x0),
                             _mm256_xor_si256(q1, offset), x1);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q0), _mm256_sign_epi8(x0, q0)), ones),
      _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q1), _mm256_sign_epi8(x1, q1)), ones));
#endif
}

// Sums of four products (u - 32) * x, u in 0..63, into int32 lanes (Q6_K's offset values); exact either way
// (maddubs(u, x) - maddubs(32, x) stays within +-24130 in int16).
inline __m256i offset32_dot(__m256i u, __m256i x) {
  const __m256i offset = _mm256_set1_epi8(32);
#ifdef __AVX512VNNI__
  return _mm256_sub_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x),
                          _mm256_dpbusd_epi32(_mm256_setzero_si256(), offset, x));
#else
  return _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(u, x), _mm256_maddubs_epi16(offset, x)),
                           _mm256_set1_epi16(1));
#endif
}

// A pass's accumulators, lanes (parity, weight row) as block_sums gives them, and (mins, if given) the mins' chains
// in (weight row, parity) lanes -> y[m][4 t + r] = (E + O) (+ ME + MO).
template <int MR>
inline void store_pass(const __m256* acc, const __m256* mins, int64_t N, int64_t t, float* y) {
  for (int m = 0; m < MR; ++m) {
    alignas(32) float a[8], mn[8];
    _mm256_store_ps(a, acc[m]);
    if (mins) _mm256_store_ps(mn, mins[m]);
    for (int r = 0; r < 4; ++r)
      y[m * N + 4 * t + r] = mins ? a[r] + a[r + 4] + mn[2 * r] + mn[2 * r + 1] : a[r] + a[r + 4];
  }
}

// The per-block sums of four pair_dot results (8 int32 lanes each: 4 partial sums of block b, 4 of block b + 1):
// lanes [s0 b, s1 b, s2 b, s3 b | s0 b+1, s1 b+1, s2 b+1, s3 b+1].
inline __m256i block_sums(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
}

// One weight row's 32 bytes of a pair of 4-bit blocks (byte j of a block: q[j] | q[j + 16] << 4) times x.
inline __m256i pair_dot(const uint8_t* wq, const int8_t* x) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i q = _mm256_loadu_si256((const __m256i*)wq);
  return pair_dot(_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_srli_epi16(q, 4), low4), x);
}

// The pair-tile formats' matmul (Q8_0's 272-byte tiles, MXFP4's 136): the rows of X (M, K) quantized by
// quantize_rows (with xc), then tiles [t_first, N/4) of 4 output rows, spread over the threads, each taking all the
// rows in passes of up to PASS_ROWS (AVX2's 16 registers: 2): pass(n, w, xq, xs, xc, t, y) for n rows from the
// pointers given. A pass of one or two rows streams its tile itself (prefetch_stream); for more the next tile is
// fetched whole. An AVX-512 build given `group` hands it groups of 8 and 4 rows first, chunked (chunk_rows):
// group(n, w, xk, xd, xcq, t, y). Then the bias.
constexpr int PASS_ROWS = VW == 16 ? 4 : 2;
template <typename Pass, typename Group = std::nullptr_t>
void pair_tiles_linear(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t t_first,
                       int64_t N, const float* B, float* Y, Pass pass, Group group = nullptr) {
  const int64_t pairs = K / 64;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * pairs * 16);
  std::vector<int32_t> xc(M * pairs * 8);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_rows(X + m * K, K / 32, xq.data() + m * K, xs.data() + m * pairs * 16, xc.data() + m * pairs * 8);
  });
  constexpr bool grouping = !std::is_same_v<Group, std::nullptr_t> && VW == 16;
  const int64_t grouped = grouping ? M / 4 * 4 : 0;
  std::vector<int8_t> xk(grouped * K);
  std::vector<float> xd(grouped * pairs * 2);
  std::vector<int32_t> xcq(grouped * pairs * 2);
#ifdef __AVX512F__
  if (grouped)
    chunk_rows(xq.data(), xs.data(), xc.data(), grouped, pairs, xk.data(), xd.data(), nullptr, xcq.data());
#endif
  // Tiny matrices (under ~64 KB of weights a thread) stay on one thread: forking would cost more than it saves.
  at::parallel_for(t_first, N / 4, std::max<int64_t>(1, (64 << 10) / tile_bytes), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* w = W + t * tile_bytes;
      if (M > PASS_ROWS && !grouped && t + 1 < t1) prefetch(w + tile_bytes, tile_bytes);
      int64_t m = 0;
      if constexpr (grouping) {
        const auto run = [&](auto rows) {
          group(rows, w, xk.data() + m * K, xd.data() + m * pairs * 2, xcq.data() + m * pairs * 2, t, Y + m * N);
          m += decltype(rows)::value;
        };
        while (M - m >= 8) run(std::integral_constant<int, 8>{});
        if (M - m >= 4) run(std::integral_constant<int, 4>{});
      }
      const auto run = [&](auto rows) {
        pass(rows, w, xq.data() + m * K, xs.data() + m * pairs * 16, xc.data() + m * pairs * 8, t, Y + m * N);
        m += decltype(rows)::value;
      };
      while (M - m >= PASS_ROWS) run(std::integral_constant<int, PASS_ROWS>{});
      if (M - m == 3) run(std::integral_constant<int, 3>{});
      if (M - m == 2) run(std::integral_constant<int, 2>{});
      if (M - m == 1) run(std::integral_constant<int, 1>{});
      if (B)
        for (int64_t i = 0; i < M; ++i)
          for (int r = 0; r < 4; ++r) Y[i * N + 4 * t + r] += B[4 * t + r];
    }
  });
}

// The kernels after amx_linear: tiles [t_first, N/4) of 4 output rows (tile_bytes each from W) against the rows of
// X (M, K) -> Y (M, N), plus the bias B (null: none).
using TilesKernel = void (*)(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes,
                             int64_t t_first, int64_t N, const float* B, float* Y);

// y (..., N) = x @ W.T + bias for x (..., K), w (N/4, _, _) uint8 the format's packed tiles of 4 weight rows and bias
// float32 (N) or none: amx_linear takes the blocks of 32 output rows it can in format f (none without one), `kernel`
// the rest (quant.cpp).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t K,
                         std::optional<AmxFormat> f, TilesKernel kernel);

// The pair-tile formats' packing (int4, Q8_0, MXFP4): `out` (N/4, blocks/2, tile_bytes) checked, then per tile of 4
// weight rows and pair of blocks, put(o, r, b, row, block) for each of its rows r and the pair's blocks b, o the
// pair's bytes in out, (row, block) the source's. The bytes move, no value changes.
template <typename Put>
void pack_pairs(const at::Tensor& out, int64_t N, int64_t blocks, int64_t tile_bytes, const char* name, Put put) {
  TORCH_CHECK(N % 4 == 0 && blocks % 2 == 0 && out.is_contiguous() && out.scalar_type() == at::kByte &&
              out.dim() == 3 && out.size(0) == N / 4 && out.size(1) == blocks / 2 && out.size(2) == tile_bytes,
              name, ": bad output");
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t pairs = blocks / 2;
  at::parallel_for(0, N / 4 * pairs, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / pairs, p = i % pairs;
      for (int r = 0; r < 4; ++r)
        for (int b = 0; b < 2; ++b) put(dst + i * tile_bytes, r, b, 4 * t + r, 2 * p + b);
    }
  });
}

}  // namespace fastdecode
