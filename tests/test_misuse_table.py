"""docs/MISUSE.md stays true: every row is triggered and must raise its exception with its exact message.

The table's rows are `| ID | Misuse | Exception | Message | Checked |`. The message is a code span in which
`{...}` stands for any text; it must match the whole first line of the exception's message. `cpu` rows are
triggered here on every run, `cuda` rows with the `cuda` marker, `2 gpus` rows with two GPUs; each row
needs a trigger and each trigger a row, so neither side can drift.

The rows are read by tests/_misuse_table.py; the triggers are in tests/_misuse_triggers_gemm.py (scaled_mm,
quantizers, W8A8Linear, graphs, decode GEMMs, w8a8_linear), tests/_misuse_triggers_norm_attention.py
(decode_attention, rope_kv_cache_, rms_norm / silu_mul and their quantizing forms) and
tests/_misuse_triggers_api.py (quantize_, W8A8Linear.from_float and its inputs, the checkpoints). DEVICE_TRIGGERS map a
`cpu` row to a function of the device: test_cpu_row runs it with "cpu" (the CPU implementations,
ops/_checks.py), test_row_on_cuda with "cuda" (the C++ checks), and both must raise the row.
"""

from __future__ import annotations

import re

import pytest
import torch

import _misuse_triggers_api as api
import _misuse_triggers_gemm as gemm
import _misuse_triggers_norm_attention as norm_attention
import cutlass_w8a8 as cw
from _misuse_table import BY_ID, CHECKED, DOC, ROWS, assert_row, ids, message_regex


def _merged(*tables: dict) -> dict:
    """One trigger table from the families' tables; a row triggered twice is an error."""
    out: dict = {}
    for table in tables:
        assert not set(out) & set(table), f"rows with two triggers: {sorted(set(out) & set(table))}"
        out.update(table)
    return out


DEVICE_TRIGGERS = _merged(gemm.DEVICE_TRIGGERS, norm_attention.DEVICE_TRIGGERS, api.DEVICE_TRIGGERS)
CPU_TRIGGERS = _merged(gemm.CPU_TRIGGERS, norm_attention.CPU_TRIGGERS, api.CPU_TRIGGERS)
CUDA_TRIGGERS = _merged(gemm.CUDA_TRIGGERS, norm_attention.CUDA_TRIGGERS, api.CUDA_TRIGGERS)
TWO_GPU_TRIGGERS = gemm.TWO_GPU_TRIGGERS

CPU_TRIGGERS.update({row: (lambda f: lambda: f("cpu"))(f) for row, f in DEVICE_TRIGGERS.items()})

TRIGGERS = {"cpu": CPU_TRIGGERS, "cuda": CUDA_TRIGGERS, "2 gpus": TWO_GPU_TRIGGERS, "manual": {}}


# ---- the table itself ---------------------------------------------------------------------------------


def test_table_is_well_formed():
    assert len(ROWS) >= 50
    assert len(BY_ID) == len(ROWS), "duplicate IDs"
    for r in ROWS:
        assert r["checked"] in CHECKED, r
        assert r["exception"] in ("TypeError", "ValueError", "RuntimeError", "NotImplementedError"), r


@pytest.mark.parametrize("checked", ["cpu", "cuda", "2 gpus"])
def test_every_row_has_a_trigger_and_every_trigger_a_row(checked):
    assert sorted(ids(checked)) == sorted(TRIGGERS[checked]), (
        f"rows marked {checked!r} and the triggers differ: "
        f"rows without trigger {sorted(set(ids(checked)) - set(TRIGGERS[checked]))}, "
        f"triggers without row {sorted(set(TRIGGERS[checked]) - set(ids(checked)))}")


def test_messages_name_the_argument():
    """Every argument error names its argument: ours in backticks after `op: ` (or, for a field of a checkpoint's
    config.json, its dotted name and value: `quantization_config.x.y = 'v'`), torch's dispatcher (a value not of
    the schema's type) in quotes after `cutlass_w8a8::op()`."""
    dispatcher = re.compile(r"^cutlass_w8a8::\w+\(\) Expected a value of type '[\w\[\]]+' for argument '\w+' "
                            r"but instead found type \{type\}\.$")
    for r in ROWS:
        if r["message"].startswith("cutlass_w8a8::"):
            assert r["exception"] == "RuntimeError" and dispatcher.match(r["message"]), r
        elif r["exception"] in ("TypeError", "ValueError") and not r["id"].startswith(("graph-", "linear-input")):
            assert re.match(r"^[\w.]+: (`\w+`|quantization_config\.[\w.]+ = )", r["message"]), r


def test_message_regex_is_strict():
    rx = message_regex("scaled_mm: `a` must be [M, K], got {shape}")
    assert rx.fullmatch("scaled_mm: `a` must be [M, K], got (2, 3)")
    assert not rx.fullmatch("scaled_mm: `b` must be [M, K], got (2, 3)")
    assert not rx.fullmatch("xscaled_mm: `a` must be [M, K], got (2, 3)")
    assert not rx.fullmatch("scaled_mm: `a` must be [M, K], got ")


def _source_text() -> str:
    """The package's Python and C++ sources, with adjacent C string literals joined ("a" "b" -> "ab")."""
    root = DOC.parents[1]
    files = [*root.glob("csrc/**/*.cu"), *root.glob("csrc/**/*.cpp"), *root.glob("csrc/**/*.hpp"),
             *root.glob("csrc/**/*.cuh"), *root.glob("cutlass_w8a8/**/*.py")]
    return re.sub(r'"\s*\n\s*"', "", "\n".join(f.read_text(encoding="utf-8") for f in files))


def test_manual_rows_match_the_source():
    """Rows that need a broken build or other hardware: their fixed text is in our sources (torch's own
    dispatcher message excepted)."""
    source = _source_text()
    for r in ROWS:
        if r["checked"] != "manual" or r["message"].startswith("Could not run"):
            continue
        for piece in re.split(r"\{[^{}]*\}", r["message"]):
            if len(piece) >= 6:
                assert piece in source, f"{r['id']}: {piece!r} is not in csrc/ or cutlass_w8a8/"


def test_int8_bound_in_table_is_the_constant():
    assert f"K <= {cw.INT8_MAX_K}" in BY_ID["int8-k-bound"]["message"]


@pytest.mark.parametrize("row_id", ids("cpu"))
def test_cpu_row(row_id):
    assert_row(row_id, CPU_TRIGGERS[row_id])


@pytest.mark.cuda
@pytest.mark.parametrize("row_id", ids("cuda"))
def test_cuda_row(row_id):
    assert_row(row_id, CUDA_TRIGGERS[row_id])


@pytest.mark.cuda
@pytest.mark.parametrize("row_id", ids("2 gpus"))
def test_two_gpu_row(row_id):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    assert_row(row_id, TWO_GPU_TRIGGERS[row_id])


def test_device_triggers_are_cpu_rows():
    assert not set(DEVICE_TRIGGERS) & set(CUDA_TRIGGERS)
    assert {BY_ID[r]["checked"] for r in DEVICE_TRIGGERS} == {"cpu"}


@pytest.mark.cuda
@pytest.mark.parametrize("row_id", sorted(DEVICE_TRIGGERS))
def test_row_on_cuda(row_id):
    """The C++ op raises, on CUDA tensors, the row the CPU implementation raises: one contract, one text."""
    assert_row(row_id, lambda: DEVICE_TRIGGERS[row_id]("cuda"))
