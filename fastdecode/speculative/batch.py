"""Speculation inside the engine's batch. Each sequence keeps its own drafters (model-free ones: a lookup, no model
runs); one adaptive policy, whose cost model prices a forward pass by its rows, picks each sequence's draft given
what the rest of the step already costs and yields, so drafting turns itself down where a bigger batch leaves it
nothing to gain. Plain decoding is the empty draft: the same step, one row per sequence."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.policy import CostModel, Policy
from fastdecode.speculative.speculator import SpeculationStats
from fastdecode.speculative.suffix import SuffixDrafter, SuffixMemory
from fastdecode.speculative.verify import Verdict

# --speculate values whose drafters the engine runs per sequence (model drafters go through Speculator).
MODEL_FREE = {
    "ngram": lambda memory: [NgramDrafter()],
    "suffix": lambda memory: [SuffixDrafter(memory=memory)],
    "auto": lambda memory: [SuffixDrafter(memory=memory), NgramDrafter()],
}
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # rows per forward measured at start-up; extrapolated beyond


@dataclass
class SequenceDrafts:
    drafters: list[Drafter]
    stats: SpeculationStats
    draft: Draft | None = None  # this step's
    draft_s: float = 0.0  # what proposing this step's draft took


@dataclass
class BatchSpeculator:
    name: str
    make_drafters: Callable[[SuffixMemory | None], list[Drafter]]
    policy: Policy
    memories: dict[str, SuffixMemory] = field(default_factory=dict)  # per tenant

    @classmethod
    def build(cls, spec: str, cost: CostModel, max_nodes: int = 24, adaptive: bool = True) -> "BatchSpeculator":
        return cls(spec, MODEL_FREE[spec], Policy(cost, max_nodes, adaptive))

    def start(self, seq):
        """Gives a sequence its drafters, sharing cross-request memory only with its own tenant."""
        memory = None if seq.tenant is None else self.memories.setdefault(seq.tenant, SuffixMemory())
        drafters = self.make_drafters(memory)
        for d in drafters:
            d.start(seq.prompt_ids, seq.params)
        seq.speculation = SequenceDrafts(drafters, SpeculationStats(self.name))

    def propose(self, seq, budget: int, base_rows: int, base_tokens: float) -> tuple[Draft | None, float]:
        """-> (the draft to verify for this sequence or None, tokens it is expected to emit)."""
        state: SequenceDrafts = seq.speculation
        t0 = time.perf_counter()
        context = seq.tokens
        best, best_rate = None, 0.0
        for d in state.drafters:
            d.observe(context)
            promising = self.policy.gate(d.name, base_rows, base_tokens)
            proposed = seq.sampler.allowed_draft(d.propose(context, budget, promising))
            chosen, rate = self.policy.choose(proposed, base_rows=base_rows, base_tokens=base_tokens, gated=True)
            if chosen is not None and (best is None or rate > best_rate):
                best, best_rate = chosen, rate
        state.draft, state.draft_s = best, time.perf_counter() - t0
        state.stats.draft_s += state.draft_s
        return best, 1.0 + (sum(self.policy.estimates(best)) if best is not None else 0.0)

    def record(self, seq, verdict: Verdict | None, step_s: float):
        """Books the step: what was drafted and accepted, for the policy's calibration and the request's stats."""
        state: SequenceDrafts = seq.speculation
        stats, draft = state.stats, state.draft
        stats.steps += 1
        if draft is None or verdict is None:
            return
        stats.add_verify(len(draft), verdict, step_s)
        self.policy.learn(draft, verdict.path)

    def finish(self, seq):
        state: SequenceDrafts | None = seq.speculation
        if state is not None:
            for d in state.drafters:
                d.finish(seq.tokens)
