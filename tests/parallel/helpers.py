"""The tiny models whose heads split evenly and unevenly across two ranks."""
from __future__ import annotations

from tests.helpers.checkpoints import SPECS, Spec, prompt_tokens

# Added beside the shared specs (4 heads, 2 KV heads: an even split), each with a different uneven split.
UNEVEN = {
    # 3 heads and 3 KV heads: rank 0 holds 1, rank 1 holds 2; an MLP of 3 x 32 columns and an odd vocabulary too.
    "llama_uneven": Spec("LlamaForCausalLM", "LlamaConfig",
                         dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
                              num_key_value_heads=3, vocab_size=161), "llama"),
    # 6 heads in 3 KV groups: rank 0 holds one group (2 heads), rank 1 two groups (4 heads).
    "qwen3_uneven": Spec("Qwen3ForCausalLM", "Qwen3Config",
                         dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                              num_key_value_heads=3), "qwen3"),
    # 3 heads on 1 KV head: both ranks hold the KV head (replicated), rank 0 one query head, rank 1 two.
    "gemma3_uneven": Spec("Gemma3ForCausalLM", "Gemma3TextConfig",
                          dict(hidden_size=48, intermediate_size=64, num_hidden_layers=6, sliding_window=4,
                               num_attention_heads=3, num_key_value_heads=1, query_pre_attn_scalar=16,
                               rope_theta=1e6, rope_local_base_freq=10000.0), "gemma3", seed=1),
}
SPECS.update(UNEVEN)
# Even: llama (4/2), qwen2 (tied embeddings, q/k/v biases), gemma3 (4/2, sliding layers), mistral (1 KV head:
# replicated, 2 query heads each).
MODELS = ["llama", "qwen2", "gemma3", "mistral", *UNEVEN]

PROMPT = prompt_tokens(24)  # longer than every sliding window
STEPS = 20
# The engine's batch: 4 requests in flight after the first ran alone; two of them begin with its 40 tokens, whose
# first 32-token block they find in the cache.
_LONG = PROMPT + prompt_tokens(16, seed=5)
BATCH = [_LONG, _LONG + prompt_tokens(9, seed=1), prompt_tokens(17, seed=2), _LONG[:8] + prompt_tokens(21, seed=3),
         _LONG + prompt_tokens(30, seed=4)]
# Every setting runs on the serving engine: none; auto (suffix trees and n-gram chains); layerskip (each draft depth a
# step of the first layers over every rank's cache, its layer count in the broadcast step); all drafting at every
# step, the adaptive policy off (see workers.tiny_models). oracle: tree drafts whose accepted paths move cache
# entries on every rank (the paged cache's mirror); see workers.oracle_speculator. batch: BATCH, plain;
# batch_layerskip: BATCH with layerskip.
SPECULATIONS = {name: ["none"] for name in MODELS} | {
    "qwen2": ["none", "auto", "batch"], "llama_uneven": ["none", "oracle", "layerskip", "batch_layerskip"],
    "gemma3_uneven": ["none", "layerskip", "oracle", "batch"]}
