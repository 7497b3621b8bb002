"""Tiny random checkpoints for the family and loader tests, and the Hugging Face reference runner.

Each spec builds a seeded random model with `transformers`, saves it with `save_pretrained` (safetensors) and
writes the same weights as GGUF the way llama.cpp's convert_hf_to_gguf.py does: its metadata keys, its tensor
names (from gguf's own TensorNameMap), the q/k row permutation for the llama architecture, Gemma norms stored as
(1 + w), and a `rope_freqs` tensor for llama3 rope scaling. Each checkpoint is built once per test session.
"""
from __future__ import annotations

import copy
import functools
import math
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QType

from fastdecode.kernels.openmp import torch_threads
from tests.helpers import kquant_blocks as kquants

VOCAB_SIZE = 160
# Added to every parameter after init: transformers initialises norms to ones (Gemma: zeros), which would hide
# a norm that is skipped or applied as w instead of (1 + w).
NOISE = 0.1
COMMON = dict(vocab_size=VOCAB_SIZE, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  # Small, so that most rotary frequencies are scaled or blended within a 60-token test.
                  "original_max_position_embeddings": 32}


@dataclass(frozen=True)
class Spec:
    model_class: str  # transformers class name
    config_class: str
    config: dict
    gguf_arch: str | None  # llama.cpp's architecture name; None where GGUF cannot express the config
    seed: int = 0


SPECS = {
    "llama": Spec("LlamaForCausalLM", "LlamaConfig",
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2), "llama"),
    "llama3_rope": Spec("LlamaForCausalLM", "LlamaConfig",
                        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, rope_scaling=LLAMA3_SCALING),
                        "llama"),
    # One kv head (MQA); sliding_window None as in Mistral v0.2+.
    "mistral": Spec("MistralForCausalLM", "MistralConfig",
                    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=1,
                         sliding_window=None), "llama"),
    # Mistral 7B v0.1 windows every layer; a window of 8 matters within the 24-token prompt.
    "mistral_window": Spec("MistralForCausalLM", "MistralConfig",
                           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, sliding_window=8),
                           None),
    "qwen2": Spec("Qwen2ForCausalLM", "Qwen2Config",
                  dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True,
                       rope_theta=1e6), "qwen2"),
    # hidden 32 with 4 heads of 16: head_dim != hidden / heads, so GGUF needs attention.key_length.
    "qwen3": Spec("Qwen3ForCausalLM", "Qwen3Config",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3), "qwen3"),
    # What a Gemma 3 GGUF can say: llama.cpp fixes the 5:1 sliding pattern, the local rope base (10000) and the
    # attention scale (head_dim), so this config uses exactly those; 6 layers give 5 sliding and 1 full.
    "gemma3": Spec("Gemma3ForCausalLM", "Gemma3TextConfig",
                   dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, sliding_window=4,
                        query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=10000.0), "gemma3",
                   seed=1),  # tied embeddings make seed 0's greedy decode echo a few tokens; seed 1 wanders
    # What only config.json can say: free layer_types, query_pre_attn_scalar != head_dim, another local rope base,
    # final logit soft-capping, an untied lm_head.
    "gemma3_hf": Spec("Gemma3ForCausalLM", "Gemma3TextConfig",
                      dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, sliding_window=6,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                        "sliding_attention"],
                           query_pre_attn_scalar=24, rope_theta=10000.0, rope_local_base_freq=100.0,
                           final_logit_softcapping=30.0, tie_word_embeddings=False), None),
}
# Mixture-of-experts models, kept out of SPECS: the native whole-model step (and its tests over SPECS) has no MoE
# block; the family, loader and engine tests take both.
MOE_SPECS = {
    # Qwen3-Coder-30B-A3B's layout in small: every layer sparse, top 3 of 8 experts renormalised (what a qwen3moe GGUF
    # can say). Expert rows of 32 so that Q8_0 blocks fit the down projection.
    "qwen3_moe": Spec("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                           num_experts=8, num_experts_per_tok=3, norm_topk_prob=True), "qwen3moe"),
    # What only config.json can say: a dense layer among sparse ones (mlp_only_layers, decoder_sparse_step) and
    # top-k weights left as the softmax gave them.
    "qwen3_moe_hf": Spec("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                         dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
                              num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[2]), None),
}
GGUF_SPECS = [name for name, spec in {**SPECS, **MOE_SPECS}.items() if spec.gguf_arch]
# K-quants take rows of 256 weights: models wide enough for them (4 heads of 64), kept out of SPECS so that the
# family tests do not grow.
KQUANT_SPECS = {
    "llama_k": Spec("LlamaForCausalLM", "LlamaConfig",
                    dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64), "llama"),
    "qwen2_k": Spec("Qwen2ForCausalLM", "Qwen2Config",
                    dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64,
                         tie_word_embeddings=True, rope_theta=1e6), "qwen2"),
    "qwen3_moe_k": Spec("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
                             head_dim=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True), "qwen3moe"),
}
# Heads of 64 (a multiple of 32): what the native prompt attention's bf16 kernel takes. A Gemma 3 whose windows of 40
# slide across the kernel's 256-key chunks, and a Llama with grouped heads.
WIDE_HEAD_SPECS = {
    "gemma3_64": Spec("Gemma3ForCausalLM", "Gemma3TextConfig",
                      dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, head_dim=64, sliding_window=40,
                           query_pre_attn_scalar=64, rope_theta=1e6, rope_local_base_freq=10000.0), None, seed=1),
}
GGUF_NAME_MAPS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "gemma3": gguf.MODEL_ARCH.GEMMA3}


