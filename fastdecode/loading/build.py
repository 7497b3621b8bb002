"""A model's modules built before its weights arrive: checked against the checkpoint's size, allocated uninitialised
(every loader fills them)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fastdecode.errors import ModelFileError
from fastdecode.models import model_class


def check_parameter_count(config, counts: list[int], path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Refuses a config that asks for more parameters than the checkpoint's tensors (`counts`: their element counts)
    hold, a corrupt or hostile header, before anything is allocated -> the model built on the meta device (which
    allocates nothing), parameters in `dtype`, for a loader that fills it module by module."""
    if config.num_hidden_layers > len(counts):  # every layer holds tensors; this also bounds the meta build
        raise ModelFileError(f"{path}: {config.num_hidden_layers} layers, but the checkpoint holds {len(counts)} "
                             "tensors")
    try:
        with skip_init(dtype), torch.device("meta"):
            model = model_class(config.family)(config)
        wanted = sum(p.numel() for p in model.parameters())
    except (RuntimeError, ValueError, OverflowError, TypeError) as e:  # sizes no tensor can have (TypeError: torch's
        # overflow of a size past int64)
        reason = str(e).splitlines()[0]
        raise ModelFileError(f"{path}: the config describes no model that can be built ({reason})") from None
    held = sum(counts) + config.vocab_size * config.hidden_size  # + a tied head
    if wanted > held:
        raise ModelFileError(f"{path}: the config's shapes need {wanted} parameters, the checkpoint holds {held}")
    return model


def numel(w: torch.Tensor | nn.Module) -> int:
    """Weights a tensor or a kept quantized module (gpt-oss's MXFP4 experts) stands for."""
    if isinstance(w, nn.Module):
        return w.in_features * w.out_features + (0 if w.bias is None else w.bias.numel())
    return w.numel()


@contextmanager
def skip_init(dtype: torch.dtype):
    """Allocates parameters uninitialised in `dtype`: every weight is overwritten by the checkpoint anyway, and
    random init of a large vocabulary costs seconds."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters, torch.get_default_dtype()
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters, default = saved
        torch.set_default_dtype(default)
