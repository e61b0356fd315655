"""Test configuration: markers that skip cleanly where there is no GPU or no compiled extension.

Nothing here touches the GPU at import or collection time; availability is checked when a marked test is
about to run (and cached).
"""

import functools

import pytest


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
    if item.get_closest_marker("cuda") or item.get_closest_marker("sm90"):
        reason = _cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    if item.get_closest_marker("sm90") and _capability() != (9, 0):
        pytest.skip(f"needs compute capability 9.0, device has {_capability()}")
