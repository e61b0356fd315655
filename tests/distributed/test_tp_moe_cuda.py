"""Tensor parallelism of the MoE experts on two GPUs with NCCL: `TensorParallelW8A8MoE` against the unsharded
`W8A8MoE` (int8, fp8, int8 with static activation scales, block-scaled fp8), the errors every rank must raise.

Two processes (`cutlass_w8a8.testing.tp.run_workers`, backend NCCL, rank r on cuda:r, NVLink multicast off; a 60 s
collective timeout, the parent kills workers that outlive 480 s). The worker functions are
tests/_tp_moe_scenarios.py's, the same as the CPU tests' (tests/distributed/test_tp_moe_cpu.py explains the criteria); on the
GPU:

- the shard's buffers are the full layer's slices bit for bit (sliced on the device);
- the NCCL sum of two bf16 partials rounds once, so the output equals the bf16 sum of the two ranks' partial
  outputs bit for bit (the same kernels as the layer's);
- against the unsharded layer and the float64 model: ||Y2 - Yf|| <= 1.25 ||Y1 - Yf|| (both layers carry the same
  kind of GEMM accumulation error, fp8's included).

Marked ``cuda``; skipped (when the test runs, not at import) with fewer than 2 CUDA devices, and reported as
skipped when the devices are not sm90 (the grouped GEMM's only architecture).
"""

import re

import pytest
import torch

from cutlass_w8a8.testing.tp import run_workers

import _tp_moe_scenarios as scen
from _tp_scenarios import ok_value

pytestmark = pytest.mark.cuda

WORLD = 2


@pytest.fixture(scope="module")
def nccl_moe():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")
    res = run_workers(scen.cuda_moe_cases, WORLD, backend="nccl", timeout_s=480, group_timeout_s=60)
    out = [r.value for r in res]
    if "skip" in out[0]:
        pytest.skip(out[0]["skip"])
    return out


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_shard_buffers_nccl(nccl_moe, name):
    _, block, _, _, i = scen.CASES[name]
    for rank in range(WORLD):
        d = ok_value(nccl_moe[rank][name])
        f, s = d["full"], d["shard"]
        assert d["sizes"] == (i // 2, i, rank, 2)
        rows = scen.w13_rows(i, rank, WORLD)
        assert torch.equal(s["w13"], f["w13"][:, rows])
        assert torch.equal(s["w2"], f["w2"][..., rank * i // 2:(rank + 1) * i // 2])
        if not block:
            assert torch.equal(s["w13_scale"], f["w13_scale"][:, rows]) and torch.equal(s["w2_scale"], f["w2_scale"])


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_output_is_the_nccl_sum_of_the_partials(nccl_moe, name):
    d0, d1 = (ok_value(nccl_moe[r][name]) for r in range(WORLD))
    expected = d0["partial"] + d1["partial"]
    for d in (d0, d1):
        assert torch.equal(d["tp_y"], expected)
    assert torch.equal(d0["tp_yl"], d1["tp_yl"])


@pytest.mark.parametrize("name", sorted(scen.CASES))
def test_sharded_vs_unsharded_against_the_float_model_nccl(nccl_moe, name):
    d = ok_value(nccl_moe[0][name])
    scen.assert_sharded_vs_unsharded(d, scen.float_reference(d))


@pytest.mark.parametrize("name", sorted(scen.MOE_ERRORS))
def test_misuse_raises_the_same_error_on_every_rank_nccl(nccl_moe, name):
    got = [nccl_moe[r]["errors"][name] for r in range(WORLD)]
    assert got[0][0] == "error" and got[0][1] == "ValueError" and re.search(scen.MOE_ERRORS[name], got[0][2]), got[0]
    assert got[1] == got[0]
    assert [ok_value(nccl_moe[r]["group_still_works"]) for r in range(WORLD)] == [3.0, 3.0]
