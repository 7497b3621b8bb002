"""Model descriptions for the roofline: a built-in catalog (models.toml), a Hugging Face config.json, or a GGUF
header. What matters for decode speed is which weights one token reads (all of a dense model, the active experts of
a mixture of experts), the KV cache one token reads, and the FLOPs."""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fastdecode.errors import FastdecodeError, ModelFileError, UnsupportedModelError

CATALOG_FILE = Path(__file__).with_name("models.toml")
# Bits per weight, scales included: int4 adds a bf16 scale and zero per group (gpt-fast's layout), fp4 is MXFP4
# (one 8-bit scale per 32). int8 and fp8 scales are per channel or per 128x128 block: negligible.
DTYPE_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.0, "fp4": 4.25}
DTYPES = tuple(DTYPE_BITS)


class UnknownModelError(FastdecodeError):
    """A -m that is neither a catalog name nor a readable config.json or GGUF file."""


def bits_per_weight(dtype: str, group_size: int = 128) -> float:
    """Bits one weight costs in memory: one of DTYPES or a GGML type name such as q4_1 (exact block size)."""
    key = dtype.strip().lower()
    if key == "int4":
        return 4.0 + 32.0 / group_size
    if key in DTYPE_BITS:
        return DTYPE_BITS[key]
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[key.upper()]]
    except KeyError:
        raise FastdecodeError(f"unknown weight format {dtype!r}; use one of {', '.join(DTYPES)} "
                              "or a GGUF type such as q4_1") from None
    return type_size * 8.0 / block


