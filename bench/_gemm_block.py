"""bench/bench_gemm.py's block-scaled fp8 comparison (issue 26): the methods, the fp8 accuracy paths, the derived
numbers and targets, and the report (Markdown tables and the PNG).

Block-scaled fp8 (DeepSeek-V3, Qwen3-FP8, compressed-tensors FP8_BLOCK): ``a`` e4m3 ``(M, K)`` with float32 scales
``(M, K/128)`` (one per 1 x 128 group of a row, from ``quantize_per_token_group``), the weight e4m3 ``(N, K)`` with
float32 scales ``(ceil(N/128), K/128)`` (one per 128 x 128 block), ``out = sum_kb sa[:, kb] sb[n // 128, kb]
(a_kb @ w_kb^T)``. The methods (``name -> (fn, args)``, all bf16 out, timed like every other method of a point):

- ``ours_block``: ``cutlass_w8a8.scaled_mm(a, w.t(), sa, sb)`` with block scales, as it dispatches (the decode
  GEMM at M <= ``decode_gemm_max_m()``, the CUTLASS blockwise kernels above).
- ``ours_block_cutlass`` (M <= ``decode_gemm_max_m()`` only): the same with the decode path off
  (``cutlass_w8a8._ext.set_decode_gemm_max_m(0)`` around the call, hence around its capture).
- ``ours_block_decode`` (``decode_gemm_max_m() < M <= 16`` only): ``cutlass_w8a8.scaled_mm_decode`` on the same
  operands. With the previous one: the kernel family that the dispatch does not pick at M <= 16, measured.
- ``torch_block``: ``torch.nn.functional.scaled_mm(a, w.t(), sa', ScalingType.BlockWise1x128, sb',
  ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)`` (cuBLASLt, ``use_fast_accum=False``, torch's
  default), with the scales in the layouts torch checks for this recipe: ``sa'`` the same ``(M, K/128)`` values
  column-major (strides ``(1, M)``), ``sb'`` ``(L4, ceil(N/128))`` with strides ``(1, L4)``, ``L4`` = K/128 rounded
  up to a multiple of 4 (the weight scales transposed, zero-padded; made once per shape, not timed). Where torch
  refuses a shape (M = 1 on torch 2.11 per the issue, or its cuBLASLt has no kernel) the error is recorded and
  the point shows n/a.
- ``ours_fp8`` / ``ours_fp8_accurate`` / ``torch_fp8_rowwise`` / ``bf16`` / ``linear_w8a8_fp8``: the row-wise fp8
  (fast accumulation, and accurate: ``fp8_fast_accum=False``, left out with ``--no-fp8-accurate``) and bf16 methods
  of bench/_gemm_methods.py on the same ``a`` and ``w``.
- ``linear_w8a8_block``: ``W8A8Linear.from_float(linear, W8A8Config(dtype=float8_e4m3fn, weight_block_size=(128,
  128)))`` on the bf16 ``x``: the group quantization plus the block GEMM, beside ``linear_w8a8_fp8``.

Accuracy (`accuracy_paths`, reported with bench/_gemm_accuracy.fp8_path_errors): every fp8 kernel family on its
own, whatever the dispatch would pick: ``cutlass_fp8`` / ``cutlass_fp8_accurate`` (``fp8_fast_accum=False``) /
``cutlass_block`` (decode path off), ``decode_fp8`` / ``decode_block`` (``scaled_mm_decode``, M <= 16),
``torch_fp8_rowwise``, ``torch_block``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

import _gemm_methods
from _gemm_accuracy import BLOCK_REL_TARGET, Operands
from _gemm_methods import module_forward, short_error, torch_fp8_rowwise
from cutlass_w8a8.testing.physical import judge, mark, physical_check, verdict
from cutlass_w8a8.testing.report import save_figure

GROUP = 128  # cutlass_w8a8.ops._limits.BLOCK_SIZE
DECODE_MAX_M = 16  # cutlass_w8a8.DECODE_MAX_M: scaled_mm_decode's bound

BLOCK_METHODS = ("ours_block", "ours_block_cutlass", "ours_block_decode", "torch_block", "linear_w8a8_block")
# the methods of `python bench/bench_gemm.py --block`, in report order
BLOCK_MODE_METHODS = ("bf16", "torch_fp8_rowwise", "ours_fp8", "ours_fp8_accurate", "linear_w8a8_fp8") + BLOCK_METHODS
# failures recorded as results (a build without block kernels, torch's limits, a W8A8Config without blocks)
BLOCK_OPTIONAL = frozenset(BLOCK_METHODS)
ACCURACY_PATHS = ("cutlass_fp8", "cutlass_fp8_accurate", "decode_fp8", "cutlass_block", "decode_block",
                  "torch_fp8_rowwise", "torch_block")
ACCURACY_LABELS = {"cutlass_fp8": "CUTLASS row-wise", "cutlass_fp8_accurate": "CUTLASS row-wise accurate",
                   "decode_fp8": "decode row-wise", "cutlass_block": "CUTLASS block",
                   "decode_block": "decode block", "torch_fp8_rowwise": "torch row-wise",
                   "torch_block": "torch block"}

# Targets (issue 26), one run, H100 or H200:
TARGET_X_TORCH_MIN = 1.0        # ours_block >= 1.0x torch_block at every measured M >= 16
TARGET_X_TORCH_GEOMEAN = 1.2    # geomean over those points >= 1.2x
TARGET_READ_FRACTION = 0.85     # at M <= 16: weight bytes / time >= 85% of the read rate measured in the run
TARGET_X_ROWWISE_LARGE_M = 0.9  # at M >= 1024: ours_block >= 0.9x our row-wise fp8
TARGET_M_TORCH = 16
TARGET_M_LARGE = 1024


# ----------------------------------------------------------------------------------------------------
# operands


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def random_scales(*shape: int) -> torch.Tensor:
    """Positive float32 scales, uniform in [0.5e-3, 1.5e-3), on `_gemm_methods.DEVICE` (as _gemm_methods')."""
    return _gemm_methods._random_scales(*shape)


def torch_scale_a(scale_a: torch.Tensor) -> torch.Tensor:
    """``(M, K/128)`` group scales in the layout torch's BlockWise1x128 recipe checks: column-major, strides
    ``(1, M)`` (made with ``empty_strided``: ``.t().contiguous().t()`` gives strides ``(K/128, 1)`` at M = 1)."""
    m, kb = scale_a.shape
    out = torch.empty_strided((m, kb), (1, m), dtype=scale_a.dtype, device=scale_a.device)
    return out.copy_(scale_a)


def torch_scale_b(scale_b: torch.Tensor) -> torch.Tensor:
    """``(ceil(N/128), K/128)`` block scales (N-major, the checkpoint layout) in the layout torch's BlockWise128x128
    recipe checks for ``b = w.t()``: ``(L4, ceil(N/128))`` with strides ``(1, L4)``, L4 = K/128 rounded up to a
    multiple of 4, the padding zero."""
    nb, kb = scale_b.shape
    l4 = ceil_div(kb, 4) * 4
    padded = torch.zeros(nb, l4, dtype=scale_b.dtype, device=scale_b.device)
    padded[:, :kb] = scale_b
    return padded.t()


@dataclasses.dataclass
class BlockOperands:
    """The block scales of one point beside the row-wise operands of bench/_gemm_methods.py (the same e4m3 ``a``
    ``(M, K)`` and ``w`` ``(N, K)``): ``scale_a`` ``(M, K/128)`` and ``scale_b`` ``(ceil(N/128), K/128)`` float32
    row-major, and torch's layouts of them (`torch_scale_a`, `torch_scale_b`)."""

    scale_a: torch.Tensor
    scale_b: torch.Tensor
    scale_a_torch: torch.Tensor
    scale_b_torch: torch.Tensor


def block_weight_scales(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(ceil(N/128), K/128)`` weight block scales and torch's layout of them."""
    sb = random_scales(ceil_div(n, GROUP), k // GROUP)
    return sb, torch_scale_b(sb)


def block_operands(m: int, k: int, scale_b: torch.Tensor, scale_b_torch: torch.Tensor) -> BlockOperands:
    sa = random_scales(m, k // GROUP)
    return BlockOperands(sa, scale_b, torch_scale_a(sa), scale_b_torch)


def block_linear(linear: torch.nn.Module, cw: Any) -> tuple[Optional[torch.nn.Module], Optional[str]]:
    """``(W8A8Linear with 128 x 128 weight blocks of linear, None)`` or ``(None, why not)``."""
    try:
        config = cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(GROUP, GROUP))
        return cw.W8A8Linear.from_float(linear, config), None
    except Exception as exc:  # noqa: BLE001 (a build or version without block layers: recorded)
        return None, short_error(exc)


# ----------------------------------------------------------------------------------------------------
# methods and accuracy paths


def torch_block(a: torch.Tensor, w: torch.Tensor, scale_a_torch: torch.Tensor,
                scale_b_torch: torch.Tensor) -> torch.Tensor:
    """torch's blockwise fp8 GEMM, ``a @ w.t()`` with BlockWise1x128 x BlockWise128x128 scales (cuBLASLt), bf16."""
    import torch.nn.functional as F

    return F.scaled_mm(a, w.t(), scale_a_torch, F.ScalingType.BlockWise1x128, scale_b_torch,
                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


def with_decode_off(fn: Callable, set_decode_gemm_max_m: Callable[[int], int]) -> Callable:
    """``fn`` with scaled_mm's decode path off (the bound is read at launch, so also at capture): the CUTLASS
    kernels at every M."""

    def call(*args):
        previous = set_decode_gemm_max_m(0)
        try:
            return fn(*args)
        finally:
            set_decode_gemm_max_m(previous)

    return call


def block_methods(cw: Any, w_fp8: torch.Tensor, a_fp8: torch.Tensor, blk: BlockOperands, x_bf16: torch.Tensor,
                  qlinear_block: Optional[torch.nn.Module], decode_max_m: int) -> dict[str, tuple[Callable, tuple]]:
    """``name -> (fn, args)`` of the block methods of one point (`BLOCK_METHODS`; see the module docstring):
    ``ours_block_cutlass`` only at M <= ``decode_max_m``, ``ours_block_decode`` only at ``decode_max_m`` < M <= 16,
    ``linear_w8a8_block`` only when ``qlinear_block`` was built."""
    m = a_fp8.shape[0]

    def ours(a, w, sa, sb):
        return cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)

    def decode(a, w, sa, sb):
        return cw.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16)

    args = (a_fp8, w_fp8, blk.scale_a, blk.scale_b)
    methods = {"ours_block": (ours, args)}
    if m <= decode_max_m:
        methods["ours_block_cutlass"] = (with_decode_off(ours, cw._ext.set_decode_gemm_max_m), args)
    elif m <= DECODE_MAX_M:
        methods["ours_block_decode"] = (decode, args)
    methods["torch_block"] = (torch_block, (a_fp8, w_fp8, blk.scale_a_torch, blk.scale_b_torch))
    if qlinear_block is not None:
        methods["linear_w8a8_block"] = (module_forward, (qlinear_block, x_bf16))
    return methods


def accuracy_paths(cw: Any, a_fp8: torch.Tensor, w_fp8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   blk: Optional[BlockOperands], accurate: bool = True) -> dict[str, tuple[Callable, tuple, Operands]]:
    """The fp8 GEMM paths of `ACCURACY_PATHS` for bench/_gemm_accuracy.fp8_path_errors, and ``ours_fp8`` /
    ``ours_fp8_accurate`` / ``ours_block`` (`scaled_mm` as it dispatches: the accuracy guard of the timed methods):
    row-wise on ``(a_fp8, w_fp8, scale_a (M, 1), scale_b (N,))``, block on ``blk``'s scales (left out when ``blk``
    is None); the decode ones only at M <= 16; ``ours_fp8_accurate`` and ``cutlass_fp8_accurate``
    (``fp8_fast_accum=False``) only with ``accurate``."""
    m = a_fp8.shape[0]
    set_max = cw._ext.set_decode_gemm_max_m

    def ours(a, w, sa, sb):
        return cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)

    def ours_accurate(a, w, sa, sb):
        return cw.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, fp8_fast_accum=False)

    def decode(a, w, sa, sb):
        return cw.scaled_mm_decode(a, w.t(), sa, sb, torch.bfloat16)

    row = Operands(a_fp8, w_fp8, scale_a, scale_b, False)
    paths = {"ours_fp8": (ours, row[:4], row)}
    if accurate:
        paths["ours_fp8_accurate"] = (ours_accurate, row[:4], row)
    paths["cutlass_fp8"] = (with_decode_off(ours, set_max), row[:4], row)
    if accurate:
        paths["cutlass_fp8_accurate"] = (with_decode_off(ours_accurate, set_max), row[:4], row)
    if m <= DECODE_MAX_M:
        paths["decode_fp8"] = (decode, row[:4], row)
    if blk is not None:
        block = Operands(a_fp8, w_fp8, blk.scale_a, blk.scale_b, True)
        paths["ours_block"] = (ours, block[:4], block)
        paths["cutlass_block"] = (with_decode_off(ours, set_max), block[:4], block)
        if m <= DECODE_MAX_M:
            paths["decode_block"] = (decode, block[:4], block)
    paths["torch_fp8_rowwise"] = (torch_fp8_rowwise, (a_fp8, w_fp8, scale_a, scale_b.view(1, -1)), row)
    if blk is not None:
        paths["torch_block"] = (torch_block, (a_fp8, w_fp8, blk.scale_a_torch, blk.scale_b_torch), block)
    return paths