@dataclass
class Checkpoint:
    name: str
    model: transformers.PreTrainedModel  # the reference: holds exactly the weights the files hold
    hf_dir: Path | None = None
    gguf_path: Path | None = None


# ---- building ------------------------------------------------------------------------------------------------
def spec_of(name: str) -> Spec:
    return {**SPECS, **MOE_SPECS, **KQUANT_SPECS, **WIDE_HEAD_SPECS}[name]


def build_model(name: str) -> transformers.PreTrainedModel:
    spec = spec_of(name)
    config = getattr(transformers, spec.config_class)(**{**COMMON, **spec.config})
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * NOISE)
    return model


@functools.cache
def _scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="fastdecode-tests-")  # removed when the interpreter exits


def scratch_dir() -> Path:
    return Path(_scratch().name)


@functools.cache
def checkpoint(name: str) -> Checkpoint:
    """The named spec's model saved as safetensors and, where the spec allows, as an F32 GGUF."""
    model = build_model(name)
    ckpt = Checkpoint(name, model, hf_dir=scratch_dir() / name)
    model.save_pretrained(ckpt.hf_dir)
    if spec_of(name).gguf_arch:
        ckpt.gguf_path = scratch_dir() / f"{name}.gguf"
        write_gguf(model, ckpt.gguf_path, spec_of(name).gguf_arch)
    return ckpt


@functools.cache
def sharded_checkpoint(name: str) -> Path:
    """The same model as checkpoint(name), saved in several safetensors shards."""
    path = scratch_dir() / f"{name}-sharded"
    checkpoint(name).model.save_pretrained(path, max_shard_size="20KB")
    return path


