// The int4 and Q4_K / Q5_K matmuls (q4_linear's and kq_linear's packed weights, quant.cpp and kquant.cpp) on AMX
// tiles, for many activation rows at once: a prompt chunk, or a batch of decode and verify rows. Intel's AMX multiplies a 16 x 64-byte int8 tile by a 64 x 16 one into
// 16 x 16 int32 in one instruction, about 8x the products a core makes with VNNI, so over many rows the float work
// around it is what costs.
//
// Bit for bit the arithmetic of the AVX2/VNNI kernels (quant.cpp): per block of 32 an exact integer sum (here one
// tdpbsud of an activation tile, signed, by a weight tile, unsigned, with K = 32), then per output the same FMA chains
// E and O over the even and odd blocks of float(sum) * (d_w * d_x), ME and MO of the mins (m_w * sx added for int4,
// dmin * m * sx subtracted for the K-quants, whose d_w is d * sc), and y = ((E + O) + ME) + MO. So a row's result does not
// depend on which kernel ran it: a prompt chunk and decode steps, a request alone and in a batch, agree exactly.
//
// Per block of 32 outputs (two 16-row weight tiles) a thread unpacks the nibbles of every block of K once into AMX's
// B layout (per 4 consecutive k, the 16 columns' 4 bytes side by side); then per 32 activation rows (two A tiles,
// element order, straight from the quantized rows) each block b takes 4 tdpbsud, whose int32 results are scaled into
// float accumulators in memory (E or O by the parity of b).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "amx.h"
#include "quant_rows.h"

#ifdef __AMX_INT8__
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fastdecode {

#ifdef __AMX_INT8__
namespace {

constexpr int64_t ROWS = 32, COLS = 32;  // activation rows and weight rows per block of outputs: 2 x 2 tiles

// The packed layouts (amx.h's AmxFormat): where block b's nibbles and factors lie in a tile of 4 weight rows.
constexpr int64_t Q4_PAIR = 160;  // quant.cpp's q4 tile: per pair of blocks 8 fp16 d, 8 fp16 m, 4 rows x 32 bytes
constexpr int64_t Q4K_SB = 592, Q5K_SB = 720;  // kquant.cpp's tiles per super-block of 8 blocks

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (int32 16 x 16), for A tile i and B tile j, 2 i + j; 4-5: A (16 rows x 32 int8); 6-7: B (8 x 64 u8).
void configure_tiles() {
  TileConfig cfg;
  for (int c = 0; c < 4; ++c) cfg.rows[c] = 16, cfg.colsb[c] = 64;
  for (int a = 4; a < 6; ++a) cfg.rows[a] = 16, cfg.colsb[a] = 32;
  for (int b = 6; b < 8; ++b) cfg.rows[b] = 8, cfg.colsb[b] = 64;
  _tile_loadconfig(&cfg);
}

// Row 0's 16 bytes of block b's nibbles in a tile (byte e = q[e] | q[e + 16] << 4; row r 32 bytes further).
const uint8_t* nibbles(AmxFormat f, const uint8_t* tile, int64_t b) {
  if (f == AmxFormat::Q4) return tile + b / 2 * Q4_PAIR + 32 + 16 * (b % 2);
  const int64_t sb_bytes = f == AmxFormat::Q4K ? Q4K_SB : Q5K_SB;
  return tile + b / 8 * sb_bytes + (sb_bytes - 512) + 128 * (b % 8 / 2) + 16 * (b % 2);
}

// v[r]: 128-bit lane i = the 16 bytes at p + 32 r of q4 tile i (output column 4 i + r), for 4 tiles.
inline void load_rows(const uint8_t* p, int64_t tile_bytes, __m512i v[4]) {
  for (int r = 0; r < 4; ++r) {
    const uint8_t* row = p + 32 * r;
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)row));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + tile_bytes)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + 2 * tile_bytes)), 2);
    v[r] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + 3 * tile_bytes)), 3);
  }
}

