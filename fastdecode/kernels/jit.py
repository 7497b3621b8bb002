"""The one JIT builder for fastdecode's C++ modules, over torch.utils.cpp_extension.load.

Each build lives in $FASTDECODE_HOME/kernels/<name>-<key>, the key a hash of the sources, flags, compiler, torch and
Python versions: a checkout never rebuilds another's module or imports a `.so` built from other sources. The
folders must be the user's own and writable by nobody else, since whatever lies there is loaded into the process.
A build holds a lock naming its host and pid; a lock whose process is gone, or that is older than any build takes,
is broken, so a build killed mid-way cannot make later starts wait forever.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from fastdecode import private_files

log = logging.getLogger(__name__)

# Named instruction sets, not -march=native: a cached build must also run on another CPU of the machine pool. Each
# kernel is built once per set it may run on; the CPU picks one at run time (kernel_isa). The sources test the
# compiler's macros (__AVX512F__, __AVX512VNNI__) to take wider paths.
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
ISA_FLAGS = {
    "avx2": AVX2_FLAGS,
    # Ice Lake and later Xeons, Zen 4 and later: 16-float vectors and int8 dot products in one instruction (vpdpbusd).
    "avx512": AVX2_FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                            # AMX's int8 tiles (Sapphire Rapids and later) are used only where amx.cpp finds them at
                            # run time: the flags let the compiler emit them, it never does so on its own.
                            "-mamx-tile", "-mamx-int8"],
}
LDFLAGS = ["-fopenmp"]
BUILT = "built"  # written once a build has finished: a later start imports its module without torch's builder
STALE_LOCK_S = 30 * 60  # a build takes 30-90 s on 2 cores; a lock this old belongs to a build that died
POLL_S = 0.5


class NativeBuildError(RuntimeError):
    """A native module cannot be had and FASTDECODE_REQUIRE_NATIVE=1 says that is a failure (CI)."""


def native_enabled() -> bool:
    return (os.environ.get("FASTDECODE_NATIVE_KERNELS", "1") != "0"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def cpu_has_avx512() -> bool:
    """AVX-512 F/BW/VL/DQ (torch's AVX512 capability) and VNNI (which torch does not report: the kernel's flags)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx512_vnni" in line.split() for line in f)
    except OSError:
        return False


def kernel_isa() -> str:
    """The instruction set the native kernels are built for: the widest this CPU runs, or FASTDECODE_KERNEL_ISA=avx2
    (the narrow build on a wide CPU, for A/B runs and tests)."""
    best = "avx512" if cpu_has_avx512() else "avx2"
    asked = os.environ.get("FASTDECODE_KERNEL_ISA", best)
    if asked == best or asked == "avx2":
        return asked
    log.warning("fastdecode: ignoring FASTDECODE_KERNEL_ISA=%s: this CPU runs %s", asked,
                " or ".join(sorted({"avx2", best})))
    return best


def native_required() -> bool:
    return os.environ.get("FASTDECODE_REQUIRE_NATIVE") == "1"


def build(name: str, sources: list[Path], fallback: str, isa: str = "avx2"):
    """The compiled module for instruction set `isa` (named `name`_`isa`, so that builds for two sets can be loaded
    side by side), or None (with a warning that says what callers do instead, `fallback`) where native kernels are
    off or cannot be built; with FASTDECODE_REQUIRE_NATIVE=1, NativeBuildError instead of None."""
    try:
        if not native_enabled():
            raise NativeBuildError("native kernels are off (FASTDECODE_NATIVE_KERNELS=0) or the CPU lacks AVX2")
        flags, module = ISA_FLAGS[isa], f"{name}_{isa}"
        home = private_files.fastdecode_home()
        directory = private_dir(home / "kernels" / f"{module}-{build_key(sources, flags + LDFLAGS)}")
        # The key names these sources and this toolchain, so a finished build there has nothing left to check.
        if (directory / BUILT).is_file() and (directory / f"{module}.so").is_file():
            return import_built(module, directory)
        from torch.utils.cpp_extension import load  # 0.13 s to import, and a ninja run: only where we build

        with build_lock(directory):
            # copies: load() appends torch's own flags to the lists it is given, which changed the next key
            built = load(module, [str(s) for s in sources], extra_cflags=list(flags), extra_ldflags=list(LDFLAGS),
                         build_directory=str(directory))
            (directory / BUILT).touch()
            return built
    except Exception as e:  # no compiler, no ninja, a compile error, an unsafe folder: PyTorch's kernels still work
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if native_required():
            raise NativeBuildError(f"{name}: {reason} (FASTDECODE_REQUIRE_NATIVE=1)") from e
        if native_enabled():
            log.warning("fastdecode: %s unavailable, %s (%s)", name, fallback, reason)
        return None


def import_built(module: str, directory: Path):
    """The module a finished build left in `directory`, imported as torch's load() imports it."""
    spec = importlib.util.spec_from_file_location(module, directory / f"{module}.so")
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    return built


def build_key(sources: list[Path], flags: list[str]) -> str:
    """The sources and the headers beside them (their names and bytes), the flags and the toolchain, hashed."""
    files = sorted({*sources, *(h for s in sources for h in s.parent.glob("*.h"))})
    h = hashlib.sha256()
    for part in [*flags, compiler_version(), torch.__version__, sys.version]:
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def compiler_version() -> str:
    """What torch compiles with ($CXX, else c++), as it reports itself."""
    try:
        return subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "no compiler"


def private_dir(directory: Path) -> Path:
    """`directory` ($FASTDECODE_HOME/kernels/NAME-KEY), made if missing; raises unless it and kernels/ are the user's
    and writable by nobody else, and the home is not writable by everyone (private_files.private_dir): whoever can
    write in any of them chooses the code this process loads."""
    try:
        return private_files.private_dir(directory, home=directory.parent.parent)
    except private_files.UnsafeDirError as e:
        raise NativeBuildError(f"refusing to build or load native kernels in {e}") from None


@contextmanager
def build_lock(directory: Path):
    """Holds `directory`/build.lock ("host pid") while torch builds or loads there, breaking a stale one."""
    lock = directory / "build.lock"
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            if stale(lock):
                log.warning("fastdecode: breaking the stale build lock %s", lock)
                break_lock(lock)
            else:
                time.sleep(POLL_S)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        break
    try:
        # torch's own lock, left by a build killed inside load(): every build here holds ours first, so it is stale.
        (directory / "lock").unlink(missing_ok=True)
        yield
    finally:
        lock.unlink(missing_ok=True)


def stale(lock: Path) -> bool:
    try:
        host, _, pid = lock.read_text().partition(" ")
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:  # released meanwhile: try again
        return False
    if age > STALE_LOCK_S:
        return True
    return host == socket.gethostname() and pid.strip().isdigit() and not alive(int(pid))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def break_lock(lock: Path):
    """Renames before deleting, so that of several processes breaking the same lock one succeeds and none deletes
    a fresh lock another has just taken."""
    aside = lock.with_name(f"{lock.name}.stale-{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return
    aside.unlink(missing_ok=True)
