"""The C++ step (the native runner over the paged cache) against the PyTorch forward over its static cache (the
reference), on every tiny family checkpoint."""
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from fastdecode.config import ModelConfig
from fastdecode.engine.kv_cache import BlockTable, KVCache
from fastdecode.kernels import native_ops
from fastdecode.loading import load_model
from fastdecode.models.transformer import Transformer
from fastdecode.quant import KQuantLinear, quantize_model
from fastdecode.quant.split import RowSplitLinear
from fastdecode.runners.native import NativeRunner
from fastdecode.runners.pytorch import TorchRunner
from fastdecode.speculative.draft import Draft
from tests.helpers.checkpoints import SPECS, VOCAB_SIZE, checkpoint, kquant_gguf, prompt_tokens
from tests.helpers.paged import paged, run, tree_batch

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable on this machine")
PROMPT = prompt_tokens(20)
STEPS = 12


def greedy(prefill, decode, prompt=PROMPT, steps=STEPS) -> tuple[list[int], torch.Tensor]:
    """prefill(prompt) -> last logits; decode(token, pos) -> logits. Greedy decoding from the prompt -> (the tokens
    fed to the steps, the logits of every step (steps, vocab))."""
    logits, tokens, out = prefill(prompt), [], []
    for i in range(steps):
        tokens.append(int(logits.argmax()))
        logits = decode(tokens[-1], len(prompt) + i)
        out.append(logits)
    return tokens, torch.stack(out)


