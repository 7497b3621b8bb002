"""The KV cache's disk tier: full, final blocks kept as files under $FASTDECODE_HOME/kv, so that a prefix outlives
the process. A restarted server, a second replica or `fastdecode chat` beside `fastdecode serve` finds an agent's
system prompt and tools there and prefills only what follows them.

Layout: `kv/<model>/<hash>.kv`. <model> names everything that decides a block's bytes (ModelIdentity: the weights
file's header, tensor table and data samples, the quantization, the KV dtype, the runner, the code); <hash> is the
block's prefix hash (kv_cache.py: it chains every token before the block and the tenant's salt). A file holds a header
(magic, format, model digest, prefix hash, the counts, a CRC-32 of the rest), the block's token ids, then its keys and
values: for K then V, for each layer and KV head, block_size x head_dim values of the cache's dtype, which are exactly
the runs a block occupies in the pool (its tensors are (kv_heads, slots, head_dim) per layer), so a read goes
straight into the pool's slots (preadv) and a write comes from one snapshot.

Safe by construction: a file is written under a temporary name, fsynced, and renamed into place, so a reader sees a
whole file or none; a reader that finds a file truncated, corrupt, for another model or another prefix takes it as a
miss and removes it. Files are 0600 in folders 0700.

Bounded by the folder's cap, across processes (kv_files.py): a read touches its file, so eviction takes the least
recently used. A full disk or a folder that cannot be written is one warning line, and the process goes on without
writing.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from array import array
from pathlib import Path

import torch

from fastdecode.engine.kv_files import FORMAT, ModelIdentity, Usage, kv_dir, make_room, remove_files

log = logging.getLogger(__name__)

MAGIC = b"FDKV"
HEADER = struct.Struct("<4sI16s16sIIQI")  # magic, format, model digest, prefix hash, tokens, KV runs, payload, crc32
POSITION_AGE = 1.0  # seconds older a block looks per block before it in its prompt: eviction takes a prefix's end
# before its start (a deep block is useful only after every block before it, and is shared by fewer prompts)
PENDING_BYTES = 1 << 30  # snapshots waiting for the writer; past this a block is not written (the disk is behind)
KNOWN_MAX = 1 << 20  # prefix hashes a tier remembers as on disk (about 100 MB)
IOV_MAX = 1024  # Linux's limit of buffers in one preadv


class DiskTier:
    """One model's blocks on disk, for the pool of one KVCache (its per-layer K and V tensors, (kv_heads, slots,
    head_dim) each): read_into() loads a block into the pool on a prefix match; write_behind() snapshots a block
    once it is final, and a background thread writes it."""

    def __init__(self, identity: ModelIdentity, k: list[torch.Tensor], v: list[torch.Tensor], block_size: int,
                 cap: int, root: Path | None = None):
        self.root = root or kv_dir()
        self.folder = self.root / identity.digest.hex()
        self.digest, self.cap, self.block_size = identity.digest, cap, block_size
        self.k, self.v = k, v
        self.pool = [t.view(torch.uint8).numpy() for t in (*k, *v)]  # numpy slices are cheap: a read's buffers
        heads, _, head_dim = k[0].shape
        self.runs = 2 * len(k) * heads  # contiguous runs of a block in the pool
        self.payload = self.runs * block_size * head_dim * k[0].element_size()
        self.file_bytes = HEADER.size + 4 * block_size + self.payload
        self.known: set[int] = set()  # prefix hashes this process knows are on disk (written or read)
        self.written = self.dropped = 0  # blocks on disk / skipped (a disk behind, or one that failed)
        self.writable = True
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.pending_bytes = 0
        self.lock = threading.Lock()
        self.writer: threading.Thread | None = None
        self.info = identity.info
        self._make_folder()

    def _make_folder(self):
        """The model's folder and its model.json (again, where `fastdecode cache clear` removed them meanwhile)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.folder.mkdir(mode=0o700, exist_ok=True)
        info = self.folder / "model.json"
        if not info.exists():
            tmp = self.folder / f".model.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(self.info))
            os.chmod(tmp, 0o600)
            os.rename(tmp, info)

    def path(self, prefix_hash: int) -> Path:
        return self.folder / f"{prefix_hash:032x}.kv"

    def _runs(self, block: int) -> list:
        """The block's runs in the pool, in file order (K then V, layer, head): numpy views, written in place."""
        s0, s1 = block * self.block_size, (block + 1) * self.block_size
        return [h[s0:s1] for layer in self.pool for h in layer]

    # ---- reads (the engine's thread) -----------------------------------------------------------------------------
    def read_into(self, prefix_hash: int, tokens: tuple[int, ...], block: int, index: int) -> bool:
        """Reads the block of `prefix_hash` (block `index` of its prompt) into pool block `block` -> whether it was
        there and whole. A file that is not exactly this block (truncated, corrupt, another model or prefix) is
        removed: a miss, never a wrong token."""
        path = self.path(prefix_hash)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            head = os.pread(fd, HEADER.size + 4 * self.block_size, 0)
            ok = len(head) == HEADER.size + 4 * self.block_size and os.fstat(fd).st_size == self.file_bytes
            if ok:
                *fields, crc = HEADER.unpack_from(head)
                ok = (fields == [MAGIC, FORMAT, self.digest, prefix_hash.to_bytes(16, "little"), self.block_size,
                                 self.runs, self.payload] and tuple(array("I", head[HEADER.size:])) == tokens)
            if ok:
                runs, got = self._runs(block), 0
                for i in range(0, len(runs), IOV_MAX):
                    got += os.preadv(fd, runs[i:i + IOV_MAX], len(head) + got)
                check = zlib.crc32(head[HEADER.size:])
                for run in runs:
                    check = zlib.crc32(run, check)
                ok = got == self.payload and check == crc
            if ok:
                os.utime(fd, (t := time.time() - index * POSITION_AGE, t))  # recently used
        except OSError:
            ok = False
        finally:
            os.close(fd)
        if not ok:
            log.warning("kv disk tier: %s is not a whole block of this model; removed", path.name)
            with contextlib.suppress(OSError):
                remove_files(self.root, [(path, self.file_bytes)])
            return False
        self.known.add(prefix_hash)
        return True

    # ---- writes --------------------------------------------------------------------------------------------------
    def write_behind(self, prefix_hash: int, tokens: tuple[int, ...], block: int, index: int):
        """Queues a final block for the writer, as a snapshot (the pool's block may be reused before the writer gets
        to it). Blocks already on disk, and any past what the writer keeps up with, are skipped."""
        if not self.writable or prefix_hash in self.known:
            return
        with self.lock:
            if self.pending_bytes + self.payload > PENDING_BYTES:
                self.dropped += 1
                return
            self.pending_bytes += self.payload
        if len(self.known) > KNOWN_MAX:  # (files evicted since may be written again: forgetting costs a snapshot)
            self.known.clear()
        self.known.add(prefix_hash)
        s0, s1 = block * self.block_size, (block + 1) * self.block_size
        heads, _, head_dim = self.k[0].shape
        snapshot = torch.empty(2, len(self.k), heads, self.block_size, head_dim, dtype=self.k[0].dtype)
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            snapshot[0, i] = k[:, s0:s1]
            snapshot[1, i] = v[:, s0:s1]
        self.pending.put((prefix_hash, tokens, snapshot, index))
        if self.writer is None:
            self.writer = threading.Thread(target=_writer_thread, args=(weakref.ref(self), self.pending),
                                           name="fastdecode-kv-writer", daemon=True)
            self.writer.start()
            weakref.finalize(self, self.pending.put, None).atexit = False  # the writer ends with its tier
            _TIERS.add(self)
            _WRITERS.add(self.writer)

    def flush(self, timeout: float = 30.0) -> bool:
        """Waits until every queued block is written (or dropped) -> whether that happened in time."""
        deadline = time.monotonic() + timeout
        while self.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.pending_bytes

    def _write_batch(self, items: list[tuple[int, tuple[int, ...], torch.Tensor, int]]):
        """Writes items to temporary files, then, under the usage lock, makes room and renames them into place (as
        many as fit: the rest are dropped). Any error stops the writes for good, with one warning."""
        temps, written = [], 0
        try:
            self._make_folder()
            for prefix_hash, tokens, snapshot, index in items:
                ids = array("I", tokens).tobytes()
                data = snapshot.view(torch.uint8).numpy()
                head = HEADER.pack(MAGIC, FORMAT, self.digest, prefix_hash.to_bytes(16, "little"), self.block_size,
                                   self.runs, self.payload, zlib.crc32(data, zlib.crc32(ids)))
                tmp = self.folder / f".{prefix_hash:032x}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                temps.append((tmp, self.path(prefix_hash), time.time() - index * POSITION_AGE))
                try:
                    if os.writev(fd, [head, ids, data]) != self.file_bytes:
                        raise OSError(28, "a short write")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            with Usage(self.root) as usage:
                fit = make_room(self.root, usage, len(temps) * self.file_bytes, self.cap) // self.file_bytes
                if not fit:
                    raise OSError(28, "the cap or the disk's reserve leaves no room for a block")
                total = usage.read()
                for tmp, final, mtime in temps[:fit]:
                    if not final.exists():  # (another process may have written the same block meanwhile)
                        os.rename(tmp, final)
                        os.utime(final, (mtime, mtime))
                        total += self.file_bytes
                    written += 1
                usage.write(total)
        except OSError as e:
            if self.writable:
                log.warning("kv disk tier: blocks are no longer written to %s (%s); the engine goes on without "
                            "them", self.folder, e.strerror or e)
            self.writable = False
        finally:
            for tmp, _, _ in temps:
                tmp.unlink(missing_ok=True)
            self.written += written
            self.dropped += len(items) - written


def _writer_thread(ref: weakref.ref, pending: queue.SimpleQueue):
    """Writes queued blocks in batches; ends when its tier is collected (a None is queued then)."""
    while True:
        item = pending.get()
        if item is None:
            return
        items = [item]
        while True:  # what queued meanwhile goes in the same batch: one lock and usage update for all
            try:
                more = pending.get_nowait()
            except queue.Empty:
                break
            if more is None:
                pending.put(None)
                break
            items.append(more)
        tier = ref()
        if tier is None:
            return
        if tier.writable:
            tier._write_batch(items)
        else:
            tier.dropped += len(items)
        with tier.lock:
            tier.pending_bytes -= tier.payload * len(items)
        del tier, items, item  # (no snapshot outlives its write)


# Tiers whose writer runs, and those writers. At exit each tier's queue is written (a short-lived `fastdecode generate`
# keeps what it computed) and its writer ended and joined: a daemon thread that frees tensors while the interpreter
# finalizes makes the process abort (as engine.py's threads would).
_TIERS: weakref.WeakSet = weakref.WeakSet()
_WRITERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_writers():
    for tier in list(_TIERS):
        tier.flush(timeout=10.0)
        tier.pending.put(None)
    for thread in list(_WRITERS):
        thread.join(5.0)
