"""``from_pretrained(tp_group=...)`` of a DeepSeek-V3 native fp8 checkpoint over 2 gloo ranks
(`cutlass_w8a8.testing.tp.run_workers`): the routed experts split over I (`TensorParallelW8A8MoE`), the shared experts,
the dense MLP and the MLA projections q_b / kv_b (column-parallel by heads) and o (row-parallel) split as block-fp8
parallel layers, q_a / kv_a_proj_with_mqa replicated. The checkpoint: tests/_deepseek_checkpoints.py (4 heads of
qk 192 / v 128, so that each rank's q_b / kv_b rows and o columns are whole 128-blocks; experts and shared experts of
I 256: 128 per rank).

What is checked, and why (as tests/checkpoints/test_checkpoints_moe.py's test_from_pretrained_tensor_parallel):

- each rank's buffers are the unsharded load's slices bit for bit: the experts' gate rows and the same up rows of
  every expert, their down columns, and the matching 128-blocks of the scales; the shared experts' and the MLA
  projections' rows / columns and their scale blocks;
- both ranks return the same logits L2; against the float model Lf (the weights dequantized from the files, exact
  activations, float32) they are as accurate as the unsharded load's L1: ||L2 - Lf|| <= 1.25 ||L1 - Lf|| (the TP
  criterion of tests/distributed/test_tp_cpu.py: a row-parallel layer's partial sums are rounded to bf16 before the
  all-reduce, and the down GEMMs' inputs are quantized per rank's 1 x 128 groups, exactly the unsharded groups here,
  so the sharded model's error is no larger in expectation; 25 % for the sampling variation of the rounding noise).

transformers' own plan for DeepSeek-V3 (``DeepseekV3Config.base_model_tp_plan``) splits only the MLPs and experts;
`cutlass_w8a8.distributed.LLAMA_TP_PLAN` (the default) would make o_proj row-parallel with q_b / kv_b replicated,
which DeepSeek's attention cannot run: the plan here names MLA's projections.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.testing.tp import run_workers  # noqa: E402

from _deepseek_checkpoints import VOCAB, file_reference, write_native_deepseek  # noqa: E402
from _tp_scenarios import TP_VS_TP1_ACCURACY  # noqa: E402

WORLD = 2
#: MLA by heads (q_b / kv_b rows, o columns), the dense MLP and the shared experts, lm_head over the vocabulary; the
#: routed experts split over I whatever the plan (`TensorParallelW8A8MoE`).
DEEPSEEK_TP_PLAN = {"q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise", "gate_proj": "colwise",
                    "up_proj": "colwise", "down_proj": "rowwise", "lm_head": "vocab"}
COLWISE = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def tp_worker(rank, world, path, input_ids):
    """One gloo rank: the checkpoint loaded with ``tp_group`` and `DEEPSEEK_TP_PLAN`; its logits, and the buffers
    and class of every quantized layer (e4m3 as uint8: float8 tensors do not pickle across processes on every
    torch)."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cw.from_pretrained(path, tp_group=dist.group.WORLD, tp_plan=DEEPSEEK_TP_PLAN)
    with torch.no_grad():
        logits = model(input_ids).logits
    layers = {}
    for n, m in model.named_modules():
        if isinstance(m, (cw.W8A8Linear, cw.W8A8MoE)):
            layers[n] = {k: _u8(v).clone() for k, v in m.state_dict().items()} | {"cls": type(m).__name__}
    return {"logits": logits, "layers": layers}


@pytest.fixture(scope="module")
def deepseek_tp(tmp_path_factory):
    path = write_native_deepseek(str(tmp_path_factory.mktemp("deepseek_tp") / "native"))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    res = [r.value for r in run_workers(tp_worker, WORLD, args=(path, x), timeout_s=300, group_timeout_s=120)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = cw.checkpoints.from_pretrained(path)
    return path, x, res, full


def test_each_rank_holds_its_slices(deepseek_tp):
    _, _, res, full = deepseek_tp
    for rank in range(WORLD):
        got = res[rank]["layers"]
        assert got["model.layers.1.mlp.experts"]["cls"] == "TensorParallelW8A8MoE"
        for n, m in full.named_modules():
            leaf = n.rpartition(".")[2]
            if isinstance(m, cw.W8A8MoE):
                i, loc = m.intermediate_size, m.intermediate_size // WORLD
                a, b = rank * loc, (rank + 1) * loc
                ab, bb, nb = a // 128, b // 128, i // 128
                assert torch.equal(got[n]["w13"], _u8(torch.cat([m.w13[:, a:b], m.w13[:, i + a:i + b]], 1)))
                assert torch.equal(got[n]["w2"], _u8(m.w2[:, :, a:b].contiguous()))
                s13 = torch.cat([m.w13_scale[:, ab:bb], m.w13_scale[:, nb + ab:nb + bb]], 1)
                assert torch.equal(got[n]["w13_scale"], s13)
                assert torch.equal(got[n]["w2_scale"], m.w2_scale[:, :, ab:bb])
            elif isinstance(m, cw.W8A8Linear):
                w, s = _u8(m.weight), m.weight_scale
                if leaf in COLWISE:
                    loc = m.out_features // WORLD
                    assert got[n]["cls"] == "ColumnParallelW8A8Linear", n
                    want_w, want_s = w[rank * loc:(rank + 1) * loc], s[rank * loc // 128:(rank + 1) * loc // 128]
                elif leaf in ROWWISE:
                    loc = m.in_features // WORLD
                    assert got[n]["cls"] == "RowParallelW8A8Linear", n
                    want_w, want_s = w[:, rank * loc:(rank + 1) * loc], s[:, rank * loc // 128:(rank + 1) * loc // 128]
                else:  # q_a_proj, kv_a_proj_with_mqa
                    assert got[n]["cls"] == "W8A8Linear", n
                    want_w, want_s = w, s
                assert torch.equal(got[n]["weight"], want_w.contiguous()), n
                assert torch.equal(got[n]["weight_scale"], want_s.contiguous()), n
        shared = [n for n in got if ".shared_experts." in n]
        assert sorted(got[n]["cls"] for n in shared) == ["ColumnParallelW8A8Linear"] * 2 + ["RowParallelW8A8Linear"]


def test_logits_agree_across_ranks_and_meet_the_tp_criterion(deepseek_tp):
    path, x, res, full = deepseek_tp
    assert torch.equal(res[0]["logits"], res[1]["logits"])
    with torch.no_grad():
        l1 = full(x).logits.double()
        lf = file_reference(path, full_float32=True, act_quant=False)(x).logits.double()
    l2 = res[0]["logits"].double()
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    print(f"\nDeepSeek-V3 checkpoint TP=2 vs TP=1 (CPU, gloo): ||L2 - Lf|| / ||L1 - Lf|| = {e2 / e1:.3f}, "
          f"||L1 - Lf|| / ||Lf|| = {e1 / float(lf.norm()):.3f}")
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
