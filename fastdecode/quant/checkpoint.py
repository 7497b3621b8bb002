"""Quantized checkpoints: a directory that `fastdecode quantize` writes and `load_model` reads back.

    config.json                 the model's config, Hugging Face field names
    model.safetensors           per quantized matrix `{module}.qweight`, `.scales` (and `.mins`, `.tensor_scale`,
                                `.bias` as the scheme has them), exactly the tensors `encode_linear` gives; every other weight
                                in float32 under our module names (`layers.0.self_attn.qkv_proj`, norms as the model
                                holds them)
    quantization_config.json    {"quant_method": "fastdecode", "scheme", "group_size", "lm_head_scheme",
                                 "modules": {name: {"scheme", "in_features", "out_features"}}, "source_model"}
    tokenizer.json, tokenizer_config.json, generation_config.json, chat_template.jinja

Loading builds every quantized module from the stored tensors with the same constructor the in-memory transform
uses, so a reloaded model gives the same logits bit for bit. safetensors only: no pickle anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError
from fastdecode.quant import build_linear, encode_linear, plan
from fastdecode.quant.linear import QuantLinear

QUANT_CONFIG = "quantization_config.json"
WEIGHTS = "model.safetensors"
TENSORS = {"int8": {"qweight", "scales"}, "int4": {"qweight", "scales", "mins"},
           "mxfp4": {"qweight", "scales", "tensor_scale"}, "nvfp4": {"qweight", "scales", "tensor_scale"}}
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                 "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def is_quantized_checkpoint(path) -> bool:
    return Path(path).is_dir() and (Path(path) / QUANT_CONFIG).is_file()


def hf_config(c: ModelConfig) -> dict:
    """ModelConfig -> a config.json dict that ModelConfig.from_hf reads back to an equal config."""
    arch, model_type = ARCHITECTURES[c.family]
    if c.family == "llama" and c.sliding_window:  # Mistral v0.1: from_hf windows every layer of a "mistral"
        arch, model_type = "MistralForCausalLM", "mistral"
    out = {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "tie_word_embeddings": c.tie_word_embeddings,
           "attention_bias": c.attention_bias, "hidden_act": c.hidden_act,
           "final_logit_softcapping": c.final_logit_softcapping, "bos_token_id": c.bos_token_id,
           "eos_token_id": c.eos_token_id, "sliding_window": c.sliding_window}
    if c.num_experts:
        out.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                   decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=c.mlp_only_layers)
    if c.family == "gemma3":
        out.update(query_pre_attn_scalar=c.query_pre_attn_scalar, layer_types=c.layer_types,
                   rope_local_base_freq=c.rope_local_base_freq)
    return out


def save_tokenizer(tokenizer, out: Path):
    """Writes what Tokenizer.from_hf_dir reads: the `tokenizers` pipeline, special tokens and chat template."""
    backend = tokenizer.complete_backend
    token = lambda i: backend.id_to_token(i) if i is not None else None  # noqa: E731
    (out / "tokenizer.json").write_text(backend.to_str())
    eos = tokenizer.eos_token_ids
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": token(tokenizer.bos_token_id), "eos_token": token(eos[0] if eos else None)}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos}, indent=2))
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)


@torch.no_grad()
def save_quantized(model: nn.Module, tokenizer, out, scheme: str, group_size: int = 32,
                   lm_head_scheme: str | None = "int8", source: str | None = None) -> dict:
    """Quantizes a float model's matrices with the in-memory transform's rules and writes the checkpoint directory;
    returns the quantization config. The model itself is left as it is."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("save_quantized takes a float model; this one is already quantized")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, {}
    for name, s in plan(model, scheme, group_size, lm_head_scheme):
        linear = model.get_submodule(name)
        for key, t in encode_linear(linear.weight, s, group_size).items():
            tensors[f"{name}.{key}"] = t
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.float()
        modules[name] = {"scheme": s, "in_features": linear.in_features, "out_features": linear.out_features}
    for name, p in model.named_parameters():  # each shared tensor once: a tied lm_head is the embedding
        if name.rpartition(".")[0] not in modules:
            tensors[name] = p.float()
    if getattr(model, "rope_freq_factors", None) is not None:  # GGUF llama3 rope scaling lives in a tensor
        tensors["rope_freq_factors"] = model.rope_freq_factors.float()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / WEIGHTS),
              metadata={"format": "pt", "producer": "fastdecode quantize"})
    config = {"quant_method": "fastdecode", "scheme": scheme, "group_size": group_size if scheme == "int4" else None,
              "lm_head_scheme": lm_head_scheme or scheme, "modules": modules, "source_model": source,
              "format_version": 1}
    (out / "config.json").write_text(json.dumps(hf_config(model.config), indent=2))
    (out / QUANT_CONFIG).write_text(json.dumps(config, indent=2))
    if tokenizer is not None:  # None: weights only (tests); `generate -m DIR` needs the tokenizer files
        save_tokenizer(tokenizer, out)
    return config


def read_quant_config(path) -> dict:
    try:
        config = json.loads((Path(path) / QUANT_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {Path(path) / QUANT_CONFIG}: {e}") from None
    if config.get("quant_method") != "fastdecode" or not isinstance(config.get("modules"), dict):
        raise ModelFileError(f"{Path(path) / QUANT_CONFIG} is not a fastdecode quantization config")
    return config


@torch.no_grad()
def load_quantized(path, dtype: torch.dtype = torch.float32, backend: str | None = None) -> nn.Module:
    """Builds the model of a quantized checkpoint: quantized modules from their stored tensors, other weights in
    `dtype`."""
    from fastdecode.loading.build import skip_init
    from fastdecode.loading.hf_loader import read_config
    from fastdecode.models import model_class

    path = Path(path)
    config, qconfig = read_config(path), read_quant_config(path)
    try:
        with safe_open(path / WEIGHTS, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, RuntimeError, SafetensorError) as e:
        raise ModelFileError(f"cannot read {path / WEIGHTS}: {e}") from None
    with skip_init(dtype):
        model = model_class(config.family)(config)
    for name, spec in qconfig["modules"].items():
        prefix = f"{name}."
        parts = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        bias = parts.pop("bias", None)
        if spec.get("scheme") not in TENSORS or not TENSORS[spec["scheme"]] <= set(parts):
            raise ModelFileError(f"{path / WEIGHTS} lacks the {spec.get('scheme')} tensors of {name}")
        parent, _, leaf = name.rpartition(".")
        try:
            module = build_linear(parts, spec["scheme"], bias, spec["in_features"], qconfig.get("group_size") or 32,
                                  backend)
            setattr(model.get_submodule(parent), leaf, module)
        except (ValueError, RuntimeError, AttributeError) as e:  # shapes that contradict the config
            raise ModelFileError(f"{path}: cannot build {name}: {e}") from None
    if "lm_head" not in qconfig["modules"] and "lm_head.weight" not in tensors:
        model.lm_head.weight = model.embed_tokens.weight
    for name, p in model.named_parameters():
        if name not in tensors:
            raise ModelFileError(f"{path / WEIGHTS} lacks {name}")
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise ModelFileError(f"{name}: checkpoint shape {tuple(tensors[name].shape)} != model {tuple(p.shape)}")
        p.data = tensors[name].to(dtype)
    model.rope_freq_factors = tensors.get("rope_freq_factors")
    return model.eval()
