"""The whole-model decode step in C++ (decode_step.cpp) for a built Transformer, where the model allows it."""
from __future__ import annotations

import torch
from torch import nn

from fastdecode.kernels import native_ops
from fastdecode.quant.split import RowSplitLinear

EMPTY = torch.empty(0)
ZERO_TABLE = torch.zeros(1, 1, dtype=torch.long)
SLOTS = 18  # tensors per layer, in decode_step.cpp's Slot order


def linear_tensors(module: nn.Module, parts: int = 1) -> list[torch.Tensor] | None:
    """(weight, bias) per part as decode_step.cpp takes them, `parts` pairs (a lone linear, then empty pairs; a
    RowSplitLinear of up to `parts` parts), or None for a linear it cannot run."""
    if isinstance(module, RowSplitLinear):
        pairs = [linear_tensors(p) for p in module.parts]
        if len(pairs) > parts or any(pair is None for pair in pairs):
            return None
        return [t for pair in pairs for t in pair] + [EMPTY, EMPTY] * (parts - len(pairs))
    bias = module.bias if module.bias is not None else EMPTY
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
        weight = module.weight
    elif getattr(module, "backend", None) == "native":  # Int8Linear, Int4Linear: scales live in the packed weight
        weight = module.qweight
    else:
        return None
    return [weight, bias] + [EMPTY, EMPTY] * (parts - 1)


def layer_tensors(block) -> list[list[torch.Tensor] | None]:
    """A block's norms, then its linears' (weight, bias) pairs (q/k/v: two parts), in decode_step.cpp's slot order."""
    attn, mlp = block.self_attn, block.mlp

    def norm(name, owner=block):
        m = getattr(owner, name, None)
        return m.weight if m is not None else EMPTY
    return [[norm("input_layernorm"), norm("post_attention_layernorm"), norm("pre_feedforward_layernorm"),
             norm("post_feedforward_layernorm"), norm("q_norm", attn), norm("k_norm", attn)],
            linear_tensors(attn.qkv_proj, parts=2), linear_tensors(attn.o_proj), linear_tensors(mlp.gate_up_proj),
            linear_tensors(mlp.down_proj)]


def layer_weights(block) -> list[torch.Tensor]:
    """A block's tensors in decode_step.cpp's slot order, without the cache (the last two slots)."""
    return [t for group in layer_tensors(block) for t in group]


def model_supported(model) -> bool:
    """Float32 embeddings on the CPU, a dense MLP in every layer (decode_step.cpp has no mixture-of-experts block)
    and every linear one decode_step.cpp runs."""
    if any(not hasattr(block.mlp, "gate_up_proj") for block in model.layers):
        return False
    layers_ok = all(group is not None for block in model.layers for group in layer_tensors(block))
    return (model.embed_tokens.weight.dtype == torch.float32 and model.embed_tokens.weight.device.type == "cpu"
            and layers_ok)


def layer_args(model) -> dict:
    """The model-wide arguments of forward_batch after the per-layer tensors and the batch."""
    c = model.config
    return dict(windows=[c.sliding_window if c.is_sliding(i) else 0 for i in range(c.num_hidden_layers)],
                H=c.num_attention_heads, K=c.num_key_value_heads, hd=c.head_dim, eps=c.rms_norm_eps,
                scale=c.attention_scale, sandwich=c.family == "gemma3", gelu=c.hidden_act.startswith("gelu"))


class NativeDecoder:
    """The native step over the model's own static cache (`Transformer.setup_cache`), one sequence whose slot i holds
    position i: what the drafters that run the target's layers, and the single-request speculative loop, call. The
    serving engine's paged cache goes through fastdecode.runners.native instead."""

    def __init__(self, model, ops):
        self.model, self.ops = model, ops
        self.args = layer_args(model)
        self.gather()

    def gather(self):
        """Collects the per-layer tensors in decode_step.cpp's slot order (again whenever the cache is replaced)."""
        self.cache = self.model.layers[0].self_attn.kv_cache.k
        self.weights = []
        for block in self.model.layers:
            self.weights += [*layer_weights(block), block.self_attn.kv_cache.k, block.self_attn.kv_cache.v]

    @staticmethod
    def supports(model) -> bool:
        return model_supported(model) and all(b.self_attn.kv_cache is not None and
                                              b.self_attn.kv_cache.k.shape[0] == 1 for b in model.layers)

    @torch.inference_mode()
    def __call__(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """token (1, 1) at position pos -> logits (vocab,)."""
        return self.model.head(self.hidden(token[0], torch.tensor([pos]), pos))[0]

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, slot0: int, tree_mask: torch.Tensor | None = None,
               layers: int | None = None) -> torch.Tensor:
        """tokens (T,) at positions (T,) written to cache slots slot0.. -> final hidden states (T, D), before the
        final norm. tree_mask (T, T) bool lets each token see its ancestors (default: a causal chain); `layers`
        runs only the first that many layers (a self-speculative draft)."""
        n = self.model.config.num_hidden_layers if layers is None else layers
        return self.run_layers(self.model.embed(tokens), 0, n, positions, slot0, tree_mask)

    @torch.inference_mode()
    def hidden_taps(self, tokens: torch.Tensor, positions: torch.Tensor, slot0: int,
                    tree_mask: torch.Tensor | None, taps: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """hidden() that also returns the residual after each layer in `taps` (sorted), for drafters that read the
        target's features: -> (final hidden states (T, D), [(T, D) per tap]). The layers run as consecutive ranges,
        each range's residual handed to the next, which is the same arithmetic as one call: logits are unchanged."""
        x, out, a = self.model.embed(tokens), [], 0
        for b in [t + 1 for t in taps] + [self.model.config.num_hidden_layers]:
            if b > a:
                x = self.run_layers(x, a, b, positions, slot0, tree_mask)
            out.append(x)
            a = b
        return x, out[:len(taps)]

    def run_layers(self, x: torch.Tensor, start: int, stop: int, positions: torch.Tensor, slot0: int,
                   tree_mask: torch.Tensor | None) -> torch.Tensor:
        """The residual stream x (T, D) through layers start..stop-1 in one call into C++: one sequence whose single
        block is the whole cache."""
        if self.model.layers[0].self_attn.kv_cache.k is not self.cache:
            self.gather()
        T, a, m = x.shape[0], self.args, self.model
        return self.ops.forward_batch(
            x, self.weights[start * SLOTS:stop * SLOTS], positions, torch.arange(slot0, slot0 + T),
            torch.tensor([0, T]), torch.tensor([slot0]), ZERO_TABLE, m.max_seq_len,
            EMPTY if tree_mask is None else tree_mask, m.rope_global, m.rope_local, a["windows"][start:stop],
            a["H"], a["K"], a["hd"], a["eps"], a["scale"], a["sandwich"], a["gelu"])


def native_decoder(model) -> NativeDecoder | None:
    """A NativeDecoder for the model when the native kernels are built and the model fits them, else None."""
    if not NativeDecoder.supports(model):
        return None
    ops = native_ops()
    return NativeDecoder(model, ops) if ops is not None else None
