// Quantized matmuls for x86 with AVX2 (+FMA, F16C); the AVX-512 build (jit.py) sums int8 products with VNNI's vpdpbusd
// (the same integers) and runs the float FMAs on 16-float vectors (its own summation order). Two ways of computing:
// - Weight-only (q8_linear's 144-byte tiles: --quant int8): float activations times 8-bit weights dequantized in
//   registers, for the encodings whose values int8 activations would round a second time for little gain.
// - Integer (int4, and q8_linear's pair tiles: a GGUF's Q8_0 and Q5_0 tensors), as llama.cpp's dot products: each
//   activation row is quantized to int8 in blocks of 32 (scale d = amax / 127), the weight x activation products are
//   summed exactly per block (vpmaddubsw / vpmaddwd, or vpdpbusd), then scaled per block in float.
// Several activation rows (a verify step, a prefill) share each weight tile: int4 unpacks a weight row's nibbles once
// for up to 8 rows, the weight-only kernel dequantizes a tile once for 6 rows or more. Either way each output is the
// same arithmetic whatever the number of rows, so a verify step reproduces the decode steps it replaces bit for bit.
//
// Weights are stored tile-major, in the order the kernel reads them, so that each thread reads one sequential
// stream (the hardware prefetcher's best case):
// q8_linear, weight-only: W 8-bit in blocks of 32 along K, packed as (N/4, K/32, 144) bytes: for each tile of 4 rows
//   and block, the 4 rows' fp16 scales d, their fp16 offsets m, then each row's 32 values q in 0..255, w = d * q + m.
// q8_linear, integer: a symmetric W (w = d * q, q int8: Q8_0) with K a multiple of 64, packed as (N/4, K/64, 272)
//   bytes: for each tile of 4 rows and pair of blocks, 8 fp16 scales d in (row, block) order, then each row's 64
//   int8 q: elements 0..15 of block b, of b+1, then 16..31 of b, of b+1 (the activations' layout).
// q4_linear: W 4-bit in blocks of 32 along K, w = d * q + m with q in 0..15 (asymmetric, like Q4_1), packed as
//   (N/4, K/64, 160) bytes: for each tile of 4 rows and pair of blocks, 8 fp16 scales d and 8 fp16 mins m in
//   (row, block) order, then each row's 32 bytes; byte j of a block holds q[j] | q[j + 16] << 4.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "quant_rows.h"
#include "simd.h"

namespace {

constexpr int64_t QK = 32;
constexpr int64_t Q8F_BLOCK = 16 + 4 * QK;  // a weight-only tile's bytes per block: d and m of 4 rows, their values
constexpr int64_t Q8_PAIR = 16 + 8 * QK;   // a pair tile's bytes per pair of blocks: 8 d, 4 rows x 64 values

using fastdecode::hsum;
using fastdecode::block_sums;
using fastdecode::Q8_DOT_OFFSET;
using fastdecode::q8_row_dot;
using fastdecode::pair_dot;
using fastdecode::prefetch;
using fastdecode::prefetch_stream;
using fastdecode::quantize_rows_grouped;
using fastdecode::row_scales;
using fastdecode::store_pass;
using fastdecode::vecf;
using fastdecode::vfma;
using fastdecode::vload;
using fastdecode::vset1;
using fastdecode::vstore;
using fastdecode::VW;
using fastdecode::vzero;
#ifdef __AVX512F__
using fastdecode::nibble_quads;
using fastdecode::chunk_pair_sums;
using fastdecode::store_row_pairs;
using fastdecode::tile_halves;
#endif

// The int4 arithmetic, for every output (activation row m, weight row n), whatever kernel computes it (the AVX2/VNNI
// ones below or the AMX tiles of amx.cpp, which reproduce it bit for bit): each block b of 32 gives an exact integer
// sum s_b; E = the FMA chain over the even blocks, in order, of float(s_b) * (d_w * d_x), O the same over the odd
// blocks; ME and MO the chains of m_w * sx over the even and odd blocks (the weight mins' share); y = ((E + O) + ME)
// + MO. Exact per-block integers are what let tiles of any shape (AMX's 16 x 16) compute the same result.

// The weight mins' share for MR rows against tile t, added to y: ME and MO of each (row, weight row) in one register
// of (weight row, parity) lanes, as the tile stores the mins.
template <int MR>
void q4_mins(const uint8_t* w, int64_t K, const float* xs, int64_t N, int64_t t, float* y) {
  const int64_t pairs = K / 64;
  for (int m = 0; m < MR; ++m) {
    __m256 acc = _mm256_setzero_ps();
    const uint8_t* wp = w;
    for (int64_t p = 0; p < pairs; ++p, wp += 160)
      acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wp + 16))),
                            _mm256_loadu_ps(xs + (m * pairs + p) * 16 + 8), acc);
    alignas(32) float mn[8];
    _mm256_store_ps(mn, acc);
    for (int r = 0; r < 4; ++r) y[m * N + 4 * t + r] = y[m * N + 4 * t + r] + mn[2 * r] + mn[2 * r + 1];
  }
}

