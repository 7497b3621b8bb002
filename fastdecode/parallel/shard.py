"""Tensor parallelism as a transform of a built Transformer (gpt-fast style): `shard_model` keeps this rank's rows
and columns of every weight in place, `install_collectives` adds the communication. The model file never learns
about either.

    q/k/v (packed qkv_proj), gate/up (packed gate_up_proj): column-parallel, this rank's output rows
    o_proj, down_proj: row-parallel, this rank's input columns; an all-reduce sums the partial outputs
    embed_tokens: vocabulary-parallel; rows outside this rank's range look up zeros, an all-reduce fills them in
    lm_head: vocabulary-parallel; an all-gather joins the ranks' logits

Sharding works on real and on meta tensors alike, so the loader can shape a model before any weight is read.
Collectives go in after quantization: their hooks sit on each attention's output projection (whatever the
quantization transform made of it), on the MLP modules and on wrappers around the embedding and LM head. The native
C++ step runs a layer without those modules' forward, so it is handed the same all-reduce (`model.all_reduce`).
The collectives are parallel/collectives.py's (shared memory between the ranks of one host, else gloo).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.parallel.plan import Range, ShardPlan


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_start + num_embeddings) of the token embedding."""

    def __init__(self, weight: torch.Tensor, vocab_start: int):
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True,
                         device=weight.device, dtype=weight.dtype)
        self.vocab_start = vocab_start
        self.comm = None  # the ranks' collectives, set by install_collectives
        self.rows = None  # where set, a module that looks the rows up instead of `weight` (look_up_in)

    def look_up_in(self, rows: nn.Module) -> "VocabParallelEmbedding":
        """Rows from `rows` (a QuantEmbedding over this rank's slice of a GGUF file's blocks) instead of a float
        table; `weight` becomes its empty (0, D) stand-in, which tells the dtype and device the lookups return."""
        self.rows = rows
        self.weight = nn.Parameter(rows.weight, requires_grad=False)
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            raise RuntimeError("a vocabulary-parallel embedding needs install_collectives() before it runs")
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        local = local.masked_fill(outside, 0)
        x = F.embedding(local, self.weight) if self.rows is None else self.rows(local)
        x = x.masked_fill(outside.unsqueeze(-1), 0)  # (B, T, D): this rank's rows, zeros elsewhere
        self.comm.all_reduce(x)
        return x


class GatherLogits(nn.Module):
    """Wraps the vocabulary-parallel LM head: local logits (..., V / world) -> every rank's, joined (..., V)."""

    def __init__(self, head: nn.Module, vocab_ranges: list[Range], comm):
        super().__init__()
        self.head, self.vocab_ranges, self.comm = head, vocab_ranges, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.head(x)
        widest = max(hi - lo for lo, hi in self.vocab_ranges)
        flat = local.reshape(-1, local.shape[-1])
        # all_gather wants equal shapes: pad the narrower shards of an uneven split, trim after.
        parts = self.comm.all_gather(F.pad(flat, (0, widest - flat.shape[-1])))
        logits = torch.cat([p[:, :hi - lo] for p, (lo, hi) in zip(parts, self.vocab_ranges)], dim=-1)
        return logits.reshape(*local.shape[:-1], logits.shape[-1])


def _rows(w: torch.Tensor, ranges: list[Range]) -> torch.Tensor:
    return torch.cat([w[lo:hi] for lo, hi in ranges], dim=0)


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None):
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape  # the quantization transform reads these


@torch.no_grad()
def shard_model(model, plan: ShardPlan):
    """Keeps this rank's shard of every weight, in place. Afterwards model.config describes this rank's shard
    (its heads, KV heads and MLP width, so setup_cache allocates only its KV heads); vocab_size stays the whole
    vocabulary, which the gathered logits span."""
    c = model.config
    q_rows, kv_rows = plan.rows(plan.heads), plan.rows(plan.kv_heads)
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    qkv = [q_rows, (q_size + kv_rows[0], q_size + kv_rows[1]),
           (q_size + kv_size + kv_rows[0], q_size + kv_size + kv_rows[1])]
    lo, hi = plan.intermediate
    I = c.intermediate_size
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        bias = attn.qkv_proj.bias
        _set(attn.qkv_proj, _rows(attn.qkv_proj.weight, qkv), _rows(bias, qkv) if bias is not None else None)
        bias = attn.o_proj.bias
        _set(attn.o_proj, attn.o_proj.weight[:, q_rows[0]:q_rows[1]],
             (bias if plan.rank == 0 else torch.zeros_like(bias)) if bias is not None else None)
        attn.num_heads = plan.heads[1] - plan.heads[0]
        attn.num_kv_heads = plan.kv_heads[1] - plan.kv_heads[0]
        attn.split = (attn.num_heads * c.head_dim, attn.num_kv_heads * c.head_dim, attn.num_kv_heads * c.head_dim)
        _set(mlp.gate_up_proj, _rows(mlp.gate_up_proj.weight, [(lo, hi), (I + lo, I + hi)]))  # [gate; up] per rank
        _set(mlp.down_proj, mlp.down_proj.weight[:, lo:hi])
    tied = model.lm_head.weight is model.embed_tokens.weight
    v0, v1 = plan.vocab
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight[v0:v1].contiguous(), v0)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
        model.lm_head.out_features = v1 - v0
    else:
        _set(model.lm_head, model.lm_head.weight[v0:v1])
    model.config = dataclasses.replace(c, num_attention_heads=attn.num_heads if model.layers else 0,
                                       num_key_value_heads=attn.num_kv_heads if model.layers else 0,
                                       intermediate_size=hi - lo)
    model.shard_plan = plan
    return model


def _all_reduce_output(all_reduce):
    def hook(module, inputs, output):
        all_reduce(output)
        return output
    return hook


def install_collectives(model, comm):
    """The communication of a sharded model: an all-reduce after attention and after the MLP in every block, one
    in the embedding, an all-gather of the logits. Call once, after any quantization. `model.all_reduce` is the
    layers' all-reduce, for a runner that computes them without their modules (the native step's `reduce`). comm:
    the ranks' collectives (parallel/collectives.py)."""
    model.all_reduce = comm.all_reduce
    for block in model.layers:
        # On o_proj, not the attention module: the engine's runner calls Attention.paged, not its forward.
        block.self_attn.o_proj.register_forward_hook(_all_reduce_output(model.all_reduce))
        block.mlp.register_forward_hook(_all_reduce_output(model.all_reduce))
    model.embed_tokens.comm = comm
    model.lm_head = GatherLogits(model.lm_head, model.shard_plan.vocab_ranges(), comm)
    return model
