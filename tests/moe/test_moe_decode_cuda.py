"""`moe_decode_experts` on an sm90 GPU: the fused MoE decode path (2 kernels at top_k >= 4 within
csrc/moe/moe_decode.cu's speed rule or with CUTLASS_W8A8_MOE_DECODE_PREP=0, else 3) against the unfused CUDA chain
(`moe_align` -> `moe_permute_quant` -> `grouped_scaled_mm` -> `silu_mul_quant` -> `grouped_scaled_mm` ->
`moe_unpermute`) BIT FOR BIT, for int8, fp8 with per-channel and per-expert weight scales and block fp8, bfloat16 and
float16 outputs, float32 / float16 / bfloat16 x, T * top_k from 1 to 64, 8 and 128 experts, routings with empty
experts, all pairs on one expert and unrouted -1 ids, int32 and int64 ids; against the float64 reference of the
dequantized operands (`_moe_models.FakeQuantExperts`, the layer tests' SQNR bound `LAYER_SQNR_DB`); a fresh output
fully written (the caching allocator filled with NaN blocks first, two runs equal, no NaN); CUDA-graph capture of
`W8A8MoE.forward` at T = 1 and 8 replayed with new router logits equal to eager; the profiler: the layer at
T * top_k <= 64 launches `moe_decode_gate_up_kernel` and the token-major `moe_decode_down_tm_kernel` at top_k >= 4
(the expert-major `moe_decode_down_kernel` below), no `grouped_decode_kernel`, and at most 6 kernels per call with
the routing; the two-kernel and the three-kernel paths (CUTLASS_W8A8_MOE_DECODE_PREP, read once per process: one of
them in a subprocess) equal bit for bit on random routings with repeated experts and unrouted ids, and each runs the
kernels it should; `cutlass_w8a8._ext.moe_decode_path` (the rule the op launches by, which the kernel tests here
ask for the path they expect) on both sides of each of the rule's bounds under each switch value, its argument
checks and a bad switch value. (A device other than sm90 raises NotImplementedError: not testable
here.) The CPU op and the checks are tests/moe/test_moe_decode_cpu.py; the checks' C++ messages are held to the
Python ones by tests/test_misuse_table.py::test_row_on_cuda.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")  # _moe_models (the float64 reference) imports it

from _checkpoints import sqnr_db  # noqa: E402
from _moe_decode import ROUTES, SCHEMES, chain, decode_operands, random_x, routing  # noqa: E402
from _moe_models import LAYER_SQNR_DB, FakeQuantExperts  # noqa: E402
from _opcheck import run_opcheck  # noqa: E402
from test_moe_layer_cuda import graph_replays  # noqa: E402

pytestmark = pytest.mark.sm90

H, I = 256, 128
# (T, top_k): T * top_k from 1 to MOE_DECODE_MAX_PAIRS = 64
SIZES = [(1, 1), (1, 8), (3, 2), (8, 8), (16, 4), (64, 1), (32, 2)]
NAN_BLOCK_BYTES = [2**p for p in range(9, 23)]  # 512 B .. 4 MiB: the allocator's small and large pools


@functools.lru_cache(maxsize=None)
def _operands(scheme, e, expert_2d=False):
    ops = decode_operands(scheme, e, H, I, "cpu", seed=e, expert_shape=(-1, 1) if expert_2d else (-1,))
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


def _fill_allocator_with_nan():
    """Allocate, fill with NaN and free blocks of many sizes: a fresh output or workspace that the op does not write
    fully then holds NaN (bytes 0xFF: NaN in bf16 / fp16 / fp32, and non-zero counters)."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda") for n in NAN_BLOCK_BYTES for _ in range(2)]
    del blocks


def _fused(x, ids, wts, ops, out_dtype=torch.bfloat16):
    """The op twice, after filling the allocator with NaN before each run: the two results equal, without NaN."""
    outs = []
    for _ in range(2):
        _fill_allocator_with_nan()
        outs.append(cw.moe_decode_experts(x, ids, wts, out_dtype=out_dtype, **ops))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1]), "two runs differ (a fresh output or workspace not fully written?)"
    assert not torch.isnan(outs[0].float()).any()
    return outs[0]


def _assert_equals_chain(x, ids, wts, ops, out_dtype=torch.bfloat16, what=""):
    out = _fused(x, ids, wts, ops, out_dtype)
    want = chain(x, ids, wts, out_dtype=out_dtype, **ops)
    assert out.shape == want.shape and out.dtype == out_dtype and out.is_cuda and out.is_contiguous(), what
    assert torch.equal(out, want), (what, (out.float() - want.float()).abs().max().item())
    e = ops["w13"].shape[0]
    routed = ((ids >= 0) & (ids < e)).any(1)
    assert bool((out[~routed] == 0).all()), what
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t, k", SIZES)
@pytest.mark.parametrize("e", [8, 128])
@pytest.mark.parametrize("route", ROUTES)
def test_equals_the_chain_bitwise(scheme, t, k, e, route):
    ops = _operands(scheme, e)
    ids, wts = routing(t, k, e, route, "cuda", seed=t * 100 + k)
    x = random_x(t, H, device="cuda", seed=t + k)
    _assert_equals_chain(x, ids, wts, ops, what=(scheme, t, k, e, route))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("h", [2048, 4608, 6144])
