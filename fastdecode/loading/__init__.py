"""Model loading: a registered name or a path (GGUF file or Hugging Face directory) -> built model."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

import torch

from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading.build import check_parameter_count, numel, skip_init
from fastdecode.models import model_class


def resolve_quant(path, quant: str | None) -> str | None:
    """The weight scheme a model runs with: `quant` as asked ("none": float weights), or where none is asked, a GGUF
    file's own formats ("gguf") and float weights for a directory."""
    if quant is None:
        return "gguf" if Path(path).is_file() else None
    return None if quant == "none" else quant


def check_gguf_quant(path: Path, quant: str | None) -> None:
    if quant == "gguf" and path.is_dir():
        raise UnsupportedModelError(f"--quant gguf keeps a GGUF file's own quantized weights; {path} is not a GGUF "
                                    "file")


def load_model(path, dtype: torch.dtype = torch.float32, progress=None, quant: str | None = None):
    """Builds the model from a GGUF file, a Hugging Face directory or a quantized checkpoint that `fastdecode
    quantize` wrote; float weights held in `dtype`. quant "gguf" keeps a GGUF file's matrices in their own formats
    (gguf_native); any other value loads float weights, for quantize_model to transform."""
    from fastdecode.loading.gguf_loader import load_gguf
    from fastdecode.loading.gguf_native import load_gguf_native
    from fastdecode.loading.hf_loader import load_hf_dir
    from fastdecode.quant.checkpoint import is_quantized_checkpoint, load_quantized

    path = Path(path)
    freq_factors = None
    if quant == "gguf" and path.is_file():
        return load_gguf_native(path, dtype, progress)
    check_gguf_quant(path, quant)
    if is_quantized_checkpoint(path):
        return load_quantized(path, dtype)
    if path.is_dir():
        config, weights = load_hf_dir(path, dtype, progress)
    elif path.is_file():
        config, weights, freq_factors, _ = load_gguf(path, dtype, progress)
    else:
        raise ModelFileError(f"model path {path} does not exist")
    check_parameter_count(config, [numel(w) for w in weights.values()], path)
    with skip_init(dtype):
        model = model_class(config.family)(config)
    try:
        model.load_weights(weights)
    except (ValueError, RuntimeError) as e:  # a shape load_weights refuses, or q/k/v shards torch.cat cannot join
        raise ModelFileError(f"{path}: {e}") from None
    model.rope_freq_factors = freq_factors
    return model.eval()


def load_tokenizer(path):
    from fastdecode.loading.gguf_file import read_gguf
    from fastdecode.loading.tokenizer import Tokenizer

    path = Path(path)
    with collection_paused():
        if path.is_dir():
            return Tokenizer.from_hf_dir(path)
        return Tokenizer.from_gguf(read_gguf(path).metadata)


@contextmanager
def collection_paused():
    """Python's cycle collector off inside the block: a GGUF vocabulary's half a million merge tuples, all alive
    until the tokenizer is built, set off collections that walk them and find nothing (Gemma 3: 40 ms of its load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
