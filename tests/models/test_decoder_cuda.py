"""The decoder in CUDA graphs: per-bucket replay, padding, greedy decoding, no host sync, joint capture with
Triton / CuPy / Warp kernels, torch.cuda.make_graphed_callables and torch.compile.

Comparisons, and why they are exact or not:

- graph replay vs the eager step at the same padded batch: bitwise. Same kernels on the same shapes and data.
- eager vs the float32 reference (`float_reference`): relative Frobenius error of the logits, per step, below
  `EAGER_VS_FP32_REL` (see there).
- torch.compile vs eager: relative error below `COMPILE_REL`; inductor fuses the elementwise ops and keeps
  their intermediates in float32 where eager rounds each to bf16.
"""

import copy
import functools

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import rel_err
from cutlass_w8a8.models import LlamaConfig, LlamaDecoder, float_reference, generate_greedy
from cutlass_w8a8.runner import DecodeGraphRunner, cuda_graph_batch_sizes
from _runner_greedy import bucket_steps, random_host_inputs

try:  # optional: the joint-capture tests skip without them
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:
    import warp as wp
except ImportError:
    wp = None

pytestmark = pytest.mark.cuda

# 2 layers of width 256: 4 query and 2 key/value heads of 64; buckets 1, 2, 4, 8, 16, 24, 32.
CFG = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position=256)
MAX_BATCH, MAX_SEQ = 32, 64

# Relative Frobenius error of the logits of one eager step against the float32 reference. The same models
# on CPU (the ops' reference kernels) give at most 0.7% (bf16), 2.7% (int8) and 6.6% (fp8) over 36 steps of
# 1 to 32 rows; the bounds are about 2.5x that. bf16 rounds every activation (2^-8 relative); W8A8 adds the
# activations that bf16 rounding moves into a neighbouring quantization bin (one step: absmax/127 for int8,
# 2^-3 relative for e4m3), which the float32 reference, quantizing float32 activations, does not share.
EAGER_VS_FP32_REL = {None: 2e-2, "int8": 6e-2, "fp8": 1.5e-1}
# torch.compile (inductor) against eager: measured 0.6% (bf16) and 0.9% (int8) on CPU inductor.
COMPILE_REL = 3e-2


