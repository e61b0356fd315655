"""decode_attention's one-kernel path (issue 36) against its two-kernel path: the same bits.

csrc/attention/decode_attention.cu serves a decode step in one kernel (decode_attention_fused_kernel, a thread-block
cluster per row that merges the splits through distributed shared memory) where fused_plan allows it (sm90, 16-bit
q, 32 < D <= 128, the row's head groups x splits within one cluster), else with the split and combine kernels. Both
use the same splits (choose_splits) and the same float operations in the same order, so every output here is
compared with torch.equal (never a tolerance): the fused path (allowed through the private switch
cutlass_w8a8._ext.set_decode_attention_fused, off by default) against the two kernels (the switch off), for
decode_attention and decode_attention_quant (int8 / fp8, dynamic per-token and static scales), over B 1..16, positions 0..S-1 (ragged
rows), GQA groups 1, 2, 4, 8, D 64 / 128, bfloat16 / float16; and a CUDA graph's replays against the eager op.
Each comparison first checks, through cutlass_w8a8._ext.decode_attention_path, which path the shape takes, so a
rule change that sends everything to one path fails test_paths_of_the_target_shapes instead of passing silently.
The accuracy of the attention itself is test_decode_attention_cuda.py's (against float64).

The split count follows the split rule of the process (CUTLASS_W8A8_ATTN_SPLITS, read once per process): the wave
rule by default, whose count also follows the split kernel's occupancy, or the CTAs-per-SM rule with
CUTLASS_W8A8_ATTN_SPLITS=ctas (test_decode_attention_knobs_cuda.py runs this file so). The bitwise comparisons hold
under either; the paths asserted here hold under either rule unless marked as the ctas rule's (CTAS_RULE).
"""

import math
import os

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8 import _ext
from cutlass_w8a8.testing.attention import make_inputs
from _fused_quant_cuda import replay_and_eager

pytestmark = pytest.mark.cuda

OPS = torch.ops.cutlass_w8a8
DTYPES = [torch.bfloat16, torch.float16]
# (H, KVH): GQA groups 1, 2, 4, 8 (G' = 1, 2, 4, 8 query heads per split unit); (32, 4) is Qwen3-30B-A3B's,
# (32, 8) Llama-3-8B's
HEADS = [(8, 8), (16, 8), (32, 8), (32, 4)]
BATCHES = [1, 2, 3, 5, 8, 11, 16]
# A cache length the fused path serves at any B: at the default min chunk of 32 positions (kMinChunk in
# csrc/attention/decode_attention.cu) a cache of 128 has at most 4 splits under either rule, so every layout here
# makes at most 8 head groups x 4 units (Qwen3-30B-A3B's 8 groups of G' = 4 at the default cap of 4 query heads per
# CTA, CUTLASS_W8A8_ATTN_HEADS_PER_CTA), one cluster of at most 16 CTAs of 2. At S = 256 those 8 groups make up to
# 8 x 8 units and B 1 takes the two kernels; at S = 512 Qwen3's B 1 has 16 splits.
S_FUSED = 128
# The process runs the ctas rule (CUTLASS_W8A8_ATTN_SPLITS=ctas), whose split counts the ctas-only path checks below
# assume (choose_splits: ceil(2 x SMs / (B x H / G')), at most S / 32); unset or "waves": the wave rule.
CTAS_RULE = os.environ.get("CUTLASS_W8A8_ATTN_SPLITS") == "ctas"


def _path(q, kv):
    b, h, d = q.shape
    return _ext.decode_attention_path(q.device.index or 0, b, h, kv.shape[2], kv.shape[3], d, q.dtype)


class _Paths:
    """Runs a callable on the fused path (the switch on for the block) and on the two-kernel path (off)."""

    def __enter__(self):
        self.previous = _ext.set_decode_attention_fused(True)
        return self

    def __exit__(self, *exc):
        _ext.set_decode_attention_fused(self.previous)

    @staticmethod
    def split(fn, *args):
        """fn(*args) with the fused path forbidden."""
        previous = _ext.set_decode_attention_fused(False)
        try:
            return fn(*args)
        finally:
            _ext.set_decode_attention_fused(previous)