// 4 G activation rows against one tile of 4 weight rows, one weight row at a time: its nibbles are unpacked once per
// pair of blocks for all the rows, whose accumulators (lanes (row, parity)) are all that stays in registers.
// xt: the rows' d_x in groups of 4, per pair (d_x b of the 4 rows, d_x b+1 of the 4 rows), as the block sums lie.
template <int G>
void q4_rows(const uint8_t* w, int64_t K, const int8_t* xq, const float* xs, const float* xt, int64_t N, int64_t t,
             float* y) {
  const int64_t pairs = K / 64;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    const __m256i bcast = row_scales(r);
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    const uint8_t* wp = w;
    for (int64_t p = 0; p < pairs; ++p, wp += 160) {
      const __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)wp)), bcast);
      const __m256i q = _mm256_loadu_si256((const __m256i*)(wp + 32 + 32 * r));
      const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      for (int g = 0; g < G; ++g) {
        const int8_t* x = xq + 4 * g * K + 64 * p;
        const __m256i s = block_sums(pair_dot(lo, hi, x), pair_dot(lo, hi, x + K), pair_dot(lo, hi, x + 2 * K),
                                     pair_dot(lo, hi, x + 3 * K));
        const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(xt + (g * pairs + p) * 8));
        acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(32) float a[8];
      _mm256_store_ps(a, acc[g]);
      for (int i = 0; i < 4; ++i) y[(4 * g + i) * N + 4 * t + r] = a[i] + a[i + 4];
    }
  }
  q4_mins<4 * G>(w, K, xs, N, t, y);
}

// Up to 4 activation rows (AVX2: 2) against a tile of 4 weight rows, all 4 in one pass over K: for so few rows the 4
// passes of q4_rows cost more than they share. Accumulator lanes (weight row, parity).
template <int MR>
void q4_pass(const uint8_t* w, int64_t K, const int8_t* xq, const float* xs, int64_t N, int64_t t, float* y) {
  const int64_t pairs = K / 64;
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (row, parity) -> (parity, row) lanes
  __m256 acc[MR], acc_min[MR];
  for (int m = 0; m < MR; ++m) acc[m] = acc_min[m] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += 160) {
    prefetch_stream(w, 160);
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)), by_block);
    const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16)));
    for (int m = 0; m < MR; ++m) {
      const float* s = xs + (m * pairs + p) * 16;  // (d_x b x4, d_x b+1 x4), then the sums' factors
      const int8_t* x = xq + m * K + 64 * p;
      acc_min[m] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(s + 8), acc_min[m]);
      const __m256i sums = block_sums(pair_dot(w + 32, x), pair_dot(w + 64, x), pair_dot(w + 96, x),
                                      pair_dot(w + 128, x));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_loadu_ps(s)), acc[m]);
    }
  }
  store_pass<MR>(acc, acc_min, N, t, y);
}

