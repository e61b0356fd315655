"""rope_kv_cache_: rotary embedding of q and k heads in place + the k/v write into the slot cache.

CPU: the reference is the decoder's former torch code (_rope_ + index_put_). CUDA: against that reference on
the same inputs (each rotated element within one ulp of the element type: the reference's complex multiply may
fuse a multiply-add where the kernel rounds each product), with the untouched cache entries left bitwise as
they were; capture and replay; opcheck.

With Qwen3's head norms (``q_norm`` / ``k_norm`` / ``eps``, issue 36): on the CPU the op equals the chain it replaces
(``rms_norm`` of the q heads and of the k heads copied back into qkv, then the op without norms) bit for bit; on
CUDA the same bound plus what the kernel's own order of the sum of squares can move a normalized element (one ulp of
a 16-bit dtype; (D + 11) float32 roundings in float32, where nothing rounds it away) and the rotation carries over,
at head sizes covering one to eight warps of that sum, and with an eps large enough to matter.
"""

import pytest
import torch

import cutlass_w8a8  # noqa: F401 (registers the ops)
from cutlass_w8a8.models.llama import _rope_

H, KVH, D, SLOTS, S = 8, 2, 64, 5, 32


def inputs(b, dtype, device, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, H + 2 * KVH, d, generator=g).to(dtype)
    angles = torch.rand(b, d // 2, generator=g) * 6.28
    rope = torch.stack((angles.cos(), angles.sin()), dim=-1)
    cache = torch.randn(SLOTS, 2, KVH, S, d, generator=g).to(dtype)
    slots = torch.randperm(SLOTS, generator=g)[:b]
    positions = torch.randint(0, S, (b,), generator=g)
    return [t.to(device) for t in (qkv, rope, cache, slots, positions)]


def former(qkv, rope, cache, slots, positions):
    """The decoder's code before the op (LlamaAttention.forward, 2026-11-23)."""
    _rope_(qkv[:, : H + KVH], rope)
    index = (slots.unsqueeze(1) * (2 * KVH) + torch.arange(2 * KVH)) * S + positions.unsqueeze(1)
    cache.view(-1, D).index_put_((index,), qkv[:, H:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_equals_former_code(dtype):
    a = inputs(4, dtype, "cpu")
    b = [t.clone() for t in a]
    torch.ops.cutlass_w8a8.rope_kv_cache_(a[0], a[1], a[2], a[3], a[4], H, KVH)
    former(*b)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def test_cpu_argument_errors():
    qkv, rope, cache, slots, positions = inputs(2, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="`qkv` must be"):
        torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, rope, cache, slots, positions, H + 1, KVH)
    with pytest.raises(TypeError, match="`rope` must be float32"):
        torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, rope.half(), cache, slots, positions, H, KVH)


EPS = 1e-6


def norm_weights(dtype, device, seed=1, d=D):
    """q_norm and k_norm weights (D,) around 1, as trained Qwen3 head norms are."""
    g = torch.Generator().manual_seed(seed)
    return [(1 + 0.5 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)]


def chain(qkv, rope, cache, slots, positions, qn, kn, eps):
    """What the fused head norms replace: rms_norm of the q heads and of the k heads copied back into qkv (the
    decoder's former `LlamaAttention._norm_heads_`), then rope_kv_cache_ without norms."""
    for heads, w in ((qkv[:, :H], qn), (qkv[:, H:H + KVH], kn)):
        heads.copy_(torch.ops.cutlass_w8a8.rms_norm(heads, w, eps))
    torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, rope, cache, slots, positions, H, KVH)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_head_norms_equal_the_chain(dtype):
    """With q_norm / k_norm the CPU op is the chain it replaces, bit for bit (qkv and cache); the norms changed
    the values (the weights are not ones), and the value heads are copied untouched."""
    a = inputs(4, dtype, "cpu", seed=2)
    qn, kn = norm_weights(dtype, "cpu")
    b = [t.clone() for t in a]
    plain = [t.clone() for t in a]
    v = a[0][:, H + KVH:].clone()
    cutlass_w8a8.rope_kv_cache_(*a, H, KVH, qn, kn, EPS)
    chain(*b, qn, kn, EPS)
    torch.ops.cutlass_w8a8.rope_kv_cache_(*plain, H, KVH)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[0][:, :H + KVH], plain[0][:, :H + KVH])
    assert torch.equal(a[0][:, H + KVH:], v)


def test_opcheck_head_norms_cpu():
    torch.library.opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default,
                          (*inputs(2, torch.bfloat16, "cpu"), H, KVH, *norm_weights(torch.bfloat16, "cpu"), EPS))