@pytest.mark.parametrize("t, k, route", [(1, 8, "random"), (8, 8, "random"), (16, 4, "one-expert")])
def test_equals_the_chain_bitwise_wide(scheme, h, t, k, route):
    """Qwen3-30B-A3B's H = 2048 (8 K blocks of 256: one per warp) and H = 4608 (18: the warps take 2 or 3), I = 768
    (48 gate/up CTAs per expert), T 1 and 8 at top-8: the sums of every warp and block count. Random routing leaves
    at most 8 pairs per expert here (one-tile chunks); all 64 pairs of T 16 at top-4 on one expert make 16-pair
    chunks (two token tiles, NT = 2) with every warp busy. The two-kernel path's gate/up shared memory (T rows of
    about H bytes): H 4608 and 6144 leave runs of 2048 elements partly outside the row; T 8 at H 6144 takes 49.7 KB
    (above the 48 KB that needs the kernel's opt-in); T 16 at H 4608 and 6144 would take more than 64 KiB, so that
    call takes the three-kernel path."""
    ops = _wide_operands(scheme, h)
    ids, wts = routing(t, k, 8, route, "cuda", seed=h + t)
    x = random_x(t, h, device="cuda", seed=h + t + 1)
    _assert_equals_chain(x, ids, wts, ops, what=(scheme, h, t, k, route))


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if "block" not in s])
@pytest.mark.parametrize("h, i", [(2112, 784), (2128, 784), (1040, 400)])
@pytest.mark.parametrize("t, k", [(1, 8), (8, 8), (16, 4)])
def test_equals_the_chain_bitwise_unaligned(scheme, h, i, t, k):
    """Row-wise H and I that are multiples of 16 but not of 128 (block fp8 needs 128): the two-kernel path's shared
    x rows (their pitch and a partial last run of the row) and h rows (a partial last 16-byte group of a warp's row)
    outside the 128-multiples every other case uses; T 16 at top-4 the two-token-tile gate/up."""
    ops = decode_operands(scheme, 8, h, i, "cpu", seed=h + i)
    ops = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in ops.items()}
    ids, wts = routing(t, k, 8, "random", "cuda", seed=h + t)
    x = random_x(t, h, device="cuda", seed=h + t + 2)
    _assert_equals_chain(x, ids, wts, ops, what=(scheme, h, i, t, k))


@functools.lru_cache(maxsize=None)
def _wide_operands(scheme, h):
    ops = decode_operands(scheme, 8, h, 768, "cpu", seed=h)
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("i", [384, 2176])
@pytest.mark.parametrize("t, k, route", [(1, 8, "random"), (8, 8, "random"), (4, 2, "random")])
def test_equals_the_chain_bitwise_long_i(scheme, i, t, k, route):
    """The down GEMM's K = I over several 256-byte blocks with a half block at the end: I = 384 (2 blocks: the
    token-major kernel's one-block-ahead load of a tail block; the expert-major kernel's R = 4 tiles per CTA) and
    I = 2176 (9 blocks: a second round of the 8 per-warp accumulators, whose one block is the tail; expert-major
    R = 1 with warp 0 taking 2 blocks). Token-major at top-8, expert-major at top-2. The other tests' I is 128 or
    768 (one block with a tail, or 3 whole blocks)."""
    ops = _long_i_operands(scheme, i)
    ids, wts = routing(t, k, 8, route, "cuda", seed=i + t)
    x = random_x(t, H, device="cuda", seed=i + t + 1)
    _assert_equals_chain(x, ids, wts, ops, what=(scheme, i, t, k, route))


@functools.lru_cache(maxsize=None)
def _long_i_operands(scheme, i):
    ops = decode_operands(scheme, 8, H, i, "cpu", seed=i)
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}


def _two_kernel(t, k, h=H, i=I, scheme="int8"):
    """Whether this process runs the two-kernel path at (T, top_k, H, I) for ``scheme``: csrc/moe/moe_decode.cu's
    own_quant (top_k >= 4, shared memory, the speed rule, CUTLASS_W8A8_MOE_DECODE_PREP), asked through
    cutlass_w8a8._ext.moe_decode_path; test_decode_path_query_* hold that answer to the rule's bounds."""
    return cw._ext.moe_decode_path(t, k, h, i, SCHEMES[scheme][2]) == "two-kernel"


