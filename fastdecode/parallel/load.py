"""Each rank reads only its shard of a checkpoint: the model is built on the meta device, sharded there (shapes
only), then filled tensor by tensor with this rank's rows or columns.

safetensors: `safe_open(...).get_slice` reads just the slice from the memory-mapped file.
GGUF: a tensor's rows are whole runs of blocks, so a row slice (q/k/v, gate/up, embedding, LM head) is cut from the
raw bytes before dequantizing; a column slice (o_proj, down_proj) likewise when its edges fall on block boundaries
(heads of 64 on 32-value blocks, MLP slices 256-aligned), else that one tensor is dequantized whole, then sliced.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from safetensors import SafetensorError, safe_open

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading.build import skip_init
from fastdecode.loading.gguf_file import GGUFFile, GGUFTensor
from fastdecode.loading.gguf_loader import dequantize_tensor, hf_name, unpermute_rows
from fastdecode.loading.hf_loader import PREFIXES, read_config
from fastdecode.models import model_class
from fastdecode.parallel.plan import ShardPlan
from fastdecode.parallel.shard import shard_model


def checkpoint_config(path: Path) -> tuple[ModelConfig, GGUFFile | None]:
    """The config of a Hugging Face directory or GGUF file (and the opened GGUF file), without reading weights."""
    from fastdecode.quant.checkpoint import is_quantized_checkpoint

    if is_quantized_checkpoint(path):
        raise UnsupportedModelError(f"{path} is a quantized checkpoint, which --tp cannot shard yet: give the float "
                                    "model and --quant")
    if path.is_dir():
        return read_config(path), None
    if path.is_file():
        f = GGUFFile(path)
        config = ModelConfig.from_gguf(f.metadata)
        config.tie_word_embeddings = "output.weight" not in f.tensors
        return config, f
    raise ModelFileError(f"model path {path} does not exist")


def load_shard(path, rank: int, world: int, dtype: torch.dtype = torch.float32, progress=None):
    """A Hugging Face directory or GGUF file -> this rank's shard of the model (see shard_model)."""
    path = Path(path)
    config, f = checkpoint_config(path)
    if f is None:
        reader = lambda plan: safetensors_shard(path, plan, progress)  # noqa: E731
    else:
        reader = lambda plan: gguf_shard(f, config, plan, progress)  # noqa: E731
    plan = ShardPlan.build(config, rank, world)  # SplitError before any weight is read
    with skip_init(dtype), torch.device("meta"):
        model = model_class(config.family)(config)
    shard_model(model, plan)
    model.to_empty(device="cpu")
    weights, freq_factors = {}, None
    for name, tensor in reader(plan):
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
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(f"{path} has no *.safetensors files")
    for shard in progress(shards) if progress is not None else shards:
        try:
            with safe_open(shard, framework="pt") as f:
                for key in f.keys():
                    name = next((key[len(p):] for p in PREFIXES if key.startswith(p)), key)
                    if name.startswith(("vision_tower", "multi_modal_projector")):
                        continue
                    cut = plan.slice_of(name)
                    if cut is None:
                        tensor = f.get_tensor(key)
                    else:
                        dim, lo, hi = cut
                        part = f.get_slice(key)
                        tensor = part[lo:hi] if dim == 0 else part[:, lo:hi]
                    yield name, _cut(plan, name, tensor)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ModelFileError(f"cannot read {shard}: {e}") from None


def gguf_slice(t: GGUFTensor, dim: int, lo: int, hi: int) -> np.ndarray:
    """Rows or columns [lo, hi) of a 2-D GGUF tensor (or entries of a 1-D one), dequantizing only those where
    the block layout allows."""
    if len(t.shape) == 1:
        return dequantize_tensor(t)[lo:hi]
    rows, cols = t.shape
    block, type_size = GGML_QUANT_SIZES[t.type]
    raw = np.asarray(t.data).reshape(rows, -1)  # one row of blocks per weight row
    if dim == 0:
        part = raw[lo:hi]
        shape = (hi - lo, cols)
    elif lo % block == 0 and hi % block == 0:
        part = np.ascontiguousarray(raw[:, lo // block * type_size:hi // block * type_size])
        shape = (rows, hi - lo)
    else:
        return dequantize_tensor(t)[:, lo:hi]
    return dequantize_tensor(GGUFTensor(t.name, shape, t.type, part.reshape(-1)))


def gguf_shard(f: GGUFFile, config: ModelConfig, plan: ShardPlan, progress=None):
    """The transformations of fastdecode.loading.gguf_loader.load_gguf, applied to this rank's slices."""
    tensors = list(f.tensors.values())
    for t in progress(tensors) if progress is not None else tensors:
        if t.name == "rope_freqs.weight":
            yield t.name, torch.from_numpy(dequantize_tensor(t).copy())
            continue
        name = hf_name(t.name, config.family)
        if name is None:
            continue
        cut = plan.slice_of(name)
        w = dequantize_tensor(t) if cut is None else gguf_slice(t, *cut)
        # llama.cpp permutes q/k rows within each head, so a slice of whole heads unpermutes on its own.
        if config.family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, plan.heads[1] - plan.heads[0])
        elif config.family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, plan.kv_heads[1] - plan.kv_heads[0])
        if config.family == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma norms as (1 + w)
        yield name, _cut(plan, name, torch.from_numpy(np.array(w, dtype=np.float32)))
