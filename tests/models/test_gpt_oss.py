"""gpt-oss against transformers' GptOssForCausalLM: attention sinks, alternating windowed layers, YaRN, router and
expert biases and the clamped SwiGLU, from safetensors (float, and MXFP4 blocks kept in Fp4Linear) and GGUF (F32 and
MXFP4 experts); MXFP4 decoding equal to both references bit for bit; unsupported layouts refused in one line.
YaRN's tables are tests/layers/test_rotary.py's."""
import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from fastdecode import LLM, SamplingParams
from fastdecode.config import ModelConfig
from fastdecode.errors import UnsupportedModelError
from fastdecode.loading import load_model
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_loader import block_tensors
from fastdecode.loading.gguf_native import ModuleLoader
from fastdecode.loading.gpt_oss import split_gate_up
from fastdecode.quant.fp4 import Fp4Linear
from fastdecode.runners.native_layers import model_supported
from tests.helpers.checkpoints import max_diff, our_run, prompt_tokens, reference_run, single_thread
from tests.helpers.gpt_oss import build, gguf_checkpoint, hf_checkpoint
from tests.kernels.test_decoder import native_steps, reference_steps

PROMPT = prompt_tokens(24)
STEPS = 32
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def checkpoint(kind: str):
    return {"hf": lambda: hf_checkpoint(False), "hf_mxfp4": lambda: hf_checkpoint(True),
            "gguf": lambda: gguf_checkpoint(), "gguf_mxfp4": lambda: gguf_checkpoint("MXFP4")}[kind]()


def float_activations(model):
    """Each MXFP4 expert on the dequantizing backend: the file's values times float activations, transformers'
    arithmetic (the native kernel rounds activations to int8 per block, as llama.cpp does)."""
    for block in model.layers:
        for e in block.mlp.experts:
            for name in ("gate_up_proj", "down_proj"):
                m = getattr(e, name)
                qweight, scales = m.codes()
                setattr(e, name, Fp4Linear("mxfp4", {"qweight": qweight, "scales": scales}, m.bias, "dequant"))


@pytest.mark.parametrize("kind", ["hf", "hf_mxfp4", "gguf", "gguf_mxfp4"])
def test_prefill_and_cached_decode_match_transformers(kind):
    ref_model, path = checkpoint(kind)
    model = load_model(path, quant="gguf" if kind == "gguf_mxfp4" else None)
    assert model_supported(model)  # the native step takes gpt-oss: sinks, clamped SwiGLU, softmax after the top-k
    ref = reference_run(ref_model, PROMPT, STEPS)
    if kind.endswith("mxfp4"):  # the experts hold the file's MXFP4 bytes, for the native kernel
        assert all(type(e.gate_up_proj) is Fp4Linear and e.gate_up_proj.backend == "native"
                   for block in model.layers for e in block.mlp.experts)
        # Activations rounded to int8 per block of 32 (as llama.cpp): 2-3% of the logits' norm a position on this
        # model, whose gate/up values reach the SwiGLU clamp, and where a rounding flips a near tie in a router's
        # top 4, more (one prompt position: 22%). The greedy tokens hold.
        ours = our_run(model, PROMPT, STEPS)
        for a, b in ((ours.prefill_logits, ref.prefill_logits), (ours.step_logits, ref.step_logits)):
            assert (a - b).norm() / b.norm() < 0.08
        assert ours.tokens == ref.tokens
        float_activations(model)
    ours = our_run(model, PROMPT, STEPS)
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= ATOL
    assert max_diff(ours.step_logits, ref.step_logits) <= ATOL
    assert ours.tokens == ref.tokens


@pytest.mark.parametrize("kind", ["gguf", "gguf_mxfp4"])
def test_native_step_equals_the_pytorch_forward(kind):
    """decode_step.cpp's sinks, clamped SwiGLU and softmax after the top-k against the modules' own forward."""
    model = load_model(checkpoint(kind)[1], quant="gguf")
    # The native runner over a paged cache (built: paged() asserts it), prompt and steps, against the static-cache
    # forward.
    _, ours = native_steps(model)
    reference = reference_steps(model)
    if kind == "gguf":
        assert max_diff(ours, reference) <= ATOL
    else:  # the same kernel on inputs an ulp apart (attention sums in another order): int8 roundings may differ
        assert (ours - reference).norm() / reference.norm() < 0.01


def test_sinks_and_window_matter():
    # Zero sinks or no window would change the logits: the test above pins both.
    ref_model, path = hf_checkpoint(False)
    model = load_model(path)
    base = our_run(model, PROMPT, 1).prefill_logits
    for block in model.layers:
        block.self_attn.sinks.data.zero_()
    assert max_diff(our_run(model, PROMPT, 1).prefill_logits, base) > 1e-3
    assert model.config.layer_types[0] == "sliding_attention" and model.config.sliding_window < len(PROMPT)


