"""GGUF container: header, metadata and tensor table, with tensor data memory-mapped.

gguf.GGUFReader builds a numpy view per array element, which takes ~19 s on Gemma 3's 262k-token vocabulary;
this reader parses the same header with struct in well under a second and leaves dequantization to `gguf`.

Every count and size is checked against the file before it is used (as llama.cpp's gguf.cpp does), so a corrupt or
hostile file fails with ModelFileError rather than a traceback, a long loop or a huge allocation.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from fastdecode.errors import ModelFileError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
# GGUF metadata value types (gguf.GGUFValueType): id -> struct format for scalars.
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
U64 = struct.Struct("<Q")
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 2  # arrays of arrays; llama.cpp writes none
MAX_ARRAY = 1 << 21  # elements per metadata array: Gemma 3's vocabulary is 262k; Python objects cost ~50 bytes each
MAX_ENTRIES = 1 << 20  # metadata keys, or tensors


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (rows first); GGUF stores the reverse
    type: GGMLQuantizationType
    data: np.ndarray  # raw bytes (uint8) or values, memory-mapped


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.mm = np.frombuffer(self.map, dtype=np.uint8)
            self.buf = memoryview(self.mm)  # slicing a memoryview is far cheaper than slicing an array
        except (OSError, ValueError) as e:
            raise ModelFileError(f"cannot read GGUF file {self.path}: {e}") from None
        self.pos = 0
        try:
            self.metadata, self.tensors = self._parse()
            self.header_size = self.pos  # metadata and tensor table
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as e:
            raise ModelFileError(f"{self.path} is not a valid GGUF file (truncated or corrupt: {e})") from None

    def release(self, t: GGUFTensor):
        """Drops a tensor's pages from this process's mapping once they have been copied out: they stay in the page
        cache, but no longer count as this process's memory, so a loader holds one tensor of the file at a time."""
        if not hasattr(mmap, "MADV_DONTNEED") or t.data.nbytes == 0:
            return
        start = t.data.ctypes.data - self.mm.ctypes.data
        if not 0 <= start <= len(self.mm) - t.data.nbytes:  # a copy (a tensor-parallel rank's columns), not the map
            return
        page = start // mmap.PAGESIZE * mmap.PAGESIZE
        self.map.madvise(mmap.MADV_DONTNEED, page, start + t.data.nbytes - page)

    # ---- primitive readers -------------------------------------------------------------------------------------
    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.mm):
            raise ValueError("unexpected end of file")
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value[0]

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, n: int) -> list[str]:
        """n strings in a row: a vocabulary's 150k tokens and its merges, so the loop is the read of one string
        inlined (half the time of calling a function per string, ~40 ms per 150k)."""
        unpack, mm, size, pos, out = U64.unpack_from, self.map, len(self.mm), self.pos, []
        append = out.append
        for _ in range(n):
            end = pos + 8 + unpack(mm, pos)[0]
            if end > size:
                raise ValueError("unexpected end of file")
            append(mm[pos + 8:end].decode("utf-8", errors="replace"))
            pos = end
        self.pos = pos
        return out

    def _count(self, limit: int, what: str) -> int:
        n = self._unpack("<Q")
        if n > limit:
            raise ValueError(f"{n} {what}, more than the {limit} a model holds")
        return n

    def _value(self, vtype: int, nesting: int = 0):
        if vtype in SCALARS:
            return self._unpack(SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            if nesting >= MAX_NESTING:
                raise ValueError(f"metadata arrays nested more than {MAX_NESTING} deep")
            etype, n = self._unpack("<I"), self._count(MAX_ARRAY, "array elements")
            if etype in NUMPY_TYPES:  # numeric arrays: one vectorised read
                dt = np.dtype(NUMPY_TYPES[etype])
                end = self.pos + n * dt.itemsize
                if end > len(self.mm):
                    raise ValueError("unexpected end of file")
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos = end
                return arr.tolist()
            if etype == STRING:
                return self._strings(n)
            return [self._value(etype, nesting + 1) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")

    # ---- file structure ----------------------------------------------------------------------------------------
    def _parse(self):
        if bytes(self.buf[:4]) != GGUF_MAGIC:
            raise ValueError("missing GGUF magic")
        self.pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self._count(MAX_ENTRIES, "tensors"), self._count(MAX_ENTRIES, "metadata keys")
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [self._unpack("<Q") for _ in range(n_dims)]
            raw_type, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, dims, raw_type, offset))
        alignment = metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, not {alignment!r}")
        data_start = (self.pos + alignment - 1) // alignment * alignment
        tensors = {}
        for name, dims, raw_type, offset in infos:
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise UnsupportedModelError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}'s rows of {dims[0]} are not whole blocks of {block}")
            n_bytes = math.prod(dims) // block * type_size  # Python ints: no overflow, unlike np.prod
            start = data_start + offset
            if offset % alignment or start + n_bytes > len(self.mm):
                raise ValueError(f"tensor {name!r} lies outside the file's aligned data")
            tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qtype, self.mm[start:start + n_bytes])
        return metadata, tensors


def read_gguf(path: str | Path) -> GGUFFile:
    """The parsed file at `path`. The last one parsed is kept (its header, and a mapping that holds no memory of its
    own) until forget_parsed(), so that the weights' loader and the tokenizer of one model parse its 150k-string
    vocabulary once; a file replaced or rewritten since is parsed again."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelFileError(f"cannot read GGUF file {path}: {e}") from None
    return _parsed(Path(path).resolve(), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=1)
def _parsed(path: Path, identity: tuple) -> GGUFFile:
    return GGUFFile(path)


def forget_parsed():
    """Drops the kept parse (a 262k vocabulary's strings are tens of MB) once a model has loaded."""
    _parsed.cache_clear()
