"""A GGUF model's loaded weights kept as a file (a weight image), which the next load of the same GGUF maps instead of
packing the file's blocks again.

Packing (gguf_native) writes every weight once into fresh memory, and fresh memory is what a load costs: in this
VM a fresh 2 MB page costs the host's faults too (about 0.7-1 GB/s made, against 5 GB/s to rewrite pages already
made), so an 8B Q4_0 model (4.5 GB) took 5-10 s to pack while llama.cpp maps its GGUF from the page cache in 2.3 s.
The first load packs straight into this file's pages (a shared mapping: the page cache holds them and the kernel
writes them back), which costs what anonymous pages cost; every later load maps the file, as llama.cpp maps a GGUF:
the page cache's 2 MB folios map whole, and decode reads them at the bandwidth of anonymous huge pages (31.7-36 GB/s
against 33-34 measured here).

An image is two files under $FASTDECODE_HOME/weights: `KEY-PID-N.bin` (the tensors' bytes; storages of 2 MB or more
start on 2 MB) and `KEY.json` (the manifest: each loaded module's class, plain attributes and tensors, and which data
file holds them), written last so a half-written image is never read. KEY hashes the GGUF's identity and header, samples of its data, the loader's dtype
and the code that lays weights out, so a changed file or a changed layout never maps an old image. The manifest is
parsed as untrusted: classes only from fastdecode and torch.nn, no pickle, every offset checked against the file; the
data is checked against a CRC-32 per 4 MB that its writer recorded (loading/image_checksums.py: in full where the file
changed since, by samples where it did not). The folder must be the user's and writable by nobody else, as the kernel
cache's must (private_files.py): whoever can write there chooses the weights this process runs.
FASTDECODE_WEIGHT_CACHE_GB caps the images kept (least recently used go first; 0: no images), and
FASTDECODE_WEIGHT_CACHE_DIR moves them.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import itertools
import json
import logging
import mmap
import os
import shutil
import threading
from pathlib import Path

import torch
from torch import nn

from fastdecode import memory, private_files
from fastdecode.loading import image_checksums

log = logging.getLogger(__name__)

FORMAT = 2  # 2: checksums and a seal
HUGE = 2 << 20  # storages this large start on a 2 MB boundary of the file, so the page cache can map them in 2 MB
PAGE = mmap.PAGESIZE
DEFAULT_CAP_GB = 50.0
MAX_MANIFEST = 64 << 20
SOURCE = 16  # a key's first hex digits: the file it was built from
WRITERS = itertools.count()
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                     torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                                     torch.bool)}
LAYOUT_CODE = ("quant", "loading", "kernels", "models", "layers", "memory.py")  # what decides the bytes of a weight
MODULE_STATE = set(nn.Module().__dict__)  # nn.Module's own bookkeeping in every module's __dict__


class ImageError(ValueError):
    """An image that cannot be restored (corrupt, or written by other code): it is removed and the GGUF loads."""


def cap_bytes() -> int:
    try:
        return int(float(os.environ.get("FASTDECODE_WEIGHT_CACHE_GB", DEFAULT_CAP_GB)) * 1e9)
    except ValueError:
        return int(DEFAULT_CAP_GB * 1e9)


def image_dir() -> Path:
    return Path(os.environ.get("FASTDECODE_WEIGHT_CACHE_DIR") or private_files.fastdecode_home() / "weights")


@functools.cache
def layout_code_hash() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(torch.__version__.encode())
    for part in LAYOUT_CODE:
        base = root / part
        for p in sorted([base] if base.is_file() else base.rglob("*")):
            if p.suffix in (".py", ".cpp", ".h"):
                h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def image_key(f, dtype: torch.dtype) -> str:
    """f: a GGUFFile -> SOURCE hex digits naming the file (its path), then 16 naming what it holds and how it loads:
    its size, inode and times, its header (metadata and tensor table), 16 samples of its data (a file rewritten in
    place within the clock's tick still differs), the dtype and the layout code. An image of an older version of a
    file, or of older code, has the same first part: writing the new one removes it."""
    st = os.stat(f.path)
    path = str(Path(f.path).resolve())
    h = hashlib.sha256(json.dumps([st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, str(dtype),
                                   layout_code_hash(), FORMAT]).encode())
    h.update(f.buf[:f.header_size])
    for i in range(16):
        at = (len(f.buf) - 4096) * i // 15 if len(f.buf) > 4096 else 0
        h.update(f.buf[at:at + 4096])
    return hashlib.sha256(path.encode()).hexdigest()[:SOURCE] + h.hexdigest()[:16]


# ---- module state <-> manifest -----------------------------------------------------------------------------------
class Tensors:
    """The tensors of a manifest, and the distinct storages they view (a split MoE layer's experts: one storage)."""

    def __init__(self):
        self.entries: list[dict] = []
        self.storages: list[torch.UntypedStorage] = []
        self.index: dict[int, int] = {}  # id(tensor) -> entry: a tensor (a tied weight) is written once
        self.storage_index: dict[int, int] = {}  # storage data_ptr -> storage

    def add(self, t: torch.Tensor) -> int:
        if id(t) in self.index:
            return self.index[id(t)]
        if t.is_meta or t.device.type != "cpu":
            raise ImageError(f"a {t.device} tensor cannot go into an image")
        entry = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                 "parameter": isinstance(t, nn.Parameter)}
        if entry["dtype"] not in DTYPES:
            raise ImageError(f"no image holds {t.dtype}")
        if t.numel():
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.storage_index:
                self.storage_index[key] = len(self.storages)
                self.storages.append(storage)
            entry.update(storage=self.storage_index[key], offset=t.storage_offset(), stride=list(t.stride()))
        self.index[id(t)] = len(self.entries)
        self.entries.append(entry)
        return self.index[id(t)]


def encode_value(v, tensors: Tensors):
    if v is None or type(v) in (bool, int, float, str):
        return v
    if isinstance(v, (tuple, list)):
        return {"tuple" if isinstance(v, tuple) else "list": [encode_value(x, tensors) for x in v]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Tensor):
        return {"tensor": tensors.add(v)}
    raise ImageError(f"an attribute of type {type(v).__name__} cannot go into an image")


def encode_module(m: nn.Module, path: str, seen: dict[int, str], tensors: Tensors) -> dict:
    """A module as its class, plain attributes, tensors and children; one seen before (a tied lm_head that
    QuantEmbedding reads) as a reference to its first path."""
    if id(m) in seen:
        return {"ref": seen[id(m)]}
    seen[id(m)] = path
    cls = type(m)
    if not cls.__module__.startswith(("fastdecode.", "torch.nn.")):
        raise ImageError(f"{cls.__module__}.{cls.__qualname__} cannot go into an image")
    if any(getattr(m, k) for k in MODULE_STATE if "hooks" in k):
        raise ImageError(f"{path} has hooks")
    return {"class": f"{cls.__module__}:{cls.__qualname__}",
            "attrs": {k: encode_value(v, tensors) for k, v in m.__dict__.items() if k not in MODULE_STATE},
            "parameters": {k: None if p is None else tensors.add(p) for k, p in m._parameters.items()},
            "buffers": {k: None if b is None else tensors.add(b) for k, b in m._buffers.items()},
            "non_persistent": sorted(m._non_persistent_buffers_set),
            "children": {k: None if c is None else encode_module(c, f"{path}.{k}", seen, tensors)
                         for k, c in m._modules.items()}}


class Decoder:
    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.modules: dict[str, nn.Module] = {}

    def value(self, v):
        if not isinstance(v, dict):
            return v
        if "tuple" in v or "list" in v:
            items = [self.value(x) for x in v.get("tuple", v.get("list"))]
            return tuple(items) if "tuple" in v else items
        if "dtype" in v:
            return DTYPES[v["dtype"]]
        return self.tensor(v["tensor"])

    def tensor(self, i) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(self.tensors):
            raise ImageError(f"no tensor {i!r}")
        return self.tensors[i]

    def module(self, d: dict, path: str) -> nn.Module:
        if "ref" in d:
            if d["ref"] not in self.modules:
                raise ImageError(f"{path} refers to {d['ref']!r}, not restored before it")
            return self.modules[d["ref"]]
        cls = module_class(d["class"])
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.__dict__.update({k: self.value(v) for k, v in d["attrs"].items() if k not in MODULE_STATE})
        m._parameters.update({k: None if i is None else self.tensor(i) for k, i in d["parameters"].items()})
        m._buffers.update({k: None if i is None else self.tensor(i) for k, i in d["buffers"].items()})
        m._non_persistent_buffers_set.update(d["non_persistent"])
        self.modules[path] = m
        m._modules.update({k: None if c is None else self.module(c, f"{path}.{k}") for k, c in d["children"].items()})
        return m.eval()


def module_class(name: str) -> type[nn.Module]:
    module, _, qualname = str(name).partition(":")
    if not module.startswith(("fastdecode.", "torch.nn.")):
        raise ImageError(f"class {name!r} is not one an image may hold")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module):
        raise ImageError(f"class {name!r} is not one an image may hold")
    return cls


