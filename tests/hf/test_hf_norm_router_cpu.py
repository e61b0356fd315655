"""`cutlass_w8a8.hf.DecodeStep` on tiny sparse-MoE transformers models (Qwen3-MoE; Qwen2-MoE with its shared expert)
with ``CUTLASS_W8A8_FUSED_NORM_ROUTER=1``: the layers' post-attention norm folded into the router kernel
(`MoeMLP.forward_add_norm`, ``add_rms_norm_moe_router_route``) gives the same logits bit for bit as the switch off
(``fused_add_rms_norm``, ``moe_router_route``), one op fewer per layer. On the CPU `W8A8MoE.uses_decode_path` and
`router_route_applies` are False: patched as in tests/hf/test_hf_decode_step_cpu.py. GLM-4.5's router computes its
logits in float32 (`MoeBlockForward` "float32"): with its weight in the model dtype (transformers 5.17's layout; 5.24
keeps it in float32, which the fused router kernels do not take) the folded norm must route on float32 logits too.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import optimized_moe_step  # noqa: E402

from cutlass_w8a8.hf.decode_step import MoeMLP  # noqa: E402
from cutlass_w8a8.testing.op_calls import OpCalls  # noqa: E402

CACHE = 48
SWITCH = "CUTLASS_W8A8_FUSED_NORM_ROUTER"


def _moe(kind):
    import test_hf_generate_graph_cuda as gpu_cases

    model = gpu_cases._moe_model(kind, "int8", "cpu", **gpu_cases.MOE_CW_OVERRIDES.get(kind, {}))
    if kind == "glm4_moe":  # the router weight in the model dtype, as transformers 5.17 loads it
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.data = gate.weight.data.to(torch.bfloat16)
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "glm4_moe"])
@pytest.mark.parametrize("batch", [1, 3])
def test_step_logits_equal_switch_on_off(kind, batch, monkeypatch):
    step = optimized_moe_step(_moe(kind), CACHE, batch, monkeypatch)
    rows = torch.arange(batch)
    g = torch.Generator().manual_seed(batch)
    n = sum(isinstance(layer.mlp, MoeMLP) for layer in step.layers)  # GLM-4.5's first layer is dense
    assert n >= 1
    for i in range(3):  # each step twice at the same positions: both write the same cache columns
        tokens = torch.randint(1, 64, (batch,), generator=g)
        positions = rows + 2 + i
        monkeypatch.setenv(SWITCH, "1")
        with torch.no_grad(), OpCalls() as on_calls:
            on = step(tokens, positions, rows)
        monkeypatch.setenv(SWITCH, "0")
        with torch.no_grad(), OpCalls() as off_calls:
            off = step(tokens, positions, rows)
        assert torch.equal(on, off), f"{kind} step {i}"
        assert on_calls.names.count("cutlass_w8a8::add_rms_norm_moe_router_route") == n
        assert on_calls.names.count("cutlass_w8a8::moe_router_route") == 0
        assert off_calls.names.count("cutlass_w8a8::moe_router_route") == n
        assert len(on_calls.names) == len(off_calls.names) - n