@dataclass(frozen=True)
class TensorBytes:
    """Exact weight bytes from a GGUF tensor table."""
    dense: int  # read by every token: attention, dense MLP, shared experts, router, norms
    head: int  # the LM head (token_embd.weight when tied)
    routed: int  # all routed-expert tensors together
    embed_row: int  # one row of the embedding table: all an input token reads of it
    total: int  # every tensor: what must be resident
    params: int
    format: str  # the file type, e.g. Q4_1


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    lm_head: int  # 0 when tied (the embedding matrix serves as the head)
    attention: int
    dense_mlp: int
    shared_experts: int
    routed_experts: int
    router: int
    norms: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # width of the dense MLP layers
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0  # width of one expert
    first_k_dense_replace: int = 0  # leading layers with a dense MLP (DeepSeek)
    # multi-head latent attention (DeepSeek, Kimi): the KV cache holds one latent per token
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0
    sliding_layers: int = 0
    dtype: str = "bf16"  # the format the weights are published in
    expert_dtype: str = ""  # routed experts' format where it differs
    source: str = ""
    gguf: TensorBytes | None = None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def heads_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace if self.num_experts else 0

    def params(self) -> ParamCounts:
        h, n_layers = self.hidden_size, self.num_hidden_layers
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * self.num_attention_heads * qk if self.q_lora_rank
                 else h * self.num_attention_heads * qk)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim)
                  + self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim))
            attn = q + kv + self.num_attention_heads * self.v_head_dim * h
            extra_norms = self.q_lora_rank + self.kv_lora_rank
        else:
            d = self.heads_dim
            attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
            extra_norms = 0
        expert = 3 * h * self.moe_intermediate_size  # gate, up, down
        embedding = self.vocab_size * h
        return ParamCounts(
            embedding=embedding, lm_head=0 if self.tie_word_embeddings else embedding,
            attention=attn * n_layers, dense_mlp=3 * h * self.intermediate_size * (n_layers - self.moe_layers),
            shared_experts=self.n_shared_experts * expert * self.moe_layers,
            routed_experts=self.num_experts * expert * self.moe_layers, router=h * self.num_experts * self.moe_layers,
            norms=(2 * h + extra_norms) * n_layers + h)

    def total_params(self) -> int:
        return self.gguf.params if self.gguf else self.params().total

    def active_params(self) -> int:
        """Weights one token multiplies by: all but the embedding table and the unchosen experts (LM head included)."""
        p = self.params()
        read = p.total - p.embedding - p.lm_head + self.vocab_size * self.hidden_size
        return read - p.routed_experts + round(p.routed_experts * self.expert_fraction(1))

    def expert_fraction(self, tokens: int) -> float:
        """Expected fraction of routed experts a forward over `tokens` tokens touches (uniform routing)."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.num_experts_per_tok / self.num_experts) ** tokens

    def weight_bytes(self, dtype: str | None = None, tokens: int = 1, group_size: int = 128) -> float:
        """Weight bytes one forward over `tokens` tokens reads. dtype None: as published (exact for a GGUF)."""
        if self.gguf and dtype is None:
            g = self.gguf
            return g.dense + g.head + g.routed * self.expert_fraction(tokens) + g.embed_row
        p = self.params()
        bits = bits_per_weight(dtype or self.dtype, group_size)
        expert_bits = bits if dtype else bits_per_weight(self.expert_dtype or self.dtype, group_size)
        always = p.attention + p.dense_mlp + p.shared_experts + p.router + p.norms + self.vocab_size * self.hidden_size
        return (always * bits + p.routed_experts * self.expert_fraction(tokens) * expert_bits
                + self.hidden_size * bits) / 8

    def resident_weight_bytes(self, dtype: str | None = None, group_size: int = 128) -> float:
        """Bytes all the weights occupy: what must fit in memory."""
        if self.gguf and dtype is None:
            return float(self.gguf.total)
        p = self.params()
        bits = bits_per_weight(dtype or self.dtype, group_size)
        expert_bits = bits if dtype else bits_per_weight(self.expert_dtype or self.dtype, group_size)
        return ((p.total - p.routed_experts) * bits + p.routed_experts * expert_bits) / 8

    def kv_elements_per_token(self) -> int:
        """KV cache elements one token adds to one layer: K and V per KV head, or one MLA latent."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.heads_dim

    def kv_bytes(self, context: int, kv_dtype: str = "bf16") -> float:
        """Bytes of KV cache held for `context` tokens, which is also what one decode step reads."""
        full = self.num_hidden_layers - self.sliding_layers
        positions = full * context + self.sliding_layers * min(context, self.sliding_window or context)
        return self.kv_elements_per_token() * positions * bits_per_weight(kv_dtype) / 8

    def attention_flops(self, tokens: int, context: int) -> float:
        """FLOPs of QK^T and PV for `tokens` new tokens after `context` cached ones (causal)."""
        if self.mla:  # absorbed form: scores over the latent plus the rope part, values in the latent
            per_pair = 2 * self.num_attention_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim)
        else:
            per_pair = 2 * self.num_attention_heads * 2 * self.heads_dim
        pairs_full = tokens * context + tokens * (tokens + 1) / 2
        pairs_window = min(pairs_full, tokens * (self.sliding_window or context + tokens))
        full = self.num_hidden_layers - self.sliding_layers
        return per_pair * (full * pairs_full + self.sliding_layers * pairs_window)

    def flops(self, tokens: int, context: int, sampled: int | None = None) -> float:
        """FLOPs of a forward over `tokens` tokens after `context` cached ones: 2 per active weight per token, the LM
        head's only for the `sampled` rows (None: every row, as in decode and verify; a prompt samples its last)."""
        head = self.vocab_size * self.hidden_size
        rows = tokens if sampled is None else sampled
        return 2.0 * ((self.active_params() - head) * tokens + head * rows) + self.attention_flops(tokens, context)


def load_catalog(path: Path = CATALOG_FILE) -> dict[str, ModelSpec]:
    with open(path, "rb") as f:
        return {name: ModelSpec(name=name, **entry) for name, entry in tomllib.load(f).items()}


def get_model(name_or_path: str, catalog: dict[str, ModelSpec] | None = None) -> ModelSpec:
    """A catalog name, a config.json (or a folder holding one), or a .gguf file."""
    catalog = catalog or load_catalog()
    key = name_or_path.strip().lower()
    if key in catalog:
        return catalog[key]
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return from_gguf(path) if path.suffix.lower() == ".gguf" else from_hf_config(path)
    raise UnknownModelError(f"unknown model {name_or_path!r}: not a file, and not one of {', '.join(catalog)}")


