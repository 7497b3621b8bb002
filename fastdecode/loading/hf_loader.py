"""Hugging Face model directory -> ModelConfig and float tensors (safetensors shards, memory-mapped)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError
from fastdecode.loading.gpt_oss import expert_modules

PREFIXES = ("model.language_model.", "language_model.model.", "model.")  # plain and multimodal Gemma 3 layouts


def read_config(path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    except FileNotFoundError:
        raise ModelFileError(f"{path} has no config.json") from None
    except (json.JSONDecodeError, AttributeError, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFileError(f"{path}/config.json is malformed: {e}") from None


def load_hf_dir(path, dtype: torch.dtype = torch.float32, progress=None):
    """Returns (config, weights) with names stripped of their `model.` prefix; gpt-oss's expert stacks come split per
    expert, MXFP4 ones as modules (loading/gpt_oss.py)."""
    path = Path(path)
    config = read_config(path)

    def read(f, key, name):
        t = f.get_tensor(key)
        return t.to(dtype) if t.is_floating_point() else t  # MXFP4 blocks stay bytes

    weights = dict(safetensors_weights(path, read, progress))
    if config.family == "gpt_oss":
        weights = expert_modules(weights)
    return config, weights


def safetensors_weights(path: Path, read, progress=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, read(f, key, name)) for each weight in the folder's *.safetensors files, `f` the open file: names
    stripped of their `model.` prefix, the vision tower's weights skipped, an unreadable file a ModelFileError."""
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
                    yield name, read(f, key, name)
        except (OSError, RuntimeError, SafetensorError) as e:  # SafetensorError: truncated or not safetensors
            raise ModelFileError(f"cannot read {shard}: {e}") from None
