import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension. Gemma's (1 + w) form is folded into `weight` by the loader."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precisions: normalise in float32 as the reference implementations do.
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
