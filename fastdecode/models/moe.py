"""The sparse mixture-of-experts block of Qwen3-MoE and gpt-oss: a router picks each token's top-k experts, and only
those run.

The batch's rows are grouped by expert, so each routed expert's weights are read once per forward however many rows
chose it (the verify step's draft tokens, several sequences); experts no row chose are not touched. Module names
follow Hugging Face checkpoints (`mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`, gate/up packed into
gate_up_proj as in the dense MLP), so each expert is an ordinary linear pair that any quantized module can replace.
"""
import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.config import ModelConfig


class Router(nn.Linear):
    """The router's (num_experts, hidden) matrix. Its own class so that quantize_model, which swaps only exact
    nn.Linear modules, leaves it float: routing decides which weights run at all, and it is a tiny matrix."""


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, expert: type[nn.Module]):
        """`expert(config, width)` builds one SwiGLU MLP of `width` (the dense MLP class, to share its forward)."""
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.softmax_after_topk = config.softmax_after_topk
        self.gate = Router(config.hidden_size, config.num_experts, bias=config.moe_bias)
        self.experts = nn.ModuleList(expert(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.stacked: list[torch.Tensor] | None = None  # experts stacked for the native step (native_layers.py)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (R, D) -> top-k weights (R, k) in x's dtype and expert ids (R, k), as transformers' Qwen3MoeTopKRouter:
        softmax in float32 over all experts, then the top k, renormalised when norm_topk_prob; or as
        GptOssTopKRouter: the top k logits, then their softmax (the same weights, rounded in another order)."""
        if self.softmax_after_topk:
            logits, experts = self.gate(x).topk(self.top_k, dim=-1)
            return F.softmax(logits, dim=-1).to(x.dtype), experts
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (R, D)
        weights, experts = self.route(x)
        # Sort the R * k (row, expert) choices by expert: each expert's rows are then one contiguous run.
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()
        rows, weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                idx = rows[start:start + n]
                out.index_add_(0, idx, self.experts[e](x[idx]) * weights[start:start + n, None])
                start += n
        return out.view(shape)
