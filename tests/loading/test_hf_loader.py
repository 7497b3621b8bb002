"""Hugging Face directories: sharded safetensors, the multimodal Gemma 3 layout, bfloat16, and directories that
are broken or not ours to load."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.loading import load_model
from fastdecode.loading.hf_loader import load_hf_dir
from tests.helpers.checkpoints import (checkpoint, max_diff, our_run, prompt_tokens, reference_run,
                                       sharded_checkpoint, single_thread)

PROMPT = prompt_tokens(24)
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def copy_checkpoint(name: str, dest) -> dict:
    """Copies the named checkpoint's directory to dest; returns its config.json for editing."""
    shutil.copytree(checkpoint(name).hf_dir, dest)
    return json.loads((dest / "config.json").read_text())


# ---- what a good directory holds ---------------------------------------------------------------------------------
def test_sharded_safetensors_load_the_same_weights_as_one_file():
    sharded = sharded_checkpoint("llama")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    _, one = load_hf_dir(checkpoint("llama").hf_dir)
    _, many = load_hf_dir(sharded)
    assert sorted(one) == sorted(many)
    for key in one:
        assert torch.equal(one[key], many[key]), key
    ours = our_run(load_model(sharded), PROMPT, 4)
    ref = reference_run(checkpoint("llama").model, PROMPT, 4)
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= ATOL
    assert ours.tokens == ref.tokens


def test_multimodal_gemma3_layout_loads_the_language_model(tmp_path):
    # Gemma3ForConditionalGeneration keeps the text model under model.language_model. and its settings under
    # text_config, next to vision weights that a text-only engine skips.
    text = copy_checkpoint("gemma3_hf", tmp_path / "text")
    text.pop("architectures")
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}
    weights = load_file(checkpoint("gemma3_hf").hf_dir / "model.safetensors")
    renamed = {(k if k == "lm_head.weight" else "model.language_model." + k.removeprefix("model.")): v
               for k, v in weights.items()}
    renamed["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    renamed["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    save_file(renamed, multimodal / "model.safetensors")
    (multimodal / "config.json").write_text(json.dumps(config))
    ours = our_run(load_model(multimodal), PROMPT, 4)
    ref = reference_run(checkpoint("gemma3_hf").model, PROMPT, 4)
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= ATOL
    assert ours.tokens == ref.tokens


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bfloat16_load_is_close_to_float32(name):
    model = load_model(checkpoint(name).hf_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    half = our_run(model, PROMPT, 8)
    full = our_run(load_model(checkpoint(name).hf_dir), PROMPT, 8)
    # bfloat16 keeps 8 bits of mantissa; these logits span about +-5, and differ from float32 by about 0.08.
    assert max_diff(half.prefill_logits, full.prefill_logits) <= 0.25
    assert half.tokens[0] == full.tokens[0]


# ---- bad directories -------------------------------------------------------------------------------------------
def test_directory_without_safetensors_raises_model_file_error(tmp_path):
    copy_checkpoint("llama", tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(ModelFileError, match="safetensors"):
        load_model(tmp_path / "model")


def test_directory_without_config_raises_model_file_error(tmp_path):
    copy_checkpoint("llama", tmp_path / "model")
    (tmp_path / "model" / "config.json").unlink()
    with pytest.raises(ModelFileError, match="config.json"):
        load_model(tmp_path / "model")


def test_missing_path_raises_model_file_error(tmp_path):
    with pytest.raises(ModelFileError):
        load_model(tmp_path / "nowhere")


def test_unknown_architecture_raises_unsupported_model_error(tmp_path):
    config = copy_checkpoint("llama", tmp_path / "model")
    config.update(architectures=["FooForCausalLM"], model_type="foo")
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="FooForCausalLM"):
        load_model(tmp_path / "model")


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_corrupt_safetensors_raises_model_file_error(tmp_path, cut):
    copy_checkpoint("llama", tmp_path / "model")
    shard = tmp_path / "model" / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if cut == "truncated" else b"not safetensors" * 100)
    with pytest.raises(ModelFileError):
        load_model(tmp_path / "model")


def test_safetensors_missing_a_weight_raises_model_file_error(tmp_path):
    copy_checkpoint("llama", tmp_path / "model")
    shard = tmp_path / "model" / "model.safetensors"
    weights = load_file(shard)
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, shard)
    with pytest.raises(ModelFileError, match="lacks"):
        load_model(tmp_path / "model")


def test_config_that_disagrees_with_weight_shapes_raises_model_file_error(tmp_path):
    config = copy_checkpoint("llama", tmp_path / "model")
    config["intermediate_size"] *= 2
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="shape"):
        load_model(tmp_path / "model")
