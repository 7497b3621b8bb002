"""The KV cache: every layer's keys and values in fixed-size blocks of token slots, the one owner of them.

A sequence holds a block table (block ids in order); its token at logical position p lives in slot
table[p // block_size] * block_size + p % block_size of every layer. Blocks are reference counted. A full block whose
keys and values are final is registered under a hash of its tokens and of every token before it (a hash chain, salted
per tenant), so a later request with the same prefix takes the same blocks instead of computing them again
(automatic prefix caching). When its last user lets go, such a block stays cached, unreferenced, until a new block is
needed and it is the least recently used one (then it is evicted and reused); a block without a hash goes straight
back to the free list.

With a disk tier (kv_disk.py), a registered block is also written behind to disk, once, and a prefix match that runs
out of cached blocks goes on with the disk's: each one found is read into a free block and registered as if it had
been computed here. The hash chain is a cryptographic one (BLAKE2b), the same in every process, so that a block's
file is found again by a server started later.
"""
from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from fastdecode import memory
from fastdecode.layers.batch import Batch

BLOCK_SIZE = 32  # token slots per block: an eighth of the attention kernel's key chunk, read contiguously


class NoFreeBlocks(Exception):
    """Every block is referenced by a running sequence: the scheduler must wait or preempt."""


@dataclass
class BlockTable:
    """One sequence's blocks; `hashes[i]` is block i's prefix hash once it is registered."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    from_disk: int = 0  # of the blocks the last match_prefix gave, those read from the disk tier
    disk_pending: bool = False  # the last match_prefix stopped at its deadline with more of the prefix on disk


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32, device=None):
        self.block_size, self.num_blocks = block_size, num_blocks
        slots = num_blocks * block_size
        # (kv_heads, slots, head_dim) per layer: a KV group's keys for consecutive slots are contiguous.
        # Pages made as sequences first write them (fastdecode/memory.py): the part of the budget never used costs
        # neither memory nor start-up time.
        shape = (num_kv_heads, slots, head_dim)
        self.k = [memory.zeros(*shape, dtype=dtype, device=device, huge_pages=False) for _ in range(num_layers)]
        self.v = [memory.zeros(*shape, dtype=dtype, device=device, huge_pages=False) for _ in range(num_layers)]
        self.refs = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # never used or evicted; pop() takes block 0 first
        self.cached: dict[int, int] = {}  # prefix hash -> block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # checked on a hit: no false sharing
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody references, least recent first
        self.disk = None  # a kv_disk.DiskTier under the pool, or None
        # move(src, dst) -> None, called with each move before it is made here: tensor parallelism's rank 0 repeats
        # it on the other ranks' caches, whose slots mirror this one's (parallel/runner.py). None: nothing to tell.
        self.mirror = None

    @classmethod
    def for_model(cls, config, tokens: int, dtype=torch.float32, device=None, block_size: int = BLOCK_SIZE):
        blocks = -(-tokens // block_size)
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, blocks, block_size, dtype,
                   device)

    @staticmethod
    def bytes_per_token(config, dtype=torch.float32) -> int:
        elements = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return elements * torch.finfo(dtype).bits // 8

    @property
    def capacity(self) -> int:
        """Token slots in all."""
        return self.num_blocks * self.block_size

    @property
    def available(self) -> int:
        """Blocks that can be handed out now (free, or cached and idle)."""
        return len(self.free) + len(self.idle)

    # ---- prefix hashing --------------------------------------------------------------------------------------
    def _hash(self, parent: int, tokens: tuple[int, ...]) -> int:
        data = parent.to_bytes(16, "little") + array("I", tokens).tobytes()
        return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")

    @staticmethod
    def _root(salt: str) -> int:
        key = b"fastdecode-kv\0" + salt.encode("utf-8", "surrogatepass")  # any str: a lone surrogate from JSON too
        return int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")

    def prefix_hashes(self, tokens: list[int], salt: str = "") -> list[int]:
        """The hash chain of every full block of `tokens`."""
        out, parent, bs = [], self._root(salt), self.block_size
        for i in range(len(tokens) // bs):
            parent = self._hash(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    # ---- a sequence's blocks ---------------------------------------------------------------------------------
    def match_prefix(self, table: BlockTable, tokens: list[int], salt: str = "", limit: int | None = None,
                     disk_deadline: float | None = None) -> int:
        """Gives an empty table the longest run of cached blocks that begins `tokens` (at most `limit` tokens'
        worth), from memory or else from the disk tier -> the number of tokens it covers. A hit is a block whose
        hash and tokens both match. Past `disk_deadline` (time.perf_counter()) no more blocks are read from disk, but
        always one: table.disk_pending then says whether the next one was there."""
        assert not table.blocks
        bs = self.block_size
        limit = len(tokens) if limit is None else limit
        hashes = self.prefix_hashes(tokens[:limit - limit % bs], salt)
        table.from_disk, table.disk_pending = 0, False
        for i, h in enumerate(hashes):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            block = self.cached.get(h)
            if block is not None and self.block_tokens[block] != block_tokens:
                break
            if block is None:
                if table.from_disk and disk_deadline is not None and time.perf_counter() > disk_deadline:
                    table.disk_pending = self.disk is not None and self.disk.path(h).exists()
                    break
                block = self._from_disk(h, block_tokens, i)
                if block is None:
                    break
                table.from_disk += 1
            else:
                self._ref(block)
            table.blocks.append(block)
            table.hashes.append(h)
        return len(table.blocks) * bs

    def reserve(self, table: BlockTable, tokens: int):
        """Grows the table to cover `tokens` logical positions; raises NoFreeBlocks (taking nothing) if it can't."""
        need = -(-tokens // self.block_size) - len(table.blocks)
        if need <= 0:
            return
        if need > self.available:
            raise NoFreeBlocks(f"{need} blocks needed, {self.available} available")
        for _ in range(need):
            table.blocks.append(self._take())

    def commit(self, table: BlockTable, tokens: list[int], computed: int, salt: str = ""):
        """Registers the table's full blocks among the first `computed` positions (their keys and values are final)
        under their prefix hashes, so that later requests can share them."""
        bs, n = self.block_size, min(computed, len(tokens)) // self.block_size
        if len(table.hashes) >= n:
            return
        parent = table.hashes[-1] if table.hashes else self._root(salt)
        for i in range(len(table.hashes), n):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            parent = self._hash(parent, block_tokens)
            table.hashes.append(parent)
            block = table.blocks[i]
            if parent not in self.cached and self.block_hash[block] is None:
                self._register(block, parent, block_tokens)
                if self.disk is not None:
                    self.disk.write_behind(parent, block_tokens, block, i)

    def release(self, table: BlockTable):
        """The sequence lets go of its blocks: cached ones become idle (evictable, newest last), others free."""
        for block in reversed(table.blocks):  # the tail first, so eviction takes a prefix's end before its start
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if self.block_hash[block] is not None:
                    self.idle[block] = None
                else:
                    self.free.append(block)
        table.blocks.clear()
        table.hashes.clear()

    def slot(self, table: BlockTable, position: int) -> int:
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, table: BlockTable, start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table.blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def batch(self, parts: list[tuple[BlockTable, list[int], int]], logits: bool = False,
              prompt_end: list[int] | None = None) -> Batch:
        """A forward over (block table, new tokens, tokens already cached) per sequence, each a causal chain after
        what this cache holds for it (its blocks reserved); logits: the last row of each needs them."""
        tokens, positions, slots, seq_rows, context = [], [], [], [0], []
        for table, new, start in parts:
            tokens += new
            positions += range(start, start + len(new))
            slots += self.slots(table, start, start + len(new))
            seq_rows.append(len(tokens))
            context.append(start)
        width = max(len(t.blocks) for t, _, _ in parts)
        tables = torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t, _, _ in parts], dtype=torch.long)
        return Batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.tensor(seq_rows),
                     torch.tensor(context), tables, self.block_size,
                     prompt_end=None if prompt_end is None else torch.tensor(prompt_end),
                     logit_rows=torch.tensor(seq_rows[1:], dtype=torch.long) - 1 if logits else None)

    def move(self, src: list[int], dst: list[int]):
        """Copies the keys and values of slots src to slots dst in every layer (a verified tree's accepted path)."""
        if self.mirror is not None:
            self.mirror(src, dst)
        s, d = torch.tensor(src), torch.tensor(dst)
        for k, v in zip(self.k, self.v):
            k[:, d] = k[:, s]
            v[:, d] = v[:, s]

    def clear(self):
        """Forgets every cached prefix (blocks in use keep their contents)."""
        for block in list(self.idle):
            self._evict(block)
        for h, block in list(self.cached.items()):
            self.block_hash[block] = self.block_tokens[block] = None
        self.cached.clear()

    # ---- blocks ----------------------------------------------------------------------------------------------
    def _register(self, block: int, prefix_hash: int, block_tokens: tuple[int, ...]):
        self.cached[prefix_hash] = block
        self.block_hash[block], self.block_tokens[block] = prefix_hash, block_tokens

    def _from_disk(self, prefix_hash: int, block_tokens: tuple[int, ...], index: int) -> int | None:
        """A free block holding the disk tier's copy of this one, referenced and registered; None if the disk
        has no whole copy, or the pool no block to spare."""
        if self.disk is None or not self.available:
            return None
        block = self._take()
        if not self.disk.read_into(prefix_hash, block_tokens, block, index):
            self.refs[block] = 0
            self.free.append(block)
            return None
        self._register(block, prefix_hash, block_tokens)
        return block

    def _ref(self, block: int):
        if self.refs[block] == 0:
            self.idle.pop(block, None)
        self.refs[block] += 1

    def _take(self) -> int:
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.idle.popitem(last=False)
            self._evict(block, to_free=False)
        self.refs[block] = 1
        return block

    def _evict(self, block: int, to_free: bool = True):
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = self.block_tokens[block] = None
        self.idle.pop(block, None)
        if to_free:
            self.free.append(block)
