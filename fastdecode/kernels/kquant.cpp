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

#include "quant_rows.h"
#include "simd.h"

namespace fastdecode {
at::Tensor as_rows(const at::Tensor& x, int64_t K);
const float* bias_of(const c10::optional<at::Tensor>& bias, int64_t N);
}  // namespace fastdecode

namespace {

using fastdecode::hsum;
using fastdecode::offset32_dot;
using fastdecode::pair_dot;
using fastdecode::prefetch;
using fastdecode::row_scales;

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

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
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

// Weight rows r0 .. r0 + NR - 1 of a Q4_K or Q5_K tile in one pass over K. NR = 4 (one or two activation rows) shares
// each load of the scales among the 4 rows; from three rows on, 4 rows' accumulators would leave the registers, so each
// row takes a pass (NR = 1). Every output is the same arithmetic either way: one FMA chain over the pairs of
// sub-blocks of d * sc times the pair's integer dot products, then the mins' chain (kept for all 4 rows in lanes, the
// rows of the pass read from it).
template <int MR, int NR, bool Q5>
void pair_rows(const Call& c, int r0) {
  constexpr int64_t bytes = Q5 ? Q5K_BYTES : Q4K_BYTES, qoff = Q5 ? 208 : 80;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  __m256 acc[MR][NR], acc_min[MR];
  for (int m = 0; m < MR; ++m) {
    acc_min[m] = _mm256_setzero_ps();
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  }
  const uint8_t* w = c.w;
  for (int64_t sb = 0; sb < c.sbs; ++sb, w += bytes) {
    const __m256 d = row_pairs(w), dmin = row_pairs(w + 8);
    __m256i fifth[NR];
    if (Q5)
      for (int r = 0; r < NR; ++r) fifth[r] = _mm256_loadu_si256((const __m256i*)(w + 80 + 32 * (r0 + r)));
    for (int p = 0; p < 4; ++p) {
      const int64_t pair = 4 * sb + p;
      const __m256 scale = _mm256_mul_ps(d, u8_floats(w + 16 + 8 * p));  // (row, sub-block): d * sc, exact
      const __m256 mins = _mm256_mul_ps(dmin, u8_floats(w + 48 + 8 * p));
      for (int m = 0; m < MR; ++m)
        acc_min[m] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(c.xs + m * c.xs_row + 16 * pair + 8), acc_min[m]);
      for (int r = 0; r < NR; ++r) {
        const __m256 sr = _mm256_permutevar8x32_ps(scale, row_scales(r0 + r));
        const __m256i q = _mm256_loadu_si256((const __m256i*)(w + qoff + 128 * p + 32 * (r0 + r)));
        __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if (Q5) {  // pair p's fifth bits sit in bits 0 and 1 of each byte after p shifts by 2
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(fifth[r], 4), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(fifth[r], 3), bit4));
          fifth[r] = _mm256_srli_epi16(fifth[r], 2);
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i s = pair_dot(lo, hi, c.xq + m * c.K + 64 * pair);
          const __m256 scaled = _mm256_mul_ps(sr, _mm256_loadu_ps(c.xs + m * c.xs_row + 16 * pair));
          acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scaled, acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(32) float mn[8];
    _mm256_store_ps(mn, acc_min[m]);
    for (int r = 0; r < NR; ++r) {
      const int row = r0 + r;
      c.y[m * c.N + 4 * c.t + row] = hsum(acc[m][r]) + mn[2 * row] + mn[2 * row + 1];
    }
  }
}

// The same for Q6_K: per half super-block and row, the 6-bit values unpacked into 4 registers of 32 consecutive
// weights; each times its activation block gives 8 int32 lanes, 0-3 one sub-block of 16, 4-7 the next. The -32 offset
// is taken off in the integer sums (offset32_dot).
template <int MR, int NR>
void q6_rows(const Call& c, int r0) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const uint8_t* w = c.w;
  for (int64_t sb = 0; sb < c.sbs; ++sb, w += Q6K_BYTES) {
    for (int h = 0; h < 2; ++h) {
      const int64_t b0 = 8 * sb + 4 * h;  // the half's first activation block
      for (int r = 0; r < NR; ++r) {
        const int row = r0 + r;
        const __m256 s = _mm256_mul_ps(_mm256_set1_ps(fp16(w + 2 * row)), i8_floats(w + 8 + 32 * h + 8 * row));
        const uint8_t* qp = w + 72 + 384 * h + 96 * row;
        const __m256i ql0 = _mm256_loadu_si256((const __m256i*)qp), ql1 = _mm256_loadu_si256((const __m256i*)(qp + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(qp + 64));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
        for (int i = 0; i < 4; ++i) {
          const __m256 si = _mm256_permutevar8x32_ps(s, row_scales(i));  // sub-blocks 2i, 2i + 1 of the half
          for (int m = 0; m < MR; ++m) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(c.xq + m * c.K + 32 * (b0 + i)));
            const __m256i dot = offset32_dot(q[i], x);
            const __m256 scaled = _mm256_mul_ps(si, _mm256_broadcast_ss(c.xs + m * c.xs_row + b0 + i));
            acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scaled, acc[m][r]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < NR; ++r) c.y[m * c.N + 4 * c.t + r0 + r] = hsum(acc[m][r]);
}

struct Q4K {
  template <int MR, int NR> static void run(const Call& c, int r0) { pair_rows<MR, NR, false>(c, r0); }
};
struct Q5K {
  template <int MR, int NR> static void run(const Call& c, int r0) { pair_rows<MR, NR, true>(c, r0); }
};
struct Q6K {
  template <int MR, int NR> static void run(const Call& c, int r0) { q6_rows<MR, NR>(c, r0); }
};

template <class F, int MR>
void call(const Call& c) {
  if (MR <= 2) return F::template run<MR, 4>(c, 0);
  for (int r = 0; r < 4; ++r) F::template run<MR, 1>(c, r);
}

// All M rows against one tile, in calls of up to 8 rows of about equal size (as q4_tile).
template <class F>
void tile(Call c, int64_t M) {
  const int64_t calls = (M + 7) / 8;
  for (int64_t k = 0, m = 0; k < calls; ++k) {
    const int64_t rows = (M - m) / (calls - k);
    Call part = c;
    part.xq += m * c.K, part.xs += m * c.xs_row, part.y += m * c.N;
    switch (rows) {
      case 1: call<F, 1>(part); break;
      case 2: call<F, 2>(part); break;
      case 3: call<F, 3>(part); break;
      case 4: call<F, 4>(part); break;
      case 5: call<F, 5>(part); break;
      case 6: call<F, 6>(part); break;
      case 7: call<F, 7>(part); break;
      default: call<F, 8>(part); break;
    }
    m += rows;
  }
}

}  // namespace

namespace fastdecode {

// w (N/4, K/256, 592 | 720 | 840) uint8: Q4_K, Q5_K or Q6_K by its tile size. The rows of x are quantized to int8
// per block of 32 (in pair order for Q4_K/Q5_K, element order for Q6_K), then every tile of 4 output rows takes all
// of them, tiles spread over the threads.
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte &&
              (w.size(2) == Q4K_BYTES || w.size(2) == Q5K_BYTES || w.size(2) == Q6K_BYTES), "bad K-quant weight");
  const int64_t N = w.size(0) * 4, K = w.size(1) * QK_K, bytes = w.size(2);
  const at::Tensor x2d = as_rows(x, K);
  const float* B = bias_of(bias, N);
  const int64_t M = x2d.size(0);
  const bool q6 = bytes == Q6K_BYTES;
  const int64_t xs_row = q6 ? K / 32 : K / 64 * 16;
  const at::Tensor xq = at::empty({M, K}, x2d.options().dtype(at::kChar));
  const at::Tensor xs = at::empty({M, xs_row}, x2d.options());
  if (q6) quantize_rows_plain(x2d.data_ptr<float>(), M * K / 32, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  else quantize_rows(x2d.data_ptr<float>(), M * K / 32, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor y = at::empty(shape, x2d.options());
  const uint8_t* W = w.data_ptr<uint8_t>();
  float* Y = y.data_ptr<float>();
  const int64_t tile_bytes = K / QK_K * bytes;
  // Tiny matrices (under ~64 KB of weights a thread) stay on one thread: forking would cost more than it saves.
  at::parallel_for(0, N / 4, std::max<int64_t>(1, (64 << 10) / tile_bytes), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (t + 1 < t1) prefetch(W + (t + 1) * tile_bytes, tile_bytes);
      const Call c{W + t * tile_bytes, K / QK_K, K, N, t, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xs_row, Y};
      if (bytes == Q4K_BYTES) tile<Q4K>(c, M);
      else if (bytes == Q5K_BYTES) tile<Q5K>(c, M);
      else tile<Q6K>(c, M);
      if (B)
        for (int64_t m = 0; m < M; ++m)
          for (int r = 0; r < 4; ++r) Y[m * N + 4 * t + r] += B[4 * t + r];
    }
  });
  return y;
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
