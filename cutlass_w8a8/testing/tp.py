"""Tensor-parallel test and benchmark support: `run_workers` (start N processes in one process group, gloo or
NCCL, every wait under a timeout) and `row_parallel_bound` (the element-wise bound on how far a row-parallel
W8A8 layer's output may be from the unsharded layer's, element-wise worst case; `row_parallel_rms_bound`, its
norm under independent roundings). Importing it touches no GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["LAUNCHER_ENV", "NCCL_ENV", "RankResult", "WorkerTimeout", "launcher_env", "refuse_under_launcher",
           "row_parallel_bound", "row_parallel_rms_bound", "run_workers", "unit_roundoff"]

#: Environment for NCCL workers: NVLink multicast (NVLS) and torch's symmetric-memory multicast off (the
#: lent H200 machines do not support it; KINDS.md).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


#: Variables torchrun (torch.distributed.run) sets in every process it starts; any of them set means this process is
#: one rank of a launch.
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def launcher_env(environ: Optional[dict] = None) -> dict:
    """The `LAUNCHER_ENV` variables set in ``environ`` (default ``os.environ``), by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in LAUNCHER_ENV if k in environ}


def refuse_under_launcher(script: str, environ: Optional[dict] = None) -> None:
    """For a script that starts its own ranks (`run_workers`): exit with status 2 and a message on stderr when it
    runs under torchrun or another launcher (any `LAUNCHER_ENV` variable set). Under ``torchrun --nproc-per-node 2``
    each copy would start all its ranks at once on the same GPUs, and the copies would time each other: one such run
    of bench/bench_tp.py reported TP=1 at 5.06 ms and a 3.15x speedup against its own 2.00x byte bound.

    Raises
    ------
    SystemExit
        Status 2, when a launcher variable is set.
    """
    found = launcher_env(environ)
    if not found:
        return
    names = ", ".join(f"{k}={v}" for k, v in found.items())
    print(f"{script}: refusing to run under torchrun or another launcher ({names} set). It starts its own "
          "processes, one per rank; under a launcher every copy would start them at once on the same GPUs and the "
          f"copies would time each other. Run it as `python {script} ...` with none of "
          f"{', '.join(LAUNCHER_ENV)} in the environment.", file=sys.stderr, flush=True)
    raise SystemExit(2)


@dataclasses.dataclass
class RankResult:
    """What one worker returned or raised."""

    rank: int
    value: Any = None
    error_type: Optional[str] = None  # e.g. "ValueError"; None when the function returned
    error: Optional[str] = None  # str(exception)
    traceback: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error_type is None


class WorkerTimeout(RuntimeError):
    """A worker did not finish within `run_workers`'s timeout (it was killed)."""


def _worker(fn, rank: int, world: int, backend: str, init_method: str, init_timeout_s: float, env: dict,
            args: tuple, out_path: str) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    if backend == "gloo":
        # the ranks share the CPU: each a pool as large as the machine would oversubscribe it
        torch.set_num_threads(max(1, torch.get_num_threads() // world))

    result = RankResult(rank)
    try:
        kw = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=init_timeout_s), **kw)
        try:
            result.value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 (reported to the parent)
        result.error_type, result.error = type(exc).__name__, str(exc)
        result.traceback = traceback.format_exc()
        result.value = None
    with open(out_path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out_path + ".tmp", out_path)


#: Modules a gloo forkserver imports once (those of them the caller has imported), so that its workers start
#: without importing them again: seconds of CPU per worker (compressed-tensors alone about 5 s).
_PRELOAD = ("torch", "torch.distributed", "cutlass_w8a8", "transformers", "compressed_tensors", "safetensors")


def _context(backend: str):
    """The multiprocessing context of `run_workers`' workers. NCCL: ``spawn`` (a fresh interpreter per rank).
    gloo: ``forkserver`` where the platform has it, preloaded with the modules of `_PRELOAD` that this process has
    imported: each rank is forked from that single-threaded server (no CUDA, no OpenMP pool there), so it starts
    in milliseconds instead of importing torch, transformers and compressed-tensors (several seconds of CPU each)
    again. The server starts at the first call and serves this process's later calls, so gloo workers see the
    environment and ``sys.path`` of that moment (pass later variables in ``env``); the modules a worker function
    needs beyond these (its own module, e.g. a test file) are imported by each rank as with spawn."""
    import sys

    import torch.multiprocessing as mp

    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])
    return ctx


