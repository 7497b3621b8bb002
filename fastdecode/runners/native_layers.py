"""A built Transformer's layers as the C++ step (kernels/decode_step.cpp) takes them: each layer's tensors in the
step's slot order and the model's shape arguments (the native runner's), and NativeDecoder, the same step over the
model's static cache for the single-request loop (tensor parallelism, model drafters) until that loop joins the
engine. Here rather than in kernels/: it reads the model's modules, and the kernels sit below the models."""
from __future__ import annotations

import torch
from torch import nn

from fastdecode.kernels import native_ops
from fastdecode.models.moe import SparseMoE
from fastdecode.quant.split import RowSplitLinear

EMPTY = torch.empty(0)
ZERO_TABLE = torch.zeros(1, 1, dtype=torch.long)
SLOTS = 25  # tensors per layer, in decode_step.cpp's Slot order


def weight_name(module: nn.Module) -> str | None:
    """The attribute holding the weight decode_step.cpp reads: a float nn.Linear's weight, or the packed qweight of
    an Int8Linear/Int4Linear/KQuantLinear on its native backend (scales live in the packed weight); None for a linear
    it cannot run."""
    if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
        return "weight"
    if getattr(module, "backend", None) == "native":
        return "qweight"
    return None


def linear_tensors(module: nn.Module, parts: int = 1) -> list[torch.Tensor] | None:
    """(weight, bias) per part as decode_step.cpp takes them, `parts` pairs (a lone linear, then empty pairs; a
    RowSplitLinear of up to `parts` parts), or None for a linear it cannot run."""
    if isinstance(module, RowSplitLinear):
        pairs = [linear_tensors(p) for p in module.parts]
        if len(pairs) > parts or any(pair is None for pair in pairs):
            return None
        return [t for pair in pairs for t in pair] + [EMPTY, EMPTY] * (parts - len(pairs))
    name = weight_name(module)
    if name is None:
        return None
    return [getattr(module, name), module.bias if module.bias is not None else EMPTY] + [EMPTY, EMPTY] * (parts - 1)


