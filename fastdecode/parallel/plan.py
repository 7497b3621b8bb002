"""Which rows and columns of every weight one tensor-parallel rank holds (pure: no process group, no tensors).

Attention is split by whole KV groups: a rank holds some KV heads and every query head that reads them, so its
attention needs nothing from the other ranks. With fewer KV heads than ranks, the ranks sharing a KV head each
hold a copy of it (replicated) and split that head's query heads. Counts that do not divide evenly give some
ranks one group (or head) more than others; what cannot be split at all raises SplitError.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastdecode.config import ModelConfig
from fastdecode.errors import FastdecodeError

Range = tuple[int, int]  # [lo, hi)


class SplitError(FastdecodeError):
    """A model whose heads cannot be divided among the ranks asked for."""


def even_range(n: int, world: int, rank: int, unit: int = 1) -> Range:
    """Rank's share of n items handed out in units of `unit` items, as evenly as possible (n % unit == 0)."""
    units = n // unit
    return units * rank // world * unit, units * (rank + 1) // world * unit


def split_unit(n: int, world: int) -> int:
    """The coarsest of 256, 32 and 1 that still gives every rank a unit: 256-aligned MLP slices keep GGUF K-quant
    blocks and int4 groups whole on every rank."""
    return next(u for u in (256, 32, 1) if n % u == 0 and n // u >= world)


def head_ranges(heads: int, kv_heads: int, world: int, rank: int) -> tuple[Range, Range]:
    """(query heads, KV heads) of one rank; raises SplitError when no split exists."""
    group = heads // kv_heads  # query heads per KV head
    if kv_heads >= world:  # whole KV groups per rank
        kv = even_range(kv_heads, world, rank)
        return (kv[0] * group, kv[1] * group), kv
    share = world // kv_heads  # ranks per (replicated) KV head
    if world % kv_heads:
        raise SplitError(f"cannot split {kv_heads} KV heads across {world} ranks: with fewer KV heads than ranks, "
                         f"--tp must be a multiple of {kv_heads} (or at most {kv_heads})")
    if group < share:
        raise SplitError(f"cannot split {heads} attention heads across {world} ranks: every rank needs a query "
                         f"head of its own (--tp {heads} at most)")
    kv = rank // share
    lo, hi = even_range(group, share, rank % share)
    return (kv * group + lo, kv * group + hi), (kv, kv + 1)


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    head_dim: int
    num_heads: int  # the whole model's, to find the k and v rows in a packed qkv weight
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    heads: Range  # this rank's query heads
    kv_heads: Range
    intermediate: Range  # MLP columns (gate/up rows, down_proj columns)
    vocab: Range  # embedding and LM-head rows

    @classmethod
    def build(cls, config: ModelConfig, rank: int, world: int) -> "ShardPlan":
        if world < 1 or not 0 <= rank < world:
            raise SplitError(f"rank {rank} is not in a group of {world}")
        if config.num_experts:
            raise SplitError(f"tensor parallelism does not split mixture-of-experts models ({config.family}) yet")
        heads, kv = head_ranges(config.num_attention_heads, config.num_key_value_heads, world, rank)
        I, V = config.intermediate_size, config.vocab_size
        if I < world or V < world:
            raise SplitError(f"cannot split an MLP of {I} or a vocabulary of {V} across {world} ranks")
        return cls(rank, world, config.head_dim, config.num_attention_heads, config.num_key_value_heads, I, V,
                   heads, kv, even_range(I, world, rank, split_unit(I, world)), even_range(V, world, rank))

    def vocab_ranges(self) -> list[Range]:
        """Every rank's vocabulary rows, to reassemble gathered logits."""
        return [even_range(self.vocab_size, self.world, r) for r in range(self.world)]

    def rows(self, r: Range) -> Range:
        return r[0] * self.head_dim, r[1] * self.head_dim

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, lo, hi) of a Hugging Face-named checkpoint tensor this rank keeps, or None for all of it."""
        parts = name.split(".")
        module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
        if module == "q_proj":
            return (0, *self.rows(self.heads))
        if module in ("k_proj", "v_proj"):
            return (0, *self.rows(self.kv_heads))
        if module == "o_proj" and leaf == "weight":
            return (1, *self.rows(self.heads))
        if module in ("gate_proj", "up_proj"):
            return (0, *self.intermediate)
        if module == "down_proj" and leaf == "weight":
            return (1, *self.intermediate)
        if module in ("embed_tokens", "lm_head"):
            return (0, *self.vocab)
        return None

    def zeroed(self, name: str) -> bool:
        """A row-parallel layer's bias is added once, on rank 0; the all-reduce sums the ranks' partial outputs."""
        return self.rank != 0 and name.endswith(("o_proj.bias", "down_proj.bias"))
