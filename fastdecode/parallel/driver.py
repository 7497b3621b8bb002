"""Rank 0 drives, the other ranks follow: every forward pass the engine asks of rank 0's model is first broadcast
as a command, so all ranks run the same pass together (its all-reduces pair up) and only rank 0 samples.

Two ways to drive. The serving engine (parallel/runner.py) sends each step's batch (STEP: the rows, their
positions, cache slots and block tables, any tree mask, the rows that need logits) and the paged cache's moves
(MOVE_SLOTS); every rank runs its runner over its shard and its own paged cache, whose blocks mirror rank 0's, then
its slice of the LM head on those rows. The single-request loop, which the model drafters still need, sends model
calls (FORWARD, HIDDEN, HEAD) over each rank's static cache and its moves (MOVE_KV). A command is a fixed int64 header, then its payload. Engine, speculator and server
code above stays single-process: they call `Leader` as they would call the model.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
import time
from enum import IntEnum

import torch
import torch.distributed as dist

from fastdecode.errors import FastdecodeError
from fastdecode.parallel.group import Group
from fastdecode.runners import Batch


class RankFailure(FastdecodeError):
    """Another rank died or fell silent (gloo and NCCL raise RuntimeError): the group cannot go on."""


class Op(IntEnum):
    FORWARD = 1  # model(tokens, start, all_logits, **tree)
    HIDDEN = 2  # model.hidden(tokens, start, **tree)
    HEAD = 3  # model.head(x), x sent along
    MOVE_KV = 4  # cache slots src -> dst (the speculator keeps an accepted tree path)
    PING = 5  # nothing: rank 0 is idle but alive
    STOP = 6
    STEP = 7  # runner.forward(batch): the engine's step
    MOVE_SLOTS = 8  # the paged cache's slots src -> dst (KVCache.move)


# op, start, batch, tokens, all_logits, layers (-1: all), has positions, has tree mask, payload length. A STEP's
# header reads: STEP, block-table width, sequences, rows, logit rows, block size, has prompt_end, has tree mask,
# payload length.
HEADER = 9


def move_kv(model, src: torch.Tensor, dst: torch.Tensor):
    for block in model.layers:
        cache = block.self_attn.kv_cache
        cache.k[:, :, dst] = cache.k[:, :, src]
        cache.v[:, :, dst] = cache.v[:, :, src]


class Leader:
    """Rank 0's handle on its shard of the model: broadcasts each call, then runs it here. Anything else (layers,
    config, modules()) is the model's own. A lock keeps a command and its collectives whole against the keep-alive
    thread. A failed collective calls `on_failure(error)` (the command line exits there), then raises RankFailure."""

    def __init__(self, model, group: Group, on_failure=None):
        self.model, self.group, self.on_failure = model, group, on_failure
        self.lock = threading.RLock()
        self.last_sent = time.monotonic()
        self.stopped = threading.Event()
        self.keepalive: threading.Thread | None = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    # ---- the model's interface ---------------------------------------------------------------------------------
    def __call__(self, tokens, start, all_logits=False, positions=None, tree_mask=None, layers=None):
        with self.lock, self.failures():
            self._send(Op.FORWARD, tokens, start, positions, tree_mask, layers, all_logits)
            return self.model(tokens, start, all_logits, positions=positions, tree_mask=tree_mask, layers=layers)

    forward = __call__

    def hidden(self, tokens, start, positions=None, tree_mask=None, layers=None):
        with self.lock, self.failures():
            self._send(Op.HIDDEN, tokens, start, positions, tree_mask, layers)
            return self.model.hidden(tokens, start, positions=positions, tree_mask=tree_mask, layers=layers)

    def head(self, x: torch.Tensor):
        with self.lock, self.failures():
            # (B, T, D) or (T, D): the follower rebuilds the same leading shape
            self._header(Op.HEAD, payload=x.numel(), batch=x.shape[0] if x.dim() == 3 else 0,
                         tokens=x.shape[-2] if x.dim() >= 2 else 1)
            dist.broadcast(x.contiguous(), 0, group=self.group.pg)
            return self.model.head(x)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor):
        with self.lock, self.failures():
            self._header(Op.MOVE_KV, payload=2 * len(src))
            dist.broadcast(torch.cat([src, dst]).long(), 0, group=self.group.pg)
            move_kv(self.model, src, dst)

    # ---- the engine's interface ----------------------------------------------------------------------------------
    def step(self, batch: Batch, forward):
        """Sends the batch, then runs forward(batch) here: every rank's runner makes the same pass, and the other
        ranks then their slice of the LM head on its logit rows, as the engine does here next (its all-gather)."""
        with self.lock, self.failures():
            payload = pack(batch)
            logit_rows = 0 if batch.logit_rows is None else batch.logit_rows.numel()
            self._header(Op.STEP, batch.block_tables.shape[1], len(batch.context), batch.num_rows, logit_rows,
                         batch.block_size, batch.prompt_end is not None, batch.tree_mask is not None, payload.numel())
            dist.broadcast(payload, 0, group=self.group.pg)
            return forward(batch)

    def move_slots(self, src: list[int], dst: list[int]):
        """Tells the other ranks of a paged-cache move (rank 0's KVCache.mirror): they make it on theirs."""
        with self.lock, self.failures():
            self._header(Op.MOVE_SLOTS, payload=2 * len(src))
            dist.broadcast(torch.tensor(src + dst, dtype=torch.long), 0, group=self.group.pg)

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def keep_alive(self, interval_s: float):
        """Pings the followers whenever rank 0 has sent nothing for interval_s (a server between requests, a chat
        waiting for its user), so that they can tell an idle rank 0 from a dead one by the group's timeout."""
        def run():
            while not self.stopped.wait(interval_s / 4):
                if time.monotonic() - self.last_sent >= interval_s and self.lock.acquire(blocking=False):
                    try:
                        with self.failures():
                            if not self.stopped.is_set():
                                self._header(Op.PING)
                    except RankFailure:  # the main thread hears of it on its next call
                        return
                    finally:
                        self.lock.release()
        self.keepalive = threading.Thread(target=run, name="tp-keepalive", daemon=True)
        self.keepalive.start()

    def stop(self):
        """Tells the followers to return; idempotent, and quiet if the group is already broken."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
            try:
                header = self._header(Op.STOP)
            except Exception:  # noqa: BLE001 - a dead follower: nothing left to stop
                return
            released(header)

    @contextmanager
    def failures(self):
        """gloo and NCCL report a dead peer or a timeout as RuntimeError; so does a bug in a forward pass, which
        leaves the followers waiting just the same, so both end the group."""
        try:
            yield
        except RuntimeError as e:
            self.stopped.set()
            if self.on_failure is not None:
                self.on_failure(e)
            raise RankFailure(f"tensor-parallel group failed: {str(e).splitlines()[0] if str(e) else e!r}") from e

    # ---- wire --------------------------------------------------------------------------------------------------
    def _header(self, op: Op, start=0, batch=0, tokens=0, all_logits=False, layers=None, positions=False,
                mask=False, payload=0) -> torch.Tensor:
        header = torch.tensor([op, start, batch, tokens, int(all_logits), -1 if layers is None else layers,
                               int(positions), int(mask), payload], dtype=torch.long)
        dist.broadcast(header, 0, group=self.group.pg)
        self.last_sent = time.monotonic()
        return header

    def _send(self, op, tokens, start, positions, tree_mask, layers, all_logits=False):
        parts = [tokens.reshape(-1).long()]
        if positions is not None:
            parts.append(positions.reshape(-1).long())
        if tree_mask is not None:
            parts.append(tree_mask.reshape(-1).long())
        payload = torch.cat(parts)
        B, T = tokens.shape
        self._header(op, start, B, T, all_logits, layers, positions is not None, tree_mask is not None,
                     payload.numel())
        dist.broadcast(payload, 0, group=self.group.pg)


def pack(batch: Batch) -> torch.Tensor:
    """A batch's tensors as one int64 payload, in the order unpack reads them."""
    parts = [batch.tokens, batch.positions, batch.slots, batch.seq_rows, batch.context, batch.block_tables]
    parts += [t for t in (batch.prompt_end, batch.tree_mask, batch.logit_rows) if t is not None]
    return torch.cat([t.reshape(-1).long() for t in parts])


def unpack(payload: torch.Tensor, width: int, B: int, R: int, logit_rows: int, block_size: int,
           has_prompt_end: bool, has_mask: bool) -> Batch:
    sizes = [R, R, R, B + 1, B, B * width, B if has_prompt_end else 0, R * R if has_mask else 0, logit_rows]
    tokens, positions, slots, seq_rows, context, tables, prompt_end, mask, logits = payload.split(sizes)
    return Batch(tokens, positions, slots, seq_rows, context, tables.view(B, width), block_size,
                 mask.view(R, R).bool() if has_mask else None, prompt_end if has_prompt_end else None, logits)


def released(tensor: torch.Tensor, timeout_s: float = 1.0):
    """Waits until gloo's worker thread holds no reference to the last tensor broadcast. The worker lets go of a
    broadcast's tensor only after the broadcast has returned, and letting go takes the GIL; when the interpreter is
    exiting by then, Python ends that thread inside C++ and the process aborts ("terminate called without an active
    exception": rank 0 about one run in five before its STOP waited; a follower, rarely, on its last header)."""
    deadline = time.monotonic() + timeout_s
    while tensor._use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)


