"""A built Transformer's layers as the C++ step (kernels/decode_step.cpp) takes them: each layer's tensors in the
step's slot order and the model's shape arguments (the native runner's). Here rather than in kernels/: it reads the model's modules, and the kernels sit below the models."""
from __future__ import annotations

import torch
from torch import nn

from fastdecode.models.moe import SparseMoE
from fastdecode.quant.split import RowSplitLinear

EMPTY = torch.empty(0)
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
