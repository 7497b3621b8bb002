"""A tiny target on the engine (native runner, int4: bit-exact across verify sizes), an oracle drafter, and plain/
speculative runs of it: several requests at once through one engine step loop, as the server runs them."""
import random

import torch

from fastdecode.engine.engine import Engine
from fastdecode.engine.sampling import SamplingParams
from fastdecode.engine.scheduler import SchedulerConfig
from fastdecode.quant import quantize_model
from fastdecode.speculative.batch import BatchSpeculator
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter
from fastdecode.speculative.policy import CostModel, Policy
from fastdecode.speculative.stats import SpeculationStats
from tests.helpers.paged import paged
from tests.helpers.tiny import tiny_model


def flat_cost() -> CostModel:
    """Every verify size costs the same: the adaptive policy drafts whenever a draft is likely at all."""
    return CostModel([1, 64], [1.0, 1.0])


def tiny_target(quant: str | None = "int4", native: bool = True, seed: int = 0, max_seq_len: int = 256):
    """-> (model, runner over a paged cache of its own, room for a few sequences of max_seq_len)."""
    model = tiny_model(tied=False)
    if seed:
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0, 0.2)
    else:
        for p in model.parameters():  # sharper logits than the default init, so greedy decoding has real choices
            p.data.mul_(4.0)
    if quant:
        quantize_model(model, quant)
    runner, _ = paged(model, "native" if native else "pytorch", blocks=8 * max_seq_len // 32, block_size=32,
                      positions=max_seq_len)
    return model, runner


def run_requests(model, runner, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 speculator: BatchSpeculator | None = None, stop=(), max_seq_len: int = 256):
    """All prompts at once through one engine (driven here, no thread) -> [(output tokens, SpeculationStats or
    None)] in the prompts' order."""
    engine = Engine(model, runner.kv, runner, max_seq_len, SchedulerConfig(max_batch=len(prompts)), speculator,
                    background=False)
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, q, stop_ids=set(stop)) for p, q in zip(prompts, params)]
    while engine.pump():
        pass
    for seq in seqs:
        kinds = []
        while not seq.outbox.empty():
            kinds.append(seq.outbox.get()[0])
        assert "error" not in kinds and seq.finished, f"a request did not finish cleanly: {kinds}"
    return [(seq.tokens[len(seq.prompt_ids):], seq.speculation.stats if seq.speculation else None) for seq in seqs]


def speculator(make_drafters, adaptive: bool = False, cost: CostModel | None = None, chain=None, taps=None,
               name: str = "test") -> BatchSpeculator:
    """make_drafters() -> one request's drafters; chain: a drafter for every sequence at once (model_drafters)."""
    return BatchSpeculator(name, lambda memory: make_drafters(), Policy(cost or flat_cost(), 24, adaptive), chain,
                           taps)


def plain_tokens(model, runner, prompt, params: SamplingParams, stop=()) -> list[int]:
    return run_requests(model, runner, [prompt], params, stop=stop)[0][0]


def speculative_tokens(model, runner, make_drafters, prompt, params: SamplingParams, adaptive=False, stop=(),
                       cost=None, chain=None, taps=None) -> tuple[list[int], SpeculationStats]:
    return run_requests(model, runner, [prompt], params, speculator(make_drafters, adaptive, cost, chain, taps),
                        stop)[0]


class OracleDrafter(Drafter):
    """Knows the true continuation; proposes it up to a random depth, with one wrong token at a random depth and
    (as a tree) wrong siblings, so every verify step mixes accepted, rejected and recovered tokens."""
    name = "oracle"

    def __init__(self, truth: list[int], vocab: int, tree: bool, seed: int = 0):
        self.truth, self.vocab, self.tree = truth, vocab, tree
        self.rng = random.Random(seed)

    def propose(self, context, budget, promising=None):
        n = len(context)
        right = self.truth[n:n + min(budget, 6)]
        if not right:
            return None
        cut = len(right) if self.rng.random() < 0.3 else self.rng.randint(0, len(right) - 1)
        draft = Draft(drafter=self.name)
        parent = -1
        for i, t in enumerate(right[:cut]):
            if self.tree and len(draft) < budget:
                draft.add((t + 1 + i) % self.vocab, parent, 0.5)  # a wrong sibling before the right branch
            if len(draft) < budget:
                parent = draft.add(t, parent, 0.9)
        if cut < len(right) and len(draft) < budget:
            draft.add((right[cut] + 7) % self.vocab, parent, 0.5)  # a wrong token where the oracle stops
        return draft or None
