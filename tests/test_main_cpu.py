"""``python -m cutlass_w8a8`` without a GPU: the CPU correctness run, and the subcommand dispatch."""

import re
import subprocess
import sys
import types

import pytest
import torch

from cutlass_w8a8 import __main__ as main_job


def test_main_job_cpu_subprocess():
    """The main job as a user runs it: without a CUDA device it is the CPU correctness run by default (with one,
    ``--cpu`` asks for it), says that it measures no timings, and passes its SQNR check."""
    args = ["--cpu"] if torch.cuda.is_available() else []
    res = subprocess.run([sys.executable, "-m", "cutlass_w8a8", *args], capture_output=True, text=True, timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "CPU correctness run" in out and "no timings measured or claimed" in out
    assert "4 linears quantized to int8" in out  # the CPU default: 2 blocks of up + down
    m = re.search(r"W8A8 ([0-9.]+) dB \[ok", out)
    assert m and float(m.group(1)) >= main_job.SQNR_THRESHOLD_DB, out
    assert "median" not in out and "| run |" not in out  # no timing table


def test_main_job_cpu_fp8(capsys):
    assert main_job.main(["--cpu", "--dtype", "fp8", "--layers", "1", "--hidden", "64", "--ffn", "128"]) == 0
    out = capsys.readouterr().out
    assert "2 linears quantized to fp8" in out and "correctness run: passed" in out


def test_main_job_cpu_fails_when_nothing_is_quantized(capsys):
    # hidden 40 is not a multiple of 16: quantize_ leaves the linears in float, the run must not pass
    with pytest.warns(UserWarning, match="multiples of 16"):
        assert main_job.main(["--cpu", "--layers", "1", "--hidden", "40", "--ffn", "64"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_quantize_subcommand_dispatch(monkeypatch):
    """``python -m cutlass_w8a8 quantize ARGS`` calls ``cutlass_w8a8.checkpoints.cli.main(ARGS)``, imported lazily."""
    calls = []
    fake = types.ModuleType("cutlass_w8a8.checkpoints.cli")
    fake.main = lambda argv: calls.append(argv) or 7
    monkeypatch.setitem(sys.modules, "cutlass_w8a8.checkpoints.cli", fake)
    assert main_job.main(["quantize", "src", "dst", "--dtype", "fp8"]) == 7
    assert calls == [["src", "dst", "--dtype", "fp8"]]
