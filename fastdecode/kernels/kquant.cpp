// Matmuls over llama.cpp's K-quant formats, with the file's own values: Q4_K and Q5_K (super-blocks of 256 weights,
// 8 sub-blocks of 32, w = d * sc * q - dmin * m with 6-bit sc and m, 4- or 5-bit q) and Q6_K (16 sub-blocks of 16,
// w = d * sc * (q - 32) with int8 sc, 6-bit q). d * sc and dmin * m are exact in float (11 + 6 or 8 significant
// bits), so the kernel multiplies exactly the weights gguf dequantizes to. As in q4_linear (quant.cpp), each activation
// row is quantized to int8 per block of 32, weight x activation sums are exact integers (vpmaddubsw / vpmaddwd), and
// each sub-block's float scaling follows in a fixed order, the same whatever the number of rows M: a verify step or a
// batch reproduces decode steps bit for bit.
//
// Weights are repacked at load (fastdecode/quant/kquant.py) tile-major, (N/4, K/256, bytes): per tile of 4 rows and
// super-block,
// Q4_K (592 bytes) and Q5_K (720): the 4 rows' fp16 d, their fp16 dmin, 32 bytes of scales sc and 32 of mins m in
//   (pair of sub-blocks, row, sub-block of the pair) order; for Q5_K per row 32 bytes of fifth bits (bit 2p of byte j:
//   the low nibble of pair p's byte j, bit 2p + 1: its high nibble); then per pair of sub-blocks and row 32 bytes of
//   nibbles in q4_linear's order (per sub-block byte j = q[j] | q[j + 16] << 4), so that pair_dot reads them.
// Q6_K (840 bytes): the 4 rows' fp16 d, 64 int8 scales in (half, row, sub-block of the half) order, then per half of
//   128 weights and row the file's own 64 bytes of low nibbles and 32 of high bit pairs: unpacked, each 32-byte
//   register holds 32 consecutive weights (llama.cpp's order), read against activations in element order.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cstring>

#include "amx.h"
#include "quant_rows.h"
#include "simd.h"

namespace {

using fastdecode::block_sums;
using fastdecode::fp16;
using fastdecode::hsum;
using fastdecode::offset32_dot;
using fastdecode::pair_dot;
using fastdecode::prefetch;
using fastdecode::prefetch_stream;
using fastdecode::prefetch_stream_l1;
using fastdecode::row_scales;
using fastdecode::store_pass;
#ifdef __AVX512F__
using fastdecode::chunk_rows;
using fastdecode::nibble_quads;
using fastdecode::row_pair_lanes;
using fastdecode::chunk_pair_sums;
using fastdecode::store_row_pairs;
#endif

constexpr int64_t QK_K = 256;
constexpr int64_t Q4K_BYTES = 592, Q5K_BYTES = 720, Q6K_BYTES = 840;

// 4 fp16 at p -> (v0, v0, v1, v1, v2, v2, v3, v3): a value per row in (row, sub-block of a pair) lanes.
inline __m256 row_pairs(const uint8_t* p) {
  const __m256 v = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)p)));
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

inline __m256 u8_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

inline __m256 i8_floats(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// One call: MR activation rows against one tile of 4 weight rows.
struct Call {
  const uint8_t* w;  // the tile's first super-block
  int64_t sbs, K, N, t;  // super-blocks per row, in and out features, the tile
  const int8_t* xq;  // (MR, K) the call's quantized activation rows
  const float* xs;  // their scales, xs_row floats a row
  int64_t xs_row;
  float* y;  // (MR, N) the call's output rows
};

// Q4_K and Q5_K follow q4_linear's arithmetic (quant.cpp), with d * sc for d_w and dmin * m * sx subtracted for the
// mins: per sub-block an exact integer sum, E and O the FMA chains over the even and odd sub-blocks, ME and MO the
// mins' chains, y = ((E + O) + ME) + MO, whatever the number of rows and on AMX tiles too (amx.cpp).

// Row r's values of pair p of a super-block as two registers (lo: elements 0..15 of both sub-blocks, hi: 16..31),
// the fifth bits added for Q5_K.
template <bool Q5>
inline void unpack_pair(const uint8_t* w, int p, int r, __m256i& lo, __m256i& hi) {
  constexpr int64_t qoff = Q5 ? 208 : 80;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i q = _mm256_loadu_si256((const __m256i*)(w + qoff + 128 * p + 32 * r));
  lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
  if (Q5) {  // pair p's fifth bits: bit 2p of each byte for the low nibble, 2p + 1 for the high one
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    const __m256i f = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)(w + 80 + 32 * r)), _mm_cvtsi32_si128(2 * p));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(f, 4), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(f, 3), bit4));
  }
}

