// The int4, Q8_0, K-quant and MXFP4 matmuls (the packed weights of quant.cpp, kquant.cpp and fp4.cpp) on AMX tiles,
// for many activation rows at once: a prompt chunk, or a batch of decode and verify rows. Intel's AMX multiplies a
// 16 x 64-byte int8 tile by a 64 x 16 one into 16 x 16 int32 in one instruction, about 8x the products a core makes
// with VNNI, so over many rows the float work around it is what costs.
//
// Bit for bit the arithmetic of the AVX2/VNNI kernels: per unit (a block of 32; Q6_K's sub-block of 16) an exact
// integer sum, here one tdpbsud of an activation tile, signed, by a weight tile, unsigned, with K = the unit (Q6_K's
// -32 offset taken off as 32 * the sum of the unit's activations, Q8_0's +128 as 128 * that sum, MXFP4's +12 as
// 12 * that sum); then per output the same FMA chains of float(sum) * (d_w * d_x), one per class of units: int4,
// Q4_K, Q5_K (quant.cpp) the even and odd blocks E, O, and ME, MO of the mins (m_w * sx added for int4,
// dmin * m * sx subtracted for the K-quants, whose d_w is d * sc), y = ((E + O) + ME) + MO; Q8_0 (quant.cpp's pair
// tiles) and MXFP4 (fp4.cpp) E and O, y = E + O; Q6_K (kquant.cpp) the 8 sub-blocks of a half super-block c0..c7,
// y = ((c0 + c1) + (c4 + c5)) + ((c2 + c3) + (c6 + c7)). So a row's
// result does not depend on which kernel ran it: a prompt chunk and decode steps, a request alone and in a batch,
// agree exactly.
//
// Per block of 32 outputs (two 16-row weight tiles) a thread unpacks the values of every unit of K once into AMX's
// B layout (per 4 consecutive k, the 16 columns' 4 bytes side by side); then per 32 activation rows (two A tiles,
// element order, straight from the quantized rows; a last block of 16 or fewer one tile) each unit takes 4 tdpbsud
// (2), whose int32 results are scaled into float accumulators in memory, one per class.
//
// Without AMX (an AVX-512 CPU such as AMD's Zen 4, or FASTDECODE_AMX=0) the same unpacked B feeds vpdpbusd with each
// activation row's 4 bytes broadcast (vnni_linear): one weight row loaded serves 4 activation rows, against the
// VNNI kernels' unpacking of every weight tile per pair of rows. Measured on a Zen 4 EPYC, 2 threads, 512 rows:
// int4 (Q4_0) 470-560 GOP/s against 310-350, Q4_K 502 against 297, Q5_K 522 / 272, Q6_K 457 / 200, MXFP4 658 / 191;
// vpdpbusd alone (registers only) runs at 813. The rest is the float work that the arithmetic above fixes per unit
// and output (convert, scale, FMA, and the mins' FMA), about 3 operations for every 8 vpdpbusd. The AVX2 build does
// the same with vpmaddubsw: 1.2-1.4x its own many-row kernels (that Zen 4 running the AVX2 build, medians of 7, 64
// and 512 rows).
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "quant_rows.h"

