"""scripts/sanitize.py on the CPU: its cases (cutlass_w8a8.testing.sanitize_cases) run on the CPU implementations,
every op of the schema (cutlass_w8a8/ops/_schema.py) is named by a case and called by it, a case that skips an op it
names or whose check fails fails the run, and the harness reads compute-sanitizer's reports into one line per tool.
compute-sanitizer itself needs a GPU (scripts/gpu_run.sh OUT reuse,sanitize)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import time

import pytest
import torch

from cutlass_w8a8.ops._schema import OPS
from cutlass_w8a8.testing import sanitize_cases as sc

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sanitize.py"
Q = torch.ops.cutlass_w8a8


@pytest.fixture
def one_thread():
    """The cases' CPU work is many small ops, where torch's intra-op pool only adds waiting (on a loaded 2-core
    machine the whole driver took 64 s with the default pool, 3.4 s with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("sanitize_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- coverage -----------------------------------------------------------------------------------------------


def test_every_schema_op_is_named_by_a_case():
    assert sc.coverage_errors() == []
    named = {op for c in sc.CASES for op in c.ops}
    assert set(OPS) - set(sc.NOT_DRIVEN) <= named
    assert len({c.name for c in sc.CASES}) == len(sc.CASES), "case names must be unique"


def test_coverage_errors_name_what_is_missing():
    errors = sc.coverage_errors(schema=list(OPS) + ["new_op"])
    assert len(errors) == 1 and "new_op" in errors[0] and "NOT_DRIVEN" in errors[0]
    without_align = [c for c in sc.CASES if "moe_align" not in c.ops]
    assert any("moe_align" in e for e in sc.coverage_errors(cases=without_align))
    typo = sc.Case("typo", ("moe_algn",), lambda ctx: None)
    assert any("moe_algn" in e for e in sc.coverage_errors(cases=[*sc.CASES, typo]))
    # an op listed as not driven that a case drives, or that the schema lacks, is a stale entry
    assert any("moe_align" in e for e in sc.coverage_errors(not_driven={"moe_align": "no kernel"}))
    assert any("gone_op" in e for e in sc.coverage_errors(not_driven={"gone_op": "no kernel"}))
    # an op without CUDA work may be excluded, with its reason
    assert sc.coverage_errors(cases=without_align, not_driven={"moe_align": "no kernel"}) == []


# ---- the cases on the CPU -----------------------------------------------------------------------------------


def test_every_case_runs_and_passes_on_the_cpu(one_thread):
    """The whole driver, --quick's selection with a short M sweep: every case ok, every schema op called on the CPU
    but the CUDA-only ones."""
    lines = []
    rc = sc.run_driver(sc.Ctx("cpu", quick=True, ms=(1, 24, 100)), out=lines.append)
    report = "\n".join(lines)
    assert rc == 0, report
    assert lines[-1].startswith(f"DRIVER OK: {len(sc.CASES)} cases"), report
    assert sum(ln.startswith("case ") and ": ok (" in ln for ln in lines) == len(sc.CASES), report
    assert "_graph_update_scaled_mm: CUDA only, not called" in report


def test_a_case_that_does_not_call_an_op_it_names_fails():
    def run(ctx):
        Q.moe_align(ctx.to(torch.zeros(2, 1, dtype=torch.int32)), 4)

    r = sc.run_case(sc.Case("claims_too_much", ("moe_align", "moe_unpermute"), run), sc.Ctx("cpu"))
    assert r.status == "FAILED" and "moe_unpermute" in r.failures[-1] and "moe_align" not in r.failures[-1]
    # an op called on the wrong device (here: only the host reference) does not count either
    r = sc.run_case(sc.Case("host_only", ("moe_align",), lambda ctx: Q.moe_align(torch.zeros(2, 1, dtype=torch.int32),
                                                                                 4)), sc.Ctx("meta"))
    assert r.status == "FAILED" and "moe_align" in r.failures[-1]


def test_a_failed_check_fails_its_case_and_the_run():
    def run(ctx):
        with ctx.sub("an off-by-one silu_mul"):
            y = Q.silu_mul(ctx.to(torch.ones(2, 32)))
            sc.check_equal(y + 1, Q.silu_mul(torch.ones(2, 32)), "silu_mul")
        with ctx.sub("a good one"):
            sc.check_equal(Q.silu_mul(ctx.to(torch.ones(2, 32))), Q.silu_mul(torch.ones(2, 32)), "silu_mul")

    r = sc.run_case(sc.Case("bad", ("silu_mul",), run), sc.Ctx("cpu"))
    assert r.status == "FAILED" and r.checks == 2 and len(r.failures) == 1
    assert r.failures[0].startswith("an off-by-one silu_mul: AssertionError")
    assert "FAILED" in r.line() and "an off-by-one silu_mul" in r.line()


def test_checks_catch_unwritten_and_wrong_outputs():
    a = torch.randint(-128, 128, (4, 32), dtype=torch.int8)
    w = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    sa, sb = torch.full((4, 1), 1e-3), torch.full((16,), 1e-3)
    out = Q.scaled_mm(a, w.t(), sa, sb, torch.bfloat16)
    sc.check_gemm(out, a, w.t(), sa, sb, None, "right")
    holed = out.clone()
    holed[1, 3] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        sc.check_gemm(holed, a, w.t(), sa, sb, None, "unwritten")
    with pytest.raises(AssertionError, match="out of tolerance"):
        sc.check_gemm(out * 1.01, a, w.t(), sa, sb, None, "wrong")
    ref = torch.randn(64, 64)
    with pytest.raises(AssertionError, match="relative error"):
        sc.check_loose(ref * (1 + 2 * sc.LOOSE_REL), ref, "loose")
    with pytest.raises(AssertionError, match="non-finite"):
        sc.check_loose(torch.full((2, 2), float("inf")), ref[:2, :2], "inf")


def test_groups_and_selection():
    graphs = sc.select_cases("graphs")
    assert graphs and all(c.graphs for c in graphs)
    assert not any(c.graphs for c in sc.select_cases("eager"))
    assert len(sc.select_cases("eager")) + len(graphs) == len(sc.CASES)
    assert [c.name for c in sc.select_cases("all", "^moe_align$")] == ["moe_align"]
    with pytest.raises(ValueError, match="group"):
        sc.select_cases("some")


# ---- the harness ---------------------------------------------------------------------------------------------


def test_device_cpu_runs_the_cases_without_the_sanitizer(script, capsys, one_thread):
    assert script.main(["--device", "cpu", "--quick", "--cases", "^(moe_align|rope_kv_cache)$",
                        "--sanitizer", "/nonexistent/compute-sanitizer"]) == 0
    out = capsys.readouterr().out
    assert "case moe_align: ok" in out and "DRIVER OK: 2 cases" in out


def test_missing_compute_sanitizer_is_a_clear_error(script, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for var in ("CUDA_HOME", "CUDA_PATH", "COMPUTE_SANITIZER"):
        monkeypatch.delenv(var, raising=False)
    assert script.main(["--tools", "memcheck", "--sanitizer", "compute-sanitizer-missing"]) == 2
    err = capsys.readouterr().err
    assert "compute-sanitizer not found" in err and "--device cpu" in err


def test_dry_run_commands(script, capsys):
    assert script.main(["--dry-run", "--sanitizer", "/x/compute-sanitizer", "--jobs", "2",
                        "--quick-tools", "racecheck"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 8  # 4 tools x (eager, graphs)
    for line in lines:
        tool, group = line.split(":")[0].split()
        assert f"--tool {tool} " in line and f"--group {group} " in line
        assert ("PYTORCH_NO_CUDA_MEMORY_CACHING=1" in line) == (group == "eager")
        assert ("--quick" in line) == (tool == "racecheck")
        assert ("--prefill-outputs" in line) == (tool == "initcheck")


def _report(driver_line, summary, finding=None):
    lines = ["case x: ok (3 checks, 3 op calls, 1.0 s)"]
    if finding:
        lines += [f"========= {finding[0]}"] + [f"=========     {d}" for d in finding[1:]]
    lines += [driver_line, f"========= {summary}"] if driver_line else [f"========= {summary}"]
    return "\n".join(lines) + "\n"


def _runs(script, *texts):
    runs = []
    for group, text in zip(("eager", "graphs"), texts):
        r = script.parse_report(text)
        r.update(group=group, rc=0, seconds=10.0, log=f"{group}.log")
        runs.append(r)
    return runs


def test_summary_line_counts_cases_and_errors(script):
    runs = _runs(script, _report("DRIVER OK: 21 cases, 395 op calls on cuda", "ERROR SUMMARY: 0 errors"),
                 _report("DRIVER OK: 3 cases, 80 op calls on cuda", "ERROR SUMMARY: 0 errors"))
    clean, line = script.tool_summary("memcheck", runs)
    assert clean and line.startswith("memcheck: 24 cases, 0 errors (ours 0, elsewhere 0); drivers ok")
    assert runs[0]["case_seconds"] == {"x": 1.0}  # per-case times, for the slowest-cases note

    race = ["Error: Race reported between Write access at 0x50 in void cutlass_w8a8::(anonymous namespace)::"
            "rowwise_regs_kernel<Op>(Params)", "and Read access at 0x90 in the same kernel"]
    runs = _runs(script, _report("DRIVER OK: 21 cases, 200 op calls on cuda",
                                 "RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)", race),
                 _report("DRIVER OK: 3 cases, 80 op calls on cuda", "RACECHECK SUMMARY: 0 hazards displayed "
                         "(0 errors, 0 warnings)"))
    clean, line = script.tool_summary("racecheck", runs)
    assert not clean and line.startswith("racecheck: 24 cases, 1 errors (ours 1, elsewhere 0)")
    assert "NOT CLEAN" in line
    assert script.tool_summary("racecheck", runs, fail_on="ours")[0] is False


def test_summary_line_when_a_driver_fails_or_a_tool_dies(script):
    runs = _runs(script, _report("DRIVER FAILED: 1 of 21 cases failed (grouped_scaled_mm)", "ERROR SUMMARY: 0 errors"),
                 _report("DRIVER OK: 3 cases, 80 op calls on cuda", "ERROR SUMMARY: 0 errors"))
    clean, line = script.tool_summary("memcheck", runs)
    assert not clean and "driver FAILED (eager)" in line
    timed_out = _runs(script, "case x: ok\n", _report("DRIVER OK: 3 cases, 80 op calls on cuda",
                                                      "ERROR SUMMARY: 0 errors"))
    clean, line = script.tool_summary("initcheck", timed_out)
    assert not clean and "no summary from eager" in line
    # errors elsewhere (torch's kernels) count unless --fail-on ours
    other = ["Uninitialized __global__ memory read of size 4 bytes", "at 0x10 in void at::native::copy_kernel"]
    runs = _runs(script, _report("DRIVER OK: 21 cases, 395 op calls on cuda", "ERROR SUMMARY: 1 error", other),
                 _report("DRIVER OK: 3 cases, 80 op calls on cuda", "ERROR SUMMARY: 0 errors"))
    assert script.tool_summary("initcheck", runs)[0] is False
    assert script.tool_summary("initcheck", runs, fail_on="ours")[0] is True


def test_a_tool_past_its_timeout_is_killed_with_its_driver(script, tmp_path):
    """The sanitizer and the driver it started are one process group: both go at the timeout, and the run reads as
    no summary."""
    marker = tmp_path / "child_alive"
    cmd = ["bash", "-c", f"(sleep 3; touch {marker}) & sleep 30"]
    t0 = time.time()
    _, rc = script.run_killable(cmd, dict(os.environ), 1.0)
    assert rc is None and time.time() - t0 < 10
    time.sleep(3.5)
    assert not marker.exists(), "the sanitizer's child survived the timeout"