// The mins' chains ME, MO of MR rows against the tile's 4 weight rows, in (weight row, parity) lanes, added to y.
template <int MR, bool Q5>
void kq_mins(const Call& c) {
  constexpr int64_t bytes = Q5 ? Q5K_BYTES : Q4K_BYTES;
  for (int m = 0; m < MR; ++m) {
    __m256 acc = _mm256_setzero_ps();
    const uint8_t* w = c.w;
    for (int64_t sb = 0; sb < c.sbs; ++sb, w += bytes) {
      const __m256 dmin = row_pairs(w + 8);
      for (int p = 0; p < 4; ++p)
        acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, u8_floats(w + 48 + 8 * p)),
                               _mm256_loadu_ps(c.xs + m * c.xs_row + 16 * (4 * sb + p) + 8), acc);
    }
    alignas(32) float mn[8];
    _mm256_store_ps(mn, acc);
    for (int r = 0; r < 4; ++r) c.y[m * c.N + 4 * c.t + r] = c.y[m * c.N + 4 * c.t + r] + mn[2 * r] + mn[2 * r + 1];
  }
}

// One or two activation rows against the tile's 4 weight rows in one pass over K; lanes (parity, weight row).
template <int MR, bool Q5>
void kq_pass(const Call& c) {
  constexpr int64_t bytes = Q5 ? Q5K_BYTES : Q4K_BYTES;
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (row, parity) -> (parity, row) lanes
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  const uint8_t* w = c.w;
  for (int64_t sb = 0; sb < c.sbs; ++sb, w += bytes) {
    prefetch_stream(w, bytes);
    const __m256 d = row_pairs(w);
    for (int p = 0; p < 4; ++p) {
      const int64_t pair = 4 * sb + p;
      const __m256 scale = _mm256_permutevar8x32_ps(_mm256_mul_ps(d, u8_floats(w + 16 + 8 * p)), by_block);
      __m256i lo[4], hi[4];
      for (int r = 0; r < 4; ++r) unpack_pair<Q5>(w, p, r, lo[r], hi[r]);
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = c.xq + m * c.K + 64 * pair;
        const __m256i sums = block_sums(pair_dot(lo[0], hi[0], x), pair_dot(lo[1], hi[1], x),
                                        pair_dot(lo[2], hi[2], x), pair_dot(lo[3], hi[3], x));
        const __m256 scaled = _mm256_mul_ps(scale, _mm256_loadu_ps(c.xs + m * c.xs_row + 16 * pair));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scaled, acc[m]);
      }
    }
  }
  store_pass<MR>(acc, nullptr, c.N, c.t, c.y);
  kq_mins<MR, Q5>(c);
}

