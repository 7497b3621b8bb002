"""A weight image's data checked against the CRC-32s its writer recorded, one per 4 MB chunk (loading/weight_image.py).

Checking every chunk on every load would cost more than the load: an 8B Q4_0 image (5.1 GB) maps in 0.1 s, and checking
all of it takes 0.8 s on this VM's two cores (zlib's CRC-32: about 3 GB/s a core from the page cache, against 1.6 for
SHA-256 and 0.6 for BLAKE2b; zlib lets go of the GIL, so chunks run on every core). So the manifest also keeps the data
file's seal, its inode, size, modification and change times as they were when its chunks were last found right. The
change time cannot be set back from user space, so every write through the file system (a flipped byte, a
truncation), a chmod or a copy breaks the seal. A load whose file still has its seal checks SAMPLED chunks chosen at
random (about 5 ms), which finds damage beneath the file system (which breaks no seal) on some load, not on every one;
a load whose file has lost its seal checks every chunk, and where all match (a `touch`, a copied or restored folder)
records the new seal, so that costs one full check, not a repack. A chunk that differs makes the image unusable: it is
removed and the GGUF packs again. The writer computes the checksums from the page cache after packing, in the thread
that syncs the file (0.8 s more at 8B before the process can exit).
"""
from __future__ import annotations

import mmap
import os
import random
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

CHUNK = 4 << 20
SAMPLED = 8  # chunks checked on a load whose file still has its seal (32 MB)


def chunk_count(nbytes: int) -> int:
    return -(-nbytes // CHUNK)


def checksums(data, chunks: Iterable[int]) -> list[int]:
    """data: a buffer (the mapped file) -> the CRC-32 of each chunk whose index is in `chunks`."""
    with memoryview(data) as view, ThreadPoolExecutor() as pool:  # zlib lets go of the GIL: a chunk per core
        return list(pool.map(lambda i: zlib.crc32(view[i * CHUNK:(i + 1) * CHUNK]), chunks))


def file_checksums(fd: int, nbytes: int) -> list[int]:
    """The CRC-32s of the first nbytes of the open file fd, read through a mapping (the writer's pages are still in
    the page cache)."""
    if not nbytes:
        return []
    with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as pages:
        return checksums(pages, range(chunk_count(nbytes)))


def seal(st: os.stat_result) -> list[int]:
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def check(data, st: os.stat_result, recorded: list[int], sealed: list[int]) -> list[int] | None:
    """data: the mapped data file, st: its stat, recorded: its CRC-32s, sealed: its seal when they were last found
    right -> the seal to record, where it changed and every chunk still matches (else None). Raises ValueError at
    the first chunk checked that differs."""
    n = chunk_count(st.st_size)
    if not (type(recorded) is list and len(recorded) == n and all(type(c) is int for c in recorded)):
        raise ValueError(f"it records {len(recorded) if type(recorded) is list else 'no'} checksums for {n} chunks")
    now = seal(st)
    chunks = random.sample(range(n), min(SAMPLED, n)) if sealed == now else range(n)
    for i, found in zip(chunks, checksums(data, chunks)):
        if found != recorded[i]:
            raise ValueError(f"its data changed since it was written (the {CHUNK >> 20} MB at byte {i * CHUNK} differ)")
    return None if sealed == now else now