def run_workers(fn: Callable, world_size: int = 2, args: Sequence[Any] = (), *, backend: str = "gloo",
                timeout_s: float = 120.0, group_timeout_s: float = 60.0, env: Optional[dict] = None,
                raise_errors: bool = True) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes (`_context`: spawned for NCCL, forked
    from a preloaded forkserver for gloo) that form one default process group, and return each rank's `RankResult`.

    Each worker sets ``env`` (plus `NCCL_ENV` for NCCL) before initializing ``torch.distributed`` with
    ``backend`` (``init_method`` a ``file://`` rendezvous in a fresh temporary directory, ``timeout`` =
    ``group_timeout_s``, so a collective that a rank never joins fails after that long instead of hanging); with
    NCCL, rank ``r`` uses ``cuda:r``; with gloo each rank runs torch with ``torch.get_num_threads() // world_size``
    threads (at least 1), the ranks sharing the CPU. The parent waits at most ``timeout_s`` seconds for all of
    them, kills the ones still running and raises `WorkerTimeout` naming them: the caller never hangs.

    Parameters
    ----------
    fn : callable
        A module-level function (the workers import it by name). Its return value must pickle (keep it on
        the CPU).
    raise_errors : bool
        Raise ``RuntimeError`` with every failing rank's traceback when a worker raised (default). False returns
        the results with the errors recorded, for tests that expect an exception on every rank.
    """
    env = dict(env or {})
    if backend == "nccl":
        env = {**NCCL_ENV, **env}
    ctx = _context(backend)
    tmp = tempfile.mkdtemp(prefix="cw8a8_tp_")
    try:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, backend, init, group_timeout_s, env,
                                                   tuple(args), outs[r]), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        for r in hung:
            procs[r].join(10)
        results = []
        for r, p in enumerate(procs):
            if os.path.exists(outs[r]):
                with open(outs[r], "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(RankResult(r, error_type="WorkerDied",
                                          error=f"rank {r} exited with code {p.exitcode} without a result"))
        if hung:
            done = "; ".join(f"rank {res.rank}: {'ok' if res.ok else res.error_type + ': ' + res.error}"
                             for res in results if res.rank not in hung)
            raise WorkerTimeout(f"run_workers: ranks {hung} did not finish within {timeout_s} s and were killed"
                                + (f" (others: {done})" if done else ""))
        failed = [res for res in results if not res.ok]
        if failed and raise_errors:
            raise RuntimeError("run_workers: " + "\n".join(
                f"rank {res.rank} raised {res.error_type}: {res.error}\n{res.traceback or ''}" for res in failed))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------
# tolerances


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of floats near 1 (relative rounding error bound, round to nearest): bfloat16 2**-8,
    float16 2**-11, float32 2**-24."""
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]


