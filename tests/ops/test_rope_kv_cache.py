"""rope_kv_cache_: rotary embedding of q and k heads in place + the k/v write into the slot cache.

CPU: the reference is the decoder's former torch code (_rope_ + index_put_). CUDA: against that reference on
the same inputs (each rotated element within one ulp of the element type: the reference's complex multiply may
fuse a multiply-add where the kernel rounds each product), with the untouched cache entries left bitwise as
they were; capture and replay; opcheck.
"""

import pytest
import torch

import cutlass_w8a8  # noqa: F401 (registers the ops)
from cutlass_w8a8.models.llama import _rope_

H, KVH, D, SLOTS, S = 8, 2, 64, 5, 32


def inputs(b, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, H + 2 * KVH, D, generator=g).to(dtype)
    angles = torch.rand(b, D // 2, generator=g) * 6.28
    rope = torch.stack((angles.cos(), angles.sin()), dim=-1)
    cache = torch.randn(SLOTS, 2, KVH, S, D, generator=g).to(dtype)
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


def test_public_wrapper_is_the_op():
    a = inputs(3, torch.bfloat16, "cpu", seed=4)
    b = [t.clone() for t in a]
    assert cutlass_w8a8.rope_kv_cache_(*a, H, KVH) is None
    torch.ops.cutlass_w8a8.rope_kv_cache_(*b, H, KVH)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("case", ["positions int32", "slots int32", "rope strided", "rope short", "qkv strided heads",
                                  "kv_cache strided", "no positions"])
def test_cpu_checks_are_the_cuda_checks(case):
    """The CPU and fake implementations make csrc/attention/rope_kv_cache.cu's checks, with its messages (int32
    indices, layouts and rope's shape included); nothing is written when they fail."""
    qkv, rope, cache, slots, positions = inputs(2, torch.bfloat16, "cpu")
    exc, msg = {
        "positions int32": (TypeError, "^rope_kv_cache_: `positions` must be int64$"),
        "slots int32": (TypeError, "^rope_kv_cache_: `slots` must be int64$"),
        "rope strided": (ValueError, r"^rope_kv_cache_: `rope` must be contiguous \(B, D / 2, 2\), got \[2, 32, 2\]$"),
        "rope short": (ValueError, r"^rope_kv_cache_: `rope` must be contiguous \(B, D / 2, 2\), got \[2, 16, 2\]$"),
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
        "rope short": lambda: dict(rope=rope[:, :16].contiguous()),
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


@pytest.mark.cuda
def test_cuda_graph_replay_and_opcheck():
    qkv, rope, cache, slots, positions = inputs(3, torch.bfloat16, "cuda", seed=7)
    static = [t.clone() for t in (qkv, rope, cache, slots, positions)]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.cutlass_w8a8.rope_kv_cache_(*[t.clone() for t in static], H, KVH)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        torch.ops.cutlass_w8a8.rope_kv_cache_(*static, H, KVH)
    for seed in (1, 2):
        new = inputs(3, torch.bfloat16, "cuda", seed=seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        g.replay()
        eager = [t.clone() for t in new]
        torch.ops.cutlass_w8a8.rope_kv_cache_(*eager, H, KVH)
        assert torch.equal(static[0], eager[0]) and torch.equal(static[2], eager[2])
    torch.library.opcheck(torch.ops.cutlass_w8a8.rope_kv_cache_.default,
                          (*inputs(2, torch.bfloat16, "cuda", seed=3), H, KVH))
