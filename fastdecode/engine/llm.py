"""The Python API: `LLM(model).generate(prompt, SamplingParams(...))`, `.stream(...)`, `.chat(messages)`."""
from __future__ import annotations

import asyncio
import collections
import gc
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch
from torch import nn

from fastdecode.engine import kv_files
from fastdecode.engine.detokenize import IncrementalDetokenizer
from fastdecode.engine.engine import Engine
from fastdecode.engine.timings import Timings
from fastdecode.engine.kv_cache import BLOCK_SIZE, KVCache
from fastdecode.engine.kv_disk import DiskTier
from fastdecode.engine.sampling import SamplingParams
from fastdecode.engine.scheduler import SchedulerConfig
from fastdecode.engine.sequence import Sequence
from fastdecode.errors import InvalidRequestError
from fastdecode.kernels.openmp import release_openmp_workers
from fastdecode.loading import load_model, load_tokenizer, resolve_quant
from fastdecode.loading.catalog import DEFAULT_MODEL, resolve
from fastdecode.runners import build_runner
from fastdecode.speculative.batch import COST_SIZES, BatchSpeculator, check_speculate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CANCEL_POLL_S = 0.1  # how often a stream waiting for its next token looks whether it was cancelled
PROGRESS_POLL_S = 0.5  # how often a stream waiting for its first token reports the prefill's progress
KV_DTYPES = {"float16": torch.float16, "float32": torch.float32}  # what the native attention reads


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or stop string) or "length"
    timings: Timings
    speculation: dict | None = None  # SpeculationStats.as_dict() when a drafter ran
    logprobs: list[dict] | None = None  # per output token, when SamplingParams.logprobs is set

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": len(self.prompt_token_ids),
               "finish_reason": self.finish_reason, "timings": self.timings.as_dict()}
        if self.speculation is not None:
            out["speculation"] = self.speculation
        return out


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty while a UTF-8 character is incomplete)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # for token_ids, when SamplingParams.logprobs is set
    completion: Completion | None = None  # set on the last chunk


class ChunkMaker:
    """A request's tokens -> its chunks: the output ends at a stop token or stop string, text comes as it becomes
    whole characters, logprobs ride along, and the last chunk carries the Completion. The blocking and the asyncio
    streams share it."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, stop_ids: set[int]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop, params.keep_token_ids)
        self.prompt_ids, self.params, self.stop_ids = prompt_ids, params, stop_ids
        self.output: list[int] = []
        self.finish, self.done = "length", False
        self.sampler = self.timings = self.stats = None

    def add(self, token: int, sampler, timings, stats) -> StreamChunk | None:
        """-> the token's chunk, or None (a stop token; a stop string that ends exactly before it); sets `done` once
        the output has ended."""
        self.sampler, self.timings, self.stats = sampler, timings, stats
        if token in self.stop_ids:
            self.finish, self.done = "stop", True
            return None
        self.output.append(token)
        n = len(self.output)
        logprobs = sampler.logprobs[n - 1:n] if self.params.logprobs is not None else None
        delta = self.detok.add(token)
        if self.detok.stopped:
            self.finish, self.done = "stop", True
            if not delta:
                return None
        return StreamChunk(delta, [token], logprobs)

    def take(self, seq, kind: str, value) -> list[StreamChunk]:
        """One event from seq's outbox ("tokens" or "error"; not "finished") -> its tokens' chunks, up to the end of
        the output; raises the engine's exception."""
        if kind == "error":
            raise value
        stats = seq.speculation.stats if seq.speculation is not None else None
        chunks = []
        for token in value:
            if (chunk := self.add(token, seq.sampler, seq.timings, stats)) is not None:
                chunks.append(chunk)
            if self.done:
                break
        return chunks

    def last(self) -> StreamChunk:
        tail = "" if self.detok.stopped else self.detok.flush()
        logprobs = None
        if self.params.logprobs is not None:  # (no sampler yet: the request ended before its first token)
            logprobs = self.sampler.logprobs[:len(self.output)] if self.sampler is not None else []
        completion = Completion(self.detok.text, self.output, self.prompt_ids, self.finish,
                                self.timings or Timings(), self.stats.as_dict() if self.stats is not None else None,
                                logprobs)
        return StreamChunk(tail, [], None, completion)