def test_public_wrapper_is_the_op():
    a = inputs(3, torch.bfloat16, "cpu", seed=4)
    b = [t.clone() for t in a]
    assert cutlass_w8a8.rope_kv_cache_(*a, H, KVH) is None
    torch.ops.cutlass_w8a8.rope_kv_cache_(*b, H, KVH)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("case", ["q_norm alone", "k_norm dtype", "q_norm shape", "k_norm strided", "eps missing",
                                  "eps nan"])
def test_cpu_head_norm_checks_are_the_cuda_checks(case):
    """The head-norm arguments' checks, with csrc/attention/rope_kv_cache.cu's messages, in the CPU and the fake
    implementations; nothing is written when they fail."""
    qkv, rope, cache, slots, positions = inputs(2, torch.bfloat16, "cpu")
    qn, kn = norm_weights(torch.bfloat16, "cpu")
    exc, msg, norms = {
        "q_norm alone": (ValueError, "^rope_kv_cache_: `q_norm` and `k_norm` must be given together", (qn, None, EPS)),
        "k_norm dtype": (TypeError, "^rope_kv_cache_: `k_norm` must have qkv's dtype$", (qn, kn.float(), EPS)),
        "q_norm shape": (ValueError, r"^rope_kv_cache_: `q_norm` must be contiguous \(D,\) = \[64\], got \[32\]$",
                         (qn[:32], kn, EPS)),
        "k_norm strided": (ValueError, r"^rope_kv_cache_: `k_norm` must be contiguous \(D,\) = \[64\], got \[64\]$",
                           (qn, torch.ones(128, dtype=torch.bfloat16)[::2], EPS)),
        "eps missing": (ValueError, "^rope_kv_cache_: `eps` must be given with q_norm and k_norm", (qn, kn, -1.0)),
        "eps nan": (ValueError, "^rope_kv_cache_: `eps` must be given with q_norm and k_norm", (qn, kn, float("nan"))),
    }[case]
    before = qkv.clone()
    with pytest.raises(exc, match=msg):
        cutlass_w8a8.rope_kv_cache_(qkv, rope, cache, slots, positions, H, KVH, *norms)
    assert torch.equal(qkv, before)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (qkv, rope, cache, slots, positions)]
        fake_norms = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in norms]
        with pytest.raises(exc, match=msg):
            torch.ops.cutlass_w8a8.rope_kv_cache_(*fake, H, KVH, *fake_norms)


ROPE_SHAPE = r"^rope_kv_cache_: `rope` must be contiguous \(B, R / 2, 2\) with 1 <= R / 2 <= D / 2 = 32, "


@pytest.mark.parametrize("case", ["positions int32", "slots int32", "rope strided", "rope wide", "rope empty",
                                  "qkv strided heads", "kv_cache strided", "no positions"])
def test_cpu_checks_are_the_cuda_checks(case):
    """The CPU and fake implementations make csrc/attention/rope_kv_cache.cu's checks, with its messages (int32
    indices, layouts and rope's shape included); nothing is written when they fail."""
    qkv, rope, cache, slots, positions = inputs(2, torch.bfloat16, "cpu")
    exc, msg = {
        "positions int32": (TypeError, "^rope_kv_cache_: `positions` must be int64$"),
        "slots int32": (TypeError, "^rope_kv_cache_: `slots` must be int64$"),
        "rope strided": (ValueError, ROPE_SHAPE + r"got \[2, 32, 2\]$"),
        "rope wide": (ValueError, ROPE_SHAPE + r"got \[2, 33, 2\]$"),
        "rope empty": (ValueError, ROPE_SHAPE + r"got \[2, 0, 2\]$"),
        "qkv strided heads": (ValueError, r"^rope_kv_cache_: `qkv` must have contiguous heads of even D \(strides "
                                          r"\(\*, D, 1\)\), got strides \[64, 128, 1\]$"),
        "kv_cache strided": (ValueError, r"^rope_kv_cache_: `kv_cache` must be contiguous \(slots, 2, num_kv_heads, S, "
                                         r"D\), got \[5, 2, 2, 32, 64\]$"),
        "no positions": (ValueError, "^rope_kv_cache_: `kv_cache` must not be empty$"),
    }[case]
    change = {
        "positions int32": lambda: dict(positions=positions.int()),
        "slots int32": lambda: dict(slots=slots.int()),
        "rope strided": lambda: dict(rope=rope.transpose(0, 1).contiguous().transpose(0, 1)),
        "rope wide": lambda: dict(rope=torch.cat((rope, rope[:, :1]), dim=1)),  # R / 2 = D / 2 + 1
        "rope empty": lambda: dict(rope=rope[:, :0].contiguous()),  # R = 0 (rope[:, :16] would be R = D / 2, legal)
        "qkv strided heads": lambda: dict(qkv=qkv.transpose(0, 1).contiguous().transpose(0, 1)),
        "kv_cache strided": lambda: dict(kv_cache=cache.transpose(0, 3).contiguous().transpose(0, 3)),
        "no positions": lambda: dict(kv_cache=cache[:, :, :, :0]),
    }[case]()
    kw = dict(qkv=qkv, rope=rope, kv_cache=cache, slots=slots, positions=positions)
    kw.update(change)
    before = kw["qkv"].clone()
    with pytest.raises(exc, match=msg):
        cutlass_w8a8.rope_kv_cache_(*kw.values(), H, KVH)
    assert torch.equal(kw["qkv"], before)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fake kernel: the same check
        fake = {k: mode.from_tensor(v) for k, v in kw.items()}
        with pytest.raises(exc, match=msg):
            torch.ops.cutlass_w8a8.rope_kv_cache_(*fake.values(), H, KVH)