# ---- model <-> image ---------------------------------------------------------------------------------------------
def loaded_state(model: nn.Module, kinds: dict[str, str]) -> dict[str, nn.Module | dict[str, torch.Tensor]]:
    """What a loader put into the meta model, name by name (kinds: name -> "module" for one it replaced, a matrix or
    the embedding, "tensors" for one whose tensors it set, a norm or attention's sinks), and the rope frequency
    factors as the root's tensor."""
    state = {name: model.get_submodule(name) if kind == "module" else
             dict(model.get_submodule(name).named_parameters(recurse=False)) for name, kind in kinds.items()}
    if model.rope_freq_factors is not None:
        state[""] = {"rope_freq_factors": model.rope_freq_factors}
    return state


def apply_state(model: nn.Module, state: dict) -> None:
    for name, value in state.items():
        if isinstance(value, nn.Module):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, value)
        else:
            for key, t in value.items():
                setattr(model.get_submodule(name), key, t)


class ImageWriter:
    """The image being written while the model loads: allocate() is memory.weights_into's allocator."""

    def __init__(self, directory: Path, key: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.key = directory, key
        # named by its writer: two writers (two processes, or two loads in one) never share a file
        self.data = directory / f"{key}-{os.getpid()}-{next(WRITERS)}.bin"
        self.fd = os.open(self.data, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.end = 0
        self.regions: dict[int, int] = {}  # a mapping's address -> its offset in the file
        self.failed = False

    def place(self, nbytes: int) -> int:
        """Reserves nbytes of the file (blocks allocated now: a full disk fails here, not as SIGBUS on a write)."""
        align = HUGE if nbytes >= HUGE else PAGE
        offset = -(-self.end // align) * align
        os.posix_fallocate(self.fd, offset, whole_pages(nbytes))
        self.end = offset + whole_pages(nbytes)
        return offset

    def allocate(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if self.failed or nbytes < memory.MIN_BYTES:
            return None  # small tensors are copied in at the end
        try:
            offset = self.place(nbytes)
            pages = mmap.mmap(self.fd, whole_pages(nbytes), flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        except OSError as e:
            log.warning("weight image: %s; this load keeps its weights in memory only", e)
            self.failed = True
            return None
        memory.advise_huge_pages(pages)
        t = torch.frombuffer(pages, dtype=torch.uint8, count=nbytes)
        self.regions[t.data_ptr()] = offset
        return t.view(dtype).view(*shape)

    def finish(self, state: dict, formats: dict) -> None:
        """Copies in what was not packed into the file, then (in a thread: writing back the packed pages takes
        seconds the caller need not wait for) syncs the file and commits it with its manifest."""
        try:
            if self.failed:
                raise ImageError("the disk refused space")
            tensors, seen = Tensors(), {}
            modules = {name: encode_module(v, name, seen, tensors) if isinstance(v, nn.Module)
                       else {"tensors": {k: tensors.add(t) for k, t in v.items()}} for name, v in state.items()}
            storages = []
            for s in tensors.storages:
                offset = self.regions.get(s.data_ptr())
                if offset is None:
                    offset = at = self.place(s.nbytes())
                    data = memoryview(torch.empty(0, dtype=torch.uint8).set_(s).numpy())
                    while data:  # one write moves at most 2 GB
                        n = os.pwrite(self.fd, data, at)
                        data, at = data[n:], at + n
                storages.append({"offset": offset, "nbytes": s.nbytes()})
        except (ImageError, OSError) as e:
            log.warning("weight image not written: %s", e)
            return self.abandon()
        manifest = {"format": FORMAT, "key": self.key, "data": self.data.name, "file_bytes": self.end,
                    "formats": formats, "storages": storages, "tensors": tensors.entries, "modules": modules}
        threading.Thread(target=self.commit, args=(manifest,), name="weight-image").start()

    def abandon(self) -> None:
        os.close(self.fd)
        self.data.unlink(missing_ok=True)

    def commit(self, manifest: dict) -> None:
        try:
            try:
                manifest["checksums"] = image_checksums.file_checksums(self.fd, self.end)
                os.fdatasync(self.fd)  # the data on disk before the manifest that vouches for it
                manifest["seal"] = image_checksums.seal(os.fstat(self.fd))  # (its last write is behind it)
            finally:
                os.close(self.fd)
            write_manifest(self.directory, self.key, manifest)
            log.info("weight image written: %s (%.2f GB)", self.data, self.end / 1e9)
        except OSError as e:
            log.warning("weight image not written: %s", e)
            self.data.unlink(missing_ok=True)


def write_manifest(directory: Path, key: str, manifest: dict) -> None:
    tmp = directory / f"{key}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / f"{key}.json")


def whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def restore(directory: Path, key: str) -> tuple[dict | None, dict | None]:
    """(the loaded state, as loaded_state gives it, mapped from an image; the formats its writer noted), or Nones where
    there is none. A corrupt image raises ImageError."""
    manifest_path = directory / f"{key}.json"
    if not manifest_path.is_file():
        return None, None
    try:
        with open(manifest_path, "rb") as fh:
            manifest = json.loads(fh.read(MAX_MANIFEST + 1)[:MAX_MANIFEST])
        name = manifest["data"]
        if manifest["format"] != FORMAT or manifest["key"] != key or Path(name).name != name:
            raise ImageError("manifest of another key or format")
        with open(directory / name, "rb") as fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
            if manifest["file_bytes"] != size:
                raise ImageError(f"data is {size} bytes, the manifest says {manifest['file_bytes']}")
            pages = mmap.mmap(fh.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        memory.advise_huge_pages(pages)  # (copy on write: a stray write never reaches the file)
        resealed = image_checksums.check(pages, st, manifest["checksums"], manifest["seal"])
        storages = []
        for s in manifest["storages"]:
            offset, nbytes = s["offset"], s["nbytes"]
            if not (type(offset) is int and type(nbytes) is int and 0 <= offset and 0 < nbytes <= size - offset):
                raise ImageError(f"storage {s} lies outside the file")
            storages.append(torch.frombuffer(pages, dtype=torch.uint8, count=nbytes, offset=offset))
        tensors = []
        for e in manifest["tensors"]:
            dtype = DTYPES[e["dtype"]]
            if "storage" in e:
                if type(e["storage"]) is not int or not 0 <= e["storage"] < len(storages):
                    raise ImageError(f"no storage {e['storage']!r}")
                base = storages[e["storage"]]
                t = base[:base.numel() // dtype.itemsize * dtype.itemsize].view(dtype).as_strided(
                    e["shape"], e["stride"], e["offset"])  # bounds checked by torch
            else:
                t = torch.empty(e["shape"], dtype=dtype)
            tensors.append(nn.Parameter(t, requires_grad=False) if e["parameter"] else t)
        decoder = Decoder(tensors)
        state = {name: decoder.module(d, name) if "tensors" not in d else
                 {k: decoder.tensor(i) for k, i in d["tensors"].items()} for name, d in manifest["modules"].items()}
        formats = {"kept": dict(manifest["formats"]["kept"]), "requantized": dict(manifest["formats"]["requantized"])}
    except (ImageError, OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        raise ImageError(f"{manifest_path}: {e}") from None
    if resealed:  # the data file changed (a touch, a copy) and every chunk still matches: its next load samples
        log.info("weight image %s checked in full: its file changed since it was last checked", manifest_path)
        with contextlib.suppress(OSError):
            write_manifest(directory, key, {**manifest, "seal": resealed})
    with contextlib.suppress(OSError):  # (a read-only cache maps as well)
        os.utime(manifest_path)  # least recently used goes first
    return state, formats


def remove(directory: Path, key: str) -> None:
    manifest = directory / f"{key}.json"
    manifest.unlink(missing_ok=True)
    for data in directory.glob(f"{key}-*.bin"):
        data.unlink(missing_ok=True)


def make_room(directory: Path, need: int, source: str) -> bool:
    """Removes the images of `source` (older versions of the file, or of the code) and evicts the least recently used
    until `need` more bytes fit under the cap, leaving the disk a reserve; False where they cannot (an image larger
    than the cap, a disk too full). Removes data no manifest vouches for whose writer has died (a crash mid-load, an
    image replaced since)."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob(f"{source}*.json"):
        remove(directory, old.stem)
    images = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime)
    for tmp in directory.glob("*.json.*.tmp"):  # a manifest half written
        if not alive(tmp.name.split(".")[-2]):
            tmp.unlink(missing_ok=True)
    for data in directory.glob("*.bin"):
        if not alive(data.stem.split("-")[1] if data.stem.count("-") == 2 else "") and not referenced(data):
            data.unlink(missing_ok=True)
    size = lambda p: sum(d.stat().st_size for d in directory.glob(f"{p.stem}-*.bin"))  # noqa: E731
    total, cap = sum(size(p) for p in images), cap_bytes()
    if need > cap:
        return False
    while images and total + need > cap:
        oldest = images.pop(0)
        total -= size(oldest)
        remove(directory, oldest.stem)
    disk = shutil.disk_usage(directory)
    return disk.free - need > max(4e9, 0.05 * disk.total)


def alive(pid: str) -> bool:
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def referenced(data: Path) -> bool:
    """Whether the manifest of data's key names this file."""
    try:
        manifest = data.with_name(f"{data.stem.split('-')[0]}.json").read_bytes()[:MAX_MANIFEST]
        return json.loads(manifest).get("data") == data.name
    except (OSError, ValueError, AttributeError):
        return False


class WeightImage:
    """One GGUF file's image, for a loader: restore() maps an existing one into the meta model; where there is none,
    the load runs within writing(), which packs the weights into a new one, and finish() commits it."""

    def __init__(self, f, dtype: torch.dtype, enabled: bool = True):
        """f: the GGUFFile being loaded; enabled False (or FASTDECODE_WEIGHT_CACHE_GB=0): no image is read or
        written."""
        self.enabled = enabled and cap_bytes() > 0
        self.directory = image_dir()
        if self.enabled:
            try:
                private_files.private_dir(self.directory, home=self.directory.parent)
            except OSError as e:  # another's or a shared folder (UnsafeDirError), a read-only home: no images
                log.warning("weight images off, the GGUF loads: %s", e)
                self.enabled = False
        self.key = image_key(f, dtype) if self.enabled else ""
        self.size_estimate = sum(t.data.nbytes for t in f.tensors.values())
        self.writer: ImageWriter | None = None

    def restore(self, model: nn.Module, kinds: dict[str, str]) -> dict | None:
        """Where the image filled `model` (kinds: as loaded_state takes them), what finish() was told about the
        formats; else None."""
        if not self.enabled:
            return None
        try:
            state, formats = restore(self.directory, self.key)
            if state is not None and {k: "module" if isinstance(v, nn.Module) else "tensors"
                                      for k, v in state.items() if k} != kinds:
                raise ImageError("it holds other modules than this model's")
        except ImageError as e:
            log.warning("weight image unusable, loading the GGUF instead: %s", e)
            remove(self.directory, self.key)
            return None
        if state is None:
            return None
        apply_state(model, state)
        log.info("gguf: weights mapped from the image %s", self.directory / self.key)
        return formats

    @contextlib.contextmanager
    def writing(self):
        """Packed weights go into a new image where images are kept and the disk has room (else into memory only); a
        load that fails leaves none behind."""
        try:
            if self.enabled and make_room(self.directory, self.size_estimate, self.key[:SOURCE]):
                self.writer = ImageWriter(self.directory, self.key)
            elif self.enabled and cap_bytes() > 0:  # (a cap of 0 turns images off: nothing to say)
                log.warning("weight image not written: %.1f GB would pass the cap (FASTDECODE_WEIGHT_CACHE_GB=%g) or "
                            "leave %s less than 4 GB or 5%% free, so every load of this file packs it again",
                            self.size_estimate / 1e9, cap_bytes() / 1e9, self.directory)
        except OSError as e:  # a read-only home: no image, the load goes on
            log.warning("weight image not written: %s", e)
        try:
            with memory.weights_into(self.writer.allocate if self.writer is not None else None):
                yield
        except BaseException:
            if self.writer is not None:
                self.writer.abandon()
            raise

    def finish(self, model: nn.Module, kinds: dict[str, str], formats: dict) -> None:
        """formats: what restore() gives back (plain values)."""
        if self.writer is not None:
            self.writer.finish(loaded_state(model, kinds), formats)
