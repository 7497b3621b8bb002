"""The C++ decode step against the PyTorch forward, on every tiny family checkpoint."""
import pytest
import torch

from fastdecode.engine.generate import decode_one_token, prefill
from fastdecode.kernels import native_ops
from fastdecode.kernels.decoder import NativeDecoder, native_decoder
from fastdecode.loading import load_model
from tests.helpers.checkpoints import SPECS, checkpoint, prompt_tokens

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable on this machine")
PROMPT = prompt_tokens(20)
STEPS = 12


def run(model, decode):
    """Greedy decode from PROMPT, returning the logits of every step."""
    logits, out = prefill(model, PROMPT), []
    token = torch.empty((1, 1), dtype=torch.long)
    for i in range(STEPS):
        token[0, 0] = int(logits.argmax())
        logits = decode(token, len(PROMPT) + i)
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("name", list(SPECS))
def test_native_decode_equals_pytorch_forward(name):
    model = load_model(checkpoint(name).hf_dir)
    model.setup_cache(64)
    decoder = native_decoder(model)
    assert decoder is not None
    ours = run(model, decoder)
    reference = run(model, lambda t, p: decode_one_token(model, t, p))
    assert (ours - reference).abs().max().item() <= 1e-4


def test_native_decoder_follows_a_replaced_cache():
    model = load_model(checkpoint("llama").hf_dir)
    model.setup_cache(64)
    decoder = native_decoder(model)
    model.setup_cache(48)  # e.g. a new max_seq_len: the decoder must write into the new cache
    ours = run(model, decoder)
    reference = run(model, lambda t, p: decode_one_token(model, t, p))
    assert (ours - reference).abs().max().item() <= 1e-4


def test_bfloat16_models_are_left_to_pytorch():
    model = load_model(checkpoint("llama").hf_dir, dtype=torch.bfloat16)
    model.setup_cache(32)
    assert not NativeDecoder.supports(model)
