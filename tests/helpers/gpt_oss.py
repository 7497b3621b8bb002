"""A tiny random gpt-oss (transformers' GptOssForCausalLM) saved as safetensors (float, or its experts as MXFP4
blocks and scales like the released checkpoint) and as GGUF the way llama.cpp's converter writes it (experts F32 or
MXFP4). Each reference model holds exactly the values its file holds."""
from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fastdecode.quant.fp4 import quantize_mxfp4
from fastdecode.quant.linear import pack_nibbles
from tests.helpers.checkpoints import VOCAB_SIZE, add_shape, add_tokenizer, scratch_dir

# YaRN with a short original context, so that the 56-token runs scale most rotary frequencies.
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
# A window of 4 slides within the 24-token prompt; experts of width 64 hold whole pairs of MXFP4 blocks in both
# projections (the native kernel's unit).
CONFIG = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_local_experts=8,
              num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
              max_position_embeddings=64, rope_parameters=YARN, initializer_range=0.1, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


@functools.cache
def build() -> transformers.GptOssForCausalLM:
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**CONFIG, attn_implementation="eager")
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # sinks and biases start at zero: make each one matter
            p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:  # gate/up values past the SwiGLU limit (7) now and then
            layer.mlp.experts.gate_up_proj.mul_(4.0)
    return model


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., out, in) float -> the released checkpoint's (..., out, in / 32, 16) blocks and (..., out, in / 32)
    scales."""
    *lead, N, K = w.shape
    codes, scales = quantize_mxfp4(w.reshape(-1, K))
    return pack_nibbles(codes).view(*lead, N, K // 32, 16), scales.view(*lead, N, K // 32)


@functools.cache
def hf_checkpoint(mxfp4: bool) -> tuple[transformers.GptOssForCausalLM, Path]:
    """(reference model, directory). MXFP4: the experts are stored as blocks and scales, and the reference holds
    what transformers' convert_moe_packed_tensors makes of them."""
    model = build()
    path = scratch_dir() / f"gpt_oss-{'mxfp4' if mxfp4 else 'f32'}"
    model.save_pretrained(path)
    if not mxfp4:
        return model, path
    ref = copy.deepcopy(model)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_blocks(tensors.pop(key).transpose(1, 2))  # stored (E, in, out); blocks (E, out, ..)
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        with torch.no_grad():
            ref.get_parameter(key).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    return ref, path


def gguf_tensors(model, experts: QType):
    """(GGUF name, float data, type) as llama.cpp's GptOssModel converter writes them: the interleaved gate/up stack
    split into ffn_gate_exps and ffn_up_exps, (E, out, in), each with its bias."""
    for key, t in model.state_dict().items():
        t = t.detach().float()
        key = key.removeprefix("model.")
        if key in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            yield {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[key], t, QType.F32
            continue
        _, i, *rest = key.split(".")
        rest = ".".join(rest)
        blk = f"blk.{i}"
        if rest == "mlp.experts.gate_up_proj":
            yield f"{blk}.ffn_gate_exps.weight", t[..., 0::2].transpose(1, 2), experts
            yield f"{blk}.ffn_up_exps.weight", t[..., 1::2].transpose(1, 2), experts
        elif rest == "mlp.experts.gate_up_proj_bias":
            yield f"{blk}.ffn_gate_exps.bias", t[:, 0::2], QType.F32
            yield f"{blk}.ffn_up_exps.bias", t[:, 1::2], QType.F32
        elif rest == "mlp.experts.down_proj":
            yield f"{blk}.ffn_down_exps.weight", t.transpose(1, 2), experts
        elif rest == "mlp.experts.down_proj_bias":
            yield f"{blk}.ffn_down_exps.bias", t, QType.F32
        else:
            names = {"self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
                     "mlp.router.bias": "ffn_gate_inp.bias", "input_layernorm.weight": "attn_norm.weight",
                     "post_attention_layernorm.weight": "post_attention_norm.weight"}
            proj = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}
            if rest not in names:
                p, kind = rest.removeprefix("self_attn.").split("_proj.")
                names[rest] = f"{proj[p]}.{kind}"
            yield f"{blk}.{names[rest]}", t, QType.F32


@functools.cache
def gguf_checkpoint(experts: str = "F32") -> tuple[transformers.GptOssForCausalLM, Path]:
    """(reference model, GGUF path) with the experts in GGML type `experts` (F32, MXFP4, Q8_0); the reference holds
    gguf-py's dequantization of quantized ones."""
    model, ref = build(), copy.deepcopy(build())
    c = model.config
    path = scratch_dir() / f"gpt_oss-{experts.lower()}.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_shape(w, c, YARN["rope_theta"])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN["factor"])
    w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    add_tokenizer(w, c.vocab_size)
    dequantized = {}
    for name, data, qtype in gguf_tensors(model, getattr(QType, experts)):
        data = np.ascontiguousarray(data.numpy())
        raw = gguf.quants.quantize(data, qtype) if qtype != QType.F32 else data
        if qtype != QType.F32:
            dequantized[name] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(data.shape).copy())
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            if experts != "F32":
                gate_up = layer.mlp.experts.gate_up_proj
                gate_up[..., 0::2] = dequantized[f"blk.{i}.ffn_gate_exps.weight"].transpose(1, 2)
                gate_up[..., 1::2] = dequantized[f"blk.{i}.ffn_up_exps.weight"].transpose(1, 2)
                layer.mlp.experts.down_proj.copy_(dequantized[f"blk.{i}.ffn_down_exps.weight"].transpose(1, 2))
    return ref, path