def test_opcheck_cpu():
    torch.library.opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default, (*inputs(2, torch.bfloat16, "cpu"), H, KVH))


def _ulp(x, dtype):
    bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(1e-30))[1] - 1 - bits)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b", [1, 3, 5])
def test_cuda_matches_reference(dtype, b):
    cpu = inputs(b, dtype, "cpu", seed=b)
    gpu = [t.cuda() for t in cpu]
    # a row-padded qkv view, as a GEMM output slice of a wider buffer would be
    wide = torch.full((b, H + 2 * KVH + 1, D), float("nan"), device="cuda", dtype=dtype)
    wide[:, : H + 2 * KVH] = gpu[0]
    qkv = wide[:, : H + 2 * KVH]
    before = gpu[2].clone()
    torch.ops.cutlass_w8a8.rope_kv_cache_(qkv, gpu[1], gpu[2], gpu[3], gpu[4], H, KVH)
    torch.ops.cutlass_w8a8.rope_kv_cache_(cpu[0], cpu[1], cpu[2], cpu[3], cpu[4], H, KVH)
    torch.cuda.synchronize()
    got, ref = qkv.cpu().double(), cpu[0].double()
    assert ((got - ref).abs() <= _ulp(ref, dtype)).all()
    assert torch.isnan(wide[:, -1].float()).all(), "the padding was written"
    written = torch.zeros(SLOTS, 2, KVH, S, dtype=torch.bool)
    written[cpu[3], :, :, cpu[4]] = True
    cache = gpu[2].cpu()
    assert torch.equal(cache[~written], before.cpu()[~written]), "entries outside (slot, position) changed"
    got_c, ref_c = cache[written].double(), cpu[2][written].double()
    assert ((got_c - ref_c).abs() <= _ulp(ref_c, dtype)).all()
    # the cache holds exactly what the kernel left in qkv (k heads rotated, v heads copied)
    for i in range(b):
        s, p = int(cpu[3][i]), int(cpu[4][i])
        assert torch.equal(cache[s, 0, :, p], qkv[i, H:H + KVH].cpu())
        assert torch.equal(cache[s, 1, :, p], qkv[i, H + KVH:].cpu())


