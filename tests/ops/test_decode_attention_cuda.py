"""decode_attention on the GPU (csrc/attention/decode_attention.cu) against the float64 reference.

Inputs are laid out as the decoder passes them: q a strided view of a fused qkv output, slots and positions
strided columns of a (B, 3) int64 tensor. The outputs are poisoned with NaN before each call, and every cache
entry the op must not read (other slots, positions past a row's own) holds NaN, so a missed write or a read
of the wrong entry shows up as NaN. Tolerances: `_attention.assert_close_to_reference`.
"""

import math

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder
from cutlass_w8a8.models import llama as llama_mod

from cutlass_w8a8.testing.attention import assert_close_to_reference, make_inputs, opcheck_cases, reference, sdpa_formulation
from _fused_quant_cuda import capture

pytestmark = pytest.mark.cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (H, KVH): Llama-3-8B's 32 / 8 (G = 4), the decoder tests' 4 / 2, multi-head, a single kv head (G = 16), and
# groups of 3 and 6 (12 / 4, 12 / 2), which the split kernel serves with CTAs of G' = 1 and 2 query heads
HEADS = [(32, 8), (4, 2), (8, 8), (16, 1), (12, 4), (12, 2)]


def poison_unread(kv, slots, positions):
    """NaN in every cache entry the op must not read: unused slots, and positions past each row's own."""
    keep = torch.zeros(kv.shape[0], kv.shape[3], dtype=torch.bool, device=kv.device)
    for slot, pos in zip(slots.tolist(), positions.tolist()):
        keep[slot, : pos + 1] = True
    kv.masked_fill_(~keep[:, None, None, :, None], float("nan"))


def run_checked(q, kv, slots, positions, scale=None, what=""):
    """Both forms of the op into NaN-poisoned outputs; equal to each other and close to float64.

    Measured (H100): bf16 and float16 within half an ulp of the float64 result (the final rounding), float32
    within 0.07 of its bound, over the shapes of test_matches_float64_reference and S = 2048."""
    b, h, d = q.shape
    poison_unread(kv, slots, positions)
    out = torch.full((b, h * d), float("nan"), dtype=q.dtype, device=q.device)
    assert cw.decode_attention(q, kv, slots, positions, scale, out=out) is out
    functional = cw.decode_attention(q, kv, slots, positions, scale)
    assert functional.shape == (b, h * d) and functional.dtype == q.dtype and functional.is_contiguous()
    assert torch.equal(functional, out), what
    ref_scale = 1.0 / math.sqrt(d) if scale is None else scale
    assert_close_to_reference(out, reference(q, kv, slots, positions, ref_scale), q.dtype, what)
    return out


def positions_for(b, s, seed):
    """0, S - 1 and S // 2 first, then random positions."""
    g = torch.Generator().manual_seed(seed)
    first = [0, s - 1, s // 2]
    return (first + torch.randint(0, s, (max(b - 3, 0),), generator=g).tolist())[:b]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda hk: f"H{hk[0]}-KVH{hk[1]}")