#ifdef __AMX_INT8__
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fastdecode {

namespace {

constexpr int64_t ROWS = 32, COLS = 32;  // activation rows and weight rows per block of outputs: 2 x 2 tiles

// The packed layouts: where a unit's values and factors lie in a tile of 4 weight rows (of the whole K).
constexpr int64_t Q4_PAIR = 160;  // quant.cpp's q4 tile: per pair of blocks 8 fp16 d, 8 fp16 m, 4 rows x 32 bytes
constexpr int64_t Q8_PAIR = 272;  // quant.cpp's q8 pair tile: per pair of blocks 8 fp16 d, 4 rows x 64 bytes
constexpr int64_t FP4_PAIR = 136;  // fp4.cpp's tile: per pair of blocks 8 E8M0 scale bytes, 4 rows x 32 bytes
constexpr int64_t Q4K_SB = 592, Q5K_SB = 720, Q6K_SB = 840;  // kquant.cpp's tiles per super-block of 256

// Per format: the unit of K one integer sum covers, how many accumulator classes, whether mins follow.
template <AmxFormat F> struct Traits {
  static constexpr int64_t UNIT = F == AmxFormat::Q6K ? 16 : 32;
  static constexpr int CLASSES = F == AmxFormat::Q6K ? 8 : 2;
  static constexpr bool MINS = F == AmxFormat::Q4 || F == AmxFormat::Q4K || F == AmxFormat::Q5K;
  static constexpr int64_t B_BYTES = UNIT / 4 * 64;  // a B tile: UNIT / 4 rows of 16 columns x 4 bytes
};

#ifdef __AMX_INT8__
// Tiles 0-3: C (int32 16 x 16), for A tile i and B tile j, 2 i + j; 4-5: A (16 rows x unit int8); 6-7: B (unit / 4
// rows x 64 u8).
void configure_tiles(int64_t unit) {
  TileConfig cfg;
  for (int c = 0; c < 4; ++c) cfg.rows[c] = 16, cfg.colsb[c] = 64;
  for (int a = 4; a < 6; ++a) cfg.rows[a] = 16, cfg.colsb[a] = unit;
  for (int b = 6; b < 8; ++b) cfg.rows[b] = unit / 4, cfg.colsb[b] = 64;
  _tile_loadconfig(&cfg);
}
#endif

// The integer vectors unpack_b rearranges bytes in: 4 tiles' rows at once with AVX-512 (a B row of 16 columns in one
// register), 2 with AVX2 (a B row in two halves of 8 columns). Every operation works within 128-bit lanes, one lane a
// tile, so both builds write the same bytes.
#ifdef __AVX512F__
struct IVec {
  using T = __m512i;
  static constexpr int TILES = 4;
  static T tiles(const uint8_t* row, int64_t tile_bytes) {  // lane i: the 16 bytes at row + i tile_bytes
    T z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)row));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + tile_bytes)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + 2 * tile_bytes)), 2);
    return _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(row + 3 * tile_bytes)), 3);
  }
  static T lo32(T a, T b) { return _mm512_unpacklo_epi32(a, b); }
  static T hi32(T a, T b) { return _mm512_unpackhi_epi32(a, b); }
  static T lo64(T a, T b) { return _mm512_unpacklo_epi64(a, b); }
  static T hi64(T a, T b) { return _mm512_unpackhi_epi64(a, b); }
  static T bytes(char b) { return _mm512_set1_epi8(b); }
  static T lanes(__m128i v) { return _mm512_broadcast_i32x4(v); }
  static T and_(T a, T b) { return _mm512_and_si512(a, b); }
  static T or_(T a, T b) { return _mm512_or_si512(a, b); }
  static T xor_(T a, T b) { return _mm512_xor_si512(a, b); }
  static T srl16(T v, unsigned bits) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(bits)); }
  static T sll16(T v, unsigned bits) { return _mm512_sll_epi16(v, _mm_cvtsi32_si128(bits)); }
  static T shuffle8(T table, T index) { return _mm512_shuffle_epi8(table, index); }
  static void store(uint8_t* p, T v) { _mm512_storeu_si512(p, v); }
};
#else
struct IVec {
  using T = __m256i;
  static constexpr int TILES = 2;
  static T tiles(const uint8_t* row, int64_t tile_bytes) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)row)),
                                   _mm_loadu_si128((const __m128i*)(row + tile_bytes)), 1);
  }
  static T lo32(T a, T b) { return _mm256_unpacklo_epi32(a, b); }
  static T hi32(T a, T b) { return _mm256_unpackhi_epi32(a, b); }
  static T lo64(T a, T b) { return _mm256_unpacklo_epi64(a, b); }
  static T hi64(T a, T b) { return _mm256_unpackhi_epi64(a, b); }
  static T bytes(char b) { return _mm256_set1_epi8(b); }
  static T lanes(__m128i v) { return _mm256_broadcastsi128_si256(v); }
  static T and_(T a, T b) { return _mm256_and_si256(a, b); }
  static T or_(T a, T b) { return _mm256_or_si256(a, b); }
  static T xor_(T a, T b) { return _mm256_xor_si256(a, b); }
  static T srl16(T v, unsigned bits) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits)); }
  static T sll16(T v, unsigned bits) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(bits)); }
  static T shuffle8(T table, T index) { return _mm256_shuffle_epi8(table, index); }
  static void store(uint8_t* p, T v) { _mm256_storeu_si256((__m256i*)p, v); }
};
#endif
using V = IVec::T;

// v[r]: 128-bit lane i = the 16 bytes at p + stride r of tile i (output column 4 i + r), for IVec::TILES tiles.
inline void load_rows(const uint8_t* p, int64_t stride, int64_t tile_bytes, V v[4]) {
  for (int r = 0; r < 4; ++r) v[r] = IVec::tiles(p + stride * r, tile_bytes);
}

// A 4 x 4 transpose of dwords in each lane: o[kk] = dword kk of the lanes' columns, in column order.
inline void transpose(const V v[4], V o[4]) {
  const V t0 = IVec::lo32(v[0], v[1]), t1 = IVec::hi32(v[0], v[1]);
  const V t2 = IVec::lo32(v[2], v[3]), t3 = IVec::hi32(v[2], v[3]);
  o[0] = IVec::lo64(t0, t2), o[1] = IVec::hi64(t0, t2);
  o[2] = IVec::lo64(t1, t3), o[3] = IVec::hi64(t1, t3);
}

