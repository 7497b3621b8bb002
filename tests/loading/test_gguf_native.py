"""A GGUF loaded in its own formats (gguf_native): Q8_0/Q4_0/Q4_1 blocks go into Int8Linear/Int4Linear and
Q4_K/Q5_K/Q6_K into KQuantLinear without a value changing, other types fall back to int8 with a warning, the
embedding reads the kept blocks, and no float model is built on the way."""
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize
from torch import nn

from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading import load_model, resolve_quant
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_loader import block_tensors
from fastdecode.loading.gguf_native import load_gguf_native
from fastdecode.quant import Int4Linear, Int8Linear, KQuantLinear, quantize_model
from fastdecode.quant.embedding import QuantEmbedding
from fastdecode.quant.int4 import dequantize_groupwise, from_blocks
from fastdecode.quant.int8 import dequantize_blockwise
from fastdecode.quant.split import RowSplitLinear
from tests.helpers.checkpoints import build_model, checkpoint, kquant_gguf, scratch_dir, write_gguf
from tests.helpers.tiny import logits

# A file with one of each case: q/k/v Q4_0, o Q4_1, down Q8_0, gate Q4_1 beside up Q5_0 (mixed: no one kernel).
TYPES = {"attn_q": QType.Q4_0, "attn_k": QType.Q4_0, "attn_v": QType.Q4_0, "attn_output": QType.Q4_1,
         "ffn_down": QType.Q8_0, "ffn_gate": QType.Q4_1, "ffn_up": QType.Q5_0, "output": QType.Q8_0,
         "token_embd": QType.F16}
TOKENS = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))


def tensor_type(name: str, ndim: int):
    return QType.F32 if ndim == 1 else TYPES[name.split(".")[-2]]


@pytest.fixture(scope="module")
def mixed_gguf():
    path = scratch_dir() / "llama-mixed-quant.gguf"
    write_gguf(build_model("llama"), path, "llama", tensor_type=tensor_type)
    return path


def uniform_gguf(qtype: QType, name: str = "llama") -> str:
    """Every matrix, the embedding included, in `qtype` (norms F32)."""
    path = scratch_dir() / f"{name}-all-{qtype.name}.gguf"
    if not path.exists():
        write_gguf(build_model(name), path, checkpoint(name).model.config.model_type,
                   tensor_type=lambda gguf_name, ndim: QType.F32 if ndim == 1 else qtype)
    return path


def block_weight(t) -> torch.Tensor:
    b = block_tensors(t)
    if "mins" in b:
        return dequantize_groupwise(from_blocks(b["blocks"]), b["scales"].float(), b["mins"].float())
    return dequantize_blockwise(b["qweight"], b["scales"].float())


def test_block_tensors_hold_the_values_gguf_dequantizes_to(mixed_gguf):
    f = GGUFFile(mixed_gguf)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        t = f.tensors[name]
        expected = torch.from_numpy(dequantize(np.asarray(t.data), t.type).reshape(t.shape).copy())
        assert torch.allclose(block_weight(t), expected, rtol=0, atol=1e-6), name  # Q4_0 sums d*q - 8d: 1 ulp


def test_released_tensor_pages_read_back_the_same(mixed_gguf):
    # release() only drops pages from this process's mapping; the next read faults them in from the file again.
    f = GGUFFile(mixed_gguf)
    t = f.tensors["blk.1.ffn_down.weight"]
    before = np.array(t.data)
    f.release(t)
    assert np.array_equal(np.array(t.data), before)


