"""The cases `scripts/sanitize.py` runs under compute-sanitizer: every op of the schema (`cutlass_w8a8.ops._schema.OPS`,
the one DEF block) in the modes it serves, each result checked.

A `Case` names the schema ops it calls (``ops``) and runs them on small problems whose sizes cross the dispatch
buckets that matter (decode M <= 16 against the CUTLASS GEMMs, the grouped decode bound, empty experts, K tails,
row lengths that take the cluster kernels). `run_case` records, with a torch dispatch mode, which ops of the namespace
were called on the case's device, and fails the case when one it names was not: a case cannot claim an op it does not
drive. `coverage_errors` fails the whole run when an op of the schema is named by no case and is not in `NOT_DRIVEN`,
so a new op cannot go without a sanitizer run unnoticed.

Every result is checked, so a kernel that silently did nothing (or too little) shows:

- GEMMs (dense, decode, block, grouped) against the float64 product of the dequantized operands, within the bounds
  of the CUDA tests (`assert_close_to_reference`; `block_reference` for block fp8); outputs start as host-written
  NaN, so an element left unwritten fails;
- quantization, MoE routing (align, permute-quant, unpermute) bit for bit against the CPU implementations, which do
  the kernels' float32 arithmetic; `moe_topk_softmax` ids exactly and weights within a few float32 ulps;
- the fused quantizers (norm, SiLU, attention) bit for bit against the unfused chain on the same device, whose float
  outputs are within the CUDA tests' bounds of the CPU implementation (`ROW_ULPS`, `ROW_F32_REL`: a float32 sum
  order, expf against the CPU's exp, and the roundings to the dtype that follow);
- decode attention against its float64 reference (`cutlass_w8a8.testing.attention`); rope + cache writes within one
  ulp of the CPU, untouched entries unchanged;
- chains (`decode_layer`, the CUDA-graph cases) finite and within `LOOSE_REL` of the CPU chain; graph replays equal
  to the eager chain bit for bit.

The same cases run on the CPU (``device="cpu"``: the CPU implementations, no sanitizer), which is what
tests/ops/test_sanitize_cpu.py does, so their argument conventions stay right between GPU runs. On the CPU the graph
cases run their chains eagerly and `_graph_update_scaled_mm` (CUDA only: it rewrites a captured kernel node) is not
called; the case that drives it on the GPU runs the same GEMMs through ``scaled_mm_out`` instead.

compute-sanitizer specifics, handled here:

- Inputs are drawn on the host and copied over (initcheck counts a host-to-device copy as initialisation; it flagged
  thousands of reads of torch.randint's device output as uninitialised).
- initcheck does not count the sm90 epilogue's TMA stores as writes (H200, compute-sanitizer of CUDA 13.0): with
  ``prefill=True`` (scripts/sanitize.py sets it for initcheck) a GEMM that may store by TMA writes into a host-written
  NaN buffer (the out= op), and an op without an out= form at such sizes (`w8a8_linear` at M past the decode bound)
  runs but its output is not read back.
- CUDA-graph capture needs torch's caching allocator (a graph's memory pool), which scripts/sanitize.py turns off for
  exact bounds (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): the graph cases (``graphs=True``) run in a second driver
  process with the allocator on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import re
import time
from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _ext
from ..graphs import UpdatableGraph, capture
from ..ops._schema import OPS as SCHEMA_OPS
from .attention import assert_close_to_reference as assert_attention_close
from .attention import reference as attention_reference
from .references import (BLOCK, assert_close_to_reference, assert_within, block_reference, fp8_accum_bound,
                         rand_operand, rand_scale, reference, rel_err, scale_magnitudes, ulp)

__all__ = ["CASES", "Case", "CaseResult", "Ctx", "DEFAULT_MS", "LOOSE_REL", "NOT_DRIVEN", "coverage_errors",
           "run_case", "run_driver", "select_cases"]

Q = torch.ops.cutlass_w8a8
I8, FP8 = torch.int8, torch.float8_e4m3fn
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
QMAX = {I8: 127.0, FP8: 448.0}

#: Schema ops the driver need not call, each with the reason. Empty: every op of the DEF block launches CUDA work
#: (``decode_layer`` runs its steps' kernels; ``_graph_update_scaled_mm`` rewrites a captured kernel node's
#: parameters, which the replay then runs). The non-tensor ops that ``_C.so`` defines itself (``supports_fp8``, the
#: PDL switch, the decode-size bound, the graph-node records) are not in the schema: capability queries and host
#: bookkeeping, no kernel.
NOT_DRIVEN: dict[str, str] = {}

#: One M per bucket of the sm90 row-wise dispatch (csrc/gemm/sm90/scaled_mm_sm90_dispatch.cuh): [1, 16] (M <= 8:
#: the decode GEMM), (16, 32], (32, 64], (64, 128], (128, 1024], > 1024.
DEFAULT_MS = (1, 24, 48, 100, 512, 2048)

#: The grouped decode kernel's bound on rows (csrc/gemm/decode/grouped_decode.cu, kGroupedDecodeMaxRows); read from
#: the extension where it answers.
GROUPED_DECODE_MAX_ROWS = 64

#: Relative Frobenius error allowed between a chain of quantized ops on the GPU and the same chain on the CPU
#: (decode_layer, the MoE and decode graphs). The two differ only where a float value lands within a rounding of a
#: quantization tie (a norm's sum order, an exp's last bit): that element's code moves by one step, 1/254 of its row's
#: range for int8, 2**-4 of itself for e4m3, which leaves the whole output within ~1e-3. A skipped, misplaced or
#: half-written kernel costs O(1). 0.05 keeps a margin of > 10 over the first and far below the second.
LOOSE_REL = 0.05

#: How far a row-wise float kernel (csrc/quant/rms_norm.cu, silu_mul.cu) may be from its CPU implementation (the
#: torch chain on the CPU), the bounds of the CUDA tests (tests/ops/test_fused_quant_cuda.py):
#:
#: - float32 output: relative `ROW_F32_REL` = 2**-18 (32 float32 ulps; `assert_within_one_ulp`'s float32 branch and
#:   `test_silu_mul_float32_close_to_cpu`'s rtol 4e-6). Both sides compute in float32 and round each step, but not
#:   the same steps: rms_norm sums the K squares in another order than the CPU (the sum's rounding errors, ~sqrt(K)
#:   float32 roundings of the sum on random inputs, halved by the square root) and takes 1 / sqrtf where the CPU
#:   takes its rsqrt; silu_mul takes CUDA's expf (max 2 ulps, non-fast-math build) where the CPU takes its
#:   vectorized exp (1 ulp), then 1 + e, the division and the product each round once on either side (no
#:   cancellation: every step is well conditioned). A few float32 ulps in all (3 seen on an H200), far below 2**-18;
#:   a skipped or misplaced element is off by O(1).
#: - bfloat16 / float16 output: the float32 values before the last rounding are within 2**-18 of each other, far
#:   below the dtype's ulp (2**-8 / 2**-11 relative), so each rounding to the dtype lands on the same or an adjacent
#:   value. rms_norm rounds once (1 ulp, `ROW_ULPS["rms_norm"]`). silu_mul rounds twice: silu to the dtype (1 ulp
#:   apart), then silu * up, exact in float32 (8- or 11-bit significands), which moves by ulp(silu) * |up| <
#:   2 ulp(y) and is rounded again: < 3 ulps, so at most 2 on the dtype's grid (`ROW_ULPS["silu_mul"]`).
ROW_F32_REL = 2.0**-18
ROW_ULPS = {"rms_norm": 1, "silu_mul": 2}


# ----------------------------------------------------------------------------------------------------
# cases and their context


@dataclasses.dataclass(frozen=True)
class Case:
    """One sanitizer case: ``run(ctx)`` calls the schema ops ``ops`` on ``ctx.dev`` and checks their results.

    ``graphs``: captures CUDA graphs (runs where torch's caching allocator is on); ``needs_sm90``: skipped (and
    said so) on other GPUs; ``cuda_only_ops``: ops with no CPU kernel, not required on the CPU."""

    name: str
    ops: tuple[str, ...]
    run: Callable[["Ctx"], None]
    graphs: bool = False
    needs_sm90: bool = False
    cuda_only_ops: tuple[str, ...] = ()
    doc: str = ""


CASES: list[Case] = []


def case(name: str, ops: Sequence[str], *, graphs: bool = False, needs_sm90: bool = False,
         cuda_only_ops: Sequence[str] = ()):
    """Register the decorated function as a `Case` (its docstring's first line is the description)."""

    def register(fn):
        doc = (fn.__doc__ or "").strip().split("\n")[0]
        CASES.append(Case(name, tuple(ops), fn, graphs, needs_sm90, tuple(cuda_only_ops), doc))
        return fn

    return register


class Ctx:
    """What a case runs with: the device, the size of the run and the sanitizer's needs.

    Parameters
    ----------
    device : str or torch.device
        ``"cuda"`` (the kernels) or ``"cpu"`` (the CPU implementations).
    quick : bool
        Fewer parametrizations per case (racecheck's selection); every op is still driven.
    prefill : bool
        initcheck mode: outputs a GEMM may store by TMA are host-written NaN buffers (see the module docstring).
    ms, n, k : the row-wise scaled_mm sweep (one M per dispatch bucket, N and K multiples of 16).
    configs : bool
        Force every entry of the config tables with ``_scaled_mm_config`` (else the first of each).
    seed : int
        Seed of the host generator every input is drawn from.
    """

    def __init__(self, device="cuda", *, quick: bool = False, prefill: bool = False,
                 ms: Sequence[int] = DEFAULT_MS, n: int = 256, k: int = 512, configs: bool = True, seed: int = 0):
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        self.quick, self.prefill, self.configs = quick, prefill and self.cuda, configs
        self.ms, self.n, self.k = tuple(ms), n, k
        self.g = torch.Generator().manual_seed(seed)
        self.failures: list[str] = []
        self.checks = 0
        if self.cuda:
            forced = os.environ.get("CUTLASS_W8A8_FORCE_ARCH", "")
            self.sm90 = torch.cuda.get_device_capability(self.dev) == (9, 0) and forced in ("", "sm90")
            self.fp8 = _ext.supports_fp8(self.dev.index if self.dev.index is not None else torch.cuda.current_device())
            self.decode_max_m = _ext.decode_gemm_max_m()
            try:
                self.grouped_decode_rows = int(Q._grouped_decode_max_rows())
            except (AttributeError, RuntimeError):
                self.grouped_decode_rows = GROUPED_DECODE_MAX_ROWS
        else:
            self.sm90 = self.fp8 = True
            self.decode_max_m, self.grouped_decode_rows = 0, GROUPED_DECODE_MAX_ROWS
        self.qdtypes = (I8, FP8) if self.fp8 else (I8,)

    # tensors: drawn on the host, copied to the device (always a copy, also on the CPU: in-place ops on the
    # device copy must not touch the host original the reference reads)
    def to(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(self.dev, copy=True)

    def randn(self, *shape, dtype=F32, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * std).to(dtype)

    def nan(self, shape, dtype) -> torch.Tensor:
        """A host-written NaN buffer on the device: an output element the kernel skips stays NaN."""
        return self.to(torch.full(tuple(shape), float("nan"), dtype=dtype))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def tma_out(self, rows: int, bound: Optional[int] = None) -> bool:
        """initcheck only: whether a GEMM output of ``rows`` rows may be stored by TMA (past the decode bound)."""
        return self.prefill and rows > (self.decode_max_m if bound is None else bound)

    @contextlib.contextmanager
    def sub(self, what: str):
        """One checked call: an exception is recorded as a failure of the case and the case goes on."""
        self.checks += 1
        try:
            yield
            self.sync()
        except Exception as exc:  # noqa: BLE001 (every failure is reported, the run goes on)
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            self.failures.append(f"{what}: {msg[:400]}")


# ----------------------------------------------------------------------------------------------------
# checks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_equal(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Same shape, dtype and bits (``got`` may be on the device)."""
    g = got.detach().cpu()
    assert g.shape == ref.shape and g.dtype == ref.dtype, (
        f"{what}: {tuple(g.shape)} {g.dtype}, expected {tuple(ref.shape)} {ref.dtype}")
    diff = _bits(g.contiguous()) != _bits(ref.contiguous())
    if diff.any():
        idx = tuple(diff.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.numel()} elements differ; first at {list(idx)}: "
                             f"{g[idx].item()!r} vs {ref[idx].item()!r}")


def check_ulps(got: torch.Tensor, ref: torch.Tensor, n_ulps: float, what: str) -> None:
    """|got - ref| <= n_ulps ulps of ref's dtype at ref, elementwise; no NaN."""
    g, r = got.detach().cpu().double(), ref.double()
    assert not torch.isnan(g).any(), f"{what}: NaN in the output"
    assert_within(g, r, n_ulps * ulp(r, ref.dtype), what)


def check_row(got: torch.Tensor, ref: torch.Tensor, op: str, what: str) -> None:
    """A row-wise float kernel's output (``op``: "rms_norm" or "silu_mul") against its CPU implementation: within
    `ROW_F32_REL` of ref for float32, `ROW_ULPS`[op] ulps of the dtype at ref for bfloat16 / float16; no NaN."""
    if ref.dtype == torch.float32:
        g, r = got.detach().cpu().double(), ref.double()
        assert not torch.isnan(g).any(), f"{what}: NaN in the output"
        assert_within(g, r, ROW_F32_REL * r.abs(), what)
    else:
        check_ulps(got, ref, ROW_ULPS[op], what)


def check_loose(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Finite, and the relative Frobenius error against ``ref`` at most `LOOSE_REL`."""
    g = got.detach().cpu()
    assert torch.isfinite(g.float()).all(), f"{what}: non-finite values in the output"
    err = rel_err(g, ref)
    assert err <= LOOSE_REL, f"{what}: relative error {err:.3g} against the CPU chain > {LOOSE_REL}"


def check_gemm(out: torch.Tensor, a, b, sa, sb, bias, what: str, block: bool = False) -> None:
    """``out`` against the float64 reference of the host operands ``a`` (M, K), ``b`` (K, N): the bounds of the CUDA
    tests (one output ulp, the float32 epilogue, fp8 accumulation; block fp8: `block_reference`)."""
    o = out.detach().cpu()
    if block:
        d, bound = block_reference(a, b, sa, sb, bias)
        od = o.double()
        assert not torch.isnan(od).any(), f"{what}: NaN in the output (elements left unwritten)"
        assert_within(od, d, bound + torch.maximum(ulp(d, o.dtype), ulp(od, o.dtype)), what)
    else:
        ref = reference(a, b, sa, sb, bias)
        rel = fp8_accum_bound(ref.k) if a.dtype == FP8 else 0.0
        assert_close_to_reference(o, ref, o.dtype, accum_rel=rel, what=what)


# ----------------------------------------------------------------------------------------------------
# recording which ops a case called


class _Recorder(TorchDispatchMode):
    """Counts the calls of ``cutlass_w8a8`` ops by (op, device type of its first tensor argument)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "cutlass_w8a8":
            dev = next((a.device.type for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)),
                       None)
            self.calls[(func.overloadpacket.__name__, dev)] += 1
        return func(*args, **kwargs)


@dataclasses.dataclass
class CaseResult:
    name: str
    status: str  # "ok", "FAILED" or "skipped"
    calls: int = 0
    checks: int = 0
    seconds: float = 0.0
    failures: list = dataclasses.field(default_factory=list)
    note: str = ""

    def line(self) -> str:
        head = f"case {self.name}: {self.status}"
        if self.status == "skipped":
            return f"{head} ({self.note})"
        head += f" ({self.checks} checks, {self.calls} op calls, {self.seconds:.1f} s)"
        if self.note:
            head += f"; {self.note}"
        if self.failures:
            shown = self.failures[:3]
            more = f" ... and {len(self.failures) - 3} more" if len(self.failures) > 3 else ""
            head += "\n" + "\n".join(f"    {f}" for f in shown) + more
        return head


def run_case(c: Case, ctx: Ctx) -> CaseResult:
    """Run one case under the op recorder; FAILED when a check failed or an op it names was not called on
    ``ctx.dev`` (``cuda_only_ops`` excepted on the CPU)."""
    if c.needs_sm90 and not ctx.sm90:
        return CaseResult(c.name, "skipped", note="needs an sm90 GPU (block-scaled and grouped kernels)")
    if c.graphs and ctx.cuda and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        return CaseResult(c.name, "FAILED", failures=["CUDA-graph cases need torch's caching allocator: run them "
                                                      "without PYTORCH_NO_CUDA_MEMORY_CACHING (scripts/sanitize.py "
                                                      "does, in a second driver process)"])
    ctx.failures, ctx.checks = [], 0
    rec = _Recorder()
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), rec:
            c.run(ctx)
        ctx.sync()
    except Exception as exc:  # noqa: BLE001
        ctx.failures.append(f"the case raised {type(exc).__name__}: {str(exc)[:400]}")
    seconds = time.perf_counter() - t0
    on_dev = collections.Counter({op: n for (op, dev), n in rec.calls.items() if dev == ctx.dev.type})
    required = [op for op in c.ops if ctx.cuda or op not in c.cuda_only_ops]
    missing = [op for op in required if not on_dev[op]]
    failures = list(ctx.failures)
    if missing:
        failures.append(f"ops this case names but did not call on {ctx.dev.type}: {', '.join(missing)}")
    note = "" if ctx.cuda or not c.cuda_only_ops else f"{', '.join(c.cuda_only_ops)}: CUDA only, not called"
    return CaseResult(c.name, "FAILED" if failures else "ok", sum(on_dev.values()), ctx.checks, seconds, failures,
                      note)


