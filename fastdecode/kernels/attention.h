// Attention over the paged KV cache for forward_batch (decode_step.cpp): every row of a batch -- decode steps,
// verify trees, prompt chunks -- against the keys it may see, in chunks of keys folded in one order, so a row's result
// does not depend on its batch, its chunking or the threads. Prompt rows may take attend_prompt's kernel
// (attention_bf16.h, attention_lanes.h). Included by decode_step.cpp alone: its helpers keep internal linkage.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "attention_bf16.h"
#include "attention_lanes.h"
#include "simd.h"

namespace fastdecode {
namespace {

// e^x for x <= 0 (scores minus their maximum): e^-87 is 0 next to the maximum's 1.
inline __m256 exp_nonpositive(__m256 x) { return exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.0f))); }

// The KV cache holds float32 or float16 (its bits as uint16_t, converted with F16C): one attention kernel reads either,
// VW values at a time.
inline vecf vload_kv(const float* p) { return vload(p); }
#ifdef __AVX512F__
inline vecf vload_kv(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
inline vecf vload_kv(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline float load1(float x) { return x; }
inline float load1(uint16_t x) { return _cvtsh_ss(x); }

// Attention in chunks of keys (as flash-decoding does). A query's visible keys, in position order, fall into chunks
// of KEY_CHUNK positions aligned at multiples of KEY_CHUNK. A chunk gives a partial result: the scores' maximum m,
// l = sum of e^(score - m) and o = sum of e^(score - m) * value; the partials fold left, in chunk order, into the
// output o / l. The chunks of one query may be computed by different threads, so a decode step of one sequence
// keeps every thread busy and each KV group's keys are read once. A query's arithmetic depends only on its own
// visible keys (every key's score is one FMA chain and the same horizontal sum, every output element one FMA chain
// over a chunk's keys in order, then the same fold), never on the number of tokens in the call, the queries that share
// a work item or the threads, so a token's result is the same in a decode step, a verify step or a prefill chunk,
// alone or in a batch.
constexpr int64_t KEY_CHUNK = 256;  // 256 keys of 64 halves: 32 KB of keys, 32 KB of values, read from L1/L2

// The lane sums of 4 vectors, (sum a0, ..., sum a3), each added as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// One vector's lane sum in the order of hsum4's.
inline float hsum1(vecf a) {
  const __m256 h = halve(a);
  return _mm_cvtss_f32(hsum4(h, h, h, h));
}

// What a run of keys asks memory for while its scores are computed, a few lines per key rather than a block at once
// (a block's 64 or more prefetches at once filled the line-fill buffers, and the core waited on them): with key i,
// key i of the next run (its key, needed next) and the value of key i of this run (needed after the chunk's softmax,
// so into L2).
struct RunPrefetch {
  const char *next_k, *v;  // nullptr: none
  int64_t next_n, v_n, row_bytes;
  void keys(int64_t i, int64_t n) const {
    for (int64_t e = std::min(i + n, next_n); i < e; ++i) prefetch(next_k + i * row_bytes, row_bytes);
  }
  void values(int64_t i, int64_t n) const {
    for (int64_t e = std::min(i + n, v_n); i < e; ++i) prefetch<_MM_HINT_T1>(v + i * row_bytes, row_bytes);
  }
};

// p[r][i] = (q[r] . key i) * scale for NQ queries and n keys, key i at k + slot(i) * hd (hd % VW == 0). Two queries
// over four keys are eight independent FMA chains, enough to keep both FMA units busy through their latency, and the
// four keys' sums come out of one transposing reduction.
template <int NQ, typename KV, typename Slot>
void scores(const float* const* q, const KV* k, Slot slot, int64_t n, int64_t hd, float scale, float* const* p,
            const RunPrefetch& pf) {
  constexpr int NK = 4;
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + NK <= n; i += NK) {
    pf.keys(i, NK);
    pf.values(i, NK);
    const KV* key[NK];
    for (int b = 0; b < NK; ++b) key[b] = k + slot(i + b) * hd;
    vecf a[NQ][NK];
    for (int r = 0; r < NQ; ++r)
      for (int b = 0; b < NK; ++b) a[r][b] = vzero();
    for (int64_t d = 0; d < hd; d += VW) {
      vecf qd[NQ];
      for (int r = 0; r < NQ; ++r) qd[r] = vload(q[r] + d);
      for (int b = 0; b < NK; ++b) {
        const vecf kd = vload_kv(key[b] + d);
        for (int r = 0; r < NQ; ++r) a[r][b] = vfma(qd[r], kd, a[r][b]);
      }
    }
    for (int r = 0; r < NQ; ++r)
      _mm_storeu_ps(p[r] + i, _mm_mul_ps(hsum4(halve(a[r][0]), halve(a[r][1]), halve(a[r][2]), halve(a[r][3])), vscale));
  }
  pf.keys(i, pf.next_n - i);  // the rest of a longer next run, and the last few values
  pf.values(i, n - i);
  for (; i < n; ++i) {
    const KV* ki = k + slot(i) * hd;
    for (int r = 0; r < NQ; ++r) {
      vecf a = vzero();
      for (int64_t d = 0; d < hd; d += VW) a = vfma(vload(q[r] + d), vload_kv(ki + d), a);
      p[r][i] = hsum1(a) * scale;
    }
  }
}

// The largest of a vector's 8 lanes.
inline float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// p[0..n) <- e^(p - m), in place, with m = max p (p has room for a whole last vector; lanes past n become 0); l <- their
// sum.
void softmax_part(float* p, int64_t n, float& m, float& l) {
  // The maximum in vectors: as a scalar chain (the compiler keeps std::max's order) it took 4 cycles a key, more than
  // the exponentials. A maximum is the same in any order; where it is a zero its sign changes no difference below.
  const float lowest = -std::numeric_limits<float>::infinity();
#ifdef __AVX512F__
  __m512 vmax = _mm512_set1_ps(lowest);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(p + j));
  if (j < n) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(_mm512_set1_ps(lowest), (1u << (n - j)) - 1, p + j));
  m = _mm512_reduce_max_ps(vmax);
