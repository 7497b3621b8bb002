"""The engine's thread must be the process's only OpenMP team (kernels/openmp.py): releasing a thread's workers has
to work with the runtime torch ships, or the engine silently decodes at half speed again."""
import threading

import torch

from fastdecode.kernels.openmp import release_openmp_workers


def _parallel_work():
    torch.ones(1 << 22).sum()  # large enough for at::parallel_for to start an OpenMP team


def test_release_after_parallel_work_in_main_thread():
    _parallel_work()
    assert release_openmp_workers()
    _parallel_work()  # a later region gets a fresh team
    assert release_openmp_workers()


def test_release_in_a_thread_without_a_team():
    results = []
    t = threading.Thread(target=lambda: results.append(release_openmp_workers()))
    t.start()
    t.join()
    assert results == [True]
