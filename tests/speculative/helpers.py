"""A tiny target with the native decoder (int4: bit-exact across verify sizes), an oracle drafter, and plain/
speculative runs of it."""
import random

import torch

from fastdecode.engine.generate import Timings, generate_tokens
from fastdecode.engine.sampling import Sampler, SamplingParams
from fastdecode.quant import quantize_model
from fastdecode.runners.native_layers import native_decoder
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter
from fastdecode.speculative.policy import CostModel
from fastdecode.speculative.speculator import Speculator
from tests.helpers.tiny import tiny_model



def flat_cost() -> CostModel:
    """Every verify size costs the same: the adaptive policy drafts whenever a draft is likely at all."""
    return CostModel([1, 64], [1.0, 1.0])


def tiny_target(quant: str | None = "int4", native: bool = True, seed: int = 0, max_seq_len: int = 256):
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
    model.setup_cache(max_seq_len)
    return model, native_decoder(model) if native else None


def plain_tokens(model, decoder, prompt, params: SamplingParams, stop=()) -> list[int]:
    sampler = Sampler(params, model.config.vocab_size, prompt)
    return list(generate_tokens(model, prompt, sampler, params.max_tokens, set(stop), Timings(), decoder))


def speculative_tokens(model, decoder, drafters, prompt, params: SamplingParams, adaptive=False, stop=(), cost=None):
    spec = Speculator("test", model, decoder, drafters, model.max_seq_len, adaptive=adaptive,
                      cost=cost or flat_cost())
    sampler = Sampler(params, model.config.vocab_size, prompt)
    tokens, stats = spec.generate_tokens(prompt, sampler, params.max_tokens, set(stop), Timings())
    return list(tokens), stats


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
