// Prompt rows' attention in bf16 products (AVX512-BF16's vdpbf16ps: two bf16 products a lane, summed in float).
//
// A prompt chunk's attention is matrix work, queries x keys x hd twice (QK^T, then PV), which the float kernel of
// decode_step.cpp runs as FMA chains near the float32 FMA peak: at 8k tokens 44% of a 1.5B model's prefill. Here 16
// queries share every instruction, one a lane, and each instruction does two products a lane:
//   scores S^T (keys, 16 queries): for each pair of dimensions, the queries' pairs (one register) times a key's pair
//     (broadcast), so the keys need only rounding to bf16, not transposing;
//   softmax down each lane (a query's keys), masked to the keys it sees;
//   out^T (hd, 16 queries) += P^T pairs (two keys' weights a lane) times two keys' values at one dimension.
// q, k, v and the softmax weights are rounded to bf16 (8 significant bits); sums, maxima, exponentials and the
// normaliser stay float32. A query's result depends only on itself and the keys it sees: its scores are one chain
// over hd, keys of the chunk outside its range have weight 0 (adding 0 x v changes no sum), and the key pairs and
// chunks are aligned to positions. So it is the same whichever queries share its block, whatever the chunking of the
// prompt or the batch around it.
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "prompt_blocks.h"
#include "simd.h"

#define FASTDECODE_BF16 __attribute__((target("avx512bf16")))

namespace fastdecode {

// Whether this CPU has AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later) and FASTDECODE_BF16_ATTENTION is
// not 0 (the float kernel for every row: A/B runs, or a user who wants prompt rows computed as decode rows are).
inline bool prompt_attention_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("FASTDECODE_BF16_ATTENTION");
    return __builtin_cpu_supports("avx512bf16") && !(env && std::strcmp(env, "0") == 0);
  }();
  return ready;
}

constexpr const char* PROMPT_ATTENTION = "bf16";
constexpr int64_t PROMPT_HD_MULTIPLE = 32;  // head sizes the kernel takes
constexpr int64_t LANES = 16;               // queries a register holds

// 16 floats of a cache row (float32 or float16 bits).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Two rows' 16 floats -> 16 dwords, lane i (even[i], odd[i]) in bf16: the pair one vdpbf16ps lane multiplies.
FASTDECODE_BF16 inline __m512i interleave_bf16(__m512 even, __m512 odd) {
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // even's 16, then odd's 16
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
}

// 32 consecutive floats -> 32 bf16 in order (16 dwords: pairs of neighbours).
FASTDECODE_BF16 inline __m512i consecutive_bf16(const __m512 lo, const __m512 hi) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