// The weight rows of IVec::TILES tiles from `tile`, unit u -> their columns' part of each B row (unpack_b): row kk
// holds each column's elements 4 kk .. 4 kk + 3 of the unit, so B's k runs over the unit's elements in order, as
// the activations lie.
// int4 / Q4_K / Q5_K (block u of 32): rows kk < 4 the low nibbles of the column's bytes 4 kk .., rows 4 + kk the
// high nibbles (byte e = q[e] | q[e + 16] << 4); Q5_K adds each value's fifth bit (bit 2 p of the fifth-bit byte for
// the low nibble of pair p's byte, bit 2 p + 1 for the high one). Q6_K (sub-block u of 16, element e of block i of a
// half): the low nibble (i < 2) or high nibble of ql byte 32 (i % 2) + e, with bits 2 i, 2 i + 1 of qh byte e on top.
template <AmxFormat F>
void unpack_part(const uint8_t* tile, int64_t tile_bytes, int64_t u, uint8_t* out) {
  V v[4], o[4];
  const V low4 = IVec::bytes(0x0F);
  if (F == AmxFormat::Q6K) {
    const int64_t sb = u / 16, h = u % 16 / 8, i = u % 8 / 2, s = u % 2;
    const uint8_t* q = tile + sb * Q6K_SB + 72 + 384 * h;
    V hv[4], ho[4];
    load_rows(q + 32 * (i % 2) + 16 * s, 96, tile_bytes, v);
    load_rows(q + 64 + 16 * s, 96, tile_bytes, hv);
    transpose(v, o);
    transpose(hv, ho);
    const V bits45 = IVec::bytes(0x30);
    for (int kk = 0; kk < 4; ++kk) {
      const V lo = IVec::and_(IVec::srl16(o[kk], 4 * (i / 2)), low4);
      const V hi = IVec::and_(IVec::sll16(IVec::srl16(ho[kk], 2 * i), 4), bits45);
      IVec::store(out + 64 * kk, IVec::or_(lo, hi));
    }
    return;
  }
  if (F == AmxFormat::Q8) {  // per row: int8 elements 0..15 of block u at 16 (u % 2), 16..31 32 bytes on; B: q + 128
    for (int h = 0; h < 2; ++h) {
      load_rows(tile + u / 2 * Q8_PAIR + 16 + 16 * (u % 2) + 32 * h, 64, tile_bytes, v);
      transpose(v, o);
      for (int kk = 0; kk < 4; ++kk) IVec::store(out + 64 * (4 * h + kk), IVec::xor_(o[kk], IVec::bytes(-128)));
    }
    return;
  }
  V lo[4], hi[4];
  const uint8_t* q;
  if (F == AmxFormat::FP4) {  // each code through the table of doubled E2M1 values + 12 (fp4.cpp)
    const V lut = IVec::lanes(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    load_rows(tile + u / 2 * FP4_PAIR + 8 + 16 * (u % 2), 32, tile_bytes, v);
    transpose(v, o);
    for (int kk = 0; kk < 4; ++kk) {
      IVec::store(out + 64 * kk, IVec::shuffle8(lut, IVec::and_(o[kk], low4)));
      IVec::store(out + 64 * (4 + kk), IVec::shuffle8(lut, IVec::and_(IVec::srl16(o[kk], 4), low4)));
    }
    return;
  }
  if (F == AmxFormat::Q4) q = tile + u / 2 * Q4_PAIR + 32 + 16 * (u % 2);
  else q = tile + u / 8 * (F == AmxFormat::Q4K ? Q4K_SB : Q5K_SB) + (F == AmxFormat::Q4K ? 80 : 208) + 128 * (u % 8 / 2) +
           16 * (u % 2);
  load_rows(q, 32, tile_bytes, v);
  transpose(v, o);
  for (int kk = 0; kk < 4; ++kk) lo[kk] = IVec::and_(o[kk], low4), hi[kk] = IVec::and_(IVec::srl16(o[kk], 4), low4);
  if (F == AmxFormat::Q5K) {
    load_rows(tile + u / 8 * Q5K_SB + 80 + 16 * (u % 2), 32, tile_bytes, v);
    transpose(v, o);
    const V bit4 = IVec::bytes(0x10);
    const unsigned p = u % 8 / 2;
    for (int kk = 0; kk < 4; ++kk) {
      const V bits = IVec::srl16(o[kk], 2 * p);
      lo[kk] = IVec::or_(lo[kk], IVec::and_(IVec::sll16(bits, 4), bit4));
      hi[kk] = IVec::or_(hi[kk], IVec::and_(IVec::sll16(bits, 3), bit4));
    }
  }
  for (int kk = 0; kk < 4; ++kk) {
    IVec::store(out + 64 * kk, lo[kk]);
    IVec::store(out + 64 * (4 + kk), hi[kk]);
  }
}

// 16 weight rows (4 tiles from `tile`) of unit u -> B (B_BYTES: UNIT / 4 rows of the 16 columns' 4 bytes).
template <AmxFormat F>
void unpack_b(const uint8_t* tile, int64_t tile_bytes, int64_t u, uint8_t* out) {
  for (int part = 0; part < 4 / IVec::TILES; ++part)
    unpack_part<F>(tile + part * IVec::TILES * tile_bytes, tile_bytes, u, out + part * 16 * IVec::TILES);
}

// The float factors of 32 weight rows (8 tiles from `tile`), per unit: d_w -> dw[u][n], the mins' -> mw[u][n]
// (int4: m; Q4_K, Q5_K: dmin * m), as the VNNI kernels compute them.
template <AmxFormat F>
void weight_factors(const uint8_t* tile, int64_t tile_bytes, int64_t units, float* dw, float* mw) {
  if (F == AmxFormat::Q4 || F == AmxFormat::Q8 || F == AmxFormat::FP4) {
    // A pair of blocks' 8 factors lie in (row, block) order: converted 8 at a time, then each block's 4 rows stored
    // as one run (the scalar loop below took ~0.2 ms of a 1.2 ms call of 16 rows at 5760 x 2880).
    const __m256i by_block = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const int64_t pair_bytes = F == AmxFormat::Q4 ? Q4_PAIR : F == AmxFormat::Q8 ? Q8_PAIR : FP4_PAIR;
    const auto store = [&](float* out, int64_t p, int64_t t, __m256 v) {  // lanes (block, row) -> out[u][4 t + r]
      v = _mm256_permutevar8x32_ps(v, by_block);
      _mm_storeu_ps(out + 2 * p * COLS + 4 * t, _mm256_castps256_ps128(v));
      _mm_storeu_ps(out + (2 * p + 1) * COLS + 4 * t, _mm256_extractf128_ps(v, 1));
    };
    for (int64_t t = 0; t < COLS / 4; ++t, tile += tile_bytes)
      for (int64_t p = 0; p < units / 2; ++p) {
        const uint8_t* head = tile + p * pair_bytes;
        if (F == AmxFormat::FP4) {  // 2^(e - 128), as fp4.cpp's pair_scales makes it
          const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)head));
          store(dw, p, t, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f)));
        } else {
          store(dw, p, t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)head)));
          if (F == AmxFormat::Q4) store(mw, p, t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(head + 16))));
        }
      }
    return;
  }
  for (int64_t t = 0; t < COLS / 4; ++t, tile += tile_bytes)
    for (int r = 0; r < 4; ++r)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t n = u * COLS + 4 * t + r;
        if (F == AmxFormat::Q6K) {  // d per row, int8 sc in (half, row, sub-block of the half) order
          const uint8_t* sb = tile + u / 16 * Q6K_SB;
          dw[n] = fp16(sb + 2 * r) * float(int8_t(sb[8 + 32 * (u % 16 / 8) + 8 * r + u % 8]));
        } else {  // per super-block the 4 rows' d and dmin, then sc and m in (pair, row, parity) order
          const uint8_t* sb = tile + u / 8 * (F == AmxFormat::Q4K ? Q4K_SB : Q5K_SB);
          const int64_t i = u % 8 / 2 * 8 + 2 * r + u % 2;
          dw[n] = fp16(sb + 2 * r) * float(sb[16 + i]);
          mw[n] = fp16(sb + 8 + 2 * r) * float(sb[48 + i]);
        }
      }
}

