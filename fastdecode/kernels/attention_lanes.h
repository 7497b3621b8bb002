// Prompt rows' attention in the AVX2 build (no AVX-512: the AVX2-only EPYCs), float32 products with 8 queries a
// vector, one a lane: the layout of attention_bf16.h without bf16 (AVX2 has no bf16 dot product).
//
// The float kernel of decode_step.cpp gives each query its own dot products: per key a row of hd floats converted from
// the cache's float16 and multiplied by 2 queries at most, then summed across lanes. A prompt chunk has many queries
// per KV group (heads x tokens), so here each chunk's keys and values are converted to float32 once, and then every
// instruction serves 8 queries, and each broadcast of a key's or a value's element two instructions (blocks of 16
// queries, two registers):
//   scores S^T (keys, 16 queries): for each dimension, the queries' values (two registers) times a key's (broadcast);
//   softmax down each lane (a query's keys), masked to the keys it sees;
//   out^T (hd, 16 queries) += a key's weights (two registers) times its value at one dimension (broadcast).
// Measured on an AVX2 EPYC (Zen 1), 2 threads: see docs/engine.md. Everything stays float32; only the order of the
// sums differs from the float kernel's, so prompt rows agree with it to float rounding, not bit for bit. A query's
// result depends only on itself and the keys it sees: its scores are one FMA chain over hd, keys of the chunk outside
// its range have weight 0 (adding 0 x v changes no sum), and blocks are aligned to positions; so it is the same
// whichever queries share its block, however the prompt is chunked, whatever the batch around it.
#pragma once
#ifndef __AVX512F__
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "prompt_blocks.h"
#include "simd.h"

namespace fastdecode {

// Whether prompt rows take this kernel: FASTDECODE_PROMPT_ATTENTION not 0 (0: the float kernel for every row, for A/B
// runs, or a user who wants prompt rows computed as decode rows are).
inline bool prompt_attention_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("FASTDECODE_PROMPT_ATTENTION");
    return !(env && std::strcmp(env, "0") == 0);
  }();
  return ready;
}

constexpr const char* PROMPT_ATTENTION = "float32 lanes";
constexpr int64_t PROMPT_HD_MULTIPLE = 8;  // head sizes the kernel takes
constexpr int64_t LANES = 8;               // queries a register holds
constexpr int64_t BLOCK = 2 * LANES;       // queries a block computes together

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Lanes i with first[i] <= j < end[i], as all-ones.
inline __m256 sees(int64_t j, __m256i first, __m256i end) {
  const __m256i vj = _mm256_set1_epi32(static_cast<int32_t>(j));
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(first, vj), _mm256_cmpgt_epi32(end, vj)));
}

// n queries of one KV group (hd floats each, hd % 8 == 0) against the keys of one chunk at a time. A chunk's keys are
// given as cache slots from a first position x0 (pack); each query sees positions [a, e) of it (chunk).
class PromptAttention {
 public:
  PromptAttention(const float* const* q, int64_t n, int64_t hd, float scale)
      : n_(n), hd_(hd), scale_(scale) {
    qt_.assign((n + BLOCK - 1) / BLOCK * hd * BLOCK, 0.f);  // per block of 16 queries, (hd, 16): dimension d of query i of the block
    for (int64_t i = 0; i < n; ++i) {
      float* block = qt_.data() + (i / BLOCK) * hd * BLOCK + i % BLOCK;
      for (int64_t d = 0; d < hd; ++d) block[d * BLOCK] = q[i][d];
    }
    out_.resize(hd * BLOCK);
  }

  // The chunk's keys at positions x0 + j, j < count (count % 8 == 0): key j's and value j's rows at cache slot
  // slots[j] of k and v ((slots, hd) each), or zeros where slots[j] < 0.
  template <typename KV>
  void pack(const KV* k, const KV* v, const int64_t* slots, int64_t count) {
    count_ = count;
    keys_.resize(count * hd_);
    values_.resize(count * hd_);
    scores_.resize(count * BLOCK);
    for (int64_t j = 0; j < count; ++j) {
      float* kj = keys_.data() + j * hd_;
      float* vj = values_.data() + j * hd_;
      if (slots[j] < 0) {
        std::fill(kj, kj + hd_, 0.f), std::fill(vj, vj + hd_, 0.f);
        continue;
      }
      const KV* ks = k + slots[j] * hd_;
      const KV* vs = v + slots[j] * hd_;
      for (int64_t d = 0; d < hd_; d += 8) _mm256_storeu_ps(kj + d, load8(ks + d)), _mm256_storeu_ps(vj + d, load8(vs + d));
    }
  }

