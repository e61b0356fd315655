"""The MoE decoder layer's post-attention norm folded into the router kernel (issue 36), on the CPU (the ops' CPU
implementations): with ``CUTLASS_W8A8_FUSED_NORM_ROUTER=1`` a W8A8 Qwen3-MoE layer at decode sizes runs
``add_rms_norm_moe_router_route`` in place of ``fused_add_rms_norm`` + ``moe_router_route`` (one op fewer per layer)
and the logits are the same bit for bit as with the switch off; the switch's values; the shapes the layer declines.

On the CPU `W8A8MoE.router_route_applies` is False (the fused router is CUDA-only) and `uses_decode_path` too: both
patched here as in tests/models/test_decoder_moe_cpu.py, so the layer takes the decode-size ops it takes on CUDA.
The CUDA side: tests/moe/test_norm_router_route_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.models.layers import fused_norm_router
from cutlass_w8a8.testing.op_calls import OpCalls

TINY = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position=128, qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
MAX_BATCH, MAX_SEQ = 8, 32
SWITCH = "CUTLASS_W8A8_FUSED_NORM_ROUTER"


def _model(quant, seed=0):
    torch.manual_seed(seed)
    model = LlamaDecoder(TINY, quant, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in model.layers:  # norm weights that are not ones, so that y depends on them
        w = layer.post_attention_layernorm.weight
        w.data.copy_((1 + 0.3 * torch.randn(w.shape, generator=g)).to(w.dtype))
    return model


def _steps(n_steps, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(MAX_BATCH, generator=g)[:batch]
    start = torch.randint(0, MAX_SEQ - n_steps, (batch,), generator=g)
    return [(torch.randint(0, TINY.vocab_size, (batch,), generator=g), start + i, slots) for i in range(n_steps)]


@pytest.fixture
def decode_sizes(monkeypatch):
    monkeypatch.setattr(cw.W8A8MoE, "uses_decode_path", lambda self, x, k: True)
    monkeypatch.setattr(cw.W8A8MoE, "router_route_applies", lambda self, x, w, logits_dtype=None: True)


def test_switch_values(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert not fused_norm_router()
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(SWITCH, value)
        assert fused_norm_router() is on, value
    monkeypatch.setenv(SWITCH, "yes")
    with pytest.raises(ValueError, match="CUTLASS_W8A8_FUSED_NORM_ROUTER must be 0 or 1, got 'yes'"):
        fused_norm_router()


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@torch.no_grad()
def test_logits_bitwise_equal_switch_on_off(quant, batch, decode_sizes, monkeypatch):
    """Two models with the same weights and caches, over three steps: switch on vs off, logits and KV caches equal
    bit for bit; the fused op replaces fused_add_rms_norm + moe_router_route in every layer (the final norm keeps
    fused_add_rms_norm)."""
    on, off = _model(quant), _model(quant)
    for tok, pos, slots in _steps(3, batch, seed=batch):
        monkeypatch.setenv(SWITCH, "1")
        with OpCalls() as calls_on:
            a = on(tok, pos, slots)
        monkeypatch.setenv(SWITCH, "0")
        with OpCalls() as calls_off:
            b = off(tok, pos, slots)
        assert torch.equal(a, b)
        n = TINY.num_layers
        assert calls_on.names.count("cutlass_w8a8::add_rms_norm_moe_router_route") == n
        assert calls_on.names.count("cutlass_w8a8::moe_router_route") == 0
        assert calls_on.names.count("cutlass_w8a8::fused_add_rms_norm") == 1  # the final norm
        assert calls_off.names.count("cutlass_w8a8::moe_router_route") == n
        assert calls_off.names.count("cutlass_w8a8::add_rms_norm_moe_router_route") == 0
        assert len(calls_on.names) == len(calls_off.names) - n
    for la, lb in zip(on.layers, off.layers):
        assert torch.equal(la.self_attn.kv_cache, lb.self_attn.kv_cache)


@torch.no_grad()
def test_declined_shapes_keep_the_two_ops(decode_sizes, monkeypatch):
    """Where the fused router does not apply (here: router_route_applies False, as on the CPU or above T = 16) or
    the norm's limits are not met, the switch changes nothing: the layer runs fused_add_rms_norm and its block."""
    monkeypatch.setenv(SWITCH, "1")
    model = _model("int8")
    block = model.layers[0].mlp
    h = torch.zeros(2, TINY.hidden_size, dtype=torch.bfloat16)
    r = torch.zeros_like(h)
    nw = model.layers[0].post_attention_layernorm.weight
    assert block.add_norm_route_applies(h, r, nw)
    assert not block.add_norm_route_applies(h, None, nw)
    assert not block.add_norm_route_applies(h, r.half(), nw)
    assert not block.add_norm_route_applies(h, torch.zeros(2, TINY.hidden_size + 4, dtype=torch.bfloat16)[:, 4:], nw)
    assert not block.add_norm_route_applies(h, r, nw[:128])
    assert not block.add_norm_route_applies(h, r, nw.float())
    monkeypatch.setattr(cw.W8A8MoE, "router_route_applies", lambda self, x, w, logits_dtype=None: False)
    assert not block.add_norm_route_applies(h, r, nw)
    tok, pos, slots = _steps(1, 2)[0]
    with OpCalls() as calls:
        model(tok, pos, slots)
    assert "cutlass_w8a8::add_rms_norm_moe_router_route" not in calls.names
