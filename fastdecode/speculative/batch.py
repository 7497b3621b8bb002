"""Speculation inside the engine's batch. Each sequence keeps its own drafters: model-free ones (a lookup, no model
runs) and a trained head's (EAGLE, reading the target's taps); a drafter that runs a model for the whole step
(layerskip, draft:MODEL) drafts for every sequence at once, one batched forward per draft depth. One adaptive policy,
whose cost model prices a forward pass by its rows, picks each sequence's draft given what the rest of the step
already costs and yields, so drafting turns itself down where a bigger batch leaves it nothing to gain; a drafter that
runs a model is asked only while its steps beat plain decoding for that request (ModelGate). Plain decoding is the
empty draft: the same step, one row per sequence."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fastdecode.errors import InvalidRequestError
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter
from fastdecode.speculative.model_drafters import ChainModelDrafter, ChainState, DraftModelDrafter, LayerSkipDrafter
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.policy import CostModel, Policy
from fastdecode.speculative.stats import ModelGate, SpeculationStats
from fastdecode.speculative.suffix import SuffixDrafter, SuffixMemory
from fastdecode.speculative.verify import Verdict

# --speculate values whose drafters are all model-free (a sequence's own lookups).
MODEL_FREE = {
    "ngram": lambda memory: [NgramDrafter()],
    "suffix": lambda memory: [SuffixDrafter(memory=memory)],
    "auto": lambda memory: [SuffixDrafter(memory=memory), NgramDrafter()],
}
SPECULATE_CHOICES = ("none", *MODEL_FREE, "layerskip")  # and draft:MODEL, eagle[:DIR], auto+eagle[:DIR]
HEADS = ("eagle", "auto+eagle")  # a trained head (`fastdecode train-drafter`), alone or beside auto's; `:DIR` optional
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # rows per forward measured at start-up; extrapolated beyond
log = logging.getLogger(__name__)


def check_speculate(spec: str | None):
    """InvalidRequestError for a `--speculate` value that names no drafter."""
    if spec in (None, "", *SPECULATE_CHOICES) or spec.startswith("draft:") or spec.partition(":")[0] in HEADS:
        return
    raise InvalidRequestError(f"--speculate must be one of {', '.join(SPECULATE_CHOICES)}, draft:MODEL, eagle[:DIR] "
                              f"or auto+eagle[:DIR], not {spec!r}")


@dataclass
class SequenceDrafts:
    drafters: list[Drafter]
    stats: SpeculationStats
    gates: dict[str, ModelGate] = field(default_factory=dict)  # per drafter that runs a model (the tenant's)
    chain: ChainState | None = None  # the step-wide model drafter's state for this sequence
    chain_draft: Draft | None = None  # its draft this step
    chain_s: float = 0.0  # this sequence's share of what drafting it took
    draft: Draft | None = None  # this step's
    draft_s: float = 0.0  # what a model drafter spent on this step's draft (its gate charges the step for it)


@dataclass
class BatchSpeculator:
    name: str
    make_drafters: Callable[[SuffixMemory | None], list[Drafter]]
    policy: Policy
    chain_drafter: ChainModelDrafter | None = None  # drafts for every sequence at once (layerskip, draft:MODEL)
    taps: list[int] | None = None  # target layers whose residuals the sequences' drafters read (EAGLE)
    memories: dict[str, SuffixMemory] = field(default_factory=dict)  # per tenant
    gates: dict[str, dict[str, ModelGate]] = field(default_factory=dict)  # per tenant, per drafter that runs a model
    plain_rate: float = 0.0  # a sequence's tokens per second this step without drafting (what a model drafter must beat)

    @classmethod
    def build(cls, spec: str, cost: CostModel, llm=None) -> "BatchSpeculator":
        """llm: the target (its model, engine runner and cache), for drafters that run a model."""
        check_speculate(spec)
        policy = Policy(cost)
        if spec in MODEL_FREE:
            return cls(spec, MODEL_FREE[spec], policy)
        if spec == "layerskip":
            return cls(spec, lambda memory: [], policy, LayerSkipDrafter(llm.model, llm.runner))
        if spec.startswith("draft:"):
            return cls(spec, lambda memory: [], policy, DraftModelDrafter.load(spec.removeprefix("draft:"), llm))
        from fastdecode.speculative.eagle import head_drafters

        kind, _, path = spec.partition(":")
        make_head, taps = head_drafters(path or None, llm)
        if kind == "eagle":
            return cls(spec, lambda memory: [make_head()], policy, taps=taps)
        return cls(spec, lambda memory: [*MODEL_FREE["auto"](memory), make_head()], policy, taps=taps)

    def start(self, seq):
        """Gives a sequence its drafters, sharing cross-request memory only with its own tenant."""
        memory = None if seq.tenant is None else self.memories.setdefault(seq.tenant, SuffixMemory())
        drafters = self.make_drafters(memory)
        for d in drafters:
            d.start(seq.prompt_ids, seq.params)
        state = SequenceDrafts(drafters, SpeculationStats(self.name))
        # A gate learns whether its drafter pays on the tenant's text (a request alone relearns it every time: its
        # first steps draft for nothing).
        state.gates = {} if seq.tenant is None else self.gates.setdefault(seq.tenant, {})
        for d in drafters:
            if not d.model_free:
                state.gates.setdefault(d.name, ModelGate())
        if self.chain_drafter is not None:
            state.chain = self.chain_drafter.start(seq)
            state.gates.setdefault(self.chain_drafter.name, ModelGate())
        seq.speculation = state

    def draft_chains(self, seqs: list, budgets: list[int], reserve):
        """The step-wide model drafter's chains for the sequences whose gate lets it draft this step.
        reserve(seq, tokens) -> bool: target blocks for a chain's positions, without preempting."""
        self.plain_rate = 1.0 / self.policy.cost(max(1, len(seqs)))
        for seq in seqs:
            seq.speculation.chain_draft, seq.speculation.chain_s = None, 0.0
        if self.chain_drafter is None:
            return
        name = self.chain_drafter.name
        chosen = [i for i, (seq, b) in enumerate(zip(seqs, budgets))
                  if b > 0 and (not self.policy.adaptive or seq.speculation.gates[name].allow(self.plain_rate))]
        if not chosen:
            return
        t0 = time.perf_counter()
        try:
            drafts = self.chain_drafter.propose([seqs[i] for i in chosen], [seqs[i].speculation.chain for i in chosen],
                                                [budgets[i] for i in chosen], reserve)
        except Exception:  # noqa: BLE001 - a draft is optional: the step goes on without (and the engine with it)
            log.exception("%s drafting failed; the step runs without its drafts", name)
            return
        share = (time.perf_counter() - t0) / len(chosen)
        for i, draft in zip(chosen, drafts):
            state = seqs[i].speculation
            state.chain_draft, state.chain_s = draft, share

    def propose(self, seq, budget: int, base_rows: int, base_tokens: float) -> tuple[Draft | None, float]:
        """-> (the draft to verify for this sequence or None, tokens it is expected to emit)."""
        state: SequenceDrafts = seq.speculation
        t0 = time.perf_counter()
        context = seq.tokens
        best, best_rate, best_s = None, 0.0, 0.0
        for d in state.drafters:
            d.observe(context)
        for d in state.drafters:
            if not d.model_free:
                continue
            promising = self.policy.gate(d.name, base_rows, base_tokens)
            proposed = seq.sampler.allowed_draft(d.propose(context, budget, promising))
            chosen, rate = self.policy.choose(proposed, base_rows=base_rows, base_tokens=base_tokens, gated=True)
            if chosen is not None and (best is None or rate > best_rate):
                best, best_rate = chosen, rate
        for d in state.drafters:
            if d.model_free:
                continue
            gate = state.gates[d.name]
            # A trained head is asked beside a model-free draft only when its steps have been faster than that
            # draft promises, and at all only while its gate allows.
            if (best is not None and gate.rate() <= best_rate) or (self.policy.adaptive
                                                                   and not gate.allow(self.plain_rate)):
                continue
            t1 = time.perf_counter()
            try:
                proposed = seq.sampler.allowed_draft(d.propose(context, budget))
            except Exception:  # noqa: BLE001 - as in draft_chains
                log.exception("%s drafting failed; the step runs without its draft", d.name)
                proposed = None
            seconds = time.perf_counter() - t1
            best, best_rate, best_s = self._consider(gate, proposed, seconds, best, best_rate, best_s, base_rows,
                                                     base_tokens)
        if state.chain_draft is not None:
            proposed = seq.sampler.allowed_draft(state.chain_draft)
            best, best_rate, best_s = self._consider(state.gates[self.chain_drafter.name], proposed, state.chain_s,
                                                     best, best_rate, best_s, base_rows, base_tokens)
        state.stats.draft_s += time.perf_counter() - t0 + state.chain_s
        state.draft, state.draft_s = best, best_s
        return best, 1.0 + (sum(self.policy.estimates(best)) if best is not None else 0.0)

    def _consider(self, gate: ModelGate, proposed: Draft | None, seconds: float, best, best_rate, best_s, base_rows,
                  base_tokens):
        """A model drafter's draft against the best so far -> the new best (draft, rate, its drafting seconds)."""
        chosen, rate = self.policy.choose(proposed, seconds, base_rows=base_rows, base_tokens=base_tokens)
        if chosen is not None and (best is None or rate > best_rate):
            return chosen, rate, seconds
        gate.record(0, seconds)  # drafted for nothing: the gate must hear of the cost
        return best, best_rate, best_s

    def record(self, seq, verdict: Verdict | None, step_s: float):
        """Books the step: what was drafted and accepted, for the policy's calibration and the request's stats."""
        state: SequenceDrafts = seq.speculation
        stats, draft = state.stats, state.draft
        stats.steps += 1
        if draft is None or verdict is None:
            return
        stats.add_verify(len(draft), verdict, step_s)
        self.policy.learn(draft, verdict.path)
        if draft.drafter in state.gates:
            state.gates[draft.drafter].record(len(verdict.tokens), step_s + state.draft_s)

    def feed(self, seq, pos: int, taps: torch.Tensor):
        """The target's taps (m, n_taps * D) of the sequence's tokens at positions pos..pos+m-1, now in its cache."""
        for d in seq.speculation.drafters:
            if getattr(d, "feature_layers", None):
                d.observe_features(pos, taps)

    def finish(self, seq, learn: bool = True):
        """The request ended: its drafters learn from it (not from a failed one) and give back what they held."""
        state: SequenceDrafts | None = seq.speculation
        if state is None:
            return
        if learn:
            for d in state.drafters:
                d.finish(seq.tokens)
        if state.chain is not None:
            self.chain_drafter.finish(seq, state.chain)
            state.chain = None
