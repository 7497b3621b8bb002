"""The held-out corpus every machine has: the Python standard library of the running interpreter.

Windows are taken from top-level `*.py` files of `sysconfig.get_paths()["stdlib"]`, sorted by name and picked at
evenly spaced places in that list (argparse, inspect, shutil... rather than sixteen private `_*.py` modules), one
window from the middle of each file (past the license header and imports, into the code). The same interpreter
version gives the same tokens on every machine.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_windows(encode, n_windows: int, window: int, files: list[Path] | None = None):
    """-> (token windows (n_windows, window) int64, the file each came from). `encode`: text -> token ids.
    A file shorter than a window gives way to the next one in sorted order."""
    files = stdlib_files() if files is None else files
    rows, names, used = [], [], set()
    for i in range(n_windows):
        j = i * len(files) // n_windows
        while j < len(files):
            if j not in used:
                used.add(j)
                ids = encode(files[j].read_text(encoding="utf-8", errors="replace"))
                if len(ids) >= window:
                    start = (len(ids) - window) // 2
                    rows.append(ids[start:start + window])
                    names.append(files[j].name)
                    break
            j += 1
    if len(rows) < n_windows:
        raise ValueError(f"the corpus has only {len(rows)} files of {window}+ tokens; asked for {n_windows}")
    return torch.tensor(rows, dtype=torch.long), names
