"""The sanitizer cases' core: their context (`Ctx`), the `@case` registry (`CASES`), the checks, the op
recorder, the schema coverage and the driver, and the operand helpers the area modules share. The cases themselves
are in the area modules of this package (see the package docstring)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import re
import time
from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ... import _ext
from ...ops._schema import OPS as SCHEMA_OPS
from ..references import (assert_close_to_reference, assert_within, block_reference, fp8_accum_bound, rand_operand,
                          rand_scale, reference, rel_err, scale_magnitudes, ulp)


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
        initcheck mode: outputs a GEMM may store by TMA are host-written NaN buffers (see the package docstring).
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



def config_count(force, op: str, what: str) -> int:
    """The number of entries of a config table, read from the refusal of an out-of-range config: ``force(config)``
    runs a private forcing op (``_scaled_mm_config`` / ``_grouped_scaled_mm_config``) with ``config = 2**30``,
    whose ValueError says ``must be in [0, n)``. Raises that error if it says something else, and RuntimeError if
    the op accepts the config (``op`` and ``what`` name the op and the table in that message)."""
    try:
        force(1 << 30)
    except ValueError as exc:
        found = re.search(r"must be in \[0, (\d+)\)", str(exc))
        if found:
            return int(found.group(1))
        raise
    raise RuntimeError(f"{op} accepted config 2**30 for {what}")

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
                      "add a case in cutlass_w8a8/testing/sanitize_cases/ (the module of its area), or, for an op "
                      "that launches no CUDA work, an entry with the reason in NOT_DRIVEN")
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


