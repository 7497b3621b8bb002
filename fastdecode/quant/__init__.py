"""Weight-only quantization as a model transform: `quantize_model` swaps every nn.Linear for a quantized module, so
the model file never learns about it. Embedding lookups keep their float table, also where lm_head is tied to it.

    model = quantize_model(model, "int4")  # int8 | int4 | mxfp4 | nvfp4; weight_bytes(model) sums one forward

Schemes: int8 and int4 run on native AVX2 kernels (or PyTorch's); mxfp4 and nvfp4 are dequantized at every forward
(fp4.py). Every module is built from `encode_linear`'s tensors, the same ones a quantized checkpoint stores
(checkpoint.py). A GGUF file's own Q8_0/Q4_0/Q4_1 blocks go into the int8/int4 modules, and its K-quants
(Q4_K/Q5_K/Q6_K) into KQuantLinear (kquant.py), while it loads (`load_model(path, quant="gguf")`,
fastdecode.loading.gguf_native), without a float model in between; the K-quant schemes are only read from files.
"""
import logging

import torch
from torch import nn

from fastdecode.quant.fp4 import BLOCK_SIZE, Fp4Linear, quantize_fp4
from fastdecode.quant.int4 import Int4Linear
from fastdecode.quant.int8 import Int8Linear
from fastdecode.quant.kquant import KINDS as K_QUANTS, KQuantLinear
from fastdecode.quant.linear import QuantLinear

log = logging.getLogger(__name__)

__all__ = ["Fp4Linear", "Int4Linear", "Int8Linear", "KQuantLinear", "encode_linear", "build_linear", "quantize_linear",
           "quantize_model", "weight_bytes"]
WEIGHT_SCHEMES = ("int8", "int4", "mxfp4", "nvfp4")  # computed from float weights


def fits(scheme: str, out_features: int, in_features: int, group_size: int) -> bool:
    if scheme == "int4":
        return Int4Linear.fits(out_features, in_features, group_size)
    if scheme in BLOCK_SIZE:
        return in_features % BLOCK_SIZE[scheme] == 0
    if scheme in K_QUANTS:
        return KQuantLinear.fits(out_features, in_features)
    return True  # int8: the aten kernel takes any shape


def encode_linear(w: torch.Tensor, scheme: str, group_size: int = 32, backend: str | None = None) -> dict:
    """Float weight (N, K) -> the scheme's tensors (see Int8Linear.encode, Int4Linear.encode, quantize_fp4)."""
    if scheme == "int8":
        return Int8Linear.encode(w, Int8Linear.resolve_backend(w.shape, backend))
    if scheme == "int4":
        return Int4Linear.encode(w, group_size)
    if scheme in BLOCK_SIZE:
        return quantize_fp4(w, scheme)
    raise ValueError(f"unknown quantization scheme {scheme!r}; known: {WEIGHT_SCHEMES}")


def build_linear(tensors: dict, scheme: str, bias: torch.Tensor | None, in_features: int, group_size: int = 32,
                 backend: str | None = None) -> QuantLinear:
    if scheme == "int8":
        return Int8Linear.from_tensors(tensors, bias, backend)
    if scheme == "int4":
        return Int4Linear.from_tensors(tensors, bias, group_size, backend, in_features)
    if scheme in K_QUANTS:  # a forced int backend ("aten", "lut": not the native kernel) means dequantizing
        return KQuantLinear(tensors["blocks"], scheme, bias, backend if backend in (None, "native") else "dequant")
    return Fp4Linear(scheme, tensors, bias)


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int = 32, backend: str | None = None) -> QuantLinear:
    tensors = encode_linear(linear.weight, scheme, group_size, backend)
    return build_linear(tensors, scheme, linear.bias, linear.in_features, group_size, backend)


def plan(model: nn.Module, scheme: str, group_size: int = 32, lm_head_scheme: str | None = "int8"):
    """[(qualified name, scheme)] of the nn.Linear modules a weight scheme quantizes; shapes that no kernel of their
    scheme takes stay float (logged)."""
    for s in (scheme, lm_head_scheme or scheme):
        if s not in WEIGHT_SCHEMES:
            raise ValueError(f"unknown quantization scheme {s!r}; known: {WEIGHT_SCHEMES} (gguf is chosen when "
                             "loading: load_model(path, quant='gguf'))")
    out = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        s = (lm_head_scheme or scheme) if name == "lm_head" else scheme
        if not fits(s, module.out_features, module.in_features, group_size):
            log.warning("%s (%d x %d) left in float: no %s kernel takes that shape", name, module.out_features,
                        module.in_features, s)
            continue
        out.append((name, s))
    return out


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32, backend: str | None = None,
                   lm_head_scheme: str | None = "int8") -> nn.Module:
    """Replaces every nn.Linear of model in place (biases kept in float32) and returns it.

    group_size applies to int4 (MXFP4 and NVFP4 have theirs by definition: 32 and 16). backend None picks our AVX2
    kernels where they are built and fit the shape, else PyTorch's ("aten"). lm_head gets lm_head_scheme (None: the
    same as the rest), int8 by default: on SmolLM2-135M's Q4_1 GGUF (Q4_1 blocks, a Q8_0 tied head), teacher-forced
    over 256 tokens of code, int4 everywhere keeps 87% of the float model's greedy tokens and int4 with an int8 head
    97%, for 12 MB more per token. (The native formats reproduce those Q4_1 and Q8_0 weights exactly; the
    rest is the int4 kernel's int8 rounding of activations.)
    """
    for name, s in plan(model, scheme, group_size, lm_head_scheme):
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, quantize_linear(getattr(owner, child), s, group_size, backend))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the matmul weights one forward reads: quantized modules' own count, float nn.Linear weights as is."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.weight_bytes()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total
