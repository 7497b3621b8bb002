"""Qwen3-MoE beyond the family comparisons of test_families: GGUF experts kept in their own formats, only routed
experts run, the engine's greedy output equals transformers' generate, and MoE layouts of other families are refused
with one line that names what is missing."""
import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from fastdecode import LLM, SamplingParams
from fastdecode.config import ModelConfig
from fastdecode.errors import UnsupportedModelError
from fastdecode.loading import load_model
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_loader import block_tensors
from fastdecode.loading.gguf_moe import expert_tensors
from fastdecode.loading.gguf_native import load_gguf_native
from fastdecode.models.moe import Router, SparseMoE
from fastdecode.quant import Int8Linear, KQuantLinear, quantize_model
from fastdecode.runners.native_layers import stacked_experts
from tests.helpers.checkpoints import (checkpoint, kquant_gguf, max_diff, our_run, prompt_tokens, quantized_checkpoint,
                                       reference_run, single_thread)
from tests.helpers.tiny import logits

PROMPT = prompt_tokens(24)
STEPS = 32
ATOL = 1e-4
GREEDY_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_gguf_experts_kept_in_their_format_match_transformers(quantized):
    ckpt = quantized_checkpoint("qwen3_moe") if quantized else checkpoint("qwen3_moe")
    model = load_model(ckpt.gguf_path, quant="gguf")
    moe = model.layers[0].mlp
    assert type(moe.gate) is Router and moe.gate.weight.dtype == torch.float32  # the router is float
    expert_type = Int8Linear if quantized else nn.Linear  # each expert is its own module, sliced from the stack
    assert all(type(e.gate_up_proj) is expert_type and type(e.down_proj) is expert_type for e in moe.experts)
    ref, ours = reference_run(ckpt.model, PROMPT, STEPS), our_run(model, PROMPT, STEPS)
    if quantized:  # Q8_0 experts run as llama.cpp runs them: activations rounded to int8 per block
        for a, b in ((ours.prefill_logits, ref.prefill_logits), (ours.step_logits, ref.step_logits)):
            assert (a - b).norm() / b.norm() < 0.02
        return
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= ATOL
    assert max_diff(ours.step_logits, ref.step_logits) <= ATOL
    assert ours.tokens == ref.tokens


@pytest.mark.parametrize("source", ["gguf_q8_0", "hf_f32"])
def test_the_native_step_reads_each_layers_experts_as_one_stack_held_once(source):
    """A GGUF's experts are packed as one matrix per layer and projection (each expert a view of it); a model built
    otherwise is stacked once, its experts becoming views of the stack. Either way no weight is held twice."""
    path = quantized_checkpoint("qwen3_moe").gguf_path if source == "gguf_q8_0" else checkpoint("qwen3_moe").hf_dir
    model = load_model(path, quant="gguf" if source == "gguf_q8_0" else None)
    moe = model.layers[0].mlp
    name = "qweight" if source == "gguf_q8_0" else "weight"
    before = [getattr(e.gate_up_proj, name).data_ptr() for e in moe.experts]
    gate_up, _, down, _ = stacked_experts(moe)
    assert stacked_experts(moe)[0] is gate_up  # made once
    assert gate_up.shape[0] == down.shape[0] == len(moe.experts)
    for e, expert in enumerate(moe.experts):
        assert getattr(expert.gate_up_proj, name).data_ptr() == gate_up[e].data_ptr()
        assert getattr(expert.down_proj, name).data_ptr() == down[e].data_ptr()
    if source == "gguf_q8_0":  # already one stack: viewed, not copied
        assert before == [gate_up[e].data_ptr() for e in range(len(moe.experts))]


def test_k_quant_experts_are_kquant_modules_holding_the_files_values():
    # As Q4_K_M files store them: experts Q4_K, down projections Q6_K, the router F32.
    path = kquant_gguf("qwen3_moe_k", {"ffn_down_exps": QType.Q6_K, "ffn_gate_inp": QType.F32})
    kept, ref = load_gguf_native(path, backend="aten"), load_model(path)  # aten: K-quants dequantize exactly
    for layer in range(2):
        for e in (0, 3):
            for name, kind in (("gate_up_proj", "q4_k"), ("down_proj", "q6_k")):
                m = kept.get_submodule(f"layers.{layer}.mlp.experts.{e}.{name}")
                w = ref.get_submodule(f"layers.{layer}.mlp.experts.{e}.{name}").weight
                assert isinstance(m, KQuantLinear) and m.kind == kind
                assert torch.equal(m(torch.eye(w.shape[1])).T, w)
    # Loaded for the native kernels, each layer's experts are packed as one matrix: expert e's slice holds exactly
    # the tiles its own tensors pack into.
    stacked = load_model(path, quant="gguf")
    per_expert, _ = expert_tensors(GGUFFile(path))
    for layer, e in ((0, 0), (1, 3)):
        name = f"layers.{layer}.mlp.experts.{e}"
        pack = lambda proj, kind: KQuantLinear(block_tensors(per_expert[f"{name}.{proj}.weight"])["blocks"],  # noqa
                                               kind).qweight
        assert torch.equal(stacked.get_submodule(f"{name}.gate_up_proj").qweight,
                           torch.cat([pack("gate_proj", "q4_k"), pack("up_proj", "q4_k")]))
        assert torch.equal(stacked.get_submodule(f"{name}.down_proj").qweight, pack("down_proj", "q6_k"))
    tokens = torch.tensor([PROMPT])
    expected, out = logits(ref, tokens), logits(stacked, tokens)
    assert (out - expected).norm() / expected.norm() < 0.05  # native kernels round activations to int8 per block