def coverage_errors(cases: Sequence[Case] = CASES, schema: Sequence[str] = SCHEMA_OPS,
                    not_driven: Optional[dict] = None) -> list[str]:
    """What is wrong with the cases' coverage of the schema: ops no case names (and not in `NOT_DRIVEN`), ops named
    that the schema does not define, stale `NOT_DRIVEN` entries. Empty when every op is driven."""
    not_driven = NOT_DRIVEN if not_driven is None else not_driven
    declared = {op for c in cases for op in c.ops}
    errors = []
    missing = [op for op in schema if op not in declared and op not in not_driven]
    if missing:
        errors.append(f"schema ops (cutlass_w8a8/ops/_schema.py) driven by no sanitizer case: {', '.join(missing)}; "
                      "add a case in cutlass_w8a8/testing/sanitize_cases.py, or, for an op that launches no CUDA work, "
                      "an entry with the reason in NOT_DRIVEN")
    unknown = sorted(declared - set(schema))
    if unknown:
        errors.append(f"sanitizer cases name ops the schema does not define: {', '.join(unknown)}")
    stale = sorted(set(not_driven) - set(schema)) + sorted(set(not_driven) & declared)
    if stale:
        errors.append(f"NOT_DRIVEN entries that are not in the schema or that a case drives: {', '.join(stale)}")
    return errors


def select_cases(group: str = "all", pattern: Optional[str] = None, cases: Sequence[Case] = CASES) -> list[Case]:
    """The cases of ``group`` ("eager": no CUDA graphs, "graphs", "all") whose name matches ``pattern`` (a regular
    expression, searched), in registration order."""
    if group not in ("eager", "graphs", "all"):
        raise ValueError(f"`group` must be 'eager', 'graphs' or 'all', got {group!r}")
    picked = [c for c in cases if group == "all" or c.graphs == (group == "graphs")]
    if pattern:
        rx = re.compile(pattern)
        picked = [c for c in picked if rx.search(c.name)]
    return picked


