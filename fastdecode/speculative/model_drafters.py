"""Drafters that run a model, for every drafting sequence of an engine step at once: the target's first layers over
its own paged cache (layerskip) or a smaller model over a paged cache of its own (draft:MODEL). A chain grows one
token per batched forward of one row per sequence still drafting: greedy (a one-hot q) for greedy requests, sampled
at the request's temperature otherwise; a sequence's chain stops once its own confidence falls below
min_confidence."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastdecode.engine.kv_cache import BlockTable, KVCache, NoFreeBlocks
from fastdecode.engine.sampling import draw
from fastdecode.errors import InvalidRequestError
from fastdecode.runners import build_runner
from fastdecode.speculative.draft import Draft

CATCH_UP_ROWS = 512  # the draft model's own prefill rows in one step, over all sequences (a long prompt: a few steps)


@dataclass
class ChainState:
    """A sequence's chain drafting: its sampling, and (draft:MODEL) its blocks in the draft model's cache."""
    temperature: float
    generator: torch.Generator | None
    table: BlockTable = field(default_factory=BlockTable)
    cached: list[int] = field(default_factory=list)  # the tokens whose keys and values sit in that cache, from 0
    verified: int = 0  # cached[:verified] are the sequence's own tokens (the rest may be a draft it did not keep)


class ChainModelDrafter:
    model_free = False

    def __init__(self, max_depth: int = 8, min_confidence: float = 0.2):
        self.max_depth, self.min_confidence = max_depth, min_confidence

    def start(self, seq) -> ChainState:
        p = seq.params
        generator = torch.Generator().manual_seed(p.seed + 1) if p.seed is not None else None
        return ChainState(p.temperature, generator)

    def finish(self, seq, state: ChainState):
        """The request ended."""

    def prepare(self, seqs: list, states: list[ChainState], depths: list[int], reserve) -> list[bool]:
        """Brings each sequence's cache up to its context before drafting -> which of them can draft now."""
        raise NotImplementedError

    def logits(self, seqs: list, states: list[ChainState], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One row per sequence: its token at its position -> the drafter's logits (n, vocab)."""
        raise NotImplementedError

    @torch.inference_mode()
    def propose(self, seqs: list, states: list[ChainState], budgets: list[int], reserve) -> list[Draft | None]:
        """A chain for each sequence (at most its budget), or None. reserve(seq, tokens) -> bool: the target's
        blocks for that many positions of seq (the scheduler's, without preempting anyone)."""
        depths = [min(b, self.max_depth) for b in budgets]
        ready = self.prepare(seqs, states, depths, reserve)
        chains: list[list[int]] = [[] for _ in seqs]
        scores: list[list[float]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        confidence = [1.0] * len(seqs)
        active = [i for i, ok in enumerate(ready) if ok and depths[i] > 0]
        while active:
            tokens = [chains[i][-1] if chains[i] else seqs[i].tokens[-1] for i in active]
            positions = [seqs[i].num_computed + len(chains[i]) for i in active]
            logits = self.logits([seqs[i] for i in active], [states[i] for i in active], tokens, positions).float()
            still = []
            for row, i in enumerate(active):
                state = states[i]
                if state.temperature > 0:
                    q = torch.softmax(logits[row] / state.temperature, -1)
                    token = draw(q, state.generator)
                    qs[i].append(q)
                else:
                    q = torch.softmax(logits[row], -1)
                    token = int(q.argmax())
                confidence[i] *= float(q[token])
                chains[i].append(token)
                scores[i].append(confidence[i])
                if confidence[i] >= self.min_confidence and len(chains[i]) < depths[i]:
                    still.append(i)
            active = still
        return [Draft.chain(chains[i], scores[i], torch.stack(qs[i]) if qs[i] else None, self.name) if chains[i]
                else None for i in range(len(seqs))]


class LayerSkipDrafter(ChainModelDrafter):
    """Self-speculation (LayerSkip/Draft&Verify style, without training): the target's first `layers` layers and its
    own LM head, over the target's cache. It writes those layers' keys and values at the draft positions, which the
    verify step then rewrites, so nothing needs undoing; it adds no weights and no cache."""
    name = "layerskip"

    def __init__(self, model, runner, layers: int | None = None, **kw):
        super().__init__(**kw)
        self.model, self.runner = model, runner
        self.layers = layers or max(1, model.config.num_hidden_layers // 4)

    def prepare(self, seqs, states, depths, reserve):
        # The chain writes positions num_computed.. num_computed + depth - 1; the verify step one more.
        return [reserve(seq, seq.num_computed + 1 + d) for seq, d in zip(seqs, depths)]

    def logits(self, seqs, states, tokens, positions):
        kv = self.runner.kv
        batch = kv.batch([(seq.table, [t], p) for seq, t, p in zip(seqs, tokens, positions)], logits=True)
        return self.model.head(self.runner.forward(batch, self.layers))


class DraftModelDrafter(ChainModelDrafter):
    """A smaller model with the target's vocabulary, over a paged cache of its own whose blocks are shared through
    its own prefix cache (an agent's next turn finds its conversation there too). Each step it first computes what
    a sequence's context added since (its prompt, over a few steps: CATCH_UP_ROWS a step)."""

    def __init__(self, name: str, model, kv: KVCache, runner, **kw):
        super().__init__(**kw)
        self.name, self.model, self.kv, self.runner = f"draft:{name}", model, kv, runner

    @classmethod
    def load(cls, name: str, llm, **kw) -> "DraftModelDrafter":
        """The draft model `name` in the target's dtype and quantization, with a cache as many tokens long as the
        target's."""
        from fastdecode.loading import load_model
        from fastdecode.loading.catalog import resolve

        model = load_model(resolve(name), getattr(torch, llm.dtype))
        if model.config.vocab_size != llm.config.vocab_size:
            raise InvalidRequestError(f"draft model {name} has a vocabulary of {model.config.vocab_size} tokens, the "
                                      f"target {llm.config.vocab_size}: they must share a tokenizer")
        if llm.quant not in (None, "gguf"):
            from fastdecode.quant import quantize_model
            quantize_model(model, llm.quant)
        model.setup_rope(llm.max_seq_len)
        target = llm.engine.kv
        kv = KVCache.for_model(model.config, target.capacity, target.k[0].dtype, target.k[0].device)
        return cls(name, model, kv, build_runner(model, kv, llm.runner.name == "native"), **kw)

    def start(self, seq) -> ChainState:
        state = super().start(seq)
        state.cached = seq.tokens[:self.kv.match_prefix(state.table, seq.tokens, seq.salt, limit=len(seq.tokens) - 1)]
        state.verified = len(state.cached)
        return state

    def finish(self, seq, state: ChainState):
        self.kv.commit(state.table, state.cached, len(state.cached), seq.salt)
        self.kv.release(state.table)

    def prepare(self, seqs, states, depths, reserve):
        parts, owners, ready, room = [], [], [], CATCH_UP_ROWS
        for seq, state, depth in zip(seqs, states, depths):
            n = len(seq.tokens) - 1  # what must be cached before the root
            # Only what follows the known prefix is compared (a sequence's tokens never change): last step's draft.
            common = state.verified
            while common < min(len(state.cached), n) and state.cached[common] == seq.tokens[common]:
                common += 1
            del state.cached[common:]
            state.verified = common
            todo = seq.tokens[common:min(n, common + room)]
            try:
                self.kv.reserve(state.table, common + len(todo) + depth)
            except NoFreeBlocks:
                ready.append(False)
                continue
            if todo:
                parts.append((state.table, todo, common))
                owners.append((seq, state))
                room -= len(todo)
            ready.append(common + len(todo) == n and reserve(seq, seq.num_computed + 1 + depth))
        if parts:
            self.runner.forward(self.kv.batch(parts, logits=False))
            for (table, todo, _), (seq, state) in zip(parts, owners):
                state.cached += todo
                state.verified = len(state.cached)
                self.kv.commit(table, state.cached, len(state.cached), seq.salt)
        return ready

    def logits(self, seqs, states, tokens, positions):
        for state, token in zip(states, tokens):
            state.cached.append(token)
        batch = self.kv.batch([(s.table, [t], p) for s, t, p in zip(states, tokens, positions)], logits=True)
        return self.model.head(self.runner.forward(batch))