def native_steps(model, ops=None, prompt=PROMPT, steps=STEPS, torch_prompt: bool = False
                 ) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding by the native runner (`ops`: a build of the kernels; default the package's): the prompt in one
    forward (torch_prompt: by the PyTorch runner, into the same cache), then one forward a step, over one block table
    of a paged cache."""
    if ops is None:
        runner, kv = paged(model, "native")
    else:
        model.setup_rope(256)
        kv = KVCache.for_model(model.config, 128, block_size=8)
        runner = NativeRunner(model, ops, kv)
    prompt_runner = TorchRunner(model, kv) if torch_prompt else runner
    table = BlockTable()
    return greedy(lambda p: run(prompt_runner, kv, [(table, 0, p)])[0][-1],
                  lambda t, pos: run(runner, kv, [(table, pos, [t])])[0][0], prompt, steps)


@torch.inference_mode()
def reference_steps(model, prompt=PROMPT, steps=STEPS, tokens: list[int] | None = None) -> torch.Tensor:
    """The PyTorch forward over its static cache: greedy decoding from the prompt (or, given `tokens`, teacher-forced
    on them) -> the logits of every step (steps, vocab)."""
    model.setup_cache(len(prompt) + steps)

    def prefill(p):
        return model(torch.tensor([p]), 0)[0, -1]

    def decode(t, pos):
        return model(torch.tensor([[t]]), pos)[0, -1]

    if tokens is not None:
        prefill(prompt)
        return torch.stack([decode(t, len(prompt) + i) for i, t in enumerate(tokens)])
    return greedy(prefill, decode, prompt, steps)[1]


@pytest.mark.parametrize("name", list(SPECS))
def test_native_decode_equals_pytorch_forward(name):
    model = load_model(checkpoint(name).hf_dir)
    _, ours = native_steps(model)
    reference = reference_steps(model)
    assert (ours - reference).abs().max().item() <= 1e-4


def test_bfloat16_models_are_left_to_pytorch():
    model = load_model(checkpoint("llama").hf_dir, dtype=torch.bfloat16)
    model.setup_rope(32)
    kv = KVCache.for_model(model.config, 32, torch.float32, block_size=8)  # a cache the native step takes
    assert NativeRunner.build(model, kv) is None
    float_model = load_model(checkpoint("llama").hf_dir)
    float_model.setup_rope(32)
    assert NativeRunner.build(float_model, kv) is not None  # the weights' type alone made it decline


# Vector attention holding 2 or 8 registers, and the plain loops (head sizes whose o_proj the int4 kernel takes);
# one, two and three query heads per KV head (queries of a group are scored in pairs); prompts inside one
# block of keys, across several (32 keys a block) and across chunks (256 keys a chunk, whose partial results fold;
# the verified tokens at 254..257 straddle a chunk boundary);
# a sliding window shorter than the prompt on one of two layers (queries of one step then see different first keys).
@pytest.mark.parametrize("heads,head_dim", [(4, 16), (2, 64), (4, 64), (6, 64), (16, 12)])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("prompt_len,window", [(20, None), (75, None), (75, 40), (254, None), (254, 150)])
def test_verify_step_reproduces_decode_steps_bit_for_bit(heads, head_dim, tree, prompt_len, window):
    """Speculation is only lossless if verifying tokens together gives each the logits of decoding it alone."""
    torch.manual_seed(0)
    config = ModelConfig(family="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim, sliding_window=window,
                         layer_types=["sliding_attention", "full_attention"] if window else [])
    assert_verify_reproduces_decode(quantize_model(Transformer(config).eval(), "int4"), prompt_tokens(prompt_len), tree)


def assert_verify_reproduces_decode(model, prompt: list[int], tree: bool):
    """Four decode steps after `prompt`, then the same path verified in one step (as a chain, or inside a tree with
    rejected siblings) over the same cached prompt: the kept rows' logits equal the steps' bit for bit."""
    runner, kv = paged(model, "native", blocks=(len(prompt) + 8) // 16 + 2, block_size=16,
                       positions=len(prompt) + 8)
    path = [5, 9, 2, 7]
    table = BlockTable()
    run(runner, kv, [(table, 0, prompt)])
    steps = torch.stack([run(runner, kv, [(table, len(prompt) + i, [t])])[0][0] for i, t in enumerate(path)])
    tokens, parents = (path, [-1, 0, 1, 2]) if not tree else ([5, 11, 9, 2, 3, 7], [-1, 0, 0, 2, 2, 3])
    keep = [0, 2, 3, 5] if tree else [0, 1, 2, 3]
    draft = Draft(tokens[1:], [p - 1 for p in parents[1:]], [1.0] * (len(tokens) - 1))
    ids, positions, mask = draft.tree_inputs(tokens[0], len(prompt))
    assert (mask is None) == (not tree)
    with torch.inference_mode():  # over the steps' rows in the cache, as the engine's verify step writes its tree
        hidden = runner.forward(tree_batch(kv, table, len(prompt), ids, positions, mask))
    assert torch.equal(model.head(hidden)[keep], steps)


# A GGUF of K-quants as a Q4_K_M file mixes them (see tests/loading/test_gguf_native.py): Q4_K, Q5_K, Q6_K matrices
# run on kq_linear inside the C++ step.
K_TYPES = {"attn_v": QType.Q6_K, "attn_output": QType.Q5_K, "ffn_down": QType.Q6_K, "output": QType.Q6_K}


def test_native_decode_of_k_quants_equals_their_pytorch_forward():
    model = load_model(kquant_gguf("llama_k", K_TYPES), quant="gguf")
    assert isinstance(model.layers[0].mlp.down_proj, KQuantLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj, RowSplitLinear)  # Q4_K q/k, Q6_K v
    # paged() asserts the runner is built: every K-quant module is one the step runs, the two-format q/k/v too.
    # The prompt goes through PyTorch's modules, as the reference's does: the steps alone are compared.
    _, ours = native_steps(model, torch_prompt=True)
    reference = reference_steps(model)
    # The same kernels on the same activations, but the attention sums in another order, and a 1e-7 difference can
    # flip one activation's int8 rounding in a linear that quantizes them (all of them here): that step's logits
    # then move by about 1e-2 (one step in 12 on this model).
    steps = (ours - reference).abs().reshape(STEPS, -1).amax(-1)
    assert (steps <= 1e-4).sum() >= STEPS - 2 and steps.max() < 0.1
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    # With the prompt's cache computed by the native step too, such flips come more often (a prompt row's keys
    # and values carry them into every step), but the greedy tokens hold.
    _, all_native = native_steps(model)
    assert torch.equal(all_native.argmax(-1), reference.argmax(-1))


def test_native_decode_of_k_quants_stays_near_the_dequantized_float_model():
    path = kquant_gguf("llama_k", K_TYPES)  # nothing requantized: q/k/v in two parts, each the file's blocks
    model, float_model = load_model(path, quant="gguf"), load_model(path)
    tokens, ours = native_steps(model)
    # Teacher-forced on our tokens, so that one flipped token does not change every later step's context.
    reference = reference_steps(float_model, tokens=tokens)
    assert (ours - reference).norm() / reference.norm() < 0.05
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("tree", [False, True])
def test_verify_step_of_k_quants_reproduces_decode_steps_bit_for_bit(tree):
    assert_verify_reproduces_decode(load_model(kquant_gguf("llama_k", K_TYPES), quant="gguf"), prompt_tokens(20), tree)
