"""Fixtures shared by the GEMM tests."""

import pytest


@pytest.fixture
def cutlass_only():
    """The decode GEMM off (scaled_mm runs the CUTLASS kernels at every M); the bound restored afterwards."""
    import cutlass_w8a8 as cw

    previous = cw._ext.set_decode_gemm_max_m(0)
    yield
    cw._ext.set_decode_gemm_max_m(previous)
