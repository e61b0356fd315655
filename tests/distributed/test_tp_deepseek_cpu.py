"""``from_pretrained(tp_group=...)`` of a DeepSeek-V3 native fp8 checkpoint over 2 gloo ranks
(`cutlass_w8a8.testing.tp.run_workers`) with the default plan (`cutlass_w8a8.distributed.LLAMA_TP_PLAN`): the routed
experts split over I (`TensorParallelW8A8MoE`), the shared experts, the dense MLP and the MLA projections q_b / kv_b
(column-parallel by heads) and o (row-parallel) split as block-fp8 parallel layers, q_a / kv_a_proj_with_mqa
replicated, each attention module's ``num_heads`` halved. The checkpoint: tests/_deepseek_checkpoints.py (4 heads of
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

transformers' own plan for DeepSeek-V3 (``DeepseekV3Config.base_model_tp_plan``, 5.17 and 5.24) splits only the
MLPs and experts; the default plan splits MLA by heads as vLLM does (`cutlass_w8a8.distributed.plan.ATTENTION_LAYOUTS`).
A plan that makes o_proj row-parallel but leaves q_b / kv_b replicated (what the default plan did before it had MLA's
rows) is refused on every rank before anything is read, naming the attention module, instead of failing in forward.

The same split through ``quantize_(model, config, tp_group=...)`` on transformers' tiny DeepSeek-V3 of
tests/_moe_models.py (`tiny_moe_config("deepseek_v3")`: 4 heads, q_lora_rank 128, and q_lora_rank None, where the
queries come from q_proj): int8 per channel and block fp8; the logits of both ranks are equal and meet the TP
criterion above against the 1-rank model, the reference being that model's dequantized weights in float32 with exact
activations.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.testing.tp import run_workers  # noqa: E402

from _deepseek_checkpoints import VOCAB, file_reference, write_native_deepseek  # noqa: E402
from _moe_models import pin_routing  # noqa: E402
from _tp_scenarios import TP_VS_TP1_ACCURACY, _ReadLog  # noqa: E402

WORLD = 2
HEADS = 4  # the checkpoint's num_attention_heads
#: The leaves the default plan splits in this model (the routed experts split over I whatever the plan).
COLWISE = ("q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
#: The plan the default had for MLA before its rows for q_b / kv_b: o_proj row-parallel, q_b / kv_b replicated.
PLAN_WITHOUT_MLA_ROWS = {"q_proj": "colwise", "o_proj": "rowwise", "gate_proj": "colwise", "up_proj": "colwise",
                         "down_proj": "rowwise", "lm_head": "vocab"}


def _u8(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def tp_worker(rank, world, path, input_ids):
    """One gloo rank: the checkpoint loaded with ``tp_group`` and the default plan; its logits, the buffers and class
    of every quantized layer (e4m3 as uint8: float8 tensors do not pickle across processes on every torch), and the
    attention modules' ``num_heads``. Then the load with `PLAN_WITHOUT_MLA_ROWS`: the exception it raises (with the
    safetensors reads it made before: `_tp_scenarios._ReadLog`)."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cw.from_pretrained(path, tp_group=dist.group.WORLD)
    with torch.no_grad():
        logits = model(input_ids).logits
    layers = {}
    for n, m in model.named_modules():
        if isinstance(m, (cw.W8A8Linear, cw.W8A8MoE)):
            layers[n] = {k: _u8(v).clone() for k, v in m.state_dict().items()} | {"cls": type(m).__name__}
    heads = [m.num_heads for n, m in model.named_modules() if n.endswith("self_attn")]
    log = _ReadLog()
    try:
        cw.from_pretrained(path, tp_group=dist.group.WORLD, tp_plan=PLAN_WITHOUT_MLA_ROWS)
        refused = None
    except Exception as e:  # noqa: BLE001 (recorded for the test)
        refused = (type(e).__name__, str(e))
    finally:
        log.close()
    return {"logits": logits, "layers": layers, "heads": heads, "refused": refused, "reads": log.reads}


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
        assert res[rank]["heads"] == [HEADS // WORLD] * 2  # each layer's attention: its local heads


def test_attention_split_inconsistently_is_refused_before_any_read(deepseek_tp):
    """The plan without MLA's rows (o_proj row-parallel, q_b / kv_b replicated) raises the same ValueError on both
    ranks, naming the first attention module and the projections that would have to be column-parallel, and reads no
    tensor before."""
    _, _, res, _ = deepseek_tp
    for rank in range(WORLD):
        kind, msg = res[rank]["refused"]
        assert kind == "ValueError" and res[rank]["refused"] == res[0]["refused"]
        assert msg.startswith("cutlass_w8a8.from_pretrained(tp_group=...): 'model.layers.0.self_attn' (multi-head "
                              "latent attention, DeepseekV3Attention): `tp_plan` makes `o_proj` row-parallel"), msg
        assert "`q_b_proj`, `kv_b_proj` are not column-parallel" in msg, msg
        assert res[rank]["reads"] == [], res[rank]["reads"][:3]


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


# ---- quantize_(tp_group=...) on transformers' tiny DeepSeek-V3 --------------------------------------------------

#: name: (W8A8Config keywords, config overrides of `tiny_moe_model`). Block fp8 needs every shard whole 128-blocks:
#: the experts' and shared experts' I 256 (128 per rank) instead of the tiny model's 128.
QUANTIZE_CASES = {
    "int8": ({}, {}),
    "int8, q_proj (q_lora_rank None)": ({}, {"q_lora_rank": None}),
    "fp8 block": ({"dtype": torch.float8_e4m3fn, "weight_block_size": (128, 128)}, {"moe_intermediate_size": 256}),
}
#: The classes of MLA's projections after the split, with q_lora_rank (queries through q_a / q_b) and without (q_proj).
MLA_SPLIT = {"kv_b_proj": "ColumnParallelW8A8Linear", "o_proj": "RowParallelW8A8Linear",
             "kv_a_proj_with_mqa": "W8A8Linear"}
MLA_QUERIES = {True: {"q_b_proj": "ColumnParallelW8A8Linear", "q_a_proj": "W8A8Linear"},
               False: {"q_proj": "ColumnParallelW8A8Linear"}}


def _quantized(name, tp_group=None):
    """The tiny DeepSeek-V3 of case ``name`` quantized (lm_head left in float) with ``quantize_``, sharded over
    ``tp_group`` when given (the default plan)."""
    from _moe_models import tiny_moe_model

    cfg, overrides = QUANTIZE_CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cw.quantize_(tiny_moe_model("deepseek_v3", seed=0, **overrides), cw.W8A8Config(**cfg),
                            filter_fn=lambda m, fqn: fqn != "lm_head", tp_group=tp_group)


def quantize_worker(rank, world, input_ids):
    """One gloo rank: each case's model quantized with ``tp_group``; its logits, the classes of the first layer's
    attention projections, and every attention module's ``num_heads``. Then ``tensor_parallel_`` of the quantized
    int8 model with `PLAN_WITHOUT_MLA_ROWS`: the exception, and the classes of the layers it would have split."""
    import torch.distributed as dist

    model = _quantized("int8")
    try:
        cw.tensor_parallel_(model, dist.group.WORLD, PLAN_WITHOUT_MLA_ROWS)
        refused = None
    except Exception as e:  # noqa: BLE001 (recorded for the test)
        refused = (type(e).__name__, str(e))
    out = {"refused": refused, "after refusal": sorted({type(m).__name__ for m in model.modules()
                                                        if isinstance(m, (cw.W8A8Linear, cw.W8A8MoE))})}
    from _moe_models import record_routing

    for name in QUANTIZE_CASES:
        model = _quantized(name, dist.group.WORLD)
        routing, unhook = record_routing(model)
        with torch.no_grad():
            logits = model(input_ids).logits
        unhook()
        attn = model.model.layers[0].self_attn
        out[name] = {"logits": logits, "heads": [layer.self_attn.num_heads for layer in model.model.layers],
                     "classes": {leaf: type(m).__name__ for leaf, m in attn.named_children()
                                 if isinstance(m, (torch.nn.Linear, cw.W8A8Linear))},
                     "routing": routing}
    return out


class _ExactExperts(torch.nn.Module):
    """A `W8A8MoE`'s dequantized weights in float32 with exact activations, called as transformers' experts
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``: sum_j w_j down_e(silu(gate_e x) * up_e x)."""

    def __init__(self, layer):
        super().__init__()
        from _moe_models import dequantize_experts

        self.register_buffer("w13", dequantize_experts(layer.w13, layer.w13_scale, torch.float32))
        self.register_buffer("w2", dequantize_experts(layer.w2, layer.w2_scale, torch.float32))

    def forward(self, x, ids, w):
        out = torch.zeros(x.shape[0], self.w2.shape[1], dtype=torch.float32)
        for j in range(ids.shape[1]):
            gate, up = torch.einsum("tnh,th->tn", self.w13[ids[:, j]], x.float()).chunk(2, -1)
            out += w[:, j, None].float() * torch.einsum("thi,ti->th", self.w2[ids[:, j]], F.silu(gate) * up)
        return out.to(x.dtype)


def _exact_float_model(model):
    """A float32 copy of the quantized, unsharded ``model``: each `W8A8Linear` an ``nn.Linear`` holding its weight
    times its scale (per channel, or per 128 x 128 block), each `W8A8MoE` an `_ExactExperts`; exact activations. What
    both the 1-rank and the 2-rank quantized model approximate."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, cw.W8A8MoE):
            new = _ExactExperts(m)
        elif isinstance(m, cw.W8A8Linear):
            n, k = m.weight.shape
            s = m.weight_scale.float()
            s = (s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] if m.weight_block_size is not None
                 else s.reshape(-1, 1))
            new = torch.nn.Linear(k, n, bias=m.bias is not None, dtype=torch.float32)
            with torch.no_grad():
                new.weight.copy_(m.weight.float() * s)
                if m.bias is not None:
                    new.bias.copy_(m.bias.float())
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child, new)
    return ref.to(torch.float32).eval()


@pytest.fixture(scope="module")
def quantize_tp():
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    res = [r.value for r in run_workers(quantize_worker, WORLD, args=(x,), timeout_s=300, group_timeout_s=120)]
    return x, res


def test_tensor_parallel_refuses_an_inconsistent_attention_split(quantize_tp):
    """``tensor_parallel_`` with `PLAN_WITHOUT_MLA_ROWS` raises the same ValueError on both ranks, naming the module,
    before it shards anything: the model's layers are all still unsharded W8A8Linear / W8A8MoE."""
    _, res = quantize_tp
    for rank in range(WORLD):
        kind, msg = res[rank]["refused"]
        assert kind == "ValueError" and res[rank]["refused"] == res[0]["refused"]
        assert msg.startswith("tensor_parallel_: 'model.layers.0.self_attn' (multi-head latent attention, "
                              "DeepseekV3Attention): `tp_plan` makes `o_proj` row-parallel"), msg
        assert res[rank]["after refusal"] == ["W8A8Linear", "W8A8MoE"]


@pytest.mark.parametrize("name", sorted(QUANTIZE_CASES))
def test_quantize_tp_default_plan_matches_one_rank(quantize_tp, name):
    """``quantize_(model, config, tp_group=...)`` with the default plan: MLA split by heads (q_b / kv_b, or q_proj,
    column-parallel, o_proj row-parallel, the latents replicated, ``num_heads`` 4 -> 2), both ranks' logits equal,
    and the TP criterion against the 1-rank model: ||L2 - Lf|| <= 1.25 ||L1 - Lf|| (Lf: `_exact_float_model`), hence
    ||L2 - L1|| <= 2.25 ||L1 - Lf||; ||L1 - Lf|| / ||Lf|| < 0.1 shows Lf is the right reference. L1 and Lf are routed
    as the 2-rank model was (`pin_routing`): the criterion compares the numerics of the split; a top-k near-tie that
    the ranks' other rounding flips moves a token by a whole expert and decided it otherwise (measured on an H200
    machine's CPU: ratio 1.49 unpinned, where this machine's CPU gave 1.10)."""
    x, res = quantize_tp
    d = [res[r][name] for r in range(WORLD)]
    q_lora = QUANTIZE_CASES[name][1].get("q_lora_rank", 128) is not None
    assert d[0]["classes"] == MLA_SPLIT | MLA_QUERIES[q_lora]
    assert d[0]["heads"] == [2, 2]
    assert torch.equal(d[0]["logits"], d[1]["logits"])
    full = _quantized(name)
    exact = _exact_float_model(full)
    unpin = [pin_routing(m, d[0]["routing"]) for m in (full, exact)]
    with torch.no_grad():
        l1 = full(x).logits.double()
        lf = exact(x).logits.double()
    for u in unpin:
        u()
    l2 = d[0]["logits"].double()
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    print(f"\ntiny DeepSeek-V3 quantize_ {name}, TP=2 vs TP=1 (CPU, gloo): ||L2 - Lf|| / ||L1 - Lf|| = {e2 / e1:.3f}, "
          f"||L1 - Lf|| / ||Lf|| = {e1 / float(lf.norm()):.4f}")
    assert e1 / float(lf.norm()) < 0.1
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    assert float((l2 - l1).norm()) <= (1 + TP_VS_TP1_ACCURACY) * e1