// Thread-local working memory, 64-byte aligned (tile loads and vector stores).
struct alignas(64) Line {
  uint8_t bytes[64];
};
template <AmxFormat F>
struct Scratch {
  using T = Traits<F>;
  std::vector<Line> b, c, acc;
  std::vector<float> dw, mw;
  explicit Scratch(int64_t units)
      : b(units * 2 * T::B_BYTES / 64), c(2 * 4 * 16), acc(T::CLASSES * ROWS * COLS / 16), dw(units * COLS),
        mw(T::MINS ? units * COLS : 0) {}
};

#ifdef __AMX_INT8__
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
#else
bool tiles_permitted() { return false; }  // the AVX2 build has no tiles
#endif

// The quantized rows: xq (Mp, K) int8 in element order, padded with zero rows to Mp, a multiple of 32; xd (K / 32,
// Mp) the d_x of each (block, row), zero in the padding; xsx (M, K / 32) each (row, block)'s d_x * sum(q_x) (the
// mins' factor); xo (units, Mp) int32: the weights' offset times the sum of each (unit, row)'s values (Q6_K: 32,
// per sub-block of 16; Q8_0: 128, MXFP4: 12, per block).
struct Rows {
  int64_t M, Mp;
  std::vector<int8_t> xq;
  std::vector<float> xd, xsx;
  std::vector<int32_t> xo;
};

