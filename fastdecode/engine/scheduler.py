"""Which sequences run in the next forward pass, and how many rows each: continuous batching with chunked prefill.

Every step, each running sequence that is decoding gets one row (its last sampled token) plus the draft the speculator
picks for it; prompts being prefilled share what is left of the step's token budget evenly (a prompt that needs less
than its share takes what it needs, the rest is split among the others). While anyone decodes, that budget is sized so
the step takes about `decode_gap_s`, so one user's long paste delays the others' next token by a chunk, not by its whole
prefill; otherwise about `prefill_step_s`, so a request that arrives during a long prefill starts within about that, and
a short prompt is not queued behind a long one (an agent's subagent beside its main conversation), but never fewer than
`min_prefill_rows` (prefill_floor: a mixture-of-experts chunk reads nearly every expert; a dense model's matmuls run
near their best from 64 rows). Waiting requests join between steps (first in, first out) while fewer than `max_batch`
run, taking the longest cached prefix of their tokens first (from the disk tier, while others run, about `decode_gap_s`
of reading a step). When a sequence needs a block and none is free, the most recently admitted sequence is preempted:
its blocks go back (full ones stay cached), and it computes its tokens again when readmitted (recompute preemption, as
in vLLM), with its output so far kept.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from fastdecode.engine.kv_cache import KVCache, NoFreeBlocks
from fastdecode.engine.sequence import Sequence, Status
from fastdecode.speculative.draft import Draft


@dataclass
class SchedulerConfig:
    max_batch: int = 8  # sequences running at once; more wait in the queue
    max_batched_tokens: int = 2048  # rows in one forward pass (a prompt chunk when nobody decodes)
    decode_gap_s: float = 0.3  # while sequences decode, a step's prompt chunk is sized to take about this long
    prefill_step_s: float = 1.0  # and a step of prompt chunks alone, this long
    min_prefill_rows: int = 0  # but a step of prompt chunks alone never shorter than this (prefill_floor)
    prefix_cache: bool = True


@dataclass
class Work:
    """One sequence's rows in a step: `rows` of its pending tokens, then `draft`'s nodes (decode only)."""
    seq: Sequence
    rows: int
    draft: Draft | None = None

    @property
    def samples(self) -> bool:
        """The rows reach the sequence's last token, so the step samples its next one."""
        return self.rows == self.seq.pending


DENSE_PREFILL_FLOOR = 64


