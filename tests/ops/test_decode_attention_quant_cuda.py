"""decode_attention_quant on the GPU: bit for bit the composition it replaces.

The op is decode_attention (csrc/attention/decode_attention.cu, split-KV) with the combine kernel rounding each
row to q's dtype and then quantizing it as quantize_per_token / quantize_per_tensor do. So on the GPU:

    decode_attention_quant(q, ...) == quantize_per_token(decode_attention(q, ...))       (torch.equal)

for q_out and the scales, whatever the shapes, dtypes and positions (both ops choose the same split count
from the same B, H, KVH and S). Every comparison runs twice, with the caching allocator's blocks of the output
sizes filled with 0x7f and then 0xff bytes first (0x7f is NaN in float8_e4m3fn, 127 in int8, 3.4e38 as float32;
0xff is NaN in float32 and float8_e4m3fn, -1 in int8): an element the kernel does not write differs from the
expected value in at least one of the two. Every cache entry the op must not read holds NaN.

The accuracy of the attention itself is test_decode_attention_cuda.py's (against float64).
"""

import math

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.testing.attention import make_inputs

from _fused_quant_cuda import assert_bits_equal, capture, poison_allocator

pytestmark = pytest.mark.cuda

OPS = torch.ops.cutlass_w8a8
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
QDTYPES = [torch.int8, torch.float8_e4m3fn]
# (H, KVH): G = 1, 2, 3, 4, 6, 8
HEADS = [(8, 8), (8, 4), (12, 4), (32, 8), (12, 2), (64, 8)]
POISON = (0x7F, 0xFF)


def _skip_without_fp8(qdtype):
    if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")


def poison_unread(kv, slots, positions):
    """NaN in every cache entry the op must not read: unused slots, and positions past each row's own."""
    keep = torch.zeros(kv.shape[0], kv.shape[3], dtype=torch.bool, device=kv.device)
    for slot, pos in zip(slots.tolist(), positions.tolist()):
        keep[slot, : pos + 1] = True
    kv.masked_fill_(~keep[:, None, None, :, None], float("nan"))


def static_scale_for(y, qdtype):
    """A static scale that uses the quantized range and saturates a few elements: max|y| / (0.8 QMAX)."""
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    return (y.float().abs().amax() / (0.8 * qmax)).reshape(1)


def check_against_composition(q, kv, slots, positions, qdtype, static, softmax_scale=None, what=""):
    """decode_attention_quant (the op and the wrapper) into poisoned memory, bit for bit the composition.
    Returns (q_out, scales) of the op."""
    b, h, d = q.shape
    softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    poison_unread(kv, slots, positions)
    y = OPS.decode_attention(q, kv, slots, positions, softmax_scale)
    assert not torch.isnan(y).any(), f"{what}: NaN in decode_attention's output"
    scale = static_scale_for(y, qdtype) if static else None
    if static:
        expect_q, expect_s = OPS.quantize_per_tensor(y, scale, qdtype), scale.expand(b, 1)
    else:
        expect_q, expect_s = OPS.quantize_per_token(y, qdtype)
    expect_q, expect_s = expect_q.cpu(), expect_s.cpu()
    for byte in POISON:
        tag = f"{what} {qdtype} {'static' if static else 'dynamic'} poison={byte:#x}"
        poison_allocator(b * h * d, b * 4, byte=byte)
        q_out, scales = OPS.decode_attention_quant(q, kv, slots, positions, softmax_scale, qdtype, scale)
        assert q_out.shape == (b, h * d) and q_out.is_contiguous() and scales.is_contiguous()
        assert_bits_equal(q_out, expect_q, f"{tag}: q_out")
        assert_bits_equal(scales, expect_s, f"{tag}: scales")
    wq, ws = cw.decode_attention_quant(q, kv, slots, positions, softmax_scale, qdtype, scale)
    assert_bits_equal(wq, expect_q, f"{what}: wrapper q_out")
    assert (ws is scale) if static else torch.equal(ws.cpu(), expect_s)
    return q_out, scales


