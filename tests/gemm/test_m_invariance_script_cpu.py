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
    points = [{"scheme": "int8", "n": 256, "k": 512, "m": m, "differ": 0, "rows_differ": 0, "max_ulp": 0, "nan": 0,
               "kernel": "decode_gemm"} for m in (1, 16)]
    points += [{"scheme": "fp8-fast", "n": 256, "k": 512, "m": 1, "differ": 7, "rows_differ": 1, "max_ulp": 2,
                "nan": 0, "kernel": "decode_gemm"},
               {"scheme": "fp8-fast", "n": 256, "k": 512, "m": 16, "differ": 0, "rows_differ": 0, "max_ulp": 0,
                "nan": 0, "kernel": "cutlass sm90"}]
    md = inv.render({"device": "GPU X", "torch": "t", "m": [1, 16], "points": points})
    assert "- int8: every M gives the same bits" in md
    assert "- fp8-fast: differs at M = [1]" in md
    assert "| fp8-fast | 256 | 512 | 1 | decode_gemm | 7 | 1 | 2 |" in md