// 4 G activation rows against the tile, one weight row at a time (unpacked once for all the rows); lanes (parity,
// activation row), the rows' d_x from xt (quantize_rows_grouped).
template <int G, bool Q5>
void kq_rows(const Call& c, const float* xt) {
  constexpr int64_t bytes = Q5 ? Q5K_BYTES : Q4K_BYTES;
  const int64_t pairs = c.K / 64;
  for (int r = 0; r < 4; ++r) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    const uint8_t* w = c.w;
    for (int64_t sb = 0; sb < c.sbs; ++sb, w += bytes) {
      const __m256 d = row_pairs(w);
      for (int p = 0; p < 4; ++p) {
        const int64_t pair = 4 * sb + p;
        const __m256 scale = _mm256_permutevar8x32_ps(_mm256_mul_ps(d, u8_floats(w + 16 + 8 * p)), row_scales(r));
        __m256i lo, hi;
        unpack_pair<Q5>(w, p, r, lo, hi);
        for (int g = 0; g < G; ++g) {
          const int8_t* x = c.xq + 4 * g * c.K + 64 * pair;
          const __m256i sums = block_sums(pair_dot(lo, hi, x), pair_dot(lo, hi, x + c.K),
                                          pair_dot(lo, hi, x + 2 * c.K), pair_dot(lo, hi, x + 3 * c.K));
          const __m256 scaled = _mm256_mul_ps(scale, _mm256_loadu_ps(xt + (g * pairs + pair) * 8));
          acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scaled, acc[g]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(32) float a[8];
      _mm256_store_ps(a, acc[g]);
      for (int i = 0; i < 4; ++i) c.y[(4 * g + i) * c.N + 4 * c.t + r] = a[i] + a[i + 4];
    }
  }
  kq_mins<4 * G, Q5>(c);
}

#ifdef __AVX512F__
// 8 activation rows (chunk_rows' layout: xk, xd, xsx) against a Q4_K or Q5_K tile, as quant.cpp's q4_rows_t does for
// int4: per pair of sub-blocks the 4 weight rows' nibbles (and fifth bits) are rearranged once (nibble_quads), four
// vpdpbusd leave each row's exact sub-block sums in lanes, and pairs of activation rows share the float work. The
// integers, scales (d * sc, then times d_x) and FMA chains (the mins' with dmin * m) are kq_rows' and kq_mins': the
// same outputs, bit for bit.
template <bool Q5>
void kq_rows_t(const Call& c, const int8_t* xk, const float* xd, const float* xsx) {
  constexpr int R = 8;
  constexpr int64_t bytes = Q5 ? Q5K_BYTES : Q4K_BYTES, qoff = Q5 ? 208 : 80;
  const int64_t pairs = c.K / 64;
  __m512 acc[R / 2], acc_min[R / 2];
  for (int j = 0; j < R / 2; ++j) acc[j] = acc_min[j] = _mm512_setzero_ps();
  const uint8_t* w = c.w;
  for (int64_t sb = 0; sb < c.sbs; ++sb, w += bytes) {
    prefetch_stream(w, bytes);
    const __m256 d = row_pairs(w), dmin = row_pairs(w + 8);
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
      const int64_t pair = 4 * sb + p;
      const __m512 scale = row_pair_lanes(_mm256_mul_ps(d, u8_floats(w + 16 + 8 * p)));
      const __m512 mins = row_pair_lanes(_mm256_mul_ps(dmin, u8_floats(w + 48 + 8 * p)));
      __m512i q[4];
      nibble_quads(w + qoff + 128 * p, q, Q5 ? w + 80 : nullptr, 2 * p);
#pragma GCC unroll 4
      for (int j = 0; j < R / 2; ++j) {
        const __m512i sums =
            chunk_pair_sums(q, xk + 64 * (2 * j * pairs + pair), xk + 64 * ((2 * j + 1) * pairs + pair));
        const int64_t o = 4 * (j * pairs + pair);
        const __m512 scaled = _mm512_mul_ps(scale, _mm512_broadcast_f32x4(_mm_loadu_ps(xd + o)));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scaled, acc[j]);
        acc_min[j] = _mm512_fnmadd_ps(mins, _mm512_broadcast_f32x4(_mm_loadu_ps(xsx + o)), acc_min[j]);
      }
    }
  }
  store_row_pairs<R>(acc, acc_min, c.N, c.t, c.y);
}
#endif

// The chunked activation rows (chunk_rows) of the groups kq_rows_t takes, where the build has it.
struct Chunked {
  int8_t* xk;
  float *xd, *xsx;
};

// All M rows of a Q4_K or Q5_K tile: groups of 8 rows (kq_rows_t in an AVX-512 build) and 4, the last 1-3 in one
// pass.
template <bool Q5>
void pair_tile(Call c, int64_t M, const float* xt, Chunked ch) {
  const int64_t pairs = c.K / 64, group_xt = pairs * 8;
  const auto advance = [&](int64_t rows) {
    c.xq += rows * c.K, c.xs += rows * c.xs_row, c.y += rows * c.N, xt += rows / 4 * group_xt, M -= rows;
    if (ch.xk) ch.xk += rows * c.K, ch.xd += rows * pairs * 2, ch.xsx += rows * pairs * 2;
  };
#ifdef __AVX512F__
  for (; M >= 8; advance(8)) kq_rows_t<Q5>(c, ch.xk, ch.xd, ch.xsx);
#else
  for (; M >= 8; advance(8)) kq_rows<2, Q5>(c, xt);
#endif
  if (M >= 4) kq_rows<1, Q5>(c, xt), advance(4);
  if (M >= 2) kq_pass<2, Q5>(c), advance(2);
  if (M == 1) kq_pass<1, Q5>(c);
}