class EngineStream:
    """A request on the engine read from an event loop (LLM.astream): an async iterator of its chunks."""

    def __init__(self, engine: Engine, seq, maker: ChunkMaker, on_prefill=None):
        self.engine, self.seq, self.maker, self.on_prefill = engine, seq, maker, on_prefill
        self.ready: collections.deque[StreamChunk] = collections.deque()
        self.ended = False
        loop, self.posted = asyncio.get_running_loop(), asyncio.Event()
        seq.notify = lambda: loop.call_soon_threadsafe(self.posted.set)  # (a post before this is in the outbox)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamChunk:
        try:
            while not self.ready:
                if self.ended:
                    raise StopAsyncIteration
                await self._next_event()
        except BaseException:
            self.close()  # an engine error, or the reader cancelled: the request ends
            raise
        return self.ready.popleft()

    async def _next_event(self):
        """Waits for the engine's next post and turns it into chunks; the last one once the output has ended."""
        seq = self.seq
        try:
            kind, value = seq.outbox.get_nowait()
        except queue.Empty:
            self.posted.clear()
            if seq.outbox.empty():  # a post after the clear sets it again
                try:
                    await asyncio.wait_for(self.posted.wait(), PROGRESS_POLL_S if self.on_prefill else None)
                except TimeoutError:
                    self.on_prefill(min(seq.num_computed, len(seq.prompt_ids)), len(seq.prompt_ids))
            return
        if self.on_prefill is not None:
            self.on_prefill(len(seq.prompt_ids), len(seq.prompt_ids))
            self.on_prefill = None
        if kind != "finished":
            self.ready.extend(self.maker.take(seq, kind, value))
        if kind == "finished" or self.maker.done:
            self.close()
            self.ready.append(self.maker.last())
            self.ended = True

    def close(self):
        """Ends the request in the engine unless it has finished (any thread)."""
        if not self.seq.finished:
            self.engine.abort(self.seq)


