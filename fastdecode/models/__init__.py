"""Registry: family name (from ModelConfig.family) -> model class."""
from fastdecode.errors import UnsupportedModelError
from fastdecode.models.transformer import Transformer

MODEL_CLASSES = {"llama": Transformer, "qwen2": Transformer, "qwen3": Transformer, "qwen3_moe": Transformer,
                 "gemma3": Transformer, "gpt_oss": Transformer}


def model_class(family: str):
    if family not in MODEL_CLASSES:
        raise UnsupportedModelError(f"no model class for family {family!r}; known: {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[family]