def test_kept_blocks_become_int_modules_and_mixed_types_fall_back_to_int8(mixed_gguf, caplog):
    ref = logits(load_model(mixed_gguf), TOKENS)
    with caplog.at_level(logging.WARNING):
        model = load_gguf_native(mixed_gguf, backend="aten")
    block = model.layers[0]
    assert isinstance(block.self_attn.qkv_proj, Int4Linear) and isinstance(block.self_attn.o_proj, Int4Linear)
    assert isinstance(block.mlp.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert isinstance(block.mlp.gate_up_proj, Int8Linear)  # Q4_1 + Q5_0: requantized ...
    assert "Q4_1/Q5_0" in caplog.text and "requantized to int8" in caplog.text  # ... and said so
    assert type(model.embed_tokens) is nn.Embedding  # F16: a float table, as in the float model
    out = logits(model, TOKENS)
    # Kept blocks are the loaded float weights exactly; only the aten int8 fallbacks (per-channel scales) round.
    assert (out - ref).norm() / ref.norm() < 0.02


def test_kept_q4_0_blocks_multiply_as_the_dequantized_file(mixed_gguf):
    # q/k/v are Q4_0 (row-permuted back from llama.cpp's order): the module times the identity is the loaded weight.
    model = load_model(mixed_gguf)
    kept = load_gguf_native(mixed_gguf, backend="aten")
    for m, q in zip(model.layers, kept.layers):
        w = m.self_attn.qkv_proj.weight
        eye = torch.eye(w.shape[1])
        assert torch.allclose(q.self_attn.qkv_proj(eye).T, w, atol=1e-5)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1])
@pytest.mark.parametrize("backend", ["native", "lut"])
def test_embedding_rows_come_from_the_kept_blocks_value_for_value(qtype, backend):
    # An untied llama: the embedding is its own kept matrix; its rows equal the float table the file dequantizes to.
    if backend == "lut" and qtype == QType.Q8_0:
        pytest.skip("int8 has no lookup backend: its embedding is a float table there")
    path = uniform_gguf(qtype)
    kept = load_gguf_native(path, backend=backend)
    assert isinstance(kept.embed_tokens, QuantEmbedding) and kept.embed_tokens.table is not kept.lm_head
    table = load_model(path).embed_tokens.weight
    ids = torch.tensor([[0, 5, 159], [77, 3, 3]])
    assert torch.equal(kept.embed_tokens(ids), table[ids])


def test_tied_embedding_shares_the_lm_head_module():
    kept = load_gguf_native(uniform_gguf(QType.Q4_0, "qwen2"))
    assert kept.embed_tokens.table is kept.lm_head
    table = load_model(uniform_gguf(QType.Q4_0, "qwen2")).embed_tokens.weight
    assert torch.equal(kept.embed_tokens(torch.arange(160)), table)


def test_a_bfloat16_load_looks_up_bfloat16_rows_and_leaves_the_native_step():
    from fastdecode.engine.kv_cache import KVCache
    from fastdecode.kernels import native_ops
    from fastdecode.runners.native import NativeRunner

    kept = load_gguf_native(uniform_gguf(QType.Q4_0), dtype=torch.bfloat16)
    assert kept.embed_tokens(torch.tensor([[1, 2]])).dtype == torch.bfloat16
    kept.setup_rope(32)
    kv = KVCache.for_model(kept.config, 32, torch.float32, block_size=8)  # a cache the native step takes
    assert NativeRunner.build(kept, kv) is None  # the C++ step takes float32 norms and embeddings only
    if native_ops() is not None:  # the same file loaded in float32 runs on it: the bfloat16 load alone declined
        float_kept = load_gguf_native(uniform_gguf(QType.Q4_0))
        float_kept.setup_rope(32)
        assert NativeRunner.build(float_kept, kv) is not None


def test_no_parameter_is_left_unloaded_or_float_where_kept():
    kept = load_gguf_native(uniform_gguf(QType.Q4_0))
    assert not any(t.is_meta for t in [*kept.parameters(), *kept.buffers()])
    assert not any(type(m) is nn.Linear for m in kept.modules())  # every matrix kept, none float