def run_driver(ctx: Ctx, group: str = "all", pattern: Optional[str] = None, out: Callable[[str], None] = print) -> int:
    """Run the selected cases and print a line per case, the coverage, and ``DRIVER OK: N cases, M op calls`` or
    ``DRIVER FAILED: ...``. Returns 0 when every case passed and the coverage is complete, else 1."""
    import torch._dynamo  # noqa: F401 (imported by the first op under a dispatch mode: seconds charged to no case)

    errors = coverage_errors()
    selected = select_cases(group, pattern)
    if not selected:
        out(f"DRIVER FAILED: no case of group {group!r} matches {pattern!r}")
        return 1
    results = []
    for c in selected:
        r = run_case(c, ctx)
        results.append(r)
        out(r.line())
    for e in errors:
        out(f"COVERAGE ERROR: {e}")
    if not errors:
        out(f"coverage: all {len(SCHEMA_OPS)} schema ops named by a case"
            + (f" ({len(NOT_DRIVEN)} not driven by design: {', '.join(NOT_DRIVEN)})" if NOT_DRIVEN else ""))
    failed = [r for r in results if r.status == "FAILED"]
    skipped = [r for r in results if r.status == "skipped"]
    ran = [r for r in results if r.status != "skipped"]
    calls = sum(r.calls for r in results)
    skip_note = f"; {len(skipped)} skipped: {', '.join(r.name for r in skipped)}" if skipped else ""
    if failed or errors:
        what = [f"{len(failed)} of {len(ran)} cases failed ({', '.join(r.name for r in failed)})"] if failed else []
        what += ["coverage incomplete"] if errors else []
        out(f"DRIVER FAILED: {'; '.join(what)}{skip_note}")
        return 1
    out(f"DRIVER OK: {len(ran)} cases, {calls} op calls on {ctx.dev.type}{skip_note}")
    return 0


# ----------------------------------------------------------------------------------------------------
# operands


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rowwise_scales(ctx: Ctx, m: int, n: int, k: int, dtype, per_token: bool):
    ma, mb = scale_magnitudes(dtype, k)
    sa = rand_scale((m, 1) if per_token else (1,), "cpu", ma, ctx.g)
    sb = rand_scale((n,) if per_token else (1,), "cpu", mb, ctx.g)
    return sa, sb


def _block_scales(ctx: Ctx, shape, k: int) -> torch.Tensor:
    """Scales of magnitudes 2^-3 .. 2^2 / sqrt(K) that differ from group to group (a scale read for the wrong
    group shows), as tests/gemm/test_scaled_mm_block_cuda.py draws them."""
    mag = 2.0 ** torch.randint(-3, 3, shape, generator=ctx.g).float()
    return (torch.rand(shape, generator=ctx.g) + 0.5) * mag / (k ** 0.5)


def _operand(ctx: Ctx, shape, dtype) -> torch.Tensor:
    return rand_operand(shape, dtype, "cpu", ctx.g)


# ----------------------------------------------------------------------------------------------------
# dense GEMMs