def test_gguf_q8_0_experts_load_as_views_of_one_stack_with_their_biases(monkeypatch):
    """Experts in a kept native format pack as one matrix per layer and projection; each expert's module is a view
    of it and must still carry its own bias rows (gpt-oss's experts have biases)."""
    ref_model, path = gguf_checkpoint("Q8_0")
    model = load_model(path, quant="gguf")
    experts = model.layers[1].mlp.experts
    assert experts[1].gate_up_proj.qweight.untyped_storage().data_ptr() == \
        experts[0].gate_up_proj.qweight.untyped_storage().data_ptr()
    ref = ref_model.model.layers[1].mlp.experts
    I = ref.down_proj.shape[1]
    for e in (0, len(experts) - 1):
        gate_up_bias = torch.cat([ref.gate_up_proj_bias[e, 0::2], ref.gate_up_proj_bias[e, 1::2]])
        assert torch.equal(experts[e].gate_up_proj.bias, gate_up_bias) and experts[e].gate_up_proj.out_features == 2 * I
        assert torch.equal(experts[e].down_proj.bias, ref.down_proj_bias[e])
    monkeypatch.setattr(ModuleLoader, "expert_stack", lambda *args: None)  # every expert packed on its own
    alone = load_model(path, quant="gguf")
    assert torch.equal(our_run(model, PROMPT, 8).step_logits, our_run(alone, PROMPT, 8).step_logits)


@pytest.mark.parametrize("kind", ["gguf", "gguf_mxfp4"])
def test_engine_greedy_output_equals_transformers_generate_or_runs_alone(kind):
    ref_model, path = checkpoint(kind)
    llm = LLM(str(path), max_seq_len=64, kv_dtype="float32")
    assert llm.decode_path == "native"
    prompts = ["def f(x):", "return [a, b]"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)  # one forward per step for both sequences
    for prompt, out in zip(prompts, outs):
        if kind == "gguf_mxfp4":  # int8 activations (as llama.cpp's): the reference is the request run alone
            assert out.token_ids == llm.generate([prompt], params)[0].token_ids
            continue
        # transformers' cached greedy decode (generate's min_new_tokens would mask the EOS token these pick)
        assert out.token_ids == reference_run(ref_model, llm.encode_prompt(prompt), 23).tokens


@pytest.mark.parametrize("speculate", ["auto", "layerskip"])
def test_speculation_on_gpt_oss_is_lossless(speculate):
    """Verify steps route several rows at once through the MXFP4 experts; greedy tokens equal plain decoding."""
    path = str(checkpoint("gguf_mxfp4")[1])
    prompts = ["def f(x):\n    return x + 1\n\ndef f(x):", "a b c a b c a b"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = LLM(path, max_seq_len=128, speculate="none")
    spec = LLM(path, max_seq_len=128, speculate=speculate)
    assert spec.decode_path == "native"
    for prompt in prompts:
        assert spec.generate([prompt], params)[0].token_ids == plain.generate([prompt], params)[0].token_ids


# ---- MXFP4, exactly ---------------------------------------------------------------------------------------
def random_mxfp4(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, shape, generator=g, dtype=torch.uint8)  # 2^-27 .. 2^22
    return blocks, scales


def test_safetensors_mxfp4_experts_decode_as_transformers_bit_for_bit():
    blocks, scales = random_mxfp4((2, 6, 3))  # (E, out, in / 32)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # (E, out, in)
    for e in range(2):
        for split in (False, True):  # down_proj as is; gate_up_proj's interleaved rows regrouped
            f = split_gate_up if split else (lambda t: t)
            m = Fp4Linear("mxfp4", {"qweight": f(blocks[e].flatten(1)), "scales": f(scales[e])}, None)
            assert torch.equal(m.dequantize(), f(expected[e]))


def test_gguf_mxfp4_blocks_decode_as_gguf_py_bit_for_bit():
    g = np.random.default_rng(0)
    raw = quantize(g.standard_normal((5, 96)).astype(np.float32) * 10.0 ** g.integers(-8, 8, (5, 1)), QType.MXFP4)
    raw[:, ::17] = g.integers(1, 254, raw[:, ::17].shape)  # any scale byte but NaN's (255)
    t = type("T", (), {"shape": (5, 96), "type": QType.MXFP4, "data": raw})
    m = Fp4Linear("mxfp4", block_tensors(t), None)
    assert torch.equal(m.dequantize(), torch.from_numpy(dequantize(raw, QType.MXFP4).reshape(5, 96)))


def test_config_reads_gpt_oss_from_config_json_and_gguf():
    hf = ModelConfig.from_hf(build().config.to_dict())
    gg = ModelConfig.from_gguf(GGUFFile(gguf_checkpoint()[1]).metadata)
    for c in (hf, gg):
        assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("gpt_oss", 8, 4, 64)
        assert c.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
        assert (c.sliding_window, c.swiglu_limit, c.attention_bias) == (4, 7.0, True)
        assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False


# ---- refusals ------------------------------------------------------------------------------------------------
def test_experts_quantized_another_way_are_refused_in_one_line(tmp_path):
    shutil.copytree(hf_checkpoint(False)[1], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="bitsandbytes") as err:
        load_model(tmp_path / "m")
    assert "\n" not in str(err.value)
