"""GEMM shapes the benchmarks share (bench/bench_gemm.py, bench/bench_decode_gemm.py): `SHAPES` (the Llama-3
linears) and `BLOCK_SHAPES` (the models that ship block-scaled fp8 checkpoints: DeepSeek-V3, Qwen3)."""

from __future__ import annotations

from typing import Optional

__all__ = ["BLOCK_SHAPES", "SHAPES", "select_shapes"]

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


# (name, N, K) of the block-scaled fp8 comparison (issue 26), every K a multiple of 128:
# - DeepSeek-V3 (the shapes of vLLM's block-fp8 GEMM benchmarks, as the issue lists them): K 7168 with N 2112
#   (the fused q_a / kv_a projection: 1536 + 512 + 64), 24576, 32768 and 7168, and K 16384 with N 7168.
# - Qwen3-8B (hidden 4096, MLP 12288, 32 query and 8 key/value heads of 128) and Qwen3-32B (hidden 5120, MLP 25600,
#   64 query and 8 key/value heads of 128; its attention width 8192 is not the hidden size), qkv and gate/up fused.
BLOCK_SHAPES: tuple[tuple[str, int, int], ...] = (
    ("dsv3-n2112-k7168", 2112, 7168),
    ("dsv3-n24576-k7168", 24576, 7168),
    ("dsv3-n32768-k7168", 32768, 7168),
    ("dsv3-n7168-k7168", 7168, 7168),
    ("dsv3-n7168-k16384", 7168, 16384),
    ("q3-8b-qkv", 6144, 4096),
    ("q3-8b-o", 4096, 4096),
    ("q3-8b-gate_up", 24576, 4096),
    ("q3-8b-down", 4096, 12288),
    ("q3-32b-qkv", 10240, 5120),
    ("q3-32b-o", 5120, 8192),
    ("q3-32b-gate_up", 51200, 5120),
    ("q3-32b-down", 5120, 25600),
)


def select_shapes(filters: Optional[str], shapes: tuple[tuple[str, int, int], ...] = SHAPES
                  ) -> list[tuple[str, int, int]]:
    """The ``shapes`` (default `SHAPES`) whose name contains one of the comma-separated substrings of ``filters``
    (all of them when ``filters`` is empty)."""
    if not filters:
        return list(shapes)
    keys = [f.strip() for f in filters.split(",") if f.strip()]
    return [s for s in shapes if any(key in s[0] for key in keys)]
