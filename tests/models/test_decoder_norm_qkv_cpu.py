"""The decoder layer's input norm and qkv_proj as one `add_rms_norm_linear_decode` (CUTLASS_W8A8_FUSED_NORM_QKV=1,
`cutlass_w8a8.models.layers.fused_norm_qkv`), on the CPU: which ops a step calls with the switch on, that the logits
of several steps equal those of the unfused path bit for bit (dense and Qwen3-MoE layers, int8 and fp8, batch 1 and
several rows), that layers the op cannot serve keep the old path, and the switch's accepted values.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.models import layers as L

DENSE = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3, num_heads=4,
                    num_kv_heads=2, max_position=128)
MOE = DENSE.replace(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)


@pytest.fixture
def switch(monkeypatch):
    """set(value): CUTLASS_W8A8_FUSED_NORM_QKV for this test (read at each call), undone afterwards."""
    def set_(value):
        if value is None:
            monkeypatch.delenv(L.FUSED_NORM_QKV_ENV, raising=False)
        else:
            monkeypatch.setenv(L.FUSED_NORM_QKV_ENV, value)
        return L.fused_norm_qkv()
    yield set_
    monkeypatch.undo()


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts, self.depth = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            self.counts[func.name()] = self.counts.get(func.name(), 0) + 1
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


def _steps(model, batch, n_steps=3):
    out = []
    for step in range(n_steps):
        tok = torch.arange(batch) * 7 + step + 1
        pos = torch.full((batch,), step)
        out.append(model(tok, pos, torch.arange(batch)))
    return out


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_logits_equal_with_the_switch_on_and_off(switch, cfg, quant, batch):
    torch.manual_seed(0)
    model = LlamaDecoder(cfg, quant, max_batch=4, max_seq_len=16)
    for layer in model.layers:  # the Python path (the one the MoE layers take anyway)
        layer.use_layer_op = False
    twin = copy.deepcopy(model)  # its own KV cache
    assert not switch(None)
    off = _steps(model, batch)
    assert switch("1")
    with _OpCounter() as counter:
        on = _steps(twin, batch)
    n = cfg.num_layers * 3
    assert counter.counts.get("cutlass_w8a8::add_rms_norm_linear_decode") == n, counter.counts
    assert counter.counts.get("cutlass_w8a8::rms_norm_quant", 0) == (0 if cfg.num_experts else n), counter.counts
    for i, (a, b) in enumerate(zip(off, on)):
        assert torch.equal(a, b), f"step {i}"


@torch.no_grad()
def test_layers_the_op_cannot_serve_keep_the_old_path(switch):
    """bf16 projections (no W8A8Linear), a static input scale, and more rows than the decode GEMM takes."""
    switch("1")
    for quant, batch in ((None, 2), ("int8", 17)):
        model = LlamaDecoder(DENSE, quant, max_batch=17, max_seq_len=16)
        for layer in model.layers:
            layer.use_layer_op = False
        with _OpCounter() as counter:
            _steps(model, batch, 1)
        assert "cutlass_w8a8::add_rms_norm_linear_decode" not in counter.counts, (quant, batch)
    model = LlamaDecoder(DENSE, "int8", max_batch=2, max_seq_len=16)
    for layer in model.layers:
        layer.use_layer_op = False
        layer.self_attn.qkv_proj.input_scale = torch.ones(1)  # static per-tensor activations
    with _OpCounter() as counter:
        _steps(model, 2, 1)
    assert "cutlass_w8a8::add_rms_norm_linear_decode" not in counter.counts


def test_switch_values(switch):
    assert switch(None) is False and switch("0") is False and switch("") is False and switch("1") is True
    with pytest.raises(ValueError, match="CUTLASS_W8A8_FUSED_NORM_QKV must be 0 or 1, got 'yes'"):
        switch("yes")
