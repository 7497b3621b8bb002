"""Adaptive speculation: how many draft nodes to verify each step (0 is plain decode), to maximise expected tokens
per second.

A verify step over n draft nodes costs t(1 + n) seconds (measured at start-up: on a memory-bound machine t grows
slowly with n, on a compute-bound one fast) and emits 1 + (expected accepted nodes) tokens. A node is accepted when
its parent is and the target agrees with it there: that conditional chance is calibrated online per drafter against
its conditional score (node score / parent score, in bins) from the nodes whose parent was accepted, and a node's
chance is the product along its path. The step takes the n with the most tokens per second, if that beats plain
decoding by MARGIN; when drafts are poor it is n = 0, plain decoding, so speculation never costs more than a proposal
lookup -- except for a short probe when a draft's first node falls in a score bin with (almost) no evidence: untested
scores start pessimistic, and without a probe a drafter that was never verified would never be (a fresh process
would not speculate at all).
Evidence fades, so on text where drafts fail a bin is probed again about every 70 consultations; probes are spaced
PROBE_GAP consultations apart at least, more where a probe's extra row costs much (a compute-bound machine).
Drafters skip building drafts the policy would not verify (`gate`), so that on such text drafting costs a lookup.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

from fastdecode.speculative.draft import Draft

BINS = 10
PROBE_NODES = 1  # a probe verifies the draft's most likely node: one acceptance is evidence enough to go on
PROBE_BELOW = 0.5  # tries (decayed) under which a bin counts as untested
MARGIN = 0.1  # a draft must promise this much more than plain decoding: one whose gain is within the estimates' error
# adds variance (a run of rejections is a slow window, which the floor reads) for a mean gain of a few percent
PROBE_GAP = 24  # consultations from one probe to the next: on text where drafts fail, untested bins (every drafter's,
# each coming due again as its evidence fades) would otherwise be probed in bursts, up to 7 failed probes in one
# 32-token window, which is what the floor reads
PROBE_SPEND = 0.005  # where a probe's extra rows cost more (a compute-bound machine: a second row at 0.6 of a step on
# an AVX2 EPYC with the 135M model), probes are spaced further, so that they cost at most this share of a plain step
# per consultation (1% of the time with auto's two drafters) on text where they all fail


def probe_tokens(n: int, vocab: int) -> list[int]:
    """n distinct token ids spread over the vocabulary, for timing a forward: n copies of one token would all route to
    that token's experts in a mixture-of-experts model, and understate what n real tokens (draft tokens, several
    sequences) cost."""
    return [(7919 * i + 1) % vocab for i in range(n)]


@dataclass
class CostModel:
    sizes: list[int]  # tokens per forward (1 = plain decode step)
    seconds: list[float]
    version: int = 0  # counts observations, for what is derived from the costs (Policy.least_estimate)

    def __call__(self, tokens: int) -> float:
        """Linear interpolation between measured sizes (extrapolated past the last)."""
        s, t = self.sizes, self.seconds
        if tokens <= s[0]:
            return t[0]
        i = min(bisect.bisect_left(s, tokens), len(s) - 1)
        lo, hi = i - 1, i
        return t[lo] + (t[hi] - t[lo]) * (tokens - s[lo]) / (s[hi] - s[lo])

    def observe(self, tokens: int, seconds: float, weight: float = 0.1):
        """Folds a timed step into the nearest measured size, so the model follows a machine that got busier or
        quieter since start-up (the scale carried over by the model's own ratio between the two sizes)."""
        s, t = self.sizes, self.seconds
        i = min(bisect.bisect_left(s, tokens), len(s) - 1)  # the nearest size (the first of two as near)
        if i > 0 and tokens - s[i - 1] <= s[i] - tokens:
            i -= 1
        t[i] += weight * (seconds * t[i] / self(tokens) - t[i])
        # More tokens never cost less: the size that moved stays at least its smaller neighbour, and the sizes after it
        # at least it.
        for j in range(max(i, 1), len(t)):
            if t[j] >= t[j - 1] and j > i:
                break
            t[j] = max(t[j], t[j - 1])
        self.version += 1

    @classmethod
    def measure(cls, forward, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24), repeats: int = 5) -> "CostModel":
        """forward(n) runs one forward over n new tokens; the median of `repeats` timings per size, sizes
        interleaved so that a burst of noise does not hit one size only."""
        times: dict[int, list[float]] = {n: [] for n in sizes}
        forward(1)  # warm-up
        for _ in range(repeats):
            for n in sizes:
                t0 = time.perf_counter()
                forward(n)
                times[n].append(time.perf_counter() - t0)
        seconds = [sorted(times[n])[repeats // 2] for n in sizes]
        for i in range(1, len(seconds)):  # more tokens never cost less: smooth out noise
            seconds[i] = max(seconds[i], seconds[i - 1])
        return cls(list(sizes), seconds)


@dataclass
class Calibration:
    """P(a node is accepted | its parent was; its conditional score), per score bin. Evidence decays with every
    update and, more slowly, with every consultation, so a bin that went bad is tried again after a while (the
    workload changes within a request: a file being copied, then new code). A bin's evidence is stored divided by
    `scale`, so forgetting, at every consultation of every step, is one multiplication rather than a pass over the
    bins."""
    stored_hits: list[float] = field(default_factory=lambda: [0.0] * BINS)
    stored_tries: list[float] = field(default_factory=lambda: [0.0] * BINS)
    scale: float = 1.0
    decay: float = 0.995
    forget_rate: float = 0.99
    prior_weight: float = 2.0

    @property
    def hits(self) -> list[float]:
        return [h * self.scale for h in self.stored_hits]

    @property
    def tries(self) -> list[float]:
        return [t * self.scale for t in self.stored_tries]

    def estimate(self, score: float) -> float:
        b = min(int(score * BINS), BINS - 1)
        prior = 0.5 * score  # untested scores start pessimistic: the floor matters more than the first draft
        return (self.stored_hits[b] * self.scale + self.prior_weight * prior) / (
            self.stored_tries[b] * self.scale + self.prior_weight)

    def update(self, score: float, accepted: bool):
        b = min(int(score * BINS), BINS - 1)
        self.stored_hits[b] = self.stored_hits[b] * self.decay + accepted / self.scale
        self.stored_tries[b] = self.stored_tries[b] * self.decay + 1 / self.scale

    def untested(self, score: float) -> bool:
        return self.stored_tries[min(int(score * BINS), BINS - 1)] * self.scale < PROBE_BELOW

    def forget(self):
        self.scale *= self.forget_rate
        if self.scale < 1e-100:  # fold the scale back in before the stored values grow out of range
            self.stored_hits, self.stored_tries, self.scale = self.hits, self.tries, 1.0


def conditional_scores(draft: Draft) -> list[float]:
    """Each node's score given that its parent is accepted (scores are path estimates)."""
    out = []
    for score, parent in zip(draft.scores, draft.parents):
        base = draft.scores[parent] if parent >= 0 else 1.0
        out.append(min(1.0, score / base) if base > 0 else 0.0)
    return out


class Policy:
    def __init__(self, cost: CostModel, max_nodes: int = 24, adaptive: bool = True, margin: float = MARGIN):
        self.cost, self.max_nodes, self.adaptive, self.margin = cost, max_nodes, adaptive, margin
        self.calibration: dict[str, Calibration] = {}
        self.consultations, self.last_probe = 0, None
        self._least: tuple = (None, 0.0)  # (key, value) of the last least_estimate

    def estimates(self, draft: Draft) -> list[float]:
        """Each node's chance that its whole path is accepted."""
        cal = self.calibration.setdefault(draft.drafter, Calibration())
        est: list[float] = []
        for cond, parent in zip(conditional_scores(draft), draft.parents):
            est.append(cal.estimate(cond) * (est[parent] if parent >= 0 else 1.0))
        return est

    def _consult(self, drafter: str) -> Calibration:
        """Counts a consultation: the drafter's evidence fades a little (a bin that went bad is tried again later)."""
        cal = self.calibration.setdefault(drafter, Calibration())
        cal.forget()
        self.consultations += 1
        return cal

    def gate(self, drafter: str, base_rows: int = 0, base_tokens: float = 0.0) -> Callable[[float], bool]:
        """Opens this step's consultation of `drafter` (choose(..., gated=True) then follows) and returns whether a
        node hanging under the root with this score could make its draft worth verifying, or probing: a drafter
        builds no draft none of whose first nodes could. The bound is exact: a node's estimate is at most its
        parent's, so n nodes promise at most n times the best first node's. On text where drafts fail, drafting
        then costs a lookup, not a tree and its estimates (0.1-0.2 ms a step in Python: 2% of a 135M model's step)."""
        cal = self._consult(drafter)
        if not self.adaptive:
            return lambda score: True
        need = self.least_estimate(base_rows, base_tokens) - 1e-9  # the gate must not be stricter than choose
        probe = self._probe_due(base_rows)
        return lambda score: cal.estimate(min(1.0, score)) > need or (probe and cal.untested(min(1.0, score)))

    def least_estimate(self, base_rows: int = 0, base_tokens: float = 0.0) -> float:
        """The estimate the best first node of a draft must exceed for some number of nodes to beat choose's bar:
        min over n of (bar * cost(rows + n) - tokens) / n. Within a segment of the piecewise-linear cost that ratio
        is monotone in n, so the segments' ends (the measured sizes) and n = 1 and max_nodes are the candidates."""
        key = (base_rows, base_tokens, id(self.cost), self.cost.version)
        if self._least[0] == key:
            return self._least[1]
        tokens, top = base_tokens + 1.0, self.max_nodes
        bar = self._bar(base_rows, base_tokens)
        least = min(bar * self.cost(base_rows + 2) - tokens, (bar * self.cost(base_rows + 1 + top) - tokens) / top)
        for size, seconds in zip(self.cost.sizes, self.cost.seconds):  # runs once a step: no interpolation here
            n = size - base_rows - 1
            if 1 < n < top:
                least = min(least, (bar * seconds - tokens) / n)
        self._least = (key, least)
        return least

    def _bar(self, base_rows: int, base_tokens: float) -> float:
        """The tokens per second a draft must beat: plain decoding's, raised by the margin on this sequence's own
        share of the step (a draft must add MARGIN of what its plain row yields)."""
        tokens = base_tokens + 1.0
        return tokens / self.cost(base_rows + 1) * (1 + self.margin / tokens)

    def _probe_due(self, base_rows: int) -> bool:
        """Probes are PROBE_GAP consultations apart, further where a probe's extra rows cost more than PROBE_SPEND
        of a step per consultation."""
        if self.last_probe is None:
            return True  # a fresh process probes at once: its drafts start pessimistic
        since = self.consultations - self.last_probe
        if since < PROBE_GAP:
            return False
        extra = self.cost(base_rows + 1 + PROBE_NODES) / self.cost(base_rows + 1) - 1.0
        return since >= extra / PROBE_SPEND

    def choose(self, draft: Draft | None, draft_seconds: float = 0.0, base_rows: int = 0,
               base_tokens: float = 0.0, gated: bool = False) -> tuple[Draft | None, float]:
        """-> (the nodes worth verifying or None for plain decode, expected tokens per second). In a batch the rest of
        the step already holds `base_rows` rows that emit `base_tokens` tokens: a draft is judged by what it adds to
        the whole step's tokens per second (its nodes cost less beside a prefill chunk, more beside nothing).
        gated: gate() already opened this consultation."""
        plain = (base_tokens + 1.0) / self.cost(base_rows + 1)
        if not draft:
            return None, plain
        if not self.adaptive:
            return draft.subset(list(range(min(len(draft), self.max_nodes)))), float("inf")
        cal = self.calibration.setdefault(draft.drafter, Calibration()) if gated else self._consult(draft.drafter)
        est = self.estimates(draft)
        # Parents first: a child's estimate is at most its parent's, ties go to the lower index (parents come first),
        # so order[0] hangs under the root and its score is its conditional score.
        order = sorted(range(len(draft)), key=lambda i: (-est[i], i))[:self.max_nodes]
        bar = self._bar(base_rows, base_tokens)
        best_n, best_rate, expected = 0, plain, base_tokens + 1.0
        for n, i in enumerate(order, start=1):
            expected += est[i]
            rate = expected / (self.cost(base_rows + 1 + n) + draft_seconds)
            if rate > max(best_rate, bar):
                best_n, best_rate = n, rate
        if best_n == 0 and cal.untested(min(1.0, draft.scores[order[0]])) and self._probe_due(base_rows):
            best_n, self.last_probe = min(PROBE_NODES, len(order)), self.consultations
        return (draft.subset(order[:best_n]) if best_n else None), best_rate

    def learn(self, draft: Draft, path: list[int]):
        """A node whose parent was accepted (or that hangs under the root) was a try; the accepted ones were hits.
        Nodes under a rejected parent say nothing about their own chance."""
        cal = self.calibration.setdefault(draft.drafter, Calibration())
        accepted = set(path)
        for i, (cond, parent) in enumerate(zip(conditional_scores(draft), draft.parents)):
            if parent < 0 or parent in accepted:
                cal.update(cond, i in accepted)
