"""rope_kv_cache_ with partial rotary embedding: ``rope`` ``(B, R / 2, 2)`` with ``R < D`` (GLM-4.5 / 4.6,
transformers' ``glm4_moe``: ``partial_rotary_factor`` 0.5, ``head_dim`` 128, so ``R = 64``).

Semantics (transformers' ``Glm4Moe`` ``apply_rotary_pos_emb``): per q and k head, after the optional head norms over
all ``D`` elements, the pairs ``(x[j], x[j + R/2])``, ``j < R/2``, are rotated by row ``j``'s angle and ``x[R:]``
passes through; every k and v head goes into the cache whole.

CPU: against an independent float64 reference written here, and against transformers' own
``apply_rotary_pos_emb`` (bounds derived below, at each test); the pass-through part bitwise. CUDA: against the CPU
op within the bounds of tests/ops/test_rope_kv_cache.py's full-width tests, a CUDA-graph replay, opcheck.
"""

import pytest
import torch

import cutlass_w8a8
from _full import opcheck
from test_rope_kv_cache import check_graph_replay

H, KVH, SLOTS, S = 4, 2, 5, 16
EPS = 1e-6
U32 = 2.0 ** -24  # float32's unit roundoff
BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}  # stored significand bits
CASES = [(d, r) for d in (64, 128) for r in (d // 4, d // 2, d)]  # (D, R): R = D is the full-width op


def ulp(x, dtype):
    """float64 (same shape): the spacing of ``dtype`` at |x| (the normal range; these values are far from
    subnormal)."""
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64),
                       torch.frexp(x.double().abs().clamp_min(1e-30))[1] - 1 - BITS[dtype])