# (T, top_k, H, I, group_size, path unset, path with CUTLASS_W8A8_MOE_DECODE_PREP=0); with =1 every case takes the
# three kernels. csrc/moe/moe_decode.cu's own_quant: top_k >= 4; the speed rule T x H <= 2048 and top_k x I <= 6144
# (ignored at 0); both kernels' dynamic shared memory <= 64 KiB (gate/up: T rows of own_x_pitch(H) = (H + 63) / 128 x
# 128 + 64 bytes, then T scales, or T x H / 128 with block scales, of 4 bytes; down: 8 x I bytes, plus 8 x I / 128
# scales with block scales).
TWO, THREE = "two-kernel", "three-kernel"
PATH_CASES = [
    (1, 8, 2048, 768, 0, TWO, TWO),        # Qwen3-30B-A3B at T 1: T x H = 2048 and top_k x I = 6144, both at the bound
    (1, 8, 2048, 768, 128, TWO, TWO),      # the same, block fp8
    (1, 8, 2064, 768, 0, THREE, TWO),      # T x H = 2064: one multiple of 16 above
    (2, 8, 1024, 768, 0, TWO, TWO),        # T x H = 2048 at T 2
    (2, 8, 1040, 768, 0, THREE, TWO),      # T x H = 2080
    (1, 8, 2048, 784, 0, THREE, TWO),      # top_k x I = 6272
    (1, 4, 256, 1536, 0, TWO, TWO),        # top_k x I = 6144 at top-4
    (1, 4, 256, 1552, 0, THREE, TWO),      # 6208
    (1, 4, 256, 1536, 128, TWO, TWO),      # 6144, block fp8
    (1, 4, 256, 1664, 128, THREE, TWO),    # 6656, block fp8 (the next multiple of 128)
    (4, 16, 256, 384, 0, TWO, TWO),        # top-16: 64 pairs, T x H = 1024, top_k x I = 6144
    (1, 3, 256, 128, 0, THREE, THREE),     # top_k 3: the expert-major down, whatever the switch
    (1, 4, 256, 128, 0, TWO, TWO),         # top_k 4: the token-major down
    (64, 1, 256, 128, 0, THREE, THREE),    # top_k 1 at 64 pairs
    (16, 4, 256, 128, 0, THREE, TWO),      # T x H = 4096; gate/up's shared memory 5184 bytes
    (16, 4, 4032, 128, 0, THREE, TWO),     # gate/up's shared memory 16 x 4032 + 64 = 64576 bytes: fits
    (16, 4, 4096, 128, 0, THREE, THREE),   # 16 x 4160 + 64 = 66624 bytes: does not fit, even at 0
    (16, 4, 3968, 128, 0, THREE, TWO),     # 64576 bytes row-wise
    (16, 4, 3968, 128, 128, THREE, THREE),  # block fp8: 64512 + 16 x 31 x 4 = 66496 bytes
    (1, 4, 256, 8192, 0, THREE, TWO),      # down's shared memory 8 x 8192 = 65536 bytes: exactly fits
    (1, 4, 256, 8192, 128, THREE, THREE),  # block fp8: 65536 + 8 x 64 x 4 = 67584 bytes
    (1, 4, 256, 8208, 0, THREE, THREE),    # 65664 bytes
]


def _want_paths(switch):
    return [{"": unset, "0": zero, "1": THREE}[switch] for *_, unset, zero in PATH_CASES]


def _query_paths_in_a_process(value):
    """cutlass_w8a8._ext.moe_decode_path of every PATH_CASES case in a fresh process with
    CUTLASS_W8A8_MOE_DECODE_PREP = value (None: unset)."""
    cases = [c[:5] for c in PATH_CASES]
    code = ("import cutlass_w8a8 as cw\n"
            f"print('PATHS', [cw._ext.moe_decode_path(*c) for c in {cases!r}])\n")
    env = {k: v for k, v in os.environ.items() if k != "CUTLASS_W8A8_MOE_DECODE_PREP"}
    if value is not None:
        env["CUTLASS_W8A8_MOE_DECODE_PREP"] = value
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=pathlib.Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PATHS "))
    return ast.literal_eval(line[len("PATHS "):])


