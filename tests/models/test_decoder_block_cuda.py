"""The decoder with block-scaled fp8 layers (``quant="fp8-block"``, issue 26) on an sm90 GPU: bucketed CUDA graphs
against the eager step and the float32 reference, greedy decoding, steps without host synchronisation, the
exact-M runner (`UpdatableGraph` nodes resized), and the bypass of the one-op layer. The CPU side is
test_decoder_block_cpu.py.

Comparisons, and why they are exact or not:

- graph replay vs the eager step at the same padded batch: bitwise (same kernels on the same shapes and data).
- eager vs `float_reference` (the float32 model of the dequantized weights with the same 1x128 activation
  quantization): relative Frobenius error of the logits below `EAGER_VS_FP32_REL`. The same model on the CPU (the
  ops' references) gives at most 5.9% over the steps of `test_every_bucket_replay_equals_eager_and_reference`
  (per-channel fp8: 6.4%); the bound is about 2.5x, test_decoder_cuda.py's for fp8.
- the exact-M runner (one UpdatableGraph captured at the largest bucket, resized, for the batches above the decode
  GEMM's bound; buckets up to it: `DecodeGraphRunner.exact_floor`, issue 37): every step equals the unpadded eager
  step bitwise, since each graph runs the GEMM family eager runs at that batch (lm_head quantized, so every GEMM is
  ours), and the float32 reference as eager is.
"""

import functools

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rel_err
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder, float_reference
from cutlass_w8a8.runner import DecodeGraphRunner, cuda_graph_batch_sizes
from _runner_greedy import bucket_steps, greedy_graph_and_eager, random_host_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.sm90]

# 2 layers of width 256: 4 query and 2 key/value heads of 64 (qkv_proj rows: q 256, k 128, v 128), MLP 512: every K
# and every fused part's N a multiple of 128. Buckets 1, 2, 4, 8, 16, 24, 32.
CFG = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position=256)
MAX_BATCH, MAX_SEQ = 32, 64
EAGER_VS_FP32_REL = 1.5e-1


@functools.lru_cache(maxsize=None)
def _block_unavailable():
    """Why a block-scaled layer does not run here (None when it does): a build without the block kernels."""
    lin = torch.nn.Linear(128, 128, bias=False, device="cuda", dtype=torch.bfloat16)
    try:
        layer = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128)))
        layer(torch.randn(2, 128, device="cuda", dtype=torch.bfloat16))
        layer(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16))  # the decode GEMM and CUTLASS
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0]
    return None


def build(**kw):
    if _block_unavailable():
        pytest.skip(f"block-scaled fp8 kernels unavailable: {_block_unavailable()}")
    kw.setdefault("max_batch", MAX_BATCH)
    return LlamaDecoder(CFG, "fp8-block", max_seq_len=MAX_SEQ, device="cuda", **kw)


# host_inputs(batch, gen): random (token_ids, positions, slots) CPU int64 tensors of `batch` rows in distinct slots
host_inputs = functools.partial(random_host_inputs, vocab=CFG.vocab_size, max_seq=MAX_SEQ, max_batch=MAX_BATCH)


def on_cuda(*ts):
    return tuple(t.cuda() for t in ts)


@pytest.mark.parametrize("quant_lm_head", [False, True])
@torch.no_grad()
def test_every_bucket_replay_equals_eager_and_reference(quant_lm_head):
    """For every bucket, full and padded (b - 1 rows), 2 steps with new inputs each: replay == eager step
    (bitwise) and eager ~ float32 reference (`EAGER_VS_FP32_REL`)."""
    model = build(quant_lm_head=quant_lm_head)
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.weight_block_size == (128, 128) and layer._layer_op_operands(
        torch.zeros(2, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)) is None  # no one-op layer
    ref = float_reference(model)
    runner = DecodeGraphRunner(model)
    assert runner.sizes == cuda_graph_batch_sizes(MAX_BATCH)
    for b, n, i, inputs, graph, eager in bucket_steps(runner, host_inputs, 2, torch.Generator().manual_seed(0)):
        expect = ref(*on_cuda(*inputs))
        where = f"bucket {b}, {n} rows, step {i}"
        assert graph.shape == (n, CFG.vocab_size) and torch.isfinite(graph).all(), where
        assert torch.equal(graph, eager), where
        err = rel_err(eager, expect)
        assert err < EAGER_VS_FP32_REL, f"{where}: relative error {err:.3g}"


