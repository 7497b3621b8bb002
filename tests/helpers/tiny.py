"""A tiny random Llama built directly (no transformers), for tests of model transforms."""
import torch

from fastdecode.config import ModelConfig
from fastdecode.models.transformer import Transformer


def tiny_model(tied: bool) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    model = Transformer(config).eval()
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    model.setup_cache(64, batch=tokens.shape[0])
    with torch.no_grad():
        return model(tokens, start=0, all_logits=True)