def test_decode_path_query_at_the_rule_bounds():
    """cutlass_w8a8._ext.moe_decode_path (csrc/moe/moe_decode.cu own_quant, the rule the op launches by; the kernel
    tests above check the op's launches against it) on both sides of each of the rule's bounds (PATH_CASES): top_k 3
    / 4, T x H and top_k x I at and just above the speed rule's 2048 / 6144, and each kernel's shared memory at and
    above 64 KiB. In this process under its own CUTLASS_W8A8_MOE_DECODE_PREP, then in one fresh process per other
    value (unset, 0, 1: read once per process)."""
    switch = os.environ.get("CUTLASS_W8A8_MOE_DECODE_PREP", "")
    got = [cw._ext.moe_decode_path(*c[:5]) for c in PATH_CASES]
    assert got == _want_paths(switch), list(zip(PATH_CASES, got))
    for value in ("", "0", "1"):
        if value != switch:
            other = _query_paths_in_a_process(value or None)
            assert other == _want_paths(value), (value, list(zip(PATH_CASES, other)))


@pytest.mark.parametrize("args, name", [((0, 8, 2048, 768, 0), "`tokens` and `top_k` must be positive"),
                                        ((1, 0, 2048, 768, 0), "`tokens` and `top_k` must be positive"),
                                        ((9, 8, 2048, 768, 0), "`tokens` x `top_k` = 9 x 8"),
                                        ((1, 65, 2048, 768, 0), "`tokens` x `top_k` = 1 x 65"),
                                        ((1, 8, 2048, 768, 64), "`group_size` must be 0 (per-token) or 128"),
                                        ((1, 8, 2056, 768, 0), "`hidden` must be a positive multiple of 16"),
                                        ((1, 8, 2064, 768, 128), "`hidden` must be a positive multiple of 128"),
                                        ((1, 8, 0, 768, 0), "`hidden` must be a positive multiple of 16"),
                                        ((1, 8, 2048, 776, 0), "`intermediate` must be a positive multiple of 16"),
                                        ((1, 8, 2048, 784, 128), "`intermediate` must be a positive multiple of 128"),
                                        ((1, 8, 2048, -768, 0), "`intermediate` must be a positive multiple of 16")])
def test_decode_path_query_checks_its_arguments(args, name):
    with pytest.raises(ValueError, match=re.escape(f"cutlass_w8a8._moe_decode_path: {name}")):
        cw._ext.moe_decode_path(*args)


