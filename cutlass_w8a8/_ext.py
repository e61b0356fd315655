"""Loading of the compiled parts: the torch extension `_C.so` and the per-architecture kernel libraries.

Nothing here queries a GPU: importing cutlass_w8a8 works on machines without one (and with a CPU-only
torch, where no library was built and the ops keep only their CPU reference implementations).
"""

from __future__ import annotations

import ctypes
import os

import torch

_DIR = os.path.dirname(os.path.abspath(__file__))
# Kernel libraries (csrc/gemm/kernel_api.h). `_C.so` dlopens them itself, RTLD_LOCAL; loading them here as well
# (the same handle) reports load failures at import and gives the tuning scripts their config tables.
KERNEL_LIBRARIES = ("_kernels_sm90", "_kernels_sm80", "_kernels_sm89")

_loaded: dict[str, object] = {}
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
        # the same (already loaded) library through ctypes, for its C entry points (set_pdl)
        _loaded["_C_ctypes"] = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        _errors["_C"] = f"failed to load: {exc}"


def cuda_ops_available() -> bool:
    """True when the CUDA implementations of the ops (`_C.so`) are loaded."""
    return "_C" in _loaded


def pdl_enabled() -> bool:
    """Whether the sm90 GEMMs are launched with programmatic dependent launch (PDL).

    With PDL a GEMM's thread blocks are scheduled while the previous kernel on the stream finishes and run
    their prologue (barrier setup, TMA descriptor prefetch) before waiting, on ``griddepcontrol.wait``, for
    that kernel to complete and its writes to be visible; the quantization kernels let a PDL-launched
    successor be scheduled as soon as all their blocks have started. Results are identical either way;
    only the launch latency between kernels changes (CUDA C++ Programming Guide, "Programmatic Dependent
    Launch and Synchronization"). It applies to GEMMs with M <= 16 (decode), where it was measured faster on
    every benchmarked shape (bench/results/gemm_nvidia-h200.md); at larger M it measured slower, so those
    launch without it. The CUTLASS 2.x kernels (sm80/sm89) are never launched with PDL.

    On by default; ``CUTLASS_W8A8_PDL=0`` in the environment before the first GEMM turns it off. False when
    the extension is not loaded.
    """
    lib = _loaded.get("_C_ctypes")
    return bool(lib.cw8a8_get_pdl()) if lib is not None else False


def set_pdl(enabled: bool) -> bool:
    """Turn PDL for the sm90 GEMMs on or off for later launches (see `pdl_enabled`); returns the previous
    setting. A CUDA graph keeps the setting its kernels were captured with.

    Raises
    ------
    RuntimeError
        The CUDA extension is not loaded.
    """
    lib = _loaded.get("_C_ctypes")
    if lib is None:
        raise RuntimeError(f"cutlass_w8a8.set_pdl: the CUDA extension is not loaded ({extension_status()})")
    return bool(lib.cw8a8_set_pdl(1 if enabled else 0))


# ---- CUDA-graph node records (csrc/graphs/graph_nodes.cu; used by cutlass_w8a8.graphs.UpdatableGraph) ----------


class GraphRecordInfo(ctypes.Structure):
    """One recorded kernel node (csrc/graphs/graph_nodes.cu, cw8a8_graph_record_info)."""

    _fields_ = [("kind", ctypes.c_int), ("device", ctypes.c_int), ("graph", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("bound_rows", ctypes.c_int64), ("captured_rows", ctypes.c_int64),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("config", ctypes.c_int)]


_ERR_LEN = 1024


def _graph_lib(what: str):
    lib = _loaded.get("_C_ctypes")
    if lib is None:
        raise RuntimeError(f"cutlass_w8a8.{what}: the CUDA extension is not loaded ({extension_status()})")
    return lib


def _graph_call(what: str, fn, *args) -> None:
    err = ctypes.create_string_buffer(_ERR_LEN)
    rc = fn(*args, err, ctypes.c_size_t(_ERR_LEN))
    if rc != 0:
        msg = f"{what}: {err.value.decode(errors='replace')}"
        raise ValueError(msg) if rc == 2 else RuntimeError(msg)


def graph_record_begin() -> int:
    """Open a node recording; returns the id its first record will get."""
    lib = _graph_lib("graph_record_begin")
    first = ctypes.c_int64(0)
    _graph_call("cutlass_w8a8.graph_record_begin", lib.cw8a8_graph_record_begin, ctypes.byref(first))
    return first.value


def graph_record_end(check: bool) -> int:
    """Close the open recording (validating its records when `check`); returns one past its last id."""
    lib = _graph_lib("graph_record_end")
    end = ctypes.c_int64(0)
    _graph_call("cutlass_w8a8.graph_record_end", lib.cw8a8_graph_record_end, ctypes.c_int(1 if check else 0), ctypes.byref(end))
    return end.value


def graph_record_info(record: int) -> tuple[GraphRecordInfo, str]:
    """The record's fields and its op's name."""
    lib = _graph_lib("graph_record_info")
    info = GraphRecordInfo()
    op = ctypes.create_string_buffer(64)
    _graph_call("cutlass_w8a8.graph_record_info", lib.cw8a8_graph_record_info_get, ctypes.c_int64(record), ctypes.byref(info),
                op, ctypes.c_size_t(64))
    return info, op.value.decode()


def graph_set_rows(graph_exec: ctypes.c_void_p, ids, count: int, rows: int) -> None:
    """Set `count` recorded nodes (a ctypes int64 array) of an instantiated graph to `rows` rows."""
    lib = _graph_lib("graph_set_rows")
    _graph_call("UpdatableGraph.set_rows", lib.cw8a8_graph_set_rows, graph_exec, ids, ctypes.c_int64(count),
                ctypes.c_int64(rows))


def graph_release(ids) -> None:
    """Forget records whose graph is gone."""
    lib = _loaded.get("_C_ctypes")
    if lib is not None and len(ids):
        arr = (ctypes.c_int64 * len(ids))(*ids)
        lib.cw8a8_graph_release(arr, ctypes.c_int64(len(ids)))


def graph_exec_update(graph_exec: int, graph: int) -> bool:
    """cudaGraphExecUpdate(graph_exec, graph): True on success, False when the topology changed."""
    lib = _graph_lib("graph_exec_update")
    err = ctypes.create_string_buffer(_ERR_LEN)
    rc = lib.cw8a8_graph_exec_update(ctypes.c_void_p(graph_exec), ctypes.c_void_p(graph), err,
                                     ctypes.c_size_t(_ERR_LEN))
    if rc == 1:
        raise RuntimeError(f"cutlass_w8a8.graph_exec_update: {err.value.decode(errors='replace')}")
    return rc == 0


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