def test_each_routed_expert_runs_once_over_all_its_rows_and_the_rest_never():
    model = load_model(checkpoint("qwen3_moe").hf_dir)
    moe: SparseMoE = model.layers[1].mlp
    x = torch.randn(1, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))  # 6 choices of 8
    calls = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, args, out, e=e: calls.setdefault(e, []).append(args[0].shape[0]))
    with torch.no_grad():
        moe(x)
        _, experts = moe.route(x.reshape(-1, x.shape[-1]))
    routed = torch.bincount(experts.flatten(), minlength=len(moe.experts))
    assert calls == {e: [int(n)] for e, n in enumerate(routed) if n}
    assert len(calls) < len(moe.experts)  # some expert was skipped, so the check above means something


def test_quantize_model_leaves_the_router_float_and_quantizes_every_expert():
    model = quantize_model(load_model(checkpoint("qwen3_moe").hf_dir), "int8")
    moe = model.layers[0].mlp
    assert type(moe.gate) is Router
    assert all(isinstance(e.gate_up_proj, Int8Linear) and isinstance(e.down_proj, Int8Linear) for e in moe.experts)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_engine_greedy_output_equals_transformers_generate_or_runs_alone(quantized):
    ckpt = quantized_checkpoint("qwen3_moe") if quantized else checkpoint("qwen3_moe")
    llm = LLM(str(ckpt.gguf_path), max_seq_len=128, kv_dtype="float32")
    assert llm.decode_path == "native"  # decode_step.cpp's MoE block
    prompts = ["def f(x):", "return [a, b]"]
    # Submitted together, the engine runs both sequences' rows through one forward per step.
    params = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        if quantized:  # int8 activations (as llama.cpp's Q8_0): the reference is the request run alone
            assert out.token_ids == llm.generate([prompt], params)[0].token_ids
            continue
        ids = llm.encode_prompt(prompt)
        with torch.inference_mode():
            ref = ckpt.model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS,
                                      min_new_tokens=GREEDY_TOKENS, do_sample=False)
        assert out.token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("speculate", ["auto", "layerskip"])
def test_speculation_on_moe_is_lossless(speculate):
    """Verify steps route several rows at once (more experts per step); greedy tokens must equal plain decoding on
    the same path (the engine's native runner). auto: the model-free drafters; layerskip: the target's first layers
    as the drafter."""
    path = str(quantized_checkpoint("qwen3_moe").gguf_path)
    prompts = ["def f(x):\n    return x + 1\n\ndef f(x):", "a b c a b c a b"]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)
    plain = LLM(path, max_seq_len=128, speculate="none")
    spec = LLM(path, max_seq_len=128, speculate=speculate)
    assert spec.decode_path == "native"
    for prompt in prompts:
        assert spec.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("shared_expert_intermediate_size", 64), ("n_shared_experts", 1),
                                       ("first_k_dense_replace", 1)])
def test_config_with_another_familys_moe_layout_is_refused_in_one_line(tmp_path, key, value):
    shutil.copytree(checkpoint("qwen3_moe").hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(UnsupportedModelError, match=key) as err:
        load_model(tmp_path / "m")
    assert "\n" not in str(err.value)


def test_gguf_with_shared_experts_is_refused_in_one_line():
    meta = {**GGUFFile(checkpoint("qwen3_moe").gguf_path).metadata, "qwen3moe.expert_shared_count": 1}
    with pytest.raises(UnsupportedModelError, match="shared experts") as err:
        ModelConfig.from_gguf(meta)
    assert "\n" not in str(err.value)


def test_other_moe_architectures_are_refused_by_name(tmp_path):
    shutil.copytree(checkpoint("qwen3_moe").hf_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="Qwen2MoeForCausalLM"):
        load_model(tmp_path / "m")
