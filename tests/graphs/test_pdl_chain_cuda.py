"""Programmatic dependent launch (PDL) through a whole decode step.

Every kernel of the extension (quantization, RMSNorm, SiLU*mul, rotary + cache write, decode attention's split
and combine kernels or its fused kernel, the decode GEMM and its split-K reduce) is launched with PDL on sm90 and waits on
griddepcontrol before touching memory a predecessor writes; each signals its dependents early, and the decode
GEMM prefetches the start of its weight rows into L2 before it waits (csrc/core/launch_policy.hpp). A missing
or misplaced wait would let a kernel read an operand before its producer wrote it (or write over one its
predecessor still reads), which shows up as a result that differs from the same kernels run without PDL.

So: decode steps of the reference decoder, with PDL on, must equal bit for bit the same steps with PDL off,
eagerly (Python path and the decode_layer op) and inside CUDA graphs captured with PDL on, over several steps
of growing positions (the cache written by one step is read by the next). And a kernel launched with PDL right
after a torch kernel that writes its input must read the new value.
"""

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.graphs import capture
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder

pytestmark = pytest.mark.sm90

# Llama-3-8B's attention shape (32 / 8 heads of 128: query-head groups of 4) at a smaller width and depth, so
# that every kernel family of the step runs (decode GEMM at M <= 8, CUTLASS above, split attention; at S = 1024 the
# attention of batch 1 and 5 takes the split + combine kernels, of batch 12 the fused kernel on sm90 when it is allowed
# (the `attention_path` fixture: off by default, cutlass_w8a8._ext.set_decode_attention_fused): on an H200, 4 splits
# under the default wave rule (3 split CTAs resident per SM at G' = 4), 3 under CUTLASS_W8A8_ATTN_SPLITS=ctas).
CFG = LlamaConfig(vocab_size=2048, hidden_size=4096, intermediate_size=2048, num_layers=2, num_heads=32,
                  num_kv_heads=8, head_dim=128, max_position=1024)


@pytest.fixture
def pdl():
    previous = cw.set_pdl(True)
    yield cw.set_pdl
    cw.set_pdl(previous)


def _steps(model, batch, steps, first_position, seed, use_layer_op):
    """Logits of `steps` consecutive decode steps of `batch` rows from a zeroed cache (fresh random tokens)."""
    for layer in model.layers:
        layer.use_layer_op = use_layer_op
    model.reset_cache()
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for i in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (batch,), device="cuda", generator=g)
        positions = torch.full((batch,), first_position + i, device="cuda", dtype=torch.long)
        positions[0] = i  # a short row beside the long ones
        out.append(model(tokens, positions).clone())
    return torch.stack(out)


@pytest.fixture(params=[False, True], ids=["attention-default", "attention-fused-allowed"])
def attention_path(request):
    """The one-kernel decode attention path forbidden (the default) or allowed, restored after the test."""
    previous = cw._ext.set_decode_attention_fused(request.param)
    yield request.param
    cw._ext.set_decode_attention_fused(previous)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("batch", [1, 5, 12])
@pytest.mark.parametrize("use_layer_op", [False, True], ids=["python", "layer_op"])
def test_eager_steps_pdl_on_equal_off(pdl, attention_path, quant, batch, use_layer_op):
    if quant == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    model = LlamaDecoder(CFG, quant=quant, max_batch=16, max_seq_len=1024, device="cuda")
    pdl(False)
    off = _steps(model, batch, 4, 700, seed=batch, use_layer_op=use_layer_op)
    pdl(True)
    on = _steps(model, batch, 4, 700, seed=batch, use_layer_op=use_layer_op)
    assert torch.isfinite(on).all()
    assert torch.equal(on, off), f"{int((on != off).sum())} logits differ between PDL on and off"


@pytest.mark.parametrize("batch", [1, 8])
def test_graph_steps_pdl_on_equal_eager_off(pdl, batch):
    model = LlamaDecoder(CFG, quant="int8", max_batch=16, max_seq_len=1024, device="cuda")
    tokens = torch.zeros(batch, device="cuda", dtype=torch.long)
    positions = torch.zeros(batch, device="cuda", dtype=torch.long)
    pdl(True)
    graph, logits = capture(model, [tokens, positions])
    g = torch.Generator(device="cuda").manual_seed(batch)
    steps = [(torch.randint(0, CFG.vocab_size, (batch,), device="cuda", generator=g),
              torch.arange(batch, device="cuda") * 37 + 300 + i) for i in range(4)]
    model.reset_cache()
    replayed = []
    for t, p in steps:
        tokens.copy_(t)
        positions.copy_(p)
        graph.replay()
        replayed.append(logits.clone())
    pdl(False)
    model.reset_cache()
    eager = [model(t, p).clone() for t, p in steps]
    for i, (r, e) in enumerate(zip(replayed, eager)):
        assert torch.equal(r, e), f"step {i}: graph (PDL on) and eager (PDL off) logits differ"


@pytest.mark.parametrize("op", ["rms_norm_quant", "silu_mul_quant", "quantize_per_token"])
def test_pdl_kernel_reads_what_a_torch_kernel_just_wrote(pdl, op):
    """x is overwritten by a torch kernel (no PDL) right before our PDL-launched kernel reads it."""
    ops = torch.ops.cutlass_w8a8
    x = torch.randn(3, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    run = {"rms_norm_quant": lambda t: ops.rms_norm_quant(t, w, 1e-5, torch.int8, None, None),
           "silu_mul_quant": lambda t: ops.silu_mul_quant(t, torch.int8, None),
           "quantize_per_token": lambda t: ops.quantize_per_token(t, torch.int8)}[op]
    for i in range(5):
        new = torch.randn(3, 8192, device="cuda", dtype=torch.bfloat16) * (i + 1)
        pdl(True)
        x.copy_(new)
        got = run(x)
        pdl(False)
        want = run(new.clone())
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"{op}, round {i}: read a stale input"
