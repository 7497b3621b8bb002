// MXFP4 matmuls (gpt-oss's experts; OCP Microscaling Formats v1.0): blocks of 32 E2M1 codes under one E8M0 scale
// byte e, w = 2^(e - 127) * E2M1(q), kept as the file has them (4.25 bits a weight) and read in one sequential stream.
//
// fp4_linear: W packed as (N/4, K/64, 136) bytes: for each tile of 4 rows and pair of blocks, the 8 scale bytes in
// (row, block) order, then each row's 32 bytes: block b's 16, then block b+1's, byte j of a block holding q[j] in its
// low nibble and q[j + 16] in its high one (GGUF's MXFP4 block, less its scale byte).
//
// The arithmetic is llama.cpp's: doubled, the E2M1 values are the integers v in -12..12 (its kvalues_mxfp4) and
// w = v * 2^(e - 128). Activations are quantized to int8 per block of 32 (quant_rows.h); one vpshufb looks up
// u = v + 12 (0..24, the unsigned operand vpdpbusd and vpmaddubsw take) for 32 codes, so every block gives the exact
// integer s_b = sum u q_x - 12 sum q_x; y = E + O, E the FMA chain over the even blocks, in order, of
// float(s_b) * (d_w * d_x), O the same over the odd ones. Each output is that arithmetic whatever the number of rows
// in the call (from 16 rows, on a CPU with AMX, amx.cpp's tiles compute it), so a verify step reproduces the decode
// steps it replaces bit for bit. Measured on 2 Sapphire Rapids cores at gpt-oss-20b's experts (5760 x 2880): one row
// streams at the memory's speed (24 GB/s), 4 to 15 rows reach ~290 G integer ops/s with VNNI, 16 rows 430 and 64 rows
// 720 on the AMX tiles.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "quant_rows.h"
#include "simd.h"

namespace {

constexpr int64_t FP4_PAIR = 8 + 4 * 32;  // a tile's bytes per pair of blocks: 8 scale bytes, 4 rows x 32 bytes

using fastdecode::block_sums;
using fastdecode::pair_dot;
using fastdecode::prefetch_stream;
using fastdecode::store_pass;

// The pair's 8 scales 2^(e - 128) in (block, row) lanes, as block_sums lays out a pair's sums: e << 23 is the float
// 2^(e - 127) (e = 0: 0, in place of 2^-127), halved exactly.
inline __m256 pair_scales(const uint8_t* w) {
  const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // (row, block) -> (block, row)
  const __m256i e = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)w)), by_block);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f));
}

// MR activation rows against one tile of 4 weight rows, all 4 in one pass over K. xc: the rows' 128 sum(q_x) per pair
// of blocks (quantize_rows), of which the offset's 12 sum(q_x) is 3/32.
template <int MR>
void fp4_pass(const uint8_t* w, int64_t K, const int8_t* xq, const float* xs, const int32_t* xc, int64_t N, int64_t t,
              float* y) {
  const int64_t pairs = K / 64;
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += FP4_PAIR) {
    prefetch_stream(w, FP4_PAIR);
    const __m256 d = pair_scales(w);
    __m256i lo[4], hi[4];
    for (int r = 0; r < 4; ++r) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(w + 8 + 32 * r));
      lo[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(q, low4));
      hi[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
    }
    for (int m = 0; m < MR; ++m) {
      const int8_t* x = xq + m * K + 64 * p;
      const __m256i c = _mm256_loadu_si256((const __m256i*)(xc + (m * pairs + p) * 8));
      const __m256i offset = _mm256_srai_epi32(_mm256_add_epi32(c, _mm256_add_epi32(c, c)), 5);  // 12 sum(q_x)
      const __m256i sums = _mm256_sub_epi32(block_sums(pair_dot(lo[0], hi[0], x), pair_dot(lo[1], hi[1], x),
                                                       pair_dot(lo[2], hi[2], x), pair_dot(lo[3], hi[3], x)),
                                            offset);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_loadu_ps(xs + (m * pairs + p) * 16)),
                               acc[m]);
    }
  }
  store_pass<MR>(acc, nullptr, N, t, y);
}

}  // namespace

namespace fastdecode {

// The tiles from t_first: the rows of x are quantized to int8 per block of 32, then every tile of 4 output rows takes
// all of them in passes (pair_tiles_linear), tiles spread over the threads; a tile (9 KB at K = 2880) stays in L1
// between passes.
void fp4_tiles(const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t t_first, int64_t N,
               const float* B, float* Y) {
  fastdecode::pair_tiles_linear(X, M, K, W, tile_bytes, t_first, N, B, Y,
                                [&](auto rows, const uint8_t* w, const int8_t* xq, const float* xs, const int32_t* xc,
                                    int64_t t, float* y) { fp4_pass<decltype(rows)::value>(w, K, xq, xs, xc, N, t, y); });
}

// w (N/4, K/64, 136) uint8; over AMX_MIN_ROWS rows or more, on a CPU with AMX, the AMX tiles take the blocks of 32
// output rows (the same results, amx.cpp).
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == FP4_PAIR,
              "bad fp4 weight");
  return packed_linear(x, w, bias, w.size(1) * 64, AmxFormat::FP4, fp4_tiles);
}

// MXFP4 blocks -> fp4_linear's tiles (N/4, K/64, 136), written once in one pass: codes (N, K/32, 16) uint8, each
// block's 16 bytes as GGUF holds them (byte j = q[j] | q[j + 16] << 4), scales (N, K/32) E8M0 bytes; rows and blocks
// may be strided (views of the mapped file: a GGUF block is its scale byte, then its 16 code bytes).
void fp4_pack(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 16 && codes.stride(2) == 1,
              "fp4_pack: need (N, K/32, 16) code blocks");
  const int64_t N = codes.size(0), blocks = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.size(0) == N &&
              scales.size(1) == blocks, "fp4_pack: scales must be uint8 (N, K/32)");
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const uint8_t* e = scales.data_ptr<uint8_t>();
  pack_pairs(out, N, blocks, FP4_PAIR, "fp4_pack", [&](uint8_t* o, int r, int b, int64_t row, int64_t block) {
    o[2 * r + b] = e[row * scales.stride(0) + block * scales.stride(1)];
    std::memcpy(o + 8 + 32 * r + 16 * b, q + row * codes.stride(0) + block * codes.stride(1), 16);
  });
}

}  // namespace fastdecode
