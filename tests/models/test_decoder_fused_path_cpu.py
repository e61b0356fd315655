"""The reference decoder's use of the fused non-GEMM ops, on the CPU: which ops a decode step calls (rms_norm /
fused_add_rms_norm / *_quant, silu_mul), that its math equals the unfused Python path bit for bit, the
float64 fallback of its RMSNorm module, and the one-op decode layer (`decode_layer`) against the Python path,
with opcheck and its refusal of mixed projections. The ops themselves are in test_fused_quant_cpu.py.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder

from _full import opcheck
from _fused_quant_cpu import EPS, assert_bits_equal, inputs

TINY = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, max_position=128)


class _OpCounter(TorchDispatchMode):
    """Counts the ops the model calls itself (not those inside the ops' CPU implementations)."""

    def __init__(self):
        super().__init__()
        self.counts = {}
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.depth == 0:
            name = func.name()
            self.counts[name] = self.counts.get(name, 0) + 1
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
@torch.no_grad()
def test_decoder_uses_the_fused_path(quant):
    """Per layer: two norms with the residual add fused (the first layer's first without: nothing to add
    yet), quantizing for the W8A8 qkv and gate_up projections, one attention (quantizing for o_proj) and one
    silu_mul (quantizing for down_proj); the final norm adds the last residual. The bf16 model runs the same
    ops without quantization. Neither runs a separate add, norm, silu or quantization: every W8A8 projection
    is one scaled_mm on a QuantizedActivation."""
    model = LlamaDecoder(TINY, quant, max_batch=4, max_seq_len=32)
    for layer in model.layers:  # the Python path of each layer (the layer op runs the same ops: below)
        layer.use_layer_op = False
    with _OpCounter() as counter:
        model(torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([0, 1]))
    c = counter.counts
    n = TINY.num_layers
    for unfused in ("aten::silu", "aten::silu_", "aten::pow.Tensor_Scalar", "aten::rsqrt", "aten::mean.dim",
                    "aten::rms_norm", "cutlass_w8a8::quantize_per_tensor"):
        assert unfused not in c, (unfused, c)
    if quant is None:
        # 2n - 1 norms with the add in the layers, plus the final one
        assert c.get("cutlass_w8a8::rms_norm") == 1 and c.get("cutlass_w8a8::fused_add_rms_norm") == 2 * n
        assert c.get("cutlass_w8a8::silu_mul") == n and c.get("cutlass_w8a8::decode_attention") == n
        assert not any(k in c for k in ("cutlass_w8a8::rms_norm_quant", "cutlass_w8a8::silu_mul_quant",
                                        "cutlass_w8a8::decode_attention_quant",
                                        "cutlass_w8a8::quantize_per_token")), c
    else:
        assert c.get("cutlass_w8a8::rms_norm_quant") == 2 * n and c.get("cutlass_w8a8::silu_mul_quant") == n
        # o_proj's quantization is folded into the attention: all four projections take a QuantizedActivation
        assert c.get("cutlass_w8a8::decode_attention_quant") == n and "cutlass_w8a8::decode_attention" not in c
        assert c.get("cutlass_w8a8::scaled_mm") == 4 * n and "cutlass_w8a8::w8a8_linear" not in c
        assert "cutlass_w8a8::quantize_per_token" not in c
        # the final norm feeds the bf16 lm_head
        assert c.get("cutlass_w8a8::fused_add_rms_norm") == 1 and "cutlass_w8a8::rms_norm" not in c
        assert "cutlass_w8a8::silu_mul" not in c


def _unfused_forward(model, tok, pos, slots):
    """The decoder's step as it was written before the fused ops: h = h + attn(norm(h)); h = h + mlp(...)."""
    ctx = model._context(pos, slots)
    h = model.embed_tokens(tok)

    def norm(m, x):
        return F.rms_norm(x, (x.shape[-1],), m.weight, m.eps)

    for layer in model.layers:
        h = h + layer.self_attn(norm(layer.input_layernorm, h), ctx)
        gate, up = layer.mlp.gate_up_proj(norm(layer.post_attention_layernorm, h)).chunk(2, dim=-1)
        h = h + layer.mlp.down_proj(F.silu(gate) * up)
    return model.lm_head(norm(model.norm, h))


@pytest.mark.parametrize("quant, dtype, quant_lm_head", [
    (None, torch.bfloat16, False), (None, torch.float32, False), (None, torch.float16, False),
    ("int8", torch.bfloat16, False), ("int8", torch.bfloat16, True), ("fp8", torch.bfloat16, True),
    ("int8", torch.float16, False),
])
@torch.no_grad()
def test_decoder_math_is_unchanged(quant, dtype, quant_lm_head):
    """The fused path computes exactly what the unfused step computed (CPU: the ops are those chains)."""
    model = LlamaDecoder(TINY, quant, max_batch=8, max_seq_len=32, dtype=dtype, quant_lm_head=quant_lm_head)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(18)
    for t in range(3):
        tok = torch.randint(0, TINY.vocab_size, (5,), generator=g)
        pos, slots = torch.full((5,), t), torch.tensor([3, 0, 6, 1, 2])
        assert_bits_equal(model(tok, pos, slots), _unfused_forward(twin, tok, pos, slots), f"step {t}")


@torch.no_grad()
def test_rms_norm_module_float64_falls_back_to_torch():
    """A float64 copy of a model (no fused kernels for float64) computes with the torch chain."""
    norm = cw.models.llama.RMSNorm(64, EPS, dtype=torch.float64)
    x, _, r = inputs((3, 64), torch.float64)
    r0 = r.clone()
    y = norm(x, r)
    assert torch.equal(r, r0 + x) and torch.equal(y, F.rms_norm(r0 + x, (64,), norm.weight, EPS))


# Static input scales per projection, near max|x| / QMAX of TINY's activations (normed inputs of about 1,
# attention outputs of about 0.1, silu(gate) * up of about 0.01), so the quantized values use the range.
STATIC_SCALES = {"qkv_proj": 0.01, "o_proj": 1e-3, "gate_up_proj": 0.01, "down_proj": 1e-4}


def _make_static(model):
    """Give every W8A8 projection of the decoder layers a static per-tensor input scale."""
    for layer in model.layers:
        for name, mod in (*layer.self_attn.named_children(), *layer.mlp.named_children()):
            assert isinstance(mod, cw.W8A8Linear)
            mod.input_scale = torch.tensor([STATIC_SCALES[name]], device=mod.weight.device)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("quant", ["int8", "fp8"])
@torch.no_grad()
def test_attention_quantizes_for_o_proj(quant, static, dtype):
    """LlamaAttention with a W8A8 o_proj: one decode_attention_quant (o_proj's quant_dtype and input_scale)
    whose QuantizedActivation o_proj takes, and the same output and cache, bit for bit, as o_proj quantizing
    decode_attention's output itself (the attention as it was before the fold)."""
    model = LlamaDecoder(TINY, quant, max_batch=4, max_seq_len=32, dtype=dtype)
    if static:
        _make_static(model)
    attn = model.layers[1].self_attn
    g = torch.Generator().manual_seed(4)
    attn.kv_cache.copy_(torch.randn(attn.kv_cache.shape, generator=g).to(dtype))
    x = torch.randn(3, TINY.hidden_size, generator=g).to(dtype)
    ctx = model._context(torch.tensor([0, 31, 9]), torch.tensor([2, 0, 4]))
    cache = attn.kv_cache.clone()
    with _OpCounter() as counter:
        y = attn(x, ctx)
    c = counter.counts
    assert c.get("cutlass_w8a8::decode_attention_quant") == 1 and "cutlass_w8a8::decode_attention" not in c, c
    assert "cutlass_w8a8::w8a8_linear" in c and c.get("cutlass_w8a8::scaled_mm") == 1, c  # qkv, then o_proj

    o_proj, (h, kvh, d) = attn.o_proj, (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    qkv = attn.qkv_proj(x).view(3, h + 2 * kvh, d)
    cw.rope_kv_cache_(qkv, ctx.rope, cache, ctx.slots, ctx.positions, h, kvh)
    out = cw.decode_attention(qkv[:, :h], cache, ctx.slots, ctx.positions)
    assert_bits_equal(y, o_proj(out), f"{quant} static={static}")
    assert torch.equal(attn.kv_cache, cache)
    qa = o_proj.quantize_input(out)  # what the layer makes of the float output: nonzero, unsaturated
    assert qa.q.float().abs().amax() > 8 and (qa.scale.numel() == 1) == static


@pytest.mark.parametrize("quant, static", [(None, False), ("int8", False), ("fp8", False), ("int8", True),
                                           ("fp8", True)])
def test_decoder_layer_op_equals_python_path(quant, static):
    """One decode_layer call per layer, and the same logits bit for bit as the layers' Python path (it runs
    the same ops in the same order: decode_attention_quant for a W8A8 o_proj), over two steps (the cache
    written by the first is read by the second); dynamic and static activation scales."""
    torch.manual_seed(0)
    model = LlamaDecoder(TINY, quant, max_batch=4, max_seq_len=32)
    if static:
        _make_static(model)
    tok, pos, slots = torch.tensor([1, 2]), torch.tensor([0, 3]), torch.tensor([0, 1])
    with _OpCounter() as counter:
        fused = [model(tok, pos, slots), model(tok + 1, pos + 1, slots)]
    assert counter.counts.get("cutlass_w8a8::decode_layer") == 2 * TINY.num_layers, counter.counts
    model.reset_cache()
    for layer in model.layers:
        layer.use_layer_op = False
    python = [model(tok, pos, slots), model(tok + 1, pos + 1, slots)]
    for a, b in zip(fused, python):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_decode_layer_opcheck_cpu(quant):
    """opcheck of decode_layer on a layer's operands: the schema's mutations (residual, kv_cache), the fake
    kernel's output, and dispatch; with a first-layer call (h None) and a later one."""
    torch.manual_seed(0)
    model = LlamaDecoder(TINY, quant, max_batch=4, max_seq_len=32)
    layer = model.layers[0]
    ctx = model._context(torch.tensor([0, 3]), torch.tensor([0, 1]))
    attn = layer.self_attn
    for first in (True, False):
        residual = torch.randn(2, TINY.hidden_size).to(torch.bfloat16)
        h = None if first else torch.randn_like(residual)
        ops = list(layer._layer_op_operands(residual))
        ops[-1] = ops[-1].clone()
        opcheck(torch.ops.cutlass_w8a8.decode_layer.default,
                (h, residual, *ops, ctx.rope, ctx.slots, ctx.positions, attn.num_heads,
                 attn.num_kv_heads, attn.head_dim ** -0.5))


def test_decode_layer_rejects_mixed_projections():
    """Projections of different kinds (an 8-bit qkv with a bf16 o_proj) raise, naming the argument."""
    model = LlamaDecoder(TINY, "int8", max_batch=4, max_seq_len=32)
    layer = model.layers[0]
    ops = list(layer._layer_op_operands(torch.zeros(2, TINY.hidden_size, dtype=torch.bfloat16)))
    ops[6] = torch.zeros(TINY.hidden_size, TINY.num_heads * TINY.head_dim, dtype=torch.bfloat16)  # o_w
    ctx = model._context(torch.tensor([0, 3]), torch.tensor([0, 1]))
    residual = torch.zeros(2, TINY.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="decode_layer: `o_w` must have qkv_w's dtype torch.int8"):
        torch.ops.cutlass_w8a8.decode_layer(None, residual, *ops, ctx.rope, ctx.slots, ctx.positions,
                                            TINY.num_heads, TINY.num_kv_heads, 0.125)
