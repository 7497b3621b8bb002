"""The roofline: the fastest batch-1 decode (and prefill) a model can reach on a hardware route.

One decode step reads the active weights and the KV cache once, does 2 FLOPs per active weight plus attention, and
on several chips waits for the interconnect. Memory and compute overlap, communication does not:

    step = max(bytes / bandwidth, FLOPs / compute, pipeline latency) + communication
    decode_tok_s_ceiling = accept_length / (verify step + draft time)    (accept_length 1: one token per step)

Tensor parallelism over t chips divides the bytes and FLOPs by t and adds two all-reduces per layer; pipeline
stages at batch 1 run one after another, so they add capacity and hops but no speed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from fastdecode.errors import FastdecodeError
from fastdecode.roofline.hardware import Hardware
from fastdecode.roofline.models import ModelSpec, get_model


class ScenarioError(FastdecodeError):
    """Inputs that do not make a scenario (speculation that accepts more than it drafts, TP without links...)."""


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    hardware: Hardware
    dtype: str | None = None  # weight format; None: as published (exact tensor bytes for a GGUF)
    kv_dtype: str = "bf16"
    group_size: int = 128  # int4 scale group
    context: int = 1024  # tokens in the KV cache while decoding
    prompt: int | None = None  # prompt tokens for TTFT; None: `context`
    tp: int | None = None  # None (with pp None): as few chips as the weights need
    pp: int | None = None
    accept_length: float = 1.0  # mean tokens per verify step, bonus token included (1: no speculation)
    draft_tokens: int | None = None  # tokens drafted per step; None: max(4, ceil(accept_length - 1))
    draft_cost: float = 0.0  # drafter time per step as a fraction of one plain decode step (0: n-gram lookup)
    allreduce_us: float | None = None  # overrides the hardware's interconnect latency per step
    price_per_hour: float | None = None  # overrides the hardware's price per chip-hour
    bytes_per_token: float | None = None  # a measured engine's own bytes per decode step (replaces weights + KV)
    act_bits: int = 16  # activations sent between chips


@dataclass
class Step:
    bytes_per_chip: float
    memory_s: float
    compute_s: float
    latency_s: float  # pipeline depth of a hardwired chip
    comm_s: float

    @property
    def total_s(self) -> float:
        return max(self.memory_s, self.compute_s, self.latency_s) + self.comm_s

    @property
    def bound(self) -> str:
        parts = {"memory": self.memory_s, "compute": self.compute_s, "latency": self.latency_s,
                 "interconnect": self.comm_s}
        return max(parts, key=parts.get)


@dataclass
class Result:
    model: str
    hardware: str
    weights: str  # the weight format counted
    chips: int
    tp: int
    pp: int
    chips_needed: int
    fits: bool
    context: int
    resident_gb: float  # weights + KV cache that must be held, all chips together
    weight_bytes_per_token: float
    kv_bytes_per_token: float
    bytes_per_token: float  # weights + KV one decode step reads, all chips together
    bytes_per_chip: float
    bandwidth_gb_s: float
    decode_tok_s_ceiling: float
    bound: str  # the largest term of the step: memory | compute | latency | interconnect
    memory_bound_tok_s: float | None
    compute_bound_tok_s: float | None
    step: dict  # seconds per term of the step the ceiling divides (the verify step when speculating)
    speculation_multiplier: float
    accept_length: float
    draft_tokens: int
    prompt_tokens: int
    ttft_s: float
    prefill_tok_s_ceiling: float
    prefill_bound: str
    compute_precision: str | None
    price_per_hour: float | None
    cost_per_million_tokens: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _weight_format(s: Scenario) -> tuple[str | None, str]:
    """(dtype passed to the byte counts, label shown)."""
    hw, m = s.hardware, s.model
    if hw.weights_in_logic:
        return hw.dtype, f"{hw.dtype} (wired in)"
    if s.dtype:
        return s.dtype, s.dtype
    if m.gguf:
        return None, f"gguf {m.gguf.format} (exact tensor bytes)"
    return None, m.dtype + (f", {m.expert_dtype} experts" if m.expert_dtype else "")


def _plan(s: Scenario, resident: float) -> tuple[int, int, int]:
    """(tp, pp, chips needed to hold the model)."""
    hw, m = s.hardware, s.model
    if hw.weights_in_logic:  # a chip holds as many weights as the model it was built for
        needed = math.ceil(m.total_params() / get_model(hw.model).total_params())
    elif hw.memory_gb > 0:
        needed = max(1, math.ceil(resident / (hw.memory_gb * 1e9)))
    else:
        needed = 1
    if s.tp or s.pp:  # a given --tp gets as many pipeline stages as the weights need, unless --pp is given too
        tp = s.tp or 1
        return tp, s.pp or max(1, math.ceil(needed / tp)), needed
    if hw.multi_chip == "pp":
        return 1, needed, needed
    tp = 2 ** math.ceil(math.log2(needed)) if hw.kind == "gpu" else needed
    cap = hw.scale_up or tp
    return (tp, 1, needed) if tp <= cap else (cap, math.ceil(needed / cap), needed)


def _step(s: Scenario, dtype: str | None, tp: int, pp: int, tokens: int, context: int, kv_moved: float,
          weight_bytes: float, sampled: int | None = None) -> Step:
    hw, m = s.hardware, s.model
    kv_split = 1 if m.mla else min(tp, m.num_key_value_heads)  # an MLA latent is replicated on every TP rank
    memory = weight_bytes / tp + kv_moved / kv_split
    memory_s = memory / (hw.bandwidth_gb_s * 1e9) if hw.bandwidth_gb_s else 0.0
    tflops, _ = hw.compute_tflops(dtype or m.dtype)
    compute_s = m.flops(tokens, context, sampled) / (tp * tflops * 1e12) if tflops else 0.0
    latency_s = (m.num_hidden_layers + tokens - 1) * hw.layer_latency_us * 1e-6  # tokens follow each other
    comm_s = 0.0
    if tp > 1 or pp > 1:
        link = (hw.interconnect_gb_s or 0) * 1e9
        latency_us = s.allreduce_us if s.allreduce_us is not None else hw.latency_us
        if not link and latency_us is None:
            raise ScenarioError(f"{hw.name} has no interconnect figures: use one chip (--tp 1 --pp 1)")
        hop = (latency_us or 0.0) * 1e-6
        message = m.hidden_size * tokens * s.act_bits / 8 / link if link else 0.0  # seconds on one link
        if tp > 1:  # two all-reduces per layer (attention out, MLP out) and one gather of the logits
            allreduce = hop * math.ceil(math.log2(tp)) + 2 * (tp - 1) / tp * message
            comm_s += (2 * m.num_hidden_layers + 1) * allreduce
        comm_s += (pp - 1) * (hop + message)
    return Step(memory, memory_s, compute_s, latency_s, comm_s)


def roofline(s: Scenario) -> Result:
    hw, m = s.hardware, s.model
    if s.accept_length < 1:
        raise ScenarioError("--accept-length is tokens per verify step, at least 1")
    draft_tokens = s.draft_tokens or max(4, math.ceil(s.accept_length - 1))
    if s.accept_length > draft_tokens + 1:
        raise ScenarioError(f"accept length {s.accept_length} exceeds {draft_tokens} drafted tokens + 1 bonus")
    if s.context < 0 or (s.prompt or 0) < 0 or (s.tp or 1) < 1 or (s.pp or 1) < 1:
        raise ScenarioError("context and prompt must be at least 0, --tp and --pp at least 1")
    notes = []
    dtype, label = _weight_format(s)
    if hw.weights_in_logic:
        if s.dtype and s.dtype != hw.dtype:
            notes.append(f"{hw.name} wires weights in {hw.dtype}; --dtype {s.dtype} ignored")
        if hw.model != m.name:
            notes.append(f"{hw.name} is built for {hw.model}: this is a hypothetical chip of the same design")
        notes.append("weights are wired into logic: no weight bytes are read; the limit is the pipeline depth")
    prompt = s.context if s.prompt is None else s.prompt
    weight_read = m.weight_bytes(dtype, 1, s.group_size)
    kv_read = m.kv_bytes(s.context, s.kv_dtype)
    resident = m.resident_weight_bytes(dtype, s.group_size) + m.kv_bytes(max(s.context, prompt), s.kv_dtype)
    tp, pp, needed = _plan(s, resident)
    if tp * pp < needed:
        notes.append(f"does not fit: needs {needed} chips of {hw.memory_gb:g} GB, the route has {tp * pp}")
    elif not (s.tp or s.pp) and needed > 1:
        notes.append(f"weights need {needed} chips: tp={tp}, pp={pp}")
    counted_weights = 0.0 if hw.weights_in_logic else weight_read
    if s.bytes_per_token is not None:  # a measured engine's own count of what one step reads
        plain = _step(s, dtype, tp, pp, 1, s.context, 0.0, s.bytes_per_token)
    else:
        plain = _step(s, dtype, tp, pp, 1, s.context, kv_read, counted_weights)
    if plain.total_s <= 0:
        raise ScenarioError(f"{hw.name} has no bandwidth, compute or latency figure to bound a step")
    step, tok_s = plain, 1.0 / plain.total_s
    if s.accept_length > 1:
        tokens = draft_tokens + 1  # the verifier reads the weights (and, for MoE, more experts) once for all
        verify_weights = 0.0 if hw.weights_in_logic else m.weight_bytes(dtype, tokens, s.group_size)
        step = _step(s, dtype, tp, pp, tokens, s.context, kv_read, verify_weights)
        tok_s = s.accept_length / (step.total_s + s.draft_cost * plain.total_s)
    prefill_weights = 0.0 if hw.weights_in_logic else m.weight_bytes(dtype, max(prompt, 1), s.group_size)
    prefill = _step(s, dtype, tp, pp, max(prompt, 1), 0, m.kv_bytes(prompt, s.kv_dtype), prefill_weights,
                    sampled=1)
    price = s.price_per_hour if s.price_per_hour is not None else hw.price_per_hour
    bytes_per_token = s.bytes_per_token if s.bytes_per_token is not None else counted_weights + kv_read
    if not hw.bandwidth_gb_s:
        notes.append(f"{hw.name} publishes no memory bandwidth: memory time not counted")
    _, precision = hw.compute_tflops(dtype or m.dtype)
    if precision is None:
        notes.append(f"{hw.name} publishes no compute figure: compute time not counted")
    return Result(
        model=m.name, hardware=hw.name, weights=label, chips=tp * pp, tp=tp, pp=pp, chips_needed=needed,
        fits=tp * pp >= needed, context=s.context, resident_gb=resident / 1e9,
        weight_bytes_per_token=counted_weights if s.bytes_per_token is None else s.bytes_per_token,
        kv_bytes_per_token=kv_read if s.bytes_per_token is None else 0.0,
        bytes_per_token=bytes_per_token, bytes_per_chip=plain.bytes_per_chip,
        bandwidth_gb_s=hw.bandwidth_gb_s, decode_tok_s_ceiling=tok_s, bound=step.bound,
        memory_bound_tok_s=1 / plain.memory_s if plain.memory_s else None,
        compute_bound_tok_s=1 / plain.compute_s if plain.compute_s else None,
        step={"memory_s": step.memory_s, "compute_s": step.compute_s, "latency_s": step.latency_s,
              "comm_s": step.comm_s, "total_s": step.total_s},
        speculation_multiplier=tok_s * plain.total_s, accept_length=s.accept_length,
        draft_tokens=draft_tokens if s.accept_length > 1 else 0, prompt_tokens=prompt,
        ttft_s=prefill.total_s, prefill_tok_s_ceiling=max(prompt, 1) / prefill.total_s, prefill_bound=prefill.bound,
        compute_precision=precision, price_per_hour=price,
        cost_per_million_tokens=price * tp * pp / 3600 / tok_s * 1e6 if price else None, notes=notes)


def prefill_ceiling(model: ModelSpec, tokens: int, context: int, tflops: float, read_s: float = 0.0) -> float:
    """Prompt tokens per second that a machine computing at `tflops` cannot beat, for `tokens` new tokens after
    `context` cached ones: their matmuls, their causal attention, and the LM head for the last row only; or, for a
    short prompt, the `read_s` it takes to read the weights once."""
    return tokens / max(model.flops(tokens, context, sampled=1) / (tflops * 1e12), read_s)