@pytest.mark.parametrize("b", [1, 7, 64])
def test_matches_float64_reference(b, heads, d, dtype):
    """S = 300 (not a multiple of the 32 to 512 positions a block reads per step)."""
    h, kvh = heads
    s = 300
    cases = [[0], [s // 2], [s - 1]] if b == 1 else [positions_for(b, s, b + d)]
    for positions in cases:
        q, kv, slots, pos = make_inputs(b, h, kvh, d, s, dtype, "cuda", seed=b * 131 + d, positions=positions)
        run_checked(q, kv, slots, pos, what=f"positions {positions[:4]}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [8, 16, 24, 32, 40, 96, 192, 256])
def test_other_head_dims(d, dtype):
    """Every lane layout of the kernel: 1 to 32 lanes per position, lanes left idle where D is not a power-of-
    two number of 16-byte vectors (24, 40, 96, 192), and float32 rows of two vectors per lane (192, 256)."""
    q, kv, slots, pos = make_inputs(5, 4, 2, d, 70, dtype, "cuda", seed=d, positions=[0, 69, 1, 35, 64])
    run_checked(q, kv, slots, pos, scale=0.7 / math.sqrt(d))


# (H, KVH, D) whose H * D / 4 output vectors split unevenly over the cluster combine's 8 CTAs (sm90): 2 vectors (6
# CTAs idle), 30 (a short last part, heads across CTAs), 70, 1054 (two vectors a thread, a short second one)
UNEVEN_ROWS = [(1, 1, 8), (3, 1, 40), (5, 5, 56), (17, 1, 248)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hkd", UNEVEN_ROWS, ids=lambda hkd: "H{}-KVH{}-D{}".format(*hkd))
def test_rows_split_unevenly_over_the_combine(hkd, dtype):
    """Rows whose outputs the cluster combine's CTAs share unevenly (and G' = 1 heads), S = 300, B 3."""
    h, kvh, d = hkd
    q, kv, slots, pos = make_inputs(3, h, kvh, d, 300, dtype, "cuda", seed=h * d, positions=[299, 0, 150])
    run_checked(q, kv, slots, pos, scale=0.7 / math.sqrt(d), what=f"H {h} D {d}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [2048, 4096])
@pytest.mark.parametrize("b", [1, 64])
def test_long_cache(b, s, dtype):
    """Llama-3-8B heads over S = 2048 and 4096, positions 0 and S - 1 included: B = 1 at S - 1 is the case
    split-KV exists for (one row of 8 head groups spread over many splits)."""
    q, kv, slots, pos = make_inputs(b, 32, 8, 128, s, dtype, "cuda", seed=b + s,
                                    positions=[s - 1] if b == 1 else positions_for(b, s, 3))
    run_checked(q, kv, slots, pos)


# (H, KVH, D, dtype): Qwen3-30B-A3B heads (G' = 8, 16 lanes a position), 12 / 2 x 64 in float16 (G' = 2), and D = 40
# in float32 (G' = 1, 10 vectors over 16 lanes: idle lanes past D)
Q_LAYOUTS = [(32, 4, 128, torch.bfloat16), (12, 2, 64, torch.float16), (4, 2, 40, torch.float32)]


@pytest.mark.parametrize("hkd", Q_LAYOUTS, ids=lambda c: f"H{c[0]}-KVH{c[1]}-D{c[2]}-{str(c[3])[6:]}")
def test_q_loads_aligned_or_not_give_the_same_bits(hkd):
    """The split step loads q in 16-byte vectors where q's pointer and both strides are 16-byte aligned (make_inputs'
    q, a view of the fused qkv output, is), else element by element: the same values copied into a buffer one
    element off 16 bytes (a misaligned pointer) and into rows of D + 1 elements (an odd stride(1)) give the aligned
    q's outputs bit for bit, each also checked against the float64 reference."""
    h, kvh, d, dtype = hkd
    q, kv, slots, pos = make_inputs(3, h, kvh, d, 300, dtype, "cuda", seed=h + d, positions=[299, 0, 150])
    expect = run_checked(q, kv, slots, pos, what="aligned q")
    shifted = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")[1:].view(q.shape)
    padded = torch.empty(3, h, d + 1, dtype=dtype, device="cuda")[:, :, :d]
    for other, what in ((shifted, "q one element off 16 bytes"), (padded, "q rows of D + 1 elements")):
        other.copy_(q)
        assert torch.equal(run_checked(other, kv, slots, pos, what=what), expect), what


# Around the split kernel's chunk edges (chunks are multiples of 8 positions, at least 32 of a full cache)
EDGE_POSITIONS = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 255, 256, 257, 1000, 4094, 4095]


@pytest.mark.parametrize("heads", [(32, 8), (12, 2), (64, 8)], ids=lambda hk: f"H{hk[0]}-KVH{hk[1]}")
def test_mixed_short_and_long_rows(heads):
    """Rows of very different lengths in one batch (S = 4096): each row's chunks come from its own position,
    so short rows leave most splits idle and long rows use them all. Then B = 1 at each of those positions."""
    h, kvh = heads
    q, kv, slots, pos = make_inputs(len(EDGE_POSITIONS), h, kvh, 128, 4096, torch.bfloat16, "cuda", seed=h,
                                    positions=EDGE_POSITIONS)
    run_checked(q, kv, slots, pos, what="mixed batch")
    for i in (0, 1, 5, 7, 11, 15):
        q1, kv1, slots1, pos1 = make_inputs(1, h, kvh, 128, 4096, torch.bfloat16, "cuda", seed=h + i,
                                            positions=[EDGE_POSITIONS[i]])
        run_checked(q1, kv1, slots1, pos1, what=f"B = 1 at position {EDGE_POSITIONS[i]}")


@pytest.mark.parametrize("q_scale", [4.0, 16.0])
def test_peaked_softmax(q_scale):
    """Large scores (a few positions dominate, the running maximum grows late): the max-subtraction keeps
    exp finite and the rescaling exact enough."""
    q, kv, slots, pos = make_inputs(16, 8, 2, 128, 512, torch.bfloat16, "cuda", seed=9, q_scale=q_scale,
                                    positions=positions_for(16, 512, 4))
    run_checked(q, kv, slots, pos)


def test_single_position_is_exactly_the_value():
    """Position 0: one weight of exactly 1, so out == V[slot, kvh, 0] bit for bit, whatever q and the scale."""
    q, kv, slots, pos = make_inputs(9, 8, 2, 128, 64, torch.bfloat16, "cuda", seed=2, positions=[0] * 9,
                                    q_scale=30.0)
    out = cw.decode_attention(q, kv, slots, pos, 3.0).view(9, 8, 128)
    expect = kv[slots, 1, :, 0].repeat_interleave(4, dim=1)
    assert torch.equal(out, expect)


def test_rows_are_independent():
    """Row-wise: at a given B, row b's output depends on row b's inputs only; changing the other rows' queries,
    slots and positions leaves it bit for bit unchanged (CUDA-graph node updates to fewer rows rely on this;
    tests/graphs/test_graph_update_cuda.py shrinks the captured nodes themselves). A smaller eager batch may choose
    another split count, so the same row computed at another B agrees to rounding, not bitwise."""
    q, kv, slots, pos = make_inputs(64, 32, 8, 128, 256, torch.bfloat16, "cuda", seed=12)
    full = cw.decode_attention(q, kv, slots, pos)
    keep = [0, 17, 63]
    other = torch.ones(64, dtype=torch.bool, device="cuda")
    other[keep] = False
    q2, slots2, pos2 = q.clone(), slots.clone(), pos.clone()
    q2[other] = torch.randn_like(q2[other])
    slots2[other] = slots2[other].flip(0)
    pos2[other] = 255 - pos2[other]
    changed = cw.decode_attention(q2, kv, slots2, pos2)
    assert torch.equal(changed[keep], full[keep])
    assert not torch.equal(changed[other], full[other])
    ref = reference(q, kv, slots, pos, 1.0 / math.sqrt(128))
    for k in (1, 5, 33):
        part = cw.decode_attention(q[:k], kv, slots[:k], pos[:k])
        assert_close_to_reference(part, ref._replace(out=ref.out[:k], abs_v=ref.abs_v[:k], s_abs=ref.s_abs[:k],
                                                     n=ref.n[:k]), torch.bfloat16, f"B = {k}")


def test_empty_batch():
    q, kv, slots, pos = make_inputs(0, 8, 2, 64, 16, torch.bfloat16, "cuda")
    assert cw.decode_attention(q, kv, slots, pos).shape == (0, 512)


@torch.no_grad()
def test_cuda_graph_replay_with_new_positions_and_slots():
    """Captured once (the out= and the functional forms) on static buffers laid out as the decoder's, then
    replayed with new q, cache contents, positions and slots copied in: each replay equals the eager op
    bit for bit and the float64 reference. Capture and replays run under sync debug mode "error"."""
    b, h, kvh, d, s, num_slots = 8, 32, 8, 128, 256, 12
    qkv = torch.zeros(b, h + 2 * kvh, d, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(num_slots, 2, kvh, s, d, dtype=torch.bfloat16, device="cuda")
    rows = torch.zeros(b, 3, dtype=torch.int64, device="cuda")
    q, slots, positions = qkv[:, :h], rows[:, 2], rows[:, 1]
    out = torch.empty(b, h * d, dtype=torch.bfloat16, device="cuda")

    steps = []
    for i in range(4):
        pos = [0, s - 1, 1, 2, 100, 255, 17, 64] if i == 0 else positions_for(b, s, 20 + i)
        q_i, kv_i, slots_i, pos_i = make_inputs(b, h, kvh, d, s, torch.bfloat16, "cuda", seed=40 + i,
                                                positions=pos, num_slots=num_slots)
        poison_unread(kv_i, slots_i, pos_i)
        steps.append((q_i, kv_i, slots_i, pos_i, reference(q_i, kv_i, slots_i, pos_i, 1.0 / math.sqrt(d))))
    torch.cuda.synchronize()

    def both_forms():
        cw.decode_attention(q, kv, slots, positions, out=out)
        return cw.decode_attention(q, kv, slots, positions)

    torch.cuda.set_sync_debug_mode("error")
    try:
        graph, functional = capture(both_forms, warm_up=lambda: cw.decode_attention(q, kv, slots, positions, out=out))
        results = []
        for q_i, kv_i, slots_i, pos_i, _ in steps:
            q.copy_(q_i)
            kv.copy_(kv_i)
            slots.copy_(slots_i)
            positions.copy_(pos_i)
            out.fill_(float("nan"))
            graph.replay()
            eager = cw.decode_attention(q, kv, slots, positions)
            results.append((out.clone(), functional.clone(), eager))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, ((replayed, replayed_functional, eager), step) in enumerate(zip(results, steps)):
        assert torch.equal(replayed, eager), f"replay {i}"
        assert torch.equal(replayed_functional, eager), f"replay {i}"
        assert_close_to_reference(replayed, step[4], torch.bfloat16, f"replay {i}")


def test_opcheck_cuda():
    for name, op, args in opcheck_cases("cuda"):
        try:
            torch.library.opcheck(op, args)
        except Exception as exc:
            raise AssertionError(f"opcheck failed for {name}: {exc}") from exc


def test_cpu_reference_agrees():
    """The CPU implementation (SDPA over the masked cache) and the kernel agree to bf16 rounding."""
    q, kv, slots, pos = make_inputs(6, 8, 2, 64, 40, torch.bfloat16, "cuda", seed=8,
                                    positions=[0, 39, 20, 3, 38, 11])
    gpu = cw.decode_attention(q, kv, slots, pos)
    cpu = cw.decode_attention(q.cpu(), kv.cpu(), slots.cpu(), pos.cpu())
    err = float((gpu.cpu().double() - cpu.double()).norm() / cpu.double().norm())
    assert err < 1e-2, err


def _former_attention_forward(self, x, ctx):
    """LlamaAttention.forward before decode_attention: index_select of whole slots + masked SDPA."""
    b = x.shape[0]
    h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
    qkv = self.qkv_proj(x).view(b, h + 2 * kvh, d)
    llama_mod._rope_(qkv[:, : h + kvh], ctx.rope)
    heads = torch.arange(2 * kvh, device=x.device)  # the cache rows of the new keys, then values
    kv_index = (ctx.slots.unsqueeze(1) * (2 * kvh) + heads) * self.kv_cache.shape[3] + ctx.positions.unsqueeze(1)
    self.kv_cache.view(-1, d).index_put_((kv_index,), qkv[:, h:])
    return self.o_proj(sdpa_formulation(qkv[:, :h], self.kv_cache, ctx.slots, ctx.positions))


@pytest.mark.parametrize("quant,dtype,rel", [(None, torch.float32, 1e-5), (None, torch.bfloat16, 2e-2),
                                             ("int8", torch.bfloat16, 6e-2)])
@torch.no_grad()
def test_decoder_close_to_former_attention(quant, dtype, rel, monkeypatch):
    """The decoder on the GPU with decode_attention against the same decoder with the former SDPA attention:
    6 steps of 5 rows, logits within a relative Frobenius error `rel`. Measured (H100, before the fused
    norm/MLP kernels): float32 5e-7 (summation order only), bf16 0.6-0.8% (SDPA rounds its probabilities to
    bf16, the kernel keeps them in float32, and the difference propagates through the layers). int8 was not
    measured: its bound is test_decoder_cuda's int8 one, as activations near a quantization bin boundary
    may fall into the neighbouring bin."""
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position=256)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(16, generator=g)[:5]
    start = torch.randint(0, 50, (5,), generator=g)
    steps = [(torch.randint(0, 1024, (5,), generator=g).cuda(), (start + i).cuda(), slots.cuda())
             for i in range(6)]
    logits = {}
    for name in ("op", "former"):
        model = LlamaDecoder(cfg, quant, max_batch=16, max_seq_len=64, device="cuda", dtype=dtype, seed=0)
        with monkeypatch.context() as m:
            if name == "former":
                m.setattr(llama_mod.LlamaAttention, "forward", _former_attention_forward)
            logits[name] = [model(*s).double() for s in steps]
    for i, (a, b) in enumerate(zip(logits["op"], logits["former"])):
        err = float((a - b).norm() / b.norm())
        assert err < rel, f"step {i}: relative error {err:.3g}"
