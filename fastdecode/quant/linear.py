"""What Int8Linear and Int4Linear share: the native/aten dispatch around a float32 (B*T, K) matmul, and byte counts."""
import torch
from torch import nn

from fastdecode.quant.kernels import native_ops


class QuantLinear(nn.Module):
    """Subclasses set out_features, in_features, backend, bias, `native_op` (a name in the native module taking
    (x, qweight, bias)) and implement aten_mm(x2d) -> (B*T, N) without the bias."""
    native_op: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "native":
            y = getattr(native_ops(), self.native_op)(x, self.qweight, self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        y = self.aten_mm(x.reshape(-1, self.in_features).float())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def aten_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
