"""bench/bench_gemm.py's methods: the names of the timed methods, the inputs of a point (`Weights` of a shape,
`Activations` of an M) and `build_methods`, which gives ``name -> (fn, args)`` for every method but the torchao
peers (bench/_gemm_torchao.py). Every tensor is on `DEVICE`, the current CUDA device
(tests/bench/test_bench_gemm_block_cpu.py runs the sweep's flow with ``"cpu"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

DEVICE = "cuda"

# torchao peers: (method, torchao.quantization config class, label). See `TorchaoPeers`.
TORCHAO_PEERS = (
    ("torchao_int8wo", "Int8WeightOnlyConfig", "int8 weight-only"),
    ("torchao_int8dq", "Int8DynamicActivationInt8WeightConfig", "int8 dynamic activation, int8 weight"),
    ("torchao_fp8row", "Float8DynamicActivationFloat8WeightConfig", "fp8 dynamic activation, fp8 weight, per row"),
)
TORCHAO_METHODS = tuple(name for name, _, _ in TORCHAO_PEERS)
TORCHAO_FP8_METHODS = frozenset({"torchao_fp8row"})

METHODS = ("bf16", "int_mm_scaled", "torch_fp8_rowwise", "ours_int8", "ours_fp8", "ours_fp8_accurate", "linear_bf16",
           "linear_w8a8", "linear_w8a8_fp8", "quant_int8", "ours_int8_nopdl", "linear_w8a8_nopdl") + TORCHAO_METHODS
# Methods whose failure is recorded instead of aborting the run (torch's own limits, an fp8 build missing,
# the torchao peers).
OPTIONAL_METHODS = frozenset({"int_mm_scaled", "torch_fp8_rowwise", "ours_fp8", "ours_fp8_accurate", "linear_w8a8_fp8",
                              *TORCHAO_METHODS})


# ----------------------------------------------------------------------------------------------------
# inputs and the timed callables


@dataclasses.dataclass
class Weights:
    """The ``(N, K)`` weights of one shape: bf16, int8 and fp8 copies, per-channel scale ``(N,)`` float32,
    the bf16 ``nn.Linear`` with its int8 ``W8A8Linear`` and (when asked for) its fp8 one, or why that one
    could not be built, the torchao peers' quantized copies of the linear by method name, and (when asked for)
    the block-scaled fp8 operands."""

    w_bf16: torch.Tensor
    w_int8: torch.Tensor
    w_fp8: torch.Tensor
    scale_b: torch.Tensor
    linear: torch.nn.Module
    qlinear: torch.nn.Module
    qlinear_fp8: Optional[torch.nn.Module] = None
    qlinear_fp8_error: Optional[str] = None
    torchao: dict = dataclasses.field(default_factory=dict)
    # block-scaled fp8 (bench/_gemm_block.py), when asked for: the (ceil(N/128), K/128) weight block scales of
    # w_fp8, torch's layout of them, and the linear's block-scaled W8A8Linear (or why it could not be built)
    scale_b_block: Optional[torch.Tensor] = None
    scale_b_block_torch: Optional[torch.Tensor] = None
    qlinear_block: Optional[torch.nn.Module] = None
    qlinear_block_error: Optional[str] = None


@dataclasses.dataclass
class Activations:
    """The ``(M, K)`` activations of one point: bf16, int8 and fp8, and a per-token scale ``(M, 1)`` float32."""

    x_bf16: torch.Tensor
    a_int8: torch.Tensor
    a_fp8: torch.Tensor
    scale_a: torch.Tensor


def _random_int8(*shape: int) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=DEVICE)


def _random_fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE).to(torch.float8_e4m3fn)


def _random_scales(*shape: int) -> torch.Tensor:
    """Positive float32 scales, uniform in [0.5e-3, 1.5e-3)."""
    return (torch.rand(*shape, dtype=torch.float32, device=DEVICE) + 0.5) * 1e-3


def make_weights(n: int, k: int, w8a8_linear: type, fp8_config: Any = None) -> Weights:
    """Random weights of one shape; ``fp8_config`` (a ``W8A8Config`` with fp8) also builds the fp8 linear."""
    linear = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16).requires_grad_(False)
    wts = Weights(w_bf16=torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE), w_int8=_random_int8(n, k),
                  w_fp8=_random_fp8(n, k), scale_b=_random_scales(n), linear=linear,
                  qlinear=w8a8_linear.from_float(linear))
    if fp8_config is not None:
        try:
            wts.qlinear_fp8 = w8a8_linear.from_float(linear, fp8_config)
        except Exception as exc:  # noqa: BLE001 (a build without fp8 kernels: recorded, not fatal)
            wts.qlinear_fp8_error = short_error(exc)
    return wts


def make_activations(m: int, k: int) -> Activations:
    return Activations(x_bf16=torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE), a_int8=_random_int8(m, k),
                       a_fp8=_random_fp8(m, k), scale_a=_random_scales(m, 1))


def bf16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.t())


def int_mm_scaled(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor, scale_b_row: torch.Tensor) -> torch.Tensor:
    return (torch._int_mm(a, w.t()).float() * scale_a * scale_b_row).to(torch.bfloat16)


def torch_fp8_rowwise(a: torch.Tensor, w: torch.Tensor, scale_a: torch.Tensor,
                      scale_b_row: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b_row, out_dtype=torch.bfloat16)


def module_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def quantize_tokens(x: torch.Tensor):
    """The activation quantization of `W8A8Linear`'s forward: dynamic per-token int8."""
    return torch.ops.cutlass_w8a8.quantize_per_token(x, torch.int8)