#else
  __m256 vmax = _mm256_set1_ps(lowest);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + j));
  m = hmax(vmax);
  for (; j < n; ++j) m = std::max(m, p[j]);
#endif
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  j = 0;
#ifdef __AVX512F__
  // 16 at a time where the build has 16-float vectors, the sum still taken 8 lanes at a time in the same order
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(p + j), _mm512_set1_ps(m));
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-64.0f), _CMP_GE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))));
    _mm512_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(_mm256_add_ps(vsum, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
#endif
  for (; j < n; j += 8) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(p + j), vm);
    // Weights under e^-64 are exactly 0: beside the maximum's 1 no float sum can see them, and kept (e^-87 at the
    // least) their products with the values are denormal floats, which cost a microcode assist each (a 4k-token
    // prefill of random weights ran 1.4x slower).
    const __m256 keep = _mm256_and_ps(live, _mm256_cmp_ps(x, _mm256_set1_ps(-64.0f), _CMP_GE_OQ));
    const __m256 e = _mm256_and_ps(keep, exp_nonpositive(x));
    _mm256_storeu_ps(p + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  l = hsum(vsum);
}

// out[r] (hd) += sum over i of p[r][i] * value i (at v + slot(i) * hd) for NQ queries, each element's chain continuing
// in i order; each value vector is read once for all NQ queries. NV vectors (VW floats each) of each out in registers
// at a time (hd % (VW NV) == 0).
template <int NQ, int NV, typename KV, typename Slot>
void accumulate(const float* const* p, const KV* v, Slot slot, int64_t n, int64_t hd, float* const* out) {
  for (int64_t d0 = 0; d0 < hd; d0 += VW * NV) {
    vecf acc[NQ][NV];
    for (int r = 0; r < NQ; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = vload(out[r] + d0 + VW * c);
    for (int64_t i = 0; i < n; ++i) {
      vecf pi[NQ];
      for (int r = 0; r < NQ; ++r) pi[r] = vset1(p[r][i]);
      const KV* vi = v + slot(i) * hd + d0;
      for (int c = 0; c < NV; ++c) {
        const vecf vc = vload_kv(vi + VW * c);
        for (int r = 0; r < NQ; ++r) acc[r][c] = vfma(pi[r], vc, acc[r][c]);
      }
    }
    for (int r = 0; r < NQ; ++r)
      for (int c = 0; c < NV; ++c) vstore(out[r] + d0 + VW * c, acc[r][c]);
  }
}

// Which keys a query sees, in position order: the logical cache positions [first, last) of its sequence, read through
// the sequence's block table, then (in a token tree being verified) the new tokens of its tree that are its ancestors,
// at their own slots (`tail`), whose positions run from tail_at. A chain's new tokens are already written at logical
// positions ctx, ctx + 1, ..., so a chain's query reads them through the table like the cache before it: [first, its
// own position + 1). A tree query sees [first, ctx) and its ancestors: the same keys at the same positions that a
// decode step at its position would see once the accepted path sits at ctx, ctx + 1, ...
struct Visible {
  int64_t first, last, tail_at;
  std::vector<int64_t> tail;
  int64_t end() const { return tail.empty() ? last : tail_at + static_cast<int64_t>(tail.size()); }
  // Whether the keys are one run of positions, [start(), end()): always so for a causal chain's rows, whose new
  // tokens sit at the table's slots for their positions.
  bool contiguous() const { return first == last || tail.empty() || last == tail_at; }
  int64_t start() const { return first < last ? first : tail_at; }
};

// One sequence's rows [r0, r1) of the batch, with ctx tokens already in the cache and its block table.
struct SeqRows {
  int64_t r0, r1, ctx;
  const int64_t* table;
};

Visible visible_keys(int64_t t, const SeqRows& s, const int64_t* positions, const int64_t* slots, const bool* mask,
                     int64_t R, int64_t window) {
  const int64_t pos = positions[t];
  if (!mask) {
    const int64_t last = s.ctx + (t - s.r0) + 1;
    return {window ? std::max<int64_t>(0, pos - window + 1) : 0, last, last, {}};
  }
  Visible out{window ? std::min(s.ctx, std::max<int64_t>(0, pos - window + 1)) : 0, s.ctx, s.ctx, {}};
  for (int64_t j = s.r0; j < s.r1; ++j)
    if (mask[t * R + j] && (!window || pos - positions[j] < window)) {
      if (out.tail.empty()) out.tail_at = positions[j];
      out.tail.push_back(slots[j]);
    }
  return out;
}

// Logical position a of a sequence -> its physical cache slot.
inline int64_t physical(const SeqRows& s, int64_t block_size, int64_t a) {
  return s.table[a / block_size] * block_size + a % block_size;
}

// Contiguous slots [first, first + n) of the cache (n = 0: none).
struct SlotRange {
  int64_t first, n;
};

// The keys of chunk c that query s sees, as runs of slots: f(slot, j, n, next) for the chunk's keys j..j + n, at slots
// slot(0..n); next: the run through the table after this one, this chunk's or the next one's (for prefetching). Runs
// never cross a block, so a run through the table is contiguous in memory. Returns the key count.
template <typename F>
int64_t walk_chunk(const Visible& s, const SeqRows& sr, int64_t block_size, int64_t c, F f) {
  const int64_t lo = c * KEY_CHUNK, hi = lo + KEY_CHUNK;
  const auto run_at = [&](int64_t x) {  // the run through the table from position x (< s.last)
    return SlotRange{physical(sr, block_size, x), std::min(s.last, (x / block_size + 1) * block_size) - x};
  };
  int64_t j = 0;
  for (int64_t x = std::max(lo, s.first), e = std::min(hi, s.last); x < e;) {
    const int64_t y = std::min(e, (x / block_size + 1) * block_size), base = physical(sr, block_size, x);
    const int64_t after = y < e ? y : std::max(hi, s.first);
    f([base](int64_t i) { return base + i; }, j, y - x, after < s.last ? run_at(after) : SlotRange{0, 0});
    j += y - x;
    x = y;
  }
  const int64_t a = std::max(lo, s.tail_at), e = std::min(hi, s.end());
  if (!s.tail.empty() && a < e) {
    const int64_t* tail = s.tail.data() + (a - s.tail_at);
    f([tail](int64_t i) { return tail[i]; }, j, e - a, SlotRange{0, 0});
    j += e - a;
  }
  return j;
}

// A query's partial result over one chunk: m, l and o (hd floats, not yet divided by l). l == 0: the query sees no
// key of the chunk.
struct Partial {
  float m, l;
  float* o;
};

// state <- the left fold of partial `c` into it (e^(m - max) and e^(m_c - max) rescale both sides); the first partial
// is taken as it is.
void fold(Partial& state, const Partial& c, int64_t hd, bool first) {
  if (first) {
    state.m = c.m, state.l = c.l;
    std::copy(c.o, c.o + hd, state.o);
    return;
  }
  // e^(m - max) and e^(m_c - max): one of them is e^0 = 1 exactly, so one exp will do.
  const float m = std::max(state.m, c.m);
  const float a = state.m == m ? 1.f : std::exp(state.m - m), b = c.m == m ? 1.f : std::exp(c.m - m);
  state.m = m, state.l = state.l * a + c.l * b;
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  int64_t d = 0;
  for (; d + 8 <= hd; d += 8)
    _mm256_storeu_ps(state.o + d, _mm256_fmadd_ps(_mm256_loadu_ps(c.o + d), vb,
                                                  _mm256_mul_ps(_mm256_loadu_ps(state.o + d), va)));
  for (; d < hd; ++d) state.o[d] = std::fma(c.o[d], b, state.o[d] * a);
}

// out (hd) <- o / (l + e^(sink - m)): the sink's term (none: -inf, whose term is 0) joins the denominator.
void finish(const Partial& s, int64_t hd, float sink, float* out) {
  const float inv = 1.f / (s.l + std::exp(sink - s.m));
  for (int64_t d = 0; d < hd; ++d) out[d] = s.o[d] * inv;
}

// NQ queries that see the same keys of chunk c -> their partials (p: NQ rows of KEY_CHUNK + 8 floats of scratch).
template <int NQ, int NV, typename KV>
void chunk_part(const float* const* q, const Visible& s, const KV* k, const KV* v, const SeqRows& sr,
                int64_t block_size, int64_t hd, float scale, int64_t c, float* const* p, Partial* part) {
  const int64_t row_bytes = hd * sizeof(KV);
  const int64_t n = walk_chunk(s, sr, block_size, c, [&](auto slot, int64_t j, int64_t cnt, SlotRange next) {
    // The KV cache is read from memory, a block (a page) at a time: the next run's keys and this run's values are
    // asked for while this run's scores are computed (RunPrefetch), the very first keys at once.
    const bool contiguous = slot(cnt - 1) == slot(0) + cnt - 1;  // (a tree's tail may not be)
    if (contiguous && j == 0) prefetch(k + slot(0) * hd, cnt * row_bytes);
    const RunPrefetch pf{reinterpret_cast<const char*>(k + next.first * hd),
                         contiguous ? reinterpret_cast<const char*>(v + slot(0) * hd) : nullptr, next.n,
                         contiguous ? cnt : 0, row_bytes};
    float* pj[NQ];
    for (int r = 0; r < NQ; ++r) pj[r] = p[r] + j;
    scores<NQ>(q, k, slot, cnt, hd, scale, pj, pf);
  });
  float* o[NQ];
  for (int r = 0; r < NQ; ++r) {
    o[r] = part[r].o;
    part[r].l = 0.f;
    std::fill(o[r], o[r] + hd, 0.f);
  }
  if (n == 0) return;
  for (int r = 0; r < NQ; ++r) softmax_part(p[r], n, part[r].m, part[r].l);
  walk_chunk(s, sr, block_size, c, [&](auto slot, int64_t j, int64_t cnt, SlotRange) {
    const float* pj[NQ];
    for (int r = 0; r < NQ; ++r) pj[r] = p[r] + j;
    accumulate<NQ, NV>(pj, v, slot, cnt, hd, o);
  });
}

// Whether queries seeing a and b see the same keys in chunk c (then they are computed together, sharing the reads).
bool same_keys(const Visible& a, const Visible& b, int64_t c) {
  if (&a == &b) return true;
  const int64_t lo = c * KEY_CHUNK, hi = lo + KEY_CHUNK;
  const auto clip = [&](int64_t x) { return std::min(std::max(x, lo), hi); };
  return clip(a.first) == clip(b.first) && clip(a.last) == clip(b.last) && std::max(lo, a.tail_at) >= std::min(hi, a.end()) &&
         std::max(lo, b.tail_at) >= std::min(hi, b.end());
}

// Queries q[i] of one sequence and KV group (seeing seen[i]) over chunks [c0, c1) of its cache k, v (slots, hd):
// emit(i, c, partial) for every chunk a query sees.
template <int NV, typename KV, typename Emit>
void attend_chunks(const std::vector<const float*>& q, const std::vector<const Visible*>& seen, const KV* k,
                   const KV* v, const SeqRows& sr, int64_t block_size, int64_t hd, float scale, int64_t c0,
                   int64_t c1, Emit emit) {
  // Up to MAXQ queries that see the same keys (a KV group's heads of one token) share each key and value read; their
  // accumulators take MAXQ x NVQ registers (AVX-512 has 32, AVX2 16).
  constexpr int MAXQ = VW == 16 ? 4 : 2, NVQ = NV < 4 ? NV : 4;
  const int64_t n = q.size();
  std::vector<float> scratch(MAXQ * (KEY_CHUNK + 8 + hd));
  float* p[MAXQ];
  Partial part[MAXQ];
  for (int r = 0; r < MAXQ; ++r) {
    p[r] = scratch.data() + r * (KEY_CHUNK + 8);
    part[r] = {0, 0, scratch.data() + MAXQ * (KEY_CHUNK + 8) + r * hd};
  }
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t i = 0; i < n;) {
      int run = 1;
      while (run < MAXQ && i + run < n && same_keys(*seen[i], *seen[i + run], c)) ++run;
      const auto part_of = [&](auto nq) {
        constexpr int NQ = decltype(nq)::value;
        chunk_part<NQ, NQ == 1 ? NV : NVQ>(&q[i], *seen[i], k, v, sr, block_size, hd, scale, c, p, part);
      };
      if constexpr (MAXQ >= 4)
        if (run == 4) part_of(std::integral_constant<int, 4>{});
      if constexpr (MAXQ >= 3)
        if (run == 3) part_of(std::integral_constant<int, 3>{});
      if (run == 2) part_of(std::integral_constant<int, 2>{});
      if (run == 1) part_of(std::integral_constant<int, 1>{});
      for (int r = 0; r < run; ++r)
        if (part[r].l > 0) emit(i + r, c, part[r]);
      i += run;
    }
}

// The same for any hd, in plain loops, one query at a time over all its keys (no chunks).
template <typename KV>
void attend_plain(const std::vector<const float*>& q, const std::vector<float*>& out,
                  const std::vector<const Visible*>& seen, const KV* k, const KV* v, const SeqRows& sr,
                  int64_t block_size, int64_t hd, float scale, const std::vector<float>& sink) {
  std::vector<int64_t> slots;
  std::vector<float> p;
  for (size_t i = 0; i < q.size(); ++i) {
    slots.clear();
    for (int64_t j = seen[i]->first; j < seen[i]->last; ++j) slots.push_back(physical(sr, block_size, j));
    slots.insert(slots.end(), seen[i]->tail.begin(), seen[i]->tail.end());
    const int64_t L = slots.size();
    p.resize(L);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      const KV* kj = k + slots[j] * hd;
      float s = 0.f;
      for (int64_t d = 0; d < hd; ++d) s += q[i][d] * load1(kj[d]);
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = std::exp(sink[i] - mx);
    for (int64_t j = 0; j < L; ++j) sum += (p[j] = std::exp(p[j] - mx));
    float* o = out[i];
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const KV* vj = v + slots[j] * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] += p[j] * load1(vj[d]);
    }
    for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
  }
}

