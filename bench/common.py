"""Helpers shared by the benchmarks: run statistics, machine description, JSON and markdown writers."""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path


def stats(runs: list[float]) -> dict:
    """Min/median/max of the timed runs, the runs kept as measured (in order) so drift stays visible."""
    if not runs:
        return {"min": None, "median": None, "max": None, "runs": []}
    return {"min": min(runs), "median": statistics.median(runs), "max": max(runs), "runs": list(runs)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def machine() -> dict:
    import torch

    flags = cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
           if f in flags]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "isa": isa, "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_avg_1m_at_start": load}


def command_line() -> str:
    return shlex.join([Path(sys.executable).name, *sys.argv])


def git_state() -> dict:
    """The commit a benchmark measured, and whether tracked files differed from it."""
    return {"commit": git("rev-parse", "HEAD").decode().strip(),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}


def write_json(path: Path, data: dict) -> None:
    """Writes a result, with the commit it measured (git_state) unless the caller recorded it already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**git_state(), **data}, indent=2) + "\n")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def fmt_range(s: dict, spec: str = ".1f") -> str:
    """'median (min-max)' of a stats() dict."""
    if not s or s.get("median") is None:
        return "-"
    if len(s["runs"]) == 1:
        return format(s["median"], spec)
    return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"


def git(*args) -> bytes:
    import subprocess

    return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          check=True).stdout


def short_sha(rev: str) -> str:
    return git("rev-parse", "--short=10", rev).decode().strip()


def package_at(rev: str) -> Path:
    """A directory holding the `fastdecode` package as it was at git revision `rev`: put it first on sys.path, before
    anything imports fastdecode, to run that revision's Python (with native_kernels_at(rev) for its kernels)."""
    import io
    import tarfile
    import tempfile

    sha = short_sha(rev)
    top = Path(tempfile.gettempdir()) / f"fastdecode-src-{sha}"
    if not (top / "fastdecode" / "__init__.py").exists():
        with tarfile.open(fileobj=io.BytesIO(git("archive", sha, "fastdecode"))) as tar:
            tar.extractall(top, filter="data")
    return top


def kernels_changed_since(rev: str) -> bool:
    """Whether the kernel sources in the working tree differ from revision `rev`'s."""
    return bool(git("diff", "--name-only", short_sha(rev), "--", "fastdecode/kernels/").strip())


def native_kernels_at(rev: str):
    """fastdecode's native kernels as they were at git revision `rev`, built as a second extension module beside the
    current one, so that a benchmark can time both side by side in one process. The packed weight layouts must be
    the same at both revisions (they are since the int8 offsets, commit 261b9b5)."""
    import tempfile

    from fastdecode.kernels import SOURCES
    from fastdecode.kernels.jit import build, kernel_isa

    sha = short_sha(rev)
    top = Path(tempfile.mkdtemp(prefix=f"fastdecode-kernels-{sha}-"))  # private: whatever is here gets compiled
    for name in git("ls-tree", "--name-only", sha, "fastdecode/kernels/").decode().split():
        if name.endswith((".cpp", ".h")):
            (top / Path(name).name).write_bytes(git("show", f"{sha}:{name}"))
    # the instruction set the current kernels are built for: an A/B of two builds for different sets measures those
    ops = build(f"fastdecode_native_{sha}", [top / s.name for s in SOURCES], "the A/B cannot run", kernel_isa())
    if ops is None:
        raise SystemExit(f"the native kernels at {sha} do not build (see the warning above)")
    return ops