def _quant_error_bound(x: torch.Tensor, quant_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - q * scale|`` for ``q = quantize(x / scale)`` (float64): int8 rounds to the
    nearest integer (``scale / 2``); e4m3 rounds to 3 mantissa bits (``2**-4 |x|``) with subnormal spacing 2**-9
    (``2**-10 scale``)."""
    if quant_dtype == torch.int8:
        return (scale / 2).expand_as(x)
    return x.abs() * 2.0**-4 + scale * 2.0**-10


def _row_parallel_terms(x, weight, weight_scale, world, input_scale):
    """``(xf, |W|, W^2, e_full, e_tp)`` in float64: the input ``(M, K)``, the dequantized weight's magnitudes and
    squares ``(N, K)``, and the per-element quantization error bounds of the full layer and of the shards."""
    quant_dtype = weight.dtype
    qmax = 127.0 if quant_dtype == torch.int8 else 448.0
    xf = x.double().reshape(-1, x.shape[-1])
    k = xf.shape[1]
    w = weight.double() * weight_scale.double().reshape(-1, 1)
    if input_scale is not None:
        s = input_scale.double().reshape(1, 1).expand(xf.shape[0], 1)
        e_full = e_tp = _quant_error_bound(xf, quant_dtype, s)
    else:
        e_full = _quant_error_bound(xf, quant_dtype, xf.abs().amax(-1, keepdim=True) / qmax)
        e_tp = torch.cat([_quant_error_bound(p, quant_dtype, p.abs().amax(-1, keepdim=True) / qmax)
                          for p in xf.split(k // world, dim=-1)], dim=-1)
    return xf, w.abs(), w * w, e_full, e_tp


def row_parallel_bound(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, world: int,
                       out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
                       input_scale: Optional[torch.Tensor] = None, accum_rel: float = 0.0) -> torch.Tensor:
    """Element-wise worst-case bound on ``|y_tp - y_full|``: a row-parallel W8A8 layer over ``world`` equal K
    shards against the unsharded layer, both quantizing the same float input ``x``.

    Derivation (exact arithmetic on ``W = weight * weight_scale``; float64 here): with dynamic per-token
    quantization the full layer quantizes row ``x`` with ``s = amax|x| / qmax`` and rank ``r`` its columns with
    ``s_r = amax|x_r| / qmax <= s``. Each quantized element is within ``e(x_k, s)`` of ``x_k`` (int8: ``s / 2``;
    e4m3: ``2**-4 |x_k| + 2**-10 s``), so each output is within ``sum_k e_full_k |W_nk|`` (full) and
    ``sum_k e_tp_k |W_nk|`` (sharded) of ``x @ W^T``, hence apart by at most their sum. Roundings to
    ``out_dtype`` (unit roundoff ``u``): the full layer rounds once (``u |y|``); the sharded one rounds each
    partial, their sum, and the sum plus bias (``u`` times the partials' magnitudes, twice, plus ``u |y + b|``);
    every magnitude is bounded by ``(|x| + e) @ |W|^T`` (+ ``|b|``). A float32 accumulation and scale products
    add ``2**-20`` of the same magnitude (generous: K <= 2**16 terms of float32 rounding are far smaller for the
    kernels' exact int32 / float64 CPU sums). With a static ``input_scale`` both quantize every element
    identically, and only the roundings remain.

    This is a worst case: for e4m3 (3 mantissa bits) at K in the hundreds it is as large as ``|y|`` itself; use
    `row_parallel_rms_bound` to catch errors of that size.

    Parameters
    ----------
    x : torch.Tensor
        ``(M, K)`` the float input.
    weight, weight_scale : torch.Tensor
        The full layer's ``(N, K)`` 8-bit weight and ``(N,)`` / ``(1,)`` float32 scale.
    world : int
        Number of K shards.
    out_dtype : torch.dtype
        The layers' output dtype.
    bias, input_scale : torch.Tensor, optional
    accum_rel : float
        The GEMM's own accumulation error relative to ``sum_k |x_k W_nk|``, charged to both sides: 0 for int8
        (exact int32 sums) and the CPU reference; `cutlass_w8a8.testing.references.fp8_accum_bound` ``(K)`` for
        e4m3 on tensor cores.

    Returns
    -------
    torch.Tensor
        ``(M, N)`` float64.
    """
    xf, aw, _, e_full, e_tp = _row_parallel_terms(x, weight, weight_scale, world, input_scale)
    # a static scale quantizes every element identically on both sides: only the roundings remain
    quant = (e_full + e_tp) @ aw.t() if input_scale is None else 0.0
    mag = (xf.abs() + torch.maximum(e_full, e_tp)) @ aw.t()
    b = bias.double().abs().reshape(1, -1) if bias is not None else 0.0
    u = unit_roundoff(out_dtype)
    rounding = u * (mag + b) + 2 * u * (1 + u) * mag + u * (1 + u) ** 2 * (mag + b) + 2.0**-20 * mag
    return quant + rounding + 2 * accum_rel * mag


def row_parallel_rms_bound(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, world: int,
                           out_dtype: torch.dtype = torch.bfloat16, bias: Optional[torch.Tensor] = None,
                           input_scale: Optional[torch.Tensor] = None, sigmas: float = 3.0,
                           accum_rel: float = 0.0) -> float:
    """Bound on the Frobenius norm ``||y_tp - y_full||`` of the same comparison as `row_parallel_bound`, treating
    each rounding as an independent zero-mean error (round to nearest on data that is not aligned to the grid).

    An error bounded by ``e`` has variance at most ``e**2``, so ``E ||y_tp - y_full||^2 <= V`` with
    ``V = sum_{m,n} [ sum_k W_nk^2 (e_full_mk^2 + e_tp_mk^2) + 2 (u (mag_mn + |b_n|))^2 + 2 (u mag_mn)^2 ]``
    (the activation quantizations of both sides; then the output roundings of `row_parallel_bound`: the full
    layer's and the bias add's, the partials' (whose squares sum to at most ``(u mag)^2``) and the sum's), and the
    bound is ``sigmas * sqrt(V)`` (default 3: the norm of one draw
    exceeding three times its RMS expectation would take the per-element errors conspiring, which round to
    nearest does not do). Unlike the worst case, it stays far below ``||y||`` for e4m3 at large K: a missing
    partial sum or a bias added twice exceeds it. ``accum_rel`` as in `row_parallel_bound`; its worst case,
    ``2 accum_rel ||mag||``, is added to the bound as such (accumulation error is not zero-mean).

    Returns
    -------
    float
    """
    xf, aw, w2, e_full, e_tp = _row_parallel_terms(x, weight, weight_scale, world, input_scale)
    quant = ((e_full**2 + e_tp**2) @ w2.t()).sum() if input_scale is None else 0.0
    mag = (xf.abs() + torch.maximum(e_full, e_tp)) @ aw.t()
    b = bias.double().abs().reshape(1, -1) if bias is not None else 0.0
    u = unit_roundoff(out_dtype)
    rounding = (u * (mag + b)).pow(2).sum() * 2 + (u * mag).pow(2).sum() * 2
    return float(sigmas * torch.sqrt(quant + rounding) + 2 * accum_rel * mag.norm())
