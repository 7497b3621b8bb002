"""Model configuration: one plain dataclass with Hugging Face field names, read from config.json or GGUF metadata."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fastdecode.errors import ModelFileError, UnsupportedModelError

# Architecture names as Hugging Face writes them in `config.json["architectures"]`, mapped to our family names.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
               "gemma3_text": "gemma3", "gemma3": "gemma3", "gpt_oss": "gpt_oss"}
SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3", "yarn")
# The rope_scaling keys layers/rotary.py reads for each kind: those it needs, and those it reads where given.
ROPE_SCALING_KEYS = {"linear": (("factor",), ()),
                     "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                                ()),
                     "yarn": (("factor", "original_max_position_embeddings"),
                              ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"))}
# llama.cpp's names for them (after `{architecture}.`).
GGUF_ROPE_KEYS = {"factor": "rope.scaling.factor", "original_max_position_embeddings":
                  "rope.scaling.original_context_length", "beta_fast": "rope.scaling.yarn_beta_fast",
                  "beta_slow": "rope.scaling.yarn_beta_slow"}
# Sizes far beyond any released model's (the largest have about 128 layers, hidden 16k, 262k-token vocabularies and
# 10M-token contexts), below which nothing built from a config can take more than a file of its size can hold: a
# hostile header asking for 2^31 layers is refused before a list of that length is made.
SIZE_LIMITS = {"vocab_size": 1 << 23, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 4096,
               "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
               "max_position_embeddings": 1 << 26, "num_experts": 1 << 12, "num_experts_per_tok": 1 << 12,
               "moe_intermediate_size": 1 << 20, "decoder_sparse_step": 4096}
# GGUF `general.architecture` values we read.
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma3": "gemma3", "gpt-oss": "gpt_oss"}
# config.json keys of MoE layouts other families use; a qwen3_moe config that sets one is refused, not half-run.
UNSUPPORTED_MOE_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                        "first_k_dense_replace", "n_group", "topk_group")


@dataclass
class ModelConfig:
    family: str  # llama | qwen2 | qwen3 | qwen3_moe | gemma3 | gpt_oss: picks the block variant
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF form: {"rope_type": "llama3"|"linear", "factor": ..., ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    hidden_act: str = "silu"  # Gemma 3 uses gelu_pytorch_tanh
    # Gemma 3 only.
    query_pre_attn_scalar: float | None = None  # attention scale is query_pre_attn_scalar**-0.5 when set
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention" per layer
    rope_local_base_freq: float = 10000.0  # rope base of sliding-window layers
    final_logit_softcapping: float | None = None
    # Mixture of experts (qwen3_moe); num_experts 0 means every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # width of one expert's SwiGLU
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse iff (i + 1) % step == 0 and i is not in mlp_only_layers
    mlp_only_layers: list[int] = field(default_factory=list)
    # gpt-oss only: its experts' clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and
    # |up| <= limit; None means the plain SwiGLU.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe", "gemma3")

    @property
    def attention_sinks(self) -> bool:
        """gpt-oss: one learned logit per head joins each softmax's denominator (attention may go to no token)."""
        return self.family == "gpt_oss"

    @property
    def softmax_after_topk(self) -> bool:
        """gpt-oss's router: the top-k logits, then their softmax (Qwen3-MoE's: a softmax over all, then the top k)."""
        return self.family == "gpt_oss"

    @property
    def moe_bias(self) -> bool:
        """gpt-oss: its router and experts carry biases."""
        return self.family == "gpt_oss"

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has an MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Reads a Hugging Face config.json dict (multimodal Gemma 3 configs keep the text part in text_config)."""
        cfg = {**cfg, **cfg.get("text_config", {})}
        archs = cfg.get("architectures") or []
        family = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
        family = family or MODEL_TYPES.get(cfg.get("model_type", ""))
        if family is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: {sorted(HF_ARCHITECTURES)}")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias=true) are not supported")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rope_parameters = cfg.get("rope_parameters")  # transformers 5 nests rope settings here
        if rope_parameters:
            if "full_attention" in rope_parameters:  # Gemma 3: one entry per attention kind
                local = rope_parameters.get("sliding_attention", {})
                cfg.setdefault("rope_local_base_freq", local.get("rope_theta", 10000.0))
                rope_parameters = rope_parameters["full_attention"]
            rope_theta = rope_theta or rope_parameters.get("rope_theta")
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_parameters
        c = cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", family == "gemma3"),
            attention_bias=cfg.get("attention_bias", family in ("qwen2", "gpt_oss")),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if family == "gemma3" else None,
            sliding_window=cfg.get("sliding_window") if family == "gemma3" else None,
            rope_local_base_freq=cfg.get("rope_local_base_freq", 10000.0),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
        ).check()
        if rope_scaling:
            where = "rope_parameters" if rope_scaling is rope_parameters else "rope_scaling"
            check_rope_scaling(rope_scaling, lambda key: f"config.json {where}.{key}")
        if family == "gemma3":
            c.layer_types = cfg.get("layer_types") or gemma3_layer_types(
                c.num_hidden_layers, cfg.get("sliding_window_pattern", 6))
        else:
            c.rope_local_base_freq = c.rope_theta  # windowed layers outside Gemma keep the model's rope base
        if family == "qwen3_moe":
            read_hf_moe(c, cfg)
        if family == "gpt_oss":
            read_hf_gpt_oss(c, cfg)
        if cfg.get("model_type") == "mistral" and cfg.get("sliding_window"):
            c.sliding_window = cfg["sliding_window"]  # Mistral 7B v0.1: every layer attends within a window
            c.layer_types = ["sliding_attention"] * c.num_hidden_layers
        return c.check()

    def check(self) -> "ModelConfig":
        """Raises ModelFileError unless the sizes are positive integers within SIZE_LIMITS, the other fields pass
        field_checks and the heads group evenly. Called as soon as the sizes are read, before anything is built from
        them (a list per layer), and again once every field is read."""
        sizes = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings"]
        if self.num_experts != 0:  # an MoE model (None: a file that names no expert count)
            sizes += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"]
        bad = [name for name in sizes if type(getattr(self, name)) is not int or getattr(self, name) <= 0]
        if bad:
            raise ModelFileError(f"the model's {', '.join(bad)} must be positive integers")
        big = [f"{name} {getattr(self, name)} > {SIZE_LIMITS[name]}" for name in sizes
               if getattr(self, name) > SIZE_LIMITS[name]]
        if big:
            raise ModelFileError(f"the model's sizes are beyond any model's: {', '.join(big)}")
        wrong = [name for name, ok in self.field_checks() if not ok]
        if wrong:
            raise ModelFileError(f"the model's {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} malformed")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ModelFileError(f"{self.num_experts_per_tok} experts per token, but only {self.num_experts} experts")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelFileError(f"{self.num_attention_heads} attention heads do not share "
                                 f"{self.num_key_value_heads} key/value heads evenly")
        return self

    def field_checks(self):
        """(field, whether its value has the type and form the model code reads) for the fields beside the sizes."""
        def integers(v):
            return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

        yield "rms_norm_eps", number(self.rms_norm_eps) and self.rms_norm_eps >= 0
        for name in ("rope_theta", "rope_local_base_freq", "swiglu_alpha"):
            yield name, number(getattr(self, name)) and getattr(self, name) > 0
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "swiglu_limit"):
            yield name, getattr(self, name) is None or (number(getattr(self, name)) and getattr(self, name) > 0)
        yield "sliding_window", self.sliding_window is None or (type(self.sliding_window) is int
                                                                 and self.sliding_window > 0)
        yield "hidden_act", isinstance(self.hidden_act, str)
        yield "rope_scaling", self.rope_scaling is None or isinstance(self.rope_scaling, dict)
        yield "layer_types", self.layer_types == [] or (
            isinstance(self.layer_types, list) and len(self.layer_types) == self.num_hidden_layers
            and all(t in ("sliding_attention", "full_attention") for t in self.layer_types))
        yield "mlp_only_layers", integers(self.mlp_only_layers)
        yield "eos_token_id", integers(self.eos_token_id)
        yield "bos_token_id", self.bos_token_id is None or integers([self.bos_token_id])
        for name in ("tie_word_embeddings", "attention_bias", "norm_topk_prob"):
            yield name, isinstance(getattr(self, name), bool)

    @classmethod
    def from_gguf(cls, meta: dict) -> "ModelConfig":
        """Reads GGUF metadata (a dict of field name to value) the way llama.cpp names it; values of the wrong type
        or out of range are a ModelFileError."""
        try:
            config = cls._read_gguf(meta)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            raise ModelFileError(f"malformed GGUF metadata ({type(e).__name__}: {e})") from None
        return config.check()

    @classmethod
    def _read_gguf(cls, meta: dict) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
        family = GGUF_ARCHITECTURES[arch]

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        kv_heads = get("attention.head_count_kv", heads)
        head_dim = get("attention.key_length") or hidden // heads
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        scaling, kind = None, get("rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        elif kind == "yarn":
            scaling = gguf_yarn(get, truncate=family != "gpt_oss")
        elif kind != "none":
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (only linear, llama3 and yarn)")
        if scaling:
            check_rope_scaling(scaling, lambda key: f"GGUF {arch}.{GGUF_ROPE_KEYS.get(key, key)}")
        c = cls(
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_hidden_layers=get("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=get("context_length", 8192),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=True,  # corrected by the loader when an output.weight tensor exists
            hidden_act="gelu_pytorch_tanh" if family == "gemma3" else "silu",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=[meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else [],
        ).check()
        rotated = get("rope.dimension_count", c.head_dim)
        if rotated != c.head_dim:
            raise UnsupportedModelError(f"GGUF {arch}.rope.dimension_count is {rotated!r}, not the head size "
                                        f"{c.head_dim}: partial rotary embeddings are not supported")
        if family != "gemma3":
            c.rope_local_base_freq = c.rope_theta  # only Gemma 3's windowed layers have their own base
        if family == "qwen2":
            c.attention_bias = True
        if family == "qwen3_moe":
            read_gguf_moe(c, get)
        if family == "gpt_oss":
            read_gguf_gpt_oss(c, get)
        if family == "gemma3":
            # llama.cpp's rule (GGUF has no key for it): the 27B (62 layers) scales by hidden/heads (= its
            # query_pre_attn_scalar, 168), every other size by head_dim.
            c.query_pre_attn_scalar = hidden // heads if c.num_hidden_layers == 62 else head_dim
            c.sliding_window = get("attention.sliding_window")
            c.final_logit_softcapping = get("final_logit_softcapping")
            c.layer_types = gemma3_layer_types(c.num_hidden_layers, 6)
        return c


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_rope_scaling(scaling: dict, name):
    """Raises UnsupportedModelError for a kind of scaling layers/rotary.py does not have, and ModelFileError, naming
    the key as `name(key)` spells it, unless each key it reads for this kind is a finite number it can use: factors,
    lengths and betas above 0 (each divides or goes under a logarithm), mscales not negative, llama3's high frequency
    factor above its low one (it divides by the gap)."""
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in SUPPORTED_ROPE_SCALING:
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_ROPE_SCALING}")
    needed, optional = ROPE_SCALING_KEYS.get(kind, ((), ()))
    for key in needed + optional:
        value = scaling.get(key)
        if value is None:
            if key in needed:
                raise ModelFileError(f"{name(key)} is missing ({kind} rope scaling needs it)")
            continue
        zero_ok = key.startswith("mscale")  # an mscale of 0 means none
        if not number(value) or value < 0 or (value == 0 and not zero_ok):
            raise ModelFileError(f"{name(key)} is {value!r}: it must be a finite number "
                                 f"{'of 0 or more' if zero_ok else 'above 0'}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelFileError(f"{name('high_freq_factor')} ({scaling['high_freq_factor']}) must be above "
                             f"{name('low_freq_factor')} ({scaling['low_freq_factor']})")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ModelFileError(f"{name('truncate')} is {scaling['truncate']!r}: it must be true or false")


def gemma3_layer_types(num_layers: int, pattern: int) -> list[str]:
    # Every `pattern`-th layer attends globally; the rest use the sliding window (Gemma 3 report, 5:1).
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def read_hf_moe(c: ModelConfig, cfg: dict):
    """The MoE fields of a Qwen3-MoE config.json (transformers' Qwen3MoeConfig), or UnsupportedModelError naming the
    first key of a layout it does not have."""
    for key in UNSUPPORTED_MOE_KEYS:
        if cfg.get(key):
            raise UnsupportedModelError(f"qwen3_moe: {key}={cfg[key]!r} is not supported (no shared experts, dense "
                                        "prefix or grouped routing in this family)")
    c.num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    c.num_experts_per_tok = cfg.get("num_experts_per_tok", 0)
    c.moe_intermediate_size = cfg.get("moe_intermediate_size", 0)
    c.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    c.decoder_sparse_step = cfg.get("decoder_sparse_step", 1)
    c.mlp_only_layers = list(cfg.get("mlp_only_layers") or [])


def read_gguf_moe(c: ModelConfig, get):
    """The MoE fields of qwen3moe GGUF metadata. llama.cpp's qwen3moe runs every layer sparse and renormalises the
    top-k weights (its converter writes no key for either), so a file saying otherwise is refused."""
    if get("expert_shared_count", 0) or get("expert_shared_feed_forward_length", 0):
        raise UnsupportedModelError("qwen3moe: shared experts (expert_shared_count) are not supported")
    if get("expert_gating_func", 1) != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModelError(f"qwen3moe: expert_gating_func {get('expert_gating_func')} is not supported "
                                    "(softmax only)")
    c.num_experts = get("expert_count")
    c.num_experts_per_tok = get("expert_used_count")
    c.moe_intermediate_size = get("expert_feed_forward_length")
    c.norm_topk_prob = bool(get("expert_weights_norm", True))
    c.intermediate_size = c.intermediate_size or c.moe_intermediate_size  # dense width: unused, every layer is sparse


def gguf_yarn(get, truncate: bool) -> dict:
    """llama.cpp's YaRN keys in transformers' rope_parameters form. `truncate` (round the correction range to whole
    dimensions) has no key: transformers' default is true, gpt-oss's config.json sets it false."""
    return {"rope_type": "yarn", "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": truncate}


def gpt_oss_layer_types(num_layers: int) -> list[str]:
    # transformers' GptOssConfig default and llama.cpp's swa pattern 2: even layers slide, odd ones see everything.
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def read_hf_gpt_oss(c: ModelConfig, cfg: dict):
    """gpt-oss: every layer sparse, top-k softmax over the chosen logits (so renormalised), experts as wide as
    intermediate_size, alternating windowed layers. Its experts load as float or MXFP4 blocks, nothing else."""
    method = (cfg.get("quantization_config") or {}).get("quant_method", "mxfp4")
    if method != "mxfp4":
        raise UnsupportedModelError(f"gpt_oss: quantization_config quant_method {method!r} is not supported "
                                    "(float or mxfp4 experts only)")
    c.num_experts = cfg.get("num_local_experts", cfg.get("num_experts", 0))
    c.num_experts_per_tok = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token", 0)
    c.moe_intermediate_size = c.intermediate_size
    c.norm_topk_prob = True
    c.swiglu_limit = float(cfg.get("swiglu_limit", 7.0))
    c.swiglu_alpha = float(cfg.get("swiglu_alpha", 1.702))
    c.sliding_window = cfg.get("sliding_window")
    c.layer_types = cfg.get("layer_types") or gpt_oss_layer_types(c.num_hidden_layers)
    c.rms_norm_eps = cfg.get("rms_norm_eps", 1e-5)


def read_gguf_gpt_oss(c: ModelConfig, get):
    """gpt-oss GGUF metadata (llama.cpp's `gpt-oss` architecture). llama.cpp fixes the SwiGLU limit (7.0) and alpha
    (1.702) and the alternating window pattern; its converter writes no key for them."""
    c.num_experts = get("expert_count")
    c.num_experts_per_tok = get("expert_used_count")
    c.moe_intermediate_size = get("expert_feed_forward_length")
    c.intermediate_size = c.intermediate_size or c.moe_intermediate_size
    c.norm_topk_prob = True
    c.attention_bias = True
    c.swiglu_limit = 7.0
    c.sliding_window = get("attention.sliding_window")
    c.layer_types = gpt_oss_layer_types(c.num_hidden_layers)
