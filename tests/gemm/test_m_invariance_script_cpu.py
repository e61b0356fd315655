"""scripts/m_invariance.py (issue 37's "same result at every M" measurement) without a GPU: its arguments, its
refusal to run without one, and its report from a synthetic result."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "m_invariance.py"


@pytest.fixture(scope="module")
def inv():
    spec = importlib.util.spec_from_file_location("m_invariance", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_arguments(inv):
    args = inv.parse_args(["--m", "16,1,8", "--shapes", "256x512", "--schemes", "int8,block"])
    assert args.m_list == [1, 8, 16] and args.shape_list == [(256, 512)] and args.scheme_list == ["int8", "block"]
    for bad in (["--m", "0"], ["--m", "x"], ["--shapes", "100x128"], ["--shapes", "256x100"], ["--schemes", "fp4"]):
        with pytest.raises(SystemExit):
            inv.parse_args(bad)


def test_needs_a_gpu(inv, monkeypatch, capsys):
    monkeypatch.setattr(inv.torch.cuda, "is_available", lambda: False)
    assert inv.main(["--m", "1,2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_report(inv):
    """Both comparisons: against the largest M (across families) and against the largest M of the row's own family
    (decode: M <= decode_gemm_max_m(); cutlass above)."""
    def point(scheme, m, differ, fam, ref_m, class_differ, kernel):
        return {"scheme": scheme, "n": 256, "k": 512, "m": m, "differ": differ, "rows_differ": min(differ, 1),
                "max_ulp": 2 if differ else 0, "nan": 0, "kernel": kernel, "class": fam, "class_ref_m": ref_m,
                "class_differ": class_differ, "class_max_ulp": 1 if class_differ else 0}
    points = [point("int8", m, 0, "decode" if m <= 8 else "cutlass", 8 if m <= 8 else 16, 0,
                    "decode_gemm" if m <= 8 else "cutlass sm90") for m in (1, 8, 16)]
    points += [point("fp8-fast", 1, 7, "decode", 8, 0, "decode_gemm"),
               point("fp8-fast", 8, 9, "decode", 8, 0, "decode_gemm"),
               point("fp8-fast", 16, 0, "cutlass", 16, 0, "cutlass sm90"),
               point("block", 1, 5, "decode", 8, 3, "decode_gemm"),
               point("block", 8, 4, "decode", 8, 0, "decode_gemm"),
               point("block", 16, 0, "cutlass", 16, 0, "cutlass blockwise")]
    md = inv.render({"device": "GPU X", "torch": "t", "m": [1, 8, 16], "decode_gemm_max_m": 8, "points": points})
    assert "- int8: every M gives the same bits" in md
    assert "- fp8-fast: differs at M = [1, 8]" in md
    assert "  - decode family: the same bits at every M of the family" in md
    assert "  - decode family: differs from its largest M at M = [1]" in md  # block's
    assert "  - cutlass family: the same bits at every M of the family" in md
    assert "| fp8-fast | 256 | 512 | 1 | decode_gemm | 7 | 1 | 2 | decode | 8 | 0 | 0 |" in md
    assert "| block | 256 | 512 | 1 | decode_gemm | 5 | 1 | 2 | decode | 8 | 3 | 1 |" in md
    assert "decode_gemm_max_m() = 8" in md
