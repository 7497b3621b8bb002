"""Rank 0 drives, the other ranks follow: every forward pass the engine asks of rank 0's model is first broadcast
as a command, so all ranks run the same pass together (its all-reduces pair up) and only rank 0 samples.

The serving engine (parallel/runner.py) sends each step's batch (STEP: the rows, their positions, cache slots and
block tables, any tree mask, the rows that need logits, the layers to run) and the paged cache's moves (MOVE_SLOTS);
every rank runs its runner over its shard and its own paged cache, whose blocks mirror rank 0's, then its slice of
the LM head on those rows. A command is a fixed int64 header, then its payload. Engine, speculator and server code
above stays single-process.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
import time
from enum import IntEnum

import torch

from fastdecode.errors import FastdecodeError
from fastdecode.parallel.group import Group
from fastdecode.runners import Batch


class RankFailure(FastdecodeError):
    """Another rank died or fell silent (every transport raises RuntimeError): the group cannot go on."""


class Op(IntEnum):
    PING = 1  # nothing: rank 0 is idle but alive
    STOP = 2
    STEP = 3  # runner.forward(batch, stop): the engine's step (stop: the layers a self-speculative draft runs)
    MOVE_SLOTS = 4  # the paged cache's slots src -> dst (KVCache.move)


# op, then a STEP's: block-table width, sequences, rows, logit rows, block size, has prompt_end, has tree mask,
# payload length, layers to run (-1: all).
HEADER = 10


class Leader:
    """Rank 0's side of the group: sends each engine step and cache move to the other ranks before making it here.
    A lock keeps a command and its collectives whole against the keep-alive thread. A failed collective calls
    `on_failure(error)` (the command line exits there), then raises RankFailure."""

    def __init__(self, group: Group, on_failure=None):
        self.group, self.on_failure = group, on_failure
        self.lock = threading.RLock()
        self.last_sent = time.monotonic()
        self.stopped = threading.Event()
        self.keepalive: threading.Thread | None = None

    def step(self, batch: Batch, forward, stop: int | None = None):
        """Sends the batch, then runs forward(batch) here: every rank's runner makes the same pass over layers
        [0, stop), and the other ranks then their slice of the LM head on its logit rows, as the engine does here
        next (its all-gather)."""
        with self.lock, self.failures():
            payload = pack(batch)
            logit_rows = 0 if batch.logit_rows is None else batch.logit_rows.numel()
            self._header(Op.STEP, batch.block_tables.shape[1], len(batch.context), batch.num_rows, logit_rows,
                         batch.block_size, batch.prompt_end is not None, batch.tree_mask is not None, payload.numel(),
                         -1 if stop is None else stop)
            self.group.comm.broadcast(payload, 0)
            return forward(batch)

    def move_slots(self, src: list[int], dst: list[int]):
        """Tells the other ranks of a paged-cache move (rank 0's KVCache.mirror): they make it on theirs."""
        with self.lock, self.failures():
            self._header(Op.MOVE_SLOTS, 2 * len(src))
            self.group.comm.broadcast(torch.tensor(src + dst, dtype=torch.long), 0)

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
        """Every transport (gloo, NCCL, shared memory) reports a dead peer or a timeout as RuntimeError; so does a bug
        in a forward pass, which leaves the followers waiting just the same, so both end the group."""
        try:
            yield
        except RuntimeError as e:
            self.stopped.set()
            if self.on_failure is not None:
                self.on_failure(e)
            raise RankFailure(f"tensor-parallel group failed: {str(e).splitlines()[0] if str(e) else e!r}") from e

    # ---- wire --------------------------------------------------------------------------------------------------
    def _header(self, op: Op, *fields: int) -> torch.Tensor:
        header = torch.tensor([op, *fields] + [0] * (HEADER - 1 - len(fields)), dtype=torch.long)
        self.group.comm.broadcast(header, 0)
        self.last_sent = time.monotonic()
        return header


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
def follow(model, group: Group, runner):
    """A follower's whole life: run each command rank 0 broadcasts on this rank's engine runner (over its own paged
    cache), until STOP. A collective that fails (a rank died) or times out raises, which ends this process."""
    header = torch.empty(HEADER, dtype=torch.long)
    while True:
        group.comm.broadcast(header, 0)
        op, *fields = header.tolist()
        if op == Op.STOP:
            released(header)  # the process may exit next
            return
        if op == Op.PING:
            continue
        if op == Op.STEP:
            width, B, R, logit_rows, block_size, has_prompt_end, has_mask, n, stop = fields
        elif op == Op.MOVE_SLOTS:
            n = fields[0]
        else:
            raise RuntimeError(f"unknown tensor-parallel command {op}")
        payload = torch.empty(n, dtype=torch.long)
        group.comm.broadcast(payload, 0)
        if op == Op.MOVE_SLOTS:
            src, dst = payload.chunk(2)
            runner.kv.move(src.tolist(), dst.tolist())
            continue
        batch = unpack(payload, width, B, R, logit_rows, block_size, bool(has_prompt_end), bool(has_mask))
        hidden = runner.forward(batch, None if stop < 0 else stop)
        if logit_rows:
            model.head(hidden[batch.logit_rows])