// Y's rows m0 .. m0 + rows, columns of block nb <- the class accumulators acc[class][acc_rows][COLS] combined as the
// VNNI kernels combine them: for the formats with mins, their chains (mw: the block's weight factors, x.xsx the rows'),
// then ((E + O) + ME) + MO; Q6_K's 8 classes in hsum's order; + bias.
template <AmxFormat F>
void finish_rows(const float* acc, int64_t acc_rows, int64_t rows, const Rows& x, int64_t m0, const float* mw,
                 int64_t nb, int64_t N, const float* bias, float* Y) {
  using T = Traits<F>;
  const int64_t blocks = int64_t(x.xsx.size()) / x.M;
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < COLS; j += VW) {
      const float* a = acc + r * COLS + j;
      const auto cls = [&](int k) { return vload(a + k * acc_rows * COLS); };
      vecf y;
      if (T::MINS) {  // the mins' chains, then ((E + O) + ME) + MO
        const float* sx = x.xsx.data() + (m0 + r) * blocks;
        const float* mwj = mw + j;
        vecf me = vzero(), mo = vzero();
        for (int64_t b = 0; b < blocks; b += 2) {
          const vecf we = vload(mwj + b * COLS), wo = vload(mwj + (b + 1) * COLS);
          if (F == AmxFormat::Q4) {
            me = vfma(we, vset1(sx[b]), me);
            mo = vfma(wo, vset1(sx[b + 1]), mo);
          } else {
            me = vfnma(we, vset1(sx[b]), me);
            mo = vfnma(wo, vset1(sx[b + 1]), mo);
          }
        }
        y = vadd(vadd(vadd(cls(0), cls(1)), me), mo);
      } else if (T::CLASSES == 2) {
        y = vadd(cls(0), cls(1));
      } else {  // hsum's order over the 8 classes of sub-blocks
        y = vadd(vadd(vadd(cls(0), cls(1)), vadd(cls(4), cls(5))), vadd(vadd(cls(2), cls(3)), vadd(cls(6), cls(7))));
      }
      const int64_t n = nb * COLS + j;
      if (bias) y = vadd(y, vload(bias + n));
      vstore(Y + (m0 + r) * N + n, y);
    }
}

#ifdef __AMX_INT8__
template <AmxFormat F>
void tiles_linear(const uint8_t* W, int64_t tile_bytes, int64_t K, int64_t n_blocks, const Rows& x, int64_t N,
                  const float* bias, float* Y) {
  using T = Traits<F>;
  constexpr int64_t UNIT = T::UNIT, CLASSES = T::CLASSES, B_BYTES = T::B_BYTES;
  const int64_t units = K / UNIT, M = x.M, Mp = x.Mp;
  at::parallel_for(0, n_blocks, 1, [&](int64_t nb0, int64_t nb1) {
    configure_tiles(UNIT);
    Scratch<F> s(units);
    uint8_t* bbuf = reinterpret_cast<uint8_t*>(s.b.data());
    int32_t* cbuf = reinterpret_cast<int32_t*>(s.c.data());
    float* acc = reinterpret_cast<float*>(s.acc.data());  // [class][ROWS][COLS]
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* tiles = W + nb * (COLS / 4) * tile_bytes;
      for (int64_t u = 0; u < units; ++u)
        for (int j = 0; j < 2; ++j) unpack_b<F>(tiles + 4 * j * tile_bytes, tile_bytes, u, bbuf + (2 * u + j) * B_BYTES);
      weight_factors<F>(tiles, tile_bytes, units, s.dw.data(), s.mw.data());
      for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        std::memset(acc, 0, sizeof(float) * CLASSES * ROWS * COLS);
        // Unit u's tile work is issued before unit u - 1's float work, into the other C buffer, so that the tile
        // unit and the vector units run side by side.
        const bool two = M - m0 > 16;  // a last block of 16 rows or fewer takes one A tile
        const auto tiles_of = [&](int64_t u, int32_t* c) {
          const int8_t* a = x.xq.data() + m0 * K + UNIT * u;
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(4, a, K);
          _tile_loadd(6, bbuf + 2 * u * B_BYTES, 64);
          _tile_loadd(7, bbuf + (2 * u + 1) * B_BYTES, 64);
          _tile_dpbsud(0, 4, 6);
          _tile_dpbsud(1, 4, 7);
          _tile_stored(0, c, 64);
          _tile_stored(1, c + 256, 64);
          if (two) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(5, a + 16 * K, K);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(2, c + 512, 64);
            _tile_stored(3, c + 768, 64);
          }
        };
        // acc[class][row][col] += float(C) * (d_w * d_x), 16 rows of a C tile at a time, all 16 or 32 rows (the
        // padding rows' d_x are 0).
        const auto scale_into = [&](int64_t u, const int32_t* cb) {
          float* a = acc + (u % CLASSES) * ROWS * COLS;
          const float* dx = x.xd.data() + u * UNIT / 32 * Mp + m0;
          const int32_t* xo = T::MINS ? nullptr : x.xo.data() + u * Mp + m0;
          for (int i = 0; i < 1 + two; ++i)
            for (int j = 0; j < 2; ++j) {
              const __m512 wv = _mm512_loadu_ps(s.dw.data() + u * COLS + 16 * j);
              const int32_t* c = cb + (2 * i + j) * 256;
              float* out = a + 16 * i * COLS + 16 * j;
#pragma GCC unroll 16
              for (int r = 0; r < 16; ++r) {
                __m512i sums = _mm512_load_si512(c + 16 * r);
                if (!T::MINS) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(xo[16 * i + r]));
                const __m512 scale = _mm512_mul_ps(wv, _mm512_set1_ps(dx[16 * i + r]));
                _mm512_storeu_ps(out + r * COLS,
                                 _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, _mm512_loadu_ps(out + r * COLS)));
              }
            }
        };
        tiles_of(0, cbuf);
        for (int64_t u = 1; u < units; ++u) {
          tiles_of(u, cbuf + (u % 2) * 1024);
          scale_into(u - 1, cbuf + ((u - 1) % 2) * 1024);
        }
        scale_into(units - 1, cbuf + ((units - 1) % 2) * 1024);
        finish_rows<F>(acc, ROWS, std::min<int64_t>(ROWS, M - m0), x, m0, s.mw.data(), nb, N, bias, Y);
      }
    }
    _tile_release();
  });
}
#endif