def make(b, d, r, dtype, seed=0, norms=False):
    """qkv (B, H + 2 KVH, D), rope (B, R / 2, 2) float32 from random angles, a cache, slots, positions; with
    ``norms``, q_norm / k_norm weights around 1 (trained head norms are) in qkv's dtype."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, H + 2 * KVH, d, generator=g).to(dtype)
    angles = torch.rand(b, r // 2, generator=g) * 6.28
    rope = torch.stack((angles.cos(), angles.sin()), dim=-1)
    cache = torch.randn(SLOTS, 2, KVH, S, d, generator=g).to(dtype)
    slots = torch.randperm(SLOTS, generator=g)[:b]
    positions = torch.randint(0, S, (b,), generator=g)
    w = [(1 + 0.5 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)] if norms else [None, None]
    return [qkv, rope, cache, slots, positions], w


def run_op(args, w):
    """The op in place on ``args``; returns the (normalized) q and k heads it rotated, as the chain would have them
    (``rms_norm`` of the q heads and of the k heads, or the heads themselves)."""
    qkv = args[0]
    if w[0] is None:
        normed = qkv[:, :H + KVH].clone()
    else:
        normed = torch.cat((torch.ops.cutlass_w8a8.rms_norm(qkv[:, :H], w[0], EPS),
                            torch.ops.cutlass_w8a8.rms_norm(qkv[:, H:H + KVH], w[1], EPS)), dim=1)
    cutlass_w8a8.rope_kv_cache_(*args, H, KVH, *((w[0], w[1], EPS) if w[0] is not None else ()))
    return normed


def float64_norm(x, w):
    """(B, N, D) float64: rms_norm of each head, x * (1 / sqrt(mean(x^2) + eps)) * w, in float64."""
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * w.double()


def float64_rotate(x, rope):
    """(B, N, D) float64: the partial neox rotation of x (float64) with R = 2 rope.shape[1], written out here."""
    h = rope.shape[1]
    c, s = rope[..., 0].double().unsqueeze(1), rope[..., 1].double().unsqueeze(1)  # (B, 1, R/2)
    x1, x2 = x[..., :h], x[..., h:2 * h]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * h:]), dim=-1)


def check_cache(args, before):
    """The written entries hold all D elements of the k heads (rotated part included) and the v heads as qkv now
    holds them; the rest of the cache is untouched."""
    qkv, _, cache, slots, positions = args
    written = torch.zeros(cache.shape[:4], dtype=torch.bool)
    written[slots, :, :, positions] = True
    assert torch.equal(cache[~written], before[~written])
    for i in range(qkv.shape[0]):
        s, p = int(slots[i]), int(positions[i])
        assert torch.equal(cache[s, 0, :, p], qkv[i, H:H + KVH])
        assert torch.equal(cache[s, 1, :, p], qkv[i, H + KVH:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
@pytest.mark.parametrize("d,r", CASES, ids=[f"D{d}-R{r}" for d, r in CASES])
def test_cpu_partial_matches_float64(d, r, norms, dtype):
    """Against a float64 reference of the whole computation (norm, rotation, pass-through) from the same inputs.

    Normalized elements: ours is float32 rounded once to T; the float64 value differs before that rounding by at
    most (D + 11) u |y| (u = 2^-24: the sum of D squares, the mean, + eps, the square root, the reciprocal and the
    two products), far below half an ulp of a 16-bit T, so the rounded values are equal or adjacent: dn <= ulp_T(y)
    + (D + 11) u |y| (the second term is the one that counts for float32, where nothing rounds it away). The
    pass-through part is exactly those normalized elements (bitwise the input without norms). Rotated elements:
    from normalized inputs off by dn each, |cos| dn1 + |sin| dn2 <= 2 max(dn); then ours rounds a float32 value
    whose own error (two products and a sum, each <= u of its magnitude, all <= 2 max|x|) is <= 6 u max|x|, to T:
    at most half an ulp of T at ours. The ulp taken at the larger of the two values makes it symmetric."""
    args, w = make(3, d, r, dtype, seed=d + r, norms=norms)
    x0 = args[0].clone()
    before = args[2].clone()
    run_op(args, w)
    qk0 = x0[:, :H + KVH]
    if norms:
        ref_n = torch.cat((float64_norm(qk0[:, :H], w[0]), float64_norm(qk0[:, H:], w[1])), dim=1)
        dn = ulp(ref_n, dtype) + (d + 11) * U32 * ref_n.abs()
    else:
        ref_n, dn = qk0.double(), torch.zeros(qk0.shape, dtype=torch.float64)
    ref = float64_rotate(ref_n, args[1])
    got = args[0][:, :H + KVH].double()
    h = r // 2
    pair_max = torch.maximum(ref_n[..., :h].abs(), ref_n[..., h:r].abs()).repeat(1, 1, 2) * (1 + 1e-2)
    pair_dn = torch.maximum(dn[..., :h], dn[..., h:r]).repeat(1, 1, 2)
    big = torch.maximum(got[..., :r].abs(), ref[..., :r].abs())
    bound_rot = 0.5 * ulp(big, dtype) + 6 * U32 * pair_max + 2 * pair_dn
    err = (got[..., :r] - ref[..., :r]).abs()
    assert (err <= bound_rot).all(), f"rotated part: worst excess {(err - bound_rot).max().item()}"
    # the pass-through part: the normalized input (the chain's rms_norm; bitwise the input without norms)
    assert ((got[..., r:] - ref[..., r:]).abs() <= dn[..., r:]).all()
    if not norms:
        assert torch.equal(args[0][:, :H + KVH, r:], x0[:, :H + KVH, r:])
    assert torch.equal(args[0][:, H + KVH:], x0[:, H + KVH:]), "the value heads changed"
    if r < d:  # the rotation really is partial: a full-width one would move x[R:] (these angles are not 0)
        assert not torch.equal(args[0][:, :H + KVH, :r], x0[:, :H + KVH, :r])
    check_cache(args, before)


def hf_cos_sin(rope, dtype):
    """transformers' (cos, sin) for these angles, (B, 1, R) in the model dtype, built as Glm4MoeRotaryEmbedding
    lays them out (the R/2 frequencies twice: cat(freqs, freqs)) and casts them (``.to(x.dtype)``)."""
    c, s = rope[..., 0], rope[..., 1]
    return torch.cat((c, c), -1).unsqueeze(1).to(dtype), torch.cat((s, s), -1).unsqueeze(1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
@pytest.mark.parametrize("d,r", CASES, ids=[f"D{d}-R{r}" for d, r in CASES])
def test_cpu_partial_matches_transformers(d, r, norms, dtype):
    """Against transformers' GLM-4.5 ``apply_rotary_pos_emb`` (modeling_glm4_moe) on the same (normalized) heads.

    Ours: o = T(float32 rotation), |o - e| <= ulp_T(o) / 2 + 6 u m, e the exact rotation with the float32 table
    values (c, s), m = max(|x1|, |x2|), u = 2^-24. Theirs computes in T with (c', s') = T(c, s): t = T(a + b),
    a = T(x1 c') and b = T(-x2 s') (x2 c' and x1 s' for the second element; a product of two 16-bit values is
    exact in float32, so a and b are rounded once). So |t - e| <= ulp_T(t) / 2 (the sum's rounding; a float32 sum
    rounded again to T can land one half-ulp further: a second ulp_T(t) / 2 is allowed for that) + ulp_T(a) / 2
    + ulp_T(b) / 2 (their products' roundings) + u_T (|x1| |c| + |x2| |s|) (the table's rounding to T, u_T =
    2^-8 for bfloat16, 2^-11 for float16: |c - c'| <= u_T |c|). The sum of the two sides is the bound, per
    element. The pass-through part: bitwise equal (both leave the normalized input as it is)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    args, w = make(3, d, r, dtype, seed=7 * d + r, norms=norms)
    normed = run_op(args, w)  # (B, H + KVH, D) in T: what the rotation read
    cos, sin = hf_cos_sin(args[1], dtype)
    q_t, k_t = apply_rotary_pos_emb(normed[:, :H].unsqueeze(2), normed[:, H:].unsqueeze(2), cos, sin)
    theirs = torch.cat((q_t.squeeze(2), k_t.squeeze(2)), dim=1)
    ours = args[0][:, :H + KVH]
    assert theirs.dtype == dtype and theirs.shape == ours.shape
    assert torch.equal(ours[..., r:], theirs[..., r:]) and torch.equal(ours[..., r:], normed[..., r:])
    h = r // 2
    x = normed.double()
    x1, x2 = x[..., :h], x[..., h:r]
    c, s = args[1][..., 0].double().unsqueeze(1), args[1][..., 1].double().unsqueeze(1)
    c_t, s_t = c.to(dtype).double(), s.to(dtype).double()
    # their products, as they round them (a, b per output element: first half x1 c', -x2 s'; second x2 c', x1 s')
    a = torch.cat((x1 * c_t, x2 * c_t), -1).to(dtype).double()
    b = torch.cat((x2 * s_t, x1 * s_t), -1).to(dtype).double()
    m = torch.maximum(x1.abs(), x2.abs()).repeat(1, 1, 2)
    table = torch.cat((x1.abs() * c.abs() + x2.abs() * s.abs(),) * 2, -1)
    u_t = 2.0 ** -(BITS[dtype] + 1)
    o, t = ours[..., :r].double(), theirs[..., :r].double()
    bound = (0.5 * ulp(o, dtype) + 6 * U32 * m + ulp(t, dtype) + 0.5 * ulp(a, dtype) + 0.5 * ulp(b, dtype)
             + u_t * table)
    err = (o - t).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"


@pytest.mark.parametrize("d,r", [(64, 32), (128, 64)])
def test_cpu_partial_is_the_full_rotation_of_a_truncated_head(d, r):
    """Without norms, the partial op on (B, N, D) heads equals the full-width op on the same heads cut to their first
    R elements (the rotated part), bitwise: the partial path pairs x[j] with x[j + R/2], not x[j + D/2]."""
    args, _ = make(2, d, r, torch.bfloat16, seed=3)
    small = [args[0][..., :r].contiguous(), args[1].clone(), args[2][..., :r].contiguous(), args[3], args[4]]
    run_op(args, [None, None])
    run_op(small, [None, None])
    assert torch.equal(args[0][..., :r], small[0])


@pytest.mark.parametrize("pairs", [0, 33], ids=["R0", "R66"])
def test_cpu_bad_rope_width_is_rejected(pairs):
    """R / 2 outside [1, D / 2] (here D = 64): csrc/attention/rope_kv_cache.cu's message, from the CPU and the fake
    implementations; nothing is written."""
    args, _ = make(2, 64, 32, torch.bfloat16)
    args[1] = torch.rand(2, pairs, 2)
    msg = (r"^rope_kv_cache_: `rope` must be contiguous \(B, R / 2, 2\) with 1 <= R / 2 <= D / 2 = 32, "
           rf"got \[2, {pairs}, 2\]$")
    before = [t.clone() for t in args]
    with pytest.raises(ValueError, match=msg):
        cutlass_w8a8.rope_kv_cache_(*args, H, KVH)
    assert all(torch.equal(a, b) for a, b in zip(args, before))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in args]
        with pytest.raises(ValueError, match=msg):
            torch.ops.cutlass_w8a8.rope_kv_cache_(*fake, H, KVH)


