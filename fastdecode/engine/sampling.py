"""Sampling parameters and the logits -> token step (greedy when temperature is 0)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastdecode.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_STOP_STRINGS = 16  # OpenAI allows 4; the matcher's cost grows with their total length, not their count
MAX_STOP_CHARS = 1024  # per stop string: far beyond any real stop sequence, and it bounds the matcher's memory
STOP_LIMITS = f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each"
MIN_TEMPERATURE = 1e-3  # logits / temperature must stay finite in float32; callers map smaller values to greedy


def stop_within_limits(stop: list[str]) -> bool:
    return len(stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stop)


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # Hugging Face's rule, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI's rules, over output tokens only
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks decode a fixed number of tokens
    logprobs: int | None = None  # None: none; n: each output token's log-probability and its n most likely rivals
    keep_token_ids: list[int] = field(default_factory=list)  # special tokens whose text stays in the output (the
    # markers of a tool-call format, such as Mistral's [TOOL_CALLS]); every other special token is left out

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (math.isfinite(self.temperature) and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature),
             f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty must be in [0.01, 100]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (stop_within_limits(self.stop), STOP_LIMITS),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def argmax(logits: torch.Tensor) -> int:
    """The index of the first largest logit. On a CPU float32 vector NumPy's argmax is vectorised and torch's is not:
    4 against 70 microseconds over SmolLM2's 49,152 logits, paid once per output token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """A token drawn with probability proportional to `weights` (vocab,), non-negative and not all zero: one uniform
    number placed on the cumulative sum (in float64). torch.multinomial draws an exponential per token instead (the
    Gumbel trick): 1.8 ms over SmolLM2's 49,152 tokens on an AVX2 EPYC, a sixth of its decode step, where this takes
    0.1 ms. A token of weight 0 is never drawn: the search lands on the first sum above the uniform number."""
    cumulative = weights.double().cumsum(0)
    total = float(cumulative[-1])
    if not 0 < total < math.inf:  # NaN fails this too: a request whose logits went bad ends with an error
        raise ValueError("no token has a finite, positive probability")
    u = torch.rand((), dtype=torch.float64, generator=generator) * total
    i = int(torch.searchsorted(cumulative, u, right=True))
    return i if i < len(weights) else int(weights.nonzero()[-1])  # u rounded up to the total: the last possible token


class Sampler:
    """Per-request sampling state: the output so far (for penalties and logits processors) and a seeded generator.

    A logits processor is a callable (output_ids, logits) -> logits that masks or shifts logits before sampling,
    e.g. a JSON grammar; it sees exactly the tokens accepted so far, in plain and in speculative decoding alike."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int], logits_processor=None):
        self.params = params
        self.logits_processor = logits_processor
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        # The distinct tokens of prompt and output, for repetition_penalty: penalising them by index touches a few
        # hundred logits where a mask over the vocabulary touched them all (0.1-0.2 ms a token).
        self.seen: set[int] = set()
        self.seen_ids = torch.empty(vocab_size, dtype=torch.long)  # seen_ids[:len(seen)]
        # output only, for presence/frequency; none without them (an indexed add costs ~5 us a token)
        counted = params.presence_penalty or params.frequency_penalty
        self.counts = torch.zeros(vocab_size, dtype=torch.float32) if counted else None
        self.output: list[int] = []
        self.logprobs: list[dict] = []  # one entry per accepted token when params.logprobs is set
        if params.repetition_penalty != 1 and prompt_ids:
            distinct = torch.unique(torch.tensor(prompt_ids))
            self.seen_ids[:len(distinct)] = distinct
            self.seen.update(distinct.tolist())

    def accept(self, token: int, logits: torch.Tensor | None = None):
        """Appends a token to the output; `logits` (vocab,), the model's raw logits it was drawn from, records its
        log-probability when asked for."""
        if self.params.repetition_penalty != 1 and token not in self.seen:
            self.seen_ids[len(self.seen)] = token
            self.seen.add(token)
        if self.counts is not None:
            self.counts[token] += 1
        self.output.append(token)
        if self.params.logprobs is not None and logits is not None:
            logprobs = torch.log_softmax(logits.float(), -1)
            top = torch.topk(logprobs, self.params.logprobs) if self.params.logprobs else None
            self.logprobs.append({"token_id": token, "logprob": float(logprobs[token]),
                                  "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))})

    def allowed_draft(self, draft):
        """`draft` (speculative decoding's) cut to what the grammar allows after the output so far: a draft token it
        refuses could never be accepted, so it is not worth a row of the verify pass."""
        check = getattr(self.logits_processor, "draft_prefix", None)
        if draft is None or check is None:
            return draft
        return draft.allowed(lambda tokens: check(self.output, tokens))

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reshapes logits: the argmax of the raw logits is the token."""
        return self.params.greedy and not self.params.penalised and self.logits_processor is None

    def process(self, logits: torch.Tensor, masked: bool = True) -> torch.Tensor:
        """Processor, penalties, temperature and truncation applied to float32 logits (vocab,); -inf marks removed
        tokens. `masked` False: a grammar's mask is left out (see sample)."""
        p = self.params
        logits = logits.float()
        if self.logits_processor is not None:
            unmasked = getattr(self.logits_processor, "unmasked", None)
            logits = self.logits_processor(self.output, logits) if masked or unmasked is None else unmasked(logits)
        if p.repetition_penalty != 1 and self.seen:
            ids = self.seen_ids[:len(self.seen)]
            v = logits[ids]
            logits = logits.index_put((ids,), torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            logits = logits - p.presence_penalty * (self.counts > 0) - p.frequency_penalty * self.counts
        if p.greedy:
            return logits
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if p.min_p > 0:
            probs = torch.softmax(logits, -1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), -math.inf)
        if p.top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the token that crosses top_p
            logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from (one-hot for greedy)."""
        logits = self.process(logits)
        if self.params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        return torch.softmax(logits, -1)

    def sample(self, logits: torch.Tensor) -> int:
        """logits (vocab,) -> next token id. Under a grammar, the token drawn without its mask is kept when the
        grammar accepts it, and drawn again with the mask otherwise: the same distribution as masking first
        (engine/grammar.py), at the cost of a mask only where the model strays."""
        if self.plain_greedy:
            return argmax(logits)
        accepts = getattr(self.logits_processor, "accepts", None)
        if accepts is not None:
            token = self._draw(self.process(logits, masked=False))
            if accepts(self.output, token):
                return token
        return self._draw(self.process(logits))

    def _draw(self, logits: torch.Tensor) -> int:
        if self.params.greedy:
            return argmax(logits)
        return draw(torch.softmax(logits, -1), self.generator)