def test_decode_path_query_refuses_a_bad_switch_value():
    """A bad CUTLASS_W8A8_MOE_DECODE_PREP makes moe_decode_path raise the op's ValueError (the same message, naming
    the variable), in a fresh process: the switch is read once per process."""
    code = ("import cutlass_w8a8 as cw\n"
            "try:\n"
            "    cw._ext.moe_decode_path(1, 8, 2048, 768, 0)\n"
            "except ValueError as exc:\n"
            "    print('RAISED', exc)\n")
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    r = subprocess.run([sys.executable, "-c", code], env={**env, "CUTLASS_W8A8_MOE_DECODE_PREP": "on"},
                       capture_output=True, text=True, timeout=300, cwd=pathlib.Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RAISED moe_decode_experts: CUTLASS_W8A8_MOE_DECODE_PREP must be 0 or 1 (or unset), got 'on'" in r.stdout, \
        r.stdout


def _launches(kernel, scheme, t, k):
    """The profiled names of the ``kernel`` launches in one moe_decode_experts call (``scheme``'s operands, 8 experts,
    T x top_k random routing, seeds 3 and 4) after a warm-up call; skips where the profiler records none (no
    CUPTI)."""
    ops = _operands(scheme, 8)
    ids, wts = routing(t, k, 8, "random", "cuda", seed=3)
    x = random_x(t, H, device="cuda", seed=4)
    cw.moe_decode_experts(x, ids, wts, **ops)  # warm-up (lazy loading)
    names = [n for n in _kernel_names(lambda: cw.moe_decode_experts(x, ids, wts, **ops)) if kernel in n]
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    return names


@pytest.mark.parametrize("scheme, t, k", [("int8", 1, 8), ("int8", 8, 8), ("fp8-block", 1, 8), ("int8", 1, 2),
                                          ("int8", 8, 2), ("fp8-block", 1, 2)])
def test_gate_up_kernel_variant_follows_the_switch(scheme, t, k):
    """moe_decode_gate_up_kernel's template arguments kDual (0 one tile after the other, 1 / 2 both tiles in one
    pass at the default's / at two CTAs per SM) and XT (void: x quantized by prep; x's dtype: the two-kernel path,
    the CTA quantizes x itself). On the three-kernel path (top_k < 4, or CUTLASS_W8A8_MOE_DECODE_PREP=1) kDual is what
    CUTLASS_W8A8_MOE_GATE_UP_DUAL says for this process (unset: 0): with 8 pairs or fewer (the one-token-tile kernel;
    row-wise, the only one where 1 and 2 differ) 0, 1 or 2; with more (two token tiles) and block fp8, 1 for both 1 and
    2. The two-kernel path (top_k >= 4 within the speed rule, or CUTLASS_W8A8_MOE_DECODE_PREP=0) runs kDual 0
    whatever the switch, with XT = bfloat16 here."""
    three = not _two_kernel(t, k, scheme=scheme)
    mode = os.environ.get("CUTLASS_W8A8_MOE_GATE_UP_DUAL", "")
    if not three:
        want = "0"
    elif scheme == "int8" and t * k <= 8:
        want = {"1": "1", "2": "2"}.get(mode, "0")
    else:
        want = "1" if mode in ("1", "2") else "0"
    names = _launches("moe_decode_gate_up_kernel", scheme, t, k)
    m = re.search(r"moe_decode_gate_up_kernel<.*, ([012]), (void|__nv_bfloat16)>\(", names[0])
    assert m is not None and m.group(1) == want, names[0]
    assert m.group(2) == ("void" if three else "__nv_bfloat16"), names[0]


def test_down_kernel_variant_follows_the_switch():
    """moe_decode_down_tm_kernel's template arguments kPrefetch (each block loaded one block ahead) and kOwnH (the
    kernel quantizes h itself: the two-kernel path) are what CUTLASS_W8A8_MOE_DOWN_PREFETCH ("1": true; unset: false)
    and CUTLASS_W8A8_MOE_DECODE_PREP ("1": false; unset or "0": true) say for this process, at T = 1, top-8."""
    want = "true" if os.environ.get("CUTLASS_W8A8_MOE_DOWN_PREFETCH") == "1" else "false"
    names = _launches("moe_decode_down_tm_kernel", "fp8-block", 1, 8)
    m = re.search(r"moe_decode_down_tm_kernel<.*, (true|false), (true|false)>\(", names[0])
    assert m is not None and m.group(1) == want, names[0]
    assert m.group(2) == ("true" if _two_kernel(1, 8, scheme="fp8-block") else "false"), names[0]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t, k", [(1, 8), (4, 8), (8, 8), (16, 4), (8, 2)])
def test_decode_path_kernels_follow_the_switch(scheme, t, k):
    """The op's kernels, in launch order: at top_k >= 4 gate/up then the token-major down (the two-kernel path:
    T x H and top_k x I within the speed rule, or CUTLASS_W8A8_MOE_DECODE_PREP=0), else prep first (the three-kernel
    path: beyond the rule, here T 16 at H 256, or CUTLASS_W8A8_MOE_DECODE_PREP=1); below top_k 4 prep, gate/up and
    the expert-major down whatever the switch."""
    ops = _operands(scheme, 8)
    ids, wts = routing(t, k, 8, "random", "cuda", seed=t + k)
    x = random_x(t, H, device="cuda", seed=5)
    cw.moe_decode_experts(x, ids, wts, **ops)  # warm-up (lazy loading)
    names = _kernel_names(lambda: cw.moe_decode_experts(x, ids, wts, **ops))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    short = [re.search(r"(moe_decode_\w+_kernel)", n).group(1) for n in names if "moe_decode_" in n]
    if k < 4:
        want = ["moe_decode_prep_kernel", "moe_decode_gate_up_kernel", "moe_decode_down_kernel"]
    elif not _two_kernel(t, k, scheme=scheme):
        want = ["moe_decode_prep_kernel", "moe_decode_gate_up_kernel", "moe_decode_down_tm_kernel"]
    else:
        want = ["moe_decode_gate_up_kernel", "moe_decode_down_tm_kernel"]
    assert short == want and len(names) == len(want), names


def _path_cases():
    """(scheme, E, x, ids, wts) at T 1, 4, 8 (top-8) and 16 (top-4): ids drawn uniformly from [-2, E + 2)
    with repeats (a token may name an expert twice; -1, -2, E and E + 1 are not routed), and T > 1's last token
    unrouted; x of each dtype; 8 and 128 experts."""
    cases = []
    for scheme in SCHEMES:
        for t, k in [(1, 8), (4, 8), (8, 8), (16, 4)]:
            for e in (8, 128):
                g = torch.Generator().manual_seed(1000 * t + 10 * k + e)
                ids = torch.randint(-2, e + 2, (t, k), generator=g, dtype=torch.int64)
                if t > 1:
                    ids[-1] = -1
                wts = torch.rand(t, k, generator=g)
                x_dtype = (torch.bfloat16, torch.float16, torch.float32)[len(cases) % 3]
                x = random_x(t, H, x_dtype, "cpu", seed=t + e)
                cases.append((scheme, e, x, ids.to(torch.int32 if t % 2 else torch.int64), wts))
    return cases


def _path_outputs():
    outs = []
    for scheme, e, x, ids, wts in _path_cases():
        ops = _operands(scheme, e)
        outs.append(cw.moe_decode_experts(x.cuda(), ids.cuda(), wts.cuda(), **ops).cpu())
    return outs


def test_two_and_three_kernel_paths_equal_bitwise(tmp_path):
    """The two-kernel path (gate/up and the token-major down quantizing x and h themselves) and the three-kernel
    path (prep, gate/up with the last-CTA quantization of h, down) give the same bits at top_k >= 4: int8 / fp8 /
    block fp8 (and per-expert scales), T 1, 4, 8 at top-8 and 16 at top-4, random routings with repeated experts,
    out-of-range and -1 ids and an unrouted token. The other paths run in subprocesses (the switch
    CUTLASS_W8A8_MOE_DECODE_PREP is read once per process): unset here (the speed rule: two kernels at T 1-8 with
    H 256, three at T 16), the processes at 0 (two kernels everywhere) and at 1 (three everywhere); set here, the
    other value."""
    here = pathlib.Path(__file__)
    mine = _path_outputs()
    switch = os.environ.get("CUTLASS_W8A8_MOE_DECODE_PREP", "")
    for value in {"0": ["1"], "1": ["0"]}.get(switch, ["0", "1"]):
        out_file = tmp_path / f"path_prep{value}.pt"
        code = ("import sys, torch\n"
                f"sys.path.insert(0, {str(here.parent)!r}); sys.path.insert(0, {str(here.parents[1])!r})\n"
                "import test_moe_decode_cuda as m\n"
                f"torch.save(m._path_outputs(), {str(out_file)!r})\n")
        env = {k: v for k, v in os.environ.items() if k != "CUTLASS_W8A8_MOE_DECODE_PREP"}
        env["CUTLASS_W8A8_MOE_DECODE_PREP"] = value
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                           cwd=here.parents[2])
        assert r.returncode == 0, r.stderr[-4000:]
        other = torch.load(out_file)
        assert len(mine) == len(other) == len(_path_cases())
        for case, a, b in zip(_path_cases(), mine, other):
            scheme, e, x, ids, _ = case
            assert torch.equal(a, b), (value, scheme, e, tuple(x.shape), x.dtype, ids.tolist())
            assert not torch.isnan(a.float()).any()
            routed = ((ids >= 0) & (ids < e)).any(1)
            assert bool((a[~routed] == 0).all()), (scheme, e, ids.tolist())


