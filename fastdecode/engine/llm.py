"""The Python API: `LLM(model).generate(prompt, SamplingParams(...))`, `.stream(...)`, `.chat(messages)`."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from fastdecode.engine.detokenize import IncrementalDetokenizer
from fastdecode.engine.generate import Timings, generate_tokens
from fastdecode.engine.sampling import Sampler, SamplingParams
from fastdecode.errors import InvalidRequestError
from fastdecode.kernels.decoder import native_decoder
from fastdecode.loading import load_model, load_tokenizer, resolve_quant
from fastdecode.loading.catalog import DEFAULT_MODEL, resolve
from fastdecode.speculative import build_speculator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", quant: str | None = None,
                 group_size: int = 32, threads: int | None = None, max_seq_len: int = 4096, native: bool = True,
                 speculate: str = "none", progress=None, log=lambda *a: None, load=load_model):
        """quant None runs a GGUF file in its own formats and a directory in float; "none" asks for float weights.
        `load(path, dtype, progress, quant) -> model` builds the model (tensor parallelism passes its shard loader)."""
        if dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
        if threads:
            torch.set_num_threads(threads)
        self.path = resolve(model, log=log)
        self.name = model
        self.dtype = dtype
        self.quant = quant = resolve_quant(self.path, quant)
        self.model = load(self.path, DTYPES[dtype], progress, quant)
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.path)
        if quant not in (None, "gguf"):  # "gguf" is the loaded format itself
            from fastdecode.quant import quantize_model
            quantize_model(self.model, quant, group_size=group_size)
        self.max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.model.setup_cache(self.max_seq_len)
        self.decoder = native_decoder(self.model) if native else None  # None: PyTorch's forward decodes
        self.lock = threading.Lock()  # one request at a time owns the KV cache
        self.speculate = speculate
        self.speculator = build_speculator(speculate, self, log=log)  # None: plain decode

    # ---- prompts -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation --------------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               logits_processor=None) -> Iterator[StreamChunk]:
        """Yields a chunk per output token and a last chunk carrying the Completion. `logits_processor`: see Sampler.
        Closing the iterator early (a client went away) ends the request and frees the cache."""
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_seq_len} tokens")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        timings, output, finish, stats = Timings(), [], "length", None
        with self.lock:
            sampler = Sampler(params, self.config.vocab_size, prompt_ids, logits_processor)
            if self.speculator is not None and params.max_tokens > 1:
                tokens, stats = self.speculator.generate_tokens(prompt_ids, sampler, params.max_tokens, stop_ids,
                                                                timings)
            else:
                tokens = generate_tokens(self.model, prompt_ids, sampler, params.max_tokens, stop_ids, timings,
                                         self.decoder)
            for i, token in enumerate(tokens):
                if token in stop_ids:
                    finish = "stop"
                    break
                output.append(token)
                logprobs = sampler.logprobs[i:i + 1] if params.logprobs is not None else None
                delta = detok.add(token)
                if detok.stopped:
                    finish = "stop"
                    if delta:
                        yield StreamChunk(delta, [token], logprobs)
                    break
                yield StreamChunk(delta, [token], logprobs)
        tail = "" if detok.stopped else detok.flush()
        completion = Completion(detok.text, output, prompt_ids, finish, timings,
                                stats.as_dict() if stats is not None else None,
                                sampler.logprobs[:len(output)] if params.logprobs is not None else None)
        yield StreamChunk(tail, [], None, completion)

    def generate(self, prompts: str | list[int] | list[str], params: SamplingParams | None = None):
        """One prompt (text or token ids) -> Completion; a list of text prompts -> list of Completion."""
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], str):
            return [self.generate(p, params) for p in prompts]
        *_, last = self.stream(prompts, params)
        return last.completion

    def chat(self, messages: list[dict], params: SamplingParams | None = None, tools=None) -> Completion:
        return self.generate(self.chat_prompt(messages, tools), params)

    def chat_stream(self, messages: list[dict], params: SamplingParams | None = None, tools=None,
                    logits_processor=None):
        return self.stream(self.chat_prompt(messages, tools), params, logits_processor)

    # ---- accounting --------------------------------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every matrix once; the embedding only one row."""
        total = 0
        for module in self.model.modules():
            if hasattr(module, "weight_bytes"):
                total += module.weight_bytes()
            elif isinstance(module, nn.Embedding):
                total += module.weight[0].nbytes
            else:
                total += sum(p.nbytes for p in module.parameters(recurse=False))
        return total

    def kv_bytes_per_token(self, context: int) -> int:
        """KV-cache bytes one decode step reads at a given context length."""
        c = self.config
        element = torch.finfo(DTYPES[self.dtype]).bits // 8
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * context * element
