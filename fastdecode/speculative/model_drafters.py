"""Drafters that run a model: the first layers of the target itself (layerskip) or a smaller model (draft:MODEL)."""
from __future__ import annotations

import torch

from fastdecode.engine.generate import prefill
from fastdecode.engine.sampling import SamplingParams, draw
from fastdecode.errors import InvalidRequestError
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter


@torch.inference_mode()
def forward_logits(model, decoder, tokens: list[int], positions: torch.Tensor, slot0: int,
                   tree_mask: torch.Tensor | None = None, layers: int | None = None) -> torch.Tensor:
    """New tokens at positions, written to cache slots slot0.. -> logits (T, vocab); the native decoder when there
    is one, else PyTorch's forward."""
    if decoder is not None:
        hidden = decoder.hidden(torch.tensor(tokens), positions, slot0, tree_mask, layers)
    else:
        hidden = model.hidden(torch.tensor([tokens]), slot0, positions=positions, tree_mask=tree_mask,
                              layers=layers)[0]
    return model.head(hidden)


class ChainModelDrafter(Drafter):
    """Drafts a chain one token at a time, greedily (one-hot q) for greedy requests and by sampling q at the
    request's temperature otherwise; stops early once the chain's own confidence falls below min_confidence."""
    model_free = False

    def __init__(self, max_depth: int = 8, min_confidence: float = 0.2):
        self.max_depth, self.min_confidence = max_depth, min_confidence
        self.temperature = 0.0
        self.generator = None

    def start(self, prompt_ids: list[int], params: SamplingParams | None = None):
        self.temperature = params.temperature if params is not None else 0.0
        self.generator = torch.Generator().manual_seed(params.seed + 1) if params and params.seed is not None else None

    def step_logits(self, token: int, pos: int) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, context: list[int]):
        """Brings the drafter's cache up to date with context[:-1] before drafting."""

    def propose(self, context: list[int], budget: int, promising=None) -> Draft | None:
        self.prepare(context)
        token, pos = context[-1], len(context) - 1
        tokens, scores, qs, confidence = [], [], [], 1.0
        for d in range(min(budget, self.max_depth)):
            logits = self.step_logits(token, pos + d).float()
            if self.temperature > 0:
                q = torch.softmax(logits / self.temperature, -1)
                token = draw(q, self.generator)
                qs.append(q)
            else:
                q = torch.softmax(logits, -1)
                token = int(q.argmax())
            confidence *= float(q[token])
            tokens.append(token)
            scores.append(confidence)
            if confidence < self.min_confidence:
                break
        return Draft.chain(tokens, scores, torch.stack(qs) if qs else None, self.name) if tokens else None


class LayerSkipDrafter(ChainModelDrafter):
    """Self-speculation (LayerSkip/Draft&Verify style, without training): the target's first `layers` layers and its
    own LM head. It writes those layers' cache slots at the draft positions, which the verify step then rewrites
    with the same tokens, so nothing needs undoing; it adds no weights."""
    name = "layerskip"

    def __init__(self, model, decoder, layers: int | None = None, **kw):
        super().__init__(**kw)
        self.model, self.decoder = model, decoder
        self.layers = layers or max(1, model.config.num_hidden_layers // 4)

    def step_logits(self, token: int, pos: int) -> torch.Tensor:
        return forward_logits(self.model, self.decoder, [token], torch.tensor([pos]), pos, layers=self.layers)[0]


class DraftModelDrafter(ChainModelDrafter):
    """A smaller model with the same vocabulary, with its own KV cache kept in step with the accepted tokens."""

    def __init__(self, name: str, model, decoder, target_config, **kw):
        super().__init__(**kw)
        if model.config.vocab_size != target_config.vocab_size:
            raise InvalidRequestError(f"draft model {name} has a vocabulary of {model.config.vocab_size} tokens, the "
                                      f"target {target_config.vocab_size}: they must share a tokenizer")
        self.name = f"draft:{name}"
        self.model, self.decoder = model, decoder
        self.cached: list[int] = []  # tokens whose keys and values sit in the draft cache, slots 0..

    def start(self, prompt_ids: list[int], params: SamplingParams | None = None):
        super().start(prompt_ids, params)
        self.cached = []

    def prepare(self, context: list[int]):
        target = context[:-1]
        common = 0
        for a, b in zip(self.cached, target):
            if a != b:
                break
            common += 1
        if len(target) > common:
            prefill(self.model, target[common:], start=common)
        self.cached = list(target)

    def step_logits(self, token: int, pos: int) -> torch.Tensor:
        self.cached.append(token)
        return forward_logits(self.model, self.decoder, [token], torch.tensor([pos]), pos)[0]