SWITCHES = ("CUTLASS_W8A8_MOE_GATE_UP_DUAL", "CUTLASS_W8A8_MOE_DOWN_PREFETCH", "CUTLASS_W8A8_MOE_DECODE_PREP",
            "CUTLASS_W8A8_MOE_W2_PREFETCH")


@pytest.mark.parametrize("name, value, allowed", [
    ("CUTLASS_W8A8_MOE_GATE_UP_DUAL", "3", "0, 1 or 2"), ("CUTLASS_W8A8_MOE_GATE_UP_DUAL", "true", "0, 1 or 2"),
    ("CUTLASS_W8A8_MOE_DOWN_PREFETCH", "2", "0 or 1"), ("CUTLASS_W8A8_MOE_DOWN_PREFETCH", "yes", "0 or 1"),
    ("CUTLASS_W8A8_MOE_DECODE_PREP", "2", "0 or 1"), ("CUTLASS_W8A8_MOE_DECODE_PREP", "on", "0 or 1"),
    ("CUTLASS_W8A8_MOE_W2_PREFETCH", "2", "0 or 1"), ("CUTLASS_W8A8_MOE_W2_PREFETCH", "auto", "0 or 1")])
def test_a_bad_switch_value_raises_naming_the_variable(name, value, allowed):
    """A value of an A/B switch other than unset / empty / the listed ones makes the op raise a ValueError naming
    the variable (read once per process, so a fresh one), instead of silently running the default variant."""
    code = ("import sys, torch, cutlass_w8a8 as cw\n"
            f"sys.path.insert(0, {str(pathlib.Path(__file__).parents[1])!r})\n"
            "from _moe_decode import decode_operands, random_x, routing\n"
            f"ops = decode_operands('int8', 8, {H}, {I}, 'cpu', seed=1)\n"
            "ops = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}\n"
            "ids, wts = routing(1, 8, 8, 'random', 'cuda', seed=2)\n"
            f"x = random_x(1, {H}, device='cuda', seed=3)\n"
            "try:\n"
            "    cw.moe_decode_experts(x, ids, wts, **ops)\n"
            "except ValueError as exc:\n"
            "    print('RAISED', exc)\n")
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    r = subprocess.run([sys.executable, "-c", code], env={**env, name: value}, capture_output=True, text=True,
                       timeout=300, cwd=pathlib.Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RAISED" in r.stdout and f"{name} must be {allowed} (or unset), got '{value}'" in r.stdout, r.stdout


@pytest.mark.parametrize("env", [{"CUTLASS_W8A8_MOE_GATE_UP_DUAL": "1"}, {"CUTLASS_W8A8_MOE_GATE_UP_DUAL": "2"},
                                 {"CUTLASS_W8A8_MOE_DOWN_PREFETCH": "1", "CUTLASS_W8A8_MOE_GATE_UP_DUAL": "2"},
                                 {"CUTLASS_W8A8_MOE_DECODE_PREP": "1"}, {"CUTLASS_W8A8_MOE_DECODE_PREP": "0"},
                                 {"CUTLASS_W8A8_MOE_DECODE_PREP": "1", "CUTLASS_W8A8_MOE_GATE_UP_DUAL": "2",
                                  "CUTLASS_W8A8_MOE_DOWN_PREFETCH": "1"},
                                 {"CUTLASS_W8A8_MOE_W2_PREFETCH": "1"},
                                 {"CUTLASS_W8A8_MOE_W2_PREFETCH": "1", "CUTLASS_W8A8_MOE_DECODE_PREP": "1"}],
                         ids=["gate-up-1", "gate-up-2", "down-prefetch", "prep", "two-kernel",
                              "prep-gate-up-2-down-prefetch", "w2-prefetch", "w2-prefetch-prep"])
def test_kernel_variants_in_their_own_process(env):
    """The A/B variants of the decode path's kernels (CUTLASS_W8A8_MOE_GATE_UP_DUAL=1 / 2: gate/up in one pass, on the
    three-kernel path; CUTLASS_W8A8_MOE_DOWN_PREFETCH=1: the token-major down kernel one block ahead;
    CUTLASS_W8A8_MOE_DECODE_PREP=1: the three-kernel path at top_k >= 4 too; =0: the two-kernel path beyond the
    speed rule, at every wide / unaligned shape whose shared memory fits; CUTLASS_W8A8_MOE_W2_PREFETCH=1: gate/up asks
    L2 for the experts' w2 (which fits the rule's half of the L2 at these small shapes), off when unset; each read
    once per process, so a fresh one): this file's bitwise tests against the chain and the kernel-variant checks pass there
    too."""
    if any(os.environ.get(name) for name in SWITCHES):
        pytest.skip("this process already runs a variant")
    here = pathlib.Path(__file__)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", str(here), "-k",
           "equals_the_chain or dtypes_and_int64 or variant_follows or kernels_follow"]
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=900, cwd=here.parents[2])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_dtypes_and_int64_ids(scheme, x_dtype, out_dtype):
    ops = _operands(scheme, 8)
    ids, wts = routing(8, 8, 8, "random", "cuda", seed=5, ids_dtype=torch.int64)
    x = random_x(8, H, x_dtype, "cuda", seed=6)
    _assert_equals_chain(x, ids, wts, ops, out_dtype, what=(scheme, x_dtype, out_dtype))


