"""`--quant gguf`: a GGUF's own Q8_0/Q4_0/Q4_1 blocks go into Int8Linear/Int4Linear without a value changing; other
types fall back to int8 with a warning."""
import copy
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from fastdecode.errors import UnsupportedModelError
from fastdecode.loading import load_model
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_loader import block_tensors
from fastdecode.quant import Int4Linear, Int8Linear, quantize_model
from fastdecode.quant.int4 import dequantize_groupwise
from fastdecode.quant.linear import unpack_nibbles
from fastdecode.quant.int8 import dequantize_blockwise
from tests.helpers.checkpoints import build_model, scratch_dir, write_gguf
from tests.helpers.tiny import logits, tiny_model

# A file with one of each case: q/k/v Q4_0, o Q4_1, down Q8_0, gate Q4_1 beside up Q5_0 (mixed: no one kernel).
TYPES = {"attn_q": QType.Q4_0, "attn_k": QType.Q4_0, "attn_v": QType.Q4_0, "attn_output": QType.Q4_1,
         "ffn_down": QType.Q8_0, "ffn_gate": QType.Q4_1, "ffn_up": QType.Q5_0, "output": QType.Q8_0,
         "token_embd": QType.F16}


def tensor_type(name: str, ndim: int):
    return QType.F32 if ndim == 1 else TYPES[name.split(".")[-2]]


@pytest.fixture(scope="module")
def mixed_gguf():
    path = scratch_dir() / "llama-mixed-quant.gguf"
    write_gguf(build_model("llama"), path, "llama", tensor_type=tensor_type)
    return path


def block_weight(t) -> torch.Tensor:
    b = block_tensors(t)
    if "mins" in b:
        return dequantize_groupwise(unpack_nibbles(b["qweight"]), b["scales"].float(), b["mins"].float())
    return dequantize_blockwise(b["qweight"], b["scales"].float())


def test_block_tensors_hold_the_values_gguf_dequantizes_to(mixed_gguf):
    f = GGUFFile(mixed_gguf)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        t = f.tensors[name]
        expected = torch.from_numpy(dequantize(np.asarray(t.data), t.type).reshape(t.shape).copy())
        assert torch.allclose(block_weight(t), expected, rtol=0, atol=1e-6), name  # Q4_0 sums d*q - 8d: 1 ulp


def test_kept_blocks_become_int_modules_and_mixed_types_fall_back_to_int8(mixed_gguf, caplog):
    model = load_model(mixed_gguf)
    tokens = torch.randint(0, 160, (2, 12))
    ref = logits(model, tokens)
    with caplog.at_level(logging.WARNING):
        quantize_model(model, "gguf", backend="aten")
    block = model.layers[0]
    assert isinstance(block.self_attn.qkv_proj, Int4Linear) and isinstance(block.self_attn.o_proj, Int4Linear)
    assert isinstance(block.mlp.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(block.mlp.gate_up_proj, Int8Linear)  # Q4_1 + Q5_0: requantized ...
    assert "Q4_1/Q5_0" in caplog.text and "requantized to int8" in caplog.text  # ... and said so
    out = logits(model, tokens)
    # Kept blocks are the loaded float weights exactly; only the aten int8 fallbacks (per-channel scales) round.
    assert (out - ref).norm() / ref.norm() < 0.02


def test_kept_q4_0_blocks_multiply_as_the_dequantized_file(mixed_gguf):
    # q/k/v are Q4_0 (row-permuted back from llama.cpp's order): the module times the identity is the loaded weight.
    model = load_model(mixed_gguf)
    quantized = quantize_model(copy.deepcopy(model), "gguf", backend="aten")
    for m, q in zip(model.layers, quantized.layers):
        w = m.self_attn.qkv_proj.weight
        eye = torch.eye(w.shape[1])
        assert torch.allclose(q.self_attn.qkv_proj(eye).T, w, atol=1e-5)


def test_a_model_not_loaded_from_gguf_is_refused():
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        quantize_model(tiny_model(tied=False), "gguf")


def test_smollm2_q4_1_file_packs_to_the_same_bytes_as_int4(smollm2_path):
    # SmolLM2's Q4_1 blocks requantized by int4 (g32) land on the file's own scales, mins and values; "gguf" takes
    # them without the round trip. Same bytes, module for module, the tied Q8_0 head included.
    model = load_model(smollm2_path)
    via_int4 = quantize_model(copy.deepcopy(model), "int4")
    kept = quantize_model(model, "gguf")
    for (name, a), (_, b) in zip(via_int4.named_modules(), kept.named_modules()):
        assert type(a) is type(b), name
        for key, buf in a.named_buffers(recurse=False):
            assert torch.equal(buf, getattr(b, key)), f"{name}.{key}"
