// Strided byte moves for packing weights at load (quant/repack.py). Packing a GGUF tensor into a tile layout is a
// copy between strided views whose contiguous runs are short: a 2-byte fp16 scale, a block's 16 bytes of nibbles.
// numpy and torch move those one element at a time through generic loops (5-10 ns each, some 750 million runs for an
// 8B model); here each run is one fixed-size memcpy in a tight odometer loop, the runs split across the threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <vector>

namespace {

struct Dim {
  int64_t size, dst, src;  // strides in bytes
};

// The runs [begin, end) of the index space `dims` (outermost first), each `run` bytes.
template <int64_t RUN>
void copy_runs(char* dst, const char* src, const std::vector<Dim>& dims, int64_t run, int64_t begin, int64_t end) {
  const int64_t n = dims.size();
  std::vector<int64_t> idx(n);
  int64_t d_off = 0, s_off = 0;
  for (int64_t i = n - 1, rest = begin; i >= 0; --i) {  // the multi-index of `begin`
    idx[i] = rest % dims[i].size;
    rest /= dims[i].size;
    d_off += idx[i] * dims[i].dst;
    s_off += idx[i] * dims[i].src;
  }
  const Dim inner = dims[n - 1];
  for (int64_t r = begin; r < end;) {
    // along the innermost dimension without touching the odometer
    const int64_t stop = std::min(end, r + inner.size - idx[n - 1]);
    for (; r < stop; ++r, ++idx[n - 1], d_off += inner.dst, s_off += inner.src)
      std::memcpy(dst + d_off, src + s_off, RUN ? RUN : run);
    for (int64_t i = n - 1; i > 0 && idx[i] == dims[i].size; --i) {  // carry
      d_off += dims[i - 1].dst - idx[i] * dims[i].dst;
      s_off += dims[i - 1].src - idx[i] * dims[i].src;
      idx[i] = 0;
      ++idx[i - 1];
    }
  }
}

}  // namespace

namespace fastdecode {

// dst[...] = src for CPU tensors of one dtype and shape, any strides; returns dst.
at::Tensor copy_strided(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "copy_strided: CPU tensors only");
  TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.sizes() == src.sizes(),
              "copy_strided: dtype and shape must match");
  if (dst.numel() == 0) return dst;
  const int64_t item = dst.element_size();
  std::vector<Dim> dims;
  for (int64_t i = 0; i < dst.dim(); ++i)
    if (dst.size(i) != 1) dims.push_back({dst.size(i), dst.stride(i) * item, src.stride(i) * item});
  // Merge a dimension into the one outside it where both tensors step over it contiguously.
  std::vector<Dim> merged;
  for (const Dim& d : dims) {
    if (!merged.empty() && merged.back().dst == d.size * d.dst && merged.back().src == d.size * d.src) {
      merged.back() = {merged.back().size * d.size, d.dst, d.src};
    } else {
      merged.push_back(d);
    }
  }
  int64_t run = item;
  if (!merged.empty() && merged.back().dst == item && merged.back().src == item) {  // the innermost is one run
    run = merged.back().size * item;
    merged.pop_back();
  }
  if (merged.empty()) merged.push_back({1, 0, 0});
  int64_t runs = 1;
  for (const Dim& d : merged) runs *= d.size;
  char* out = static_cast<char*>(dst.data_ptr());
  const char* in = static_cast<const char*>(src.data_ptr());
  // Grain: about 1 MB a task, so small tensors stay on one thread.
  at::parallel_for(0, runs, std::max<int64_t>(1, (1 << 20) / run), [&](int64_t begin, int64_t end) {
    switch (run) {
      case 2: return copy_runs<2>(out, in, merged, run, begin, end);
      case 4: return copy_runs<4>(out, in, merged, run, begin, end);
      case 8: return copy_runs<8>(out, in, merged, run, begin, end);
      case 16: return copy_runs<16>(out, in, merged, run, begin, end);
      case 32: return copy_runs<32>(out, in, merged, run, begin, end);
      default: return copy_runs<0>(out, in, merged, run, begin, end);
    }
  });
  return dst;
}

}  // namespace fastdecode