  // Query i sees the packed keys [a[i], e[i]) (0 <= a, e <= count; none where a >= e) -> parts + i * (hd + 2): the
  // chunk's partial result m (the largest score), l (the sum of e^(score - m)), then o (hd floats, sum of
  // e^(score - m) v). l == 0: the query sees none of the chunk's keys.
  void chunk(const int64_t* a, const int64_t* e, float* parts) {
    for_each_block<BLOCK>(n_, count_, 8, hd_, a, e, parts, [this](int64_t b, auto... rest) {
      block(qt_.data() + b * hd_ * BLOCK, rest...);
    });
  }

 private:
  // One block's 16 queries against keys [lo, hi).
  void block(const float* q, int64_t lo, int64_t hi, const int32_t* first, const int32_t* end, int64_t live,
             float* out) {
    // Scores, 4 keys at a time: 4 x 2 accumulators, a key's for each half of the block.
    const __m256 scale = _mm256_set1_ps(scale_);
    for (int64_t j0 = lo; j0 < hi; j0 += 4) {
      __m256 acc[4][2];
      for (int u = 0; u < 4; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
      const float* key = keys_.data() + j0 * hd_;
      for (int64_t d = 0; d < hd_; ++d) {
        const __m256 q0 = _mm256_loadu_ps(q + d * BLOCK), q1 = _mm256_loadu_ps(q + d * BLOCK + LANES);
        for (int u = 0; u < 4; ++u) {
          const __m256 kd = _mm256_broadcast_ss(key + u * hd_ + d);
          acc[u][0] = _mm256_fmadd_ps(q0, kd, acc[u][0]);
          acc[u][1] = _mm256_fmadd_ps(q1, kd, acc[u][1]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_ps(scores_.data() + (j0 + u) * BLOCK + h * LANES, _mm256_mul_ps(acc[u][h], scale));
    }
    // Each lane's softmax over the keys it sees, in key order.
    alignas(32) float ms[BLOCK], ls[BLOCK];
    for (int h = 0; h < 2; ++h) {
      const __m256i vfirst = _mm256_load_si256(reinterpret_cast<const __m256i*>(first + h * LANES));
      const __m256i vend = _mm256_load_si256(reinterpret_cast<const __m256i*>(end + h * LANES));
      float* s = scores_.data() + h * LANES;
      __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = lo; j < hi; ++j)
        m = _mm256_blendv_ps(m, _mm256_max_ps(m, _mm256_loadu_ps(s + j * BLOCK)), sees(j, vfirst, vend));
      __m256 l = _mm256_setzero_ps();
      for (int64_t j = lo; j < hi; ++j) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j * BLOCK), m);
        // Weights under e^-64 are 0, as in the float kernel (no denormal products); lanes that do not see key j, 0
        // (their x may be inf or NaN: the mask clears every bit).
        const __m256 keep =
            _mm256_and_ps(sees(j, vfirst, vend), _mm256_cmp_ps(x, _mm256_set1_ps(-64.0f), _CMP_GE_OQ));
        const __m256 w = _mm256_and_ps(keep, exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))));
        _mm256_storeu_ps(s + j * BLOCK, w);
        l = _mm256_add_ps(l, w);
      }
      _mm256_store_ps(ms + h * LANES, m);
      _mm256_store_ps(ls + h * LANES, l);
    }
    // out^T, 4 dimensions at a time: per key, its weights (two registers) times its value at each dimension
    // (broadcast).
    for (int64_t d0 = 0; d0 < hd_; d0 += 4) {
      __m256 acc[4][2];
      for (int u = 0; u < 4; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
      for (int64_t j = lo; j < hi; ++j) {
        const __m256 w0 = _mm256_loadu_ps(scores_.data() + j * BLOCK);
        const __m256 w1 = _mm256_loadu_ps(scores_.data() + j * BLOCK + LANES);
        const float* value = values_.data() + j * hd_ + d0;
        for (int u = 0; u < 4; ++u) {
          const __m256 vd = _mm256_broadcast_ss(value + u);
          acc[u][0] = _mm256_fmadd_ps(w0, vd, acc[u][0]);
          acc[u][1] = _mm256_fmadd_ps(w1, vd, acc[u][1]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out_.data() + (d0 + u) * BLOCK + h * LANES, acc[u][h]);
    }
    for (int64_t i = 0; i < live; ++i) {
      float* part = out + i * (hd_ + 2);
      part[0] = ms[i], part[1] = first[i] < end[i] ? ls[i] : 0.f;
      for (int64_t d = 0; d < hd_; ++d) part[2 + d] = out_[d * BLOCK + i];
    }
  }

  int64_t n_, hd_;
  float scale_;
  int64_t count_ = 0;
  std::vector<float> qt_, keys_, values_, scores_, out_;
};

}  // namespace fastdecode
#endif  // !__AVX512F__