def _gemm(ctx: Ctx, m, n, k, dtype, out_dtype, bias_on, per_token, use_out, *, op="scaled_mm", config=None,
          windowed=False, block=False) -> None:
    """One call of ``op`` (scaled_mm, scaled_mm_decode; _scaled_mm_config with ``config``) checked against the
    float64 reference. ``windowed``: a, the weight and out are windows of wider buffers (16-byte aligned)."""
    what = (f"{op} M={m} N={n} K={k} {dtype} -> {out_dtype} bias={bias_on} "
            f"{'block' if block else ('per-token' if per_token else 'per-tensor')} out={use_out} config={config} "
            f"windowed={windowed}")
    with ctx.sub(what):
        if windowed:
            a_buf, w_buf = _operand(ctx, (m, k + 48), dtype), _operand(ctx, (n, k + 32), dtype)
            a_h, w_h = a_buf[:, 16:16 + k], w_buf[:, 32:]
            a, w = ctx.to(a_buf)[:, 16:16 + k], ctx.to(w_buf)[:, 32:]
        else:
            a_h, w_h = _operand(ctx, (m, k), dtype), _operand(ctx, (n, k), dtype)
            a, w = ctx.to(a_h), ctx.to(w_h)
        if block:
            sa_h, sb_h = _block_scales(ctx, (m, k // BLOCK), k), _block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k)
        else:
            sa_h, sb_h = _rowwise_scales(ctx, m, n, k, dtype, per_token)
        bias_h = ctx.randn(n, dtype=out_dtype, std=4.0) if bias_on else None
        sa, sb, bias = ctx.to(sa_h), ctx.to(sb_h), ctx.to(bias_h)
        out_buf = None
        if windowed:
            out_buf = ctx.to(torch.full((m, n + 24), 7.0, dtype=out_dtype))
            out = out_buf[:, 8:8 + n]
        elif use_out or config is not None or (op == "scaled_mm" and ctx.tma_out(m)):
            out = ctx.nan((m, n), out_dtype)
        else:
            out = None
        if config is not None:
            Q._scaled_mm_config(out, a, w.t(), sa, sb, bias, config)
        elif out is None:
            out = getattr(Q, op)(a, w.t(), sa, sb, out_dtype, bias)
        else:
            getattr(Q, f"{op}_out")(out, a, w.t(), sa, sb, bias)
        ctx.sync()
        if m:
            check_gemm(out, a_h, w_h.t(), sa_h, sb_h, bias_h, what, block)
        if out_buf is not None:
            o = out_buf.cpu()
            assert (o[:, :8] == 7).all() and (o[:, 8 + n:] == 7).all(), f"{what}: wrote outside out"


def _combos(ctx: Ctx):
    """(out dtype, bias, per-token scales): all four pairings of each two-valued choice with the others' values
    (an orthogonal array of the 8 combinations); --quick: two that flip all three."""
    if ctx.quick:
        return [(BF16, False, False), (F16, True, True)]
    return [(BF16, False, False), (BF16, True, True), (F16, False, True), (F16, True, False)]


@case("scaled_mm_rowwise", ["scaled_mm", "scaled_mm_out"])
def _scaled_mm_rowwise(ctx: Ctx) -> None:
    """Row-wise scaled_mm at one M per dispatch bucket (M <= 8 the decode GEMM), int8 and fp8, both output dtypes,
    bias or not, per-tensor and per-token/per-channel scales, functional and out=; M = 0; windowed operands."""
    for m in ctx.ms:
        for dtype in ctx.qdtypes:
            for i, (out_dtype, bias_on, per_token) in enumerate(_combos(ctx)):
                _gemm(ctx, m, ctx.n, ctx.k, dtype, out_dtype, bias_on, per_token, use_out=i % 2 == 1)
    for dtype in ctx.qdtypes:
        _gemm(ctx, 0, ctx.n, ctx.k, dtype, BF16, True, True, use_out=False)
        _gemm(ctx, 0, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True)
        _gemm(ctx, 100, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True, windowed=True)


@case("scaled_mm_k_tail", ["scaled_mm"])
def _scaled_mm_k_tail(ctx: Ctx) -> None:
    """K = 400 (a multiple of 16, not of 64 or 128: the K tails), N = 272 (a partial N tile), decode and CUTLASS M."""
    for dtype in ctx.qdtypes:
        for m in (1, 100):
            _gemm(ctx, m, 272, 400, dtype, BF16, True, True, use_out=False)


def _num_configs(ctx: Ctx, dtype, block: bool = False) -> int:
    """Entries of the config table serving these operands, read from the error of a config index far past it
    ("`config` must be in [0, N)"). The CPU implementation ignores the config: one call drives it there."""
    if not ctx.cuda:
        return 1
    k = 256
    a = ctx.to(torch.zeros(1, k).to(dtype))
    b = ctx.to(torch.zeros(16, k).to(dtype)).t()
    sa = ctx.to(torch.ones(1, k // BLOCK) if block else torch.ones(1))
    sb = ctx.to(torch.ones(1, k // BLOCK) if block else torch.ones(1))
    out = ctx.to(torch.zeros(1, 16, dtype=BF16))
    try:
        Q._scaled_mm_config(out, a, b, sa, sb, None, 1 << 30)
    except ValueError as exc:
        found = re.search(r"must be in \[0, (\d+)\)", str(exc))
        if found:
            return int(found.group(1))
        raise
    raise RuntimeError(f"_scaled_mm_config accepted config 2**30 for {dtype} (block={block})")


@case("scaled_mm_configs", ["_scaled_mm_config"])
def _scaled_mm_configs(ctx: Ctx) -> None:
    """Every entry of the int8, fp8 and block-fp8 config tables forced with _scaled_mm_config (the tuning candidates
    too when built with CUTLASS_W8A8_TUNE=1); --no-configs: the first of each."""
    tables = [(dtype, False) for dtype in ctx.qdtypes] + ([(FP8, True)] if ctx.sm90 and ctx.fp8 else [])
    for dtype, block in tables:
        count = _num_configs(ctx, dtype, block)
        if count < 1:
            ctx.failures.append(f"the {'block' if block else dtype} config table is empty")
        for config in range(count if ctx.configs else min(count, 1)):
            _gemm(ctx, 100, ctx.n, ctx.k, dtype, BF16, True, True, use_out=True, config=config, block=block)


@case("scaled_mm_block", ["scaled_mm", "scaled_mm_out"], needs_sm90=True)
def _scaled_mm_block(ctx: Ctx) -> None:
    """Block-scaled fp8 (1x128 activation groups x 128x128 weight blocks) through scaled_mm: decode M (the decode
    GEMM's block steps) and every CUTLASS block bucket; N = 208 (a partial last weight block), K = 384 (3 blocks)."""
    ms = (1, 16, 300) if ctx.quick else (1, 7, 16, 100, 300)
    for i, m in enumerate(ms):
        _gemm(ctx, m, 208, 384, FP8, (BF16, F16)[i % 2], i % 2 == 0, True, use_out=i % 2 == 1, block=True)


@case("scaled_mm_decode", ["scaled_mm_decode", "scaled_mm_decode_out"])
def _scaled_mm_decode(ctx: Ctx) -> None:
    """The decode GEMM called directly, M = 1..16 (one and two token tiles), split-K (N = 256: 16 blocks) and not
    (N = 2304: 144 blocks), padded rows of a, and block fp8 at decode M."""
    ms = (1, 9, 16) if ctx.quick else (1, 8, 9, 16)
    for i, m in enumerate(ms):
        for dtype in ctx.qdtypes:
            _gemm(ctx, m, 256, 512, dtype, (BF16, F16)[i % 2], i % 2 == 0, i % 3 != 2, use_out=i % 2 == 1,
                  op="scaled_mm_decode")
    _gemm(ctx, 4, 2304, 256, I8, BF16, True, True, use_out=False, op="scaled_mm_decode")
    _gemm(ctx, 3, 256, 512, ctx.qdtypes[-1], BF16, False, True, use_out=True, op="scaled_mm_decode", windowed=True)
    if ctx.sm90 and ctx.fp8:
        for m in ((16,) if ctx.quick else (5, 16)):
            _gemm(ctx, m, 208, 384, FP8, BF16, True, True, use_out=m == 16, op="scaled_mm_decode", block=True)


@case("linear_decode", ["linear_decode", "linear_decode_out"])
def _linear_decode(ctx: Ctx) -> None:
    """linear_decode (per-token quantization of x fused into the decode GEMM), M = 1, 5, 16, int8 and fp8, bf16 and
    fp16 x, per-channel scales as (N,) and (N, 1), bias or not, functional and out=."""
    n, k = 256, 512
    for m, dtype, xdtype, bias_on, use_out in ((1, I8, BF16, True, False), (16, I8, F16, False, True),
                                               (5, FP8, BF16, False, True), (16, FP8, F16, True, False)):
        if dtype not in ctx.qdtypes:
            continue
        what = f"linear_decode M={m} {xdtype} -> {dtype} bias={bias_on} out={use_out}"
        with ctx.sub(what):
            x_h = ctx.randn(m, k, dtype=xdtype, std=3.0)
            w_h = _operand(ctx, (n, k), dtype)
            sb_h = rand_scale((n, 1) if use_out else (n,), "cpu", scale_magnitudes(dtype, k)[1], ctx.g)
            bias_h = ctx.randn(n, dtype=xdtype, std=2.0) if bias_on else None
            x, w, sb, bias = ctx.to(x_h), ctx.to(w_h), ctx.to(sb_h), ctx.to(bias_h)
            if use_out:
                out = ctx.nan((m, n), xdtype)
                Q.linear_decode_out(out, x, w.t(), sb, bias, dtype)
            else:
                out = Q.linear_decode(x, w.t(), sb, bias, dtype)
            ctx.sync()
            q, s = Q.quantize_per_token(x_h, dtype)  # the CPU quantization equals the kernel's bit for bit
            check_gemm(out, q, w_h.t(), s, sb_h.reshape(-1), bias_h, what)


@case("w8a8_linear", ["w8a8_linear"])
def _w8a8_linear(ctx: Ctx) -> None:
    """w8a8_linear (quantize x, then the GEMM, one op): per-token and static per-tensor int8 / fp8, block fp8 weights
    (x quantized per 1x128 group), decode M and CUTLASS M, a 3-D x."""
    params = [((2, 3, 512), I8, False, False, BF16, True),   # M = 6: the decode GEMM
              ((100, 512), I8, True, False, F16, False),     # static per-tensor, CUTLASS
              ((5, 512), FP8, False, False, BF16, False),
              ((40, 512), FP8, True, False, BF16, True),
              ((1, 384), FP8, False, True, BF16, True),      # block weights, decode
              ((100, 384), FP8, False, True, F16, False)]    # block weights, CUTLASS
    if ctx.quick:
        params = [params[i] for i in (0, 1, 4, 5)]
    n_row, n_block = 256, 208
    for shape, dtype, static, block, out_dtype, bias_on in params:
        if dtype not in ctx.qdtypes or (block and not ctx.sm90):
            continue
        k = shape[-1]
        n = n_block if block else n_row
        m = math.prod(shape[:-1])
        what = f"w8a8_linear x={shape} {dtype} static={static} block={block} -> {out_dtype} bias={bias_on}"
        with ctx.sub(what):
            x_h = ctx.randn(*shape, dtype=BF16, std=2.0)
            w_h = _operand(ctx, (n, k), dtype)
            ws_h = (_block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k) if block else
                    rand_scale((n, 1), "cpu", scale_magnitudes(dtype, k)[1], ctx.g))
            is_h = (x_h.float().abs().amax() / QMAX[dtype]).reshape(1) if static else None
            bias_h = ctx.randn(n, dtype=out_dtype, std=2.0) if bias_on else None
            out = Q.w8a8_linear(ctx.to(x_h), ctx.to(w_h), ctx.to(ws_h), ctx.to(is_h), ctx.to(bias_h), out_dtype)
            ctx.sync()
            if ctx.tma_out(m):
                continue  # initcheck: no out= form, and the CUTLASS epilogue's TMA stores are invisible to it
            x2 = x_h.reshape(-1, k)
            if block:
                q, s = Q.quantize_per_token_group(x2, BLOCK, FP8)
            elif static:
                q, s = Q.quantize_per_tensor(x2, is_h, dtype), is_h
            else:
                q, s = Q.quantize_per_token(x2, dtype)
            check_gemm(out.reshape(m, n), q, w_h.t(), s, ws_h if block else ws_h.reshape(-1), bias_h, what, block)


# ----------------------------------------------------------------------------------------------------
# quantization


@case("quantize", ["quantize_per_token", "quantize_per_tensor"])
def _quantize(ctx: Ctx) -> None:
    """quantize_per_token and quantize_per_tensor, every kernel variant (csrc/quant/quantize.cu: rows held in
    registers, 1..8 16-byte vectors per thread of 256 or 8 of 512 threads; the loop kernel for long or unaligned
    rows), padded and transposed x, bf16 / f16 / f32 to int8 and fp8; bit for bit against the CPU."""
    ks = (512, 32768, 40000, 100) if ctx.quick else (512, 4096, 8192, 16384, 32768, 40000, 100)
    xdtypes = (BF16, F32) if ctx.quick else (BF16, F16, F32)
    for qdtype in ctx.qdtypes:
        for xdtype in xdtypes:
            for kk in ks:
                xs = [ctx.randn(3, kk, dtype=xdtype, std=3.0)]
                views = [lambda t: t]
                if kk == 512:  # padded rows (a slice of a wider buffer) and a transposed input
                    xs += [ctx.randn(2, 576, dtype=xdtype, std=3.0), ctx.randn(512, 5, dtype=xdtype, std=3.0)]
                    views += [lambda t: t[:, 64:], lambda t: t.t()]
                for x_h, view in zip(xs, views):
                    for static in (False, True):
                        x_h_v = view(x_h)
                        what = f"quantize {xdtype} -> {qdtype} shape={tuple(x_h_v.shape)} static={static}"
                        with ctx.sub(what):
                            x = view(ctx.to(x_h))
                            if static:
                                scale_h = torch.tensor([0.05])
                                q = Q.quantize_per_tensor(x, ctx.to(scale_h), qdtype)
                                check_equal(q, Q.quantize_per_tensor(x_h_v, scale_h, qdtype), f"{what}: q")
                            else:
                                q, s = Q.quantize_per_token(x, qdtype)
                                q_ref, s_ref = Q.quantize_per_token(x_h_v, qdtype)
                                check_equal(q, q_ref, f"{what}: q")
                                check_equal(s, s_ref, f"{what}: scale")


@case("quantize_group", ["quantize_per_token_group"])
def _quantize_group(ctx: Ctx) -> None:
    """quantize_per_token_group (1x128 groups): one group to many per row, a 3-D x, padded rows (vector loads) and
    misaligned rows (element loads), bf16 / f16 / f32 to fp8 and int8; bit for bit against the CPU."""
    shapes = [((3, 128), None), ((2, 4096), None), ((2, 16384), None), ((2, 3, 512), None),
              ((3, 640), lambda t: t[:, 128:]), ((3, 513), lambda t: t[:, 1:])]
    combos = [(x, q) for x in (BF16, F16, F32) for q in ctx.qdtypes]
    for i, (shape, view) in enumerate(shapes):
        for xdtype, qdtype in ([combos[i % len(combos)]] if ctx.quick else combos):
            x_h = ctx.randn(*shape, dtype=xdtype, std=3.0)
            view = view or (lambda t: t)
            what = f"quantize_per_token_group {xdtype} -> {qdtype} shape={tuple(view(x_h).shape)}"
            with ctx.sub(what):
                q, s = Q.quantize_per_token_group(view(ctx.to(x_h)), BLOCK, qdtype)
                q_ref, s_ref = Q.quantize_per_token_group(view(x_h), BLOCK, qdtype)
                check_equal(q, q_ref, f"{what}: q")
                check_equal(s, s_ref, f"{what}: scale")


# ----------------------------------------------------------------------------------------------------
# fused norm / SiLU (+ quantization)

# (mode, quantized dtype): per token, static per tensor, per 1x128 group
_QMODES = [("dynamic", I8), ("static", FP8), ("group", FP8), ("group", I8), ("static", I8), ("dynamic", FP8)]
_STATIC_SCALE = {I8: 0.03, FP8: 0.008}
# row lengths: registers, an 8-block cluster on sm90 (14336), a 3-D x, float32 (no clusters)
_NORM_SHAPES = [((3, 4096), BF16), ((2, 14336), BF16), ((2, 3, 1024), F16), ((4, 384), F32)]


def _quant_chain(y, mode, qdtype, scale):
    """The unfused quantization of y that the fused ops equal bit for bit: (q, scale) with per-row scales in the
    static mode as the fused ops return them."""
    if mode == "group":
        return Q.quantize_per_token_group(y, BLOCK, qdtype)
    if mode == "static":
        return Q.quantize_per_tensor(y, scale, qdtype), scale.reshape(1).expand(*y.shape[:-1], 1).contiguous()
    return Q.quantize_per_token(y, qdtype)


def _modes_for(ctx: Ctx, i: int):
    """Shape i's quantization modes: three of `_QMODES` (one with --quick), rotating so all six are used."""
    picked = [_QMODES[(3 * i + j) % len(_QMODES)] for j in range(1 if ctx.quick else 3)]
    return [(mode, q) for mode, q in picked if q in ctx.qdtypes]


@case("rms_norm", ["rms_norm", "fused_add_rms_norm"])
def _rms_norm(ctx: Ctx) -> None:
    """rms_norm and fused_add_rms_norm (residual += x in place): y within `check_row`'s bound of the CPU, the residual
    bit for bit; row lengths that take the register, cluster and float32 kernels, a 3-D x."""
    eps = 1e-5
    for shape, dtype in _NORM_SHAPES:
        x_h = ctx.randn(*shape, dtype=dtype, std=2.0)
        w_h = 1 + ctx.randn(shape[-1], dtype=dtype, std=0.1)
        r_h = ctx.randn(*shape, dtype=dtype)
        what = f"rms_norm {shape} {dtype}"
        with ctx.sub(what):
            y = Q.rms_norm(ctx.to(x_h), ctx.to(w_h), eps)
            check_row(y, Q.rms_norm(x_h, w_h, eps), "rms_norm", what)
        with ctx.sub(f"fused_add_{what}"):
            r = ctx.to(r_h)
            y = Q.fused_add_rms_norm(ctx.to(x_h), r, ctx.to(w_h), eps)
            r_ref = r_h.clone()
            y_ref = Q.fused_add_rms_norm(x_h, r_ref, w_h, eps)
            check_equal(r, r_ref, f"fused_add_{what}: residual")
            check_row(y, y_ref, "rms_norm", f"fused_add_{what}")


@case("rms_norm_quant", ["rms_norm_quant"])
def _rms_norm_quant(ctx: Ctx) -> None:
    """rms_norm_quant per token, per tensor and per 1x128 group, with and without the residual, int8 and fp8: equal
    to rms_norm then the quantizer on the same device bit for bit; that y within `check_row`'s bound of the CPU, its
    quantization equal to the CPU's."""
    eps = 1e-5
    for i, (shape, dtype) in enumerate(_NORM_SHAPES):
        for j, (mode, qdtype) in enumerate(_modes_for(ctx, i)):
            residual = (i + j) % 2 == 0
            what = f"rms_norm_quant {shape} {dtype} -> {qdtype} {mode} residual={residual}"
            with ctx.sub(what):
                x_h, w_h = ctx.randn(*shape, dtype=dtype, std=2.0), 1 + ctx.randn(shape[-1], dtype=dtype, std=0.1)
                r_h = ctx.randn(*shape, dtype=dtype) if residual else None
                scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
                group = BLOCK if mode == "group" else 0
                x, w, scale, r1, r2 = ctx.to(x_h), ctx.to(w_h), ctx.to(scale_h), ctx.to(r_h), ctx.to(r_h)
                q, s = Q.rms_norm_quant(x, w, eps, qdtype, scale, r1, group)
                y = Q.fused_add_rms_norm(x, r2, w, eps) if residual else Q.rms_norm(x, w, eps)
                qc, sc = _quant_chain(y, mode, qdtype, scale)
                check_equal(q, qc.cpu(), f"{what}: q vs the chain")
                check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
                if residual:
                    check_equal(r1, r2.cpu(), f"{what}: residual vs the chain")
                r_ref = None if r_h is None else r_h.clone()
                y_ref = Q.fused_add_rms_norm(x_h, r_ref, w_h, eps) if residual else Q.rms_norm(x_h, w_h, eps)
                check_row(y, y_ref, "rms_norm", f"{what}: y vs the CPU")
                qh, sh = _quant_chain(y.cpu(), mode, qdtype, scale_h)
                check_equal(q, qh, f"{what}: q vs the CPU quantization of y")
                check_equal(s, sh, f"{what}: scale vs the CPU quantization of y")


# [gate | up] rows: registers, an 8-block cluster on sm90 (I = 14336), a 3-D x, float32
_SILU_SHAPES = [((3, 8192), BF16), ((2, 28672), BF16), ((2, 3, 2048), F16), ((4, 768), F32)]


@case("silu_mul", ["silu_mul", "silu_mul_quant"])
def _silu_mul(ctx: Ctx) -> None:
    """silu_mul within `check_row`'s bound of the CPU; silu_mul_quant per token, per tensor and per 1x128 group, int8 and fp8,
    equal to silu_mul then the quantizer on the same device bit for bit, and to the CPU quantization of that y."""
    for i, (shape, dtype) in enumerate(_SILU_SHAPES):
        x_h = ctx.randn(*shape, dtype=dtype, std=2.0)
        what = f"silu_mul {shape} {dtype}"
        with ctx.sub(what):
            y = Q.silu_mul(ctx.to(x_h))
            check_row(y, Q.silu_mul(x_h), "silu_mul", what)
        for mode, qdtype in _modes_for(ctx, i):
            what = f"silu_mul_quant {shape} {dtype} -> {qdtype} {mode}"
            with ctx.sub(what):
                scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
                x, scale = ctx.to(x_h), ctx.to(scale_h)
                q, s = Q.silu_mul_quant(x, qdtype, scale, BLOCK if mode == "group" else 0)
                qc, sc = _quant_chain(Q.silu_mul(x), mode, qdtype, scale)
                check_equal(q, qc.cpu(), f"{what}: q vs the chain")
                check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
                qh, sh = _quant_chain(Q.silu_mul(x).cpu(), mode, qdtype, scale_h)
                check_equal(q, qh, f"{what}: q vs the CPU quantization of y")
                check_equal(s, sh, f"{what}: scale vs the CPU quantization of y")


# ----------------------------------------------------------------------------------------------------
# attention


def _attention_inputs(ctx: Ctx, b, h, kvh, d, s, dtype, positions):
    """((q, kv_cache, slots, positions) on the device, the same on the host): q the query heads of a fused qkv
    output (stride(0) = (H + 2 KVH) D), B + 1 cache slots (distinct, shuffled), slots and positions strided columns
    of a (B, 3) int64 tensor, as LlamaAttention and the decode runner pass them."""
    qkv_h = ctx.randn(b, h + 2 * kvh, d, dtype=dtype)
    kv_h = ctx.randn(b + 1, 2, kvh, s, d, dtype=dtype)
    rows_h = torch.zeros(b, 3, dtype=torch.int64)
    rows_h[:, 2] = torch.randperm(b + 1, generator=ctx.g)[:b]
    rows_h[:, 1] = torch.tensor(positions, dtype=torch.int64)
    qkv, kv, rows = ctx.to(qkv_h), ctx.to(kv_h), ctx.to(rows_h)
    return (qkv[:, :h], kv, rows[:, 2], rows[:, 1]), (qkv_h[:, :h], kv_h, rows_h[:, 2], rows_h[:, 1])


def _check_attention(ctx: Ctx, out: torch.Tensor, host, scale: float, dtype, what: str) -> None:
    """The kernel's output within its float64 reference's bound (`cutlass_w8a8.testing.attention`); on the CPU,
    whose implementation is SDPA over the masked cache in q's dtype (not held to the kernel's bound), within
    `LOOSE_REL` of it."""
    ref = attention_reference(*host, scale)
    if ctx.cuda:
        assert_attention_close(out.cpu(), ref, dtype, what)
    else:
        check_loose(out.reshape(ref.out.shape), ref.out, what)


_ATTENTION = [(3, 8, 2, 64, 300, BF16, [0, 299, 150], False),   # G = 4, strided q, many splits
              (2, 4, 4, 128, 40, F16, [39, 7], True),            # multi-head, out=
              (2, 8, 1, 256, 600, BF16, [599, 300], False),      # D = 256 (the largest), G = 8
              (1, 2, 2, 32, 17, F32, [16], True)]                # float32


@case("decode_attention", ["decode_attention", "decode_attention_out"])
def _decode_attention(ctx: Ctx) -> None:
    """decode_attention (split-KV, then combine) against the float64 reference: GQA and MHA, D = 32..256, positions
    0 and S - 1, bf16 / f16 / f32, functional and out=."""
    for b, h, kvh, d, s, dtype, positions, use_out in _ATTENTION:
        what = f"decode_attention B={b} H={h} KVH={kvh} D={d} S={s} {dtype} out={use_out}"
        with ctx.sub(what):
            dev, host = _attention_inputs(ctx, b, h, kvh, d, s, dtype, positions)
            scale = 1.0 / math.sqrt(d)
            if use_out:
                out = ctx.nan((b, h * d), dtype)
                Q.decode_attention_out(out, *dev, scale)
            else:
                out = Q.decode_attention(*dev, scale)
            ctx.sync()
            _check_attention(ctx, out, host, scale, dtype, what)


@case("decode_attention_quant", ["decode_attention_quant"])
def _decode_attention_quant(ctx: Ctx) -> None:
    """decode_attention_quant, dynamic per token and static per tensor, int8 and fp8: equal to decode_attention then
    the quantizer bit for bit; that attention within the float64 reference's bound."""
    modes = [(I8, None), (FP8, 0.01), (FP8, None), (I8, 0.02)]
    for qdtype, static in (modes[:2] if ctx.quick else modes):
        if qdtype not in ctx.qdtypes:
            continue
        what = f"decode_attention_quant {qdtype} static={static}"
        with ctx.sub(what):
            dev, host = _attention_inputs(ctx, 3, 8, 2, 64, 300, BF16, [0, 299, 150])
            sm = 1.0 / 8.0
            scale = ctx.to(torch.tensor([static])) if static else None
            q8, s = Q.decode_attention_quant(*dev, sm, qdtype, scale)
            o = Q.decode_attention(*dev, sm)
            qc, sc = _quant_chain(o, "static" if static else "dynamic", qdtype, scale)
            check_equal(q8, qc.cpu(), f"{what}: q vs the chain")
            check_equal(s, sc.cpu(), f"{what}: scale vs the chain")
            _check_attention(ctx, o, host, sm, BF16, f"{what}: attention")


@case("rope_kv_cache", ["rope_kv_cache_"])
def _rope_kv_cache(ctx: Ctx) -> None:
    """rope_kv_cache_: q and k heads rotated in place, k and v written to their (slot, position): within one ulp of
    the CPU, the row padding and every other cache entry untouched."""
    h, kvh, d, s, slots_n = 4, 2, 64, 16, 5
    params = [(3, BF16), (1, F32)] if ctx.quick else [(3, BF16), (1, F32), (5, F16)]
    for b, dtype in params:
        what = f"rope_kv_cache_ B={b} {dtype}"
        with ctx.sub(what):
            qkv_h = ctx.randn(b, h + 2 * kvh, d, dtype=dtype)
            angles = torch.rand(b, d // 2, generator=ctx.g) * 6.2831853
            rope_h = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
            cache_h = ctx.randn(slots_n, 2, kvh, s, d, dtype=dtype)
            slots_h = torch.randperm(slots_n, generator=ctx.g)[:b]
            pos_h = torch.randint(0, s, (b,), generator=ctx.g)
            wide = ctx.to(torch.cat([qkv_h, torch.full((b, 1, d), float("nan"), dtype=dtype)], dim=1))
            qkv, cache = wide[:, :h + 2 * kvh], ctx.to(cache_h)
            Q.rope_kv_cache_(qkv, ctx.to(rope_h), cache, ctx.to(slots_h), ctx.to(pos_h), h, kvh)
            ctx.sync()
            qkv_ref, cache_ref = qkv_h.clone(), cache_h.clone()
            Q.rope_kv_cache_(qkv_ref, rope_h, cache_ref, slots_h, pos_h, h, kvh)
            check_ulps(qkv, qkv_ref, 1, f"{what}: qkv")
            assert torch.isnan(wide[:, -1].cpu().float()).all(), f"{what}: the row padding was written"
            written = torch.zeros(slots_n, 2, kvh, s, dtype=torch.bool)
            written[slots_h, :, :, pos_h] = True
            got = cache.cpu()
            check_equal(got[~written], cache_h[~written], f"{what}: cache entries outside (slot, position)")
            check_ulps(got[written], cache_ref[written], 1, f"{what}: written cache entries")


# ----------------------------------------------------------------------------------------------------
# decode_layer


def _layer_operands(ctx: Ctx, kind: str, hidden=256, heads=4, kv_heads=2, d=64, inter=512):
    """Host operands of decode_layer from input_norm to down_is: 8-bit weights (N, K) with per-channel (N, 1) scales
    sized so each projection's output is O(1), input scales None (dynamic) or static per tensor; or bf16 weights."""
    qkv_n = (heads + 2 * kv_heads) * d
    dims = [(qkv_n, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    out = [1 + ctx.randn(hidden, dtype=BF16, std=0.1), 1 + ctx.randn(hidden, dtype=BF16, std=0.1), 1e-5]
    for n, k in dims:
        if kind == "bf16":
            out += [ctx.randn(n, k, dtype=BF16, std=k ** -0.5), None, None]
            continue
        dtype = I8 if kind == "int8" else FP8
        typical = 74.0 if dtype == I8 else 1.0  # rms of rand_operand's values
        ws = rand_scale((n, 1), "cpu", 1.0 / (typical * k ** 0.5), ctx.g)
        is_ = torch.tensor([4.0 / QMAX[dtype]]) if kind == "fp8-static" else None
        out += [_operand(ctx, (n, k), dtype), ws, is_]
    return out


@case("decode_layer", ["decode_layer"])
def _decode_layer(ctx: Ctx) -> None:
    """decode_layer (one reference-decoder layer in one op: norms, GEMMs at decode M, rope + cache, attention, SiLU):
    int8 dynamic, fp8 static and bf16 weights, first layer (h None) and later; finite and within LOOSE_REL of the CPU
    chain (output, residual and the cache)."""
    b, hidden, heads, kv_heads, d, s = 3, 256, 4, 2, 64, 32
    kinds = [("int8", True), ("fp8-static", False), ("bf16", False)]
    if ctx.quick:
        kinds = [kinds[0], kinds[2]]
    for kind, first in kinds:
        if kind == "fp8-static" and FP8 not in ctx.qdtypes:
            continue
        if kind == "bf16" and ctx.prefill:
            continue  # initcheck: its projections are cuBLAS GEMMs, whose sm90 epilogues may store by TMA too
        what = f"decode_layer {kind} first={first}"
        with ctx.sub(what):
            ops_h = _layer_operands(ctx, kind, hidden, heads, kv_heads, d)
            h_h = None if first else ctx.randn(b, hidden, dtype=BF16)
            res_h = ctx.randn(b, hidden, dtype=BF16)
            kv_h = ctx.randn(b + 1, 2, kv_heads, s, d, dtype=BF16)
            angles = torch.rand(b, d // 2, generator=ctx.g) * 6.2831853
            rope_h = torch.stack([angles.cos(), angles.sin()], dim=-1).contiguous()
            slots_h = torch.randperm(b + 1, generator=ctx.g)[:b]
            pos_h = torch.tensor([0, s - 1, s // 2])[:b]
            tail = (heads, kv_heads, 1.0 / math.sqrt(d))

            def run(on_dev: bool):
                cv = ctx.to if on_dev else (lambda t: None if t is None else t.clone())
                operands = [cv(t) if isinstance(t, torch.Tensor) else t for t in ops_h]
                res, kv = cv(res_h), cv(kv_h)
                out = Q.decode_layer(cv(h_h), res, *operands, kv, cv(rope_h), cv(slots_h), cv(pos_h), *tail)
                return out, res, kv

            out, res, kv = run(True)
            out_ref, res_ref, kv_ref = run(False)
            check_loose(out, out_ref, f"{what}: output")
            check_loose(res, res_ref, f"{what}: residual")
            check_loose(kv.cpu()[slots_h, :, :, pos_h], kv_ref[slots_h, :, :, pos_h], f"{what}: written cache")


# ----------------------------------------------------------------------------------------------------
# MoE routing and the grouped GEMM


def _random_ids(ctx: Ctx, t, k, e, unrouted=0.0, dtype=torch.int32) -> torch.Tensor:
    """(T, k) expert ids in [0, E); a fraction ``unrouted`` set to -1 (an expert on another rank), one of them to
    E + 3 (out of range: unrouted too)."""
    ids = torch.randint(0, e, (t, k), generator=ctx.g)
    if unrouted:
        mask = torch.rand(t, k, generator=ctx.g) < unrouted
        ids[mask] = -1
        if mask.any():
            ids.view(-1)[int(mask.view(-1).nonzero()[0])] = e + 3
    return ids.to(dtype)


@case("moe_topk_softmax", ["moe_topk_softmax"])
def _moe_topk_softmax(ctx: Ctx) -> None:
    """moe_topk_softmax: E from 8 to 1024, top-k 2..16, renormalized or not, f32 / bf16 / f16 logits, strided logits:
    ids exactly as the CPU, weights within rtol 2e-5 (the exp and the sum order differ)."""
    for t, e, k, renorm, dtype, strided in ((1, 8, 2, True, F32, False), (37, 60, 4, False, BF16, False),
                                            (5, 128, 8, True, F16, True), (9, 1024, 16, True, F32, False)):
        what = f"moe_topk_softmax T={t} E={e} k={k} renormalize={renorm} {dtype} strided={strided}"
        with ctx.sub(what):
            logits_h = ctx.randn(t, e, dtype=dtype, std=2.0)
            logits = ctx.to(logits_h.t().contiguous()).t() if strided else ctx.to(logits_h)
            w, ids = Q.moe_topk_softmax(logits, k, renorm)
            w_ref, ids_ref = Q.moe_topk_softmax(logits_h, k, renorm)
            check_equal(ids, ids_ref, f"{what}: ids")
            torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-5, atol=1e-7, msg=lambda m: f"{what}: weights: {m}")


@case("moe_align", ["moe_align"])
def _moe_align(ctx: Ctx) -> None:
    """moe_align (the stable counting sort of the (token, expert) pairs): unrouted and out-of-range ids, many empty
    experts (E = 128 > pairs), int32 and int64 ids; bit for bit against the CPU."""
    for t, k, e, unrouted, dtype in ((5, 2, 8, 0.2, torch.int32), (300, 8, 64, 0.05, torch.int64),
                                     (1, 1, 1, 0.0, torch.int32), (64, 4, 128, 0.0, torch.int32)):
        what = f"moe_align T={t} k={k} E={e} unrouted={unrouted} {dtype}"
        with ctx.sub(what):
            ids_h = _random_ids(ctx, t, k, e, unrouted, dtype)
            got, ref = Q.moe_align(ctx.to(ids_h), e), Q.moe_align(ids_h, e)
            for name, a, r in zip(("sorted_pairs", "dst_pos", "offsets"), got, ref):
                check_equal(a, r, f"{what}: {name}")


@case("moe_permute_quant", ["moe_permute_quant"])
def _moe_permute_quant(ctx: Ctx) -> None:
    """moe_permute_quant (gather into the experts' order + quantize) per token, per tensor and per 1x128 group, int8
    and fp8, rows in registers and in an 8-block cluster (H = 14336); bit for bit against the CPU."""
    params = [(7, 2, 5, 384, BF16, "dynamic", I8), (4, 3, 3, 1024, F32, "static", FP8),
              (5, 2, 8, 14336, BF16, "group", FP8), (33, 4, 16, 128, F16, "group", I8),
              (3, 2, 4, 16384, BF16, "dynamic", FP8)]
    for t, k, e, h, xdtype, mode, qdtype in (params[:3] if ctx.quick else params):
        if qdtype not in ctx.qdtypes:
            continue
        what = f"moe_permute_quant T={t} k={k} H={h} {xdtype} -> {qdtype} {mode}"
        with ctx.sub(what):
            sp_h = Q.moe_align(_random_ids(ctx, t, k, e, 0.1), e)[0]
            x_h = ctx.randn(t, h, dtype=xdtype, std=3.0)
            scale_h = torch.tensor([_STATIC_SCALE[qdtype]]) if mode == "static" else None
            group = BLOCK if mode == "group" else 0
            q, s = Q.moe_permute_quant(ctx.to(x_h), ctx.to(sp_h), k, qdtype, ctx.to(scale_h), group)
            q_ref, s_ref = Q.moe_permute_quant(x_h, sp_h, k, qdtype, scale_h, group)
            check_equal(q, q_ref, f"{what}: q")
            check_equal(s, s_ref, f"{what}: scale")


@case("moe_unpermute", ["moe_unpermute", "moe_unpermute_out"])
def _moe_unpermute(ctx: Ctx) -> None:
    """moe_unpermute (weighted sum back into token order, unrouted pairs skipped), functional and out=; bit for bit
    against the CPU (the same float32 operations in the same order)."""
    for t, k, e, h, dtype, use_out in ((7, 2, 8, 384, BF16, False), (33, 8, 64, 128, F32, True),
                                       (4, 3, 3, 1024, F16, True)):
        what = f"moe_unpermute T={t} k={k} H={h} {dtype} out={use_out}"
        with ctx.sub(what):
            dst_h = Q.moe_align(_random_ids(ctx, t, k, e, 0.1), e)[1]
            y_h = ctx.randn(t * k, h, dtype=dtype)
            w_h = torch.rand(t, k, generator=ctx.g)
            y, dst, w = ctx.to(y_h), ctx.to(dst_h), ctx.to(w_h)
            if use_out:
                out = ctx.nan((t, h), dtype)
                Q.moe_unpermute_out(out, y, dst, w)
            else:
                out = Q.moe_unpermute(y, dst, w)
            check_equal(out, Q.moe_unpermute(y_h, dst_h, w_h), what)


def _group_ends(ctx: Ctx, t: int, e: int, kind: str) -> list[int]:
    """The end row of each expert's group: "empty" (experts 0, 1, E // 2 and E - 1 get no rows), "tail" (the same,
    with 3 rows routed to no expert), "one" (every row on expert E // 2)."""
    counts = [0] * e
    if kind == "one":
        counts[e // 2] = t
    else:
        allowed = [x for x in range(e) if x not in (0, 1, e // 2, e - 1)] or [e // 2]
        routed = max(t - 3, 0) if kind == "tail" else t
        for i in torch.randint(0, len(allowed), (routed,), generator=ctx.g).tolist():
            counts[allowed[i]] += 1
    return list(itertools.accumulate(counts))


def _grouped(ctx: Ctx, t, n, k, e, dtype, kind, *, sa_kind="token", sb_kind="channel", bias=True, out_dtype=BF16,
             functional=False, block=False, bad_offsets=False) -> None:
    """One grouped_scaled_mm call checked expert by expert against the dense float64 reference; with out= (NaN
    first) the rows past the last expert's end must stay untouched."""
    what = (f"grouped_scaled_mm T={t} E={e} N={n} K={k} {'block' if block else dtype} {kind} sa={sa_kind} "
            f"sb={sb_kind} bias={bias} -> {out_dtype} functional={functional} bad_offsets={bad_offsets}")
    with ctx.sub(what):
        a_h, w_h = _operand(ctx, (t, k), dtype), _operand(ctx, (e, n, k), dtype)
        if block:
            sa_h = _block_scales(ctx, (t, k // BLOCK), k)
            sb_h = _block_scales(ctx, (e, _ceil(n, BLOCK), k // BLOCK), k)
        else:
            ma, mb = scale_magnitudes(dtype, k)
            sa_h = rand_scale({"token": (t, 1), "token1d": (t,), "tensor": (1,)}[sa_kind], "cpu", ma, ctx.g)
            sb_h = rand_scale({"channel": (e, n), "expert": (e,), "expert2d": (e, 1)}[sb_kind], "cpu", mb, ctx.g)
        b_h = ctx.randn(e, n, dtype=out_dtype, std=2.0) if bias else None
        if bad_offsets:  # the device clamps: c[e] = min(T, max(c[e - 1], offsets[e])); the CPU refuses them
            assert e == 4
            ends = [t // 2, t // 2, t, t]
            given = torch.tensor([t // 2, -5, t + 100, t // 3] if ctx.cuda else ends, dtype=torch.int32)
        else:
            ends = _group_ends(ctx, t, e, kind)
            given = torch.tensor(ends, dtype=torch.int32)
        a, w, sa, sb, offs, b = (ctx.to(x) for x in (a_h, w_h, sa_h, sb_h, given, b_h))
        routed = ends[-1]
        if functional and not ctx.tma_out(t, ctx.grouped_decode_rows):
            out = Q.grouped_scaled_mm(a, w.transpose(1, 2), sa, sb, offs, out_dtype, b)
            got = out[:routed].cpu()  # rows past the last end are unspecified in a fresh result
        else:
            out = ctx.nan((t, n), out_dtype)
            Q.grouped_scaled_mm_out(out, a, w.transpose(1, 2), sa, sb, offs, b)
            got = out.cpu()
            assert torch.isnan(got[routed:].float()).all(), f"{what}: rows >= offsets[-1] = {routed} were written"
        start = 0
        for x, end in enumerate(ends):
            if end > start:
                rows = slice(start, end)
                be = None if b_h is None else b_h[x]
                name = f"{what}: expert {x} rows [{start}, {end})"
                if block:
                    check_gemm(got[rows], a_h[rows], w_h[x].t(), sa_h[rows], sb_h[x], be, name, block=True)
                else:
                    sa_e = sa_h.reshape(-1)[rows] if sa_h.numel() != 1 else sa_h.reshape(1)
                    sb_e = sb_h[x] if sb_h.dim() == 2 and sb_h.shape[1] == n else sb_h.reshape(-1)[x:x + 1]
                    check_gemm(got[rows], a_h[rows], w_h[x].t(), sa_e, sb_e, be, name)
            start = max(start, end)


@case("grouped_scaled_mm", ["grouped_scaled_mm", "grouped_scaled_mm_out"], needs_sm90=True)
def _grouped_scaled_mm(ctx: Ctx) -> None:
    """grouped_scaled_mm int8, fp8 and block fp8 with empty experts (first, last, inner), unrouted tail rows and all
    rows on one expert; T on both sides of the grouped decode bound (64 rows) and of the CUTLASS Small / Large switch
    (16 E); per-token / per-tensor x per-channel / per-expert scales; a K tail (K = 400) in the decode kernel; offsets
    the device must clamp."""
    e, n, k = 8, 272, 512
    rows = [(I8, 5, "empty", dict(functional=True)),
            (I8, 64, "tail", dict(sa_kind="tensor", sb_kind="expert", bias=False, out_dtype=F16)),
            (I8, 100, "empty", dict(sb_kind="expert2d")),
            (I8, 300, "tail", {}),
            (FP8, 1, "one", dict(sa_kind="token1d", sb_kind="expert")),
            (FP8, 33, "empty", dict(bias=False, out_dtype=F16, functional=True)),
            (FP8, 65, "tail", dict(sa_kind="tensor")),
            (FP8, 600, "empty", dict(bias=False))]
    blocks = [(7, "empty", dict(functional=True)), (64, "tail", dict(out_dtype=F16)), (129, "empty", {}),
              (300, "one", dict(bias=False))]
    if ctx.quick:
        rows, blocks = [rows[i] for i in (0, 3, 5, 7)], [blocks[0], blocks[3]]
    for dtype, t, kind, kw in rows:
        if dtype in ctx.qdtypes:
            _grouped(ctx, t, n, k, e, dtype, kind, **kw)
    if FP8 in ctx.qdtypes:
        for t, kind, kw in blocks:
            _grouped(ctx, t, 208, 384, e, FP8, kind, block=True, **kw)
    _grouped(ctx, 9, n, 400, e, I8, "empty")  # K % 64 != 0 in the grouped decode kernel
    for t in ((3,) if ctx.quick else (3, 600)):
        _grouped(ctx, t, 128, 256, 4, I8, "clamped", bad_offsets=True)


# ----------------------------------------------------------------------------------------------------
# CUDA graphs: capture + replay with new inputs (torch's caching allocator on)


def _replay_and_compare(ctx: Ctx, what: str, fn: Callable, inputs_h: list, steps: list, cpu_fn: Callable) -> None:
    """On CUDA: capture ``fn(*static)`` (`cutlass_w8a8.graphs.capture`), then per step copy the step's host inputs
    in, replay, and compare with the eager ``fn`` on the same inputs (bit for bit) and with ``cpu_fn`` (the chain on
    the CPU, `check_loose`). On the CPU: ``fn`` eagerly per step against ``cpu_fn``."""
    if ctx.cuda:
        static = [ctx.to(x) for x in inputs_h]
        graph, out = capture(fn, static)  # warm-up and capture run fn on inputs_h (state, e.g. a cache, changes)
    else:
        fn(*[ctx.to(x) for x in inputs_h])
    cpu_fn(*inputs_h)  # the same history on the CPU
    for i, step_h in enumerate(steps):
        with ctx.sub(f"{what} step {i}"):
            if ctx.cuda:
                for dst, src in zip(static, step_h):
                    dst.copy_(ctx.to(src))
                graph.replay()
                ctx.sync()
                replayed = out.cpu().clone()
                eager = fn(*[ctx.to(x) for x in step_h]).cpu()
                check_equal(replayed, eager, f"{what} step {i}: replay vs eager")
            else:
                replayed = fn(*[ctx.to(x) for x in step_h]).clone()
            check_loose(replayed, cpu_fn(*step_h), f"{what} step {i}")


def _moe_weights(ctx: Ctx, e, hidden, inter, block):
    """Host (w13 (E, 2I, H), s13, w2 (E, H, I), s2): int8 with per-channel scales, or e4m3 with 128x128 block
    scales."""
    out = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        dtype = FP8 if block else I8
        w = _operand(ctx, (e, n, k), dtype)
        s = (_block_scales(ctx, (e, _ceil(n, BLOCK), k // BLOCK), k) if block
             else rand_scale((e, n), "cpu", 1.0 / (74.0 * k ** 0.5), ctx.g))
        out += [w, s]
    return out


@case("graph_moe", ["moe_topk_softmax", "moe_align", "moe_permute_quant", "grouped_scaled_mm_out", "silu_mul_quant",
                    "moe_unpermute_out"], graphs=True, needs_sm90=True)
def _graph_moe(ctx: Ctx) -> None:
    """The MoE layer's op chain (router top-k, align, permute-quant, grouped GEMM, SiLU-quant, grouped GEMM, unpermute)
    captured into a CUDA graph and replayed with new router logits and hidden states: int8 at 48 routed rows (grouped
    decode kernel), block fp8 at 160 (CUTLASS grouped); experts 0 and 5 never chosen (empty)."""
    e, hidden, inter, top_k = 8, 256, 256, 2
    for block, t in ((False, 24), (True, 80)):
        if block and FP8 not in ctx.qdtypes:
            continue
        qd, group = (FP8, BLOCK) if block else (I8, 0)
        w_h = _moe_weights(ctx, e, hidden, inter, block)

        def make(on_dev: bool):
            cv = ctx.to if on_dev else (lambda x: x.clone())
            w13, s13, w2, s2 = (cv(x) for x in w_h)
            nan = ctx.nan if on_dev else (lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
            h_buf, y_buf = nan((t * top_k, 2 * inter), BF16), nan((t * top_k, hidden), BF16)
            out_buf = nan((t, hidden), BF16)

            def chain(logits, x):
                tw, ids = Q.moe_topk_softmax(logits, top_k, True)
                sp, dst, offs = Q.moe_align(ids, e)
                q, s = Q.moe_permute_quant(x, sp, top_k, qd, None, group)
                Q.grouped_scaled_mm_out(h_buf, q, w13.transpose(1, 2), s, s13, offs, None)
                q2, sq2 = Q.silu_mul_quant(h_buf, qd, None, group)
                Q.grouped_scaled_mm_out(y_buf, q2, w2.transpose(1, 2), sq2, s2, offs, None)
                Q.moe_unpermute_out(out_buf, y_buf, dst, tw)
                return out_buf

            return chain

        def inputs():
            logits = ctx.randn(t, e, std=2.0)
            logits[:, 0] = logits[:, 5] = -30.0  # never chosen: empty experts
            return [logits, ctx.randn(t, hidden, dtype=BF16)]

        _replay_and_compare(ctx, f"graph_moe {'block fp8' if block else 'int8'} T={t}", make(True), inputs(),
                            [inputs(), inputs()], make(False))


@case("graph_decode", ["rms_norm_quant", "scaled_mm_out", "rope_kv_cache_", "decode_attention_quant",
                       "scaled_mm_decode_out", "linear_decode_out"], graphs=True)
def _graph_decode(ctx: Ctx) -> None:
    """A decode step's op chain (norm-quant, qkv GEMM at M = 4 (the decode GEMM), rope + cache, attention-quant,
    o_proj, a fused linear_decode) captured and replayed with new hidden states, positions and rotary tables."""
    b, hidden, heads, kv_heads, d, s, inter = 4, 256, 4, 2, 64, 32, 256
    qkv_n = (heads + 2 * kv_heads) * d
    norm_h = 1 + ctx.randn(hidden, dtype=BF16, std=0.1)
    weights_h = [(_operand(ctx, (n, k), I8), rand_scale((n, 1), "cpu", 1.0 / (74.0 * k ** 0.5), ctx.g))
                 for n, k in ((qkv_n, hidden), (hidden, heads * d), (2 * inter, hidden))]
    kv_h = ctx.randn(b + 1, 2, kv_heads, s, d, dtype=BF16)
    slots_h = torch.randperm(b + 1, generator=ctx.g)[:b]

    def make(on_dev: bool):
        cv = ctx.to if on_dev else (lambda x: x.clone())
        nw, kv, slots = cv(norm_h), cv(kv_h), cv(slots_h)
        (wqkv, sqkv), (wo, so), (wgu, sgu) = ((cv(w), cv(sc)) for w, sc in weights_h)
        nan = ctx.nan if on_dev else (lambda shape, dtype: torch.full(shape, float("nan"), dtype=dtype))
        qkv_buf, o_buf, gu_buf = nan((b, qkv_n), BF16), nan((b, hidden), BF16), nan((b, 2 * inter), BF16)

        def step(x, positions, rope):
            q, sq = Q.rms_norm_quant(x, nw, 1e-5, I8, None, None, 0)
            Q.scaled_mm_out(qkv_buf, q, wqkv.t(), sq, sqkv, None)
            qkv = qkv_buf.view(b, heads + 2 * kv_heads, d)
            Q.rope_kv_cache_(qkv, rope, kv, slots, positions, heads, kv_heads)
            qa, sa = Q.decode_attention_quant(qkv[:, :heads], kv, slots, positions, 1.0 / math.sqrt(d), I8, None)
            Q.scaled_mm_decode_out(o_buf, qa, wo.t(), sa, so, None)
            Q.linear_decode_out(gu_buf, o_buf, wgu.t(), sgu, None, I8)
            return gu_buf

        return step

    def inputs():
        positions = torch.randint(0, s, (b,), generator=ctx.g)
        angles = torch.rand(b, d // 2, generator=ctx.g) * 6.2831853
        return [ctx.randn(b, hidden, dtype=BF16), positions, torch.stack([angles.cos(), angles.sin()], -1).contiguous()]

    _replay_and_compare(ctx, "graph_decode", make(True), inputs(), [inputs(), inputs()], make(False))


@case("graph_update", ["_graph_update_scaled_mm", "quantize_per_token", "quantize_per_token_group", "scaled_mm_out"],
      graphs=True, cuda_only_ops=["_graph_update_scaled_mm"])
def _graph_update(ctx: Ctx) -> None:
    """UpdatableGraph: quantize + scaled_mm(out=) captured at M = 64 (int8) and 32 (block fp8), resized with set_rows
    (rows past the new M untouched), then the GEMM node re-pointed to new operands of another M
    (_graph_update_scaled_mm) and replayed. On the CPU: the same GEMMs through scaled_mm_out."""
    variants = [(False, I8, 64, 256, 512, 5, 7)]
    if ctx.sm90 and ctx.fp8:
        variants.append((True, FP8, 32, 256, 256, 3, 9))
    for block, dtype, m, n, k, rows, m2 in variants:
        what = f"graph_update {'block fp8' if block else dtype} M={m} set_rows({rows}) update M={m2}"
        with ctx.sub(what):
            w_h = _operand(ctx, (n, k), dtype)
            ws_h = (_block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k) if block else
                    rand_scale((n, 1), "cpu", scale_magnitudes(dtype, k)[1], ctx.g))
            bias_h = ctx.randn(n, dtype=BF16, std=2.0)  # captured with a bias, updated to another
            w, ws, bias = ctx.to(w_h), ctx.to(ws_h), ctx.to(bias_h)
            out = ctx.nan((m, n), BF16)

            def quant(x):
                return Q.quantize_per_token_group(x, BLOCK, FP8) if block else Q.quantize_per_token(x, dtype)

            def fn(x):
                q, s = quant(x)
                Q.scaled_mm_out(out, q, w.t(), s, ws, bias)
                return out

            x_h = ctx.randn(m, k, dtype=BF16, std=2.0)
            if ctx.cuda:
                g = UpdatableGraph(fn, [ctx.to(x_h)])
                node = next(nd for nd in g.nodes if nd.op == "scaled_mm")
                g.set_rows(rows)
                g.static_inputs[0].copy_(ctx.to(x_h))
                out.copy_(ctx.nan(out.shape, out.dtype))
                g.replay()
                ctx.sync()
                got = out.cpu()
                assert torch.isnan(got[rows:].float()).all(), f"{what}: rows >= {rows} were written"
            else:
                q, s = quant(ctx.to(x_h[:rows]))
                Q.scaled_mm_out(out[:rows], q, w.t(), s, ws, bias)
                got = out
            q_h, s_h = quant(x_h[:rows])
            check_gemm(got[:rows], q_h, w_h.t(), s_h, ws_h if block else ws_h.reshape(-1), bias_h,
                       f"{what}: set_rows", block)
            # new operands of another M for the GEMM node
            a2_h, w2_h = _operand(ctx, (m2, k), dtype), _operand(ctx, (n, k), dtype)
            if block:
                sa2_h = _block_scales(ctx, (m2, k // BLOCK), k)
                sb2_h = _block_scales(ctx, (_ceil(n, BLOCK), k // BLOCK), k)
            else:
                sa2_h, sb2_h = _rowwise_scales(ctx, m2, n, k, dtype, True)
            bias2_h = ctx.randn(n, dtype=BF16, std=2.0)
            out2 = ctx.nan((m2, n), BF16)
            a2, w2 = ctx.to(a2_h), ctx.to(w2_h)
            if ctx.cuda:
                g.update_scaled_mm(node, out2, a2, w2.t(), ctx.to(sa2_h), ctx.to(sb2_h), ctx.to(bias2_h))
                out.copy_(ctx.nan(out.shape, out.dtype))
                g.replay()
                ctx.sync()
                assert torch.isnan(out.cpu().float()).all(), f"{what}: the captured output was written after the update"
            else:
                Q.scaled_mm_out(out2, a2, w2.t(), ctx.to(sa2_h), ctx.to(sb2_h), ctx.to(bias2_h))
            check_gemm(out2, a2_h, w2_h.t(), sa2_h, sb2_h, bias2_h, f"{what}: updated node", block)
