"""How a tensor-parallel plan splits attention modules (`cutlass_w8a8.distributed.plan.attention_splits`, one process,
no process group): each attention module of transformers' tiny models is checked against its row of
`ATTENTION_LAYOUTS` and the plan, and a plan or a module that cannot be split by heads is refused naming the module
and the projection or attribute, before anything is sharded (the gloo runs of tests/distributed/test_tp_deepseek_cpu.py
check that the refusal reaches both entries, ``tensor_parallel_`` and ``from_pretrained(tp_group=...)``, on every
rank, and that the default plan's split computes the model).

The models: tests/_moe_models.py's tiny DeepSeek-V3 (multi-head latent attention, 4 heads; q_lora_rank 128: q_a /
q_b, or None: q_proj) and tests/_checkpoints.py's tiny Llama (4 heads, 2 key/value heads).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from cutlass_w8a8.distributed.plan import (ATTENTION_LAYOUTS, LLAMA_TP_PLAN, attention_splits,  # noqa: E402
                                           match_plan, set_attention_heads_)

from _checkpoints import tiny_model  # noqa: E402
from _moe_models import tiny_moe_model  # noqa: E402

WORLD = 2
WHERE = "tensor_parallel_"
MLA, MHA = ATTENTION_LAYOUTS[0], ATTENTION_LAYOUTS[1]
ATTN0 = "'model.layers.0.self_attn'"


def _deepseek(**overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_moe_model("deepseek_v3", seed=0, **overrides)


def _styles(model, plan):
    """``{fqn: style}`` of the linears ``plan`` names, as `tensor_parallel_` builds it."""
    out = {}
    for fqn, m in model.named_modules():
        spec = match_plan(fqn, plan) if fqn else None
        if spec is not None and type(m) is nn.Linear:
            out[fqn] = spec[0]
    return out


def _splits(model, plan, world=WORLD):
    return attention_splits(model, _styles(model, plan), world, WHERE)


def _refused(model, plan, *fragments, world=WORLD):
    with pytest.raises(ValueError) as info:
        _splits(model, plan, world)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


@pytest.mark.parametrize("q_lora_rank", [128, None])
def test_default_plan_splits_mla_by_heads(q_lora_rank):
    """The default plan: every MLA module is split (its layout the MLA row), q_b / kv_b (or q_proj) column-parallel,
    o_proj row-parallel, the latents q_a / kv_a_proj_with_mqa not planned; after the shard its num_heads is H / world
    (and num_key_value_groups, H / KVH = 1, unchanged)."""
    model = _deepseek(q_lora_rank=q_lora_rank)
    styles = _styles(model, LLAMA_TP_PLAN)
    pre = "model.layers.0.self_attn."
    queries = {"q_b_proj": "colwise"} if q_lora_rank else {"q_proj": "colwise"}
    assert {k[len(pre):]: v for k, v in styles.items() if k.startswith(pre)} == {
        **queries, "kv_b_proj": "colwise", "o_proj": "rowwise"}
    splits = attention_splits(model, styles, WORLD, WHERE)
    attns = [layer.self_attn for layer in model.model.layers]
    assert [m for m, _ in splits] == attns and all(lay is MLA for _, lay in splits)
    set_attention_heads_(model, splits, (4, 4, 64), WORLD, 1)
    assert [(a.num_heads, a.num_key_value_groups) for a in attns] == [(2, 1), (2, 1)]


def test_default_plan_splits_llama_attention():
    model = tiny_model("llama")
    splits = _splits(model, LLAMA_TP_PLAN)
    assert len(splits) == 2 and all(lay is MHA for _, lay in splits)


def test_attention_left_out_of_the_plan_stays_replicated():
    assert _splits(_deepseek(), {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}) == []
    assert _splits(tiny_model("llama"), {"lm_head": "vocab"}) == []


def test_o_proj_row_parallel_with_q_b_kv_b_replicated_is_refused():
    """The plan the default was before its MLA rows: o_proj row-parallel, q_b / kv_b replicated (the shape error in
    RowParallelW8A8Linear's forward it gave)."""
    plan = {k: v for k, v in LLAMA_TP_PLAN.items() if k not in ("q_b_proj", "kv_b_proj")}
    _refused(_deepseek(), plan, f"{WHERE}: {ATTN0} (multi-head latent attention, DeepseekV3Attention): `tp_plan` "
             "makes `o_proj` row-parallel, so its heads are split, but `q_b_proj`, `kv_b_proj` are not "
             "column-parallel: each of q_b_proj, kv_b_proj must be 'colwise'")
    # without q_lora_rank the queries come from q_proj: q_proj alone replicated is named
    _refused(_deepseek(q_lora_rank=None), {k: v for k, v in LLAMA_TP_PLAN.items() if k != "q_proj"},
             f"{ATTN0} (multi-head latent attention", "but `q_proj` is not column-parallel")


def test_heads_split_without_o_proj_row_parallel_is_refused():
    _refused(_deepseek(), {"q_b_proj": "colwise", "kv_b_proj": "colwise"},
             f"{ATTN0} (multi-head latent attention", "`tp_plan` shards `q_b_proj` 'colwise', `kv_b_proj` 'colwise' "
             "but makes `o_proj` replicated: an attention is split by heads, `o_proj` (which takes the heads' outputs) "
             "'rowwise', or left out of the plan")
    _refused(tiny_model("llama"), {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "colwise"},
             f"{ATTN0} (multi-head attention, LlamaAttention)", "but makes `o_proj` colwise")
    # an MLP-only plan whose pattern also matches a linear of the attention (AFMoE's per-head gate_proj)
    model = tiny_model("llama")
    model.model.layers[0].self_attn.gate_proj = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    _refused(model, {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"},
             f"{ATTN0} (multi-head attention, LlamaAttention): `tp_plan` shards `gate_proj` 'colwise' but makes "
             "`o_proj` replicated")


@pytest.mark.parametrize("latent", ["q_a_proj", "kv_a_proj_with_mqa"])
def test_a_sharded_latent_is_refused(latent):
    """The low-rank latents are read by every head: a plan that shards one is refused, whatever else it says."""
    _refused(_deepseek(), {**LLAMA_TP_PLAN, latent: "colwise"},
             f"{ATTN0} (multi-head latent attention", f"`{latent}`'s output is read by every head, so it must stay "
             "replicated, but `tp_plan` makes it 'colwise'")
    _refused(_deepseek(), {latent: "rowwise"}, f"`{latent}`'s output is read by every head")


def test_num_heads_not_divisible_by_the_world_is_refused():
    _refused(_deepseek(), LLAMA_TP_PLAN, f"{ATTN0} (multi-head latent attention",
             "`num_heads` = 4 is not divisible by the tensor-parallel world size 3", world=3)


def test_an_unplanned_linear_of_a_split_attention_is_refused():
    """A linear child the layout does not know (a per-head output gate, as Laguna's g_proj) is refused when it is
    replicated while the heads are split; once the plan names it, the plan decides."""
    model = tiny_model("llama")
    model.model.layers[1].self_attn.g_proj = nn.Linear(64, 4, bias=False, dtype=torch.bfloat16)
    _refused(model, LLAMA_TP_PLAN, "'model.layers.1.self_attn' (multi-head attention, LlamaAttention): its heads are "
             "split but `g_proj` is in no row of `tp_plan` and no role of the multi-head attention layout")
    assert len(_splits(model, {**LLAMA_TP_PLAN, "g_proj": "colwise"})) == 2


def test_a_split_attention_with_parameters_of_its_own_is_refused():
    """Parameters held by the attention module itself (attention sinks: one per head) are not split: refused."""
    model = tiny_model("llama")
    model.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    msg = _refused(model, LLAMA_TP_PLAN, f"{ATTN0} (multi-head attention, LlamaAttention): its heads are split but it "
                   "holds parameters of its own (`sinks`)")
    assert re.search(r"leave the attention out of `tp_plan`$", msg)
    assert _splits(model, {"lm_head": "vocab"}) == []  # replicated, it is fine
