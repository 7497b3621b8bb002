"""The disk tier's folder, shared by every process on the machine: `$FASTDECODE_HOME/kv/<model>/<hash>.kv`.

<model> is a ModelIdentity's digest: everything that decides the bytes of a model's keys and values (the weights
file's header, tensor table and data samples, the quantization, the KV dtype, the runner, the code, the processor).
`kv/.usage` holds the bytes of every block file of every model, read and written under an flock of it by every
process; a write that would pass the cap, or leave the disk less than its reserve, first evicts the least recently
used files (by mtime), whichever model or process wrote them. `fastdecode cache` lists the folder and clears it.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1  # of the files and of the identity: a new format never reads an old one's blocks
DEFAULT_CAP_GB = 50.0


def kv_dir() -> Path:
    from fastdecode.loading.catalog import fastdecode_home

    return Path(os.environ.get("FASTDECODE_KV_DIR") or fastdecode_home() / "kv")


def cap_bytes(gb: float | None = None) -> int:
    """The tier's cap: `gb` (--kv-disk-gb), else FASTDECODE_KV_DISK_GB, else DEFAULT_CAP_GB; 0 turns the tier off."""
    if gb is None:
        try:
            gb = float(os.environ.get("FASTDECODE_KV_DISK_GB", DEFAULT_CAP_GB))
        except ValueError:
            gb = DEFAULT_CAP_GB
    return max(0, int(gb * 1e9))


def disk_reserve(path: Path) -> int:
    """Bytes the tier leaves free on the disk (as the weight images do): 4 GB or 5%, whichever is more."""
    return int(max(4e9, 0.05 * shutil.disk_usage(path).total))


@dataclass(frozen=True)
class ModelIdentity:
    digest: bytes  # 16 bytes: the folder's name and every file's header field
    info: dict  # what `fastdecode cache` shows of it