def prefill_floor(config) -> int:
    """The rows a step of prompt chunks alone takes at the least, for a model config. A mixture-of-experts chunk reads
    nearly every expert however short it is (gpt-oss-20b: 10 GB of its 12), so chunks sized to a second spent most of
    it reading weights, and the rate they measured shrank the next chunk (gpt-oss-20b at 2k tokens of context: 80, 49,
    ..., 32 rows a step, 29 rows/s): enough rows for 32 an expert on average spread that read and keep the experts'
    matmuls past the tiled kernels' fixed cost per call (unpacking each weight block for however few rows): gpt-oss-20b
    at 1,024 tokens prefilled 60 tok/s in 128-row steps (16 an expert), 72 in 256-row ones, 80 in 512-row ones (MXFP4,
    2 threads of a Zen 4 EPYC). Dense models: DENSE_PREFILL_FLOOR rows, where the tiled matmuls have left most of
    their fixed cost per call behind (unpacking each weight block, reading the weights once a step): an 8B model's
    second-long steps were 32 rows, and 64-row chunks prefilled 7% faster, 128-row ones 15% (a 1,024-token prompt,
    Q4_0, 2 threads of a Zen 4 EPYC), for a newly arrived request's wait of a step (2 s instead of 1 there)."""
    if not config.num_experts:
        return DENSE_PREFILL_FLOOR
    return 32 * config.num_experts // max(1, config.num_experts_per_tok)


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """`budget` rows split among prompts needing `needs`: evenly, except that a prompt needing less than its share
    takes only what it needs and the rest goes to the others (max-min fairness)."""
    shares = [0] * len(needs)
    left = max(budget, 0)
    order = sorted(range(len(needs)), key=lambda i: needs[i])  # the neediest last, so it takes what rounding leaves
    for k, i in enumerate(order):
        shares[i] = min(needs[i], left // (len(order) - k))
        left -= shares[i]
    return shares


class Scheduler:
    def __init__(self, kv: KVCache, config: SchedulerConfig, max_seq_len: int, speculator=None):
        self.kv, self.config, self.max_seq_len, self.speculator = kv, config, max_seq_len, speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_tok_s = 0.0  # prompt rows per second of recent steps (0: not measured yet)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        self._admit()
        work: list[Work] = []
        decoding = [s for s in self.running if s.pending == 1]
        for seq in decoding:
            if seq.status is Status.RUNNING and self._reserve(seq, seq.num_computed + 1):
                work.append(Work(seq, 1))
        work = [w for w in work if w.seq.status is Status.RUNNING]  # a later one's reserve may preempt an earlier
        self._draft(work)
        budget = self.config.max_batched_tokens - sum(w.rows + len(w.draft or ()) for w in work)
        if self.prefill_tok_s:
            if work:
                budget = min(budget, max(self.kv.block_size, int(self.prefill_tok_s * self.config.decode_gap_s)))
            else:
                budget = min(budget, max(self.kv.block_size, self.config.min_prefill_rows,
                                         int(self.prefill_tok_s * self.config.prefill_step_s)))
        prefilling = [s for s in self.running if s.pending > 1]
        for seq, n in zip(prefilling, fair_shares([s.pending for s in prefilling], budget)):
            if n > 0 and seq.status is Status.RUNNING and self._reserve(seq, seq.num_computed + n):
                work.append(Work(seq, n))
        return [w for w in work if w.seq.status is Status.RUNNING]

    def _draft(self, work: list[Work]):
        """Each decoding sequence's draft, chosen against the rows and tokens the step already has."""
        if self.speculator is None:
            return
        # Draft positions must stay inside the context, and drafting past max_tokens is wasted.
        budgets = [min(self.speculator.policy.max_nodes, w.seq.params.max_tokens - w.seq.num_output - 1,
                       self.max_seq_len - w.seq.num_computed - 1) for w in work]
        self.speculator.draft_chains([w.seq for w in work], budgets,
                                     lambda seq, tokens: self._reserve(seq, tokens, preempt=False))
        rows, tokens = len(work), float(len(work))
        for w, budget in zip(work, budgets):
            seq = w.seq
            rows, tokens = rows - 1, tokens - 1
            draft, expected = self.speculator.propose(seq, budget, rows, tokens) if budget > 0 else (None, 1.0)
            if draft is not None and not self._reserve(seq, seq.num_computed + 1 + len(draft), preempt=False):
                draft, expected = None, 1.0
            w.draft = draft
            rows, tokens = rows + 1 + len(draft or ()), tokens + expected

    def _admit(self):
        while self.waiting and len(self.running) < self.config.max_batch:
            seq = self.waiting[0]
            if not seq.table.blocks and self.config.prefix_cache:
                # At least one token must run through the model to give the next token's logits. While others run,
                # reading its prefix from disk stops after decode_gap_s and goes on in the next steps.
                deadline = time.perf_counter() + self.config.decode_gap_s if self.running else None
                seq.num_computed = self.kv.match_prefix(seq.table, seq.tokens, seq.salt, limit=len(seq.tokens) - 1,
                                                        disk_deadline=deadline)
                if seq.first_scheduled is None:  # a preempted sequence's second admission is not a cache hit
                    seq.timings.cached_tokens = seq.num_computed
                    seq.timings.disk_cached_tokens = min(seq.num_computed, seq.timings.disk_cached_tokens
                                                         + seq.table.from_disk * self.kv.block_size)
                if seq.table.disk_pending:  # its blocks so far stay cached in memory for the next step's match
                    self.kv.release(seq.table)
                    seq.num_computed = 0
                    return
            try:
                self.kv.reserve(seq.table, min(len(seq.tokens), seq.num_computed + self.kv.block_size))
            except NoFreeBlocks:
                self.kv.release(seq.table)
                seq.num_computed = 0
                return
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _reserve(self, seq: Sequence, tokens: int, preempt: bool = True) -> bool:
        """Blocks for `tokens` positions of seq, preempting the newest other sequences if need be; False if seq
        itself had to go (or, without preempting, if there is no room)."""
        while True:
            try:
                self.kv.reserve(seq.table, tokens)
                return True
            except NoFreeBlocks:
                if not preempt:
                    return False
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False

    def preempt(self, seq: Sequence):
        self.running.remove(seq)
        self.kv.commit(seq.table, seq.tokens, seq.num_computed, seq.salt)
        self.kv.release(seq.table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str):
        """Takes a sequence out, wherever it is; its computed full blocks stay cached for later requests."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.commit(seq.table, seq.tokens, seq.num_computed, seq.salt)
        self.kv.release(seq.table)
        seq.status, seq.finish_reason = Status.FINISHED, reason