def saved_weights(model) -> dict[str, torch.Tensor]:
    """The model's weights as its safetensors file names them, without the `model.` prefix: transformers 5 holds a
    layer's experts stacked (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)) and saves them one
    expert at a time (experts.{e}.gate_proj.weight ...)."""
    out = {}
    for key, tensor in model.state_dict().items():
        key = key.removeprefix("model.")
        if key.endswith("experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1))):
                out[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif key.endswith("experts.down_proj"):
            out.update({key.replace("down_proj", f"{e}.down_proj.weight"): w for e, w in enumerate(tensor)})
        else:
            out[key] = tensor
    return out


def quantized_type(gguf_name: str, ndim: int) -> QType:
    """What the quantized test file stores: norms and biases F32 (as llama.cpp keeps 1-D tensors), embeddings and
    output F16, every other matrix Q8_0."""
    if ndim == 1:
        return QType.F32
    if gguf_name.startswith(("token_embd", "output")):
        return QType.F16
    return QType.Q8_0


@functools.cache
def quantized_checkpoint(name: str) -> Checkpoint:
    """A GGUF with Q8_0 and F16 tensors; its reference model holds the weights the file dequantizes to."""
    model = build_model(name)
    path = scratch_dir() / f"{name}-q8_0.gguf"
    arch = spec_of(name).gguf_arch
    write_gguf(model, path, arch, tensor_type=quantized_type)
    return Checkpoint(f"{name}-q8_0", rounded_copy(model, arch, quantized_type), gguf_path=path)


def kquant_gguf(name: str, types: dict[str, QType]) -> Path:
    """KQUANT_SPECS[name] as a GGUF whose matrices are stored as `types` says by GGUF tensor kind ("attn_v",
    "token_embd", ...; Q4_K where unnamed), norms F32; written once per session."""
    key = "-".join(f"{k}.{v.name}" for k, v in sorted(types.items()))
    path = scratch_dir() / f"{name}-{key or 'all-Q4_K'}.gguf"
    if not path.exists():
        spec = KQUANT_SPECS[name]
        write_gguf(build_model(name), path, spec.gguf_arch,
                   tensor_type=lambda n, ndim: QType.F32 if ndim == 1 else types.get(n.split(".")[-2], QType.Q4_K))
    return path


def rounded_copy(model, arch: str, tensor_type) -> transformers.PreTrainedModel:
    """A copy of `model` whose weights went through quantize and dequantize. Rounding in Hugging Face layout
    equals rounding in GGUF layout: Q8_0 blocks run along a row and the llama permutation moves whole rows, and
    1-D tensors (where Gemma's +1 lives) stay F32."""
    ref = copy.deepcopy(model)
    names = gguf.get_tensor_name_map(GGUF_NAME_MAPS[arch], model.config.num_hidden_layers)
    with torch.no_grad():
        for hf_name, p in ref.named_parameters():
            qtype = tensor_type(gguf_tensors(names, hf_name, p)[0][0], p.ndim)
            data = p.numpy()
            rounded = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).reshape(data.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(rounded)))
    return ref


# ---- GGUF writing, after llama.cpp's convert_hf_to_gguf.py ---------------------------------------------------
def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """LlamaModel.permute: half-split rotary rows -> llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def global_rope(config) -> dict:
    rope = config.rope_parameters
    return rope.get("full_attention", rope)  # Gemma 3 keeps one entry per attention kind


def llama3_rope_factors(config) -> np.ndarray:
    """The `rope_freqs` divisors LlamaModel.generate_extra_tensors writes. Unlike the converter, which reads
    original_max_position_embeddings from the top level of config.json (default 8192), this reads it from the
    rope parameters where transformers keeps it; for Llama 3.1 both are 8192."""
    rope = global_rope(config)
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def add_tokenizer(w: gguf.GGUFWriter, vocab_size: int):
    """A minimal byte-level BPE vocabulary: three control tokens, single byte characters and one merge."""
    byte_chars = [chr(b) for b in range(33, 127)] + [chr(256 + b) for b in range(vocab_size)]
    tokens = ["<pad>", "<s>", "</s>"] + byte_chars[:vocab_size - 4] + ["ab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab_size - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)


def encode(data: np.ndarray, qtype: QType) -> np.ndarray:
    if qtype in kquants.QUANTIZERS:  # gguf reads K-quants but cannot write them
        return kquants.quantize(data, qtype)
    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:  # types gguf cannot produce (e.g. IQ4_NL): zero blocks, enough to test a refusal
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((*data.shape[:-1], data.shape[-1] // block * type_size), dtype=np.uint8)


def gguf_tensors(names, hf_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The GGUF tensors (name, data) a transformers parameter becomes. transformers 5 holds a layer's experts as
    stacked gate_up_proj (E, 2I, H) and down_proj (E, H, I); llama.cpp writes ffn_gate_exps and ffn_up_exps
    (E, I, H) and ffn_down_exps."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        stem = names.get_name(hf_name.replace("gate_up_proj", "down_proj")).replace("down", "{}")
        gate, up = tensor.chunk(2, dim=1)
        return [(f"{stem.format('gate')}.weight", gate), (f"{stem.format('up')}.weight", up)]
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"no GGUF name for {hf_name}")
    if hf_name.endswith("mlp.experts.down_proj"):
        name += ".weight"
    return [(name, tensor)]


def add_shape(w, c, rope_theta: float):
    """The hyperparameters every architecture's GGUF header holds, from a transformers config."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)


