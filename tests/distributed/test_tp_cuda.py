"""Tensor parallelism on two GPUs with NCCL: the parallel layers, the errors every rank must raise, and the
decoder at TP=2 against TP=1 with its CUDA graphs capturing the all-reduces.

Two processes (`cutlass_w8a8.testing.tp.run_workers`, backend NCCL, rank r on cuda:r, ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` set before the process group starts; a 60 s collective timeout, and the
parent kills workers that outlive 480 s, so a hang fails the test instead of the suite). The worker functions are
tests/_tp_scenarios.py's, the same as the CPU tests'; what differs on the GPU:

- Column-parallel outputs equal the full layer's columns up to the GEMM's own order of work (a decode GEMM may split
  K differently for another N): one bf16 ulp plus float32 epilogue rounding, plus for e4m3 the tensor cores'
  accumulation allowance (`cutlass_w8a8.testing.references.fp8_accum_bound`).
- Row-parallel: the NCCL sum of two bf16 partials rounds once, so the output equals the bf16 sum of the two
  partial GEMMs (the same kernel as the layer's) plus the bias bit for bit; against the unsharded layer, the bounds
  of `row_parallel_bound` / `row_parallel_rms_bound` with the fp8 accumulation allowance.
- Decoder (SMALL dimensions, 2 layers, int8 and fp8): ||L2 - Lf|| <= 1.25 ||L1 - Lf|| against the dequantized
  float32 model, as on the CPU (tests/distributed/test_tp_cpu.py explains the criterion); graph replay equals the eager step of
  the same padded batch bit for bit (same kernels, the NCCL all-reduce captured in the graph).

Marked ``cuda``; skipped (when the test runs, not at import) with fewer than 2 CUDA devices.
"""

import re

import pytest
import torch

from cutlass_w8a8.testing.references import fp8_accum_bound, ulp
from cutlass_w8a8.testing.tp import row_parallel_bound, row_parallel_rms_bound, run_workers

import _tp_scenarios as scen
from _tp_scenarios import ERRORS, TP_VS_TP1_ACCURACY, as_fp8, kept_rows, ok_value

pytestmark = pytest.mark.cuda

WORLD = 2
ACCUM = {"int8": 0.0, "fp8": fp8_accum_bound(128)}


@pytest.fixture(scope="module")
def nccl():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    res = run_workers(scen.cuda_cases, WORLD, backend="nccl", timeout_s=480, group_timeout_s=60)
    return [r.value for r in res]


def _mag(d):
    return d["x"].double().abs() @ (as_fp8(d["full_w"]).double() * d["full_s"].double().reshape(-1, 1)).abs().t()


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_column_parallel_matches_the_full_layer(nccl, q):
    for rank in range(WORLD):
        d = ok_value(nccl[rank]["layers"][q])
        if isinstance(d, str):
            pytest.skip(d)
        rows = kept_rows(rank)
        assert torch.equal(d["col_w"], d["full_w"][rows]) and torch.equal(d["col_s"], d["full_s"][rows])
        full = d["full_y"].double()
        mag = _mag(d) + d["full_b"].double().abs()
        for got, ref in ((d["col_y"].double(), full[:, rows]), (d["colg_y"].double(), full)):
            m = mag[:, rows] if ref.shape != full.shape else mag
            bound = (torch.maximum(ulp(got, torch.bfloat16), ulp(ref, torch.bfloat16))
                     + (8 * 2.0**-24 + 2 * ACCUM[q]) * m)
            assert ((got - ref).abs() <= bound).all(), float(((got - ref).abs() - bound).max())


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_row_parallel_nccl_sum_and_bounds(nccl, q):
    d0, d1 = (ok_value(nccl[r]["layers"][q]) for r in range(WORLD))
    if isinstance(d0, str):
        pytest.skip(d0)
    expected = (d0["row_partial"] + d1["row_partial"]) + d0["full_b"]
    for d in (d0, d1):
        assert torch.equal(d["row_y"], expected)
        assert torch.equal(d["row_q_y"], d["row_y"]) and torch.equal(d["row_full_input_y"], d["row_y"])
    w, s, b = as_fp8(d0["full_w"]), d0["full_s"], d0["full_b"]
    diff = (d0["row_y"].double() - d0["full_y"].double()).abs()
    assert (diff <= row_parallel_bound(d0["x"], w, s, WORLD, bias=b, accum_rel=ACCUM[q])).all()
    assert float(diff.norm()) <= row_parallel_rms_bound(d0["x"], w, s, WORLD, bias=b, accum_rel=ACCUM[q])


def test_float_parallel_layers_nccl(nccl):
    for rank in range(WORLD):
        d = ok_value(nccl[rank]["layers"]["float"])
        mag = d["x"].double().abs() @ d["w"].double().abs().t()
        u, k = 2.0**-24, 128
        assert ((d["colg_y"].double() - d["full_y"].double()).abs() <= 2 * k * u * mag).all()
        bound = (k + k // 2 + 1) * u * mag + 2 * u * (mag + d["b"].double().abs())
        assert ((d["row_y"].double() - d["full_y"].double()).abs() <= bound).all()


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_misuse_raises_the_same_error_on_every_rank_nccl(nccl, name):
    got = [nccl[r]["errors"][name] for r in range(WORLD)]
    assert got[0][0] == "error" and got[0][1] == "ValueError" and re.search(ERRORS[name], got[0][2]), got[0]
    assert got[1] == got[0]
    assert [ok_value(nccl[r]["errors"]["group_still_works"]) for r in range(WORLD)] == [3.0, 3.0]


@pytest.mark.parametrize("name", ["int8", "fp8", "int8_replicated_lm_head", "int8_kv1"])
def test_decoder_tp2_vs_tp1_and_graph_replay(nccl, name):
    d = [ok_value(nccl[r]["decoder"][name]) for r in range(WORLD)]
    if isinstance(d[0], str):
        pytest.skip(d[0])
    cfg = scen.SMALL2_KV1 if name == "int8_kv1" else scen.SMALL2
    for r in range(WORLD):
        assert d[r]["same_weights"] and d[r]["use_layer_op"] == [False, False]
        # one key/value head (kv1) is replicated: each rank keeps it
        assert d[r]["heads"] == (cfg.num_heads // WORLD, max(cfg.num_kv_heads // WORLD, 1))
        assert d[r]["lm_head"] == ("Linear" if name == "int8_replicated_lm_head" else "ColumnParallelLinear")
        assert d[r]["graphs"] == 3  # buckets 1, 2, 4 of max_batch 4, each capturing 2 all-reduces per layer
        for graph, eager in zip(d[r]["runner"], d[r]["runner_eager"]):
            assert torch.equal(graph, eager)
    for key in ("tp", "runner"):  # every rank computes the same replicated logits
        assert all(torch.equal(a, b) for a, b in zip(d[0][key], d[1][key]))
    l1, l2, lf = (torch.stack(d[0][k]).double() for k in ("full", "tp", "ref"))
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    assert e1 / float(lf.norm()) < 0.1
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    assert float((l2 - l1).norm()) <= (1 + TP_VS_TP1_ACCURACY) * e1
    # the runner (graphs, batch 3 padded to 4) against the direct TP step: the same model up to kernel choice by M
    lr = torch.stack(d[0]["runner"]).double()
    assert float((lr - lf).norm()) <= TP_VS_TP1_ACCURACY * e1