// Prompt rows' queries q[i] of one sequence and KV group (seeing seen[i], one run of positions each) over chunks
// [c0, c1) with this build's prompt kernel (attention_bf16.h: bf16 products, 16 queries a vector; attention_lanes.h
// in the AVX2 build: float32, 8 queries a vector): emit(i, c, partial) as attend_chunks does. Each chunk's keys that
// any of the queries sees are converted once for all of them.
template <typename KV, typename Emit>
void attend_prompt(const std::vector<const float*>& q, const std::vector<const Visible*>& seen, const KV* k,
                   const KV* v, const SeqRows& sr, int64_t block_size, int64_t hd, float scale, int64_t c0, int64_t c1,
                   Emit emit) {
  const int64_t n = q.size();
  fastdecode::PromptAttention queries(q.data(), n, hd, scale);
  std::vector<int64_t> a(n), e(n), slots(KEY_CHUNK);
  std::vector<float> parts(n * (hd + 2));
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t lo = c * KEY_CHUNK, hi = lo + KEY_CHUNK;
    int64_t first = hi, end = lo;
    for (int64_t i = 0; i < n; ++i) {
      a[i] = std::max(lo, seen[i]->start()), e[i] = std::min(hi, seen[i]->end());
      if (a[i] < e[i]) first = std::min(first, a[i]), end = std::max(end, e[i]);
    }
    if (first >= end) continue;
    // Whole 16s of positions from x0 (lo is a multiple of 16); positions no query sees are zeros, never read.
    const int64_t x0 = first & ~int64_t(15), x1 = (end + 15) & ~int64_t(15);
    for (int64_t x = x0; x < x1; ++x) slots[x - x0] = first <= x && x < end ? physical(sr, block_size, x) : -1;
    queries.pack(k, v, slots.data(), x1 - x0);
    for (int64_t i = 0; i < n; ++i) {
      if (a[i] >= e[i]) a[i] = e[i] = 0;
      else a[i] -= x0, e[i] -= x0;
    }
    queries.chunk(a.data(), e.data(), parts.data());
    for (int64_t i = 0; i < n; ++i) {
      float* part = parts.data() + i * (hd + 2);
      if (part[1] > 0) emit(i, c, Partial{part[0], part[1], part + 2});
    }
  }
}

