"""One decoder-only transformer for the Llama, Qwen2, Qwen3, Qwen3-MoE, Gemma 3 and gpt-oss families.

The families differ in a few switches read from ModelConfig: q/k/v bias (Qwen2), q/k RMSNorm (Qwen3, Gemma 3),
a sparse mixture-of-experts block in place of the MLP (Qwen3-MoE, models/moe.py), and for Gemma 3 a scaled
embedding, four norms per block, GELU-tanh and sliding-window layers with their own rope base; gpt-oss adds attention
sinks (layers/attention.py), router and expert biases and a clamped SwiGLU. Module names follow
Hugging Face checkpoints, except the packed qkv_proj and gate_up_proj.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.config import ModelConfig
from fastdecode import memory
from fastdecode.layers.attention import Attention
from fastdecode.layers.batch import Batch
from fastdecode.layers.norm import RMSNorm
from fastdecode.layers.rotary import rope_cache
from fastdecode.models.moe import SparseMoE

# Hugging Face weight name -> (our packed module, index of its shard).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, width: int | None = None):
        """width: the inner size, config.intermediate_size unless given (an MoE expert's is smaller)."""
        super().__init__()
        width = width or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=config.moe_bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=config.moe_bias)
        self.gelu = config.hidden_act.startswith("gelu")
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.limit is not None:  # gpt-oss: clamped, and the up branch offset by one
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer)
        self.mlp = SparseMoE(config, MLP) if config.is_sparse(layer) else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        # Llama/Qwen: the norm before the MLP. Gemma 3: the norm after attention.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.sandwich = config.family == "gemma3"
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """The rows x (R, D) of a batch over a paged cache (Attention.forward) -> the residual stream after the
        block."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = math.sqrt(config.hidden_size) if config.family == "gemma3" else None
        self.max_seq_len = 0
        self.rope_freq_factors: torch.Tensor | None = None  # set by the GGUF loader for llama3-scaled models
        self.rope_global = self.rope_local = None
        self.cache: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # the reference forward's (setup_cache)

    # ---- cache -------------------------------------------------------------------------------------------------
    def setup_rope(self, max_seq_len: int):
        """The rope tables for positions up to max_seq_len (what the paged runners need of the model)."""
        c = self.config
        device = self.embed_tokens.weight.device
        self.max_seq_len = max_seq_len
        scaling = c.rope_scaling
        if self.rope_freq_factors is not None:
            scaling = {"rope_type": "freq_factors", "factors": self.rope_freq_factors}
        self.rope_global = rope_cache(c.head_dim, max_seq_len, c.rope_theta, scaling).to(device)
        # Gemma 3's windowed layers rotate unscaled at their own base; elsewhere every layer rotates alike.
        local_scaling = None if c.family == "gemma3" else scaling
        self.rope_local = rope_cache(c.head_dim, max_seq_len, c.rope_local_base_freq, local_scaling).to(device)

    def setup_cache(self, max_seq_len: int, batch: int = 1, dtype: torch.dtype | None = None):
        """Allocates the reference forward's KV cache, one sequence per batch row (in a paged cache of one block of
        max_seq_len slots each), and the rope tables for sequences up to max_seq_len tokens. The serving engine
        keeps its own (engine/kv_cache.py); this one is for `forward` and `hidden`: tests, the fidelity lab,
        training data."""
        c = self.config
        dtype = dtype or self.embed_tokens.weight.dtype
        device = self.embed_tokens.weight.device
        self.setup_rope(max_seq_len)
        # Pages made on first touch: a long context costs memory only as far as a sequence reaches into it.
        shape = (c.num_key_value_heads, batch * max_seq_len, c.head_dim)
        self.cache = tuple([memory.zeros(*shape, dtype=dtype, device=device, huge_pages=False) for _ in self.layers]
                           for _ in "kv")

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, start: int, all_logits: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions start..start+T-1 -> logits (B, T, vocab) or, by default, (B, 1, vocab)."""
        x = self.hidden(tokens, start)
        return self.head(x if all_logits else x[:, -1:])

    def hidden(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (B, T), a chain at positions start..start+T-1 written to those cache slots -> final hidden states
        (B, T, D), before the final norm. The same layers as the PyTorch runner's, over this model's reference
        cache."""
        B, T = tokens.shape
        if start + T > self.max_seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the cache of {self.max_seq_len}")
        if self.cache is None or self.cache[0][0].shape[1] != B * self.max_seq_len:
            self.setup_cache(self.max_seq_len, batch=B)  # the engine's model: its reference cache on first use
        positions = torch.arange(start, start + T)
        rows = torch.arange(B)
        slots = (rows[:, None] * self.max_seq_len + positions).reshape(-1)
        batch = Batch(tokens.reshape(-1), positions.repeat(B), slots, torch.arange(B + 1) * T, torch.full((B,), start),
                      rows[:, None], self.max_seq_len)
        x = self.run_layers(self.embed(batch.tokens), batch, *self.cache, 0, len(self.layers))
        return x.view(B, T, -1)

    def run_layers(self, x: torch.Tensor, batch: Batch, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                   start: int, stop: int) -> torch.Tensor:
        """The rows x (R, D) of a batch through layers start..stop-1 over a paged cache (per layer (kv_heads, slots,
        head_dim)): the PyTorch runner's forward and the reference forward's."""
        for layer in range(start, stop):
            block = self.layers[layer]
            rope = self.rope_local if block.self_attn.sliding else self.rope_global
            x = block(x, rope[0, batch.positions], rope[1, batch.positions], batch, k_cache[layer], v_cache[layer])
        return x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden states (..., D) -> logits (..., vocab)."""
        logits = self.lm_head(self.norm(x))
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ---- weights -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor | nn.Module]):
        """Copies Hugging Face-named weights (without the `model.` prefix) into the model, packing q/k/v and
        gate/up. Shapes are asserted: a mismatch means a wrong config, never a silent broadcast. A module (a quantized
        linear the checkpoint holds as is) replaces the module of its name."""
        for name, m in [(n, m) for n, m in weights.items() if isinstance(m, nn.Module)]:
            try:
                old = self.get_submodule(name)
            except AttributeError:
                raise ValueError(f"checkpoint module {name} has no place in the model (unsupported variant?)") from None
            if (m.out_features, m.in_features) != (old.out_features, old.in_features):
                raise ValueError(f"{name}: checkpoint shape {(m.out_features, m.in_features)} != model shape "
                                 f"{(old.out_features, old.in_features)}")
            self.set_submodule(name, m)
        weights = {n: w for n, w in weights.items() if not isinstance(w, nn.Module)}
        params = dict(self.named_parameters())
        packed: dict[str, list] = {}
        loaded = set()
        for name, tensor in weights.items():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
                target, index = PACKED_MODULES[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                packed.setdefault(key, [None] * (3 if target == "qkv_proj" else 2))[index] = tensor
                continue
            if name not in params:
                if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints carry
                    continue
                raise ValueError(f"checkpoint weight {name} has no place in the model (unsupported variant?)")
            self._copy(params[name], tensor, name)
            loaded.add(name)
        for key, shards in packed.items():
            if any(s is None for s in shards):
                raise ValueError(f"incomplete packed weight {key}")
            self._copy(params[key], torch.cat(shards, dim=0), key)
            loaded.add(key)
        if self.config.tie_word_embeddings or "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = [n for n in params if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        if self.config.family == "gemma3":  # Gemma's RMSNorm scales by (1 + weight)
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(1.0)

    @staticmethod
    def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str):
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        param.data = tensor.to(param.dtype).contiguous()  # adopt the loaded storage instead of copying into it