#ifdef __AVX512F__
// R activation rows (chunk_rows' layout; q4_tile takes 8) against a tile of 4 weight rows without horizontal sums.
// Per pair of blocks the tile's 32 weight dwords are rearranged once (nibble_quads) into 4 registers whose 128-bit
// lane r is weight row r: (dword k of block b, dword k of b+1) twice, the second copy shifted to its high nibbles,
// so that lanes (b, b+1, b, b+1) meet an activation row's chunk quad k. Four vpdpbusd leave the exact block sums of
// all 4 weight rows in two lanes each; pairs of activation rows then share the rest (chunk_pair_sums), the float work
// running on tile_halves' lanes. q4_rows spends 3 hadds per weight row and 4 activation rows instead. The integers,
// scales and FMA chains are q4_rows' and q4_mins': the same outputs, bit for bit. 8 rows: 6.8 cycles a row and pair
// of blocks against 11.3 for q4_rows<2> (Sapphire Rapids, tiles in L2); SmolLM2's matmuls for a token at 8 rows
// 8.8 ms against 11.2 (bench/matmuls.py, 30 copies of each).
template <int R>
void q4_rows_t(const uint8_t* w, int64_t K, const int8_t* xk, const float* xd, const float* xsx, int64_t N, int64_t t,
               float* y) {
  const int64_t pairs = K / 64;
  __m512 acc[R / 2], acc_min[R / 2];
  for (int j = 0; j < R / 2; ++j) acc[j] = acc_min[j] = _mm512_setzero_ps();
#pragma GCC unroll 1
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* wp = w + 160 * p;
    prefetch_stream(wp, 160);
    const __m512 d = tile_halves(wp), mins = tile_halves(wp + 16);
    __m512i c[4];
    nibble_quads(wp + 32, c);
#pragma GCC unroll 4
    for (int j = 0; j < R / 2; ++j) {
      const __m512i sums = chunk_pair_sums(c, xk + 64 * (2 * j * pairs + p), xk + 64 * ((2 * j + 1) * pairs + p));
      const int64_t q = 4 * (j * pairs + p);
      const __m512 scale = _mm512_mul_ps(d, _mm512_broadcast_f32x4(_mm_loadu_ps(xd + q)));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[j]);
      acc_min[j] = _mm512_fmadd_ps(mins, _mm512_broadcast_f32x4(_mm_loadu_ps(xsx + q)), acc_min[j]);
    }
  }
  store_row_pairs<R>(acc, acc_min, N, t, y);
}
#endif

// The activation rows as q4_tile reads them: xq and xs (quantize_rows) of every row; for its groups of rows, xk, xd and
// xsx (chunk_rows) in an AVX-512 build, xt (quantize_rows_grouped) in an AVX2 one.
struct Q4Rows {
  const int8_t* xq;
  const float* xs;
  const float* xt;
  const int8_t* xk;
  const float* xd;
  const float* xsx;
};

// All M rows against tile t. AVX-512: groups of 8 rows with q4_rows_t, then passes of up to 4 rows (its 32
// registers hold a pass's 4 weight rows' nibbles and 2 accumulators a row). A group of 4 did no better than a pass
// of 4 where the weights stream from memory (SmolLM2's matmuls for a token at 4 rows, 30 copies of each: 6.66 ms
// against 6.14, bench/matmuls.py). AVX2 (16 registers): groups of 8 and 4 with q4_rows, then passes of up to 2.
void q4_tile(const uint8_t* w, int64_t K, const Q4Rows& x, int64_t M, int64_t N, int64_t t, float* y) {
  const int64_t pairs = K / 64, row_xs = pairs * 16, group_xt = pairs * 8;
  int64_t m = 0;
#ifdef __AVX512F__
  const auto group = [&](auto rows) {
    q4_rows_t<decltype(rows)::value>(w, K, x.xk + m * K, x.xd + m * pairs * 2, x.xsx + m * pairs * 2, N, t,
                                     y + m * N);
    m += decltype(rows)::value;
  };
  while (M - m >= 8) group(std::integral_constant<int, 8>{});
#else
  for (; M - m >= 8; m += 8)
    q4_rows<2>(w, K, x.xq + m * K, x.xs + m * row_xs, x.xt + m / 4 * group_xt, N, t, y + m * N);
#endif
  const auto pass = [&](auto rows) {
    q4_pass<decltype(rows)::value>(w, K, x.xq + m * K, x.xs + m * row_xs, N, t, y + m * N);
    m += decltype(rows)::value;
  };
  if constexpr (VW == 16) {
    if (M - m >= 4) pass(std::integral_constant<int, 4>{});
    if (M - m == 3) pass(std::integral_constant<int, 3>{});
  } else if (M - m >= 4) {
    q4_rows<1>(w, K, x.xq + m * K, x.xs + m * row_xs, x.xt + m / 4 * group_xt, N, t, y + m * N);
    m += 4;
  }
  if (M - m >= 2) pass(std::integral_constant<int, 2>{});
  if (M - m == 1) pass(std::integral_constant<int, 1>{});
}