// Q6_K: per half super-block and row, the 6-bit values unpacked into 4 registers of 32 consecutive weights; each
// times its activation block gives 8 int32 lanes, 0-3 one sub-block of 16, 4-7 the next, with the -32 offset taken
// off in the integer sums (offset32_dot). The half's 8 sub-block sums (block_sums: lanes sub-blocks 0, 2, 4, 6 | 1,
// 3, 5, 7) are scaled by d * sc * d_x into one accumulator whose lanes are those 8 classes of sub-blocks, summed
// at the end in hsum's fixed order: the arithmetic amx.cpp reproduces.
template <int MR, int NR>
void q6_rows(const Call& c, int r0) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const uint8_t* w = c.w;
  for (int64_t sb = 0; sb < c.sbs; ++sb, w += Q6K_BYTES) {
    if (NR == 4) prefetch_stream_l1(w, Q6K_BYTES);  // one pass over the tile (one or two rows): streamed
    for (int h = 0; h < 2; ++h) {
      const int64_t b0 = 8 * sb + 4 * h;  // the half's first activation block
      for (int r = 0; r < NR; ++r) {
        const int row = r0 + r;
        const __m256 s = _mm256_permutevar8x32_ps(
            _mm256_mul_ps(_mm256_set1_ps(fp16(w + 2 * row)), i8_floats(w + 8 + 32 * h + 8 * row)), by_block);
        const uint8_t* qp = w + 72 + 384 * h + 96 * row;
        const __m256i ql0 = _mm256_loadu_si256((const __m256i*)qp), ql1 = _mm256_loadu_si256((const __m256i*)(qp + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(qp + 64));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = c.xq + m * c.K + 32 * b0;
          const __m256i sums = block_sums(
              offset32_dot(q[0], _mm256_loadu_si256((const __m256i*)x)),
              offset32_dot(q[1], _mm256_loadu_si256((const __m256i*)(x + 32))),
              offset32_dot(q[2], _mm256_loadu_si256((const __m256i*)(x + 64))),
              offset32_dot(q[3], _mm256_loadu_si256((const __m256i*)(x + 96))));
          // d_x of blocks b0 .. b0 + 3 in both halves: sub-blocks 2 i and 2 i + 1 lie in block b0 + i
          const __m256 scaled = _mm256_mul_ps(s, _mm256_broadcast_ps((const __m128*)(c.xs + m * c.xs_row + b0)));
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scaled, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) c.y[m * c.N + 4 * c.t + r0 + r] = hsum(acc[m][r]);
}

#ifdef __AVX512F__
// Q6_K for 8 activation rows without horizontal sums. A super-block's 16 sub-blocks of 16 weights sit in the lanes
// of a register, in q6_rows' accumulator order: lanes 0-7 the first half's sub-blocks 0, 2, 4, 6, 1, 3, 5, 7, lanes
// 8-15 the second half's. Per weight row and super-block the 256 unpacked values are rearranged once into 4
// registers, register k holding dword k of each lane's sub-block; an activation row's 4 registers (q6_chunk_rows)
// hold its values the same way, so 4 vpdpbusd leave each lane's exact sub-block sum. The -32 offset is taken off the
// sums as 32 sum(x) a sub-block. Each half then joins the row's accumulator as in q6_rows (the first half's lanes,
// then the second's): the same integers, scales and FMA chains, the same outputs bit for bit, where q6_rows spends 3
// hadds and 8 vpdpbusd per 128 weights and row.
constexpr int Q6_CLASS[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // lane -> sub-block of its half

// Rows (K, element order, quantize_rows_plain) -> per row and super-block: xk 4 x 64 bytes as above, corr (16 int32)
// 32 sum(x) of each lane's sub-block, dx (16 floats) each lane's block d_x.
void q6_chunk_rows(const int8_t* xq, const float* xd, int64_t rows, int64_t K, int8_t* xk, int32_t* corr, float* dx) {
  const int64_t sbs = K / QK_K;
  for (int64_t i = 0; i < rows * sbs; ++i) {
    const int8_t* x = xq + 256 * i;
    int32_t* xw = reinterpret_cast<int32_t*>(xk + 256 * i);
    for (int lane = 0; lane < 16; ++lane) {
      const int sub = 8 * (lane / 8) + Q6_CLASS[lane % 8];  // of the super-block
      int32_t sum = 0;
      for (int e = 0; e < 16; ++e) sum += x[16 * sub + e];
      corr[16 * i + lane] = 32 * sum;
      dx[16 * i + lane] = xd[8 * i + sub / 2];
      for (int k = 0; k < 4; ++k) std::memcpy(xw + 16 * k + lane, x + 16 * sub + 4 * k, 4);
    }
  }
}

void q6_rows_t(const Call& c, const int8_t* xk, const int32_t* corr, const float* dx) {
  constexpr int R = 8;
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  // the high bit pairs of q0 | q1 (qh << 4, qh << 2) and of q2 | q3 (qh, qh >> 2), as q6_rows takes them
  const __m512i lo_shift = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
  const __m512i hi_shift = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
  __m512i pick[4];  // dword k of each lane's sub-block, from the half's (q0 | q1, q2 | q3)
  for (int k = 0; k < 4; ++k) {
    alignas(64) int32_t idx[16];
    for (int lane = 0; lane < 16; ++lane) {
      const int sub = Q6_CLASS[lane % 8];
      idx[lane] = (sub >= 4 ? 16 : 0) + 4 * (sub % 4) + k;
    }
    pick[k] = _mm512_load_si512(idx);
  }
  const __m128i by_class = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int r = 0; r < 4; ++r) {
    __m256 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* w = c.w;
    for (int64_t sb = 0; sb < c.sbs; ++sb, w += Q6K_BYTES) {
      if (r == 0) prefetch_stream_l1(w, Q6K_BYTES);
      __m512i half[2][2];  // per half: values 0-63 (q0 | q1), 64-127 (q2 | q3)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* qp = w + 72 + 384 * h + 96 * r;
        const __m512i ql = _mm512_loadu_si512(qp);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qp + 64)));
        half[h][0] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                     _mm512_and_si512(_mm512_sllv_epi64(qh, lo_shift), bits45));
        half[h][1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                     _mm512_and_si512(_mm512_srlv_epi64(qh, hi_shift), bits45));
      }
      __m512i q[4];
      for (int k = 0; k < 4; ++k)
        q[k] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(half[0][0], pick[k], half[0][1]),
                                       _mm512_permutex2var_epi32(half[1][0], pick[k], half[1][1]));
      // d * sc of each lane's sub-block: the halves' 8 scales of row r, in lane order
      const __m128i sc = _mm_shuffle_epi8(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(w + 8 + 8 * r)),
                                                             _mm_loadl_epi64((const __m128i*)(w + 40 + 8 * r))),
                                          by_class);
      const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(fp16(w + 2 * r)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const int64_t i = m * c.sbs + sb;
        const __m512i* x = reinterpret_cast<const __m512i*>(xk + 256 * i);
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_loadu_si512(x));
        for (int k = 1; k < 4; ++k) s = _mm512_dpbusd_epi32(s, q[k], _mm512_loadu_si512(x + k));
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_loadu_si512(corr + 16 * i)));
        const __m512 scaled = _mm512_mul_ps(dsc, _mm512_loadu_ps(dx + 16 * i));
        acc[m] = _mm256_fmadd_ps(_mm512_castps512_ps256(v), _mm512_castps512_ps256(scaled), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(v, 1), _mm512_extractf32x8_ps(scaled, 1), acc[m]);
      }
    }
    for (int m = 0; m < R; ++m) c.y[m * c.N + 4 * c.t + r] = hsum(acc[m]);
  }
}
#endif

