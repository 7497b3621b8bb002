"""Trained drafter heads (EAGLE-3 style, multi-token prediction): lossless with chains and dynamic trees, refused
for another target, and trainable (loss falls, training resumes from its checkpoint)."""
from pathlib import Path

import pytest
import torch

from fastdecode.engine.kv_cache import BlockTable
from fastdecode.engine.sampling import SamplingParams
from fastdecode.errors import InvalidRequestError
from fastdecode.kernels import native_ops
from fastdecode.layers.rotary import rope_cache
from fastdecode.speculative.eagle.drafter import EagleDrafter, MTPDrafter
from fastdecode.speculative.eagle.features import sequence_taps
from fastdecode.speculative.eagle.head import build_head, head_config_for, init_from_target, load_head, save_head
from fastdecode.train.trainer import Target, TrainOptions, fit
from tests.helpers.paged import run, tree_batch
from tests.speculative.helpers import plain_tokens, run_requests, speculative_tokens, speculator, tiny_target

native = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 3], list(range(10, 40))]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def random_head(model, kind="eagle", seed=0):
    """An untrained head whose draft vocabulary is the whole tiny vocabulary (its drafts are often wrong)."""
    torch.manual_seed(seed)
    cfg = head_config_for(model, kind, "tiny", draft_vocab_size=model.config.vocab_size)
    head = build_head(cfg)
    init_from_target(head, model.norm.weight, model.embed_tokens.weight, torch.arange(cfg.draft_vocab_size))
    return head.eval().requires_grad_(False), cfg


def head_drafters(model, kind, tree, seed=0):
    """-> (a maker of one request's drafters: one over a random head, the target layers it reads), as
    eagle.head_drafters binds a trained one."""
    head, cfg = random_head(model, kind, seed)
    if kind == "mtp":
        return (lambda: [MTPDrafter(head, cfg, model, top_k=3 if tree else 1)]), cfg.taps
    c = model.config
    rope = rope_cache(cfg.head_dim, model.max_seq_len + 64, c.rope_theta, c.rope_scaling)
    return (lambda: [EagleDrafter(head, cfg, model, rope, top_k=4 if tree else 1, depth=4, min_score=0.0)]), cfg.taps


@pytest.mark.parametrize("runner_name", [pytest.param("native", marks=native), "pytorch"])
def test_taps_leave_the_verify_logits_bit_identical(runner_name):
    """A verify step (a token tree over a cached prefix) with the taps kept on the way gives the plain forward's
    logits bit for bit, and the taps are the residuals after those layers."""
    model, runner = tiny_target(quant="int4" if runner_name == "native" else None, native=runner_name == "native")
    kv, table, D = runner.kv, BlockTable(), model.config.hidden_size
    run(runner, kv, [(table, 0, list(range(20, 30)))])  # 10 tokens cached before the tree
    tokens, positions = [3, 7, 1, 9], torch.arange(10, 14)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    batch = tree_batch(kv, table, 10, tokens, positions, mask)
    with torch.inference_mode():
        plain = model.head(runner.forward(batch))
        tapped, taps = runner.forward_taps(batch, [0, 1])
        first_layer = runner.forward(batch, stop=1)
    assert torch.equal(plain, model.head(tapped))
    assert taps.shape == (4, 2 * D)
    assert model.config.num_hidden_layers == 2  # so the residual after layer 1 is the final hidden state
    assert torch.equal(taps[:, :D], first_layer) and torch.equal(taps[:, D:], tapped)


@native
@pytest.mark.parametrize("kind, tree, adaptive", [("eagle", False, False), ("eagle", True, False),
                                                  ("eagle", True, True), ("mtp", False, False), ("mtp", True, True)])
def test_greedy_output_with_a_head_equals_plain_decoding(kind, tree, adaptive):
    model, runner = tiny_target()
    make, taps = head_drafters(model, kind, tree)
    expected = [plain_tokens(model, runner, prompt, GREEDY) for prompt in PROMPTS]
    for prompt, want in zip(PROMPTS, expected):
        got, stats = speculative_tokens(model, runner, make, prompt, GREEDY, adaptive, taps=taps)
        assert got == want
    if not adaptive:
        assert stats.verify_steps > 0
    # Both requests in one batch: each one's drafter gets its own rows' taps.
    together = run_requests(model, runner, PROMPTS, GREEDY, speculator(make, adaptive, taps=taps))
    assert [got for got, _ in together] == expected
    if not adaptive:
        assert all(stats.verify_steps > 0 for _, stats in together)


def test_pytorch_runner_with_a_head_is_lossless():
    model, runner = tiny_target(quant=None, native=False)
    make, taps = head_drafters(model, "eagle", tree=True)
    for prompt in PROMPTS[:1]:
        expected = plain_tokens(model, runner, prompt, GREEDY)
        got, stats = speculative_tokens(model, runner, make, prompt, GREEDY, taps=taps)
        assert got == expected and stats.drafted > 0


@native
def test_sampling_with_a_head_reproduces_plain_sampling_for_a_seed():
    """The head drafts deterministically (one-hot q), so verification draws from the same distributions in the same
    order as plain decoding (as for the oracle in test_rejection.py): the same seed gives the same tokens."""
    model, runner = tiny_target()
    make, taps = head_drafters(model, "eagle", tree=True)
    for seed in range(2):
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        expected = plain_tokens(model, runner, PROMPTS[0], params)
        got, stats = speculative_tokens(model, runner, make, PROMPTS[0], params, taps=taps)
        assert got == expected and stats.drafted > 0