// VW weights of one row: d * q + m (one FMA; q * d is exact in float, 8 + 11 significant bits).
inline vecf dequantize(const uint8_t* q, float d, float m) {
#ifdef __AVX512F__
  const __m128i raw = _mm_loadu_si128((const __m128i*)q);
  const vecf v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw));
#else
  const __m128i raw = _mm_loadl_epi64((const __m128i*)q);
  const vecf v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
#endif
  return vfma(v, vset1(d), vset1(m));
}

// MR activation rows (float) against one tile of 4 8-bit weight rows -> y[m][4 t + r]. Each block's weights are
// dequantized to float once (one FMA: q * d is exact in float, 8 + 11 significant bits) and serve every row; each
// output is one FMA chain over K, whatever MR, so a row's result does not depend on how many rows share the call.
template <int MR>
void q8f_rows(const uint8_t* w, int64_t K, const float* x, int64_t N, int64_t t, float* y) {
  vecf acc[4][MR];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  for (int64_t b = 0; b < K / QK; ++b, w += Q8F_BLOCK) {
    alignas(16) float d[4], mn[4];
    _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)w)));
    _mm_store_ps(mn, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(w + 8))));
    for (int c = 0; c < QK; c += VW) {
      vecf xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = vload(x + m * K + b * QK + c);
      for (int r = 0; r < 4; ++r) {
        const vecf wf = dequantize(w + 16 + r * QK + c, d[r], mn[r]);
        for (int m = 0; m < MR; ++m) acc[r][m] = vfma(wf, xv[m], acc[r][m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 4; ++r) y[m * N + 4 * t + r] = hsum(acc[r][m]);
}

// The tile's weights dequantized to float exactly as q8f_rows does in registers -> buf (K / VW, 4, VW): per VW
// columns, the 4 rows' VW values, in the order f32_rows reads them.
void dequantize_tile(const uint8_t* w, int64_t K, float* buf) {
  for (int64_t b = 0; b < K / QK; ++b, w += Q8F_BLOCK) {
    alignas(16) float d[4], mn[4];
    _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)w)));
    _mm_store_ps(mn, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(w + 8))));
    for (int c = 0; c < QK; c += VW, buf += 4 * VW)
      for (int r = 0; r < 4; ++r) vstore(buf + VW * r, dequantize(w + 16 + r * QK + c, d[r], mn[r]));
  }
}

// MR rows against a tile dequantized by dequantize_tile: the same FMA chains as q8f_rows.
template <int MR>
void f32_rows(const float* buf, int64_t K, const float* x, int64_t N, int64_t t, float* y) {
  vecf acc[4][MR];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += VW, buf += 4 * VW) {
    vecf xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < MR; ++m) acc[r][m] = vfma(vload(buf + VW * r), xv[m], acc[r][m]);
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 4; ++r) y[m * N + 4 * t + r] = hsum(acc[r][m]);
}