// Queries q (R, H, hd) of the new rows of every sequence against the cache k, v (K, slots, hd) -> out (R, H, hd).
// Work items run in parallel, each one KV group's queries of one sequence:
// - a sequence of few rows (decode, verify): all its queries of the group over all their chunks, the group's keys read
//   once; where the batch holds too few groups to keep every thread busy (one sequence of few KV heads), one chunk a
//   item instead, its partials kept and folded by the item that finishes the group's last chunk;
// - a prompt chunk: runs of its (token, head) queries over all their chunks, at least three items per thread.
// Every way folds the same partials in the same order: a query's result does not depend on the batch or the threads.
// Prompt rows (a position below its sequence's prompt_end; prompt_end null: none) take attend_prompt's kernel (bf16
// products where the CPU has them; float32 lanes in the AVX2 build), wherever they fall; generated rows (decode,
// verify) always take the float kernel.
template <typename KV>
void attention(const float* q, const KV* k, const KV* v, int64_t H, int64_t K, int64_t S, int64_t hd,
               const std::vector<SeqRows>& seqs, const int64_t* prompt_end, int64_t block_size,
               const int64_t* positions, const int64_t* slots, const bool* mask, int64_t R, int64_t window,
               float scale, const float* sinks, float* out) {
  constexpr int64_t SPLIT_ROWS = 16;  // a sequence of up to this many rows may be split by chunk
  const int64_t group = H / K, threads = at::get_num_threads(), nseq = seqs.size();
  const bool chunked = hd % VW == 0;
  const bool prompt_kernel = hd % fastdecode::PROMPT_HD_MULTIPLE == 0 && fastdecode::prompt_attention_ready();
  std::vector<Visible> seen(R);
  std::vector<std::pair<int64_t, int64_t>> chunks(nseq);  // each sequence's [c0, c1)
  int64_t work = 0, active = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    const SeqRows& sr = seqs[s];
    int64_t first = std::numeric_limits<int64_t>::max(), end = 0;
    for (int64_t t = sr.r0; t < sr.r1; ++t) {
      seen[t] = visible_keys(t, sr, positions, slots, mask, R, window);
      first = std::min(first, seen[t].first);
      end = std::max(end, seen[t].end());
    }
    chunks[s] = {first / KEY_CHUNK, (end + KEY_CHUNK - 1) / KEY_CHUNK};
    work += (sr.ctx + sr.r1 - sr.r0) * hd * (sr.r1 - sr.r0) * H;
    active += sr.r1 > sr.r0;
  }
  // Too few KV groups in the batch to keep every thread busy: short sequences are split by chunk as well.
  const bool few_groups = K * active < 2 * threads;
  struct Item { int64_t seq, g, lo, hi, c0, c1; };  // rows lo..hi of the sequence's (token, head) queries of group g
  struct Split { int64_t chunks = 0, base = -1; };  // a split sequence's chunk count, where its partials start
  std::vector<Item> items;
  std::vector<Split> split(nseq);
  int64_t part_floats = 0;
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t T = seqs[s].r1 - seqs[s].r0, per_group = T * group;
    const auto [c0, c1] = chunks[s];
    if (T == 0) continue;
    if (chunked && T <= SPLIT_ROWS && c1 - c0 > 1 && few_groups) {
      split[s] = {c1 - c0, part_floats};
      part_floats += T * H * (c1 - c0) * (hd + 2);
      for (int64_t g = 0; g < K; ++g)
        for (int64_t c = c0; c < c1; ++c) items.push_back({s, g, 0, per_group, c, c + 1});
      continue;
    }
    // A few rows: one item per group (its keys read once). A prompt chunk: runs of queries, enough for the threads.
    int64_t runs = 1;
    if (T > SPLIT_ROWS) {
      runs = (3 * threads + K - 1) / K;
      while (K * runs % threads) ++runs;
      runs = std::min(runs, per_group);
    }
    // Runs of equal work, not of equal rows: in a causal prompt chunk the later tokens see more keys (the last half
    // of a prompt from position 0 holds three quarters of the work), and the threads take the items in equal
    // counts. Which item computes a query never changes its result.
    std::vector<int64_t> bounds(runs + 1, T);
    bounds[0] = 0;
    if (runs > 1) {
      const auto cost = [&](int64_t t) { return seen[t].last - seen[t].first + (int64_t)seen[t].tail.size() + 64; };
      int64_t total = 0, done = 0, run = 1;
      for (int64_t t = seqs[s].r0; t < seqs[s].r1; ++t) total += cost(t);
      for (int64_t i = 0; i < T && run < runs; ++i) {
        done += cost(seqs[s].r0 + i);
        while (run < runs && done * runs >= total * run) bounds[run++] = i + 1;
      }
    }
    for (int64_t g = 0; g < K; ++g)
      for (int64_t run = 0; run < runs; ++run)
        if (bounds[run] < bounds[run + 1])
          items.push_back({s, g, bounds[run] * group, bounds[run + 1] * group, c0, c1});
  }
  // A split sequence's partial for (row t, head h, chunk c): m, l, then o (hd); l == 0: no keys of that chunk. The
  // item that computes a group's last chunk folds the group's queries (`pending` counts its chunks still running).
  std::vector<float> parts(part_floats, 0.f);
  const auto part_at = [&](int64_t s, int64_t t, int64_t h, int64_t c) {
    const Split& sp = split[s];
    return parts.data() + sp.base + (((t - seqs[s].r0) * H + h) * sp.chunks + (c - chunks[s].first)) * (hd + 2);
  };
  std::vector<std::atomic<int64_t>> pending(nseq * K);
  for (int64_t s = 0; s < nseq; ++s)
    for (int64_t g = 0; g < K; ++g) pending[s * K + g].store(split[s].chunks, std::memory_order_relaxed);
  // The items go to the threads by cost (queries times the keys they see), each next largest to the least loaded
  // thread. Equal counts of items left a thread waiting at the barrier when the batch's sequences differ in length
  // (a decode row at 2,000 tokens beside one at 300, or a prompt chunk beside decode rows).
  const int64_t n_items = items.size(), n_bins = work >= 16384 ? std::max<int64_t>(1, std::min(threads, n_items)) : 1;
  std::vector<int64_t> by_bin(n_items), bin_start(n_bins + 1, 0);  // bin b: by_bin[bin_start[b] .. bin_start[b + 1])
  std::iota(by_bin.begin(), by_bin.end(), 0);
  if (n_bins > 1) {
    std::vector<int64_t> cost(n_items, 0), bin(n_items), load(n_bins, 0);
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& item = items[it];
      const int64_t lo = item.c0 * KEY_CHUNK, hi = item.c1 * KEY_CHUNK;
      for (int64_t r = item.lo; r < item.hi; ++r) {
        const Visible& s = seen[seqs[item.seq].r0 + r / group];
        // its keys in the item's chunks, and a query's own fixed work (its fold and output) as 16 keys'
        cost[it] += std::max<int64_t>(0, std::min(hi, s.last) - std::max(lo, s.first)) + (int64_t)s.tail.size() + 16;
      }
    }
    std::stable_sort(by_bin.begin(), by_bin.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
    for (const int64_t it : by_bin) {
      bin[it] = std::min_element(load.begin(), load.end()) - load.begin();
      load[bin[it]] += cost[it];
    }
    std::iota(by_bin.begin(), by_bin.end(), 0);
    std::stable_sort(by_bin.begin(), by_bin.end(), [&](int64_t a, int64_t b) { return bin[a] < bin[b]; });
    for (int64_t it = 0; it < n_items; ++it) ++bin_start[bin[it] + 1];
    std::partial_sum(bin_start.begin(), bin_start.end(), bin_start.begin());
  } else {
    bin_start[1] = n_items;
  }
  at::parallel_for(0, n_bins, 1, [&](int64_t b0, int64_t b1) {
    std::vector<const float*> qs, sub_q;
    std::vector<float*> outs;
    std::vector<const Visible*> vis, sub_vis;
    std::vector<int64_t> by_kernel[2];
    std::vector<int64_t> rows, heads;
    std::vector<float> state_o, sink;
    std::vector<Partial> state;
    for (int64_t at = bin_start[b0]; at < bin_start[b1]; ++at) {
      const int64_t it = by_bin[at];
      const Item& item = items[it];
      const SeqRows& sr = seqs[item.seq];
      qs.clear(), outs.clear(), vis.clear(), rows.clear(), heads.clear(), sink.clear();
      for (int64_t r = item.lo; r < item.hi; ++r) {
        const int64_t t = sr.r0 + r / group, h = item.g * group + r % group;
        qs.push_back(q + (t * H + h) * hd);
        outs.push_back(out + (t * H + h) * hd);
        vis.push_back(&seen[t]);
        rows.push_back(t), heads.push_back(h);
        sink.push_back(sinks ? sinks[h] : -std::numeric_limits<float>::infinity());
      }
      const KV* kg = k + item.g * S * hd;
      const KV* vg = v + item.g * S * hd;
      if (!chunked) {
        attend_plain(qs, outs, vis, kg, vg, sr, block_size, hd, scale, sink);
        continue;
      }
      const int64_t n = qs.size();
      // The item's queries by kernel: prompt rows (attend_prompt) and the rest (float), each list's emit mapped back.
      by_kernel[0].clear(), by_kernel[1].clear();
      for (int64_t i = 0; i < n; ++i)
        by_kernel[prompt_kernel && prompt_end && positions[rows[i]] < prompt_end[item.seq] && vis[i]->contiguous()].push_back(i);
      const auto run = [&](auto emit) {
        for (int kind : {0, 1}) {
          const std::vector<int64_t>& which = by_kernel[kind];
          if (which.empty()) continue;
          sub_q.clear(), sub_vis.clear();
          for (const int64_t i : which) sub_q.push_back(qs[i]), sub_vis.push_back(vis[i]);
          const auto mapped = [&](int64_t i, int64_t c, const Partial& p) { emit(which[i], c, p); };
          if (kind == 1) {
            attend_prompt(sub_q, sub_vis, kg, vg, sr, block_size, hd, scale, item.c0, item.c1, mapped);
            continue;
          }
          if (hd % (8 * VW) == 0)
            attend_chunks<8>(sub_q, sub_vis, kg, vg, sr, block_size, hd, scale, item.c0, item.c1, mapped);
          else if (hd % (4 * VW) == 0)
            attend_chunks<4>(sub_q, sub_vis, kg, vg, sr, block_size, hd, scale, item.c0, item.c1, mapped);
          else if (hd % (2 * VW) == 0)
            attend_chunks<2>(sub_q, sub_vis, kg, vg, sr, block_size, hd, scale, item.c0, item.c1, mapped);
          else attend_chunks<1>(sub_q, sub_vis, kg, vg, sr, block_size, hd, scale, item.c0, item.c1, mapped);
        }
      };
      state_o.resize(n * hd);
      state.assign(n, {0, 0, nullptr});
      for (int64_t i = 0; i < n; ++i) state[i].o = state_o.data() + i * hd;
      if (split[item.seq].base < 0) {  // the item holds all its queries' chunks: fold as they come
        run([&](int64_t i, int64_t, const Partial& p) { fold(state[i], p, hd, state[i].l == 0); });
        for (int64_t i = 0; i < n; ++i) finish(state[i], hd, sink[i], outs[i]);
        continue;
      }
      run([&](int64_t i, int64_t c, const Partial& p) {
        float* dst = part_at(item.seq, rows[i], heads[i], c);
        dst[0] = p.m, dst[1] = p.l;
        std::copy(p.o, p.o + hd, dst + 2);
      });
      if (pending[item.seq * K + item.g].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      for (int64_t i = 0; i < n; ++i) {  // the group's last chunk: fold every chunk of its queries in order
        for (int64_t c = chunks[item.seq].first; c < chunks[item.seq].second; ++c) {
          float* src = part_at(item.seq, rows[i], heads[i], c);
          if (src[1] > 0) fold(state[i], {src[0], src[1], src + 2}, hd, state[i].l == 0);
        }
        finish(state[i], hd, sink[i], outs[i]);
      }
    }
  });
}

}  // namespace
}  // namespace fastdecode
