"""GGUF checkpoints as llama.cpp writes them: names, permutations, norm shifts, metadata, quantized tensors, and
files that are broken or not ours to load."""
import dataclasses
import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.layers.rotary import inverse_frequencies
from fastdecode.loading import load_model
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_loader import load_gguf
from fastdecode.loading.hf_loader import load_hf_dir
from tests.helpers.checkpoints import (GGUF_SPECS, LLAMA3_SCALING, checkpoint, max_diff, our_run, prompt_tokens,
                                       quantized_checkpoint, reference_run, saved_weights, single_thread, write_gguf)

PROMPT = prompt_tokens(24)
STEPS = 32
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


# ---- what a good file holds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GGUF_SPECS)
def test_gguf_weights_equal_transformers_weights(name):
    # Pins the name map, the undone q/k permutation and the undone Gemma +1, tensor by tensor.
    ckpt = checkpoint(name)
    _, weights, _, _ = load_gguf(ckpt.gguf_path)
    expected = saved_weights(ckpt.model)
    if ckpt.model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert sorted(weights) == sorted(expected)
    for key, tensor in expected.items():
        # (w + 1) - 1 rounds in float32, so Gemma norms are equal only to an ulp.
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", GGUF_SPECS)
def test_gguf_config_equals_config_json(name):
    ckpt = checkpoint(name)
    from_gguf = ModelConfig.from_gguf(GGUFFile(ckpt.gguf_path).metadata)
    from_gguf.tie_word_embeddings = ckpt.model.config.tie_word_embeddings  # load_gguf sets it from the tensors
    from_hf, _ = load_hf_dir(ckpt.hf_dir)
    # llama3 scaling travels as the rope_freqs tensor (tested below); GGUF stores no eos list of its own here.
    skip = {"rope_scaling", "eos_token_id"}
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in skip]

    def as_stored(value):  # GGUF holds floats as float32
        return float(np.float32(value)) if isinstance(value, float) else value

    assert ({f: as_stored(getattr(from_gguf, f)) for f in fields}
            == {f: as_stored(getattr(from_hf, f)) for f in fields})


def test_rope_freqs_tensor_reproduces_llama3_scaling():
    ckpt = checkpoint("llama3_rope")
    config, _, freq_factors, _ = load_gguf(ckpt.gguf_path)
    assert freq_factors is not None
    from_factors = inverse_frequencies(config.head_dim, config.rope_theta,
                                       {"rope_type": "freq_factors", "factors": freq_factors})
    from_scaling = inverse_frequencies(config.head_dim, config.rope_theta, LLAMA3_SCALING)
    torch.testing.assert_close(from_factors, from_scaling, rtol=1e-6, atol=0)


def test_gemma3_27b_gguf_scales_attention_by_hidden_over_heads():
    # llama.cpp: the 27B (62 layers) uses hidden / heads = 168 = its query_pre_attn_scalar; other sizes head_dim.
    meta = {"general.architecture": "gemma3", "gemma3.block_count": 62, "gemma3.embedding_length": 5376,
            "gemma3.feed_forward_length": 21504, "gemma3.attention.head_count": 32,
            "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
            "gemma3.attention.sliding_window": 1024, "tokenizer.ggml.tokens": ["a"] * 8}
    assert ModelConfig.from_gguf(meta).query_pre_attn_scalar == 168
    meta_1b = {**meta, "gemma3.block_count": 26, "gemma3.embedding_length": 1152, "gemma3.attention.head_count": 4,
               "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256}
    assert ModelConfig.from_gguf(meta_1b).query_pre_attn_scalar == 256


# ---- quantized tensors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_q8_0_and_f16_gguf_matches_transformers_on_dequantized_weights(name):
    ckpt = quantized_checkpoint(name)
    types = {t.type for t in GGUFFile(ckpt.gguf_path).tensors.values()}
    assert types == {QType.Q8_0, QType.F16, QType.F32}
    ref = reference_run(ckpt.model, PROMPT, STEPS)
    ours = our_run(load_model(ckpt.gguf_path), PROMPT, STEPS)
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= ATOL
    assert ours.tokens == ref.tokens
    assert max_diff(ours.step_logits, ref.step_logits) <= ATOL


# ---- bad files -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0.5, 0.01], ids=["in-tensor-data", "in-metadata"])
def test_truncated_gguf_raises_model_file_error(tmp_path, keep):
    data = checkpoint("llama").gguf_path.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelFileError):
        load_model(path)


GARBAGE = {
    "random-bytes": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
    "empty": b"",
    "text": b"this is not a model\n" * 50,
    "gguf-magic-then-noise": b"GGUF" + struct.pack("<I", 3) + np.random.default_rng(1).integers(
        0, 256, 4096, dtype=np.uint8).tobytes(),
    "gguf-version-9": b"GGUF" + struct.pack("<IQQ", 9, 0, 0),
}


@pytest.mark.parametrize("content", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_file_raises_model_file_error(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError):
        load_model(path)


def with_u32_metadata(data: bytes, key: str, value: int) -> bytes:
    """`data` (a GGUF file) with the uint32 metadata value under `key` replaced."""
    entry = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 4)  # 4: GGUF's uint32 type
    at = data.index(entry) + len(entry)
    return data[:at] + struct.pack("<I", value) + data[at + 4:]


@pytest.mark.parametrize("key, value", [
    ("llama.attention.head_count", 0),  # a division by zero
    ("llama.attention.head_count_kv", 3),  # 4 heads cannot share 3
    ("llama.feed_forward_length", 2**31),  # 2 TB of parameters from a file of 400 KB
    ("llama.embedding_length", 2**31 - 1),  # sizes no tensor can have
])
def test_metadata_that_describes_no_model_of_the_file_raises_model_file_error(tmp_path, key, value):
    path = tmp_path / "bad-metadata.gguf"
    path.write_bytes(with_u32_metadata(checkpoint("llama").gguf_path.read_bytes(), key, value))
    with pytest.raises(ModelFileError):
        load_model(path)


def test_unknown_gguf_architecture_raises_unsupported_model_error(tmp_path):
    path = tmp_path / "foo.gguf"
    write_gguf(checkpoint("llama").model, path, "foo")
    with pytest.raises(UnsupportedModelError, match="foo"):
        load_model(path)


def test_gguf_missing_a_tensor_raises_model_file_error(tmp_path):
    path = tmp_path / "incomplete.gguf"
    write_gguf(checkpoint("llama").model, path, "llama", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelFileError, match="lacks"):
        load_model(path)


def test_gguf_without_token_embeddings_raises_model_file_error(tmp_path):
    path = tmp_path / "no-embeddings.gguf"
    write_gguf(checkpoint("llama").model, path, "llama", skip=("token_embd.weight",))
    with pytest.raises(ModelFileError, match="token_embd"):
        load_model(path)


def test_unsupported_tensor_type_raises_unsupported_model_error(tmp_path):
    # IQ4_NL is a valid GGML type that fastdecode does not dequantize; write_gguf stores zero blocks for it.
    def tensor_type(gguf_name, ndim):
        return QType.IQ4_NL if gguf_name == "blk.0.ffn_up.weight" else QType.F32

    path = tmp_path / "iq4_nl.gguf"
    write_gguf(checkpoint("llama").model, path, "llama", tensor_type=tensor_type)
    with pytest.raises(UnsupportedModelError, match="IQ4_NL"):
        load_model(path)