// MR rows against the tile: all 4 weight rows in one pass for one or two rows, else one weight row at a time.
template <int MR>
void q6_call(const Call& c) {
  if (MR <= 2) return q6_rows<MR, 4>(c, 0);
  for (int r = 0; r < 4; ++r) q6_rows<MR, 1>(c, r);
}

// All M rows against one Q6_K tile, in calls of up to 8 rows of about equal size.
void q6_tile(Call c, int64_t M) {
  const int64_t calls = (M + 7) / 8;
  for (int64_t k = 0, m = 0; k < calls; ++k) {
    const int64_t rows = (M - m) / (calls - k);
    Call part = c;
    part.xq += m * c.K, part.xs += m * c.xs_row, part.y += m * c.N;
    switch (rows) {
      case 1: q6_call<1>(part); break;
      case 2: q6_call<2>(part); break;
      case 3: q6_call<3>(part); break;
      case 4: q6_call<4>(part); break;
      case 5: q6_call<5>(part); break;
      case 6: q6_call<6>(part); break;
      case 7: q6_call<7>(part); break;
      default: q6_call<8>(part); break;
    }
    m += rows;
  }
}

}  // namespace

namespace fastdecode {

// The tiles from t_first, Q4_K, Q5_K or Q6_K by their size: the rows of x are quantized to int8 per block of 32 (in
// pair order for Q4_K/Q5_K, element order for Q6_K), then every tile of 4 output rows takes all of them, tiles spread
// over the threads.
void kq_tiles(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t t_first, int64_t N,
              const float* B, float* Y) {
  const int64_t bytes = tile_bytes / (K / QK_K);
  const bool q6 = bytes == Q6K_BYTES;
  const int64_t xs_row = q6 ? K / 32 : K / 64 * 16;
  const at::Tensor xq = at::empty({M, K}, at::kChar);
  const at::Tensor xs = at::empty({M, xs_row}, at::kFloat);
  const at::Tensor xt = at::empty({q6 ? 0 : M / 4, K / 64, 8}, at::kFloat);
  if (q6) quantize_rows_plain(X, M * K / 32, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  else quantize_rows_grouped(X, M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xt.data_ptr<float>());
  // The groups of 8 rows an AVX-512 build takes with kq_rows_t or q6_rows_t, their rows rearranged.
  Chunked chunked{nullptr, nullptr, nullptr};
  int64_t grouped = 0;
  at::Tensor xk, xd, corr;
#ifdef __AVX512F__
  grouped = M / 8 * 8;
  if (grouped) {  // (a decode step's single rows allocate nothing more)
    xk = at::empty({grouped, K}, xq.options());
    xd = at::empty({2, grouped, K / 32}, xs.options());  // Q6_K: the lanes' d_x; else chunk_rows' xd, then xsx
    corr = at::empty({q6 ? grouped : 0, K / 16}, xs.options().dtype(at::kInt));
    chunked = {xk.data_ptr<int8_t>(), xd.data_ptr<float>(), xd.data_ptr<float>() + grouped * K / 32};
    if (q6) q6_chunk_rows(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), grouped, K, chunked.xk, corr.data_ptr<int32_t>(),
                          xd.data_ptr<float>());
    else chunk_rows(xq.data_ptr<int8_t>(), xs.data_ptr<float>(), nullptr, grouped, K / 64, chunked.xk, chunked.xd,
                    chunked.xsx, nullptr);
  }
#endif
  // Tiny matrices (under ~64 KB of weights a thread) stay on one thread: forking would cost more than it saves.
  at::parallel_for(t_first, N / 4, std::max<int64_t>(1, (64 << 10) / tile_bytes), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (M > 2 && t + 1 < t1) prefetch(W + (t + 1) * tile_bytes, tile_bytes);  // else one pass streams it
      const Call c{W + t * tile_bytes, K / QK_K, K, N, t, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xs_row, Y};
      if (bytes == Q4K_BYTES) pair_tile<false>(c, M, xt.data_ptr<float>(), chunked);
      else if (bytes == Q5K_BYTES) pair_tile<true>(c, M, xt.data_ptr<float>(), chunked);
      else {
#ifdef __AVX512F__
        for (int64_t m = 0; m < grouped; m += 8) {
          Call part = c;
          part.y += m * N;
          q6_rows_t(part, chunked.xk + m * K, corr.data_ptr<int32_t>() + m * K / 16, chunked.xd + m * K / 16);
        }
#endif
        Call rest = c;
        rest.xq += grouped * K, rest.xs += grouped * xs_row, rest.y += grouped * N;
        if (M > grouped) q6_tile(rest, M - grouped);
      }
      if (B)
        for (int64_t m = 0; m < M; ++m)
          for (int r = 0; r < 4; ++r) Y[m * N + 4 * t + r] += B[4 * t + r];
    }
  });
}