// MR rows against two dequantized tiles (8 weight rows) at once: each activation load feeds 8 FMAs instead of 4,
// which is what bounds a prefill's float matmul (the activations stream from L2 for every tile). 8 x 3 accumulators
// need AVX-512's 32 registers. The same FMA chains as f32_rows, bit for bit.
template <int MR>
void f32_rows8(const float* b0, const float* b1, int64_t K, const float* x, int64_t N, int64_t t, float* y) {
  vecf acc[8][MR];
  for (int r = 0; r < 8; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = vzero();
  for (int64_t k = 0; k < K; k += VW, b0 += 4 * VW, b1 += 4 * VW) {
    vecf xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = vload(x + m * K + k);
    for (int r = 0; r < 4; ++r) {
      const vecf w = vload(b0 + VW * r);
      for (int m = 0; m < MR; ++m) acc[r][m] = vfma(w, xv[m], acc[r][m]);
    }
    for (int r = 0; r < 4; ++r) {
      const vecf w = vload(b1 + VW * r);
      for (int m = 0; m < MR; ++m) acc[4 + r][m] = vfma(w, xv[m], acc[4 + r][m]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 8; ++r) y[m * N + 4 * t + r] = hsum(acc[r][m]);
}

// All M rows (6 or more) against tiles t and t + 1, dequantized into buf (8 K floats).
void q8f_tile_pair(const uint8_t* wt, int64_t tile_bytes, int64_t K, const float* X, int64_t M, int64_t N, int64_t t,
                   float* Y, float* buf) {
  dequantize_tile(wt, K, buf);
  dequantize_tile(wt + tile_bytes, K, buf + 4 * K);
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) f32_rows8<3>(buf, buf + 4 * K, K, X + m * K, N, t, Y + m * N);
  for (int h = 0; h < 2; ++h) {
    if (M - m == 2) f32_rows<2>(buf + 4 * K * h, K, X + m * K, N, t + h, Y + m * N);
    if (M - m == 1) f32_rows<1>(buf + 4 * K * h, K, X + m * K, N, t + h, Y + m * N);
  }
}

// All M rows against tile t, in calls of up to 3 rows (4 x 3 accumulators fill the registers). From 6 rows on the
// tile is dequantized once into buf (4 K floats) instead of once per call (below that, measured no faster).
void q8f_tile(const uint8_t* wt, int64_t K, const float* X, int64_t M, int64_t N, int64_t t, float* Y, float* buf) {
  int64_t m = 0;
  if (M >= 6) {
    dequantize_tile(wt, K, buf);
    for (; m + 3 <= M; m += 3) f32_rows<3>(buf, K, X + m * K, N, t, Y + m * N);
    if (M - m == 2) f32_rows<2>(buf, K, X + m * K, N, t, Y + m * N);
    if (M - m == 1) f32_rows<1>(buf, K, X + m * K, N, t, Y + m * N);
    return;
  }
  for (; m + 3 <= M; m += 3) q8f_rows<3>(wt, K, X + m * K, N, t, Y + m * N);
  if (M - m == 2) q8f_rows<2>(wt, K, X + m * K, N, t, Y + m * N);
  if (M - m == 1) q8f_rows<1>(wt, K, X + m * K, N, t, Y + m * N);
}

// The Q8_0 arithmetic (pair tiles), for every output, whatever kernel computes it (this one or amx.cpp's tiles): each
// block b of 32 gives the exact integer s_b = sum q_w q_x (computed as sum u q_x with u = q_w + 128, the unsigned
// operand vpdpbusd and tdpbsud take, less 128 sum q_x; without VNNI directly, q8_row_dot);
// E = the FMA chain over the even blocks, in order, of float(s_b) * (d_w * d_x), O the same over the odd ones;
// y = E + O.

// MR activation rows against one pair tile of 4 weight rows, all 4 in one pass over K. Accumulator lanes
// (parity, weight row), as block_sums gives them. xc: the rows' 128 sum(q_x) per pair (quantize_rows), what the
// unsigned weights of q8_row_dot's VNNI build add.
template <int MR>
void q8_pass(const uint8_t* w, int64_t K, const int8_t* xq, const float* xs, const int32_t* xc, int64_t N, int64_t t,
             float* y) {
  const int64_t pairs = K / 64;
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (row, parity) -> (parity, row) lanes
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += Q8_PAIR) {
    prefetch_stream(w, Q8_PAIR);
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w)), by_block);
    for (int m = 0; m < MR; ++m) {
      const int8_t* x = xq + m * K + 64 * p;
      __m256i sums = block_sums(q8_row_dot(w + 16, x), q8_row_dot(w + 80, x), q8_row_dot(w + 144, x),
                                q8_row_dot(w + 208, x));
      if (Q8_DOT_OFFSET) sums = _mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i*)(xc + (m * pairs + p) * 8)));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_loadu_ps(xs + (m * pairs + p) * 16)),
                               acc[m]);
    }
  }
  store_pass<MR>(acc, nullptr, N, t, y);
}