@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
def test_opcheck_partial_cpu(norms):
    args, w = make(2, 64, 32, torch.bfloat16, norms=norms)
    tail = (w[0], w[1], EPS) if norms else ()
    opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default, (*args, H, KVH, *tail))


# ---- CUDA ----------------------------------------------------------------------------------------------------

GPU_CASES = [(d, r) for d in (64, 128, 256) for r in (d // 4, d // 2, d)]


def gpu_bound(ref, nmax, dtype, d, norms):
    """Per element, what the kernel may differ by from the CPU op: tests/ops/test_rope_kv_cache.py's bounds for
    R == D, unchanged by the width. Without norms one ulp of the element (the CPU's complex multiply may fuse a
    multiply-add where the kernel rounds each product). With norms, plus what the kernel's own order of the D
    squares' sum moves a normalized element, dn <= ulp_T(nmax) + (D + 11) u nmax (nmax the head's largest
    normalized |element|), carried through the rotation as at most 2 dn (|cos| dn1 + |sin| dn2); the pass-through
    elements move by dn alone, inside the same bound."""
    bound = ulp(ref, dtype)
    if norms:
        bound = bound + 2 * (ulp(nmax, dtype) + (d + 11) * U32 * nmax)
    return bound


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
@pytest.mark.parametrize("d,r", GPU_CASES, ids=[f"D{d}-R{r}" for d, r in GPU_CASES])
@pytest.mark.parametrize("b", [1, 3])
def test_cuda_partial_matches_cpu(b, d, r, norms, dtype):
    """The kernel against the CPU op on the same inputs, a row-padded qkv view: q / k heads within `gpu_bound`
    (the pass-through part bitwise the input without norms), value heads and the row padding untouched, the
    written cache entries exactly what the kernel left in qkv, every other entry as it was."""
    cpu, w = make(b, d, r, dtype, seed=100 * b + d + r, norms=norms)
    x0 = cpu[0].clone()
    gpu = [t.cuda() for t in cpu]
    wide = torch.full((b, H + 2 * KVH + 1, d), float("nan"), device="cuda", dtype=dtype)
    wide[:, :H + 2 * KVH] = gpu[0]
    gpu[0] = wide[:, :H + 2 * KVH]
    before = gpu[2].cpu()
    tail = (w[0].cuda(), w[1].cuda(), EPS) if norms else ()
    torch.ops.cutlass_w8a8.rope_kv_cache_(*gpu, H, KVH, *tail)
    normed = run_op(cpu, w)  # the CPU op on the host copies; its normalized heads
    torch.cuda.synchronize()
    got, ref = gpu[0].cpu(), cpu[0]
    nmax = normed.double().abs().amax(dim=-1, keepdim=True)
    bound = gpu_bound(ref[:, :H + KVH].double(), nmax, dtype, d, norms)
    err = (got[:, :H + KVH].double() - ref[:, :H + KVH].double()).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    if not norms:
        assert torch.equal(got[:, :H + KVH, r:], x0[:, :H + KVH, r:]), "the pass-through part changed"
    assert torch.equal(got[:, H + KVH:], x0[:, H + KVH:]), "the value heads changed"
    assert torch.isnan(wide[:, -1].float()).all(), "the padding was written"
    check_cache([got, cpu[1], gpu[2].cpu(), cpu[3], cpu[4]], before)


@pytest.mark.cuda
def test_cuda_partial_graph_replay_and_opcheck():
    """R = D / 2 with head norms (GLM-4.5's layout: D = 128, R = 64) captured in a CUDA graph: replays on new inputs
    equal eager calls bit for bit (qkv and the cache); then opcheck on CUDA."""
    def new(seed):
        args, w = make(3, 128, 64, torch.bfloat16, seed=seed, norms=True)
        return [t.cuda() for t in args], (w[0].cuda(), w[1].cuda(), EPS)

    static, tail = new(20)
    check_graph_replay(static, H, KVH, tail, (new(seed)[0] for seed in (21, 22)))  # the replays keep seed 20's norms
    args, tail = new(23)
    torch.library.opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default, (*args, H, KVH, *tail))


@pytest.mark.cuda
@pytest.mark.parametrize("pairs", [0, 33], ids=["R0", "R66"])
def test_cuda_bad_rope_width_is_rejected(pairs):
    """The C++ check: the CPU implementation's message (R / 2 outside [1, D / 2], D = 64); nothing is written."""
    args, _ = make(2, 64, 32, torch.bfloat16)
    args = [t.cuda() for t in args]
    args[1] = torch.rand(2, pairs, 2, device="cuda")
    msg = (r"^rope_kv_cache_: `rope` must be contiguous \(B, R / 2, 2\) with 1 <= R / 2 <= D / 2 = 32, "
           rf"got \[2, {pairs}, 2\]$")
    before = [t.clone() for t in args]
    with pytest.raises(ValueError, match=msg):
        torch.ops.cutlass_w8a8.rope_kv_cache_(*args, H, KVH)
    assert all(torch.equal(a, b) for a, b in zip(args, before))
