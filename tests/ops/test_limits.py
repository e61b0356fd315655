"""The size limits of the ops' contracts are decided once: csrc/core/limits.hpp for the CUDA checks and
cutlass_w8a8/ops/_limits.py for the CPU and fake implementations hold the same numbers (no compiler needed:
the header's constexpr expressions are evaluated here)."""

from __future__ import annotations

import pathlib
import re

import pytest

from cutlass_w8a8.ops import _limits

HEADER = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "core" / "limits.hpp"

# C++ name in limits.hpp -> Python name in ops/_limits.py
PAIRS = {
    "kInt8MaxK": "INT8_MAX_K",
    "kGemmAlign": "GEMM_ALIGN",
    "kMaxM": "MAX_M",
    "kMaxRows": "MAX_ROWS",
    "kMaxRowK": "MAX_ROW_K",
    "kDecodeMaxM": "DECODE_MAX_M",
    "kDecodeMaxK": "DECODE_MAX_K",
    "kNormDecodeMaxK": "NORM_DECODE_MAX_K",
    "kAttnMaxHeadDim": "ATTN_MAX_HEAD_DIM",
    "kAttnHeadDimMultiple": "ATTN_HEAD_DIM_MULTIPLE",
    "kAttnMaxHeads": "ATTN_MAX_HEADS",
    "kAttnMaxSeq": "ATTN_MAX_SEQ",
    "kBlockSize": "BLOCK_SIZE",
    "kMoeMaxExperts": "MOE_MAX_EXPERTS",
    "kMoeMaxGroups": "MOE_MAX_GROUPS",
    "kMoeDecodeMaxPairs": "MOE_DECODE_MAX_PAIRS",
    "kMoeRouterRouteMaxT": "MOE_ROUTER_ROUTE_MAX_T",
    "kMoeRouterHMultiple": "MOE_ROUTER_H_MULTIPLE",
    "kFp8FastAccumDefault": "FP8_FAST_ACCUM",  # 1 / 0 against True / False
}


def header_constants() -> dict:
    """{name: value} of every `constexpr int64_t kName = <integer expression>;` in limits.hpp."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    out = {}
    for name, expr in re.findall(r"constexpr\s+int64_t\s+(\w+)\s*=\s*([^;]+);", text):
        py = re.sub(r"int64_t\{([^}]*)\}", r"(\1)", expr).replace("/", "//")
        assert re.fullmatch(r"[\d\s()+\-*/<>]+", py), f"{name}: cannot evaluate {expr!r}"
        out[name] = eval(py, {"__builtins__": {}})  # noqa: S307 (digits and operators only, checked above)
    return out


def test_every_header_limit_is_paired():
    assert set(header_constants()) == set(PAIRS), "add the new limit to PAIRS and to ops/_limits.py"


@pytest.mark.parametrize("cpp,py", sorted(PAIRS.items()))
def test_limit_is_the_same_in_cpp_and_python(cpp, py):
    assert header_constants()[cpp] == getattr(_limits, py), f"{cpp} (limits.hpp) != {py} (ops/_limits.py)"


def test_int8_max_k_is_the_overflow_bound():
    """The largest multiple of the GEMM alignment with K * 128 * 128 <= 2**31 - 1."""
    k = _limits.INT8_MAX_K
    assert k % _limits.GEMM_ALIGN == 0 and k * 128 * 128 <= 2**31 - 1 < (k + _limits.GEMM_ALIGN) * 128 * 128


def test_block_size_is_the_gemm_alignment_multiple():
    """1 x 128 groups and 128 x 128 blocks: K % 128 == 0 implies the GEMM's K % 16 == 0."""
    assert _limits.BLOCK_SIZE == 128 and _limits.BLOCK_SIZE % _limits.GEMM_ALIGN == 0
