"""The reference decoder with Qwen3-MoE layers (issue 27) on an sm90 GPU: bucketed CUDA graphs against the eager
step across changing routings, the eager step against the float32 reference, greedy decoding through the graphs
without host synchronisation. The CPU side is test_decoder_moe_cpu.py.

Comparisons, and why they are exact or not:

- graph replay vs the eager step at the same padded batch: bitwise (the same kernels on the same shapes and data;
  the routing ops are deterministic: a stable sort by expert, the top-k sum in a fixed order).
- eager vs `float_reference` (float32, dequantized weights, the same activation quantization; `DequantizedMoE` for
  the experts), the reference's routers fed the model's router logits (test_decoder_moe_cpu.step_with_routing: a
  float32 router would pick another expert wherever two routing probabilities are within rounding): relative
  Frobenius error of the logits below test_decoder_moe_cpu's `EAGER_VS_FP32_REL` (CPU: 0.7% bf16, 2.1% int8, 5.4%
  fp8, 4.9% block; the bounds are the dense decoder's CUDA ones, ~2.8x).
"""

import functools

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder, MoEExperts, float_reference
from cutlass_w8a8.runner import DecodeGraphRunner, cuda_graph_batch_sizes
from _runner_greedy import bucket_steps, greedy_graph_and_eager, random_host_inputs
from cutlass_w8a8.testing.references import rel_err
from test_decoder_moe_cpu import EAGER_VS_FP32_REL, step_with_routing

pytestmark = [pytest.mark.cuda, pytest.mark.sm90]

# 2 layers of width 256, 4 query and 2 key/value heads of 64 with head norms, 16 experts of 128, top-4 (every K a
# multiple of 128: the block model). Buckets 1, 2, 4, 8, 16: up to 64 routed rows, across the grouped GEMM's decode
# kernel and its CUTLASS path.
CFG = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position=256, qk_norm=True, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128)
MAX_BATCH, MAX_SEQ = 16, 64
QUANTS = [None, "int8", "fp8", "fp8-block"]


@functools.lru_cache(maxsize=None)
def _moe_unavailable(quant):
    """Why the W8A8 MoE layer of ``quant`` does not run here (None when it does): a build without its kernels."""
    if quant is None:
        return None
    block = (128, 128) if quant == "fp8-block" else None
    dtype = torch.int8 if quant == "int8" else torch.float8_e4m3fn
    ex = MoEExperts(4, 128, 128, 2, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)
        ex.down_proj.normal_(0, 0.02)
    layer = cw.W8A8MoE.from_float(ex, cw.W8A8Config(dtype=dtype, weight_block_size=block), 2, True)
    try:
        layer(torch.randn(3, 128, device="cuda", dtype=torch.bfloat16), torch.randn(3, 4, device="cuda"))
        torch.cuda.synchronize()
    except NotImplementedError as exc:
        return str(exc).splitlines()[0]
    return None


def build(quant, **kw):
    if _moe_unavailable(quant):
        pytest.skip(f"W8A8 MoE kernels unavailable for {quant}: {_moe_unavailable(quant)}")
    kw.setdefault("max_batch", MAX_BATCH)
    return LlamaDecoder(CFG, quant, max_seq_len=MAX_SEQ, device="cuda", **kw)


# host_inputs(batch, gen): random (token_ids, positions, slots) CPU int64 tensors of `batch` rows in distinct slots
host_inputs = functools.partial(random_host_inputs, vocab=CFG.vocab_size, max_seq=MAX_SEQ, max_batch=MAX_BATCH)


def on_cuda(*ts):
    return tuple(t.cuda() for t in ts)


@pytest.mark.parametrize("quant", QUANTS)
@torch.no_grad()
def test_every_bucket_replay_equals_eager_and_reference(quant):
    """For every bucket, full and padded (b - 1 rows), 2 steps with new inputs (new routings) each: replay == eager
    step at the bucket (bitwise), and the eager step of the rows themselves ~ the float32 reference."""
    model = build(quant)
    layer = model.layers[0]
    assert layer._layer_op_operands(torch.zeros(2, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)) is None
    assert isinstance(layer.mlp.experts, MoEExperts if quant is None else cw.W8A8MoE)
    ref = float_reference(model)
    runner = DecodeGraphRunner(model)
    assert runner.sizes == cuda_graph_batch_sizes(MAX_BATCH)
    for b, n, i, inputs, graph, eager in bucket_steps(runner, host_inputs, 2, torch.Generator().manual_seed(0)):
        where = f"{quant} bucket {b}, {n} rows, step {i}"
        assert graph.shape == (n, CFG.vocab_size) and torch.isfinite(graph).all(), where
        assert torch.equal(graph, eager), where
        out, expect = step_with_routing(model, ref, *on_cuda(*inputs))
        err = rel_err(out, expect)
        assert err < EAGER_VS_FP32_REL[quant], f"{where}: relative error {err:.3g}"


@pytest.mark.parametrize("quant", [None, "int8"])
@torch.no_grad()
def test_greedy_graph_equals_eager_without_host_sync(quant):
    """Greedy decoding of 12 tokens after a 3-token prompt, through the graphs on a side stream under sync debug
    mode "error" (nothing in the MoE step synchronises the host), equals the eager runner's tokens, padded (3 rows)
    and at a bucket (4 rows)."""
    model = build(quant)
    runner = DecodeGraphRunner(model)
    torch.manual_seed(0)
    prompt = torch.randint(0, CFG.vocab_size, (4, 3), device="cuda")
    slots = torch.tensor([3, 14, 7, 0], device="cuda")
    for n, (graph, eager) in greedy_graph_and_eager(runner, model, prompt, slots, 12).items():
        assert graph.shape == (n, 12) and torch.equal(graph, eager), f"{quant}, {n} rows"