def write_gguf(model, path, arch: str, tensor_type=lambda gguf_name, ndim: QType.F32, skip: tuple[str, ...] = ()):
    """Writes `model` as llama.cpp would convert it to GGUF architecture `arch` (an unknown arch borrows the llama
    tensor names). `tensor_type(gguf_name, ndim)` picks each tensor's storage; `skip` drops tensors by GGUF name."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("fastdecode-test")
    add_shape(w, c, global_rope(c)["rope_theta"])
    if c.head_dim != c.hidden_size // c.num_attention_heads or arch == "gemma3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if arch == "qwen3moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    add_tokenizer(w, c.vocab_size)

    names = gguf.get_tensor_name_map(GGUF_NAME_MAPS.get(arch, gguf.MODEL_ARCH.LLAMA), c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # a tied checkpoint has no output.weight; llama.cpp reuses token_embd
        for name, data in gguf_tensors(names, hf_name, tensor.detach().float()):
            data = data.numpy()
            if arch == "llama" and ".q_proj." in hf_name:
                data = permute(data, c.num_attention_heads, c.num_attention_heads)
            elif arch == "llama" and ".k_proj." in hf_name:
                data = permute(data, c.num_attention_heads, c.num_key_value_heads)
            if arch == "gemma3" and hf_name.endswith("norm.weight"):
                data = data + 1.0
            if name in skip:
                continue
            qtype = tensor_type(name, data.ndim)
            w.add_tensor(name, encode(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    rope = global_rope(c)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- running -------------------------------------------------------------------------------------------------
@contextmanager
def single_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared, loaded machine OpenMP's waiting makes a
    (44, 64) x (64, 128) matmul take 30 ms instead of 20 us."""
    with torch_threads(1):
        yield


def prompt_tokens(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=g).tolist()


@dataclass
class Run:
    prefill_logits: torch.Tensor  # (P, vocab): every prompt position
    tokens: list[int]  # greedy tokens g0..gN; g0 comes from the prefill
    step_logits: torch.Tensor  # (N, vocab): decode step i feeds tokens[i] and predicts tokens[i + 1]


@torch.no_grad()
def reference_run(model, prompt: list[int], steps: int) -> Run:
    """transformers' own prefill and cached greedy decode."""
    cache = transformers.DynamicCache(config=model.config)  # filled in place; sliding layers keep their window
    prefill = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0].float()
    tokens, step_logits = [int(prefill[-1].argmax())], []
    for _ in range(steps):
        out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        step_logits.append(out.logits[0, -1].float())
        tokens.append(int(step_logits[-1].argmax()))
    return Run(prefill, tokens, torch.stack(step_logits))


@torch.no_grad()
def our_run(model, prompt: list[int], steps: int) -> Run:
    """fastdecode's prefill and cached greedy decode, feeding its own tokens back one at a time."""
    model.setup_cache(len(prompt) + steps + 1)
    prefill = model(torch.tensor([prompt]), start=0, all_logits=True)[0].float()
    tokens, step_logits = [int(prefill[-1].argmax())], []
    for i in range(steps):
        logits = model(torch.tensor([[tokens[-1]]]), start=len(prompt) + i)[0, -1].float()
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return Run(prefill, tokens, torch.stack(step_logits))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()
