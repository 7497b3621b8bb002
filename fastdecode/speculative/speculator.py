"""The speculative decode loop: each step the policy picks a draft (or none), one forward verifies it, the
accepted path's cache entries are kept and the rest are left to be overwritten."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from fastdecode.engine.generate import Timings, prefill
from fastdecode.engine.sampling import Sampler
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter
from fastdecode.speculative.eagle.features import forward_taps, prefill_taps
from fastdecode.speculative.model_drafters import DraftModelDrafter, LayerSkipDrafter, forward_logits
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.policy import CostModel, Policy, probe_tokens
from fastdecode.speculative.suffix import SuffixDrafter, SuffixMemory
from fastdecode.speculative.verify import verify


@dataclass
class SpeculationStats:
    drafter: str
    steps: int = 0  # forward passes after prefill, plain or verify
    verify_steps: int = 0  # those that carried a draft
    drafted: int = 0  # draft tokens verified
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0  # time in forward passes that carried a draft

    def add_verify(self, drafted: int, verdict, seconds: float):
        """Books one verify step of `drafted` nodes and its Verdict."""
        self.verify_s += seconds
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += len(verdict.path)
        self.bonus += verdict.bonus
        self.recovered += not verdict.bonus

    def as_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": self.accepted / self.verify_steps if self.verify_steps else 0.0,
                "tokens_per_step": (self.accepted + self.steps) / self.steps if self.steps else 0.0}


class ModelGate:
    """Whether a model drafter is worth its cost this step: yes while the steps that used it beat plain decoding,
    otherwise only now and then (a back-off that doubles) to notice when the content changes."""

    def __init__(self):
        self.tokens = self.seconds = 0.0
        self.interval, self.wait = 8, 0

    def allow(self, plain_rate: float) -> bool:
        if self.seconds == 0 or self.tokens / self.seconds > plain_rate:
            return True
        self.wait -= 1
        if self.wait <= 0:
            self.interval = min(2 * self.interval, 256)
            self.wait = self.interval
            return True
        return False

    def rate(self) -> float:
        """Tokens per second of the steps that used the drafter (0 before any)."""
        return self.tokens / self.seconds if self.seconds else 0.0

    def record(self, tokens: int, seconds: float, decay: float = 0.9):
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + seconds


class Speculator:
    """Drafters over one target model. Model-free drafters are asked every step (a lookup); a model drafter only
    when none of them beats plain decoding and its gate allows."""

    def __init__(self, name: str, model, decoder, drafters: list[Drafter], max_seq_len: int, max_nodes: int = 24,
                 adaptive: bool = True, cost: CostModel | None = None):
        """adaptive=False verifies every draft in full (tests, fixed-k comparisons); `cost` skips measuring."""
        self.name, self.model, self.decoder, self.drafters = name, model, decoder, drafters
        self.max_seq_len = max_seq_len
        # Drafters that read the target's hidden states (eagle/) name the layers to capture in every forward.
        self.taps = next((d.feature_layers for d in drafters if getattr(d, "feature_layers", None)), None)
        self.features = None  # the last forward's taps (T, n_taps * D)
        self.policy = Policy(cost or self.measure_cost(), max_nodes, adaptive)
        self.gates = {d.name: ModelGate() for d in drafters if not d.model_free}
        self.model_draft_s = 0.0  # what the model drafter spent on this step's draft
        self.memories: dict[str, SuffixMemory] = {}  # earlier requests, per tenant (as BatchSpeculator keeps them)

    @classmethod
    def build(cls, spec: str, llm, log=lambda *a: None) -> "Speculator":
        model, decoder = llm.model, llm.decoder
        if spec.startswith("draft:"):
            drafters = [cls.draft_model(spec.removeprefix("draft:"), llm, log)]
        elif spec.partition(":")[0] in ("eagle", "auto+eagle"):
            from fastdecode.speculative.eagle import build_drafter
            kind, _, path = spec.partition(":")
            head = build_drafter(path or None, llm)
            drafters = [head] if kind == "eagle" else [SuffixDrafter(), NgramDrafter(), head]
        else:
            drafters = {"ngram": lambda: [NgramDrafter()], "suffix": lambda: [SuffixDrafter()],
                        "layerskip": lambda: [LayerSkipDrafter(model, decoder)],
                        # layerskip stays out of auto: on SmolLM2 its drafts were never accepted and its probes cost
                        # 10% on low-overlap text (docs/speculative.md)
                        "auto": lambda: [SuffixDrafter(), NgramDrafter()]}[spec]()
        return cls(spec, model, decoder, drafters, llm.max_seq_len)

    @staticmethod
    def draft_model(name: str, llm, log) -> DraftModelDrafter:
        from fastdecode.loading import load_model
        from fastdecode.loading.catalog import resolve
        from fastdecode.runners.native_layers import native_decoder

        model = load_model(resolve(name, log=log), getattr(torch, llm.dtype))  # (LLM checked it is a float dtype)
        if llm.quant:
            from fastdecode.quant import quantize_model
            quantize_model(model, llm.quant)
        model.setup_cache(llm.max_seq_len)
        return DraftModelDrafter(name, model, native_decoder(model) if llm.decoder else None, llm.config)

    def forward(self, tokens: list[int], positions: torch.Tensor, slot0: int, tree_mask=None) -> torch.Tensor:
        if self.taps:
            logits, self.features = forward_taps(self.model, self.decoder, tokens, positions, slot0, tree_mask,
                                                 self.taps)
            return logits
        return forward_logits(self.model, self.decoder, tokens, positions, slot0, tree_mask)

    def feed(self, pos: int, rows):
        """Hands the last forward's taps of the kept tokens (rows) to the drafters that read them."""
        if self.taps:
            for d in self.drafters:
                if getattr(d, "feature_layers", None):
                    d.observe_features(pos, self.features[rows])

    def measure_cost(self) -> CostModel:
        """Forward time over n new tokens, at scratch slots behind 64 tokens of context (before any request, so
        the slots are free to overwrite)."""
        sizes = [n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24) if n < self.max_seq_len]
        base = max(0, min(64, self.max_seq_len - sizes[-1]))
        vocab = self.model.config.vocab_size
        return CostModel.measure(lambda n: self.forward(probe_tokens(n, vocab), torch.arange(base, base + n), base),
                                 sizes)

    # ---- one request ---------------------------------------------------------------------------------------------
    def generate_tokens(self, prompt_ids: list[int], sampler: Sampler, max_tokens: int, stop_ids: set[int],
                        timings: Timings, tenant: str | None = "") -> tuple[Iterator[int], SpeculationStats]:
        """`tenant`: whose earlier requests the suffix drafter may draw on (None: none, not even this one later)."""
        stats = SpeculationStats(self.name)
        self.use_memory(tenant)
        return self._run(prompt_ids, sampler, max_tokens, stop_ids, timings, stats), stats

    def use_memory(self, tenant: str | None):
        """Points the suffix drafters at the tenant's memory of earlier requests: a drafter that drew on another
        user's text would reveal it through what it drafts (speed, acceptance counts)."""
        for d in self.drafters:
            if not isinstance(d, SuffixDrafter):
                continue
            if tenant is None:
                d.memory = SuffixMemory(d.depth, d.memory.max_tokens)
            else:
                if tenant not in self.memories:
                    self.memories[tenant] = SuffixMemory(d.depth, d.memory.max_tokens)
                d.memory = self.memories[tenant]

    def _run(self, prompt_ids, sampler, max_tokens, stop_ids, timings, stats) -> Iterator[int]:
        t0 = time.perf_counter()
        if self.taps:
            logits, self.features = prefill_taps(self.model, prompt_ids, self.taps)
        else:
            logits = prefill(self.model, prompt_ids)
        timings.prompt_tokens = len(prompt_ids)
        timings.prefill_s = time.perf_counter() - t0
        token = sampler.sample(logits)
        sampler.accept(token, logits)
        t_first = time.perf_counter()
        timings.ttft_s = t_first - t0
        for d in self.drafters:
            d.start(prompt_ids, sampler.params)
        self.feed(0, slice(None))
        context = list(prompt_ids) + [token]
        emitted, n = [token], 0
        try:
            while True:
                for y in emitted:
                    n += 1
                    timings.output_tokens = n
                    timings.decode_s = time.perf_counter() - t_first
                    yield y
                    if y in stop_ids or n == max_tokens:
                        return
                for d in self.drafters:
                    d.observe(context)
                # Slots pos..pos+nodes must fit the cache, and drafting past max_tokens is wasted.
                pos = len(context) - 1
                budget = min(self.policy.max_nodes, max_tokens - n - 1, self.max_seq_len - pos - 1)
                draft = self.draft(context, budget, stats, sampler) if budget > 0 else None
                emitted = self.step(draft, context, sampler, stop_ids, stats)
                context += emitted
        finally:
            for d in self.drafters:
                d.finish(context)

    def draft(self, context: list[int], budget: int, stats: SpeculationStats, sampler: Sampler) -> Draft | None:
        """The best draft the policy will verify this step, or None for a plain decode step."""
        t0 = time.perf_counter()
        best, best_rate = None, 1.0 / self.policy.cost(1)
        plain_rate = best_rate
        for d in self.drafters:
            if d.model_free:
                chosen, rate = self.policy.choose(sampler.allowed_draft(d.propose(context, budget)))
                if chosen is not None and (best is None or rate > best_rate):  # a probe comes at the plain rate
                    best, best_rate = chosen, rate
        self.model_draft_s = 0.0
        for d in self.drafters:
            if d.model_free:
                continue
            gate = self.gates[d.name]
            # A trained head is worth asking beside a model-free draft when its steps have been faster than that
            # draft promises; other model drafters only when nothing model-free beats plain decoding.
            if best is not None and not (getattr(d, "feature_layers", None) and gate.rate() > best_rate):
                continue
            if self.policy.adaptive and not gate.allow(plain_rate):
                continue
            t1 = time.perf_counter()
            chosen, rate = self.policy.choose(sampler.allowed_draft(d.propose(context, budget)))
            self.model_draft_s = time.perf_counter() - t1
            if chosen is not None and (best is None or rate > best_rate):
                best, best_rate = chosen, rate
            else:  # drafted for nothing: the gate must hear of the cost
                gate.record(0, self.model_draft_s)
        stats.draft_s += time.perf_counter() - t0
        return best

    def step(self, draft: Draft | None, context: list[int], sampler: Sampler, stop_ids: set[int],
             stats: SpeculationStats) -> list[int]:
        """One forward over the root (the last emitted token) and the draft -> the tokens it emits."""
        pos = len(context) - 1
        t0 = time.perf_counter()
        stats.steps += 1
        if draft is None:
            logits = self.forward([context[-1]], torch.tensor([pos]), pos)[0]
            self.feed(pos, [0])
            y = sampler.sample(logits)
            sampler.accept(y, logits)
            self.policy.cost.observe(1, time.perf_counter() - t0)
            return [y]
        tokens, positions, mask = draft.tree_inputs(context[-1], pos)
        logits = self.forward(tokens, positions, pos, mask)
        verdict = verify(draft, logits, sampler, stop_ids)
        self.feed(pos, [0] + [1 + i for i in verdict.path])
        self.keep_path(pos, verdict.path)
        seconds = time.perf_counter() - t0
        self.policy.cost.observe(len(tokens), seconds)
        stats.add_verify(len(draft), verdict, seconds)
        self.policy.learn(draft, verdict.path)
        if draft.drafter in self.gates:
            self.gates[draft.drafter].record(len(verdict.tokens), seconds + self.model_draft_s)
        return verdict.tokens

    def keep_path(self, pos: int, path: list[int]):
        """Moves the accepted nodes' keys and values to the slots right after the root, where a chain already has
        them; a tree's other branches are simply overwritten later."""
        if path == list(range(len(path))):
            return
        src = torch.tensor([pos + 1 + i for i in path])
        dst = torch.arange(pos + 1, pos + 1 + len(path))
        for block in self.model.layers:
            cache = block.self_attn.kv_cache
            cache.k[:, :, dst] = cache.k[:, :, src]
            cache.v[:, :, dst] = cache.v[:, :, src]