FASTDECODE_BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// n queries of one KV group (hd floats each, hd % 32 == 0) against the keys of one chunk at a time. A chunk's keys
// are given as cache slots from a first position x0 (pack); each query sees positions [a, e) of it (chunk).
class PromptAttention {
 public:
  FASTDECODE_BF16 PromptAttention(const float* const* q, int64_t n, int64_t hd, float scale)
      : n_(n), hd_(hd), pairs_(hd / 2), scale_(scale) {
    const int64_t blocks = (n + LANES - 1) / LANES;
    // qp: per block of 16 queries, (hd / 2, 16) dwords: pair p of dimensions of lane i's query.
    qp_.assign(blocks * pairs_ * LANES, 0);
    std::vector<uint32_t> row(pairs_);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t d = 0; d < hd; d += 32)
        _mm512_storeu_si512(row.data() + d / 2,
                            consecutive_bf16(_mm512_loadu_ps(q[i] + d), _mm512_loadu_ps(q[i] + d + 16)));
      uint32_t* block = qp_.data() + (i / LANES) * pairs_ * LANES + i % LANES;
      for (int64_t p = 0; p < pairs_; ++p) block[p * LANES] = row[p];
    }
    out_.resize(hd * LANES);
  }

  // The chunk's keys at positions x0 + j, j < count (count % 16 == 0): key j's and value j's rows at cache slot
  // slots[j] of k and v ((slots, hd) each), or zeros where slots[j] < 0.
  template <typename KV>
  FASTDECODE_BF16 void pack(const KV* k, const KV* v, const int64_t* slots, int64_t count) {
    count_ = count;
    keys_.resize(count * pairs_);
    values_.resize(count / 2 * hd_);
    scores_.resize(count * LANES);
    weights_.resize(count / 2 * LANES);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 2) {
      const KV* k0 = slots[j] >= 0 ? k + slots[j] * hd_ : nullptr;
      const KV* k1 = slots[j + 1] >= 0 ? k + slots[j + 1] * hd_ : nullptr;
      const KV* v0 = slots[j] >= 0 ? v + slots[j] * hd_ : nullptr;
      const KV* v1 = slots[j + 1] >= 0 ? v + slots[j + 1] * hd_ : nullptr;
      for (int64_t d = 0; d < hd_; d += 32) {
        _mm512_storeu_si512(keys_.data() + j * pairs_ + d / 2,
                            consecutive_bf16(k0 ? load16(k0 + d) : zero, k0 ? load16(k0 + d + 16) : zero));
        _mm512_storeu_si512(keys_.data() + (j + 1) * pairs_ + d / 2,
                            consecutive_bf16(k1 ? load16(k1 + d) : zero, k1 ? load16(k1 + d + 16) : zero));
      }
      for (int64_t d = 0; d < hd_; d += 16)
        _mm512_storeu_si512(values_.data() + j / 2 * hd_ + d,
                            interleave_bf16(v0 ? load16(v0 + d) : zero, v1 ? load16(v1 + d) : zero));
    }
  }

  // Query i sees the packed keys [a[i], e[i]) (0 <= a, e <= count; none where a >= e) -> parts + i * (hd + 2): the
  // chunk's partial result m (the largest score), l (the sum of e^(score - m)), then o (hd floats, sum of
  // e^(score - m) v). l == 0: the query sees none of the chunk's keys.
  FASTDECODE_BF16 void chunk(const int64_t* a, const int64_t* e, float* parts) {
    // Whole 16s of keys: pairs and blocks stay aligned to positions.
    for_each_block<LANES>(n_, count_, 16, hd_, a, e, parts, [this](int64_t b, auto... rest) {
      block(qp_.data() + b * pairs_ * LANES, rest...);
    });
  }

 private:
  // One block's 16 queries against keys [lo, hi).
  FASTDECODE_BF16 void block(const uint32_t* q, int64_t lo, int64_t hi, const int32_t* first, const int32_t* end,
                             int64_t live, float* out) {
    // Scores, 16 keys at a time: 16 accumulators, one key each, all 16 queries in the lanes.
    const __m512 scale = _mm512_set1_ps(scale_);
    for (int64_t j0 = lo; j0 < hi; j0 += 16) {
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
      const uint32_t* key = keys_.data() + j0 * pairs_;
      for (int64_t p = 0; p < pairs_; ++p) {
        const __m512i qv = _mm512_loadu_si512(q + p * LANES);
        for (int u = 0; u < 16; ++u) acc[u] = dot_pairs(acc[u], qv, _mm512_set1_epi32(key[u * pairs_ + p]));
      }
      for (int u = 0; u < 16; ++u) _mm512_storeu_ps(scores_.data() + (j0 + u) * LANES, _mm512_mul_ps(acc[u], scale));
    }
    // Each lane's softmax over the keys it sees, in key order.
    const __m512i vfirst = _mm512_load_si512(first), vend = _mm512_load_si512(end);
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 m = lowest;
    for (int64_t j = lo; j < hi; ++j) {
      const __m512i vj = _mm512_set1_epi32(static_cast<int32_t>(j));
      const __mmask16 sees = _mm512_cmpge_epi32_mask(vj, vfirst) & _mm512_cmplt_epi32_mask(vj, vend);
      m = _mm512_mask_max_ps(m, sees, m, _mm512_loadu_ps(scores_.data() + j * LANES));
    }
    __m512 l = _mm512_setzero_ps();
    for (int64_t j = lo; j < hi; ++j) {
      const __m512i vj = _mm512_set1_epi32(static_cast<int32_t>(j));
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores_.data() + j * LANES), m);
      // Weights under e^-64 are 0, as in the float kernel (no denormal products).
      const __mmask16 keep = _mm512_cmpge_epi32_mask(vj, vfirst) & _mm512_cmplt_epi32_mask(vj, vend) &
                             _mm512_cmp_ps_mask(x, _mm512_set1_ps(-64.0f), _CMP_GE_OQ);
      const __m512 w = _mm512_maskz_mov_ps(keep, exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))));
      _mm512_storeu_ps(scores_.data() + j * LANES, w);
      l = _mm512_add_ps(l, w);
    }
    for (int64_t j = lo; j < hi; j += 2)
      _mm512_storeu_si512(weights_.data() + j / 2 * LANES,
                          interleave_bf16(_mm512_loadu_ps(scores_.data() + j * LANES),
                                          _mm512_loadu_ps(scores_.data() + (j + 1) * LANES)));
    // out^T, 16 dimensions at a time: per pair of keys, their weights (one register) times their values' pair at
    // each dimension (broadcast).
    for (int64_t d0 = 0; d0 < hd_; d0 += 16) {
      __m512 acc[16];
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
      for (int64_t jp = lo / 2; jp < hi / 2; ++jp) {
        const __m512i w = _mm512_loadu_si512(weights_.data() + jp * LANES);
        const uint32_t* value = values_.data() + jp * hd_ + d0;
        for (int u = 0; u < 16; ++u) acc[u] = dot_pairs(acc[u], w, _mm512_set1_epi32(value[u]));
      }
      for (int u = 0; u < 16; ++u) _mm512_storeu_ps(out_.data() + (d0 + u) * LANES, acc[u]);
    }
    alignas(64) float ms[LANES], ls[LANES];
    _mm512_store_ps(ms, m);
    _mm512_store_ps(ls, l);
    for (int64_t i = 0; i < live; ++i) {
      float* part = out + i * (hd_ + 2);
      part[0] = ms[i], part[1] = first[i] < end[i] ? ls[i] : 0.f;
      for (int64_t d = 0; d < hd_; ++d) part[2 + d] = out_[d * LANES + i];
    }
  }

  int64_t n_, hd_, pairs_;
  float scale_;
  int64_t count_ = 0;
  std::vector<uint32_t> qp_, keys_, values_, weights_;
  std::vector<float> scores_, out_;
};

}  // namespace fastdecode
#endif  // __AVX512F__
