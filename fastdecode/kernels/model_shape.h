// The model-wide arguments of forward_batch (decode_step.cpp), declared here once: Python builds one per model and
// sets its fields by these names (runners/native_layers.py), so an argument added here cannot be passed out of place.
#pragma once

#include <cstdint>
#include <vector>

namespace fastdecode {

struct ModelShape {
  std::vector<int64_t> windows;  // per layer: its sliding window, 0 where it attends to everything
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, attn_scale = 1.0;
  bool sandwich = false;  // Gemma 3's norms after attention and after the MLP too
  bool gelu = false;  // the MLP's gate is GELU's tanh approximation (else SiLU, or gpt-oss's clamped SwiGLU)
  double swiglu_limit = 0.0, swiglu_alpha = 1.702;  // gpt-oss's SwiGLU where the limit is above 0
  int64_t top_k = 0;  // a mixture-of-experts layer's experts per row
  bool norm_topk = false, softmax_after_topk = false;  // how the router's top k weights are normalised (see moe)
};

}  // namespace fastdecode