def test_strided_x_ids_and_weights():
    ops = _operands("fp8", 8)
    ids, wts = routing(6, 4, 8, "random", "cuda", seed=7, ids_dtype=torch.int64)
    x = random_x(6, H, torch.float32, "cuda", seed=8)
    x_t = x.t().contiguous().t()  # strides (1, T)
    ids_w = torch.zeros(6, 9, dtype=torch.int64, device="cuda")[:, 3:7]
    wts_w = torch.zeros(6, 9, device="cuda")[:, 2:6]
    ids_w.copy_(ids)
    wts_w.copy_(wts)
    out = _assert_equals_chain(x_t, ids_w, wts_w, ops)
    assert torch.equal(out, chain(x, ids, wts, **ops))


def test_t_zero():
    ops = _operands("int8", 8)
    out = cw.moe_decode_experts(torch.zeros(0, H, device="cuda", dtype=torch.bfloat16),
                                torch.zeros(0, 2, dtype=torch.int32, device="cuda"), torch.zeros(0, 2, device="cuda"),
                                **ops)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16 and out.is_cuda


# ---- against the float64 reference of the dequantized operands ------------------------------------------------


def _layer(scheme, e, top_k):
    """A W8A8MoE holding the operands (per-expert scales as (E, 1), which W8A8MoE and FakeQuantExperts read)."""
    dtype, kind, group = SCHEMES[scheme]
    cfg = cw.W8A8Config(dtype=dtype, weight_block_size=(128, 128) if group else None)
    mod = cw.W8A8MoE(e, top_k, H, I, cfg, device="cuda")
    for name, v in _operands(scheme, e, expert_2d=True).items():
        if isinstance(v, torch.Tensor):
            setattr(mod, name, v)
    return mod


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t, k", SIZES)
@pytest.mark.parametrize("e", [8, 128])
def test_matches_float64_reference(scheme, t, k, e):
    mod = _layer(scheme, e, min(k, e))
    mod.fused_decode = True  # the decode path at every top_k (the default takes it at top_k >= 4)
    ref = FakeQuantExperts(mod, torch.float64).to("cpu")
    ids, wts = routing(t, k, e, "random", "cuda", seed=t + 3 * k)
    x = random_x(t, H, device="cuda", seed=t * k)
    assert mod.uses_decode_path(x, k) == (t * k <= 64)
    y = _fused(x, ids, wts, {n: getattr(mod, n) for n in ("w13", "w13_scale", "w2", "w2_scale")} |
               {"group_size": mod.group_size})
    want = ref(x.cpu(), ids.cpu(), wts.cpu())
    bound = LAYER_SQNR_DB[scheme.replace("-expert", "")]
    assert sqnr_db(y.cpu(), want) >= bound, (scheme, t, k, e)
    assert torch.equal(mod(x, ids, wts), y)  # the layer takes the decode path: the same bits