# ----------------------------------------------------------------------------------------------------
# derived numbers and targets


def block_weight_bytes(n: int, k: int) -> int:
    """Bytes of a block-scaled e4m3 weight ``(N, K)`` and its float32 ``(ceil(N/128), K/128)`` scales."""
    return n * k + 4 * ceil_div(n, GROUP) * (k // GROUP)


def derive_block(m: int, n: int, k: int, times: dict[str, float], read_gbps: Optional[float],
                 copy_gbps: Optional[float] = None) -> dict[str, Any]:
    """Derived numbers of one point's block methods (``times`` in ms per call): times in us, speedups (baseline
    time / ours: > 1, ours is faster), TOPS, and the weight-stream rate of ``ours_block`` (`block_weight_bytes` /
    time, GB/s = 1e9 B/s) with its fraction of the read and copy rates. ``alt`` is the kernel family the
    dispatch did not pick at this M (``ours_block_cutlass`` or ``ours_block_decode``), None above M = 16."""

    def ratio(num: str, den: str) -> Optional[float]:
        return times[num] / times[den] if num in times and den in times else None

    alt = next((name for name in ("ours_block_cutlass", "ours_block_decode") if name in times), None)
    ours = times.get("ours_block")
    gbps = block_weight_bytes(n, k) / (ours * 1e-3) / 1e9 if ours else None
    return {
        "time_us": {name: times[name] * 1e3 for name in ("bf16", "torch_fp8_rowwise", "ours_fp8", "ours_fp8_accurate",
                                                         "linear_w8a8_fp8", *BLOCK_METHODS) if name in times},
        "tops": 2 * m * n * k / (ours * 1e-3) / 1e12 if ours else None,
        "x_torch_block": ratio("torch_block", "ours_block"),
        "x_ours_fp8": ratio("ours_fp8", "ours_block"),
        # against the accurate row-wise fp8 (promoted every 128 of K, as block fp8 always is)
        "x_ours_fp8_accurate": ratio("ours_fp8_accurate", "ours_block"),
        "x_bf16": ratio("bf16", "ours_block"),
        "x_torch_fp8": ratio("torch_fp8_rowwise", "ours_block"),
        "torch_block_x_torch_fp8": ratio("torch_fp8_rowwise", "torch_block"),
        "alt": alt,
        "alt_x_ours_block": ratio(alt, "ours_block") if alt else None,
        "linear_x_linear_fp8": ratio("linear_w8a8_fp8", "linear_w8a8_block"),
        "weight_GBps": gbps,
        "weight_over_read": gbps / read_gbps if gbps is not None and read_gbps else None,
        "weight_over_copy": gbps / copy_gbps if gbps is not None and copy_gbps else None,
    }


def _target(key: str, label: str, value: Optional[float], bound: float, sense: str, detail: str = "",
            invalid: Optional[str] = None) -> dict:
    """One target; ``invalid`` (a `physical_check` reason) leaves it unjudged: ``met`` None."""
    met, invalid = judge(None if value is None else (value >= bound if sense == ">=" else value <= bound), invalid)
    return {"key": key, "label": label, "value": value, "bound": bound, "sense": sense, "met": met, "detail": detail,
            "invalid": invalid}


def read_check(p: dict) -> Optional[str]:
    """`physical_check` of a point's weight stream over the read rate measured in the run (at most 1: the weights
    stream from HBM, cold L2), at M <= 16 where it is reported."""
    if p["M"] > DECODE_MAX_M:
        return None
    return physical_check(p["block"].get("weight_over_read"), 1.0,
                          f"{p['shape']} M = {p['M']} weight stream / measured read rate")


def _worst(points: list[dict], value: Callable[[dict], Optional[float]], lowest: bool = True):
    vals = [(value(p), p) for p in points]
    vals = [(v, p) for v, p in vals if v is not None]
    if not vals:
        return None, ""
    v, p = (min if lowest else max)(vals, key=lambda vp: vp[0])
    return v, f"worst {p['shape']} M = {p['M']}; {len(vals)} points"


def block_targets(points: list[dict], geomean: Callable) -> list[dict]:
    """The issue-26 targets over the points that hold ``"block"`` numbers (`derive_block`) and ``"accuracy"``."""
    pts = [p for p in points if p.get("block")]
    large = [p for p in pts if p["M"] >= TARGET_M_TORCH]
    small = [p for p in pts if p["M"] <= DECODE_MAX_M]
    big = [p for p in pts if p["M"] >= TARGET_M_LARGE]
    items = []
    v, d = _worst(large, lambda p: p["block"]["x_torch_block"])
    items.append(_target("x_torch_min", f"ours block / torch block at every M >= {TARGET_M_TORCH} (x, the lowest)",
                         v, TARGET_X_TORCH_MIN, ">=", d))
    xs = [p["block"]["x_torch_block"] for p in large if p["block"]["x_torch_block"] is not None]
    items.append(_target("x_torch_geomean", f"ours block / torch block, geomean over M >= {TARGET_M_TORCH} (x)",
                         geomean(xs), TARGET_X_TORCH_GEOMEAN, ">=", f"{len(xs)} points"))
    v, d = _worst(small, lambda p: p["block"]["weight_over_read"])
    items.append(_target("read_fraction", "weight stream / measured read rate at M = 1..16 (the lowest)", v,
                         TARGET_READ_FRACTION, ">=", d, "; ".join(filter(None, map(read_check, small))) or None))
    v, d = _worst(big, lambda p: p["block"]["x_ours_fp8"])
    items.append(_target("x_rowwise_large", f"ours block / our row-wise fp8 at M >= {TARGET_M_LARGE} (x, the lowest)",
                         v, TARGET_X_ROWWISE_LARGE_M, ">=", d))
    for path in ("cutlass_block", "decode_block"):
        v, d = _worst(pts, lambda p: (p.get("accuracy") or {}).get(path, {}).get("rel_fro"), lowest=False)
        items.append(_target(f"rel_err_{path}", f"{ACCURACY_LABELS[path]} relative error vs float64, bf16 out "
                             "(the highest)", v, BLOCK_REL_TARGET, "<=", d))
    return items


# ----------------------------------------------------------------------------------------------------
# report


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


BLOCK_POINT_COLUMNS = (
    ("ours block us", lambda b: b["time_us"].get("ours_block"), ".1f"),
    ("torch block us", lambda b: b["time_us"].get("torch_block"), ".1f"),
    ("ours fp8 us", lambda b: b["time_us"].get("ours_fp8"), ".1f"),
    ("ours fp8 acc us", lambda b: b["time_us"].get("ours_fp8_accurate"), ".1f"),
    ("torch fp8 us", lambda b: b["time_us"].get("torch_fp8_rowwise"), ".1f"),
    ("bf16 us", lambda b: b["time_us"].get("bf16"), ".1f"),
    ("x torch block", lambda b: b["x_torch_block"], ".2f"),
    ("x ours fp8", lambda b: b["x_ours_fp8"], ".2f"),
    ("x ours fp8 acc", lambda b: b.get("x_ours_fp8_accurate"), ".2f"),
    ("x bf16", lambda b: b["x_bf16"], ".2f"),
    ("torch block x torch fp8", lambda b: b["torch_block_x_torch_fp8"], ".2f"),
    ("other family x", lambda b: b["alt_x_ours_block"], ".2f"),
    ("TOPS", lambda b: b["tops"], ".0f"),
    ("weight GB/s", lambda b: b["weight_GBps"], ".0f"),
    ("of read", lambda b: b["weight_over_read"], ".2f"),
    ("linear block us", lambda b: b["time_us"].get("linear_w8a8_block"), ".1f"),
    ("x linear fp8", lambda b: b["linear_x_linear_fp8"], ".2f"),
)


def block_point_table(points: list[dict]) -> str:
    """Markdown, one row per (shape, M) with block numbers. "of read" only at M <= 16 (the issue's range)."""
    heads = [c for c, _, _ in BLOCK_POINT_COLUMNS]
    rows = ["| M | shape | " + " | ".join(heads) + " |", "|---:|:---|" + "---:|" * len(heads)]
    for p in points:
        b = p.get("block")
        if not b:
            continue
        cells = []
        for head, get, spec in BLOCK_POINT_COLUMNS:
            v = get(b)
            if head == "of read" and p["M"] > DECODE_MAX_M:
                v = None
            cells.append(mark(_fmt(v, spec), read_check(p)) if head == "of read" else _fmt(v, spec))
        rows.append(f"| {p['M']} | {p['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


BLOCK_SUMMARY_COLUMNS = (("x torch block", "x_torch_block"), ("x ours fp8", "x_ours_fp8"),
                         ("x ours fp8 acc", "x_ours_fp8_accurate"), ("x bf16", "x_bf16"),
                         ("x torch fp8", "x_torch_fp8"), ("torch block x torch fp8", "torch_block_x_torch_fp8"),
                         ("linear block x linear fp8", "linear_x_linear_fp8"), ("of read", "weight_over_read"))


def block_summary_table(points: list[dict], geomean: Callable, bounds=(1, 8, 16, 64, 512, 2048, None)) -> str:
    """Markdown: geomeans of the block speedups by M range (the upper bounds ``bounds``, inclusive)."""
    rows = ["| M | points | " + " | ".join(c for c, _ in BLOCK_SUMMARY_COLUMNS) + " |",
            "|:---|---:|" + "---:|" * len(BLOCK_SUMMARY_COLUMNS)]
    pts = [p for p in points if p.get("block")]
    lower = 0
    for upper in bounds:
        members = [p for p in pts if p["M"] > lower and (upper is None or p["M"] <= upper)]
        if members:
            ms = sorted({p["M"] for p in members})
            label = f"{ms[0]}–{ms[-1]}" if len(ms) > 1 else str(ms[0])
            cells = [_fmt(geomean([p["block"][key] for p in members if p["block"].get(key) is not None]), ".2f")
                     for _, key in BLOCK_SUMMARY_COLUMNS]
            rows.append(f"| {label} | {len(members)} | " + " | ".join(cells) + " |")
        if upper is not None:
            lower = upper
    return "\n".join(rows)


def accuracy_table(points: list[dict]) -> str:
    """Markdown: per M, the highest relative Frobenius error against float64 over the shapes, per fp8 path, and the
    bf16 floor (the float64 result rounded to bf16); every point's numbers are in the JSON."""
    paths = [p for p in ACCURACY_PATHS if any(p in (q.get("accuracy") or {}) for q in points)]
    heads = [ACCURACY_LABELS[p] for p in paths] + ["bf16 floor"]
    rows = ["| M | shapes | " + " | ".join(heads) + " |", "|---:|---:|" + "---:|" * len(heads)]
    for m in sorted({p["M"] for p in points if p.get("accuracy")}):
        accs = [p["accuracy"] for p in points if p["M"] == m and p.get("accuracy")]
        cells = []
        for key in (*paths, "bf16_floor"):
            vals = [a[key]["rel_fro"] for a in accs if key in a]
            if key == "bf16_floor":
                vals += [a["bf16_floor_block"]["rel_fro"] for a in accs if "bf16_floor_block" in a]
            cells.append(_fmt(max(vals) if vals else None, ".2e"))
        rows.append(f"| {m} | {len(accs)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def targets_lines(items: list[dict]) -> list[str]:
    lines = []
    for it in items:
        spec = ".2e" if it["key"].startswith("rel_err") else ".3f"
        detail = f"; {it['detail']}" if it["detail"] else ""
        lines.append(f"- {it['label']}: {_fmt(it['value'], spec)} (target {it['sense']} {it['bound']:g}): "
                     f"{verdict(it['met'], it.get('invalid'))}{detail}")
    return lines


def block_notes(results: dict[str, Any]) -> list[str]:
    """Header bullets on the block methods, the read rate and the accuracy corner."""
    return [
        "- ours block = `cutlass_w8a8.scaled_mm(a, w.t(), sa, sb)`: e4m3 `a` (M, K) with float32 1x128 group scales "
        "(M, K/128), e4m3 weight (N, K) with float32 128x128 block scales (ceil(N/128), K/128), bf16 out; "
        f"dispatched (decode GEMM at M <= {results.get('decode_gemm_max_m', '?')}, CUTLASS blockwise above). "
        "other family x = the time of the kernel family the dispatch does not pick (CUTLASS at M <= that bound, "
        "the decode GEMM above it up to 16) / ours.",
        "- torch block = `torch.nn.functional.scaled_mm` with `ScalingType.BlockWise1x128` x "
        "`ScalingType.BlockWise128x128` (cuBLASLt, `use_fast_accum=False`), scales in the layouts torch checks "
        "(column-major (M, K/128); (round_up(K/128, 4), ceil(N/128)) with strides (1, L4)). ours fp8 / torch fp8 = "
        "row-wise fp8 (`cutlass_w8a8.scaled_mm`, `torch._scaled_mm`) on the same e4m3 operands; ours fp8 acc = ours "
        "fp8 with `fp8_fast_accum=False` (promoted every 128 of K, as block fp8 is); bf16 = cuBLAS `torch.matmul`.",
        "- x <baseline> = baseline time / ours (> 1: ours is faster). weight GB/s = (N*K + 4 * ceil(N/128) * K/128) "
        "bytes / ours; of read = that / the read rate measured in this run "
        f"({_fmt(results.get('block_read_GBps'), '.0f')} "
        "GB/s, a float32 max-reduction over 1 GiB, the best of the measurements at the start and the end of the run; "
        f"device copy {_fmt(results.get('copy_GBps'), '.0f')} GB/s, bytes read + written), shown at M <= 16.",
        "- linear block = `W8A8Linear` with `W8A8Config(dtype=float8_e4m3fn, weight_block_size=(128, 128))` on "
        "bf16 x (`quantize_per_token_group` + the block GEMM); x linear fp8 = the row-wise fp8 W8A8Linear's time "
        "/ its.",
        f"- accuracy: relative Frobenius error against a float64 GEMM of the dequantized operands, on the top-left "
        f"{results.get('accuracy_corner', '256 x 1024')} of each output (all of K); each kernel family forced "
        "(CUTLASS: decode path off; decode: `scaled_mm_decode`, M <= 16). bf16 floor = the float64 result rounded "
        "to bf16.",
    ]


def error_lines(points: list[dict], names) -> list[str]:
    """One line per method or path of ``names`` that failed somewhere: the values of M and the first message."""
    failed: dict[str, tuple[list[int], str]] = {}
    for p in points:
        for name, msg in p["errors"].items():
            if name not in names:
                continue
            ms, _ = failed.setdefault(name, ([], msg))
            if p["M"] not in ms:
                ms.append(p["M"])
    return [f"- `{name}` did not run at M in {{{', '.join(map(str, sorted(ms)))}}}: `{msg}`"
            for name, (ms, msg) in failed.items()]


def block_sections(results: dict[str, Any], geomean: Callable, level: str = "##", notes: bool = True) -> list[str]:
    """The block part of a report: tables per point and by M and the targets (where the points have block
    numbers), the fp8 accuracy table (where they have accuracy numbers), the failures; led by `block_notes`
    under a heading of its own when ``notes``."""
    points = results["points"]
    lines = []
    if notes and any(p.get("block") or p.get("accuracy") for p in points):
        lines += ["", f"{level} Block-scaled fp8 and fp8 accuracy: what was measured", "", *block_notes(results)]
    if any(p.get("block") for p in points):
        lines += ["", f"{level} Block-scaled fp8 per shape and M", "", block_point_table(points), "",
                  f"{level} Block-scaled fp8: geomeans by M", "", block_summary_table(points, geomean), "",
                  f"{level} Targets (issue 26)", "", *targets_lines(results.get("block_targets") or [])]
    if any(p.get("accuracy") for p in points):
        lines += ["", f"{level} fp8 accuracy against float64 (highest over the shapes at each M)", "",
                  accuracy_table(points)]
    errs = error_lines(points, set(BLOCK_METHODS) | set(ACCURACY_PATHS) | {"torch_fp8_rowwise", "ours_fp8",
                                                                            "ours_fp8_accurate", "linear_w8a8_fp8"})
    if errs:
        lines += ["", f"{level} Block methods and accuracy paths that did not run", "", *errs]
    return lines


def render_block_markdown(results: dict[str, Any], geomean: Callable) -> str:
    """The report of ``bench_gemm.py --block``."""
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    lines = [
        f"# Block-scaled fp8 GEMM benchmark: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}; "
        f"L2 {results['l2_bytes'] / 2**20:.0f} MiB; PDL {'on' if results.get('pdl') else 'off'}",
        "- shapes (N, K): " + ", ".join(f"{s['name']} ({s['N']}, {s['K']})" for s in results["shapes"]),
        f"- times: cold-L2 CUDA-graph replays over rotating input copies, median of {results['timing']['replays']} "
        "replays; the methods of a point captured first and their replays interleaved (same clocks).",
        *block_notes(results),
    ]
    lines += block_sections(results, geomean, notes=False)
    return "\n".join(lines) + "\n"


def plot_block(results: dict[str, Any], path: str) -> None:
    """PNG: ours block over torch block, over our row-wise fp8 (solid: fast accumulation; dashed, same colour:
    accurate, where measured), and the weight stream / read rate at M <= 16, against M, one line per shape (needs
    matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    panels = ((axes[0], "x_torch_block", "ours block / torch blockwise scaled_mm (x)", TARGET_X_TORCH_MIN, None),
              (axes[1], "x_ours_fp8", "ours block / our row-wise fp8 (x; dashed: accurate)", TARGET_X_ROWWISE_LARGE_M,
               None),
              (axes[2], "weight_over_read", "weight stream / read rate, M <= 16", TARGET_READ_FRACTION,
               DECODE_MAX_M))
    points = [p for p in results["points"] if p.get("block")]
    for shape in dict.fromkeys(p["shape"] for p in points):
        pts = sorted((p for p in points if p["shape"] == shape), key=lambda p: p["M"])
        for ax, key, _, _, max_m in panels:
            xy = [(p["M"], p["block"][key]) for p in pts
                  if p["block"].get(key) is not None and (max_m is None or p["M"] <= max_m)]
            if xy:
                line, = ax.plot(*zip(*xy), marker="o", markersize=3, label=shape)
                acc = [(p["M"], p["block"]["x_ours_fp8_accurate"]) for p in pts
                       if key == "x_ours_fp8" and p["block"].get("x_ours_fp8_accurate") is not None]
                if acc:
                    ax.plot(*zip(*acc), marker="x", markersize=3, linestyle="--", color=line.get_color())
    for ax, _, title, target, _ in panels:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("M (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    save_figure(fig, path, f"Block-scaled fp8 GEMM, {results['device']}, torch {results['torch_version']}")