@torch.inference_mode()
def follow(model, group: Group, dtype: torch.dtype, runner=None):
    """A follower's whole life: run each command rank 0 broadcasts, until STOP. `runner`: this rank's engine runner
    (over its own paged cache), for STEP and MOVE_SLOTS. A collective that fails (a rank died) or times out raises,
    which ends this process."""
    header = torch.empty(HEADER, dtype=torch.long)
    while True:
        dist.broadcast(header, 0, group=group.pg)
        op, start, B, T, all_logits, layers, has_pos, has_mask, n = header.tolist()
        if op == Op.STOP:
            released(header)  # the process may exit next
            return
        if op == Op.PING:
            continue
        if op == Op.HEAD:
            x = torch.empty(n, dtype=dtype)
            dist.broadcast(x, 0, group=group.pg)
            model.head(x.view(B, T, -1) if B else x.view(T, -1))
            continue
        payload = torch.empty(n, dtype=torch.long)
        dist.broadcast(payload, 0, group=group.pg)
        if op == Op.MOVE_KV:
            src, dst = payload.chunk(2)
            move_kv(model, src, dst)
            continue
        if op == Op.STEP:
            batch = unpack(payload, start, B, T, all_logits, layers, bool(has_pos), bool(has_mask))
            hidden = runner.forward(batch)
            if all_logits:
                model.head(hidden[batch.logit_rows])
            continue
        if op == Op.MOVE_SLOTS:
            src, dst = payload.chunk(2)
            runner.kv.move(src.tolist(), dst.tolist())
            continue
        tokens, rest = payload[:B * T].view(B, T), payload[B * T:]
        tree = {"positions": rest[:T] if has_pos else None, "layers": None if layers < 0 else layers}
        if has_mask:
            tree["tree_mask"] = rest[T if has_pos else 0:].view(T, T).bool()
        if op == Op.FORWARD:
            model(tokens, start, bool(all_logits), **tree)
        elif op == Op.HIDDEN:
            model.hidden(tokens, start, **tree)
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op}")
