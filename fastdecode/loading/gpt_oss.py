"""gpt-oss's fused expert tensors (transformers' GptOssExperts) as one module per expert, named as models/moe.py names
them, so the model loads them key for key.

transformers stores each layer's experts as stacks: `mlp.experts.gate_up_proj` (E, hidden, 2 * width) with the gate
and up columns interleaved (gate = [..., ::2], up = [..., 1::2]), `down_proj` (E, width, hidden), each with a bias
(E, out), and `mlp.router` (weight and bias). The released checkpoint keeps the expert matrices in MXFP4 instead:
`*_blocks` (E, out, in / 32, 16) uint8, two E2M1 codes a byte (element 2i in the low nibble), and `*_scales`
(E, out, in / 32) E8M0 bytes. Those are Fp4Linear's own codes and scales (quant/fp4.py), so each expert becomes an
Fp4Linear holding the file's bytes; its dequantized weight equals transformers' convert_moe_packed_tensors bit for
bit (both are E2M1 value * 2^(scale - 127) in float32).
"""
from __future__ import annotations

import torch

from fastdecode.errors import ModelFileError
from fastdecode.quant.fp4 import Fp4Linear

PROJECTIONS = ("gate_up_proj", "down_proj")


def split_gate_up(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 0) interleaved gate, up, gate, up ... -> all gate rows, then all up rows (our gate_up_proj)."""
    return torch.cat([t[0::2], t[1::2]])


def expert_modules(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | torch.nn.Module]:
    """Hugging Face-named gpt-oss weights (without `model.`) -> the same with the router renamed `mlp.gate` and the
    expert stacks split per expert: float experts as `mlp.experts.{e}.{gate_up_proj,down_proj}.{weight,bias}` tensors,
    MXFP4 experts as Fp4Linear modules named `mlp.experts.{e}.{gate_up_proj,down_proj}` (biases inside)."""
    out, stacks = {}, {}
    for name, t in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("mlp.experts"):
            stacks.setdefault(prefix, {})[leaf] = t
        else:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = t
    for prefix, stack in stacks.items():
        for proj in PROJECTIONS:
            bias = stack.get(f"{proj}_bias")
            if bias is None:
                raise ModelFileError(f"{prefix}: no {proj}_bias")
            if f"{proj}_blocks" in stack:
                blocks, scales = stack[f"{proj}_blocks"], stack.get(f"{proj}_scales")
                if scales is None or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
                    raise ModelFileError(f"{prefix}.{proj}: blocks {tuple(blocks.shape)} and scales "
                                         f"{None if scales is None else tuple(scales.shape)} are not MXFP4's layout")
                for e in range(blocks.shape[0]):
                    codes, sc, b = blocks[e].flatten(1), scales[e], bias[e]  # (out, in / 2), (out, in / 32), (out,)
                    if proj == "gate_up_proj":
                        codes, sc, b = split_gate_up(codes), split_gate_up(sc), split_gate_up(b)
                    out[f"{prefix}.{e}.{proj}"] = Fp4Linear("mxfp4", {"qweight": codes, "scales": sc}, b)
            elif proj in stack:
                w = stack[proj].transpose(1, 2)  # (E, in, out) -> (E, out, in), as nn.Linear holds it
                for e in range(w.shape[0]):
                    we, b = (split_gate_up(w[e]), split_gate_up(bias[e])) if proj == "gate_up_proj" else (w[e], bias[e])
                    out[f"{prefix}.{e}.{proj}.weight"], out[f"{prefix}.{e}.{proj}.bias"] = we, b
            else:
                raise ModelFileError(f"{prefix}: no {proj} (float) or {proj}_blocks (MXFP4)")
    return out
