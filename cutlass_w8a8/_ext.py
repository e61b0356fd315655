"""Loading of the compiled parts: the torch extension `_C.so` and the per-architecture kernel libraries.

Nothing here queries a GPU: importing cutlass_w8a8 works on machines without one (and with a CPU-only
torch, where no library was built and the ops keep only their CPU reference implementations).
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import torch

_DIR = os.path.dirname(os.path.abspath(__file__))
# Kernel libraries (csrc/gemm/kernel_api.h). `_C.so` dlopens them itself, RTLD_LOCAL; loading them here as well
# (the same handle) reports load failures at import and gives the tuning scripts their config tables.
KERNEL_LIBRARIES = ("_kernels_sm90", "_kernels_sm80", "_kernels_sm89")

_loaded: dict[str, object] = {}  # "_C": its path; a kernel library's name: its ctypes handle
_errors: dict[str, str] = {}


def _load() -> None:
    for name in KERNEL_LIBRARIES:
        path = os.path.join(_DIR, name + ".so")
        if not os.path.exists(path):
            _errors[name] = "not built"
            continue
        try:
            _loaded[name] = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as exc:
            _errors[name] = f"failed to load: {exc}"
    path = os.path.join(_DIR, "_C.so")
    if not os.path.exists(path):
        _errors["_C"] = "not built (a CPU-only torch, CUTLASS_W8A8_NO_CUDA=1, or no CUDA toolkit at install time)"
        return
    try:
        torch.ops.load_library(path)
        _loaded["_C"] = path
    except OSError as exc:
        _errors["_C"] = f"failed to load: {exc}"


def cuda_ops_available() -> bool:
    """True when the CUDA implementations of the ops (`_C.so`) are loaded."""
    return "_C" in _loaded


def _c_ops(what: str):
    """``torch.ops.cutlass_w8a8``, whose non-tensor ops (csrc/torch_bindings.cpp) only `_C` defines.

    Raises
    ------
    RuntimeError
        `_C` is not loaded: "cutlass_w8a8.{what}: the CUDA extension is not loaded ({extension_status()})".
    """
    if not cuda_ops_available():
        raise RuntimeError(f"cutlass_w8a8.{what}: the CUDA extension is not loaded ({extension_status()})")
    return torch.ops.cutlass_w8a8


def pdl_enabled() -> bool:
    """Whether the sm90 GEMMs and the extension's own kernels (decode GEMM, quantization, norms, rotary,
    attention) are launched with programmatic dependent launch (PDL).

    With PDL a GEMM's thread blocks are scheduled while the previous kernel on the stream finishes and run
    their prologue (barrier setup, TMA descriptor prefetch) before waiting, on ``griddepcontrol.wait``, for
    that kernel to complete and its writes to be visible; the quantization kernels let a PDL-launched
    successor be scheduled as soon as all their blocks have started. Results are identical either way;
    only the launch latency between kernels changes (CUDA C++ Programming Guide, "Programmatic Dependent
    Launch and Synchronization"). It applies to GEMMs with M <= 16 (decode), where it was measured faster on
    every benchmarked shape (bench/results/gemm_nvidia-h200.md); at larger M it measured slower, so those
    launch without it. The CUTLASS 2.x kernels (sm80/sm89) are never launched with PDL. The extension's own
    kernels use it at every size on sm90 (each waits on griddepcontrol before touching memory a predecessor
    writes), so a decode step is one chain of overlapping launches. The rule lives in
    csrc/core/launch_policy.hpp.

    On by default; ``CUTLASS_W8A8_PDL=0`` in the environment before the first GEMM turns it off. False when
    the extension is not loaded.
    """
    return bool(torch.ops.cutlass_w8a8._get_pdl()) if cuda_ops_available() else False


def set_pdl(enabled: bool) -> bool:
    """Turn PDL for the sm90 GEMMs on or off for later launches (see `pdl_enabled`); returns the previous
    setting. A CUDA graph keeps the setting its kernels were captured with.

    Raises
    ------
    RuntimeError
        The CUDA extension is not loaded.
    """
    return bool(_c_ops("set_pdl")._set_pdl(bool(enabled)))


def decode_gemm_max_m() -> int:
    """The largest M (tokens) that `cutlass_w8a8.scaled_mm` (and `W8A8Linear`, `w8a8_linear`) sends to the decode
    GEMM (`scaled_mm_decode`: weight-streaming tensor-core ``mma.sync`` kernels, csrc/gemm/decode/README.md)
    instead of the CUTLASS kernels, on sm90; 0 when the extension is not loaded. Default 8: on an H100 the decode
    kernel was faster on the Llama-3 8B / 70B shapes at M <= 8 and mixed at 9..16
    (bench/results/decode_gemm_nvidia-h100-80gb-hbm3.md). The rule lives in csrc/core/launch_policy.hpp.
    Results: int8 is bit-identical either way; fp8 accumulates in a different order (same tolerance)."""
    return int(torch.ops.cutlass_w8a8._get_decode_gemm_max_m()) if cuda_ops_available() else 0


def set_decode_gemm_max_m(m: int) -> int:
    """Set the bound of `decode_gemm_max_m` for later launches (0 turns the decode path off); returns the previous
    one. A CUDA graph keeps the kernels it captured. Benchmarks use it to compare the two kernel families.

    Raises
    ------
    ValueError
        ``m`` outside [0, 16].
    RuntimeError
        The CUDA extension is not loaded.
    """
    return int(_c_ops("set_decode_gemm_max_m")._set_decode_gemm_max_m(int(m)))


def decode_attention_path(device_index: int, batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                          dtype: torch.dtype) -> str:
    """The kernels `cutlass_w8a8.decode_attention` / ``decode_attention_quant`` run for these sizes on CUDA device
    ``device_index`` now: ``"fused"`` (one kernel, a thread-block cluster per row: sm90, 16-bit q, 32 < D <= 128,
    the row's head groups x splits within one cluster) or ``"split"`` (the split kernel, then the combine kernel).
    Both give the same bits. The rule lives in csrc/attention/decode_attention.cu (fused_plan); tests use this to
    know which path they exercised.

    Parameters
    ----------
    batch, heads, kv_heads, seq_len, head_dim : int
        B, H, KVH, S (the cache's positions per slot) and D, all positive; ``kv_heads`` divides ``heads``.
    dtype : torch.dtype
        q's dtype.

    Raises
    ------
    ValueError
        A size that is not positive, ``kv_heads`` not dividing ``heads``, or a negative device index; a bad value of
        one of the attention's ``CUTLASS_W8A8_ATTN_*`` environment knobs (as the op would raise); under the default
        split rule (the wave rule, which asks the split kernel's occupancy), a ``head_dim`` no split kernel serves in
        ``dtype`` (16-bit: above 256).
    RuntimeError
        The CUDA extension is not loaded.
    """
    return str(_c_ops("decode_attention_path")._decode_attention_path(
        int(device_index), int(batch), int(heads), int(kv_heads), int(seq_len), int(head_dim), dtype))


def decode_attention_heads_per_cta(group: int) -> int:
    """The query heads per CTA (G') `cutlass_w8a8.decode_attention` / ``decode_attention_quant`` run on CUDA for a GQA
    group of ``group`` query heads per KV head (H / KVH) in this process: the largest of 8, 4, 2, 1 that divides
    ``group`` and is at most the cap, 4 by default or ``CUTLASS_W8A8_ATTN_HEADS_PER_CTA`` (1, 2, 4 or 8, read once per
    process). Both kernels, the split count and the fused plan take it. The rule lives in
    csrc/attention/decode_attention.cu (heads_per_cta); tests and benchmarks use this instead of re-deriving it. At a
    group of 8 (or any multiple of 8) it is the cap itself.

    Parameters
    ----------
    group : int
        H / KVH, in [1, 65535].

    Raises
    ------
    ValueError
        ``group`` outside [1, 65535]; ``CUTLASS_W8A8_ATTN_HEADS_PER_CTA`` set to another value than 1, 2, 4 or 8 (as
        the op would raise).
    RuntimeError
        The CUDA extension is not loaded.
    """
    return int(_c_ops("decode_attention_heads_per_cta")._decode_attention_heads_per_cta(int(group)))


def moe_decode_path(tokens: int, top_k: int, hidden: int, intermediate: int, group_size: int = 0) -> str:
    """The kernels `cutlass_w8a8.moe_decode_experts` (`W8A8MoE`'s decode path after its routing) launches for these
    sizes on sm90 in this process: ``"two-kernel"`` (gate/up and the token-major down quantizing x and h themselves)
    or ``"three-kernel"`` (prep, gate/up with the last-CTA quantization of h, down). Both give the same bits. Two
    kernels at ``top_k >= 4`` where both kernels' shared memory fits 64 KiB and within the measured speed rule
    (``T x H <= 2048``, ``top_k x I <= 6144``); ``CUTLASS_W8A8_MOE_DECODE_PREP`` (read once per process) ``1`` forces
    three kernels, ``0`` two wherever ``top_k >= 4`` and the shared memory fits. The rule lives in
    csrc/moe/moe_decode.cu (own_quant, which the op launches by); tests and benchmarks use this to know which path
    they exercised. It asks no device (the op itself runs on sm90 only).

    Parameters
    ----------
    tokens, top_k : int
        T and top_k, positive, ``T * top_k <= 64`` (``MOE_DECODE_MAX_PAIRS``).
    hidden, intermediate : int
        H and I: positive multiples of 16 (of 128 with ``group_size`` 128), at most 2**30.
    group_size : int, default 0
        0 (per-token activation scales) or 128 (block fp8), as the op's.

    Raises
    ------
    ValueError
        A size or ``group_size`` outside those ranges (the message names the argument);
        ``CUTLASS_W8A8_MOE_DECODE_PREP`` set to another value than 0 or 1 (as the op would raise).
    RuntimeError
        The CUDA extension is not loaded.
    """
    return str(_c_ops("moe_decode_path")._moe_decode_path(int(tokens), int(top_k), int(hidden), int(intermediate),
                                                          int(group_size)))


def moe_router_route_plan(device_index: int, experts: int, hidden: int, dtype: torch.dtype) -> tuple:
    """How `cutlass_w8a8.moe_router_route` launches for a router of ``experts`` x ``hidden`` on CUDA device
    ``device_index``: ``(ctas, slices)``, the thread-block cluster's CTAs (8, or 16 for a router weight of at least
    1 MiB where a cluster of 16 is resident) and the H slices per 16-expert tile; ``(0, 0)`` where clusters are not
    available (the op then runs ``F.linear`` and `cutlass_w8a8.moe_route`). The rule lives in
    csrc/moe/router_route.cu (router_plan); tests use this to know which configuration they exercised.

    Parameters
    ----------
    device_index : int
        A CUDA device index.
    experts, hidden : int
        E in [1, 1024] and H, a positive multiple of 64.
    dtype : torch.dtype
        x's and the router weight's dtype: torch.bfloat16 or torch.float16.

    Raises
    ------
    ValueError
        A size or dtype outside those ranges, or a negative device index.
    RuntimeError
        The CUDA extension is not loaded.
    """
    plan = _c_ops("moe_router_route_plan")._moe_router_route_plan(int(device_index), int(experts), int(hidden), dtype)
    return int(plan[0]), int(plan[1])


def set_decode_attention_fused(enabled: bool) -> bool:
    """Allow (True) or forbid (False, the default) the one-kernel decode attention path for later launches; returns
    the previous setting. Forbidden, every shape runs the split + combine kernels; tests and benchmarks compare the
    two paths with it. It is off by default because it was slower where it served 8 or more rows on an H200
    (bench/results/decode_attention_nvidia-h200.md). A CUDA graph keeps the kernels it captured.

    Raises
    ------
    RuntimeError
        The CUDA extension is not loaded.
    """
    return bool(_c_ops("set_decode_attention_fused")._set_decode_attention_fused(bool(enabled)))


def supports_fp8(device_index: int) -> bool:
    """Whether float8_e4m3fn ``scaled_mm`` runs on CUDA device ``device_index``: its fp8 kernel library exists
    for the device (9.0: sm90, 8.9: sm89) and loaded (csrc/gemm/kernel_libraries.hpp). False when `_C` is not
    loaded or CUDA is not available. Queries the device (once; C++ caches the answer's inputs)."""
    if not cuda_ops_available() or not torch.cuda.is_available():
        return False
    return bool(torch.ops.cutlass_w8a8._supports_fp8(int(device_index)))


# ---- CUDA-graph node records (csrc/graphs/graph_nodes.hpp; used by cutlass_w8a8.graphs.UpdatableGraph) --------
# Errors come from C++ with their full first line ("UpdatableGraph.set_rows: `rows` must be in [1, 64] ...");
# ValueError for a caller's mistake, RuntimeError otherwise.


class GraphRecordInfo(NamedTuple):
    """One recorded kernel node."""

    kind: int            # 0 row-wise (gridDim.x = rows), 1 scaled_mm, 2 M as the kernel's first parameter
    device: int          # CUDA device index
    graph: int           # the cudaGraph_t it was captured into (compare with CUDAGraph.raw_cuda_graph())
    rows: int            # M the node runs now
    bound_rows: int      # M of the buffers the node reads now: the most rows an update may ask for
    captured_rows: int   # M at capture
    n: int               # GEMM N (0 for other kinds)
    k: int               # GEMM K (0 for other kinds)
    config: int          # GEMM config at capture (-1 for other kinds)


def graph_record_begin() -> int:
    """Open a node recording; returns the id its first record will get."""
    return int(_c_ops("graph_record_begin")._graph_record_begin())


def graph_record_end(check: bool) -> int:
    """Close the open recording (validating its records when `check`); returns one past its last id."""
    return int(_c_ops("graph_record_end")._graph_record_end(bool(check)))


def graph_record_info(record: int) -> tuple[GraphRecordInfo, str]:
    """The record's fields and its op's name."""
    fields, op = _c_ops("graph_record_info")._graph_record_info(int(record))
    return GraphRecordInfo(*fields), op


def graph_set_rows(graph_exec: int, records: list[int], rows: int) -> None:
    """Set the recorded nodes ``records`` (a list of ints, passed as is: this runs every decode step of the
    exact-M runner) of instantiated graph ``graph_exec`` (a cudaGraphExec_t as int, from
    CUDAGraph.raw_cuda_graph_exec()) to ``rows`` rows (M)."""
    _c_ops("graph_set_rows")._graph_set_rows(graph_exec, records, rows)


def graph_release(records: list[int]) -> None:
    """Forget records whose graph is gone (nothing when `_C` is not loaded)."""
    if cuda_ops_available() and len(records):
        torch.ops.cutlass_w8a8._graph_release([int(r) for r in records])


def graph_exec_update(graph_exec: int, graph: int) -> bool:
    """cudaGraphExecUpdate(graph_exec, graph): True on success, False when the topology changed."""
    return bool(_c_ops("graph_exec_update")._graph_exec_update(int(graph_exec), int(graph)))


def kernel_library(name: str):
    """The ctypes handle of a loaded kernel library (e.g. "_kernels_sm90"), or None."""
    lib = _loaded.get(name)
    return lib if isinstance(lib, ctypes.CDLL) else None


def extension_status() -> str:
    """One line per compiled part: loaded, or why not. For error messages and bug reports."""
    lines = []
    for name in ("_C", *KERNEL_LIBRARIES):
        lines.append(f"{name}: {'loaded' if name in _loaded else _errors.get(name, 'not loaded')}")
    return "; ".join(lines)


def require_cuda_ops(op: str) -> None:
    """Raise a RuntimeError that says the CUDA extension is missing, for a CUDA tensor given to `op`."""
    if not cuda_ops_available():
        raise RuntimeError(
            f"cutlass_w8a8.{op}: the CUDA extension is not built or not loaded ({extension_status()}). "
            "Install with a CUDA build of torch and the CUTLASS headers: see README.md, 'Install'.")