def _positions(b, s, seed):
    """0, S - 1, 1 and S // 2 first (an empty-but-one split, the full cache), then random: ragged rows."""
    g = torch.Generator().manual_seed(seed)
    first = [0, s - 1, 1, s // 2]
    return (first + torch.randint(0, s, (max(b - 4, 0),), generator=g).tolist())[:b]


def _inputs(b, heads, d, s, dtype, seed):
    h, kvh = heads
    return make_inputs(b, h, kvh, d, s, dtype, "cuda", seed=seed, positions=_positions(b, s, seed))


def _is_sm90():
    return torch.cuda.get_device_capability()[0] == 9


def _skip_unless_sm90():
    if not _is_sm90():
        pytest.skip("the one-kernel path runs on sm90 (thread-block clusters; other archs keep the two kernels)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda hk: f"H{hk[0]}-KVH{hk[1]}")
@pytest.mark.parametrize("s", [S_FUSED, 512, 4096])
def test_plain_equals_two_kernel_path(s, heads, d, dtype):
    """decode_attention, fused vs two kernels: torch.equal at every B in 1..16. Some B takes the fused path on sm90:
    under either rule at S_FUSED, where every layout's units fit one cluster at any split count up to S_FUSED / 32
    = 4 (at most 8 head groups x 4 units, U = 2); under the ctas rule at S <= 512 for every layout (at B 11 and 16
    on 132 SMs: 3 splits for 8 head groups)."""
    fused_seen = 0
    with _Paths() as paths:
        for b in BATCHES:
            q, kv, slots, positions = _inputs(b, heads, d, s, dtype, seed=b)
            fused_seen += _path(q, kv) == "fused"
            scale = 1.0 / math.sqrt(d)
            got = OPS.decode_attention(q, kv, slots, positions, scale)
            expect = paths.split(OPS.decode_attention, q, kv, slots, positions, scale)
            assert not torch.isnan(expect).any()
            assert torch.equal(got, expect), f"B={b} path={_path(q, kv)}"
            out = torch.full_like(got, float("nan"))
            OPS.decode_attention_out(out, q, kv, slots, positions, scale)
            assert torch.equal(out, expect), f"B={b} out="
    if _is_sm90() and (s == S_FUSED or (CTAS_RULE and s <= 512)):
        assert fused_seen > 0, f"no batch took the fused path at S = {s}"


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda hk: f"H{hk[0]}-KVH{hk[1]}")
def test_quant_equals_two_kernel_path(heads, d, dtype, static, qdtype):
    """decode_attention_quant, fused vs two kernels: q_out and the row scales bit for bit (the row's max |y| is a
    max over the cluster's CTAs in the fused path and in the sm90 cluster combine: exact in any grouping)."""
    if qdtype == torch.float8_e4m3fn and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    s = S_FUSED
    with _Paths() as paths:
        for b in BATCHES:
            q, kv, slots, positions = _inputs(b, heads, d, s, dtype, seed=100 + b)
            scale = 1.0 / math.sqrt(d)
            static_scale = None
            if static:
                y = paths.split(OPS.decode_attention, q, kv, slots, positions, scale)
                static_scale = (y.float().abs().amax() / (0.8 * (127.0 if qdtype == torch.int8 else 448.0))).reshape(1)
            got_q, got_s = OPS.decode_attention_quant(q, kv, slots, positions, scale, qdtype, static_scale)
            exp_q, exp_s = paths.split(OPS.decode_attention_quant, q, kv, slots, positions, scale, qdtype,
                                       static_scale)
            tag = f"B={b} path={_path(q, kv)}"
            assert torch.equal(got_q.view(torch.uint8), exp_q.view(torch.uint8)), f"{tag}: q_out"
            assert torch.equal(got_s, exp_s), f"{tag}: scales"



# Plans the sweeps above do not take: Llama-3-8B's heads at S = 48 (below 2 x 32 positions: one split under either
# rule, 8 units: U = 1, a portable cluster of 8 CTAs, no non-portable attribute), B = 64; D = 80 (10 of a group's 16
# lanes hold a vector, the rest zeros; a CTA's share of 40 vectors is two heads of 20) at S_FUSED, and for 8 / 8
# heads (G' = 1) at S = 256: 8 splits at B 2 under either rule, 8 x 8 units, 16 CTAs of U = 4 (512 threads).
EXTRA = [((32, 8), 64, 128, 48), ((32, 4), 3, 80, S_FUSED), ((8, 8), 2, 80, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,b,d,s", EXTRA, ids=lambda v: str(v))
def test_other_plans_equal_two_kernel_path(heads, b, d, s, dtype):
    """decode_attention and decode_attention_quant (int8, dynamic), fused vs two kernels, torch.equal."""
    q, kv, slots, positions = _inputs(b, heads, d, s, dtype, seed=200 + b)
    scale = 1.0 / math.sqrt(d)
    with _Paths() as paths:
        if _is_sm90():  # asked with the switch on: off (the default), every shape takes the two kernels
            assert _path(q, kv) == "fused"
        got = OPS.decode_attention(q, kv, slots, positions, scale)
        expect = paths.split(OPS.decode_attention, q, kv, slots, positions, scale)
        assert torch.equal(got, expect)
        got_q, got_s = OPS.decode_attention_quant(q, kv, slots, positions, scale, torch.int8, None)
        exp_q, exp_s = paths.split(OPS.decode_attention_quant, q, kv, slots, positions, scale, torch.int8, None)
        assert torch.equal(got_q, exp_q)
        assert torch.equal(got_s, exp_s)

# (H, KVH, B, S, path on sm90, the switch on) under either split rule, on 64 to 256 SMs, at the default cap of 4
# query heads per CTA (Qwen3-30B-A3B's 32 / 4 heads in 8 groups of 4, as Llama-3-8B's 32 / 8): at S = 128 at most 4
# splits, 8 x 4 split units, one cluster of at most 16 CTAs of 2 units; at S = 256 and B = 1, 8 splits (8 x 8 units:
# too many; at a cap of 8, CUTLASS_W8A8_ATTN_HEADS_PER_CTA=8, which test_decode_attention_knobs_cuda runs this file
# with, Qwen3's 4 groups of 8 x 8 units fit one cluster: that path is keyed by the process's G' for the shape,
# cutlass_w8a8._ext.decode_attention_heads_per_cta); at S = 512 and B = 1, 16 splits (the wave rule too: 128 CTAs,
# one wave); Llama-3-8B at B = 1 has 8 x 16 units; at B = 64 few splits (the ctas rule: one, 8 units; the wave rule:
# at most 4, 8 x 4 units in 16 CTAs of 2, wherever 9 or fewer split CTAs are resident per SM on 132 SMs: 3 at
# G' = 4); Qwen3 at B = 1, S = 4096 up to 64 splits.
TARGETS = [(32, 4, 1, S_FUSED, "fused"), (32, 4, 8, S_FUSED, "fused"), (32, 8, 64, 512, "fused"),
           (32, 4, 1, 256, {1: "split", 2: "split", 4: "split", 8: "fused"}), (32, 4, 1, 512, "split"),
           (32, 8, 1, 512, "split"), (32, 4, 1, 4096, "split")]


@pytest.mark.parametrize("h,kvh,b,s,expected", TARGETS,
                         ids=lambda v: "by-heads-per-cta" if isinstance(v, dict) else str(v))
def test_paths_of_the_target_shapes(h, kvh, b, s, expected):
    """The path each of the measured shapes takes (D = 128, bfloat16) on sm90 (a path given per G' is the one of the
    G' this process runs the shape's group at); the switch sends every shape to the two kernels, and so do float32 q
    and devices other than sm90."""
    if isinstance(expected, dict):
        expected = expected[_ext.decode_attention_heads_per_cta(h // kvh)]
    dev = torch.cuda.current_device()
    with _Paths():
        path = _ext.decode_attention_path(dev, b, h, kvh, s, 128, torch.bfloat16)
        assert _ext.decode_attention_path(dev, b, h, kvh, s, 128, torch.float32) == "split"
        previous = _ext.set_decode_attention_fused(False)
        try:
            assert _ext.decode_attention_path(dev, b, h, kvh, s, 128, torch.bfloat16) == "split"
        finally:
            _ext.set_decode_attention_fused(previous)
    assert path == (expected if _is_sm90() else "split")


def test_fused_path_is_off_by_default():
    """The switch starts off (the two kernels serve every shape; csrc/attention/decode_attention.cu says why), and
    every test here restores it, so each one starts from the default."""
    previous = _ext.set_decode_attention_fused(False)
    assert previous is False
    dev = torch.cuda.current_device()
    assert _ext.decode_attention_path(dev, 1, 32, 4, S_FUSED, 128, torch.bfloat16) == "split"


def test_path_arguments_are_checked():
    with pytest.raises(ValueError, match="must divide"):
        _ext.decode_attention_path(0, 1, 32, 5, 512, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="must be positive"):
        _ext.decode_attention_path(0, 0, 32, 8, 512, 128, torch.bfloat16)


@pytest.mark.parametrize("quant", [None, torch.int8], ids=["plain", "int8"])
@pytest.mark.parametrize("heads,b,s", [((32, 4), 8, S_FUSED), ((32, 8), 16, 128)], ids=["qwen3-B8", "llama3-B16"])
def test_graph_replay_equals_eager(heads, b, s, quant):
    """The fused path captured once on static buffers, replayed with new q, cache, positions and slots copied in:
    each replay equals the eager fused op and the eager two-kernel op bit for bit. Capture and replays run under sync
    debug mode "error". The shapes take the fused path under either split rule: Qwen3-30B-A3B's 8 head groups (at
    the default cap of 4 heads per CTA) at S_FUSED (at most 4 splits: 8 x 4 units), Llama-3-8B's 8 at S = 128 (on
    an H200 3 splits at B 16 under either rule, 12 CTAs of 2 units)."""
    _skip_unless_sm90()
    h, kvh = heads
    d, num_slots = 128, b + 4
    qkv = torch.zeros(b, h + 2 * kvh, d, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(num_slots, 2, kvh, s, d, dtype=torch.bfloat16, device="cuda")
    rows = torch.zeros(b, 3, dtype=torch.int64, device="cuda")
    q, slots, positions = qkv[:, :h], rows[:, 2], rows[:, 1]
    scale = 1.0 / math.sqrt(d)

    def op():
        if quant is None:
            return (OPS.decode_attention(q, kv, slots, positions, scale),)
        return OPS.decode_attention_quant(q, kv, slots, positions, scale, quant, None)

    steps = [make_inputs(b, h, kvh, d, s, torch.bfloat16, "cuda", seed=60 + i, num_slots=num_slots,
                         positions=_positions(b, s, 70 + i)) for i in range(4)]
    with _Paths() as paths:
        assert _path(q, kv) == "fused"
        results = replay_and_eager(op, (q, kv, slots, positions), steps, eager=lambda: (op(), paths.split(op)))
    for i, (replayed, (eager, two_kernel)) in enumerate(results):
        for j, (r, e, t) in enumerate(zip(replayed, eager, two_kernel)):
            r, e, t = (x.view(torch.uint8) if x.element_size() == 1 else x for x in (r, e, t))
            assert torch.equal(r, e), f"replay {i} output {j} vs eager"
            assert torch.equal(r, t), f"replay {i} output {j} vs the two kernels"


@torch.no_grad()
@pytest.mark.parametrize("quant", [None, torch.int8], ids=["plain", "int8"])
def test_updatable_graph_set_rows(quant):
    """The fused kernel's node is row-wise (its cluster spans grid y only): UpdatableGraph.set_rows shrinks it to the
    first rows, whose outputs equal the eager op's rows at the captured batch (the splits stay the captured B's)."""
    _skip_unless_sm90()
    b, (h, kvh), d, s = 8, (32, 4), 128, S_FUSED
    q0, kv0, slots0, pos0 = _inputs(b, (h, kvh), d, s, torch.bfloat16, seed=80)
    q0 = q0.contiguous()
    scale = 1.0 / math.sqrt(d)

    def fn(q, kv, slots, positions):
        if quant is None:
            return (OPS.decode_attention(q, kv, slots, positions, scale),)
        return OPS.decode_attention_quant(q, kv, slots, positions, scale, quant, None)

    with _Paths():
        assert _path(q0, kv0) == "fused"
        upd = cw.graphs.UpdatableGraph(fn, [q0, kv0, slots0, pos0])
        assert {node.op for node in upd.nodes} == {"decode_attention_quant" if quant else "decode_attention"}
        for rows in (1, 3, 8):
            upd.set_rows(rows)
            q, kv, slots, positions = _inputs(b, (h, kvh), d, s, torch.bfloat16, seed=90 + rows)
            q = q.contiguous()
            got = upd(q, kv, slots, positions)
            eager = fn(q, kv, slots, positions)
            for j, (g, e) in enumerate(zip(got, eager)):
                g, e = (x[:rows].view(torch.uint8) if x.element_size() == 1 else x[:rows] for x in (g, e))
                assert torch.equal(g, e), f"rows={rows} output {j}"
