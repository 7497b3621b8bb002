"""The serving engine: requests in, tokens out, one step at a time -- schedule, run, postprocess -- over one paged KV
cache, in a thread of its own. Every entry point (`LLM`, the CLI, the server, the speed lab's local mode) goes through
it, so prefix caching, continuous batching, chunked prefill and speculation serve them all.

A step: the scheduler picks each running sequence's rows (a decode row and its draft, or a prompt chunk); the runner
runs them all in one forward pass; the final norm and LM head run only on rows whose next token is due; each such
sequence samples (or verifies its draft), moves its accepted path's keys and values into place, appends its tokens
and posts them to its outbox. A sequence's output is the same alone or in a batch: every row's arithmetic in the
native runner is independent of the other rows (quantized weights; float32 matmuls may round differently by batch
size).
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import replace

import torch

from fastdecode.engine.kv_cache import BlockTable, KVCache
from fastdecode.engine.sampling import Sampler, SamplingParams
from fastdecode.engine.scheduler import Scheduler, SchedulerConfig, Work, prefill_floor
from fastdecode.engine.sequence import Sequence
from fastdecode.errors import InvalidRequestError
from fastdecode.kernels.openmp import release_openmp_workers
from fastdecode.runners import Batch
from fastdecode.speculative.policy import CostModel, probe_tokens
from fastdecode.speculative.verify import verify

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, kv: KVCache, runner, max_seq_len: int, config: SchedulerConfig | None = None,
                 speculator=None, background: bool = True):
        """background=False: no thread of its own; the caller drives it with pump() (deterministic tests)."""
        self.model, self.kv, self.runner, self.max_seq_len = model, kv, runner, max_seq_len
        self.background = background
        config = config or SchedulerConfig()  # the caller's is left as it is (one may serve several engines)
        self.config = replace(config, min_prefill_rows=max(config.min_prefill_rows, prefill_floor(model.config)))
        self.speculator = speculator
        self.scheduler = Scheduler(kv, self.config, max_seq_len, speculator)
        self.cv = threading.Condition()
        self.incoming: list[Sequence] = []
        self.aborted: list[Sequence] = []
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.threads = torch.get_num_threads()  # the engine thread's own OpenMP setting starts at the default
        self.steps = 0

    # ---- requests (any thread) -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, logits_processor=None,
                    stop_ids: set[int] = frozenset(), salt: str = "", tenant: str | None = "") -> Sequence:
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must lie in the vocabulary [0, {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.kv.capacity:
            raise InvalidRequestError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                      f"needs more than the KV cache's {self.kv.capacity} token slots")
        sampler = Sampler(params, self.model.config.vocab_size, prompt_ids, logits_processor)
        seq = Sequence(list(prompt_ids), params, sampler, set(stop_ids), salt, tenant)
        if self.background:  # the engine's thread must be the only one with OpenMP workers (kernels/openmp.py)
            release_openmp_workers()
        with self.cv:
            self.incoming.append(seq)
            self.cv.notify()
            if self.background and self.thread is None:
                self.thread = threading.Thread(target=_engine_thread, args=(weakref.ref(self), self.threads),
                                               name="fastdecode-engine", daemon=True)
                self.thread.start()
                _STARTED.add(self)
                _THREADS.add(self.thread)
        return seq

    def abort(self, seq: Sequence):
        """Ends a request early (its reader went away, or a stop string matched); its blocks are freed at once."""
        with self.cv:
            self.aborted.append(seq)
            self.cv.notify()

    def stop(self, timeout: float = 5.0):
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.incoming)

    # ---- the loop (engine thread) --------------------------------------------------------------------------------
    def wait_for_work(self, timeout: float) -> bool:
        """Blocks until there is something to do or `timeout` passes -> whether there is (or it is stopping)."""
        with self.cv:
            return self.cv.wait_for(lambda: self.stopping or self.incoming or self.aborted or self.scheduler.has_work(),
                                    timeout)

    def pump(self) -> bool:
        """Takes in new and aborted requests, then runs one step -> whether there was anything to run."""
        with self.cv:
            incoming, self.incoming = self.incoming, []
            aborted, self.aborted = self.aborted, []
        for seq in incoming:
            if self.speculator is not None:
                self.speculator.start(seq)
            self.scheduler.add(seq)
        for seq in aborted:
            if not seq.finished:
                self._finish(seq, "abort")
        return self.step()

    @torch.inference_mode()
    def step(self) -> bool:
        """One forward pass over what the scheduler picks -> whether there was anything to run."""
        work = self.scheduler.schedule()
        if not work:
            return False
        t0 = time.perf_counter()
        for w in work:
            if w.seq.first_scheduled is None:
                w.seq.first_scheduled = t0
        try:
            batch = self._batch(work)
            taps = self.speculator.taps if self.speculator is not None else None
            hidden, taps = self.runner.forward_taps(batch, taps) if taps else (self.runner.forward(batch), None)
            logits = self.model.head(hidden[batch.logit_rows]) if batch.logit_rows.numel() else None
        except Exception as e:  # the forward failed: every sequence in it ends with the error
            log.exception("engine step failed")
            for w in work:
                self._fail(w.seq, e)
            return True
        seconds = time.perf_counter() - t0
        self._postprocess(work, logits, seconds, batch.seq_rows.tolist(), taps)
        self._learn_speed(work, batch.num_rows, seconds)
        self.steps += 1
        return True

    def _batch(self, work: list[Work]) -> Batch:
        """The step's rows, with which of them need logits."""
        tokens, positions, slots, seq_rows, context, masks, logit_rows = [], [], [], [0], [], [], []
        prompt_end = [len(w.seq.prompt_ids) for w in work]
        for w in work:
            seq, start = w.seq, w.seq.num_computed
            if w.draft is None:
                toks, pos, mask = seq.tokens[start:start + w.rows], list(range(start, start + w.rows)), None
            else:  # the root (the last sampled token) and the draft's nodes
                toks, pos_t, mask = w.draft.tree_inputs(seq.tokens[-1], start)
                pos = pos_t.tolist()
            r = len(tokens)
            if w.samples:
                logit_rows += [r + len(toks) - 1] if w.draft is None else list(range(r, r + len(toks)))
            tokens += toks
            positions += pos
            slots += self.kv.slots(seq.table, start, start + len(toks))
            seq_rows.append(len(tokens))
            context.append(start)
            masks.append(mask)
        width = max(len(w.seq.table.blocks) for w in work)
        tables = torch.tensor([w.seq.table.blocks + [0] * (width - len(w.seq.table.blocks)) for w in work],
                              dtype=torch.long)
        tree_mask = None
        if any(m is not None for m in masks):
            R = len(tokens)
            tree_mask = torch.zeros(R, R, dtype=torch.bool)
            for (r0, r1), m in zip(zip(seq_rows, seq_rows[1:]), masks):
                tree_mask[r0:r1, r0:r1] = m if m is not None else torch.ones(r1 - r0, r1 - r0, dtype=torch.bool).tril()
        return Batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.tensor(seq_rows),
                     torch.tensor(context), tables, self.kv.block_size, tree_mask, torch.tensor(prompt_end),
                     torch.tensor(logit_rows, dtype=torch.long))

    def _postprocess(self, work: list[Work], logits: torch.Tensor | None, seconds: float, seq_rows: list[int],
                     taps: torch.Tensor | None):
        """taps: the step's rows' residuals that the drafters read (EAGLE), handed over for the rows that stay."""
        row = 0
        for w, r0 in zip(work, seq_rows):
            seq = w.seq
            if taps is not None and w.draft is None:  # (a verified draft's: its root and accepted path, below)
                self.speculator.feed(seq, seq.num_computed, taps[r0:r0 + w.rows])
            if not w.samples:  # a prompt chunk short of the end
                seq.num_computed += w.rows
                self.kv.commit(seq.table, seq.tokens, seq.num_computed, seq.salt)
                continue
            n = 1 + len(w.draft or ())
            rows, row = logits[row:row + n], row + n
            verdict = None
            try:
                if w.draft is None:
                    y = seq.sampler.sample(rows[0])
                    seq.sampler.accept(y, rows[0])
                    emitted = [y]
                    seq.num_computed += w.rows
                else:
                    verdict = verify(w.draft, rows, seq.sampler, seq.stop_ids)
                    if taps is not None:
                        self.speculator.feed(seq, seq.num_computed, taps[[r0] + [r0 + 1 + i for i in verdict.path]])
                    self._keep_path(seq, verdict.path)
                    seq.num_computed += 1 + len(verdict.path)
                    emitted = verdict.tokens
            except Exception as e:  # this request's sampling failed (a logits processor raised): it alone ends
                self._fail(seq, e)
                continue
            if self.speculator is not None:
                self.speculator.record(seq, verdict, seconds)
            self.kv.commit(seq.table, seq.tokens, seq.num_computed, seq.salt)
            self._emit(seq, emitted)

    def _keep_path(self, seq: Sequence, path: list[int]):
        """Moves the accepted nodes' keys and values to the positions right after the root, where a chain already
        has them; a tree's other branches are overwritten later."""
        if path != list(range(len(path))):
            root = seq.num_computed
            self.kv.move([self.kv.slot(seq.table, root + 1 + i) for i in path],
                         self.kv.slots(seq.table, root + 1, root + 1 + len(path)))

    def _emit(self, seq: Sequence, emitted: list[int]):
        now = time.perf_counter()
        t = seq.timings
        if seq.first_token is None:
            seq.first_token = now
            t.prompt_tokens = len(seq.prompt_ids)
            t.ttft_s, t.prefill_s = now - seq.arrival, now - seq.first_scheduled
        out, reason = [], None
        for y in emitted:
            seq.tokens.append(y)
            out.append(y)
            if y in seq.stop_ids:
                reason = "stop"
                break
            if seq.num_output >= seq.params.max_tokens:
                reason = "length"
                break
        t.output_tokens, t.decode_s = seq.num_output, now - seq.first_token
        seq.post("tokens", out)
        if reason is not None:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str):
        if self.speculator is not None:
            self.speculator.finish(seq)
        self.scheduler.finish(seq, reason)
        seq.post("finished", reason)

    def _fail(self, seq: Sequence, error: Exception):
        if not seq.finished:
            if self.speculator is not None:
                self.speculator.finish(seq, learn=False)
            self.scheduler.finish(seq, "error")
            seq.post("error", error)

    def _learn_speed(self, work: list[Work], rows: int, seconds: float):
        """Prompt rows per second (to size chunks while others decode); a decode-only step's cost by rows (for the
        speculation policy, which follows a machine that got busier or quieter)."""
        prompt_rows = sum(w.rows for w in work if w.rows > 1)
        if prompt_rows:
            rate = rows / seconds
            s = self.scheduler
            s.prefill_tok_s = rate if not s.prefill_tok_s else 0.7 * s.prefill_tok_s + 0.3 * rate
        elif self.speculator is not None:
            self.speculator.policy.cost.observe(rows, seconds)

    # ---- start-up measurement ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def measure_cost(self, sizes, context: int = 64) -> CostModel:
        """The forward's time by rows, for one sequence at `context` tokens (scratch blocks, freed after)."""
        room = min(self.max_seq_len, self.kv.capacity)
        sizes = [n for n in sizes if n < room]
        context = max(0, min(context, room - sizes[-1]))
        table = BlockTable()
        self.kv.reserve(table, context + sizes[-1])

        def forward(n: int, start: int = context):  # every row's logits, as a verify step's
            batch = self.kv.batch([(table, probe_tokens(n, self.model.config.vocab_size), start)])
            batch = replace(batch, logit_rows=torch.arange(n))
            self.model.head(self.runner.forward(batch)[batch.logit_rows])

        try:
            if context:
                forward(context, 0)
            return CostModel.measure(forward, sizes)
        finally:
            self.kv.release(table)


# Engines whose thread runs, and those threads. A daemon thread still inside an OpenMP region or freeing tensors
# when the interpreter exits makes the process abort ("terminate called without an active exception", exit code 134)
# after the program's work is done, so every engine is stopped, and every engine thread joined, before exit. The
# threads are tracked apart: an engine that only its own thread still held is freed in that thread (a model's worth of
# tensors), after it has left _STARTED.
_STARTED: weakref.WeakSet = weakref.WeakSet()
_THREADS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_engines():
    for engine in list(_STARTED):
        engine.stop()
    for thread in list(_THREADS):
        thread.join(5.0)


@torch.inference_mode()
def _engine_thread(ref: weakref.ref, threads: int):
    """The engine's loop. It holds the engine only while working or waiting a second for work, so an engine (and its
    model) that nobody else references is collected and its thread ends."""
    torch.set_num_threads(threads)  # a new thread starts with OpenMP's default, not the caller's setting
    while (engine := ref()) is not None and not engine.stopping:
        if engine.wait_for_work(1.0) and not engine.stopping:
            engine.pump()
        del engine