def test_opcheck_cuda():
    for scheme in ("int8", "fp8-block"):
        ops = _operands(scheme, 8)
        ids, wts = routing(4, 2, 8, "random", "cuda", seed=9)
        x = random_x(4, H, device="cuda", seed=10)
        run_opcheck(torch.ops.cutlass_w8a8.moe_decode_experts,
                    (x, ids, wts, ops["w13"], ops["w13_scale"], ops["w2"], ops["w2_scale"], ops["group_size"],
                     torch.bfloat16))


# ---- W8A8MoE: the fused path vs the chain, CUDA graphs, kernels -------------------------------------------------


def _qwen_like(scheme, e=128, top_k=8):
    return _layer(scheme, e, top_k)


def _logits(t, e, seed, route="random"):
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(t, e, generator=g)
    if route == "one-expert":
        logits[:, 3] += 40
    return logits.cuda()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("t", [1, 8])
def test_layer_fused_equals_unfused(scheme, t):
    mod = _qwen_like(scheme)
    x = random_x(t, H, device="cuda", seed=11)
    for route in ("random", "one-expert"):
        logits = _logits(t, 128, 12, route)
        mod.fused_decode = True
        fused = mod(x, logits)
        mod.fused_decode = False
        assert torch.equal(fused, mod(x, logits)), (scheme, t, route)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("t", [1, 8])
def test_graph_replay_with_new_router_logits_equals_eager(scheme, t):
    """W8A8MoE.forward (routing + the decode path) captured once on a side stream with host syncs raising, replayed
    with new hidden states and router logits (random, all on one expert): each replay equals eager bit for bit."""
    mod = _qwen_like(scheme)
    cases = [[random_x(t, H, device="cuda", seed=20 + i), _logits(t, 128, 30 + i, route)]
             for i, route in enumerate(["random", "one-expert", "random"])]
    first = [random_x(t, H, device="cuda", seed=99), _logits(t, 128, 98)]
    assert mod.uses_decode_path(first[0], mod.top_k)
    outs = graph_replays(mod, first, cases)
    for i, (case, out) in enumerate(zip(cases, outs)):
        assert torch.equal(out, mod(*case)), (scheme, t, i)


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [evt.name for evt in prof.events() if evt.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("scheme", ["int8", "fp8-block"])
@pytest.mark.parametrize("t, top_k", [(1, 8), (8, 8), (4, 2)])
def test_layer_kernels(scheme, t, top_k):
    """At T * top_k <= 64 with router logits: the gate/up decode kernel and the down one (token-major at top_k >= 4,
    expert-major below), no grouped_decode_kernel, at most 6 CUDA activities per layer call (the routing included);
    with fused_decode False the chain's grouped_decode_kernel."""
    mod = _qwen_like(scheme, top_k=top_k)
    mod.fused_decode = True  # top-2 takes the chain by default
    x, logits = random_x(t, H, device="cuda", seed=13), _logits(t, 128, 14)
    mod(x, logits)  # warm-up (lazy loading)
    names = _kernel_names(lambda: mod(x, logits))
    if not names:
        pytest.skip("the profiler recorded no CUDA kernels here (no CUPTI)")
    down = "moe_decode_down_tm_kernel" if top_k >= 4 else "moe_decode_down_kernel"
    other = "moe_decode_down_kernel" if top_k >= 4 else "moe_decode_down_tm_kernel"
    assert any("moe_decode_gate_up_kernel" in n for n in names), names
    assert any(down in n for n in names), names
    assert not any(other in n for n in names), names
    assert not any("grouped_decode_kernel" in n for n in names), names
    assert len(names) <= 6, names
    mod.fused_decode = False
    unfused = _kernel_names(lambda: mod(x, logits))
    assert any("grouped_decode_kernel" in n for n in unfused), unfused
    assert not any("moe_decode_" in n for n in unfused), unfused