def test_smollm2_loaded_as_is_equals_float_then_int4_byte_for_byte(smollm2_path):
    # SmolLM2's Q4_1 blocks requantized by int4 (g32) land on the file's own scales, mins and values; loading them
    # as they are gives the same bytes, module for module. The tied Q8_0 head holds the same values both ways, but
    # kept as Q8_0 it is packed for int8 activations (as llama.cpp computes Q8_0), requantized it is weight-only.
    kept = load_model(smollm2_path, quant="gguf")
    via_int4 = quantize_model(load_model(smollm2_path), "int4")
    for name, a in via_int4.named_modules():
        if name == "embed_tokens":
            continue
        b = kept.get_submodule(name)
        assert type(a) is type(b), name
        if name == "lm_head":
            assert a.qweight.shape[-1] == 144 and b.qweight.shape[-1] == 272
            ids = torch.arange(a.out_features)
            assert torch.equal(a.rows(ids), b.rows(ids))
            continue
        for key, buf in a.named_buffers(recurse=False):
            assert torch.equal(buf, getattr(b, key)), f"{name}.{key}"
    tokens = torch.tensor([[1, 504, 3458, 314, 1178, 30]])
    ours, ref = logits(kept, tokens), logits(via_int4, tokens)
    assert (ours - ref).norm() / ref.norm() < 0.01
    # The heads' activations differ (int8 against float), so the greedy token may differ only where the reference's
    # top two are closer than the logits' difference: on the AVX-512 EPYC, position 1's are 0.009 apart (51, 50).
    top2 = ref.topk(2, dim=-1).values
    near_tie = top2[..., 0] - top2[..., 1] < 2 * (ours - ref).abs().amax(-1)
    assert ((ours.argmax(-1) == ref.argmax(-1)) | near_tie).all() and not near_tie.all()


def test_quant_gguf_of_a_directory_is_refused():
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        load_model(checkpoint("llama").hf_dir, quant="gguf")


def test_quantize_model_points_gguf_to_loading():
    with pytest.raises(ValueError, match="load_model"):
        quantize_model(load_model(checkpoint("llama").hf_dir), "gguf")


def test_default_scheme_is_the_file_format_for_gguf_and_float_for_directories():
    gguf_path, hf_dir = checkpoint("llama").gguf_path, checkpoint("llama").hf_dir
    assert resolve_quant(gguf_path, None) == "gguf" and resolve_quant(hf_dir, None) is None
    assert resolve_quant(gguf_path, "none") is None and resolve_quant(gguf_path, "int4") == "int4"


def test_truncated_tensor_data_raises_model_file_error(tmp_path):
    data = uniform_gguf(QType.Q4_0).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        load_model(path, quant="gguf")


def test_missing_tensor_raises_model_file_error(tmp_path):
    path = tmp_path / "incomplete.gguf"
    write_gguf(build_model("llama"), path, "llama", tensor_type=tensor_type, skip=("blk.1.ffn_gate.weight",))
    with pytest.raises(ModelFileError, match="lacks"):
        load_model(path, quant="gguf")


# K-quants (rows of 256: the wider KQUANT_SPECS models). As a Q4_K_M file has them: mostly Q4_K, a Q6_K v beside Q4_K
# q/k (a packed qkv of two types), Q6_K down and output; Q5_K o and a Q4_K embedding for the other two kernels.
K_TYPES = {"attn_v": QType.Q6_K, "attn_output": QType.Q5_K, "ffn_down": QType.Q6_K, "output": QType.Q6_K}


def test_k_quant_blocks_become_kquant_modules_and_a_mixed_qkv_keeps_both_formats(caplog):
    path = kquant_gguf("llama_k", K_TYPES)
    with caplog.at_level(logging.WARNING):
        kept = load_gguf_native(path, backend="aten")  # K-quants dequantize: the file's weights, exactly
    block = kept.layers[0]
    kinds = {name: m.kind for name, m in kept.named_modules() if isinstance(m, KQuantLinear)}
    assert kinds["layers.0.self_attn.o_proj"] == "q5_k" and kinds["layers.0.mlp.gate_up_proj"] == "q4_k"
    assert kinds["layers.0.mlp.down_proj"] == "q6_k" and kinds["lm_head"] == "q6_k"
    # Q4_K q/k + Q6_K v: two parts, each the file's own blocks, and nothing requantized
    qkv = block.self_attn.qkv_proj
    assert isinstance(qkv, RowSplitLinear) and [p.kind for p in qkv.parts] == ["q4_k", "q6_k"]
    assert "requantized" not in caplog.text
    model = load_model(path)  # the float model: gguf's dequantization
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.gate_up_proj",
                 "layers.1.mlp.down_proj", "lm_head"):
        w = model.get_submodule(name).weight
        assert torch.equal(kept.get_submodule(name)(torch.eye(w.shape[1])).T, w), name
    table = kept.embed_tokens
    assert isinstance(table, QuantEmbedding) and table.table.kind == "q4_k"  # untied: the embedding's own blocks
    assert torch.equal(table(torch.arange(160)), model.embed_tokens.weight)