// The same sums without the tiles (a CPU with AVX-512 VNNI but no AMX, or AMX not permitted), over the same unpacked
// B: VNNI_ROWS activation rows against the block's 32 columns, one vpdpbusd per (row, 16 columns, 4 k) with the
// row's 4 int8 broadcast, so each B row loaded serves every row of the group. A unit's integer sums start at minus
// the offset's share (xo; exact, as the tiles' subtraction) and are scaled into the class accumulators, kept in
// registers for two classes (Q6_K's eight in memory), in the order the tiles' scale_into adds them: bit for bit.
// Against the VNNI kernels of quant.cpp and kquant.cpp, which unpack each weight tile per pair of activation rows,
// the unpacking is paid once per block of 32 columns for all the rows.
// The AVX2 build does the same with vpmaddubsw and vpmaddwd (weights unsigned, activations signed, pairs of products
// summed into int16 then pairs of those into int32): exact while a pair of products stays within int16, which every
// format's values keep (|q| <= 63, |x| <= 127) but Q8_0's q + 128 (tiled_min_rows leaves Q8_0 to quant.cpp there).
// 2 rows against the 32 columns' 4 vectors, the int16 sums widened as late as they stay exact (int16_steps), the
// classes in memory.
#ifdef __AVX512F__
constexpr int64_t VNNI_ROWS = 4;

template <AmxFormat F>
void vnni_rows(const uint8_t* bbuf, const float* dw, const Rows& x, int64_t m0, int64_t K, float* acc) {
  using T = Traits<F>;
  constexpr int64_t UNIT = T::UNIT, CLASSES = T::CLASSES, B_BYTES = T::B_BYTES, R = VNNI_ROWS;
  constexpr bool IN_REGISTERS = CLASSES == 2;
  const int64_t units = K / UNIT, Mp = x.Mp;
  __m512 cls[2][R][2];
  for (int c = 0; c < 2; ++c)
    for (int r = 0; r < R; ++r) cls[c][r][0] = cls[c][r][1] = _mm512_setzero_ps();
  if (!IN_REGISTERS) std::memset(acc, 0, sizeof(float) * CLASSES * R * COLS);
  const auto unit = [&](int64_t u, __m512 (&c)[R][2]) {
    const uint8_t* b = bbuf + 2 * u * B_BYTES;
    const int8_t* xr = x.xq.data() + m0 * K + UNIT * u;
    __m512i sums[R][2];
    for (int r = 0; r < R; ++r)
      sums[r][0] = sums[r][1] = T::MINS ? _mm512_setzero_si512() : _mm512_set1_epi32(-x.xo[u * Mp + m0 + r]);
#pragma GCC unroll 8
    for (int64_t kk = 0; kk < UNIT / 4; ++kk) {
      const __m512i w0 = _mm512_load_si512(b + 64 * kk), w1 = _mm512_load_si512(b + B_BYTES + 64 * kk);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xr + r * K + 4 * kk, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        sums[r][0] = _mm512_dpbusd_epi32(sums[r][0], w0, xv);
        sums[r][1] = _mm512_dpbusd_epi32(sums[r][1], w1, xv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(dw + u * COLS), d1 = _mm512_loadu_ps(dw + u * COLS + 16);
    const float* dx = x.xd.data() + u * UNIT / 32 * Mp + m0;
    for (int r = 0; r < R; ++r) {
      const __m512 dxr = _mm512_set1_ps(dx[r]);
      const __m512 f0 = _mm512_cvtepi32_ps(sums[r][0]), f1 = _mm512_cvtepi32_ps(sums[r][1]);
      if (IN_REGISTERS) {
        c[r][0] = _mm512_fmadd_ps(f0, _mm512_mul_ps(d0, dxr), c[r][0]);
        c[r][1] = _mm512_fmadd_ps(f1, _mm512_mul_ps(d1, dxr), c[r][1]);
      } else {
        float* a = acc + (u % CLASSES * R + r) * COLS;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(f0, _mm512_mul_ps(d0, dxr), _mm512_loadu_ps(a)));
        _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(f1, _mm512_mul_ps(d1, dxr), _mm512_loadu_ps(a + 16)));
      }
    }
  };
  for (int64_t u = 0; u < units; u += 2) {  // units come in pairs (K is a multiple of 64): the classes alternate
    unit(u, cls[0]);
    unit(u + 1, cls[1]);
  }
  if (IN_REGISTERS)
    for (int c = 0; c < 2; ++c)
      for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(acc + (c * R + r) * COLS, cls[c][r][0]);
        _mm512_storeu_ps(acc + (c * R + r) * COLS + 16, cls[c][r][1]);
      }
}
#else
constexpr int64_t VNNI_ROWS = 2;