def check_graph_replay(static, h, kvh, tail, fresh):
    """rope_kv_cache_(*static, h, kvh, *tail) captured in a CUDA graph (warm-up on a side stream, on copies of
    ``static``); for each input list of ``fresh`` (an iterable, drawn one list at a time): copied into ``static``,
    the graph replayed, and the op run eagerly on copies of the same inputs; the replay's qkv and cache equal the
    eager call's bit for bit (tests/ops/test_rope_kv_cache_partial.py uses it too)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.cutlass_w8a8.rope_kv_cache_(*[t.clone() for t in static], h, kvh, *tail)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.cutlass_w8a8.rope_kv_cache_(*static, h, kvh, *tail)
    for new in fresh:
        for dst, src in zip(static, new, strict=True):
            dst.copy_(src)
        g.replay()
        eager = [t.clone() for t in new]
        torch.ops.cutlass_w8a8.rope_kv_cache_(*eager, h, kvh, *tail)
        torch.cuda.synchronize()
        assert torch.equal(static[0], eager[0]) and torch.equal(static[2], eager[2])


def check_graph_replay_and_opcheck(*tail):
    """rope_kv_cache_(*inputs, H, KVH, *tail) captured in a CUDA graph: replays on new inputs equal eager calls bit
    for bit (q / k heads and the cache); then opcheck on CUDA."""
    check_graph_replay(inputs(3, torch.bfloat16, "cuda", seed=7), H, KVH, tail,
                       (inputs(3, torch.bfloat16, "cuda", seed=seed) for seed in (1, 2)))
    torch.library.opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default,
                          (*inputs(2, torch.bfloat16, "cuda", seed=3), H, KVH, *tail))


@pytest.mark.cuda
def test_cuda_graph_replay_and_opcheck():
    check_graph_replay_and_opcheck()


def _normed_max(qkv, qn, kn, eps):
    """(B, H + KVH, 1) float64: the largest |element| of each q / k head after its norm (the CPU reference's)."""
    q = torch.ops.cutlass_w8a8.rms_norm(qkv[:, :H], qn, eps)
    k = torch.ops.cutlass_w8a8.rms_norm(qkv[:, H:H + KVH], kn, eps)
    return torch.cat((q, k), dim=1).double().abs().amax(dim=-1, keepdim=True)


def _head_norm_bound(ref, nmax, dtype, d):
    """What the fused kernel may differ by from the CPU chain (rms_norm, copy back, rotation), per element.

    The two sum the D squares (each rounded alike) in different orders: each sum is within (D - 1) u of the exact
    sum of its terms (u = 2^-24, positive terms), so inv_rms = 1 / sqrt(ss / D + eps) differs by at most (D - 1) u
    (the square root halves the sums' 2 (D - 1) u) plus the roundings of / D, + eps, sqrt and the reciprocal (or
    the CPU's rsqrt) on both sides, 8 u; the normalized float32 value y = (x * inv_rms) * w adds two roundings on each
    side, 4 u: |dy| <= (D + 11) u |y| <= (D + 11) u nmax. Rounded to a 16-bit T that is at most one ulp of T (y lands
    on the other side of a tie), so dy <= ulp_T(nmax) + (D + 11) u nmax covers every dtype (for float32 the second
    term is the one that counts: nothing rounds it away). The rotation moves it by |cos| |dy1| + |sin| |dy2| <=
    sqrt(2) max|dy| < 2 max|dy|, and its own rounding (one product fused on the CPU) by one ulp of the element."""
    u = 2.0 ** -24
    return _ulp(ref, dtype) + 2 * (_ulp(nmax, dtype) + (d + 11) * u * nmax)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b", [1, 3, 5])
@pytest.mark.parametrize("d,eps", [(D, EPS), (D, 0.5), (80, EPS), (128, EPS), (1024, EPS)],
                         ids=["D64", "D64-eps0.5", "D80", "D128", "D1024"])
def test_cuda_head_norms_match_reference(dtype, b, d, eps):
    """The fused head norms against the CPU chain, within `_head_norm_bound`. D = 64 is one warp of the kernel's sum
    of squares, 80 two warps with idle lanes, 128 (Qwen3's head_dim) two full warps, 1024 eight warps with two pairs
    per thread; eps = 0.5 (about half the mean square of these heads) makes a kernel that drops or misplaces eps
    fail, which eps = 1e-6 cannot show. The value heads and everything outside the written cache entries: bitwise."""
    cpu = inputs(b, dtype, "cpu", seed=10 + b, d=d)
    qn, kn = norm_weights(dtype, "cpu", seed=b, d=d)
    gpu = [t.cuda() for t in cpu]
    nmax = _normed_max(cpu[0], qn, kn, eps)
    before = gpu[2].clone()
    torch.ops.cutlass_w8a8.rope_kv_cache_(*gpu, H, KVH, qn.cuda(), kn.cuda(), eps)
    v = cpu[0][:, H + KVH:].clone()
    torch.ops.cutlass_w8a8.rope_kv_cache_(*cpu, H, KVH, qn, kn, eps)
    torch.cuda.synchronize()
    got, ref = gpu[0].cpu().double(), cpu[0].double()
    bound = _head_norm_bound(ref[:, :H + KVH], nmax, dtype, d)
    assert ((got[:, :H + KVH] - ref[:, :H + KVH]).abs() <= bound).all()
    assert torch.equal(gpu[0][:, H + KVH:].cpu(), v)
    written = torch.zeros(SLOTS, 2, KVH, S, dtype=torch.bool)
    written[cpu[3], :, :, cpu[4]] = True
    cache = gpu[2].cpu()
    assert torch.equal(cache[~written], before.cpu()[~written]), "entries outside (slot, position) changed"
    for i in range(b):
        s, p = int(cpu[3][i]), int(cpu[4][i])
        assert torch.equal(cache[s, 0, :, p], gpu[0][i, H:H + KVH].cpu())
        assert torch.equal(cache[s, 1, :, p], gpu[0][i, H + KVH:].cpu())


@pytest.mark.cuda
def test_cuda_head_norms_graph_replay_and_opcheck():
    """Captured with head norms, replays equal eager bit for bit on new inputs; opcheck on CUDA."""
    qn, kn = norm_weights(torch.bfloat16, "cuda")
    check_graph_replay_and_opcheck(qn, kn, EPS)