#ifdef __AVX512F__
// R activation rows (4 or 8, chunk_rows' layout) against a pair tile of 4 weight rows, as q4_rows_t does for int4:
// per pair of blocks each weight row's 16 dwords (chunks 0-3 of b, of b+1, chunks 4-7 of b, of b+1) are rearranged
// once into 4 registers whose 128-bit lane r holds row r's dwords k, 4 + k, 8 + k, 12 + k, the weights an activation
// row's chunk quad k meets. The integers, scales and FMA chains are q8_pass's: the same outputs, bit for bit.
template <int R>
void q8_rows_t(const uint8_t* w, int64_t K, const int8_t* xk, const float* xd, const int32_t* xcq, int64_t N,
               int64_t t, float* y) {
  const int64_t pairs = K / 64;
  const __m512i sign = _mm512_set1_epi8(-128);  // q ^ 0x80 = q + 128
  // two rows' quads k and k + 1 -> lanes (first row k, second row k, first row k + 1, second row k + 1)
  const __m512i quads01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i quads23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  __m512 acc[R / 2];
  for (int j = 0; j < R / 2; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 1
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* wp = w + Q8_PAIR * p;
    prefetch_stream(wp, Q8_PAIR);
    const __m512 d = tile_halves(wp);
    __m512i row[4];
    for (int r = 0; r < 4; ++r) row[r] = _mm512_xor_si512(_mm512_loadu_si512(wp + 16 + 64 * r), sign);
    const __m512i a01 = _mm512_permutex2var_epi32(row[0], quads01, row[1]);
    const __m512i b01 = _mm512_permutex2var_epi32(row[2], quads01, row[3]);
    const __m512i a23 = _mm512_permutex2var_epi32(row[0], quads23, row[1]);
    const __m512i b23 = _mm512_permutex2var_epi32(row[2], quads23, row[3]);
    const __m512i c[4] = {_mm512_shuffle_i64x2(a01, b01, 0x44), _mm512_shuffle_i64x2(a01, b01, 0xEE),
                          _mm512_shuffle_i64x2(a23, b23, 0x44), _mm512_shuffle_i64x2(a23, b23, 0xEE)};
#pragma GCC unroll 4
    for (int j = 0; j < R / 2; ++j) {
      const __m512i sums = chunk_pair_sums(c, xk + 64 * (2 * j * pairs + p), xk + 64 * ((2 * j + 1) * pairs + p));
      const int64_t q = 4 * (j * pairs + p);
      const __m512i exact = _mm512_sub_epi32(sums, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xcq + q))));
      const __m512 scale = _mm512_mul_ps(d, _mm512_broadcast_f32x4(_mm_loadu_ps(xd + q)));
      acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[j]);
    }
  }
  store_row_pairs<R>(acc, nullptr, N, t, y);
}
#endif

}  // namespace

namespace fastdecode {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t K,
                         std::optional<AmxFormat> f, TilesKernel kernel) {
  TORCH_CHECK(x.size(-1) == K, "x has ", x.size(-1), " features, the weight ", K);
  const at::Tensor x2d = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t N = w.size(0) * 4, M = x2d.size(0), tile_bytes = w.size(1) * w.size(2);
  const float* B = nullptr;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "bias must be float32 of out_features");
    B = bias->data_ptr<float>();
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x2d.options());
  const uint8_t* W = w.data_ptr<uint8_t>();
  const float* X = x2d.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t tiled = f ? amx_linear(*f, X, M, K, W, tile_bytes, N, B, Y) : 0;  // the same results (amx.cpp)
  if (tiled < N) kernel(X, M, K, W, tile_bytes, tiled / 4, N, B, Y);
  return y;
}

