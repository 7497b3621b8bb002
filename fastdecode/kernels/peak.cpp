// The peak rate of the instructions each kernel path is built on, in registers (no memory traffic): the ceiling a
// kernel of this build could reach on this CPU. `fastdecode probe` reports it beside the library GEMMs' measured
// speeds, and the prefill ceiling of the integer formats uses the path their matmuls take. A library GEMM is no
// ceiling on every machine: torch's int8 GEMM (torch._int_mm) falls back to a scalar loop without AVX-512 (2 GOP/s on
// an AVX2 EPYC, whose vpmaddubsw path makes over 100).
//
// Per path, the inner loop of its kernels (amx.cpp, quant_rows.h, decode_step.cpp, attention_bf16.h):
//   int8 AVX2:     vpmaddubsw (32 u8 x s8 products into 16 int16 pair sums) + vpaddw (the int16 accumulation)
//   int8 VNNI:     vpdpbusd, 512-bit (64 products summed into 16 int32)
//   int8 AMX:      tdpbusd (a 16 x 64 by 64 x 16 int8 tile product into 16 x 16 int32)
//   fp32 FMA:      vfmadd (attention, float matmuls)
//   bf16 AVX-512:  vdpbf16ps (prompt attention's bf16 products)
// Each thread runs enough independent chains to cover the instruction's latency for a fixed time; an operand goes
// through an empty asm statement every iteration so the compiler cannot hoist the work out of the loop. A rate
// counts 2 operations per product (multiply and add), as GEMM FLOPs do.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "amx.h"
#include "simd.h"

namespace fastdecode {

namespace {

using Clock = std::chrono::steady_clock;

// Every thread runs `setup` once, then `body` (which does `ops` operations a call) until `seconds` have passed; the
// rate is the operations of all threads over the longest thread's time, in G/s.
template <typename Body, typename Setup = void (*)()>
double rate(double seconds, double ops, Body body, Setup setup = [] {}) {
  const int threads = at::get_num_threads();
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> longest_ns{0};
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      setup();
      const auto start = Clock::now();
      int64_t n = 0;
      do {
        for (int i = 0; i < 16; ++i) body();
        n += 16;
      } while (std::chrono::duration<double>(Clock::now() - start).count() < seconds);
      const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
      calls += n;
      for (int64_t seen = longest_ns.load(); ns > seen && !longest_ns.compare_exchange_weak(seen, ns);) {}
    }
  });
  return static_cast<double>(calls.load()) * ops / static_cast<double>(longest_ns.load());
}

template <typename V>
inline void opaque(V& v) { asm volatile("" : "+x"(v)); }

constexpr int CHAINS = 12;  // latency 4-5 cycles x up to 2 a cycle, with room
constexpr int REPS = 64;     // iterations of every chain a call, in registers

double int8_avx2(double seconds) {
  return rate(seconds, REPS * CHAINS * 32 * 2, [] {
    __m256i acc[CHAINS], x = _mm256_set1_epi8(3);
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_set1_epi8(static_cast<char>(c));
    for (int r = 0; r < REPS; ++r) {
      opaque(x);
      for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(acc[c], x));
    }
    for (int c = 0; c < CHAINS; ++c) opaque(acc[c]);
  });
}

double fp32_fma(double seconds) {
  return rate(seconds, REPS * CHAINS * VW * 2, [] {
    vecf acc[CHAINS], a = vset1(0.999f), b = vset1(1e-7f);
    for (int c = 0; c < CHAINS; ++c) acc[c] = vset1(static_cast<float>(c));
    for (int r = 0; r < REPS; ++r) {
      opaque(a);
      for (int c = 0; c < CHAINS; ++c) acc[c] = vfma(acc[c], a, b);
    }
    for (int c = 0; c < CHAINS; ++c) opaque(acc[c]);
  });
}

#ifdef __AVX512F__
double int8_vnni(double seconds) {
  return rate(seconds, REPS * CHAINS * 64 * 2, [] {
    __m512i acc[CHAINS], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_epi32(c);
    for (int r = 0; r < REPS; ++r) {
      opaque(x);
      for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], w, x);
    }
    for (int c = 0; c < CHAINS; ++c) opaque(acc[c]);
  });
}

// (A lambda does not inherit its function's target: the chains live in a function of their own.)
__attribute__((target("avx512bf16"))) void bf16_chains() {
  __m512 acc[CHAINS];
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (int r = 0; r < REPS; ++r) {
    opaque(a);
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  for (int c = 0; c < CHAINS; ++c) opaque(acc[c]);
}

double bf16_dot(double seconds) { return rate(seconds, REPS * CHAINS * 32 * 2, bf16_chains); }
#endif

#ifdef __AMX_INT8__
// Tiles 0-3 C (16 x 16 int32), 4-5 A (16 x 64 int8), 6-7 B (16 x 64 u8): 4 independent products a call, as amx.cpp's
// blocks of 2 x 2 tiles. The configuration is set per run: amx.cpp's calls set their own on the same threads.
double int8_amx(double seconds) {
  return rate(
      seconds, REPS * 4.0 * 16 * 16 * 64 * 2,
      [] {
        for (int r = 0; r < REPS; ++r) {
          _tile_dpbusd(0, 4, 6);
          _tile_dpbusd(1, 4, 7);
          _tile_dpbusd(2, 5, 6);
          _tile_dpbusd(3, 5, 7);
        }
      },
      [] {
        TileConfig cfg;
        for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        alignas(64) static const int8_t values[16 * 64] = {1, 2, 3};
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, values, 64);
        _tile_loadd(5, values, 64);
        _tile_loadd(6, values, 64);
        _tile_loadd(7, values, 64);
      });
}
#endif

}  // namespace

std::map<std::string, double> instruction_peaks(double seconds) {
  std::map<std::string, double> peaks;
  peaks["fp32 fma"] = fp32_fma(seconds);
#ifdef __AVX512F__
  peaks["int8 vnni"] = int8_vnni(seconds);
  if (__builtin_cpu_supports("avx512bf16")) peaks["bf16 avx512"] = bf16_dot(seconds);
#else
  peaks["int8 avx2"] = int8_avx2(seconds);
#endif
#ifdef __AMX_INT8__
  if (amx_int8_ready()) peaks["int8 amx"] = int8_amx(seconds);
#endif
  return peaks;
}

}  // namespace fastdecode