def test_a_head_for_another_target_is_refused(tmp_path):
    model, _ = tiny_target(quant=None, native=False)
    other, _ = tiny_target(quant=None, native=False, seed=5)
    head, cfg = random_head(model)
    save_head(head, cfg, tmp_path)
    load_head(tmp_path, model)  # its own target loads
    with pytest.raises(InvalidRequestError, match="trained for tiny"):
        load_head(tmp_path, other)
    with pytest.raises(InvalidRequestError, match="no drafter head"):
        load_head(tmp_path / "missing", model)


def tiny_data(model, runner, n=8, T=48):
    """The target's own greedy continuations of random prompts, teacher-forced: (ids, taps, preds) windows."""
    g = torch.Generator().manual_seed(0)
    ids, taps, preds = [], [], []
    for _ in range(n):
        prompt = torch.randint(0, model.config.vocab_size, (8,), generator=g).tolist()
        seq = prompt + plain_tokens(model, runner, prompt, SamplingParams(max_tokens=T - 8, ignore_eos=True))
        t, p = sequence_taps(model, seq, [0, 1])
        ids.append(torch.tensor(seq, dtype=torch.int32))
        taps.append(t)
        preds.append(p.to(torch.int32))
    return {"ids": torch.stack(ids), "taps": torch.stack(taps), "preds": torch.stack(preds)}


OPTS = dict(model="tiny", window=48, steps=3, batch=4, lr=3e-3, checkpoint_every=4, holdout=0.2, epochs=4)


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_training_reduces_the_loss(tmp_path: Path, kind):
    model, runner = tiny_target(quant=None, native=False)
    cfg = head_config_for(model, kind, "tiny", draft_vocab_size=96, mtp_depth=3)
    summary = fit(TrainOptions(out=tmp_path, kind=kind, **OPTS), cfg, Target.of(model), tiny_data(model, runner),
                  Quiet(), lambda *a: None)
    assert summary["final_loss"] < 0.85 * summary["first_loss"]


def test_interrupted_training_resumes_to_the_same_head(tmp_path: Path):
    model, runner = tiny_target(quant=None, native=False)
    data, target = tiny_data(model, runner), Target.of(model)
    cfg = lambda: head_config_for(model, "eagle", "tiny", draft_vocab_size=96)  # noqa: E731
    fit(TrainOptions(out=tmp_path / "whole", **OPTS), cfg(), target, data, Quiet(), lambda *a: None)
    with pytest.raises(KeyboardInterrupt):  # interrupted after 6 steps: the checkpoint holds step 4
        fit(TrainOptions(out=tmp_path / "cut", **OPTS), cfg(), target, data, Quiet(stop_after=6), lambda *a: None)
    (tmp_path / "cut").rename(tmp_path / "moved")  # where a run writes is not one of its settings
    lines = []
    fit(TrainOptions(out=tmp_path / "moved", **OPTS), cfg(), target, data, Quiet(), lines.append)
    assert any("resumed" in line and "step 4/" in line for line in lines)
    resumed, _ = load_head(tmp_path / "moved", model)
    uninterrupted, _ = load_head(tmp_path / "whole", model)
    for (name, a), b in zip(resumed.state_dict().items(), uninterrupted.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


class Quiet:
    """A stand-in for rich's Progress; stop_after interrupts training like Ctrl-C after that many steps."""

    def __init__(self, stop_after: int | None = None):
        self.stop_after, self.updates = stop_after, 0

    def add_task(self, *a, **kw):
        return 0

    def update(self, *a, **kw):
        self.updates += 1
        if self.updates == self.stop_after:
            raise KeyboardInterrupt

    def advance(self, *a, **kw):
        pass


def test_a_long_prompts_taps_go_into_the_head_as_they_come():
    """Past EAGER_ROWS, the prompt's taps enter the head's cache chunk by chunk instead of waiting for the first
    draft: the draft is the one a drafter that took them all at once makes, and pending taps stay bounded."""
    model, _ = tiny_target(quant=None, native=False)
    make, layers = head_drafters(model, "eagle", tree=True)
    prompt = list(range(3, 43))
    taps = torch.randn(len(prompt), len(layers) * model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    lazy, eager = make()[0], make()[0]
    eager.EAGER_ROWS = 8
    for drafter in (lazy, eager):
        drafter.start(prompt, GREEDY)
        most = 0
        for pos in range(0, len(prompt), 6):  # prompt chunks of 6 rows
            drafter.observe_features(pos, taps[pos:pos + 6])
            most = max(most, drafter.pending_rows())
        assert most <= (len(prompt) if drafter is lazy else 8 + 6)
    with torch.inference_mode():
        a, b = lazy.propose(prompt, 8), eager.propose(prompt, 8)
    assert a.tokens == b.tokens and a.parents == b.parents
    # the head's cache holds the same entries (the draft alone could not tell: this random head is sure of itself)
    assert lazy.real == eager.real == len(prompt) - 1
    real = lazy.real - lazy.base
    for x, y in ((lazy.k, eager.k), (lazy.v, eager.v), (lazy.last, eager.last)):
        assert torch.allclose(x[..., :real, :] if x.dim() == 4 else x, y[..., :real, :] if y.dim() == 4 else y,
                              atol=1e-5)


def test_an_mtp_head_keeps_only_the_last_tap():
    model, _ = tiny_target(quant=None, native=False)
    make, layers = head_drafters(model, "mtp", tree=False)
    drafter = make()[0]
    drafter.start(list(range(3, 23)), GREEDY)
    taps = torch.randn(20, len(layers) * model.config.hidden_size)
    for pos in range(0, 20, 5):
        drafter.observe_features(pos, taps[pos:pos + 5])
    assert drafter.pending_rows() == 1 and drafter.pending[0][0] == 19
    assert torch.equal(drafter.pending[0][1], taps[19:])