// Q8_0's pair tiles (N/4, K/64, 272): the rows of x quantized to int8 per block of 32, then every tile from t_first
// takes all of them, tiles spread over the threads.
void q8_pairs(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t t_first, int64_t N,
              const float* B, float* Y) {
  const auto pass = [&](auto rows, const uint8_t* w, const int8_t* xq, const float* xs, const int32_t* xc, int64_t t,
                        float* y) { q8_pass<decltype(rows)::value>(w, K, xq, xs, xc, N, t, y); };
#ifdef __AVX512F__
  fastdecode::pair_tiles_linear(X, M, K, W, tile_bytes, t_first, N, B, Y, pass,
                                [&](auto rows, const uint8_t* w, const int8_t* xk, const float* xd,
                                    const int32_t* xcq, int64_t t, float* y) {
                                  q8_rows_t<decltype(rows)::value>(w, K, xk, xd, xcq, N, t, y);
                                });
#else
  fastdecode::pair_tiles_linear(X, M, K, W, tile_bytes, t_first, N, B, Y, pass);
#endif
}

// The weight-only tiles (N/4, K/32, 144), all of them (no AMX kernel: t_first is 0).
void q8f_tiles(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t bytes, int64_t, int64_t N,
               const float* B, float* Y) {
  // From 6 rows an AVX-512 build takes the tiles two at a time (f32_rows8); the tasks are pairs of tiles then.
  const int64_t step = M >= 6 && VW == 16 ? 2 : 1;
  at::parallel_for(0, (N / 4 + step - 1) / step, std::max<int64_t>(1, (64 << 10) / (4 * K * step)),
                   [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(M >= 6 ? 4 * K * step : 0);
    for (int64_t t = i0 * step; t < std::min(i1 * step, N / 4); t += step) {
      const uint8_t* wt = W + t * bytes;
      const int64_t tiles = std::min(step, N / 4 - t);
      if (t + tiles < std::min(i1 * step, N / 4)) prefetch(wt + tiles * bytes, tiles * bytes);
      if (tiles == 2) q8f_tile_pair(wt, bytes, K, X, M, N, t, Y, buf.data());
      else q8f_tile(wt, K, X, M, N, t, Y, buf.data());
      if (B)
        for (int64_t i = 0; i < M; ++i)
          for (int r = 0; r < 4 * tiles; ++r) Y[i * N + 4 * t + r] += B[4 * t + r];
    }
  });
}

// w (N/4, K/32, 144) uint8, weight-only (the activations stay float), or Q8_0's pair tiles (N/4, K/64, 272), whose
// blocks of 32 output rows amx_linear takes from enough rows (the same results, amx.cpp).
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const int64_t tile_bytes = w.size(2), K = w.size(1) * (tile_bytes == Q8_PAIR ? 64 : QK);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && (tile_bytes == Q8F_BLOCK || tile_bytes == Q8_PAIR),
              "bad q8 weight");
  if (tile_bytes == Q8_PAIR) return packed_linear(x, w, bias, K, AmxFormat::Q8, q8_pairs);
  return packed_linear(x, w, bias, K, std::nullopt, q8f_tiles);
}

// int4's tiles from t_first: the rows of x are quantized to int8 per block of 32, then every tile of 4 output rows
// takes all of them, tiles spread over the threads.
void q4_tiles(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t t_first, int64_t N,
              const float* B, float* Y) {
  const int64_t pairs = K / 64;
  const at::Tensor xq = at::empty({M, K}, at::kChar);
  const at::Tensor xs = at::empty({M, pairs, 16}, at::kFloat);
  const at::Tensor xt = at::empty({M / 4, pairs, 8}, at::kFloat);  // d_x of each group of 4 rows, per pair
  int8_t* XQ = xq.data_ptr<int8_t>();
  float *XS = xs.data_ptr<float>(), *XT = xt.data_ptr<float>();
  quantize_rows_grouped(X, M, K, XQ, XS, XT);
  Q4Rows rows{XQ, XS, XT, nullptr, nullptr, nullptr};
#ifdef __AVX512F__
  const int64_t grouped = M / 8 * 8;  // the rows q4_rows_t takes
  at::Tensor xk, xd;
  if (grouped) {  // (a decode step's single rows allocate nothing more)
    xk = at::empty({grouped, K}, xq.options()), xd = at::empty({2, grouped, pairs, 2}, xs.options());
    rows.xk = xk.data_ptr<int8_t>();
    rows.xd = xd.data_ptr<float>();
    rows.xsx = rows.xd + grouped * pairs * 2;
    fastdecode::chunk_rows(XQ, XS, nullptr, grouped, pairs, xk.data_ptr<int8_t>(), xd.data_ptr<float>(),
                           xd.data_ptr<float>() + grouped * pairs * 2, nullptr);
  }
#endif
  // Tiny matrices (under ~64 KB of weights a thread) stay on one thread: forking would cost more than it saves.
  at::parallel_for(t_first, N / 4, std::max<int64_t>(1, (64 << 10) / tile_bytes), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // The next tile whole where a group of rows reads this one several times; a single pass streams its own.
      if (VW == 8 && M >= 3 && t + 1 < t1) prefetch(W + (t + 1) * tile_bytes, tile_bytes);
      q4_tile(W + t * tile_bytes, K, rows, M, N, t, Y);
      if (B)
        for (int64_t m = 0; m < M; ++m)
          for (int r = 0; r < 4; ++r) Y[m * N + 4 * t + r] += B[4 * t + r];
    }
  });
}