// How many vpmaddubsw results (pairs of products) one int16 lane can add up exactly: 2 |q|max 127 per step against
// 32767 (q <= 15: 8 steps, a whole unit; Q5_K's 31: 4; MXFP4's doubled values + 12, <= 24: 4; Q6_K's 63: 2).
template <AmxFormat F>
constexpr int64_t int16_steps() {
  return F == AmxFormat::Q6K ? 2 : F == AmxFormat::Q5K || F == AmxFormat::FP4 ? 4 : 8;
}

template <AmxFormat F>
void vnni_rows(const uint8_t* bbuf, const float* dw, const Rows& x, int64_t m0, int64_t K, float* acc) {
  using T = Traits<F>;
  constexpr int64_t UNIT = T::UNIT, CLASSES = T::CLASSES, B_BYTES = T::B_BYTES, R = VNNI_ROWS;
  constexpr int64_t STEPS = std::min<int64_t>(int16_steps<F>(), UNIT / 4);
  const int64_t units = K / UNIT, Mp = x.Mp;
  const __m256i ones = _mm256_set1_epi16(1);
  std::memset(acc, 0, sizeof(float) * CLASSES * R * COLS);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* b = bbuf + 2 * u * B_BYTES;  // per B row: columns 0..15 (64 bytes), then 16..31 B_BYTES on
    const int8_t* xr = x.xq.data() + m0 * K + UNIT * u;
    __m256i sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c)
        sums[r][c] = T::MINS ? _mm256_setzero_si256() : _mm256_set1_epi32(-x.xo[u * Mp + m0 + r]);
    for (int64_t k0 = 0; k0 < UNIT / 4; k0 += STEPS) {
      __m256i pairs[R][4];  // int16 sums of pairs of products, STEPS of them per lane
#pragma GCC unroll 8
      for (int64_t kk = k0; kk < k0 + STEPS; ++kk) {
        __m256i w[4];
        for (int c = 0; c < 4; ++c)
          w[c] = _mm256_load_si256((const __m256i*)(b + c / 2 * B_BYTES + 64 * kk + 32 * (c % 2)));
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xr + r * K + 4 * kk, 4);
          const __m256i xv = _mm256_set1_epi32(quad);
          for (int c = 0; c < 4; ++c) {
            const __m256i p = _mm256_maddubs_epi16(w[c], xv);
            pairs[r][c] = kk == k0 ? p : _mm256_add_epi16(pairs[r][c], p);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) sums[r][c] = _mm256_add_epi32(sums[r][c], _mm256_madd_epi16(pairs[r][c], ones));
    }
    const float* dx = x.xd.data() + u * UNIT / 32 * Mp + m0;
    for (int r = 0; r < R; ++r) {
      const __m256 dxr = _mm256_set1_ps(dx[r]);
      float* a = acc + (u % CLASSES * R + r) * COLS;
      for (int c = 0; c < 4; ++c) {
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(dw + u * COLS + 8 * c), dxr);
        _mm256_storeu_ps(a + 8 * c,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]), scale, _mm256_loadu_ps(a + 8 * c)));
      }
    }
  }
}
#endif

