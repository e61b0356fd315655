"""What every benchmark script does around its measurement: check for the GPU and the extension, then write
``<prefix>_<device slug>.{json,md,png}`` and print the report."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["AccuracyError", "cuda_extension_missing", "markdown", "provenance", "publish", "require_cuda_extension",
           "run_checked", "save_figure", "write_results"]


class AccuracyError(RuntimeError):
    """A benchmark's result is wrong (too far from its reference, or unequal to the result it must equal): the
    timings would be meaningless."""


def run_checked(script: str, measure: Callable[..., Any], *args: Any) -> Any:
    """``measure(*args)``; an `AccuracyError` exits the process (``sys.exit``, status 1) with
    ``"<script>: aborted, wrong results: <error>"``."""
    try:
        return measure(*args)
    except AccuracyError as exc:
        sys.exit(f"{script}: aborted, wrong results: {exc}")


def markdown(lines: list[str], *sections: tuple[str, Sequence[str]]) -> str:
    """A report's text: ``lines``, then each ``(title, body)`` of ``sections`` whose ``body`` is not empty as a blank
    line, ``title``, a blank line and ``body``; each line ended by a newline."""
    for title, body in sections:
        if body:
            lines = [*lines, "", title, "", *body]
    return "\n".join(lines) + "\n"


def save_figure(fig: Any, path: str, title: str = "", dpi: int = 120) -> None:
    """Finish a matplotlib figure: ``title`` as its suptitle (when given), tight layout, write it to ``path`` at
    ``dpi`` and close it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def cuda_extension_missing(script: str) -> Optional[str]:
    """Why ``script`` cannot run its CUDA work here: a message that starts with ``script`` and says which is missing,
    a CUDA device or the compiled `cutlass_w8a8` extension (with `cutlass_w8a8.extension_status`); None when both are
    there. The scripts that return an exit status print it; `require_cuda_extension` exits with it."""
    if not torch.cuda.is_available():
        return (f"{script}: needs a CUDA device, and torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    import cutlass_w8a8

    if not cutlass_w8a8.cuda_ops_available():
        return f"{script}: the cutlass_w8a8 CUDA extension is not loaded: {cutlass_w8a8.extension_status()}"
    return None


def require_cuda_extension(script: str):
    """The `cutlass_w8a8` module when a CUDA device and its compiled extension are there; otherwise exit the
    process (``sys.exit``, status 1) with `cuda_extension_missing`'s message, which starts with ``script`` and says
    which is missing."""
    missing = cuda_extension_missing(script)
    if missing is not None:
        sys.exit(missing)
    import cutlass_w8a8

    return cutlass_w8a8


def provenance(device_name: str, repo_root: str) -> dict:
    """The head of a results file: ``device`` (``device_name``), ``device_slug``, ``capability`` ("9.0", of the
    current CUDA device), ``torch_version``, ``cuda_version``, ``cutlass_w8a8_version``, ``git_commit`` and
    ``git_dirty`` (of the checkout at ``repo_root``, see `cutlass_w8a8.testing.timers.git_commit`)."""
    import cutlass_w8a8

    from .timers import device_slug, git_commit

    commit, dirty = git_commit(repo_root)
    return {
        "device": device_name,
        "device_slug": device_slug(device_name),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cutlass_w8a8_version": getattr(cutlass_w8a8, "__version__", None),
        "git_commit": commit,
        "git_dirty": dirty,
    }


def write_results(results: dict, report: str, out_dir: str, prefix: str, plot: Callable[[dict, str], None]) -> dict:
    """Write ``<prefix>_<device slug>.json`` (``results``, which holds ``device_slug``), ``.md`` (``report``) and
    ``.png`` (``plot(results, path)``) to ``out_dir``; returns the paths by extension."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{prefix}_{results['device_slug']}")
    paths = {ext: f"{stem}.{ext}" for ext in ("json", "md", "png")}
    with open(paths["json"], "w", encoding="utf-8") as f:  # the machine's locale may be ASCII (the GPU hosts' is)
        json.dump(results, f, indent=1)
        f.write("\n")
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(report)
    plot(results, paths["png"])
    return paths


def publish(results: dict, report: str, out_dir: str, prefix: str, plot: Callable[[dict, str], None]) -> dict:
    """`write_results`, then print ``report`` and a line ``wrote <json>, <md>, <png>``; returns the paths."""
    paths = write_results(results, report, out_dir, prefix, plot)
    print(report)
    print("wrote " + ", ".join(paths.values()))
    return paths
