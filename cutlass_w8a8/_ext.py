"""Loading of the compiled parts: the torch extension `_C.so` and the per-architecture kernel libraries.

Nothing here queries a GPU: importing cutlass_w8a8 works on machines without one (and with a CPU-only
torch, where no library was built and the ops keep only their CPU reference implementations).
"""

from __future__ import annotations

import ctypes
import os

import torch

_DIR = os.path.dirname(os.path.abspath(__file__))
# Kernel libraries (csrc/kernel_api.h). `_C.so` dlopens them itself, RTLD_LOCAL; loading them here as well
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
    except OSError as exc:
        _errors["_C"] = f"failed to load: {exc}"


def cuda_ops_available() -> bool:
    """True when the CUDA implementations of the ops (`_C.so`) are loaded."""
    return "_C" in _loaded


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
