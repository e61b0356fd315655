"""GEMM shapes the benchmarks share (bench/bench_gemm.py, bench/bench_decode_gemm.py)."""

from __future__ import annotations

from typing import Optional

__all__ = ["SHAPES", "select_shapes"]

# (name, N, K) of the Llama-3 linears: QKV and gate/up fused, as serving engines run them.
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("l3-8b-qkv", 6144, 4096),
    ("l3-8b-o", 4096, 4096),
    ("l3-8b-gate_up", 28672, 4096),
    ("l3-8b-down", 4096, 14336),
    ("l3-70b-qkv", 10240, 8192),
    ("l3-70b-o", 8192, 8192),
    ("l3-70b-gate_up", 57344, 8192),
    ("l3-70b-down", 8192, 28672),
)


def select_shapes(filters: Optional[str]) -> list[tuple[str, int, int]]:
    """The `SHAPES` whose name contains one of the comma-separated substrings (all when ``filters`` is empty)."""
    if not filters:
        return list(SHAPES)
    keys = [f.strip() for f in filters.split(",") if f.strip()]
    return [s for s in SHAPES if any(key in s[0] for key in keys)]
