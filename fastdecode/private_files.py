"""Folders whose contents the process trusts: the native kernels it imports (kernels/jit.py) and the weight images it
maps (loading/weight_image.py). Whoever can write in such a folder, or replace it, chooses the code or the weights
this process runs, so each must be the user's own and writable by nobody else."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def fastdecode_home() -> Path:
    """The root of fastdecode's own folders: models, built kernels, weight images, logs."""
    return Path(os.environ.get("FASTDECODE_HOME") or Path.home() / ".cache" / "fastdecode")


class UnsafeDirError(OSError):
    """A trusted folder that is another user's, or that others can write in."""


def private_dir(directory: Path, home: Path) -> Path:
    """`directory`, made (mode 0700, with the folders between it and `home`) where missing; raises UnsafeDirError
    unless it and every folder below `home` on the way are the user's and writable by nobody else, and `home` is not
    writable by everyone (whoever can write in `home` can replace the folders below it). The home may be
    group-writable: umask 002 makes it so under user-private groups."""
    home.mkdir(parents=True, exist_ok=True)
    parts = directory.relative_to(home).parts
    folders = [home.joinpath(*parts[:i + 1]) for i in range(len(parts))]
    for path in folders:
        path.mkdir(mode=0o700, exist_ok=True)
    for path, writers in ((home, stat.S_IWOTH), *((p, stat.S_IWGRP | stat.S_IWOTH) for p in folders)):
        st = path.stat()
        if (path != home and st.st_uid != os.getuid()) or st.st_mode & writers:
            raise UnsafeDirError(f"{path}: it must be yours and not writable by others (chmod go-w)")
    return directory
