"""A rank's shard of a GGUF file in the file's own formats: each matrix cut to the rank's rows or columns of blocks
and kept as they are (Q8_0, a Q4_K_M mix of Q4_K and Q6_K, a Q6_K embedding read through the tied head; columns
that split a block requantized to int8), its logits those of one process within the rounding of the kernels'
per-block activation quantization."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from fastdecode.loading.gguf_file import GGUFTensor
from fastdecode.loading.gguf_loader import dequantize_tensor
from fastdecode.loading import load_model
from fastdecode.parallel.load import block_slice
from tests.helpers.checkpoints import kquant_gguf, prompt_tokens, quantized_checkpoint, single_thread
from tests.parallel.ranks import WORLD, run_ranks
from tests.parallel.workers import gguf_shards, greedy_run

PROMPT = prompt_tokens(12)
FILES = {
    "q8_0": lambda: quantized_checkpoint("llama").gguf_path,  # Q8_0 matrices, an F16 embedding and head
    "q4_k_m": lambda: kquant_gguf("llama_k", {"attn_v": QType.Q6_K, "ffn_down": QType.Q6_K}),  # two-part q/k/v
    "tied_q6_k": lambda: kquant_gguf("qwen2_k", {"token_embd": QType.Q6_K}),  # embedding rows from the head
}


def test_block_slice_keeps_whole_blocks_and_dequantizes_the_rest():
    values = np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32)
    t = GGUFTensor("w", (4, 128), QType.Q8_0, quants.quantize(values, QType.Q8_0).reshape(-1))
    whole = dequantize_tensor(t)
    for dim, lo, hi, kept in [(0, 1, 3, True), (1, 32, 96, True), (1, 16, 48, False)]:
        part = block_slice(t, dim, lo, hi)
        assert (part.type == QType.Q8_0) == kept
        expected = whole[lo:hi] if dim == 0 else whole[:, lo:hi]
        assert np.array_equal(dequantize_tensor(part), expected)


@pytest.fixture(scope="module")
def shards():
    paths = {name: str(make()) for name, make in FILES.items()}
    with single_thread():
        reference = {name: greedy_run(load_model(path, quant="gguf"), PROMPT, 2)[0] for name, path in paths.items()}
    ran = run_ranks(gguf_shards, WORLD, list(paths.values()), PROMPT)
    return {name: (reference[name], ran[path]) for name, path in paths.items()}


@pytest.mark.parametrize("name,kinds", [
    ("q8_0", {"qkv_proj": "Int8Linear", "o_proj": "Int8Linear", "down_proj": "Int8Linear", "embedding": "NoneType"}),
    # o_proj's columns split at 2 heads of 64, inside a 256-value K-quant block: requantized to int8
    ("q4_k_m", {"qkv_proj": "RowSplitLinear", "o_proj": "Int8Linear", "down_proj": "KQuantLinear",
                "embedding": "QuantEmbedding"}),
    ("tied_q6_k", {"qkv_proj": "KQuantLinear", "o_proj": "Int8Linear", "down_proj": "KQuantLinear",
                   "embedding": "QuantEmbedding"}),
])
def test_a_rank_keeps_its_cut_of_the_files_blocks(shards, name, kinds):
    reference, shard = shards[name]
    assert shard["kinds"] == kinds
    # 1.6-3% measured (tiny random models: a flipped activation step moves a logit by about 1/127 of a block's
    # largest value); a mis-cut block would give unrelated logits
    err = (shard["logits"] - reference).abs().max() / reference.abs().max()
    assert err < 6e-2, f"{name}: {err:.4f}"