@functools.lru_cache(maxsize=None)
def _fp8_unavailable():
    lin = cw.W8A8Linear(32, 32, bias=False, quant_dtype=torch.float8_e4m3fn, device="cuda")
    try:
        lin(torch.randn(2, 32, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def build(quant, **kw):
    if quant == "fp8" and _fp8_unavailable():
        pytest.skip(f"fp8 kernels unavailable: {_fp8_unavailable()}")
    kw.setdefault("max_batch", MAX_BATCH)
    return LlamaDecoder(CFG, quant, max_seq_len=MAX_SEQ, device="cuda", **kw)


# host_inputs(batch, gen): random (token_ids, positions, slots) CPU int64 tensors of `batch` rows in distinct slots
host_inputs = functools.partial(random_host_inputs, vocab=CFG.vocab_size, max_seq=MAX_SEQ, max_batch=MAX_BATCH)


def on_cuda(*ts):
    return tuple(t.cuda() for t in ts)


# ----------------------------------------------------------------------------------------------------
# the graph runner


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
@torch.no_grad()
def test_every_bucket_replay_equals_eager_and_reference(quant):
    """For every bucket, full and padded (b - 1 rows), 3 steps with new inputs each: replay == eager step
    (bitwise) and eager ~ float32 reference (`EAGER_VS_FP32_REL`)."""
    model = build(quant)
    ref = float_reference(model)
    runner = DecodeGraphRunner(model)
    assert runner.sizes == cuda_graph_batch_sizes(MAX_BATCH) == [1, 2, 4, 8, 16, 24, 32]
    assert list(runner.graphs) == sorted(runner.sizes, reverse=True)  # captured largest first
    assert len({g.pool() for g in runner.graphs.values()}) == 1  # one shared pool
    for b, n, i, inputs, graph, eager in bucket_steps(runner, host_inputs, 3, torch.Generator().manual_seed(0)):
        expect = ref(*on_cuda(*inputs))
        where = f"bucket {b}, {n} rows, step {i}"
        assert graph.shape == (n, CFG.vocab_size), where
        assert torch.equal(graph, eager), where
        err = rel_err(eager, expect)
        assert err < EAGER_VS_FP32_REL[quant], f"{where}: relative error {err:.3g}"


@pytest.mark.parametrize("quant", [None, "int8"])
@torch.no_grad()
def test_padded_rows_do_not_change_real_rows(quant):
    """5 rows padded to 8: another pad token leaves the real rows' logits bitwise unchanged; the padding
    writes only the scratch slot (the other slots' cache equals that of unpadded eager steps, to the
    rounding of GEMMs run at another M); the real rows match the unpadded step (1e-2 relative: cuBLAS
    may pick another algorithm at M = 5)."""
    model = build(quant)
    runner = DecodeGraphRunner(model, sizes=[8])
    gen = torch.Generator().manual_seed(1)
    slots = torch.tensor([9, 0, 31, 4, 17])
    steps = [(host_inputs(5, gen)[0], torch.full((5,), t), slots) for t in range(4)]
    outs, caches = {}, {}
    for pad in (0, 777):
        model.reset_cache()
        runner.pad_token_id = pad
        outs[pad] = [runner.step(*s).clone() for s in steps]
        caches[pad] = [layer.self_attn.kv_cache.clone() for layer in model.layers]
    for a, b in zip(outs[0], outs[777]):
        assert torch.equal(a, b)
    model.reset_cache()
    plain = [model(*on_cuda(*s)) for s in steps]
    for a, b in zip(outs[0], plain):
        assert rel_err(a, b) < 1e-2
    untouched = [s for s in range(MAX_BATCH) if s not in slots.tolist()]
    for layer, cache in zip(model.layers, caches[0]):
        assert cache[untouched].abs().sum() == 0
        assert rel_err(cache[slots], layer.self_attn.kv_cache[slots]) < 1e-2
        assert cache[model.scratch_slot].abs().sum() > 0


@pytest.mark.parametrize("quant", [None, "int8"])
@torch.no_grad()
def test_greedy_32_tokens_graph_equals_eager(quant):
    """Greedy decoding of 32 tokens after a 6-token prompt (fed as decode steps): the graphs give the eager
    tokens, token for token, at a bucket size (4 rows; also equal to the bare model) and padded (3 rows)."""
    model = build(quant)
    runner = DecodeGraphRunner(model)
    torch.manual_seed(0)
    prompt = torch.randint(0, CFG.vocab_size, (4, 6), device="cuda")
    slots = torch.tensor([3, 30, 7, 12], device="cuda")
    for n in (4, 3):
        model.reset_cache()
        eager = generate_greedy(lambda t, p, s: runner.step(t, p, s, use_graph=False), prompt[:n], 32, slots[:n])
        model.reset_cache()
        graph = generate_greedy(runner.step, prompt[:n], 32, slots[:n])
        assert graph.shape == (n, 32)
        assert torch.equal(graph, eager), f"{n} rows"
        if n == 4:
            model.reset_cache()
            assert torch.equal(generate_greedy(model, prompt, 32, slots), graph)


@torch.no_grad()
def test_steps_without_host_sync_on_a_side_stream():
    """Host inputs (pinned copies), device inputs, the eager step and a greedy loop under sync debug mode
    "error", on a non-default stream: nothing synchronises the host, and the three paths agree bitwise.

    Each step runs from host inputs, then from the same inputs on the device, then eagerly: the later two
    rewrite the very keys and values the first wrote, so all three see the same cache."""
    model = build("int8")
    runner = DecodeGraphRunner(model)
    gen = torch.Generator().manual_seed(2)
    steps = [host_inputs(n, gen) for n in (1, 3, 8, 20, 32, 5, 2, 16, 7, 1)]  # more than `ring` host steps
    dev_steps = [on_cuda(*s) for s in steps]
    torch.manual_seed(2)
    prompt = torch.randint(0, CFG.vocab_size, (3, 4), device="cuda")
    slots = torch.tensor([5, 6, 7], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    outs = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            for (tok, pos, slots_), dev in zip(steps, dev_steps):
                outs.append((runner.step(tok.tolist(), pos, slots_).clone(), runner.step(*dev).clone(),
                             runner.step(*dev, use_graph=False).clone()))
            tokens = generate_greedy(runner.step, prompt, 8, slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    for i, (from_host, from_dev, eager) in enumerate(outs):
        assert torch.equal(from_host, from_dev), f"step {i}"
        assert torch.equal(from_host, eager), f"step {i}"
    model.reset_cache()
    assert torch.equal(tokens, generate_greedy(lambda t, p, s: runner.step(t, p, s, use_graph=False),
                                               prompt, 8, slots))


@torch.no_grad()
def test_eager_above_the_largest_bucket():
    model = build("int8")
    runner = DecodeGraphRunner(model, max_batch=8)
    assert runner.sizes == [1, 2, 4, 8]
    tok, pos, slots = host_inputs(12, torch.Generator().manual_seed(3))
    out = runner.step(tok, pos, slots).clone()
    model.reset_cache()
    assert torch.equal(out, model(*on_cuda(tok, pos, slots)))


@torch.no_grad()
def test_graph_pool_is_reported():
    runner = DecodeGraphRunner(build("int8"), max_batch=8)
    assert runner.capture_seconds > 0 and set(runner.capture_seconds_per_size) == {1, 2, 4, 8}
    assert runner.graph_pool_bytes() > 0


# ----------------------------------------------------------------------------------------------------
# one graph with Triton, CuPy and Warp kernels


if triton is not None:
    @triton.jit
    def _temperature_kernel(x_ptr, out_ptr, temp_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
        """``out[row, :] = float32(x[row, :]) / temp[0]``; grid (rows, column blocks of BLOCK)."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, x / tl.load(temp_ptr), mask=m)


_ARGMAX_SRC = r"""
extern "C" __global__ void row_argmax(const float* x, long long* out, int n_cols) {
    // One block of 256 threads per row; ties go to the lowest index, as torch.argmax.
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    const float* row = x + (long long)blockIdx.x * n_cols;
    float bv = 0.0f;
    int bi = n_cols;  // n_cols: nothing seen yet
    for (int c = threadIdx.x; c < n_cols; c += blockDim.x) {
        float v = row[c];
        if (bi == n_cols || v > bv) { bv = v; bi = c; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float v = best_v[threadIdx.x + s], w = best_v[threadIdx.x];
            int i = best_i[threadIdx.x + s], j = best_i[threadIdx.x];
            if (i < n_cols && (j == n_cols || v > w || (v == w && i < j))) {
                best_v[threadIdx.x] = v;
                best_i[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0];
}
"""


def _check_sampling_steps(runner, temp, what, seed):
    """Several steps (buckets, padding, new temperatures; inputs drawn from ``seed``): replay == eager, the scaled
    logits equal ``logits.float() / temp`` to a few float32 ulps (Triton's fp32 division is not correctly rounded),
    and the tokens are the argmax of the scaled logits."""
    gen = torch.Generator().manual_seed(seed)
    for i, n in enumerate((1, 3, 8, 13, 32)):
        tok, pos, slots = host_inputs(n, gen)
        temp.fill_(0.5 + 0.25 * i)
        graph = [t.clone() for t in runner.step(tok, pos, slots)]
        eager = [t.clone() for t in runner.step(tok, pos, slots, use_graph=False)]
        for g, e in zip(graph, eager):
            assert torch.equal(g, e), f"{what}, step {i}"
        logits, scaled, tokens = graph
        torch.testing.assert_close(scaled, logits.float() / temp, rtol=5e-7, atol=0)
        assert torch.equal(tokens, scaled.argmax(dim=-1)), f"{what}, step {i}"


@torch.no_grad()
def test_joint_capture_triton_and_cupy():
    """Decoder step + Triton temperature kernel + CuPy argmax kernel, captured into each bucket's graph."""
    if triton is None:
        pytest.skip("triton is not installed")
    cupy = pytest.importorskip("cupy")
    import numpy as np

    model = build("int8")
    temp = torch.ones(1, device="cuda")
    scaled = torch.empty(MAX_BATCH, CFG.vocab_size, device="cuda")
    tokens = torch.empty(MAX_BATCH, dtype=torch.int64, device="cuda")
    # Wrapped once, outside any capture: CuPy sees torch's buffers without a copy or an allocation.
    cp_scaled, cp_tokens = cupy.from_dlpack(scaled), cupy.from_dlpack(tokens)
    argmax = cupy.RawKernel(_ARGMAX_SRC, "row_argmax")
    cp_streams = {}  # CuPy handles of torch streams, made on first use (the warm-up, outside the capture)

    def sample(logits):
        b, v = logits.shape
        _temperature_kernel[(b, triton.cdiv(v, 512))](logits, scaled, temp, v, logits.stride(0), BLOCK=512)
        ptr = torch.cuda.current_stream().cuda_stream
        if ptr not in cp_streams:  # 0: torch's (legacy) default stream, CuPy's null stream
            cp_streams[ptr] = cupy.cuda.ExternalStream(ptr) if ptr else cupy.cuda.Stream.null
        with cp_streams[ptr]:
            argmax((b,), (256,), (cp_scaled, cp_tokens, np.int32(v)))
        return logits, scaled[:b], tokens[:b]

    runner = DecodeGraphRunner(model, postprocess=sample)
    _check_sampling_steps(runner, temp, "triton+cupy", seed=4)


@torch.no_grad()
def test_joint_capture_warp():
    """Decoder step + a Warp kernel on torch's stream in the same graph; skips where Warp is not installed."""
    if wp is None:
        pytest.skip("warp is not installed")
    wp.init()
    model = build("int8")
    temp = torch.ones(1, device="cuda")
    logits32 = torch.empty(MAX_BATCH, CFG.vocab_size, device="cuda")
    scaled = torch.empty_like(logits32)
    w_in, w_temp, w_out = wp.from_torch(logits32), wp.from_torch(temp), wp.from_torch(scaled)
    wp_streams = {}

    def sample(logits):
        b = logits.shape[0]
        logits32[:b].copy_(logits)
        ptr = torch.cuda.current_stream().cuda_stream
        if ptr not in wp_streams:
            wp_streams[ptr] = wp.stream_from_torch(torch.cuda.current_stream())
        wp.launch(_warp_temperature, dim=(b, logits.shape[1]), inputs=[w_in, w_temp], outputs=[w_out],
                  stream=wp_streams[ptr])
        return logits, scaled[:b], scaled[:b].argmax(dim=-1)

    runner = DecodeGraphRunner(model, postprocess=sample)
    _check_sampling_steps(runner, temp, "warp", seed=5)


if wp is not None:
    @wp.kernel
    def _warp_temperature(x: wp.array2d(dtype=wp.float32), t: wp.array(dtype=wp.float32),
                          y: wp.array2d(dtype=wp.float32)):
        i, j = wp.tid()
        y[i, j] = x[i, j] / t[0]


# ----------------------------------------------------------------------------------------------------
# PyTorch's own graph APIs


@torch.no_grad()
def test_make_graphed_callables_w8a8_stack_and_decoder_mlp():
    torch.manual_seed(0)
    stack = cw.quantize_(nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 256)).to("cuda", torch.bfloat16))
    mlp = build("int8").layers[0].mlp
    for module in (stack, mlp):
        eager = copy.deepcopy(module)
        x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
        with torch.enable_grad():
            graphed = torch.cuda.make_graphed_callables(module, (x,))
        for i in range(3):
            x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16) * (i + 1)
            assert torch.equal(graphed(x), eager(x)), f"{type(module).__name__} call {i}"


def _compile_steps(quant, mode):
    """The decoder and a deep copy compiled with ``mode``: 5 steps of 4 rows; returns the relative errors."""
    model = build(quant, max_batch=8)
    compiled = torch.compile(copy.deepcopy(model), mode=mode, fullgraph=True)
    slots = torch.tensor([0, 5, 2, 7], device="cuda")
    errs = []
    for t in range(5):  # reduce-overhead: warm-up, record, then replays
        tok = torch.randint(0, CFG.vocab_size, (4,), device="cuda")
        pos = torch.full((4,), t, device="cuda")
        out = compiled(tok, pos, slots).clone()
        errs.append(rel_err(out, model(tok, pos, slots)))
    return errs


@pytest.mark.parametrize("quant", [None, "int8"])
@torch.no_grad()
def test_torch_compile_fullgraph_decoder(quant):
    errs = _compile_steps(quant, None)
    assert max(errs) < COMPILE_REL, errs


@torch.no_grad()
def test_torch_compile_reduce_overhead_decoder():
    """The W8A8 decoder under ``mode="reduce-overhead"`` (inductor + cudagraph trees): no cudagraph skip
    (the KV cache is a static address it may mutate) and logits equal to eager within `COMPILE_REL`."""
    from torch._dynamo.utils import counters

    counters.clear()
    errs = _compile_steps("int8", "reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert max(errs) < COMPILE_REL, errs


# Static input scales per projection for CFG's activations (normed inputs of about 1, attention outputs of
# about 0.3, silu(gate) * up of about 0.05): about max|x| / QMAX, so the quantized values use the range.
STATIC_SCALES = {"qkv_proj": 0.02, "o_proj": 4e-3, "gate_up_proj": 0.02, "down_proj": 1e-3}


@pytest.mark.parametrize("quant, static", [(None, False), ("int8", False), ("fp8", False), ("int8", True),
                                           ("fp8", True)])
def test_layer_op_equals_python_path_and_opcheck(quant, static):
    """The one-call layer (decode_layer, csrc/models/decode_layer.cpp) against the layers' Python path on the GPU:
    bitwise over 3 steps (same kernels, same order: for a W8A8 o_proj, decode_attention_quant then the GEMM),
    with dynamic and static activation scales; and opcheck of the op on the first layer's operands (schema
    mutations: residual and kv_cache; fake kernel; dispatch). The graph-runner tests above run the op (the
    default), so its capture and replay are covered there."""
    if quant == "fp8" and _fp8_unavailable():
        pytest.skip(_fp8_unavailable())
    model = build(quant, max_batch=8)
    if static:
        for layer in model.layers:
            for name, mod in (*layer.self_attn.named_children(), *layer.mlp.named_children()):
                mod.input_scale = torch.tensor([STATIC_SCALES[name]], device="cuda")
    tok = torch.tensor([3, 7, 11], device="cuda")
    slots = torch.tensor([0, 2, 5], device="cuda")
    outs = {}
    for use_op in (True, False):
        model.reset_cache()
        for layer in model.layers:
            layer.use_layer_op = use_op
        outs[use_op] = [model(tok + i, torch.full_like(tok, i), slots) for i in range(3)]
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b)
    # opcheck on a layer's real operands (the op mutates residual and the cache: copies)
    layer = model.layers[0]
    layer.use_layer_op = True
    h = torch.randn(3, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(h)
    ops = list(layer._layer_op_operands(h))
    ops[-1] = ops[-1].clone()
    ctx = model._context(torch.tensor([0, 1, 2], device="cuda"), slots)
    attn = layer.self_attn
    args = (h, residual, *ops, ctx.rope, ctx.slots, ctx.positions, attn.num_heads, attn.num_kv_heads,
            attn.head_dim ** -0.5)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.cutlass_w8a8.decode_layer.default, args,
                          test_utils=utils if quant == "fp8" else ("test_schema",) + utils)
