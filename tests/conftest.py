"""Shared fixtures: the real models come from the cache that `fastdecode pull` fills (make test pulls them)."""
import pytest
import torch

from fastdecode.loading.catalog import CATALOG, cached_path

torch.set_num_threads(2)


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
