// The walk over a chunk's queries that both prompt-attention kernels take (attention_bf16.h, attention_lanes.h).
#pragma once
#include <algorithm>
#include <cstdint>

namespace fastdecode {

// n queries, query i seeing the chunk's packed keys [a[i], e[i)) of `count` (none where a >= e), in blocks of B:
// per block, each query's range as int32 (first, end; padding lanes see nothing) and the union of them [lo, hi),
// rounded out to whole multiples of `align` (so that runs of keys stay aligned to positions), given to
// block(b, lo, hi, first, end, live, out) with out = parts + i0 * (hd + 2), i0 the block's first query. A block none of
// whose queries sees a key gets l = 0 (parts[i * (hd + 2) + 1]) for each of its queries instead.
template <int64_t B, typename Block>
void for_each_block(int64_t n, int64_t count, int64_t align, int64_t hd, const int64_t* a, const int64_t* e,
                    float* parts, Block block) {
  for (int64_t b = 0; b * B < n; ++b) {
    const int64_t i0 = b * B, live = std::min(B, n - i0);
    int64_t lo = count, hi = 0;
    alignas(64) int32_t first[B], end[B];
    for (int64_t i = 0; i < B; ++i) {
      first[i] = i < live ? static_cast<int32_t>(a[i0 + i]) : 0;
      end[i] = i < live ? static_cast<int32_t>(e[i0 + i]) : 0;
      if (first[i] < end[i]) lo = std::min<int64_t>(lo, first[i]), hi = std::max<int64_t>(hi, end[i]);
    }
    float* out = parts + i0 * (hd + 2);
    if (lo >= hi) {
      for (int64_t i = 0; i < live; ++i) out[i * (hd + 2) + 1] = 0.f;
      continue;
    }
    block(b, lo / align * align, (hi + align - 1) / align * align, first, end, live, out);
  }
}

}  // namespace fastdecode
