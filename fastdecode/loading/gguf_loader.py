"""GGUF checkpoint -> ModelConfig and Hugging Face-named float tensors (dequantized with the `gguf` package), and
the Q8_0/Q4_0/Q4_1 and K-quant block tensors as they are, for the modules that hold those layouts (gguf_native)."""
from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_moe import expert_tensors

# Types gguf can dequantize and we have checked against transformers; others are refused with a clear message.
SUPPORTED_TYPES = {getattr(GGMLQuantizationType, n) for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")}

GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # an MoE router; the stacked experts are gguf_moe's
}
GEMMA3_BLOCK_NAMES = {**BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# gpt-oss: llama.cpp names the norm before the MoE block post_attention_norm; the sinks are one vector per layer.
GPT_OSS_BLOCK_NAMES = {**BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn"}


def hf_name(gguf_name: str, family: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{name}.{weight|bias}
    if len(parts) != 4 or parts[0] != "blk":
        return None
    names = {"gemma3": GEMMA3_BLOCK_NAMES, "gpt_oss": GPT_OSS_BLOCK_NAMES}.get(family, BLOCK_NAMES)
    if parts[2] not in names:
        return None
    if parts[2] == "attn_sinks":  # blk.N.attn_sinks.weight -> layers.N.self_attn.sinks
        return f"layers.{parts[1]}.self_attn.sinks"
    return f"layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's convert-time q/k row permutation (interleaved rotary pairs -> half-split)."""
    shape = w.shape
    if shape[0] % (2 * n_heads):
        raise ModelFileError(f"{shape[0]} rows cannot hold {n_heads} heads of rotary pairs")
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def dequantize_tensor(t) -> np.ndarray:
    if t.type not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"tensor {t.name} has GGML type {t.type.name}, which fastdecode does not load")
    if t.type == GGMLQuantizationType.F32:
        return np.asarray(t.data).view(np.float32).reshape(t.shape)
    return dequantize(np.asarray(t.data), t.type).reshape(t.shape)


def gguf_config(f: GGUFFile) -> ModelConfig:
    config = ModelConfig.from_gguf(f.metadata)
    config.tie_word_embeddings = "output.weight" not in f.tensors
    return config


def permuted_heads(name: str, config: ModelConfig) -> int | None:
    """Heads whose q/k rows llama.cpp permuted at convert time (see unpermute_rows), or None for other tensors."""
    if config.family != "llama":
        return None
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return config.num_attention_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return config.num_key_value_heads
    return None


def float_tensor(t, name: str, config: ModelConfig) -> np.ndarray:
    """A GGUF tensor as the float32 values of the Hugging Face weight `name` (a fresh array: the file is mapped
    read-only)."""
    w = dequantize_tensor(t)
    heads = permuted_heads(name, config)
    if heads is not None:
        w = unpermute_rows(w, heads)
    if config.family == "gemma3" and name.endswith("norm.weight"):
        w = w - 1.0  # llama.cpp's converter stores Gemma norms as (1 + w); keep Hugging Face's convention
    return np.array(w, dtype=np.float32)


def load_gguf(path, dtype: torch.dtype = torch.float32, progress=None):
    """Returns (config, weights, rope_freq_factors, gguf_file). `progress` wraps an iterable, e.g. rich's track."""
    f = GGUFFile(path)
    config = gguf_config(f)
    tensors = [(hf_name(t.name, config.family), t) for t in f.tensors.values()] + list(expert_tensors(f)[0].items())
    if progress is not None:
        tensors = progress(tensors)
    weights, freq_factors = {}, None
    for name, t in tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = torch.from_numpy(dequantize_tensor(t).copy())
            continue
        if name is not None:
            weights[name] = torch.from_numpy(float_tensor(t, name, config)).to(dtype)
    if "embed_tokens.weight" not in weights:
        raise ModelFileError(f"{path}: no token_embd.weight tensor")
    return config, weights, freq_factors, f


# Block types our int8/int4 modules hold value for value (blocks of 32 weights): Q8_0 is d (fp16) and 32 int8; Q4_0
# is d and 16 bytes of nibbles, w = d * (q - 8); Q4_1 is d, m and the nibbles, w = d * q + m. A block's byte j holds
# q[j] in its low nibble and q[j + 16] in its high one.
# Q5_0 is d, 4 bytes of fifth bits (bit j of the little-endian uint32: element j) and the nibbles, w = d * (q - 16);
# Q5_1 adds m, w = d * q + m: int8 blocks hold both exactly.
# K-quants (super-blocks of 256 weights) go to KQuantLinear as the file's bytes, repacked there (quant/kquant.py).
K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}


def file_view(a: np.ndarray) -> torch.Tensor:
    """A tensor over a mapped array, without a copy. torch warns that it cannot mark the tensor read-only; the loaders
    only read these views (a write would fault), and each module's packing copies them once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def block_tensors(t, heads: int | None = None) -> dict[str, torch.Tensor]:
    """A Q8_0 or Q5_0 tensor (N, K) -> {"qweight" (N, K/32, 32) int8, "scales" (N, K/32) fp16} (Q5_1: uint8 q and
    "mins" too); Q4_0/Q4_1 -> {"blocks" (N, K/32, 16) uint8, the block's nibble bytes as they are, "scales", "mins"
    (N, K/32) fp16}; a K-quant -> {"blocks" (N, K/256, bytes) uint8}, its super-blocks as they are: what the quant
    modules' from_tensors take (fastdecode.quant), with no value rounded on the way; MXFP4 -> {"blocks" (N, K/32, 16),
    "scales" (N, K/32) E8M0 bytes}, as Fp4Linear takes them. Q8_0/Q4_0/Q4_1/K-quant blocks and
    scales are strided views of the mapped file (Q4_0's mins excepted), so packing reads the file once and the
    tensor's pages must stay mapped until then. `heads` (permuted_heads) undoes llama.cpp's q/k row permutation: rows
    are whole blocks, so it moves bytes, not values (a copy)."""
    N, K = t.shape
    data = t.data if heads is None else unpermute_rows(np.asarray(t.data).reshape(N, -1), heads)
    block, size = GGML_QUANT_SIZES[t.type]  # (weights, bytes) per block
    raw = file_view(data).view(N, K // block, size)
    if t.type == GGMLQuantizationType.MXFP4:  # an E8M0 scale byte, then 16 bytes: Fp4Linear takes both as they are
        return {"blocks": raw[..., 1:], "scales": raw[..., 0]}
    if t.type in K_QUANTS:
        return {"blocks": raw}
    half = lambda lo: raw[..., lo:lo + 2].view(torch.float16)[..., 0]  # noqa: E731  (N, K/32)
    if t.type == GGMLQuantizationType.Q8_0:
        return {"qweight": raw[..., 2:].view(torch.int8), "scales": half(0)}
    if t.type in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1):
        high = raw[..., -20:-16].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32) & 1
        qs = raw[..., -16:]
        q = (torch.cat([qs & 15, qs >> 4], dim=-1) | high.to(torch.uint8) << 4)  # (N, K/32, 32) in 0..31
        if t.type == GGMLQuantizationType.Q5_0:
            return {"qweight": (q.to(torch.int8) - 16), "scales": half(0)}
        return {"qweight": q, "scales": half(0), "mins": half(2)}
    d = half(0)
    m = half(2) if t.type == GGMLQuantizationType.Q4_1 else -8 * d  # Q4_0: d*(q-8) = d*q + (-8d), exact in fp16
    return {"blocks": raw[..., -16:], "scales": d, "mins": m}