// A 4 x 4 transpose of dwords in each lane: o[kk] = dword kk of the 16 columns, in column order.
inline void transpose(const __m512i v[4], __m512i o[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  o[0] = _mm512_unpacklo_epi64(t0, t2), o[1] = _mm512_unpackhi_epi64(t0, t2);
  o[2] = _mm512_unpacklo_epi64(t1, t3), o[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 16 weight rows (4 tiles from `tile`) of block b -> B (8 rows x 64 bytes): row kk < 4 holds each column's elements
// 4 kk .. 4 kk + 3 (the low nibbles of its bytes 4 kk ..), row 4 + kk its elements 16 + 4 kk .. (the high nibbles),
// so B's k runs over the block's elements in order, as the activations lie. Q5_K adds each value's fifth bit (bit
// 2 p of the fifth-bit byte for the low nibble of pair p's byte, bit 2 p + 1 for the high one, kquant.cpp).
void unpack_b(AmxFormat f, const uint8_t* tile, int64_t tile_bytes, int64_t b, uint8_t* out) {
  __m512i v[4], o[4], lo[4], hi[4];
  load_rows(nibbles(f, tile, b), tile_bytes, v);
  transpose(v, o);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int kk = 0; kk < 4; ++kk)
    lo[kk] = _mm512_and_si512(o[kk], low4), hi[kk] = _mm512_and_si512(_mm512_srli_epi16(o[kk], 4), low4);
  if (f == AmxFormat::Q5K) {
    load_rows(tile + b / 8 * Q5K_SB + 80 + 16 * (b % 2), tile_bytes, v);
    transpose(v, o);
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    const unsigned p = b % 8 / 2;
    for (int kk = 0; kk < 4; ++kk) {
      const __m512i bits = _mm512_srl_epi16(o[kk], _mm_cvtsi32_si128(2 * p));
      lo[kk] = _mm512_or_si512(lo[kk], _mm512_and_si512(_mm512_slli_epi16(bits, 4), bit4));
      hi[kk] = _mm512_or_si512(hi[kk], _mm512_and_si512(_mm512_slli_epi16(bits, 3), bit4));
    }
  }
  for (int kk = 0; kk < 4; ++kk) {
    _mm512_store_si512(out + 64 * kk, lo[kk]);
    _mm512_store_si512(out + 64 * (4 + kk), hi[kk]);
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The float factors of 32 weight rows (8 tiles from `tile`), per block: d_w -> dw[b][n], the mins' -> mw[b][n]
// (int4: m; K-quants: dmin * m), as the VNNI kernels compute them.
void weight_factors(AmxFormat f, const uint8_t* tile, int64_t tile_bytes, int64_t blocks, float* dw, float* mw) {
  for (int64_t t = 0; t < COLS / 4; ++t, tile += tile_bytes)
    for (int r = 0; r < 4; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n = b * COLS + 4 * t + r;
        if (f == AmxFormat::Q4) {  // (row, parity) order per pair
          const uint8_t* head = tile + b / 2 * Q4_PAIR + 2 * (2 * r + b % 2);
          dw[n] = fp16(head);
          mw[n] = fp16(head + 16);
        } else {  // per super-block the 4 rows' d and dmin, then sc and m in (pair, row, parity) order
          const uint8_t* sb = tile + b / 8 * (f == AmxFormat::Q4K ? Q4K_SB : Q5K_SB);
          const int64_t i = b % 8 / 2 * 8 + 2 * r + b % 2;
          dw[n] = fp16(sb + 2 * r) * float(sb[16 + i]);
          mw[n] = fp16(sb + 8 + 2 * r) * float(sb[48 + i]);
        }
      }
}

// Thread-local working memory, 64-byte aligned (tile loads and zmm stores).
struct Scratch {
  std::vector<__m512i> b, c, acc;
  std::vector<float> dw, mw;
  explicit Scratch(int64_t blocks)
      : b(blocks * 2 * 8), c(2 * 4 * 16), acc(2 * ROWS * COLS / 16), dw(blocks * COLS), mw(blocks * COLS) {}
};

bool tiles_permitted() {
  static const bool ready = [] {
    const char* env = std::getenv("FASTDECODE_AMX");
    if (env && std::strcmp(env, "0") == 0) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    // Linux gives the 8 KB tile state only to a process that asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ready;
}

// xq: the rows quantized per block of 32 in element order, padded with zero rows to Mp, a multiple of 32; xd
// (K / 32, Mp) the d_x of each (block, row), zero in the padding; xsx (M, K / 32) each (row, block)'s d_x * sum(q_x).
void tiles_linear(AmxFormat f, const uint8_t* W, int64_t tile_bytes, int64_t K, int64_t n_blocks, const int8_t* xq,
                  const float* xd, const float* xsx, int64_t M, int64_t N, const float* bias, float* Y) {
  const int64_t blocks = K / 32, Mp = (M + 31) / 32 * 32;
  at::parallel_for(0, n_blocks, 1, [&](int64_t nb0, int64_t nb1) {
    configure_tiles();
    Scratch s(blocks);
    uint8_t* bbuf = reinterpret_cast<uint8_t*>(s.b.data());
    int32_t* cbuf = reinterpret_cast<int32_t*>(s.c.data());
    float* acc = reinterpret_cast<float*>(s.acc.data());  // [parity][ROWS][COLS]
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* tiles = W + nb * (COLS / 4) * tile_bytes;
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < 2; ++j) unpack_b(f, tiles + 4 * j * tile_bytes, tile_bytes, b, bbuf + (2 * b + j) * 512);
      weight_factors(f, tiles, tile_bytes, blocks, s.dw.data(), s.mw.data());
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int64_t rows = std::min<int64_t>(ROWS, M - m0);
        std::memset(acc, 0, sizeof(float) * 2 * ROWS * COLS);
        // Block b's tile work is issued before block b - 1's float work, into the other C buffer, so that the
        // tile unit and the vector units run side by side.
        const auto tiles_of = [&](int64_t b, int32_t* c) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          _tile_loadd(4, xq + m0 * K + 32 * b, K);
          _tile_loadd(5, xq + (m0 + 16) * K + 32 * b, K);
          _tile_loadd(6, bbuf + 2 * b * 512, 64);
          _tile_loadd(7, bbuf + (2 * b + 1) * 512, 64);
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_dpbsud(2, 5, 6);
          _tile_dpbsud(3, 5, 7);
          _tile_stored(0, c, 64);
          _tile_stored(1, c + 256, 64);
          _tile_stored(2, c + 512, 64);
          _tile_stored(3, c + 768, 64);
        };
        // acc[parity][row][col] += float(C) * (d_w * d_x), 16 rows of a C tile at a time, all 32 rows (the padding
        // rows' d_x are 0).
        const auto scale_into = [&](int64_t b, const int32_t* cb) {
          float* a = acc + (b % 2) * ROWS * COLS;
          const float* dx = xd + b * Mp + m0;
          for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 2; ++j) {
              const __m512 wv = _mm512_loadu_ps(s.dw.data() + b * COLS + 16 * j);
              const int32_t* c = cb + (2 * i + j) * 256;
              float* out = a + 16 * i * COLS + 16 * j;
              const float* d = dx + 16 * i;
#pragma GCC unroll 16
              for (int r = 0; r < 16; ++r) {
                const __m512 scale = _mm512_mul_ps(wv, _mm512_set1_ps(d[r]));
                _mm512_storeu_ps(out + r * COLS, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)),
                                                                 scale, _mm512_loadu_ps(out + r * COLS)));
              }
            }
        };
        tiles_of(0, cbuf);
        for (int64_t b = 1; b < blocks; ++b) {
          tiles_of(b, cbuf + (b % 2) * 1024);
          scale_into(b - 1, cbuf + ((b - 1) % 2) * 1024);
        }
        scale_into(blocks - 1, cbuf + ((blocks - 1) % 2) * 1024);
        // The mins' chains, then y = ((E + O) + ME) + MO (+ bias).
        for (int64_t r = 0; r < rows; ++r) {
          const float* sx = xsx + (m0 + r) * blocks;
          for (int j = 0; j < 2; ++j) {
            __m512 me = _mm512_setzero_ps(), mo = _mm512_setzero_ps();
            const float* mw = s.mw.data() + 16 * j;
            if (f == AmxFormat::Q4)
              for (int64_t b = 0; b < blocks; b += 2) {
                me = _mm512_fmadd_ps(_mm512_loadu_ps(mw + b * COLS), _mm512_set1_ps(sx[b]), me);
                mo = _mm512_fmadd_ps(_mm512_loadu_ps(mw + (b + 1) * COLS), _mm512_set1_ps(sx[b + 1]), mo);
              }
            else
              for (int64_t b = 0; b < blocks; b += 2) {
                me = _mm512_fnmadd_ps(_mm512_loadu_ps(mw + b * COLS), _mm512_set1_ps(sx[b]), me);
                mo = _mm512_fnmadd_ps(_mm512_loadu_ps(mw + (b + 1) * COLS), _mm512_set1_ps(sx[b + 1]), mo);
              }
            const float* e = acc + r * COLS + 16 * j;
            __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(e), _mm512_loadu_ps(e + ROWS * COLS)),
                                                   me), mo);
            const int64_t n = nb * COLS + 16 * j;
            if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + n));
            _mm512_storeu_ps(Y + (m0 + r) * N + n, y);
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace

bool amx_int8_ready() { return tiles_permitted(); }

void amx_linear(AmxFormat f, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes,
                int64_t n_blocks, int64_t N, const float* bias, float* Y) {
  const int64_t blocks = K / 32, Mp = (M + 31) / 32 * 32;
  std::vector<int8_t> xq(Mp * K, 0);
  std::vector<float> xd(blocks * Mp, 0.0f), xsx(M * blocks);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b)
        _mm256_storeu_si256((__m256i*)(xq.data() + m * K + 32 * b),
                            quantize_block(X + m * K + 32 * b, xd[b * Mp + m], xsx[m * blocks + b]));
  });
  tiles_linear(f, W, tile_bytes, K, n_blocks, xq.data(), xd.data(), xsx.data(), M, N, bias, Y);
}

#else  // a build without AMX (the AVX2 one): never ready, never called

bool amx_int8_ready() { return false; }

void amx_linear(AmxFormat, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*,
                float*) {}

#endif

}  // namespace fastdecode