// Spread over the threads by blocks of 32 columns, each unpacked once for all the rows. (Blocks of 32 to 256 rows,
// each column block unpacked again per row block so that the rows stay in L2, measured slower at every shape of the
// 1.5B and 8B models: the rows stream well enough, the unpacking does not repeat for free.)
template <AmxFormat F>
void vnni_linear(const uint8_t* W, int64_t tile_bytes, int64_t K, int64_t n_blocks, const Rows& x, int64_t N,
                 const float* bias, float* Y) {
  using T = Traits<F>;
  const int64_t units = K / T::UNIT, M = x.M;
  at::parallel_for(0, n_blocks, 1, [&](int64_t nb0, int64_t nb1) {
    Scratch<F> s(units);
    uint8_t* bbuf = reinterpret_cast<uint8_t*>(s.b.data());
    float* acc = reinterpret_cast<float*>(s.acc.data());
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint8_t* tiles = W + nb * (COLS / 4) * tile_bytes;
      for (int64_t u = 0; u < units; ++u)
        for (int j = 0; j < 2; ++j)
          unpack_b<F>(tiles + 4 * j * tile_bytes, tile_bytes, u, bbuf + (2 * u + j) * T::B_BYTES);
      weight_factors<F>(tiles, tile_bytes, units, s.dw.data(), s.mw.data());
      for (int64_t m0 = 0; m0 < M; m0 += VNNI_ROWS) {
        vnni_rows<F>(bbuf, s.dw.data(), x, m0, K, acc);
        finish_rows<F>(acc, VNNI_ROWS, std::min<int64_t>(VNNI_ROWS, M - m0), x, m0, s.mw.data(), nb, N, bias, Y);
      }
    }
  });
}
}  // namespace

bool amx_int8_ready() { return tiles_permitted(); }

// From how many activation rows amx_linear takes a matmul's blocks of 32 weight rows in format f: AMX_MIN_ROWS on the
// tiles, else (vpdpbusd, or AVX2's vpmaddubsw, over the tiles' layout) VNNI_MIN_ROWS, unless FASTDECODE_VNNI_TILED=0;
// never Q8_0 in the AVX2 build (its q + 128 would saturate vpmaddubsw's int16 sums).
int64_t tiled_min_rows(AmxFormat f) {
  static const int64_t rows = [] {
    if (tiles_permitted()) return AMX_MIN_ROWS;
    const char* env = std::getenv("FASTDECODE_VNNI_TILED");
    return env && std::strcmp(env, "0") == 0 ? INT64_MAX : VNNI_MIN_ROWS;
  }();
#ifndef __AVX512F__
  if (f == AmxFormat::Q8) return INT64_MAX;  // vpmaddubsw would saturate on q + 128 (vnni_rows)
#endif
  return rows;
}

int64_t amx_linear(AmxFormat f, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t N,
                   const float* bias, float* Y) {
  const int64_t n_blocks = M >= tiled_min_rows(f) ? N / 32 : 0;
  if (n_blocks == 0) return 0;
  const int64_t blocks = K / 32, Mp = (M + 31) / 32 * 32;
  const bool q6 = f == AmxFormat::Q6K;
  const int32_t offset = f == AmxFormat::Q8 ? 128 : f == AmxFormat::FP4 ? 12 : 0;  // per block of 32
  Rows x{M, Mp, std::vector<int8_t>(Mp * K, 0), std::vector<float>(blocks * Mp, 0.0f),
         std::vector<float>(M * blocks), std::vector<int32_t>(q6 ? 2 * blocks * Mp : offset ? blocks * Mp : 0, 0)};
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        int8_t* q = x.xq.data() + m * K + 32 * b;
        int32_t qsum;
        const __m256i qb = quantize_block(X + m * K + 32 * b, x.xd[b * Mp + m], x.xsx[m * blocks + b], qsum);
        _mm256_storeu_si256((__m256i*)q, qb);
        if (offset) x.xo[b * Mp + m] = offset * qsum;
        if (q6)
          for (int h = 0; h < 2; ++h) {
            int32_t sum = 0;
            for (int e = 0; e < 16; ++e) sum += q[16 * h + e];
            x.xo[(2 * b + h) * Mp + m] = 32 * sum;
          }
      }
  });
  const auto run = [&](auto format) {
    constexpr AmxFormat F = decltype(format)::value;
#ifdef __AMX_INT8__
    if (tiles_permitted()) return tiles_linear<F>(W, tile_bytes, K, n_blocks, x, N, bias, Y);
#endif
    vnni_linear<F>(W, tile_bytes, K, n_blocks, x, N, bias, Y);
  };
  switch (f) {
    case AmxFormat::Q4: run(std::integral_constant<AmxFormat, AmxFormat::Q4>{}); break;
    case AmxFormat::Q4K: run(std::integral_constant<AmxFormat, AmxFormat::Q4K>{}); break;
    case AmxFormat::Q5K: run(std::integral_constant<AmxFormat, AmxFormat::Q5K>{}); break;
    case AmxFormat::Q6K: run(std::integral_constant<AmxFormat, AmxFormat::Q6K>{}); break;
    case AmxFormat::Q8: run(std::integral_constant<AmxFormat, AmxFormat::Q8>{}); break;
    case AmxFormat::FP4: run(std::integral_constant<AmxFormat, AmxFormat::FP4>{}); break;
  }
  return n_blocks * 32;
}


}  // namespace fastdecode