// w (N/4, K/64, 160) uint8; over AMX_MIN_ROWS rows or more, on a CPU with AMX, the AMX tiles take the blocks of 32
// output rows (the same results, amx.cpp).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.size(2) == 160, "bad q4 weight");
  return packed_linear(x, w, bias, w.size(1) * 2 * QK, AmxFormat::Q4, q4_tiles);
}

// Q4_0/Q4_1 blocks -> q4_linear's tiles (N/4, K/64, 160), written once in one pass: qs (N, K/32, 16) uint8, each
// block's nibble bytes as they are (byte j = q[j] | q[j + 16] << 4); scales and mins (N, K/32) fp16. Rows and blocks
// may be strided (views of the mapped file), a block's bytes contiguous. The bytes move, no value changes.
void q4_pack(at::Tensor out, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.size(2) == 16 && qs.stride(2) == 1,
              "q4_pack: need (N, K/32, 16) nibble blocks");
  const int64_t N = qs.size(0), blocks = qs.size(1);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kHalf && t->size(0) == N && t->size(1) == blocks,
                "q4_pack: scales and mins must be fp16 (N, K/32)");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const auto* d = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* m = reinterpret_cast<const uint16_t*>(mins.data_ptr());
  fastdecode::pack_pairs(out, N, blocks, 160, "q4_pack", [&](uint8_t* o, int r, int b, int64_t row, int64_t block) {
    std::memcpy(o + 4 * r + 2 * b, d + row * scales.stride(0) + block * scales.stride(1), 2);  // (row, block)
    std::memcpy(o + 16 + 4 * r + 2 * b, m + row * mins.stride(0) + block * mins.stride(1), 2);
    std::memcpy(o + 32 + 32 * r + 16 * b, q + row * qs.stride(0) + block * qs.stride(1), 16);
  });
}

// Q8_0 blocks -> q8_linear's pair tiles (N/4, K/64, 272) (layout above), written once in one pass: q (N, K/32, 32)
// int8, scales (N, K/32) fp16; rows and blocks may be strided (views of the mapped file), a block's values contiguous.
void q8_pack(at::Tensor out, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.size(2) == 32 && q.stride(2) == 1,
              "q8_pack: need (N, K/32, 32) int8 blocks");
  const int64_t N = q.size(0), blocks = q.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.size(0) == N &&
              scales.size(1) == blocks, "q8_pack: scales must be fp16 (N, K/32)");
  const int8_t* v = q.data_ptr<int8_t>();
  const auto* d = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  fastdecode::pack_pairs(out, N, blocks, Q8_PAIR, "q8_pack", [&](uint8_t* o, int r, int b, int64_t row, int64_t block) {
    std::memcpy(o + 4 * r + 2 * b, d + row * scales.stride(0) + block * scales.stride(1), 2);  // (row, block)
    const int8_t* src = v + row * q.stride(0) + block * q.stride(1);
    std::memcpy(o + 16 + 64 * r + 16 * b, src, 16);  // elements 0..15 of b, then (below) 16..31
    std::memcpy(o + 16 + 64 * r + 32 + 16 * b, src + 16, 16);
  });
}

}  // namespace fastdecode
