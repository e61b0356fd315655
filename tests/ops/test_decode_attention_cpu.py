"""decode_attention on CPU: the reference implementation equals the decoder's former index_select + SDPA math
bit for bit, agrees with an independent float64 reference, its out= form and fake kernel, opcheck, argument
errors through the op itself, and the decoder's attention still computing what it computed before.
decode_attention_quant on CPU: bit for bit the composition quantize_per_token / quantize_per_tensor of
decode_attention, its scales, the wrapper's defaults, its fake kernel and its checks in their order.

The wrapper's argument errors are triggered row by row in tests/test_misuse_table.py (docs/MISUSE.md).
"""

import math

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.models import llama as llama_mod

from cutlass_w8a8.testing.attention import assert_close_to_reference, make_inputs, opcheck_cases, reference, sdpa_formulation

from _full import opcheck

OPS = torch.ops.cutlass_w8a8

# (B, H, KVH, D, S): multi-head (G = 1), grouped (G = 2, 4, 8), one kv head (G = 16), D from 8 to 256
SHAPES = [
    (1, 4, 4, 16, 32),
    (3, 4, 2, 16, 32),
    (5, 8, 2, 64, 48),
    (2, 32, 8, 128, 64),
    (4, 16, 1, 32, 17),
    (2, 8, 1, 8, 16),
    (2, 2, 1, 256, 40),
    (3, 6, 3, 24, 20),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-KVH{}-D{}-S{}".format(*s))
def test_equals_former_sdpa_formulation(shape, dtype):
    """Bit for bit the decoder's former math, positions 0, S - 1 and random ones, q a strided qkv view."""
    b, h, kvh, d, s = shape
    positions = ([0, s - 1] + list(range(1, b)))[:b]
    q, kv, slots, pos = make_inputs(b, h, kvh, d, s, dtype, "cpu", seed=b * 1000 + d, positions=positions)
    assert q.stride(0) == (h + 2 * kvh) * d and pos.stride(0) == 3
    out = cw.decode_attention(q, kv, slots, pos)
    assert out.shape == (b, h * d) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, sdpa_formulation(q, kv, slots, pos))
    # the op with SDPA's default scale written out
    assert torch.equal(OPS.decode_attention(q, kv, slots, pos, 1.0 / math.sqrt(d)), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_close_to_float64_reference(dtype):
    """The semantics, checked against an independent per-row float64 computation: row b reads positions
    0..positions[b] of slot slots[b], query head h reads key/value head h // G. float32 meets the kernel's
    bound; bf16 (SDPA rounds its probabilities to bf16 on CPU) measured a relative Frobenius error of
    0.13-0.15% over 5 seeds, bound 5e-3. A wrong position, slot or head costs O(1)."""
    b, h, kvh, d, s = 6, 8, 2, 64, 40
    q, kv, slots, pos = make_inputs(b, h, kvh, d, s, dtype, "cpu", seed=7, positions=[0, 1, 39, 20, 5, 38])
    scale = 0.3
    out = cw.decode_attention(q, kv, slots, pos, scale)
    ref = reference(q, kv, slots, pos, scale)
    if dtype == torch.float32:
        assert_close_to_reference(out, ref, dtype)
    else:
        err = (out.double().view(b, h, d) - ref.out).norm() / ref.out.norm()
        assert err < 5e-3, err


def test_position_zero_is_the_first_value():
    """With one position the softmax weight is exactly 1: out is V[slot, kvh, 0] (any q, any scale)."""
    q, kv, slots, pos = make_inputs(3, 4, 2, 16, 8, torch.bfloat16, "cpu", seed=3, positions=[0, 0, 0])
    out = cw.decode_attention(q, kv, slots, pos, 2.5).view(3, 4, 16)
    for i, slot in enumerate(slots.tolist()):
        expect = kv[slot, 1, :, 0].repeat_interleave(2, dim=0)
        torch.testing.assert_close(out[i], expect, rtol=0, atol=2 ** -8 * expect.abs().max().item())


def test_out_variant_and_default_scale():
    q, kv, slots, pos = make_inputs(4, 8, 4, 32, 24, torch.float16, "cpu", seed=11)
    expect = cw.decode_attention(q, kv, slots, pos)
    out = torch.full((4, 8 * 32), float("nan"), dtype=torch.float16)
    assert cw.decode_attention(q, kv, slots, pos, out=out) is out
    assert torch.equal(out, expect)
    assert torch.equal(cw.decode_attention(q, kv, slots, pos, 1.0 / math.sqrt(32)), expect)
    assert not torch.equal(cw.decode_attention(q, kv, slots, pos, 0.5), expect)
    # the op form of out=
    out.fill_(float("nan"))
    OPS.decode_attention_out(out, q, kv, slots, pos, 1.0 / math.sqrt(32))
    assert torch.equal(out, expect)


def test_empty_batch():
    q, kv, slots, pos = make_inputs(0, 4, 2, 16, 8, torch.bfloat16, "cpu")
    out = cw.decode_attention(q, kv, slots, pos)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(5, 12, 128, dtype=torch.bfloat16)
        kv = torch.empty(9, 2, 2, 64, 128, dtype=torch.bfloat16)
        idx = torch.zeros(5, 3, dtype=torch.int64)
        out = OPS.decode_attention(qkv[:, :8], kv, idx[:, 2], idx[:, 1], 0.1)
        assert out.shape == (5, 1024) and out.dtype == torch.bfloat16 and out.is_contiguous()
        with pytest.raises(ValueError, match="must divide H"):
            OPS.decode_attention(qkv[:, :7], kv, idx[:, 2], idx[:, 1], 0.1)


CPU_CASES = opcheck_cases("cpu")


@pytest.mark.parametrize("case", [c[0] for c in CPU_CASES])
def test_opcheck_cpu(case):
    _, op, args = next(c for c in CPU_CASES if c[0] == case)
    opcheck(op, args)


@pytest.mark.parametrize("call", ["op", "fake"])
def test_op_checks_its_arguments(call):
    """Direct torch.ops calls, on CPU and under fake tensors, get the wrapper's errors."""
    q, kv, slots, pos = make_inputs(2, 4, 2, 16, 8, torch.bfloat16, "cpu")
    bad = [
        ((q.float(), kv, slots, pos), TypeError, "`kv_cache` must have q's dtype"),
        ((q, kv, slots.int(), pos), TypeError, "`slots` must be int64"),
        ((q, kv, slots, pos[:1]), ValueError, r"`positions` must be \(B,\)"),
        ((q[..., :12], kv, slots, pos), ValueError, "head dim D"),
        ((q, kv.transpose(3, 4).contiguous().transpose(3, 4), slots, pos), ValueError,
         "`kv_cache` must be contiguous"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), kv, slots, pos), ValueError, r"stride\(2\) == 1"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            if call == "op":
                OPS.decode_attention(*args, 0.25)
            else:
                from torch._subclasses.fake_tensor import FakeTensorMode

                mode = FakeTensorMode()
                fake = [mode.from_tensor(t) for t in args]
                with mode:
                    OPS.decode_attention(*fake, 0.25)
    with pytest.raises(ValueError, match="`softmax_scale` must be finite"):
        OPS.decode_attention(q, kv, slots, pos, float("inf"))


# ----------------------------------------------------------------------------------------------------
# decode_attention_quant: decode_attention, then the quantization of its output (o_proj's activation)

QDTYPES = [torch.int8, torch.float8_e4m3fn]


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-KVH{}-D{}-S{}".format(*s))
def test_quant_equals_the_composition(shape, dtype, qdtype, static):
    """Bit for bit quantize_per_token (or quantize_per_tensor) of decode_attention's output; the op's scales
    are (B, 1) float32, in the static mode the given value in every row; the wrapper returns the given scale
    object in that mode (as rms_norm_quant) and computes SDPA's default softmax scale."""
    b, h, kvh, d, s = shape
    positions = ([0, s - 1] + list(range(1, b)))[:b]
    q, kv, slots, pos = make_inputs(b, h, kvh, d, s, dtype, "cpu", seed=b * 1000 + d + 1, positions=positions)
    y = OPS.decode_attention(q, kv, slots, pos, 0.3)
    scale = (y.float().abs().amax() / 100).reshape(1) if static else None  # a few values saturate in fp8
    q_out, scales = OPS.decode_attention_quant(q, kv, slots, pos, 0.3, qdtype, scale)
    assert q_out.shape == (b, h * d) and q_out.dtype == qdtype and q_out.is_contiguous()
    assert scales.shape == (b, 1) and scales.dtype == torch.float32 and scales.is_contiguous()
    if static:
        expect_q, expect_s = OPS.quantize_per_tensor(y, scale, qdtype), scale.expand(b, 1)
    else:
        expect_q, expect_s = OPS.quantize_per_token(y, qdtype)
    assert torch.equal(_bits(q_out), _bits(expect_q)) and torch.equal(scales, expect_s)
    assert q_out.float().abs().amax() >= (100 if qdtype == torch.int8 else 64)  # the range is used

    wq, ws = cw.decode_attention_quant(q, kv, slots, pos, dtype=qdtype, scale=scale)
    default_q, default_s = OPS.decode_attention_quant(q, kv, slots, pos, 1.0 / math.sqrt(d), qdtype, scale)
    assert torch.equal(_bits(wq), _bits(default_q))
    assert (ws is scale) if static else torch.equal(ws, default_s)


def test_quant_defaults_and_positional_form():
    """The wrapper's defaults: int8, dynamic, 1 / sqrt(D); its arguments by position as in its signature."""
    q, kv, slots, pos = make_inputs(4, 8, 2, 32, 24, torch.bfloat16, "cpu", seed=21)
    q8, s = cw.decode_attention_quant(q, kv, slots, pos)
    expect_q, expect_s = OPS.quantize_per_token(cw.decode_attention(q, kv, slots, pos), torch.int8)
    assert q8.dtype == torch.int8 and torch.equal(q8, expect_q) and torch.equal(s, expect_s)
    q8b, sb = cw.decode_attention_quant(q, kv, slots, pos, 0.5, torch.float8_e4m3fn, None)
    expect_q, expect_s = OPS.quantize_per_token(cw.decode_attention(q, kv, slots, pos, 0.5), torch.float8_e4m3fn)
    assert torch.equal(_bits(q8b), _bits(expect_q)) and torch.equal(sb, expect_s)


def test_quant_empty_batch_and_fake_kernel():
    q, kv, slots, pos = make_inputs(0, 4, 2, 16, 8, torch.bfloat16, "cpu")
    q8, s = OPS.decode_attention_quant(q, kv, slots, pos, 0.25, torch.int8, None)
    assert q8.shape == (0, 64) and q8.dtype == torch.int8 and s.shape == (0, 1) and s.dtype == torch.float32
    q8, s = OPS.decode_attention_quant(q, kv, slots, pos, 0.25, torch.int8, torch.tensor([0.5]))
    assert q8.shape == (0, 64) and s.shape == (0, 1)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qkv = torch.empty(5, 12, 128, dtype=torch.float16)
        kv = torch.empty(9, 2, 2, 64, 128, dtype=torch.float16)
        idx = torch.zeros(5, 3, dtype=torch.int64)
        for qdtype, scale in ((torch.int8, None), (torch.float8_e4m3fn, torch.ones(1))):
            q8, s = OPS.decode_attention_quant(qkv[:, :8], kv, idx[:, 2], idx[:, 1], 0.1, qdtype, scale)
            assert q8.shape == (5, 1024) and q8.dtype == qdtype and q8.is_contiguous()
            assert s.shape == (5, 1) and s.dtype == torch.float32
        with pytest.raises(ValueError, match="^decode_attention_quant: `kv_cache` KVH = .* must divide H"):
            OPS.decode_attention_quant(qkv[:, :7], kv, idx[:, 2], idx[:, 1], 0.1, torch.int8, None)


def _quant_case(q, kv, slots, pos, softmax_scale=0.25, dtype=torch.int8, scale=None):
    return (q, kv, slots, pos, softmax_scale, dtype, scale)


@pytest.mark.parametrize("call", ["op", "fake"])
def test_quant_checks_its_arguments(call):
    """decode_attention's checks under the new op's name, then `dtype`, then `scale` (q the device reference),
    in that order: a call with two errors gets the earlier one. Direct op calls and fake tensors alike."""
    q, kv, slots, pos = make_inputs(2, 4, 2, 16, 8, torch.bfloat16, "cpu")
    one = torch.tensor([0.5])
    bad = [
        (_quant_case(q.int(), kv, slots, pos), TypeError,
         "decode_attention_quant: `q` must be bfloat16, float16 or float32, got torch.int32"),
        (_quant_case(q, kv.float(), slots, pos), TypeError,
         "decode_attention_quant: `kv_cache` must have q's dtype torch.bfloat16, got torch.float32"),
        (_quant_case(q, kv, slots, pos.int()), TypeError, "decode_attention_quant: `positions` must be int64"),
        (_quant_case(q, kv, slots, pos, float("nan")), ValueError,
         "decode_attention_quant: `softmax_scale` must be finite, got nan"),
        (_quant_case(q[..., :12], kv, slots, pos), ValueError, "decode_attention_quant: `q` head dim D"),
        (_quant_case(q, kv, slots[:1], pos), ValueError,
         r"decode_attention_quant: `slots` must be \(B,\) with B = q.shape\[0\] = 2, got shape \(1,\)"),
        (_quant_case(q, kv[:, :1], slots, pos), ValueError,
         r"decode_attention_quant: `kv_cache` must be \(num_slots, 2, KVH, S, D\)"),
        # decode_attention's checks come before the dtype's, the dtype's before the scale's
        (_quant_case(q[..., :12], kv, slots, pos, dtype=torch.float16), ValueError, "`q` head dim D"),
        (_quant_case(q, kv, slots, pos, dtype=torch.float16), TypeError,
         r"^decode_attention_quant: `dtype` must be torch.int8 or torch.float8_e4m3fn, got torch.float16$"),
        (_quant_case(q, kv, slots, pos, dtype=torch.float16, scale=one.half()), TypeError, "`dtype` must be"),
        (_quant_case(q, kv, slots, pos, scale=one.double()), TypeError,
         r"^decode_attention_quant: `scale` must be float32, got torch.float64$"),
        (_quant_case(q, kv, slots, pos, scale=torch.ones(2)), ValueError,
         r"^decode_attention_quant: `scale` must hold one value \(static per-tensor\), got shape \(2,\)$"),
        (_quant_case(q, kv, slots, pos, scale=torch.ones(2, device="meta")[:1]), ValueError,
         r"^decode_attention_quant: `scale` is on meta but `q` is on cpu$"),
    ]
    for args, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            if call == "op":
                OPS.decode_attention_quant(*args)
            else:
                from torch._subclasses.fake_tensor import FakeTensorMode

                mode = FakeTensorMode()
                fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
                with mode:
                    OPS.decode_attention_quant(*fake)


# ----------------------------------------------------------------------------------------------------
# the decoder


def _former_attention_forward(self, x, ctx):
    """LlamaAttention.forward as it was before decode_attention (index_select of whole slots + masked SDPA)."""
    b = x.shape[0]
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    qkv = self.qkv_proj(x).view(b, h + 2 * kvh, d)
    llama_mod._rope_(qkv[:, : h + kvh], ctx.rope)
    s = self.kv_cache.shape[3]
    kv_index = (ctx.slots.unsqueeze(1) * (2 * kvh) + torch.arange(2 * kvh)) * s + ctx.positions.unsqueeze(1)
    self.kv_cache.view(-1, d).index_put_((kv_index,), qkv[:, h:])
    out = sdpa_formulation(qkv[:, :h], self.kv_cache, ctx.slots, ctx.positions)
    return self.o_proj(out)


@pytest.mark.parametrize("quant,dtype", [(None, torch.bfloat16), ("int8", torch.bfloat16), (None, torch.float32)])
@torch.no_grad()
def test_decoder_unchanged_on_cpu(quant, dtype, monkeypatch):
    """The decoder's logits and caches equal, bit for bit, those of the former attention code."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position=128)
    g = torch.Generator().manual_seed(0)
    steps = []
    slots = torch.randperm(8, generator=g)[:5]
    start = torch.randint(0, 24, (5,), generator=g)
    for i in range(6):
        steps.append((torch.randint(0, 256, (5,), generator=g), start + i, slots))
    runs = {}
    for name in ("op", "former"):
        model = LlamaDecoder(cfg, quant, max_batch=8, max_seq_len=32, dtype=dtype, seed=0)
        with monkeypatch.context() as m:
            if name == "former":
                m.setattr(llama_mod.LlamaAttention, "forward", _former_attention_forward)
            runs[name] = [model(*s) for s in steps] + [layer.self_attn.kv_cache for layer in model.layers]
    for a, b in zip(runs["op"], runs["former"]):
        assert torch.equal(a, b)


@pytest.mark.skipif(cw._ext.cuda_ops_available(), reason="checks the message without the CUDA extension")
def test_path_helpers_without_extension_raise():
    """The private path helpers of the CUDA op (the fused-or-split dispatch and the query heads per CTA,
    csrc/attention/decode_attention.cu) name themselves when `_C` is missing."""
    with pytest.raises(RuntimeError, match="decode_attention_path: the CUDA extension is not loaded"):
        cw._ext.decode_attention_path(0, 1, 32, 4, 512, 128, torch.bfloat16)
    with pytest.raises(RuntimeError, match="set_decode_attention_fused: the CUDA extension is not loaded"):
        cw._ext.set_decode_attention_fused(False)
    with pytest.raises(RuntimeError, match="decode_attention_heads_per_cta: the CUDA extension is not loaded"):
        cw._ext.decode_attention_heads_per_cta(8)