def positions_for(b, s, seed):
    """0, S - 1 and S // 2 first, then random positions."""
    g = torch.Generator().manual_seed(seed)
    return ([0, s - 1, s // 2] + torch.randint(0, s, (max(b - 3, 0),), generator=g).tolist())[:b]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda hk: f"H{hk[0]}-KVH{hk[1]}")
def test_equals_composition(heads, dtype, qdtype, static):
    """GQA groups 1 to 8, D = 128, S = 300, B = 1 (positions 0, S // 2, S - 1), 3 and 64."""
    _skip_without_fp8(qdtype)
    h, kvh = heads
    s = 300
    for b, cases in ((1, [[0], [s // 2], [s - 1]]), (3, [positions_for(3, s, 1)]), (64, [positions_for(64, s, 2)])):
        for positions in cases:
            q, kv, slots, pos = make_inputs(b, h, kvh, 128, s, dtype, "cuda", seed=b * 7 + h, positions=positions)
            check_against_composition(q, kv, slots, pos, qdtype, static, what=f"B = {b} positions {positions[:3]}")


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 16, 24, 32, 40, 64, 96, 128, 192, 256])
def test_head_dims(d, dtype, qdtype):
    """Every lane layout of the split kernel, and rows of H * D = 32 to 3072 elements in the combine kernel;
    dynamic and static, with a softmax scale other than the default."""
    _skip_without_fp8(qdtype)
    for static in (False, True):
        q, kv, slots, pos = make_inputs(5, 12, 4, d, 70, dtype, "cuda", seed=d, positions=[0, 69, 1, 35, 64])
        check_against_composition(q, kv, slots, pos, qdtype, static, 0.7 / math.sqrt(d), what=f"D = {d}")


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkd", [(1, 1, 8), (3, 1, 40), (5, 5, 56), (17, 1, 248)],
                         ids=lambda hkd: "H{}-KVH{}-D{}".format(*hkd))
def test_rows_split_unevenly_over_the_combine(hkd, dtype, qdtype):
    """Rows whose H * D / 4 output vectors the cluster combine's 8 CTAs share unevenly (sm90): 2 (6 CTAs idle, the
    row amax still a max over all 8), 30, 70 and 1054 (two vectors a thread); dynamic and static."""
    _skip_without_fp8(qdtype)
    h, kvh, d = hkd
    for static in (False, True):
        q, kv, slots, pos = make_inputs(3, h, kvh, d, 300, dtype, "cuda", seed=h + d, positions=[299, 0, 150])
        check_against_composition(q, kv, slots, pos, qdtype, static, 0.7 / math.sqrt(d), what=f"H {h} D {d}")


def test_long_rows_of_a_wide_model():
    """64 heads of 128 over 8 kv heads (H * D = 8192, the combine kernel's register limit) at S = 4096."""
    q, kv, slots, pos = make_inputs(3, 64, 8, 128, 4096, torch.bfloat16, "cuda", seed=3, positions=[4095, 0, 2049])
    check_against_composition(q, kv, slots, pos, torch.int8, False)


# Around the split kernel's chunk edges (chunks are multiples of 8 positions, at least 32 of a full cache)
EDGE_POSITIONS = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 255, 256, 257, 1000, 4094, 4095]


@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [1, 3, 16, 64])
def test_long_cache_mixed_rows(b, dtype, qdtype):
    """S = 4096 with Llama-3-8B heads (32 / 8 x 128): B = 1 at S - 1 and at 0 (one row over many splits, or
    one active split), and batches mixing short and long rows (most splits of a short row idle)."""
    _skip_without_fp8(qdtype)
    s = 4096
    cases = {1: [[s - 1], [0], [257]], 3: [[s - 1, 0, 33]], 16: [EDGE_POSITIONS],
             64: [(EDGE_POSITIONS * 4)[:64], positions_for(64, s, 5)]}[b]
    for positions in cases:
        q, kv, slots, pos = make_inputs(b, 32, 8, 128, s, dtype, "cuda", seed=b + s, positions=positions)
        for static in (False, True):
            check_against_composition(q, kv, slots, pos, qdtype, static, what=f"B = {b} positions {positions[:4]}")


def test_padded_and_aliased_inputs():
    """q a strided view of a padded qkv buffer at a storage offset, slots and positions aliasing columns of one
    (B, 3) tensor: the same bits as contiguous copies of the same values."""
    b, h, kvh, d, s = 6, 32, 8, 128, 512
    q, kv, slots, pos = make_inputs(b, h, kvh, d, s, torch.bfloat16, "cuda", seed=11,
                                    positions=[0, 511, 100, 7, 256, 33])
    buf = torch.full((b, h + 2 * kvh + 3, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    buf[:, 1:h + 1].copy_(q)
    padded = buf[:, 1:h + 1]  # stride(0) = (H + 2 KVH + 3) D, offset D elements
    assert padded.stride(0) == (h + 2 * kvh + 3) * d and padded.storage_offset() == d
    for qdtype in QDTYPES:
        if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
            continue
        got = check_against_composition(padded, kv, slots, pos, qdtype, False, what="padded q")
        expect = OPS.decode_attention_quant(q.contiguous(), kv, slots.contiguous(), pos.contiguous(),
                                            1.0 / math.sqrt(d), qdtype, None)
        assert_bits_equal(got[0], expect[0].cpu(), "padded vs contiguous q_out")
        assert_bits_equal(got[1], expect[1].cpu(), "padded vs contiguous scales")


def test_empty_batch():
    q, kv, slots, pos = make_inputs(0, 8, 2, 64, 16, torch.bfloat16, "cuda")
    q8, s = OPS.decode_attention_quant(q, kv, slots, pos, 0.125, torch.int8, None)
    assert q8.shape == (0, 512) and q8.dtype == torch.int8 and s.shape == (0, 1) and s.dtype == torch.float32


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("qdtype", QDTYPES, ids=["int8", "fp8"])
@torch.no_grad()
def test_cuda_graph_replay_with_positions_changed_in_place(qdtype, static):
    """Captured once on static buffers laid out as the decoder's (S = 4096, so B = 4 runs many splits), then
    replayed with the positions (and q, slots) changed in place, longer and shorter than at capture: every
    replay equals the eager op and the eager composition bit for bit. Capture and replays under sync debug
    mode "error", warm-up on a side stream."""
    _skip_without_fp8(qdtype)
    b, h, kvh, d, s, num_slots = 4, 32, 8, 128, 4096, 6
    qkv = torch.zeros(b, h + 2 * kvh, d, dtype=torch.bfloat16, device="cuda")
    _, kv, _, _ = make_inputs(b, h, kvh, d, s, torch.bfloat16, "cuda", seed=50, num_slots=num_slots)
    rows = torch.zeros(b, 3, dtype=torch.int64, device="cuda")
    q, slots, positions = qkv[:, :h], rows[:, 2], rows[:, 1]
    scale = torch.tensor([0.02], device="cuda") if static else None
    steps = [[10, 100, 0, 37], [4095, 2000, 1, 512], [0, 3, 8, 31], [33, 4094, 4095, 7]]
    g = torch.Generator(device="cuda").manual_seed(51)
    qs = [torch.randn(b, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in steps]
    slot_sets = [torch.randperm(num_slots, generator=g, device="cuda")[:b] for _ in steps]
    position_sets = [torch.tensor(p, device="cuda") for p in steps]  # on the device before sync debug mode

    def load(i):
        q.copy_(qs[i])
        slots.copy_(slot_sets[i])
        positions.copy_(position_sets[i])

    load(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, (q_out, scales) = capture(
            lambda: OPS.decode_attention_quant(q, kv, slots, positions, 0.088, qdtype, scale))
        results = []
        for i in range(len(steps)):
            load(i)
            q_out.view(torch.uint8).fill_(0x7F)
            scales.fill_(float("nan"))
            graph.replay()
            eager = OPS.decode_attention_quant(q, kv, slots, positions, 0.088, qdtype, scale)
            y = OPS.decode_attention(q, kv, slots, positions, 0.088)
            chain = (OPS.quantize_per_tensor(y, scale, qdtype), scale.expand(b, 1)) if static else \
                OPS.quantize_per_token(y, qdtype)
            results.append((q_out.clone(), scales.clone(), eager, chain))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (got_q, got_s, eager, chain) in enumerate(results):
        for name, ref in (("eager", eager), ("composition", chain)):
            assert_bits_equal(got_q, ref[0].cpu(), f"replay {i} positions {steps[i]}: q_out vs {name}")
            assert_bits_equal(got_s, ref[1].cpu(), f"replay {i} positions {steps[i]}: scales vs {name}")


def test_opcheck_cuda():
    from test_opcheck import attention_quant_cases, run_opcheck

    for name, op, args in attention_quant_cases("cuda"):
        if any(isinstance(a, torch.dtype) and a == torch.float8_e4m3fn for a in args) and not cw.supports_fp8():
            continue
        try:
            run_opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for {name}: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# the decoder: LlamaAttention's W8A8 o_proj takes the op's output


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("quant", ["int8", "fp8"])
@torch.no_grad()
def test_attention_module_feeds_o_proj(quant, static):
    """LlamaAttention on the GPU with a W8A8 o_proj equals o_proj on the QuantizedActivation the layer itself
    makes of decode_attention's output (o_proj.quantize_input), bit for bit, and writes the same cache."""
    _skip_without_fp8(torch.float8_e4m3fn if quant == "fp8" else torch.int8)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=8,
                      num_kv_heads=2, max_position=512)
    model = LlamaDecoder(cfg, quant, max_batch=4, max_seq_len=512, device="cuda", seed=3)
    attn = model.layers[0].self_attn
    o_proj = attn.o_proj
    if static:
        o_proj.input_scale = torch.tensor([1e-2], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(9)
    attn.kv_cache.copy_(torch.randn(attn.kv_cache.shape, generator=g, device="cuda").to(torch.bfloat16))
    x = torch.randn(3, cfg.hidden_size, generator=g, device="cuda").to(torch.bfloat16)
    ctx = model._context(torch.tensor([0, 511, 40], device="cuda"), torch.tensor([2, 0, 4], device="cuda"))
    cache = attn.kv_cache.clone()
    y = attn(x, ctx)

    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qkv = attn.qkv_proj(x).view(3, h + 2 * kvh, d)
    cw.rope_kv_cache_(qkv, ctx.rope, cache, ctx.slots, ctx.positions, h, kvh)
    qa = o_proj.quantize_input(cw.decode_attention(qkv[:, :h], cache, ctx.slots, ctx.positions))
    assert_bits_equal(y, o_proj(qa).cpu(), f"{quant} static={static}")
    assert torch.equal(attn.kv_cache, cache)