# ---- Hugging Face config.json ----------------------------------------------------------------------------------
def from_hf_config(path: str | Path) -> ModelSpec:
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFileError(f"cannot read {path} as a config.json: {e}") from None
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers (Gemma 3) nest the language model
    try:
        heads = cfg["num_attention_heads"]
        n_layers = cfg["num_hidden_layers"]
        experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        expert_width = (cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0) if experts else 0
        # Qwen-MoE gives one wide shared expert; count it in experts of the routed width
        shared = cfg.get("n_shared_experts") or round((cfg.get("shared_expert_intermediate_size") or 0)
                                                      / max(expert_width, 1))
        layer_types = cfg.get("layer_types") or []
        quant = (cfg.get("quantization_config") or {}).get("quant_method", "")
        dtype = {"float32": "fp32", "float16": "fp16"}.get(cfg.get("torch_dtype") or cfg.get("dtype"), "bf16")
        return ModelSpec(
            name=cfg.get("_name_or_path") or path.parent.name or path.stem,
            hidden_size=cfg["hidden_size"], num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or 0, intermediate_size=cfg.get("intermediate_size") or 0,
            vocab_size=cfg["vocab_size"], tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0,
            n_shared_experts=shared, moe_intermediate_size=expert_width,
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0, qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            v_head_dim=cfg.get("v_head_dim") or 0,
            sliding_window=(cfg.get("sliding_window") or 0) if layer_types else 0,
            sliding_layers=sum(t == "sliding_attention" for t in layer_types),
            dtype="fp8" if quant == "fp8" else dtype, expert_dtype="fp4" if quant == "mxfp4" else "",
            source=str(path))
    except (KeyError, TypeError) as e:
        raise UnsupportedModelError(f"{path}: not a decoder config we can read (missing {e})") from None


# ---- GGUF header -----------------------------------------------------------------------------------------------
def _scalar(value) -> int:
    return int(max(value)) if isinstance(value, list) else int(value or 0)


def from_gguf(path: str | Path) -> ModelSpec:
    from gguf import LlamaFileType

    from fastdecode.loading.gguf_file import GGUFFile

    f = GGUFFile(path)
    md, tensors = f.metadata, f.tensors
    arch = md.get("general.architecture", "llama")

    def key(name, default=0):
        return md.get(f"{arch}.{name}", default)

    if "token_embd.weight" not in tensors or not key("block_count"):
        raise UnsupportedModelError(f"{path}: no token_embd.weight or {arch}.block_count; not a decoder we know")
    hidden, heads = _scalar(key("embedding_length")), _scalar(key("attention.head_count"))
    embd = tensors["token_embd.weight"]
    vocab = key("vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or embd.shape[0]
    nbytes = {name: t.data.nbytes for name, t in tensors.items()}
    routed = sum(n for name, n in nbytes.items() if "_exps." in name)
    head = nbytes.get("output.weight", nbytes["token_embd.weight"])
    dense = sum(nbytes.values()) - routed - nbytes["token_embd.weight"] - nbytes.get("output.weight", 0)
    try:
        file_format = LlamaFileType(md.get("general.file_type", -1)).name.removeprefix("MOSTLY_")
    except ValueError:
        file_format = "gguf"
    n_layers = _scalar(key("block_count"))
    # Gemma 3 makes every 6th layer global; newer files store the pattern as one flag per layer.
    pattern = key("attention.sliding_window_pattern", 6 if arch == "gemma3" else 0)
    sliding_layers = (sum(map(bool, pattern)) if isinstance(pattern, list)
                      else n_layers - n_layers // pattern if pattern > 1 else 0)
    return ModelSpec(
        name=md.get("general.name") or Path(path).stem, hidden_size=hidden, num_hidden_layers=n_layers,
        num_attention_heads=heads, num_key_value_heads=_scalar(key("attention.head_count_kv")) or heads,
        head_dim=_scalar(key("attention.key_length")), intermediate_size=_scalar(key("feed_forward_length")),
        vocab_size=vocab, tie_word_embeddings="output.weight" not in tensors,
        num_experts=_scalar(key("expert_count")), num_experts_per_tok=_scalar(key("expert_used_count")),
        n_shared_experts=_scalar(key("expert_shared_count")),
        moe_intermediate_size=_scalar(key("expert_feed_forward_length")),
        first_k_dense_replace=_scalar(key("leading_dense_block_count")),
        kv_lora_rank=_scalar(key("attention.kv_lora_rank")),
        qk_rope_head_dim=_scalar(key("rope.dimension_count")) if key("attention.kv_lora_rank") else 0,
        sliding_window=_scalar(key("attention.sliding_window")), sliding_layers=sliding_layers,
        source=str(path),
        gguf=TensorBytes(dense=dense, head=head, routed=routed, embed_row=nbytes["token_embd.weight"] // vocab,
                         total=sum(nbytes.values()), params=sum(math.prod(t.shape) for t in tensors.values()),
                         format=file_format))
