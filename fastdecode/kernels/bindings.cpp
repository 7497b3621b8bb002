#include <pybind11/functional.h>
#include <torch/extension.h>

#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "model_shape.h"

namespace fastdecode {
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor copy_strided(at::Tensor dst, const at::Tensor& src);
void kq_pack(at::Tensor out, const at::Tensor& blocks);
void q4_pack(at::Tensor out, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins);
void q8_pack(at::Tensor out, const at::Tensor& q, const at::Tensor& scales);
void fp4_pack(at::Tensor out, const at::Tensor& codes, const at::Tensor& scales);
bool amx_int8_ready();
std::map<std::string, double> instruction_peaks(double seconds);
}  // namespace fastdecode

at::Tensor forward_batch(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                         const at::Tensor& slots, const at::Tensor& seq_rows, const at::Tensor& context,
                         const at::Tensor& prompt_end, const at::Tensor& block_table, int64_t block_size,
                         const at::Tensor& tree_mask,
                         const at::Tensor& rope_global, const at::Tensor& rope_local,
                         const fastdecode::ModelShape& shape, const std::function<void(at::Tensor)>& reduce);

std::vector<double> forward_profile(bool reset);
std::tuple<std::string, int64_t> prompt_attention();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &fastdecode::q8_linear, "y = x @ W.T + bias, W 8-bit packed (N/4, K/32, 144) with fp16 block scales and offsets, or Q8_0 pair tiles (N/4, K/64, 272)");
  m.def("q4_linear", &fastdecode::q4_linear,
        "y = x @ W.T + bias, W 4-bit packed (N/4, K/64, 160) with fp16 scales and mins");
  m.def("amx_int8_ready", &fastdecode::amx_int8_ready,
        "whether q4_linear runs 16 rows or more on AMX int8 tiles (a CPU with AMX, allowed by the OS, FASTDECODE_AMX "
        "not 0, the AVX-512 build)");
  m.def("instruction_peaks", &fastdecode::instruction_peaks, py::arg("seconds") = 0.2,
        py::call_guard<py::gil_scoped_release>(),
        "G operations/s of each kernel path's inner instruction in registers on every torch thread (see peak.cpp): "
        "'fp32 fma', 'int8 avx2' or 'int8 vnni', 'bf16 avx512' and 'int8 amx' where this build and CPU have them");
  m.def("kq_linear", &fastdecode::kq_linear,
        "y = x @ W.T + bias, W a GGUF K-quant (Q4_K, Q5_K, Q6_K) packed (N/4, K/256, 592 | 720 | 840)");
  m.def("fp4_linear", &fastdecode::fp4_linear,
        "y = x @ W.T + bias, W MXFP4 packed (N/4, K/64, 136) with E8M0 block scales");
  m.def("copy_strided", &fastdecode::copy_strided, py::call_guard<py::gil_scoped_release>(),
        "dst[...] = src (one dtype and shape, any strides), contiguous runs moved as one, split across threads");
  m.def("kq_pack", &fastdecode::kq_pack, py::call_guard<py::gil_scoped_release>(),
        "a GGUF Q4_K / Q5_K tensor's super-blocks -> kq_linear's packed tiles, written into out");
  m.def("q4_pack", &fastdecode::q4_pack, py::call_guard<py::gil_scoped_release>(),
        "Q4_0 / Q4_1 blocks (nibbles, fp16 scales and mins) -> q4_linear's packed tiles, written into out");
  m.def("q8_pack", &fastdecode::q8_pack, py::call_guard<py::gil_scoped_release>(),
        "Q8_0 blocks (int8 values, fp16 scales) -> q8_linear's packed pair tiles, written into out");
  m.def("fp4_pack", &fastdecode::fp4_pack, py::call_guard<py::gil_scoped_release>(),
        "MXFP4 blocks (code bytes, E8M0 scale bytes) -> fp4_linear's packed tiles, written into out");
  using fastdecode::ModelShape;
  // module_local: a benchmark may load a second build of this module (another revision's) beside it
  py::class_<ModelShape>(m, "ModelShape", py::module_local(),
                         "forward_batch's model-wide arguments (model_shape.h), set by name")
      .def(py::init<>())
      .def_readwrite("windows", &ModelShape::windows)
      .def_readwrite("heads", &ModelShape::heads)
      .def_readwrite("kv_heads", &ModelShape::kv_heads)
      .def_readwrite("head_dim", &ModelShape::head_dim)
      .def_readwrite("eps", &ModelShape::eps)
      .def_readwrite("attn_scale", &ModelShape::attn_scale)
      .def_readwrite("sandwich", &ModelShape::sandwich)
      .def_readwrite("gelu", &ModelShape::gelu)
      .def_readwrite("swiglu_limit", &ModelShape::swiglu_limit)
      .def_readwrite("swiglu_alpha", &ModelShape::swiglu_alpha)
      .def_readwrite("top_k", &ModelShape::top_k)
      .def_readwrite("norm_topk", &ModelShape::norm_topk)
      .def_readwrite("softmax_after_topk", &ModelShape::softmax_after_topk);
  // The GIL is released: a server's event loop keeps answering while a step runs.
  // `reduce` (None, or a Python callable on a tensor: a tensor-parallel all-reduce) takes the GIL when called.
  m.def("forward_batch", &forward_batch, py::arg("x"), py::arg("weights"), py::arg("positions"), py::arg("slots"),
        py::arg("seq_rows"), py::arg("context"), py::arg("prompt_end"), py::arg("block_table"),
        py::arg("block_size"), py::arg("tree_mask"), py::arg("rope_global"), py::arg("rope_local"),
        py::arg("shape"), py::arg("reduce") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "the new rows of a batch of sequences (decode steps, prompt chunks, draft trees) through every layer over a "
        "paged KV cache (see decode_step.cpp)");
  m.def("prompt_attention", &prompt_attention,
        "(kernel, head size multiple): how forward_batch computes prompt rows' attention where the head size is a "
        "multiple of the second: 'bf16' products (AVX512-BF16, the AVX-512 build, FASTDECODE_BF16_ATTENTION not 0), "
        "'float32 lanes' (the AVX2 build, FASTDECODE_PROMPT_ATTENTION not 0); ('', 0): the float kernel of decode "
        "rows");
  m.def("forward_profile", &forward_profile, py::arg("reset") = false,
        "forward_batch's (calls, rows, matmul s, attention s, total s) since the last reset (the rest: norms, rotary, "
        "cache writes, activations, residuals)");
}
