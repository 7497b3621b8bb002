"""A GGUF MoE file's stacked expert tensors (llama.cpp's qwen3moe, gpt-oss) as one 2-D tensor per expert (gpt-oss's
expert biases: one vector each), named as Hugging Face names them.

llama.cpp stores each layer's experts as one (n_expert, rows, cols) tensor per projection: `blk.N.ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`. Quant blocks run along a row, so expert e is the e-th contiguous run of the tensor's
bytes: its GGUFTensor is a view of the mapped file, nothing is copied or dequantized here, and both loaders take it
as any 2-D tensor (gguf_native keeps it in its format, one quantized module per expert; load_gguf dequantizes it).
The router, `blk.N.ffn_gate_inp`, is an ordinary matrix (gguf_loader.BLOCK_NAMES).
"""
from __future__ import annotations

from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading.gguf_file import GGUFFile, GGUFTensor

EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def expert_tensors(f: GGUFFile) -> tuple[dict[str, GGUFTensor], dict[str, GGUFTensor]]:
    """-> ({Hugging Face name (`layers.N.mlp.experts.E.gate_proj.weight`): that expert's (rows, cols) tensor},
    {`layers.N.mlp.experts.gate_proj.weight`: all the layer's experts as one (experts * rows, cols) tensor}); empty for
    a dense model. Shared-expert tensors (`ffn_*_shexp`, Qwen2-MoE and DeepSeek layouts) are refused."""
    out, stacks = {}, {}
    for t in f.tensors.values():
        parts = t.name.split(".")  # blk.{i}.{name}.weight
        if len(parts) != 4 or parts[0] != "blk":
            continue
        if parts[2].endswith(("_shexp", "_shexp_gate")):
            raise UnsupportedModelError(f"{f.path}: shared-expert tensors ({t.name}) are not supported")
        if parts[2] not in EXPERT_NAMES:
            continue
        bias = parts[3] == "bias"  # gpt-oss: (experts, rows)
        if len(t.shape) != 3 - bias or t.shape[0] == 0:
            want = "(experts, rows)" if bias else "(experts, rows, cols)"
            raise ModelFileError(f"{f.path}: {t.name} has shape {t.shape}, not {want}")
        experts, shape = t.shape[0], t.shape[1:]
        stacks[f"layers.{parts[1]}.mlp.experts.{EXPERT_NAMES[parts[2]]}.{parts[3]}"] = GGUFTensor(
            t.name, (experts * shape[0], *shape[1:]), t.type, t.data)
        size = t.data.nbytes // experts
        for e in range(experts):
            name = f"layers.{parts[1]}.mlp.experts.{e}.{EXPERT_NAMES[parts[2]]}.{parts[3]}"
            out[name] = GGUFTensor(f"{t.name}[{e}]", shape, t.type, t.data[e * size:(e + 1) * size])
    return out, stacks