@torch.no_grad()
def test_greedy_graph_equals_eager_without_host_sync():
    """Greedy decoding of 16 tokens after a 4-token prompt, through the graphs on a side stream under sync debug
    mode "error" (nothing synchronises the host), equals the eager runner's tokens, padded (3 rows) and at a
    bucket (4 rows)."""
    model = build()
    runner = DecodeGraphRunner(model)
    torch.manual_seed(0)
    prompt = torch.randint(0, CFG.vocab_size, (4, 4), device="cuda")
    slots = torch.tensor([3, 30, 7, 12], device="cuda")
    for n, (graph, eager) in greedy_graph_and_eager(runner, model, prompt, slots, 16).items():
        assert graph.shape == (n, 16) and torch.equal(graph, eager), f"{n} rows"


@torch.no_grad()
def test_exact_runner_resizes_block_nodes():
    """mode="exact": one UpdatableGraph captured at 16 rows, its nodes (the block GEMMs, the group-quantizing norms
    and SiLU*mul, attention) resized to each batch above 8 before its step, buckets 1, 2, 4, 8 below; every step's
    logits equal the unpadded eager step's bitwise and are close to the float32 reference, and a repeated batch
    gives the same logits bitwise."""
    model = build(max_batch=16, quant_lm_head=True)
    ref = float_reference(model)
    runner = DecodeGraphRunner(model, mode="exact")
    assert (runner.exact_floor, runner.sizes) == (8, [1, 2, 4, 8, 16])
    gen = torch.Generator().manual_seed(5)
    seen = {}
    for n in (16, 3, 1, 9, 8, 3):
        # every row at position 7 of its slot: positions 0..6 stay zero, 7 is written by the row's own step, so a
        # step repeated later reads the same cache whatever ran in between
        tok = torch.randint(0, CFG.vocab_size, (n,), generator=gen)
        pos, slots = torch.full((n,), 7), torch.randperm(16, generator=gen)[:n]
        out = runner.step(tok, pos, slots).clone()
        assert torch.equal(out, model(*on_cuda(tok, pos, slots))), f"{n} rows: exact runner != eager step"
        err = rel_err(out, ref(*on_cuda(tok, pos, slots)))
        assert err < EAGER_VS_FP32_REL, f"{n} rows: relative error {err:.3g}"
        if n in seen:  # the earlier step of this size again: the same logits, bitwise
            prev_tok, prev_pos, prev_slots, prev_out = seen[n]
            again = runner.step(prev_tok, prev_pos, prev_slots).clone()
            assert torch.equal(again, prev_out)
        seen[n] = (tok, pos, slots, out)


def test_decode_layer_refuses_block_layers():
    """As on the CPU: the one-op layer is bypassed for block layers, and given their operands it raises the block
    GEMM's scale_a error (the same message as the CPU reference)."""
    model = build(max_batch=4)
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    ops = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps]
    for mod in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        ops += [mod.weight, mod.weight_scale, mod.input_scale]
    ops.append(attn.kv_cache)
    residual = torch.randn(2, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert layer._layer_op_operands(residual) is None
    ctx = model._context(torch.tensor([0, 3], device="cuda"), torch.tensor([0, 1], device="cuda"))
    with pytest.raises(ValueError, match=r"scaled_mm: `scale_a` must be \[M, K/128\] = \[2, 2\] \(1x128 groups\) with "
                                         r"block scales, got shape \(2, 1\)"):
        torch.ops.cutlass_w8a8.decode_layer(None, residual, *ops, ctx.rope, ctx.slots, ctx.positions, CFG.num_heads,
                                            CFG.num_kv_heads, 0.125)
