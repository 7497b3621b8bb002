"""The JIT builder: build folders keyed by what went into the build, stale locks broken, unsafe folders refused,
and FASTDECODE_REQUIRE_NATIVE=1 turning a failed build into an error."""
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from fastdecode.kernels import jit as builder
from fastdecode.kernels.jit import NativeBuildError, build, build_key, build_lock, private_dir


@pytest.fixture()
def sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cpp").write_text("int f() { return 1; }\n")
    (src / "a.h").write_text("#pragma once\n")
    return [src / "a.cpp"]


def test_build_key_changes_with_sources_headers_and_flags(sources):
    key = build_key(sources, ["-O3"])
    assert build_key(sources, ["-O3"]) == key and build_key(sources, ["-O2"]) != key
    (sources[0].parent / "a.h").write_text("#pragma once\n#define X 1\n")
    assert build_key(sources, ["-O3"]) != key
    sources[0].write_text("int f() { return 2; }\n")
    assert build_key(sources, ["-O3"]) != key


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def locked(directory, text: str, age_s: float = 0):
    lock = directory / "build.lock"
    lock.write_text(text)
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    (directory / "lock").touch()  # torch's own, left by a build killed inside load()


def acquired_within(directory, seconds: float) -> bool:
    """Whether a build takes (and releases) the lock on `directory` within `seconds`."""
    done = threading.Event()

    def take():
        with build_lock(directory):
            pass
        done.set()
    threading.Thread(target=take, daemon=True).start()
    return done.wait(seconds)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(builder, "POLL_S", 0.01)


def test_a_lock_left_by_a_dead_process_is_broken(tmp_path):
    locked(tmp_path, f"{socket.gethostname()} {dead_pid()}\n")
    assert acquired_within(tmp_path, 5)
    assert not (tmp_path / "lock").exists() and not (tmp_path / "build.lock").exists()


def test_a_lock_older_than_any_build_is_broken(tmp_path):
    locked(tmp_path, "another-host 1\n", age_s=builder.STALE_LOCK_S + 1)
    assert acquired_within(tmp_path, 5)


def test_a_live_build_lock_is_waited_for(tmp_path):
    locked(tmp_path, f"{socket.gethostname()} {os.getpid()}\n")
    assert not acquired_within(tmp_path, 0.3)
    (tmp_path / "build.lock").unlink()
    assert acquired_within(tmp_path, 5)


@pytest.mark.parametrize("folder, mode", [("home", 0o777), ("kernels", 0o770), ("build", 0o707)])
def test_a_cache_folder_others_can_write_is_refused(tmp_path, folder, mode):
    directory = tmp_path / "home" / "kernels" / "build"
    private_dir(directory)
    {"home": directory.parent.parent, "kernels": directory.parent, "build": directory}[folder].chmod(mode)
    with pytest.raises(NativeBuildError, match="not writable by others"):
        private_dir(directory)


def test_a_group_writable_home_is_accepted_and_new_folders_are_private(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o775)
    home.chmod(0o775)  # what umask 002 gives under user-private groups
    directory = private_dir(home / "kernels" / "build")
    assert (directory.stat().st_mode & 0o777) == (directory.parent.stat().st_mode & 0o777) == 0o700


@pytest.fixture()
def broken_build(tmp_path, monkeypatch, sources):
    monkeypatch.setenv("FASTDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FASTDECODE_NATIVE_KERNELS", "1")
    sources[0].write_text("this is not C++\n")
    return lambda: build("fastdecode_test_broken", sources, "testing")


def test_a_failed_build_falls_back_to_none(broken_build, monkeypatch):
    monkeypatch.delenv("FASTDECODE_REQUIRE_NATIVE", raising=False)
    assert broken_build() is None


def test_require_native_makes_a_failed_build_an_error(broken_build, monkeypatch):
    monkeypatch.setenv("FASTDECODE_REQUIRE_NATIVE", "1")
    with pytest.raises(NativeBuildError, match="fastdecode_test_broken"):
        broken_build()
    monkeypatch.setenv("FASTDECODE_NATIVE_KERNELS", "0")
    with pytest.raises(NativeBuildError, match="off"):
        broken_build()


def test_a_finished_build_is_imported_without_torchs_builder():
    """A start after the build imports the module it left (0.2 s less than cpp_extension's import and ninja run)."""
    from fastdecode.kernels import native_ops

    if native_ops() is None:
        pytest.skip("native kernels are off here")
    code = ("import sys; from fastdecode.kernels import native_ops; m = native_ops(); "
            "print(m.__name__, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == [native_ops().__name__, "False"]
