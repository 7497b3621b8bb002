import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.config import ModelConfig
from fastdecode.layers.batch import Batch
from fastdecode.layers.norm import RMSNorm
from fastdecode.layers.rotary import apply_rotary


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention of q (heads, T, hd) over k, v (kv_heads, S, hd) (the sink forms also take a
    leading B); mask (T, S) bool or None (all visible). `sinks` (heads,): gpt-oss's learned logits that join each
    softmax's denominator and attend to nothing."""
    if sinks is None:  # the CPU flash kernel takes only 4-D inputs, and 3-D ones fell back to the math kernel, 3x
        # slower (a 128-row chunk over 1.8k keys: 45 ms against 14)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=k.shape[-3] != q.shape[-3])[0]
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return (sink_attention_lse if q.device.type == "cpu" else sink_attention_key)(q, k, v, bias, scale, sinks)


def sink_attention_lse(q, k, v, bias, scale, sinks):
    """softmax([scores, sink]) @ [v; 0] = softmax(scores) @ v * e^lse / (e^lse + e^sink), with the row's log-sum-exp
    lse (B, heads, T) that the CPU flash kernel returns beside its output; bias (T, S) is shared by every head."""
    n = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(n, -3), v.repeat_interleave(n, -3)  # the kernel has no grouped-query form
    batched = [t if t.dim() == 4 else t.unsqueeze(0) for t in (q, k, v)]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*batched, attn_mask=bias, scale=scale)
    return (out * torch.sigmoid(lse - sinks.float()[:, None]).unsqueeze(-1).to(out.dtype)).view(q.shape)


def sink_attention_key(q, k, v, bias, scale, sinks):
    """Any device: the sinks ride as one more key of zeros (its q.k is exactly 0) whose additive mask entry is the
    sink and whose value is zero (a (heads, T, S + 1) mask: the sink differs per head)."""
    heads, T, S = q.shape[-3], q.shape[-2], k.shape[-2]
    bias = torch.zeros(T, S, dtype=q.dtype, device=q.device) if bias is None else bias.to(q.device)
    bias = torch.cat([bias.expand(heads, T, S), sinks.to(q.dtype)[:, None, None].expand(heads, T, 1)], dim=-1)
    zeros = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    return F.scaled_dot_product_attention(q, torch.cat([k, zeros], -2), torch.cat([v, zeros], -2), attn_mask=bias,
                                          scale=scale, enable_gqa=k.shape[-3] != heads)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding = config.is_sliding(layer)
        self.window = config.sliding_window if self.sliding else None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v projections packed into one matmul (the loader concatenates their rows).
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # Llama's and gpt-oss's attention_bias covers o_proj too; Qwen2's q/k/v biases do not.
        self.o_proj = nn.Linear(q_size, config.hidden_size,
                                bias=config.attention_bias and config.family in ("llama", "gpt_oss"))
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """x (R, D): the rows of a Batch, rotated by cos, sin (R, head_dim), their keys and values written to
        the paged cache k_cache, v_cache (kv_heads, slots, head_dim) -> attention output (R, D). Each sequence's
        visible keys are gathered through its block table (the native runner reads them in place)."""
        R = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(R, self.num_heads, self.head_dim)
        k = k.view(R, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # The cache may hold a narrower type than the model computes in: keys and values are rounded to it when
        # written and widened back when read, so attention itself runs in the model's dtype.
        q = apply_rotary(q.transpose(0, 1), cos, sin).to(x.dtype)  # (heads, R, head_dim); the tables are float32
        k_cache[:, batch.slots] = apply_rotary(k.transpose(0, 1), cos, sin).to(v_cache.dtype)
        v_cache[:, batch.slots] = v.view(R, self.num_kv_heads, self.head_dim).transpose(0, 1).to(v_cache.dtype)
        out = torch.empty_like(q)
        bs, rows = batch.block_size, batch.seq_rows.tolist()
        for b, ctx in enumerate(batch.context.tolist()):
            r0, r1 = rows[b], rows[b + 1]
            if r0 == r1:
                continue
            q_pos = batch.positions[r0:r1]
            table = batch.block_tables[b]
            if batch.tree_mask is None:  # a chain: its new rows sit at logical positions ctx.. like the cache
                logical = torch.arange(ctx + r1 - r0)
                slots = table[logical // bs] * bs + logical % bs
                k_pos = logical
                mask = k_pos.unsqueeze(0) <= (ctx + torch.arange(r1 - r0)).unsqueeze(1)
            else:
                logical = torch.arange(ctx)
                slots = torch.cat([table[logical // bs] * bs + logical % bs, batch.slots[r0:r1]])
                k_pos = torch.cat([logical, q_pos])
                mask = torch.cat([torch.ones(r1 - r0, ctx, dtype=torch.bool), batch.tree_mask[r0:r1, r0:r1]], 1)
            if self.window:
                mask &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.window
            out[:, r0:r1] = attend(q[:, r0:r1], k_cache[:, slots].to(q.dtype), v_cache[:, slots].to(q.dtype), mask,
                                   self.scale, self.sinks)
        return self.o_proj(out.transpose(0, 1).reshape(R, -1))
