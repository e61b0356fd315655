"""What a module launches, counted on any device: `OpCalls`, a ``TorchDispatchMode`` that records the ops a piece of
code calls itself, and `KERNELS_PER_OP`, how many CUDA kernels each of the package's multi-kernel ops launches, so
that a CPU run of a decode step says how many kernels the same step launches on the GPU (tests/models and tests/hf
pin the per-layer counts of issue 36 with them).

On the CPU every op of ``torch.ops.cutlass_w8a8`` runs its reference, whose own torch calls are nested and not
recorded; pure views (``aten::view``, ``aten::t``, ``aten::slice``: ``OpOverload.is_view``) and ``aten::lift_fresh``
(a Python scalar made a tensor) launch nothing and are left out.
"""

from __future__ import annotations

from typing import Optional

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KERNELS_PER_OP", "OpCalls", "cuda_kernels"]

#: CUDA kernels of the package's ops that launch more than one (every other op, and every aten op a decode step
#: calls, is one): decode_attention(_quant) is split-KV, a split kernel and a combine kernel
#: (csrc/attention/decode_attention.cu); moe_decode_experts is the prep (x's quantization), gate/up and down kernels
#: (csrc/moe/moe_decode.cu).
KERNELS_PER_OP = {"cutlass_w8a8::decode_attention": 2, "cutlass_w8a8::decode_attention_quant": 2,
                  "cutlass_w8a8::moe_decode_experts": 3}

_NO_LAUNCH = ("aten::lift_fresh",)


class OpCalls(TorchDispatchMode):
    """``with OpCalls() as calls: ...`` records in ``calls.names`` the name (``"cutlass_w8a8::rope_kv_cache_"``,
    ``"aten::mm"``) of every op the code calls at the top level that can launch a kernel, in call order."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._depth == 0 and not func.is_view and func.name() not in _NO_LAUNCH:
            self.names.append(func.name())
        self._depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._depth -= 1


def cuda_kernels(names: list[str], per_op: Optional[dict] = None) -> int:
    """The CUDA kernels the ops ``names`` launch: `KERNELS_PER_OP` (or ``per_op``) for the multi-kernel ones, 1
    for every other."""
    table = KERNELS_PER_OP if per_op is None else per_op
    return sum(table.get(n, 1) for n in names)
