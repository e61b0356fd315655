"""The MoE family table (`cutlass_w8a8.moe.families.FAMILIES`), row by row, on the CPU: each test is parametrized
over the rows, so a new family is a row there and its tiny config in tests/_moe_models.py (`tiny_moe_config`, keyed
by the row's ``model_type``), nothing more.

For each row, on a tiny random model built from transformers' own config class:

- the row's facts are transformers': its block and experts classes are defined by
  ``transformers.models.<model_type>.modeling_<model_type>`` and are the model's; the experts hold the row's fused
  parameters ``[E, 2I, H]`` / ``[E, H, I]``; the router holds the attributes the routing spec names; the shared
  experts are where the row says; transformers' own ``save_pretrained`` writes the experts under the row's
  per-expert checkpoint names, gate rows of the fused parameter as the row's first projection, up as its second;
- the routing spec is the router's: ``moe_topk_softmax`` with the top-k and renormalization read from the router
  (`read_routing`) gives the router module's own choices and weights, for either value of a renormalization
  attribute;
- `quantize_` (registered at package import) swaps the experts for `W8A8MoE` with that routing and leaves the router
  in float, the shared experts quantized as Linears; the logits stay close to the float model's;
- `save_pretrained` writes the `W8A8MoE` layers under the same per-expert names and `from_pretrained` reads them back
  bit for bit;
- tensor parallelism splits the experts as the row's ``tp`` says (two gloo ranks).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8 import quantize as _quantize_mod
from cutlass_w8a8.checkpoints import from_pretrained, save_pretrained
from cutlass_w8a8.moe import families as F
from cutlass_w8a8.moe.hf import EXPERTS_SWAP

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("compressed_tensors")

from _checkpoints import sqnr_db, stored_tensors  # noqa: E402
from _moe_models import VOCAB, moe_blocks, tiny_moe_config, tiny_moe_model  # noqa: E402

ROWS = pytest.mark.parametrize("fam", F.FAMILIES, ids=[f.model_type for f in F.FAMILIES])
# quantize_d bf16 models vs the bf16 model itself (the quantization error of every Linear and expert), the bound
# of tests/moe/test_moe_layer_cpu.py (measured there 30.9-35.2 dB int8, 21.7-24.2 dB fp8 block) for the same tiny models.
VS_FLOAT_SQNR_DB = {"int8": 28.0, "fp8-block": 18.0}
SCHEMES = {"int8": cw.W8A8Config(dtype=torch.int8),
           "fp8-block": cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))}
WORLD = 2


def ids(seed=1):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def quantized(fam, scheme="int8", seed=0):
    model = tiny_moe_model(fam.model_type, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shared expert's gate (N = 1) is left in float
        cw.quantize_(model, SCHEMES[scheme], filter_fn=lambda m, fqn: fqn != "lm_head")
    return model


def test_the_swap_is_registered_at_package_import():
    assert EXPERTS_SWAP in _quantize_mod._MODULE_SWAPS


def test_rows_are_distinct():
    assert len({f.name for f in F.FAMILIES}) == len({f.model_type for f in F.FAMILIES}) == len(F.FAMILIES)
    assert len(F.block_classes()) == len(set(F.block_classes()))


@ROWS
def test_row_is_transformers(fam, tmp_path):
    config = tiny_moe_config(fam.model_type)
    assert config.model_type == fam.model_type
    modeling = importlib.import_module(f"transformers.models.{fam.model_type}.modeling_{fam.model_type}")
    for cls in fam.blocks + fam.experts:
        assert isinstance(getattr(modeling, cls, None), type), f"{cls} is not in {modeling.__name__}"
    model = tiny_moe_model(fam.model_type)
    blocks = moe_blocks(model)
    assert blocks
    lay, spec = fam.layout, fam.routing
    for name, block in blocks:
        assert type(block).__name__ in fam.blocks and F.family_of(block) is fam
        experts = getattr(block, lay.module)
        assert type(experts).__name__ in fam.experts
        gu, dn = getattr(experts, lay.gate_up), getattr(experts, lay.down)
        e, i2, h = gu.shape
        assert dn.shape == (e, h, i2 // 2) and h == config.hidden_size
        router = getattr(block, spec.router)
        assert getattr(router, spec.top_k) == config.num_experts_per_tok
        for attr in (spec.renormalize, spec.correction_bias, spec.n_group, spec.topk_group, spec.scaling_factor):
            if isinstance(attr, str):
                assert hasattr(router, attr), (name, attr)
        shared = fam.shared_experts
        children = dict(block.named_children())
        if shared is None:
            assert not [c for c in children if "shared" in c], children
        else:
            assert isinstance(children[shared.module], nn.Module)
            assert shared.gate is None or isinstance(children[shared.gate], nn.Linear)
    # transformers' own save writes the experts one linear per expert and projection, under the row's names
    model.save_pretrained(tmp_path)
    stored = stored_tensors(tmp_path)
    name, block = blocks[-1]
    experts = getattr(block, lay.module)
    i = getattr(experts, lay.gate_up).shape[1] // 2
    base = f"{fam.checkpoint_block(name)}.{lay.module}"
    e_count = getattr(experts, lay.gate_up).shape[0]
    want = {f"{base}.{e}.{p}.weight" for e in range(e_count) for p in fam.checkpoint.projs}
    assert {k for k in stored if k.startswith(f"{base}.")} == want
    gate, up, down = fam.checkpoint.projs
    gu, dn = getattr(experts, lay.gate_up), getattr(experts, lay.down)
    assert torch.equal(stored[f"{base}.3.{gate}.weight"], gu[3, :i])
    assert torch.equal(stored[f"{base}.3.{up}.weight"], gu[3, i:])
    assert torch.equal(stored[f"{base}.3.{down}.weight"], dn[3])


def _renormalize_values(fam):
    return (True, False) if isinstance(fam.routing.renormalize, str) else (fam.routing.renormalize,)


@ROWS
def test_routing_spec_is_the_routers(fam):
    """moe_topk_softmax with the routing read from the router (what W8A8MoE runs in router-logits mode) against the
    router module itself, float32: the same experts, the same weights (the softmax is the same float32 call; only
    the renormalizing sum may be ordered differently: the tolerance of tests/moe/test_moe_routing_cpu.py)."""
    model = tiny_moe_model(fam.model_type, dtype=torch.float32)
    _, block = moe_blocks(model)[0]
    router = getattr(block, fam.routing.router)
    x = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    for renormalize in _renormalize_values(fam):
        if isinstance(fam.routing.renormalize, str):
            setattr(router, fam.routing.renormalize, renormalize)
        args = F.read_routing(block, fam, "test")
        assert args.unserved() is None
        assert (args.top_k, args.renormalize) == (model.config.num_experts_per_tok, renormalize)
        with torch.no_grad():
            logits, weights, chosen = router(x)
        w, got = cw.moe_topk_softmax(logits, args.top_k, args.renormalize)
        assert torch.equal(got.long(), chosen), renormalize
        torch.testing.assert_close(w, weights.float(), rtol=3e-7, atol=0)


@ROWS
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_swaps_the_rows_experts(fam, scheme):
    base = tiny_moe_model(fam.model_type)
    model = quantized(fam, scheme)
    blocks = moe_blocks(model)
    for (name, block), (_, float_block) in zip(blocks, moe_blocks(base)):
        layer = getattr(block, fam.layout.module)
        assert type(layer) is cw.W8A8MoE, name
        args = F.read_routing(block, fam, "test")
        assert (layer.top_k, layer.renormalize) == (args.top_k, args.renormalize)
        assert layer.weight_block_size == SCHEMES[scheme].weight_block_size
        router, float_router = getattr(block, fam.routing.router), getattr(float_block, fam.routing.router)
        assert type(router) is type(float_router) and torch.equal(router.weight, float_router.weight)
        if fam.shared_experts is not None:
            linears = [m for m in getattr(block, fam.shared_experts.module).modules() if isinstance(m, nn.Linear)]
            assert not linears, linears  # every projection of the shared experts is a W8A8Linear
            if fam.shared_experts.gate is not None:
                assert type(getattr(block, fam.shared_experts.gate)) is nn.Linear  # N = 1: float
    with torch.no_grad():
        got, want = model(ids()).logits.float(), base(ids()).logits.float()
    assert sqnr_db(got, want) >= VS_FLOAT_SQNR_DB[scheme]


@ROWS
def test_checkpoint_round_trip(fam, tmp_path):
    """save_pretrained writes each W8A8MoE under the row's per-expert names (the names transformers writes, above),
    weight and weight_scale, nothing fused; from_pretrained reads them back into the same buffers bit for bit, and
    the routers are in the config's ignore list. A checkpoint storing a block's experts fused (the model's names) is
    refused, naming the fused tensor."""
    import json
    import re

    from _block_checkpoints import copy_checkpoint

    model = quantized(fam)
    path = tmp_path / "ckpt"
    save_pretrained(model, path)
    stored = stored_tensors(path)
    for name, block in moe_blocks(model):
        layer = getattr(block, fam.layout.module)
        base = f"{fam.checkpoint_block(name)}.{fam.layout.module}"
        want = {f"{base}.{e}.{p}.{leaf}" for e in range(layer.num_experts) for p in fam.checkpoint.projs
                for leaf in ("weight", "weight_scale")}
        assert {k for k in stored if k.startswith(f"{base}.")} == want, name
    assert not any(k.endswith((fam.layout.gate_up, fam.layout.down, ".w13", ".w2")) for k in stored)
    with open(path / "config.json") as f:
        ignore = json.load(f)["quantization_config"]["ignore"]
    block_in_files = fam.checkpoint_block(moe_blocks(model)[0][0]).rpartition(".")[2]
    assert f"re:.*{block_in_files}.{fam.routing.router}$" in ignore
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = from_pretrained(path)
    for (name, block), (_, block_back) in zip(moe_blocks(model), moe_blocks(back)):
        a, b = getattr(block, fam.layout.module), getattr(block_back, fam.layout.module)
        assert type(b) is cw.W8A8MoE, name
        assert (b.top_k, b.renormalize) == (a.top_k, a.renormalize)
        for k, v in a.state_dict().items():
            assert torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                               b.state_dict()[k].view(torch.uint8) if v.element_size() == 1 else b.state_dict()[k])

    name, block = moe_blocks(model)[-1]
    layer = getattr(block, fam.layout.module)
    base = f"{fam.checkpoint_block(name)}.{fam.layout.module}"

    def fused(tensors):
        for k in [k for k in tensors if k.startswith(f"{base}.")]:
            del tensors[k]
        tensors[f"{base}.{fam.layout.gate_up}"] = layer.w13.clone()
        tensors[f"{base}.{fam.layout.down}"] = layer.w2.clone()

    with pytest.raises(ValueError, match=rf"the checkpoint stores the experts of {re.escape(repr(name))} fused "
                                         rf"\({re.escape(repr(base + '.' + fam.layout.gate_up))}\)"):
        from_pretrained(copy_checkpoint(path, tmp_path / "fused", edit_tensors=fused))


def _tp_worker(rank, world, model_types, input_ids):
    """A gloo rank: each family's tiny model quantized with ``tp_group`` and a plan that names no attention or
    MLP projection (only ``lm_head``, over the vocabulary): what is split besides it is the experts, as their row
    says. Its experts layers' classes and sizes, the first one's buffers, and the logits."""
    import torch.distributed as dist

    out = {}
    for model_type in model_types:
        model = tiny_moe_model(model_type, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cw.quantize_(model, filter_fn=lambda m, fqn: fqn != "lm_head", tp_group=dist.group.WORLD,
                         tp_plan={"lm_head": "vocab"})
        with torch.no_grad():
            logits = model(input_ids).logits
        experts = [getattr(b, cw.moe.family_of(b).layout.module) for _, b in moe_blocks(model)]
        layers = [(type(m).__name__, m.intermediate_size, getattr(m, "full_intermediate_size", None))
                  for m in experts]
        first = {k: v.clone() for k, v in experts[0].state_dict().items()}
        out[model_type] = {"layers": layers, "logits": logits, "first": first}
    return out


@pytest.fixture(scope="module")
def tp_results():
    from cutlass_w8a8.testing.tp import run_workers

    x = ids()
    res = run_workers(_tp_worker, WORLD, args=([f.model_type for f in F.FAMILIES], x), timeout_s=300,
                      group_timeout_s=120)
    return [r.value for r in res]


@ROWS
def test_tensor_parallel_split(fam, tp_results):
    """Two gloo ranks: every experts layer is split as the row's ``tp`` says ("intermediate": a TensorParallelW8A8MoE
    holding I / world channels of every expert: rank r's gate rows ``[r I/2, (r+1) I/2)`` stacked on the same up rows
    of ``w13`` with their scales, the same columns of ``w2``, its per-channel scales whole), bit for bit the
    unsharded layer's slices; both ranks return the same logits."""
    assert fam.tp == "intermediate"
    d = [tp_results[r][fam.model_type] for r in range(WORLD)]
    for r in range(WORLD):
        layers = d[r]["layers"]
        assert layers and all(cls == "TensorParallelW8A8MoE" and full == WORLD * local for cls, local, full in layers)
    assert torch.equal(d[0]["logits"], d[1]["logits"])
    full = getattr(moe_blocks(quantized(fam, seed=0))[0][1], fam.layout.module)
    i = full.intermediate_size
    half = i // WORLD
    for r in range(WORLD):
        got = d[r]["first"]
        rows = list(range(r * half, (r + 1) * half)) + list(range(i + r * half, i + (r + 1) * half))
        assert torch.equal(got["w13"], full.w13[:, rows]) and torch.equal(got["w13_scale"], full.w13_scale[:, rows])
        assert torch.equal(got["w2"], full.w2[:, :, r * half:(r + 1) * half])
        assert torch.equal(got["w2_scale"], full.w2_scale)
