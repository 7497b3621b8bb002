"""What speculation did for one request (its `speculation` in a Completion), and the gate that decides, per request,
whether a drafter that runs a model is worth its cost this step."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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
    """Whether a model drafter is worth its cost for a request this step: yes while the steps that used it beat plain
    decoding, otherwise only now and then (a back-off that doubles) to notice when the content changes."""

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