def adjacent_views(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The (len(parts), ...) tensor whose slices are `parts`, as a view, when they are contiguous runs that follow one
    another in one storage (experts a GGUF loader packed as one matrix, QuantLinear.split); else None."""
    first, n = parts[0], parts[0].numel()
    ptr = first.untyped_storage().data_ptr()
    if all(p.is_contiguous() and p.shape == first.shape and p.dtype == first.dtype and
           p.untyped_storage().data_ptr() == ptr and p.storage_offset() == first.storage_offset() + i * n
           for i, p in enumerate(parts)):
        return first.as_strided((len(parts), *first.shape), (n, *first.stride()))
    return None


def stacked_experts(moe: SparseMoE) -> list[torch.Tensor] | None:
    """An MoE block's experts as decode_step.cpp takes them: (gate_up weight, bias, down weight, bias), each stacked
    over the experts (E, ...), or None when the experts differ in kind or shape. Experts that already lie stacked
    (gguf_native) are viewed as they are; others are stacked once, each expert's own tensor becoming a view of the
    stack, so the weights are not held twice and both paths read the same bytes."""
    if moe.stacked is not None:
        return moe.stacked
    out = []
    for proj in ("gate_up_proj", "down_proj"):
        modules = [getattr(expert, proj) for expert in moe.experts]
        names = {weight_name(m) for m in modules}
        kinds = {(type(m), getattr(m, "kind", None), m.bias is None) for m in modules}
        name = names.pop() if len(names) == 1 else None
        if name is None or len(kinds) != 1 or len({(getattr(m, name).shape, getattr(m, name).dtype)
                                                    for m in modules}) != 1:
            return None
        for attr in (name, "bias"):
            parts = [getattr(m, attr) for m in modules]
            if parts[0] is None:
                out.append(EMPTY)
                continue
            stack = adjacent_views(parts)
            if stack is None:
                stack = torch.stack([p.detach() for p in parts])
                for m, part in zip(modules, stack):
                    setattr(m, attr, nn.Parameter(part, requires_grad=False) if attr in m._parameters else part)
            out.append(stack)
    moe.stacked = out
    return out


def layer_tensors(block) -> list[list[torch.Tensor] | None]:
    """A block's norms and attention sinks, its linears' (weight, bias) pairs (q/k/v: two parts), then an MoE block's
    router and stacked experts, in decode_step.cpp's slot order."""
    attn, mlp = block.self_attn, block.mlp

    def norm(name, owner=block):
        m = getattr(owner, name, None)
        return m.weight if m is not None else EMPTY
    norms = [norm("input_layernorm"), norm("post_attention_layernorm"), norm("pre_feedforward_layernorm"),
             norm("post_feedforward_layernorm"), norm("q_norm", attn), norm("k_norm", attn),
             attn.sinks.detach() if attn.sinks is not None else EMPTY]
    attention = [linear_tensors(attn.qkv_proj, parts=2), linear_tensors(attn.o_proj)]
    if isinstance(mlp, SparseMoE):
        experts = stacked_experts(mlp)
        return [norms, *attention, [EMPTY] * 4,
                None if experts is None else [*linear_tensors(mlp.gate), *experts]]
    return [norms, *attention, linear_tensors(mlp.gate_up_proj), linear_tensors(mlp.down_proj), [EMPTY] * 6]


def layer_weights(block) -> list[torch.Tensor]:
    """A block's tensors in decode_step.cpp's slot order, without the cache (the last two slots)."""
    return [t for group in layer_tensors(block) for t in group]


def model_supported(model) -> bool:
    """Float32 embeddings on the CPU, and every linear one decode_step.cpp runs (an MoE block's experts all of one
    kind and shape)."""
    layers_ok = all(group is not None for block in model.layers for group in layer_tensors(block))
    return (model.embed_tokens.weight.dtype == torch.float32 and model.embed_tokens.weight.device.type == "cpu"
            and layers_ok)


def model_shape(model, ops, layers: slice = slice(None)):
    """forward_batch's model-wide arguments for the model's `layers` (kernels/model_shape.h: the fields are set by the
    names declared there, so an unknown one fails here)."""
    c, shape = model.config, ops.ModelShape()
    fields = dict(windows=[c.sliding_window if c.is_sliding(i) else 0 for i in range(c.num_hidden_layers)][layers],
                  heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                  eps=c.rms_norm_eps, attn_scale=c.attention_scale, sandwich=c.family == "gemma3",
                  gelu=c.hidden_act.startswith("gelu"), swiglu_limit=c.swiglu_limit or 0.0,
                  swiglu_alpha=c.swiglu_alpha, top_k=c.num_experts_per_tok, norm_topk=c.norm_topk_prob,
                  softmax_after_topk=c.softmax_after_topk)
    for name, value in fields.items():
        setattr(shape, name, value)
    return shape


class NativeDecoder:
    """The native step over the model's own static cache (`Transformer.setup_cache`), one sequence whose slot i holds
    position i: what the drafters that run the target's layers, and the single-request speculative loop, call. The
    serving engine's paged cache goes through fastdecode.runners.native instead."""

    def __init__(self, model, ops):
        self.model, self.ops = model, ops
        self.shapes: dict[tuple[int, int], object] = {}  # (start, stop) -> the model shape of those layers
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
        T, m = x.shape[0], self.model
        shape = self.shapes.get((start, stop))
        if shape is None:
            shape = self.shapes[start, stop] = model_shape(m, self.ops, slice(start, stop))
        return self.ops.forward_batch(
            x, self.weights[start * SLOTS:stop * SLOTS], positions, torch.arange(slot0, slot0 + T),
            torch.tensor([0, T]), torch.tensor([slot0]), EMPTY, ZERO_TABLE, m.max_seq_len,
            EMPTY if tree_mask is None else tree_mask, m.rope_global, m.rope_local, shape)


def native_decoder(model) -> NativeDecoder | None:
    """A NativeDecoder for the model when the native kernels are built and the model fits them, else None."""
    if not NativeDecoder.supports(model):
        return None
    ops = native_ops()
    return NativeDecoder(model, ops) if ops is not None else None
