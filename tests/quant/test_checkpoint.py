"""Quantized checkpoints: what `fastdecode quantize` writes reloads to the in-memory transform's logits bit for bit,
holds only safetensors and JSON, and carries a config and tokenizer that read back to the same ones."""
import copy
import json

import pytest
import torch
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError
from fastdecode.loading import load_model
from fastdecode.models.moe import Router
from fastdecode.models.transformer import Transformer
from fastdecode.quant import Fp4Linear, Int4Linear, Int8Linear, quantize_model
from fastdecode.quant.checkpoint import QUANT_CONFIG, WEIGHTS, hf_config, save_quantized
from tests.helpers.checkpoints import checkpoint
from tests.helpers.tiny import logits, tiny_model

CASES = [("int8", 32), ("int4", 32), ("int4", 128), ("mxfp4", 32), ("nvfp4", 32)]
MODULES = {"int8": Int8Linear, "int4": Int4Linear, "mxfp4": Fp4Linear, "nvfp4": Fp4Linear}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme,group_size", CASES)
def test_reloaded_checkpoint_gives_the_in_memory_logits(tmp_path, scheme, group_size, tied):
    model = tiny_model(tied=tied)
    tokens = torch.randint(0, 128, (2, 16))
    expected = logits(quantize_model(copy.deepcopy(model), scheme, group_size), tokens)
    save_quantized(model, None, tmp_path, scheme, group_size)
    reloaded = load_model(tmp_path)
    assert isinstance(reloaded.layers[1].mlp.down_proj, MODULES[scheme])
    assert isinstance(reloaded.lm_head, Int8Linear)  # the default int8 LM head
    assert torch.equal(logits(reloaded, tokens), expected)


def test_lm_head_scheme_is_kept_and_a_tied_embedding_stays_float(tmp_path):
    model = tiny_model(tied=True)
    save_quantized(model, None, tmp_path, "int4", lm_head_scheme="mxfp4")
    assert json.loads((tmp_path / QUANT_CONFIG).read_text())["modules"]["lm_head"]["scheme"] == "mxfp4"
    reloaded = load_model(tmp_path)
    assert isinstance(reloaded.lm_head, Fp4Linear)
    assert torch.equal(reloaded.embed_tokens.weight, model.embed_tokens.weight)


def test_float_lm_head_of_a_tied_model_is_tied_again(tmp_path):
    # hidden 48 is no whole MXFP4 block: q/k/v, gate/up and the tied head stay float, down_proj (in 128) is MXFP4.
    torch.manual_seed(0)
    config = ModelConfig(family="llama", vocab_size=128, hidden_size=48, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Transformer(config).eval()
    model.lm_head.weight = model.embed_tokens.weight
    tokens = torch.randint(0, 128, (1, 8))
    expected = logits(quantize_model(copy.deepcopy(model), "mxfp4", lm_head_scheme="mxfp4"), tokens)
    save_quantized(model, None, tmp_path, "mxfp4", lm_head_scheme="mxfp4")
    reloaded = load_model(tmp_path)
    assert isinstance(reloaded.layers[0].mlp.down_proj, Fp4Linear)
    assert reloaded.lm_head.weight is reloaded.embed_tokens.weight
    assert torch.equal(logits(reloaded, tokens), expected)


def test_moe_checkpoint_reloads_with_quantized_experts_and_a_float_router(tmp_path):
    model = load_model(checkpoint("qwen3_moe").hf_dir)
    tokens = torch.randint(0, 160, (2, 16))
    expected = logits(quantize_model(copy.deepcopy(model), "int8"), tokens)
    save_quantized(model, None, tmp_path, "int8")
    reloaded = load_model(tmp_path)
    assert isinstance(reloaded.layers[0].mlp.experts[3].down_proj, Int8Linear)
    assert type(reloaded.layers[0].mlp.gate) is Router
    assert torch.equal(logits(reloaded, tokens), expected)


def test_checkpoint_is_safetensors_and_json_only(tmp_path):
    save_quantized(tiny_model(tied=False), None, tmp_path, "int4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS, QUANT_CONFIG]
    assert not (tmp_path / WEIGHTS).read_bytes()[:2] == b"\x80\x04"  # not a pickle


@pytest.mark.parametrize("config", [
    ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}, eos_token_id=[2, 5], bos_token_id=1),
    ModelConfig(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                layer_types=["sliding_attention"] * 2),  # Mistral v0.1
    ModelConfig(family="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, rope_theta=1e6),
    ModelConfig(family="gemma3", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=16, hidden_act="gelu_pytorch_tanh",
                query_pre_attn_scalar=24, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                rope_local_base_freq=100.0, final_logit_softcapping=30.0, tie_word_embeddings=True),
    ModelConfig(family="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]),
])
def test_config_json_reads_back_to_the_same_config(config):
    if config.family != "gemma3":
        config.rope_local_base_freq = config.rope_theta  # what both loaders set outside Gemma
    assert ModelConfig.from_hf(json.loads(json.dumps(hf_config(config)))) == config


def test_missing_tensor_is_a_model_file_error(tmp_path):
    save_quantized(tiny_model(tied=False), None, tmp_path, "int8")
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / WEIGHTS)
    del tensors["layers.0.mlp.down_proj.scales"]
    save_file(tensors, tmp_path / WEIGHTS)
    with pytest.raises(ModelFileError):
        load_model(tmp_path)


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-int4")
    result = CliRunner().invoke(main, ["quantize", str(smollm2_path), "--to", "int4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_quantize_command_output_loads_like_the_in_memory_transform(smollm2_path, smollm2_int4):
    from fastdecode import LLM, SamplingParams

    in_memory = LLM(str(smollm2_path), quant="int4", max_seq_len=128)
    reloaded = LLM(str(smollm2_int4), max_seq_len=128)
    ids = in_memory.encode_prompt("def quicksort(arr):\n")
    assert reloaded.encode_prompt("def quicksort(arr):\n") == ids
    assert reloaded.tokenizer.eos_token_ids == in_memory.tokenizer.eos_token_ids
    assert reloaded.tokenizer.chat_template == in_memory.tokenizer.chat_template
    with torch.inference_mode():
        a = in_memory.model(torch.tensor([ids]), 0, all_logits=True)
        b = reloaded.model(torch.tensor([ids]), 0, all_logits=True)
    assert torch.equal(a, b)
    assert reloaded.decode_path == "native"  # the native decode step takes the reloaded int4 modules
    params = SamplingParams(max_tokens=16, temperature=0)
    assert reloaded.generate(ids, params).token_ids == in_memory.generate(ids, params).token_ids
    assert reloaded.weight_bytes_per_token() == in_memory.weight_bytes_per_token()


def test_fp4_group_size_other_than_its_block_is_one_line_error(smollm2_path, tmp_path):
    result = CliRunner().invoke(main, ["quantize", str(smollm2_path), "--to", "nvfp4", "--group-size", "32",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 2 and "16" in result.stderr


def test_an_already_quantized_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="already quantized"):
        save_quantized(quantize_model(tiny_model(tied=False), "int8"), None, tmp_path, "int4")
    save_quantized(tiny_model(tied=False), None, tmp_path / "q", "int8")
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "q"), "--to", "int4", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "already quantized" in result.stderr