def test_packed_modules_of_one_k_quant_are_kept_whole():
    kept = load_gguf_native(kquant_gguf("llama_k", {}))  # every matrix Q4_K
    assert all(isinstance(m, KQuantLinear) for m in (kept.layers[1].self_attn.qkv_proj,
                                                     kept.layers[1].mlp.gate_up_proj))
    assert not any(type(m) is nn.Linear or isinstance(m, Int8Linear) for m in kept.modules())


def test_tied_k_quant_embedding_shares_the_lm_head_and_reads_the_files_rows():
    path = kquant_gguf("qwen2_k", {"token_embd": QType.Q6_K})
    kept = load_gguf_native(path)
    assert kept.embed_tokens.table is kept.lm_head and kept.lm_head.kind == "q6_k"
    assert torch.equal(kept.embed_tokens(torch.arange(160)), load_model(path).embed_tokens.weight)


@pytest.mark.parametrize("name,types", [("llama_k", K_TYPES), ("qwen2_k", {"token_embd": QType.Q6_K})])
def test_k_quant_model_logits_agree_with_the_dequantized_model(name, types):
    # Native kernels round activations to int8 per block of 32: near, not equal.
    path = kquant_gguf(name, types)
    ref, out = logits(load_model(path), TOKENS), logits(load_model(path, quant="gguf"), TOKENS)
    assert (out - ref).norm() / ref.norm() < 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("qtype", [QType.Q5_0, QType.Q5_1])
def test_q5_blocks_go_into_int8_value_for_value(qtype):
    # No 5-bit kernel, but d * (q - 16) and d * q + m are int8 blocks exactly: no second rounding.
    path = uniform_gguf(qtype)
    kept = load_gguf_native(path)
    assert not any(type(m) is nn.Linear for m in kept.modules())
    t = GGUFFile(path).tensors["blk.0.ffn_down.weight"]
    expected = torch.from_numpy(dequantize(np.asarray(t.data), t.type).reshape(t.shape).copy())
    b = block_tensors(t)
    mins = b["mins"].float() if "mins" in b else None
    assert torch.equal(dequantize_blockwise(b["qweight"], b["scales"].float(), mins), expected)
    down = kept.layers[0].mlp.down_proj
    assert isinstance(down, Int8Linear) and torch.equal(down.rows(torch.arange(down.out_features)), expected)


def test_a_qkv_of_q5_0_beside_q8_0_is_one_exact_int8_module(caplog):
    # gemma3-270m's layout: q/k Q5_0, v Q8_0.
    path = scratch_dir() / "llama-q5_0-q8_0.gguf"
    write_gguf(build_model("llama"), path, "llama", tensor_type=lambda n, ndim: QType.F32 if ndim == 1 else
               QType.Q8_0 if ".attn_v." in n else QType.Q5_0)
    with caplog.at_level(logging.WARNING):
        kept = load_gguf_native(path)
    assert "requantized" not in caplog.text
    qkv, w = kept.layers[1].self_attn.qkv_proj, load_model(path).layers[1].self_attn.qkv_proj.weight
    assert isinstance(qkv, Int8Linear) and torch.equal(qkv.rows(torch.arange(w.shape[0])), w)
