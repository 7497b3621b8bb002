"""Each rank reads only its shard of a checkpoint: the model is built on the meta device, sharded there (shapes
only), then filled tensor by tensor with this rank's rows or columns.

safetensors: `safe_open(...).get_slice` reads just the slice from the memory-mapped file.
GGUF: a tensor's rows are whole runs of blocks, so a row slice (q/k/v, gate/up, embedding, LM head) is cut from the
raw bytes; a column slice (o_proj, down_proj) likewise when its edges fall on block boundaries (heads of 64 on
32-value blocks, MLP slices 256-aligned), else that one tensor is dequantized whole, then sliced. With quant "gguf"
(a GGUF file's default) the cut blocks become the rank's modules as they are (loading/gguf_native.py, GGUFShard);
otherwise they are dequantized, for LLM to quantize the float shard as asked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading import check_gguf_quant
from fastdecode.loading.build import skip_init
from fastdecode.loading.gguf_file import GGUFFile, GGUFTensor
from fastdecode.loading.gguf_loader import dequantize_tensor, float_tensor as gguf_float, gguf_config, hf_name
from fastdecode.loading.gguf_native import load_gguf_native
from fastdecode.loading.hf_loader import read_config, safetensors_weights
from fastdecode.models import model_class
from fastdecode.parallel.plan import ShardPlan
from fastdecode.parallel.shard import shard_model


def checkpoint_config(path: Path, quant: str | None = None) -> tuple[ModelConfig, GGUFFile | None]:
    """The config of a Hugging Face directory or GGUF file (and the opened GGUF file), without reading weights."""
    from fastdecode.quant.checkpoint import is_quantized_checkpoint

    check_gguf_quant(path, quant)
    if is_quantized_checkpoint(path):
        raise UnsupportedModelError(f"{path} is a quantized checkpoint, which --tp cannot shard yet: give the float "
                                    "model and --quant")
    if path.is_dir():
        return read_config(path), None
    if path.is_file():
        f = GGUFFile(path)
        return gguf_config(f), f
    raise ModelFileError(f"model path {path} does not exist")


def load_shard(path, rank: int, world: int, dtype: torch.dtype = torch.float32, progress=None,
               quant: str | None = None):
    """A Hugging Face directory or GGUF file -> this rank's shard of the model (see shard_model). quant "gguf": a
    GGUF file's matrices in their own formats, cut block by block; otherwise float weights."""
    path = Path(path)
    config, f = checkpoint_config(path, quant)
    plan = ShardPlan.build(config, rank, world)  # SplitError before any weight is read
    if quant == "gguf":
        return load_gguf_native(path, dtype, progress, shard=GGUFShard(plan))
    with skip_init(dtype), torch.device("meta"):
        model = model_class(config.family)(config)
    shard_model(model, plan)  # model.config is now the shard's: its heads, as gguf_shard unpermutes them
    model.to_empty(device="cpu")
    weights, freq_factors = {}, None
    tensors = safetensors_shard(path, plan, progress) if f is None else gguf_shard(f, model.config, plan, progress)
    for name, tensor in tensors:
        if name == "rope_freqs.weight":
            freq_factors = tensor
            continue
        weights[name] = tensor.to(dtype)
    try:
        model.load_weights(weights)
    except ValueError as e:
        raise ModelFileError(f"{path}: {e}") from None
    model.rope_freq_factors = freq_factors
    return model.eval()


def _cut(plan: ShardPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if plan.zeroed(name):
        return torch.zeros_like(tensor)
    return tensor


def safetensors_shard(path: Path, plan: ShardPlan, progress=None) -> Iterator[tuple[str, torch.Tensor]]:
    def read(f, key, name):
        cut = plan.slice_of(name)
        if cut is None:
            tensor = f.get_tensor(key)
        else:
            dim, lo, hi = cut
            part = f.get_slice(key)
            tensor = part[lo:hi] if dim == 0 else part[:, lo:hi]
        return _cut(plan, name, tensor)

    return safetensors_weights(path, read, progress)


def block_slice(t: GGUFTensor, dim: int, lo: int, hi: int) -> GGUFTensor:
    """Rows or columns [lo, hi) of a 2-D GGUF tensor (or entries of a 1-D one), in the tensor's own type where
    whole blocks allow: rows are runs of blocks (a view of the file), columns whole blocks when both edges fall on
    block boundaries (a copy). Otherwise the slice of the tensor dequantized whole, as F32."""
    if len(t.shape) == 1:
        return float_tensor(t.name, dequantize_tensor(t)[lo:hi])
    rows, cols = t.shape
    block, type_size = GGML_QUANT_SIZES[t.type]
    raw = np.asarray(t.data).reshape(rows, -1)  # one row of blocks per weight row
    if dim == 0:
        return GGUFTensor(t.name, (hi - lo, cols), t.type, raw[lo:hi].reshape(-1))
    if lo % block == 0 and hi % block == 0:
        part = np.ascontiguousarray(raw[:, lo // block * type_size:hi // block * type_size])
        return GGUFTensor(t.name, (rows, hi - lo), t.type, part.reshape(-1))
    return float_tensor(t.name, dequantize_tensor(t)[:, lo:hi])


def float_tensor(name: str, values: np.ndarray) -> GGUFTensor:
    values = np.ascontiguousarray(values, dtype=np.float32)
    return GGUFTensor(name, values.shape, GGMLQuantizationType.F32, values.reshape(-1).view(np.uint8))


class GGUFShard:
    """One rank's cut of a GGUF file, for load_gguf_native: the meta model shaped to the rank's shard, then each
    tensor cut to its rows or columns of blocks (block_slice; a row-parallel bias zeroed beyond rank 0)."""

    def __init__(self, plan: ShardPlan):
        self.plan = plan

    def shape(self, model):
        shard_model(model, self.plan)

    def cut(self, name: str, t: GGUFTensor) -> GGUFTensor:
        if self.plan.zeroed(name):
            return float_tensor(t.name, np.zeros(t.shape, dtype=np.float32))
        where = self.plan.slice_of(name)
        return t if where is None else block_slice(t, *where)


def gguf_shard(f: GGUFFile, config: ModelConfig, plan: ShardPlan, progress=None):
    """The float weights of fastdecode.loading.gguf_loader.load_gguf, for this rank's slices. config: the shard's
    (shard_model's), whose head counts unpermute the q/k rows: llama.cpp permutes them within each head, so a slice
    of whole heads unpermutes on its own."""
    tensors = list(f.tensors.values())
    for t in progress(tensors) if progress is not None else tensors:
        if t.name == "rope_freqs.weight":
            yield t.name, torch.from_numpy(dequantize_tensor(t).copy())
            continue
        name = hf_name(t.name, config.family)
        if name is None:
            continue
        cut = plan.slice_of(name)
        w = gguf_float(t if cut is None else block_slice(t, *cut), name, config)
        yield name, _cut(plan, name, torch.from_numpy(w))