def kv_budget_tokens(config, dtype: torch.dtype, kv_cache_gb: float | None = None) -> int:
    """Tokens of keys and values the KV cache may hold: --kv-cache-gb's, else a quarter of the memory available now
    (at most 8 GiB). The cache's pages are made on first touch, so the budget costs nothing until it is used."""
    per_token = KVCache.bytes_per_token(config, dtype)
    return int((kv_cache_gb * 1e9) if kv_cache_gb else min(8 << 30, available_memory() // 4)) // per_token


@dataclass(frozen=True)
class Context:
    """The context length a model runs with, and what set it: start-up banners print it."""
    tokens: int
    trained: int  # the model's own (max_position_embeddings)
    set_by: str  # "trained", "kv budget" or "--max-seq-len"

    @classmethod
    def choose(cls, trained: int, requested: int | None, budget: int) -> "Context":
        """requested None: the model's trained context, as far as the KV budget holds one sequence of it (whole
        blocks). Asked for: that, up to the trained context (the cache then makes room for it)."""
        if requested is not None:
            return cls(min(requested, trained), trained, "trained" if requested >= trained else "--max-seq-len")
        fits = max(BLOCK_SIZE, budget // BLOCK_SIZE * BLOCK_SIZE)
        return cls(trained, trained, "trained") if trained <= fits else cls(fits, trained, "kv budget")

    def describe(self) -> str:
        if self.set_by == "trained":
            return f"{self.tokens:,} tokens (the model's trained context)"
        if self.set_by == "kv budget":
            return (f"{self.tokens:,} of the model's {self.trained:,} tokens, what the KV budget holds for one "
                    f"sequence (--kv-cache-gb raises it)")
        return f"{self.tokens:,} tokens (--max-seq-len; the model was trained for {self.trained:,})"

    def hint(self) -> str:
        """What an error about a too-long request says of the context: what set it, and the flag that raises it."""
        if self.set_by == "trained":
            return "(the model's trained context)"
        flag = "--kv-cache-gb" if self.set_by == "kv budget" else "--max-seq-len"
        return f"({flag} raises it, up to the model's {self.trained:,})"


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 8 << 30


class Prompts:
    """Text and chats -> a model's token ids, from its tokenizer and context (`tokenizer`, `context`): what the server
    asks of an LLM, and of a cluster's ingress (cluster/remote.py), which holds the tokenizer but no model."""
    tokenizer = context = None

    def context_hint(self) -> str:
        return self.context.hint()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """`template_kwargs`: extra variables the chat template reads (e.g. Qwen3's enable_thinking)."""
        return self.tokenizer.encode(self.render_chat(messages, tools, template_kwargs), add_special_tokens=False)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The chat template's text for `messages`, with the generation prompt (what chat_prompt tokenizes)."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                  **(template_kwargs or {}))


class LLM(Prompts):
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", quant: str | None = None,
                 group_size: int = 32, threads: int | None = None, max_seq_len: int | None = None, native: bool = True,
                 speculate: str = "none", progress=None, log=lambda *a: None, load=load_model,
                 max_batch: int = 8, kv_cache_gb: float | None = None, prefix_cache: bool = True,
                 kv_dtype: str = "float16", scheduler: SchedulerConfig | None = None,
                 kv_disk_gb: float | None = None):
        """quant None runs a GGUF file in its own formats and a directory in float; "none" asks for float weights.
        `load(path, dtype, progress, quant) -> model` builds the model (tensor parallelism passes its shard loader).
        Every request runs on the serving engine, with the drafters of `speculate`.
        kv_dtype: the engine's KV cache, float16 (half the memory and the attention reads of float32; keys and values
        are rounded to it once, when written) or float32 (the reference). kv_disk_gb: the prefix cache's disk tier
        under $FASTDECODE_HOME/kv (None: FASTDECODE_KV_DISK_GB, else 50 GB; 0: none)."""
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        if kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
        check_speculate(speculate)
        if threads:
            torch.set_num_threads(threads)
        # What the imports made (torch's module graph) lives as long as the process: frozen, no collection walks it
        # again. Each walk took ~70 ms, in the load (a vocabulary's 150k tuples set one off) and mid-stream later.
        gc.freeze()
        self.path = resolve(model, log=log)
        self.name = model
        self.dtype = dtype
        self.quant = quant = resolve_quant(self.path, quant)
        self.model = load(self.path, DTYPES[dtype], progress, quant)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.path)
        # (Before forget_parsed: a GGUF's digest hashes its header, which the loader parsed.)
        disk_tier = prefix_cache and kv_files.cap_bytes(kv_disk_gb) > 0
        weights = kv_files.weights_digest(self.path) if disk_tier else None
        from fastdecode.loading.gguf_file import forget_parsed  # (it imports gguf: not at `import fastdecode`)

        forget_parsed()  # the loader and the tokenizer shared one parse of a GGUF's header
        if quant not in (None, "gguf"):  # "gguf" is the loaded format itself
            from fastdecode.quant import quantize_model
            quantize_model(self.model, quant, group_size=group_size)
        self.context = Context.choose(self.config.max_position_embeddings, max_seq_len,
                                      kv_budget_tokens(self.config, KV_DTYPES[kv_dtype], kv_cache_gb))
        self.max_seq_len = self.context.tokens
        self.speculate = speculate
        self._build_engine(native, max_batch, kv_cache_gb, prefix_cache, KV_DTYPES[kv_dtype],
                           scheduler or SchedulerConfig())
        if weights is not None:
            self._attach_disk_tier(weights, kv_files.cap_bytes(kv_disk_gb), dict(
                quant=quant, group_size=group_size, dtype=dtype, kv_dtype=kv_dtype, runner=self.runner.name,
                config=repr(self.config)))

    def _build_engine(self, native: bool, max_batch: int, kv_cache_gb: float | None, prefix_cache: bool,
                      kv_dtype: torch.dtype, scheduler: SchedulerConfig):
        tokens = self._kv_tokens(kv_cache_gb, max_batch, kv_dtype)
        if tokens < self.max_seq_len:
            raise InvalidRequestError(f"a KV cache of {kv_cache_gb} GB holds {tokens} tokens, fewer than one "
                                      f"sequence of --max-seq-len {self.max_seq_len}")
        self.model.setup_rope(self.max_seq_len)
        kv = KVCache.for_model(self.config, tokens, kv_dtype, self.model.embed_tokens.weight.device)
        self.runner = self._runner(kv, native)
        scheduler = replace(scheduler, max_batch=max_batch, prefix_cache=prefix_cache)  # the caller's stays as it is
        self.engine = Engine(self.model, kv, self.runner, self.max_seq_len, scheduler)
        if self.speculate not in (None, "", "none"):
            self.engine.speculator = self.engine.scheduler.speculator = BatchSpeculator.build(
                self.speculate, self.engine.measure_cost(COST_SIZES), self)
        release_openmp_workers()  # loading ran here; from now on the engine's thread computes (kernels/openmp.py)

    def _kv_tokens(self, kv_cache_gb: float | None, max_batch: int, kv_dtype: torch.dtype) -> int:
        """The engine's KV-cache slots: what --kv-cache-gb holds, else room for max_batch full-length sequences
        within the budget, but never less than one full-length sequence and a batch of prompts' ends."""
        budget = kv_budget_tokens(self.config, kv_dtype, kv_cache_gb)
        if kv_cache_gb:
            return budget
        return max(min(max_batch * self.max_seq_len, budget), self.max_seq_len + max_batch * BLOCK_SIZE)

    def _runner(self, kv: KVCache, native: bool):
        """The engine's runner (tensor parallelism wraps it: parallel/llm.py)."""
        return build_runner(self.model, kv, native)

    def _attach_disk_tier(self, weights: bytes, cap: int, parts: dict):
        """The prefix cache's disk tier, where $FASTDECODE_HOME/kv can be made: else one warning, and none."""
        kv = self.engine.kv
        try:
            identity = kv_files.model_identity(self.path, weights, parts)
            kv.disk = DiskTier(identity, kv.k, kv.v, kv.block_size, cap)
        except OSError as e:
            logging.getLogger(__name__).warning("kv disk tier off: %s", e)

    @property
    def decode_path(self) -> str:
        """"native" (the C++ step) or "pytorch"."""
        return self.runner.name

    @property
    def slots(self) -> int:
        """Requests served at once: the engine's batch."""
        return self.engine.config.max_batch

    def status(self) -> dict:
        """What /health adds: the engine's requests running and waiting."""
        return {"engine_running": self.engine.num_running, "engine_waiting": self.engine.num_waiting}

    @property
    def kv(self) -> KVCache:
        return self.engine.kv

    # ---- generation --------------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, logits_processor=None,
               salt: str = "", tenant: str | None = "", cancel: threading.Event | None = None,
               on_prefill: Callable[[int, int], None] | None = None) -> Iterator[StreamChunk]:
        """Submits the request at once and returns an iterator of chunks: one per output token and a last one
        carrying the Completion. `logits_processor`: see Sampler. `salt` keeps prefix-cache sharing within a
        namespace; `tenant` does the same for the drafters' memory of earlier requests (None: no memory shared).
        Closing the iterator early (a client went away) ends the request and frees its cache blocks; so does
        setting `cancel` (from another thread), within CANCEL_POLL_S and the engine's step, even mid-prefill, when
        no chunk comes to close it after. `on_prefill(done, total)`: the prompt's tokens in the cache so far, at
        least every PROGRESS_POLL_S until the first token, then once with done == total (the batching engine only)."""
        return self._chunks(*self._submit(prompt, params, logits_processor, salt, tenant), cancel, on_prefill)

    def _chunks(self, seq, maker: ChunkMaker, cancel: threading.Event | None = None,
                on_prefill=None) -> Iterator[StreamChunk]:
        """Yields the request's chunks as the engine posts its tokens, then the last one; aborts the request if
        closed early or cancelled (the engine then frees its blocks)."""
        poll = CANCEL_POLL_S if cancel is not None else PROGRESS_POLL_S if on_prefill is not None else None
        try:
            while not maker.done:
                try:
                    kind, value = seq.outbox.get(timeout=poll)
                except queue.Empty:
                    if cancel is not None and cancel.is_set():
                        break
                    if on_prefill is not None:
                        on_prefill(min(seq.num_computed, len(seq.prompt_ids)), len(seq.prompt_ids))
                    continue
                if on_prefill is not None:
                    on_prefill(len(seq.prompt_ids), len(seq.prompt_ids))
                    on_prefill = None
                if kind == "finished":
                    break
                yield from maker.take(seq, kind, value)
        finally:
            if not seq.finished:
                self.engine.abort(seq)
        yield maker.last()

    def astream(self, prompt: str | list[int], params: SamplingParams | None = None, logits_processor=None,
                salt: str = "", tenant: str | None = "",
                on_prefill: Callable[[int, int], None] | None = None, session: str | None = None) -> "EngineStream":
        """stream() for an asyncio consumer (call it on the event loop), on the engine: the engine's thread wakes the
        loop when it posts, and no thread waits on the request. Its close() (a client that left, a time limit) ends
        the request in the engine at its next step, even mid-prefill; so does cancelling the task that reads it.
        `session` (the conversation a client named) is for a cluster's router; one engine has nothing to route."""
        return EngineStream(self.engine, *self._submit(prompt, params, logits_processor, salt, tenant), on_prefill)

    def _submit(self, prompt, params: SamplingParams | None, logits_processor, salt: str,
                tenant: str | None) -> tuple[Sequence, ChunkMaker]:
        """Adds the request to the engine -> its sequence and the maker of its chunks; InvalidRequestError if it
        cannot fit the context."""
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_seq_len} tokens {self.context_hint()}")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        seq = self.engine.add_request(prompt_ids, params, logits_processor, stop_ids, salt, tenant)
        return seq, ChunkMaker(self.tokenizer, prompt_ids, params, stop_ids)

    def generate(self, prompts: str | list[int] | list[str], params: SamplingParams | None = None):
        """One prompt (text or token ids) -> Completion; a list of text prompts -> list of Completion (submitted
        together: the engine batches them)."""
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], str):
            streams = [self.stream(p, params) for p in prompts]
            return [self._last(s) for s in streams]
        return self._last(self.stream(prompts, params))

    @staticmethod
    def _last(stream) -> Completion:
        *_, last = stream
        return last.completion

    def chat(self, messages: list[dict], params: SamplingParams | None = None, tools=None) -> Completion:
        return self.generate(self.chat_prompt(messages, tools), params)

    def chat_stream(self, messages: list[dict], params: SamplingParams | None = None, tools=None,
                    logits_processor=None, salt: str = "", tenant: str | None = "", on_prefill=None):
        return self.stream(self.chat_prompt(messages, tools), params, logits_processor, salt, tenant,
                           on_prefill=on_prefill)

    def close(self):
        """Stops the engine's thread (a finished program need not: it is a daemon)."""
        self.engine.stop()

    # ---- accounting --------------------------------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every matrix once; the embedding only one row."""
        total = 0
        for module in self.model.modules():
            if hasattr(module, "weight_bytes"):
                total += module.weight_bytes()
            elif isinstance(module, nn.Embedding):
                total += module.weight[:1].nbytes  # (none for a stand-in: its rows live in a kept module)
            else:
                total += sum(p.nbytes for p in module.parameters(recurse=False))
        return total

    def kv_bytes_per_token(self, context: int) -> int:
        """KV-cache bytes one decode step reads at a given context length."""
        return KVCache.bytes_per_token(self.config, self.kv.k[0].dtype) * context