// w (N/4, K/256, 592 | 720 | 840) uint8: Q4_K, Q5_K or Q6_K by its tile size; over AMX_MIN_ROWS rows or more, on a CPU
// with AMX, the AMX tiles take the blocks of 32 output rows (the same results, amx.cpp).
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte &&
              (w.size(2) == Q4K_BYTES || w.size(2) == Q5K_BYTES || w.size(2) == Q6K_BYTES), "bad K-quant weight");
  const int64_t bytes = w.size(2);
  const AmxFormat f = bytes == Q4K_BYTES ? AmxFormat::Q4K : bytes == Q5K_BYTES ? AmxFormat::Q5K : AmxFormat::Q6K;
  return packed_linear(x, w, bias, w.size(1) * QK_K, f, kq_tiles);
}

// A Q4_K or Q5_K tensor's super-blocks (N, K/256, 144 | 176) uint8 (rows and super-blocks may be strided, a super-
// block's bytes contiguous: a view of the mapped file) -> `out` (N/4, K/256, 592 | 720) in the layout above, written
// once. One pass over the file's bytes: the nibble regrouping on 8-byte words, the 6-bit scales and the fifth bits
// per super-block (Q6_K is byte runs only: quant/kquant.py moves them).
void kq_pack(at::Tensor out, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.stride(2) == 1 &&
              (blocks.size(2) == 144 || blocks.size(2) == 176), "kq_pack: need Q4_K or Q5_K super-blocks");
  const int64_t N = blocks.size(0), S = blocks.size(1);
  const bool q5 = blocks.size(2) == 176;
  const int64_t tile = q5 ? Q5K_BYTES : Q4K_BYTES;
  TORCH_CHECK(N % 4 == 0 && out.is_contiguous() && out.scalar_type() == at::kByte && out.size(0) == N / 4 &&
              out.size(1) == S && out.size(2) == tile, "kq_pack: bad output");
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_stride = blocks.stride(0), block_stride = blocks.stride(1);
  at::parallel_for(0, N / 4 * S, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / S, s = i % S;
      uint8_t* o = dst + i * tile;
      for (int r = 0; r < 4; ++r) {
        const uint8_t* b = in + (4 * t + r) * row_stride + s * block_stride;
        std::memcpy(o + 2 * r, b, 2);  // d
        std::memcpy(o + 8 + 2 * r, b + 2, 2);  // dmin
        const uint8_t* sc = b + 4;  // gguf's get_scale_min_k4
        for (int j = 0; j < 8; ++j) {
          const uint8_t scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
          const uint8_t min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
          o[16 + (j / 2) * 8 + 2 * r + j % 2] = scale;  // (pair, row, sub-block of the pair)
          o[48 + (j / 2) * 8 + 2 * r + j % 2] = min;
        }
        const uint8_t* qs = b + (q5 ? 48 : 16);
        for (int p = 0; p < 4; ++p) {  // sub-block 2p: the low nibbles of pair p's 32 bytes, 2p + 1 the high ones
          uint8_t* q = o + tile - 512 + p * 128 + r * 32;
          for (int w = 0; w < 2; ++w) {
            uint64_t lo, hi;
            std::memcpy(&lo, qs + 32 * p + 8 * w, 8);  // bytes j, and j + 16 below
            std::memcpy(&hi, qs + 32 * p + 16 + 8 * w, 8);
            const uint64_t low = (lo & 0x0F0F0F0F0F0F0F0FULL) | ((hi << 4) & 0xF0F0F0F0F0F0F0F0ULL);
            const uint64_t high = ((lo >> 4) & 0x0F0F0F0F0F0F0F0FULL) | (hi & 0xF0F0F0F0F0F0F0F0ULL);
            std::memcpy(q + 8 * w, &low, 8);  // byte j = q[j] | q[j + 16] << 4 of sub-block 2p
            std::memcpy(q + 16 + 8 * w, &high, 8);
          }
        }
        if (q5) {  // element 32 k + l's fifth bit is bit k of qh[l]; ours, byte 16 h + e: bit 2p that of element
          const uint8_t* qh = b + 16;  // 32 (2p + h) + e, bit 2p + 1 that of element 32 (2p + h) + 16 + e
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 16; ++e) {
              uint8_t bits = 0;
              for (int p = 0; p < 4; ++p)
                bits |= ((qh[e] >> (2 * p + h)) & 1) << (2 * p) | ((qh[16 + e] >> (2 * p + h)) & 1) << (2 * p + 1);
              o[80 + r * 32 + 16 * h + e] = bits;
            }
        }
      }
    }
  });
}

}  // namespace fastdecode