def without_pdl(fn: Callable, set_pdl: Callable[[bool], bool]) -> Callable:
    """``fn`` with the sm90 GEMMs launched without PDL (the setting is read at launch, so also at capture)."""

    def call(*args):
        previous = set_pdl(False)
        try:
            return fn(*args)
        finally:
            set_pdl(previous)

    return call


def build_methods(scaled_mm: Callable, wts: Weights, act: Activations, fp8: bool,
                  set_pdl: Optional[Callable[[bool], bool]] = None,
                  fp8_accurate: bool = True) -> dict[str, tuple[Callable, tuple]]:
    """``name -> (fn, args)`` for every method of the point but the torchao peers (`TorchaoPeers.methods`),
    in `METHODS` order; ``fn(*args)`` is timed. The ``*_nopdl`` methods are left out when ``set_pdl`` is
    None, ``ours_fp8``, ``ours_fp8_accurate`` and ``linear_w8a8_fp8`` without ``fp8`` (the latter also when it
    was not built), ``ours_fp8_accurate`` also without ``fp8_accurate``.

    ``ours_fp8_accurate`` is ``ours_fp8`` (same operands) with ``fp8_fast_accum=False``: on sm90 the fp8 table's
    accurate rows, which promote the partial sums into float32 every 128 of K (issue 37); at M <=
    ``decode_gemm_max_m()`` both run the decode GEMM, which accumulates in float32 either way."""

    def ours(a, w, scale_a, scale_b):
        return scaled_mm(a, w.t(), scale_a, scale_b, torch.bfloat16)

    def ours_accurate(a, w, scale_a, scale_b):
        return scaled_mm(a, w.t(), scale_a, scale_b, torch.bfloat16, fp8_fast_accum=False)

    scale_b_row = wts.scale_b.view(1, -1)
    methods = {
        "bf16": (bf16_matmul, (act.x_bf16, wts.w_bf16)),
        "int_mm_scaled": (int_mm_scaled, (act.a_int8, wts.w_int8, act.scale_a, scale_b_row)),
        "torch_fp8_rowwise": (torch_fp8_rowwise, (act.a_fp8, wts.w_fp8, act.scale_a, scale_b_row)),
        "ours_int8": (ours, (act.a_int8, wts.w_int8, act.scale_a, wts.scale_b)),
        "ours_fp8": (ours, (act.a_fp8, wts.w_fp8, act.scale_a, wts.scale_b)),
        "ours_fp8_accurate": (ours_accurate, (act.a_fp8, wts.w_fp8, act.scale_a, wts.scale_b)),
        "linear_bf16": (module_forward, (wts.linear, act.x_bf16)),
        "linear_w8a8": (module_forward, (wts.qlinear, act.x_bf16)),
        "linear_w8a8_fp8": (module_forward, (wts.qlinear_fp8, act.x_bf16)),
        "quant_int8": (quantize_tokens, (act.x_bf16,)),
    }
    if set_pdl is not None:
        methods["ours_int8_nopdl"] = (without_pdl(ours, set_pdl), methods["ours_int8"][1])
        methods["linear_w8a8_nopdl"] = (without_pdl(module_forward, set_pdl), methods["linear_w8a8"][1])
    if not fp8:
        del methods["ours_fp8"]
    if not fp8 or not fp8_accurate:
        del methods["ours_fp8_accurate"]
    if not fp8 or wts.qlinear_fp8 is None:
        del methods["linear_w8a8_fp8"]
    return methods


def short_error(exc: BaseException) -> str:
    """The first line of an exception's message, with its type, at most 300 characters."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
