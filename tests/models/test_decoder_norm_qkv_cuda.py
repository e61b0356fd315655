"""The decoder's input norm + qkv_proj as one add_rms_norm_linear_decode kernel (CUTLASS_W8A8_FUSED_NORM_QKV=1) on the
GPU: the logits of several eager steps equal the unfused path's (rms_norm_quant, then scaled_mm on the quantized
activations) bit for bit for int8 (the decode GEMM and scaled_mm's int8 kernels accumulate exactly and share the
epilogue's float32 order), dense and Qwen3-MoE layers; and a captured graph of the fused step replays equal to the
eager fused step.
"""

import copy

import pytest
import torch

from cutlass_w8a8.graphs import CapturedGraph
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.models import layers as L

pytestmark = pytest.mark.cuda

DENSE = LlamaConfig(vocab_size=256, hidden_size=2048, intermediate_size=1024, num_layers=2, num_heads=16,
                    num_kv_heads=4, max_position=128)
MOE = DENSE.replace(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)


@pytest.fixture
def switch(monkeypatch):
    def set_(value):
        monkeypatch.setenv(L.FUSED_NORM_QKV_ENV, value)
        return L.fused_norm_qkv()
    yield set_
    monkeypatch.undo()


def _step_inputs(batch, step):
    tok = (torch.arange(batch, device="cuda") * 7 + step + 1)
    return tok, torch.full((batch,), step, device="cuda"), torch.arange(batch, device="cuda")


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("batch", [1, 5, 16])
@torch.no_grad()
def test_int8_logits_equal_with_the_switch_on_and_off(switch, cfg, batch):
    torch.manual_seed(0)
    model = LlamaDecoder(cfg, "int8", max_batch=16, max_seq_len=16, device="cuda")
    for layer in model.layers:
        layer.use_layer_op = False
    twin = copy.deepcopy(model)
    switch("0")
    off = [model(*_step_inputs(batch, s)) for s in range(3)]
    switch("1")
    on = [twin(*_step_inputs(batch, s)) for s in range(3)]
    for i, (a, b) in enumerate(zip(off, on)):
        assert torch.equal(a, b), f"step {i}"


@torch.no_grad()
def test_fused_step_captured_and_replayed(switch):
    torch.manual_seed(1)
    switch("1")
    model = LlamaDecoder(DENSE, "int8", max_batch=4, max_seq_len=16, device="cuda")
    for layer in model.layers:
        layer.use_layer_op = False
    twin = copy.deepcopy(model)
    graph = CapturedGraph(lambda tok, pos, slots: model(tok, pos, slots), list(_step_inputs(4, 0)))
    # the capture's warm-up ran step 0 on `model`'s cache; run it on the twin too, then replay steps 1..3
    twin(*_step_inputs(4, 0))
    for s in range(1, 4):
        inputs = _step_inputs(4, s)
        assert torch.equal(graph(*inputs), twin(*inputs)), f"step {s}"