def weights_digest(path: Path) -> bytes:
    """A digest of a model's weights: a GGUF's header and tensor table, a folder's configs and safetensors headers,
    each file's size and 16 samples of its data. Not the path or the times: a copy of the file shares its blocks."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors")) if path.is_dir() else [path]
    for p in files:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = header_bytes(p, f)
            f.seek(0)
            h.update((p.name if path.is_dir() else "").encode() + struct.pack("<Q", size) + f.read(min(size, head)))
            for i in range(16):
                f.seek(max(0, (size - 4096) * i // 15))
                h.update(f.read(4096))
    return h.digest()


def model_identity(path: Path, weights: bytes, parts: dict) -> ModelIdentity:
    """What decides the keys and values a model writes: its weights (weights_digest), `parts` (quantization, dtypes,
    runner, config), the code and the processor."""
    from fastdecode.loading.weight_image import layout_code_hash

    h = hashlib.sha256(weights + json.dumps([FORMAT, layout_code_hash(), code_hash(), cpu_name(), parts],
                                            sort_keys=True, default=str).encode())
    info = {"model": str(path), **{k: v for k, v in parts.items() if k != "config"}}
    return ModelIdentity(h.digest()[:16], info)


def header_bytes(path: Path, f) -> int:
    """How much of a weights file to hash whole: a GGUF's metadata and tensor table, a safetensors' JSON header."""
    if path.suffix == ".json":
        return 1 << 20
    if path.suffix == ".safetensors":
        size = f.read(8)
        return 8 + struct.unpack("<Q", size)[0] if len(size) == 8 else 0
    from fastdecode.loading.gguf_file import read_gguf

    return read_gguf(path).header_size


def code_hash() -> str:
    """The runners' and engine's code (weight_image's layout hash covers the kernels, models and layers)."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    engine = [root / "engine" / name for name in ("kv_cache.py", "kv_disk.py", "kv_files.py")]
    for p in sorted([*(root / "runners").glob("*.py"), *engine]):
        h.update(p.read_bytes())
    return h.hexdigest()


def cpu_name() -> str:
    """Which kernels ran: the processor and the ISA asked for (a file shared across machines keeps them apart)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "".join(lines) + os.environ.get("FASTDECODE_KERNEL_ISA", "")


class Usage:
    """kv/.usage: the bytes of all block files, shared by every process through an flock of the file."""

    def __init__(self, root: Path):
        self.path = root / ".usage"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # (closing releases the lock)

    def read(self) -> int:
        data = os.pread(self.fd, 8, 0)
        return struct.unpack("<q", data)[0] if len(data) == 8 else -1  # -1: never counted, scan

    def write(self, total: int):
        os.pwrite(self.fd, struct.pack("<q", max(total, 0)), 0)


def block_files(root: Path) -> list[tuple[float, int, Path]]:
    """(mtime, size, path) of every block file of every model, and removes temporary files whose writer died."""
    out = []
    for model in root.iterdir() if root.exists() else ():
        if not model.is_dir():
            continue
        for entry in os.scandir(model):
            try:
                if entry.name.endswith(".kv"):
                    st = entry.stat()
                    out.append((st.st_mtime, st.st_size, Path(entry.path)))
                elif entry.name.endswith(".tmp") and not Path(f"/proc/{entry.name.split('.')[-2]}").exists():
                    os.unlink(entry.path)
            except (FileNotFoundError, IndexError):
                pass  # gone meanwhile (another process evicted it)
    return out


def make_room(root: Path, usage: Usage, need: int, cap: int) -> int:
    """Under usage's lock: evicts the least recently used block files until `need` more bytes fit under the cap and
    the disk's reserve -> the bytes that fit (`need`, or less where the cap or the disk is smaller)."""
    total = usage.read()
    free = shutil.disk_usage(root).free - disk_reserve(root)
    if 0 <= total and total + need <= cap and need <= free:
        return need
    files = sorted(block_files(root))
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total + need <= cap and need <= free:
            break
        path.unlink(missing_ok=True)
        total, free = total - size, free + size
    usage.write(total)
    return max(0, min(need, cap - total, free))


def remove_files(root: Path, files: list[tuple[Path, int]]):
    """Removes block files and takes the bytes they were counted as off the usage."""
    with Usage(root) as usage:
        total = usage.read()
        for path, size in files:
            try:
                path.unlink()
                total -= size
            except FileNotFoundError:
                pass
        if total >= 0:
            usage.write(total)


# ---- what `fastdecode cache` shows and clears ------------------------------------------------------------------------
def stored(root: Path | None = None) -> list[dict]:
    """Per model folder: its digest, what model.json says of it, the blocks and bytes stored, the newest use."""
    root = root or kv_dir()
    out = {}
    for mtime, size, path in block_files(root):
        entry = out.setdefault(path.parent, {"blocks": 0, "bytes": 0, "last_used": 0.0})
        entry["blocks"] += 1
        entry["bytes"] += size
        entry["last_used"] = max(entry["last_used"], mtime)
    for folder in root.iterdir() if root.exists() else ():
        if folder.is_dir():
            out.setdefault(folder, {"blocks": 0, "bytes": 0, "last_used": 0.0})
    rows = []
    for folder, entry in sorted(out.items()):
        try:
            info = json.loads((folder / "model.json").read_text())
        except (OSError, ValueError):
            info = {}
        rows.append({"digest": folder.name, **entry, "model": info.get("model", "?"),
                     "quant": info.get("quant"), "kv_dtype": info.get("kv_dtype")})
    return rows


def clear(root: Path | None = None, digest: str | None = None) -> tuple[int, int]:
    """Removes the stored blocks of every model, or of the model folders whose digest starts with `digest` ->
    (files, bytes) removed."""
    root = root or kv_dir()
    files = [(path, size) for _, size, path in block_files(root)
             if digest is None or path.parent.name.startswith(digest)]
    remove_files(root, files)
    for folder in {path.parent for path, _ in files}:
        with contextlib.suppress(OSError):
            if not any(p.suffix == ".kv" for p in folder.iterdir()):
                shutil.rmtree(folder)
    return len(files), sum(size for _, size in files)
