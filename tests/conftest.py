"""Shared fixtures: the real models come from the cache that `fastdecode pull` fills (make test pulls them)."""
import os

import pytest
import torch

from fastdecode.loading.catalog import cached_path

torch.set_num_threads(2)
# No weight images (loading/weight_image.py) in the suite, so that every load of a test file runs the loader it tests
# (and nothing lands in the user's cache); tests/loading/test_weight_image.py turns them on. Child processes (the
# CLI, the server) inherit this.
os.environ.setdefault("FASTDECODE_WEIGHT_CACHE_GB", "0")
# No prefix cache on disk either (engine/kv_disk.py): a block left by an earlier test or run would turn a test's cold
# prompt into a hit. tests/engine/test_kv_disk.py gives its caches their own folder.
os.environ.setdefault("FASTDECODE_KV_DISK_GB", "0")


def real_model_path(name: str):
    path = cached_path(name)
    if not path.exists():
        pytest.skip(f"{name} is not pulled (run `fastdecode pull {name}`)")
    return path


@pytest.fixture(scope="session")
def smollm2_path():
    return real_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path():
    return real_model_path("gemma3-270m")
