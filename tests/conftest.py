"""Test configuration: markers that skip cleanly where there is no GPU or no compiled extension.

Nothing here touches the GPU at import or collection time; availability is checked when a marked test is
about to run (and cached).
"""

import functools
import os

import pytest

from _full import FULL_SKIP_REASON, FULL_TESTS  # the quick / full split of the matrix (tests/_full.py)


def pytest_configure(config):
    """Under pytest-xdist (``-n N``), each worker runs torch with cores // N threads (at least 1), and so do the
    processes it starts (``OMP_NUM_THREADS``, read when they import torch): N workers each running a pool as large
    as the machine wait on each other's descheduled threads (a tiny decoder step on 2 cores with 2 workers: about
    10x slower). Serial runs keep torch's default."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    threads = max(1, (os.cpu_count() or 1) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _cuda_skip_reason():
    import torch

    import cutlass_w8a8

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not cutlass_w8a8.cuda_ops_available():
        return f"CUDA extension not built ({cutlass_w8a8.extension_status()})"
    return None


@functools.lru_cache(maxsize=None)
def _capability():
    import torch

    return torch.cuda.get_device_capability()


def pytest_runtest_setup(item):
    if not FULL_TESTS and item.get_closest_marker("full"):
        pytest.skip(FULL_SKIP_REASON)
    if item.get_closest_marker("cuda") or item.get_closest_marker("sm90"):
        reason = _cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    if item.get_closest_marker("sm90") and _capability() != (9, 0):
        pytest.skip(f"needs compute capability 9.0, device has {_capability()}")
