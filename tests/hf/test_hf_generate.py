"""transformers' two decode paths with `W8A8Linear` layers: eager ``generate`` and a compiled static-cache step.

A tiny random ``LlamaForCausalLM`` (every projection's K and N a multiple of 16), ``quantize_``d to int8 and fp8
with ``lm_head`` left in bf16, against the bf16 model it was copied from:

- eager ``generate`` (greedy, 16 new tokens, dynamic and static caches): the tokens are well formed, the logits
  of each decode step equal the same model's full forward over the generated sequence (the KV cache path is the
  same function), and the W8A8 logits stay close to the bf16 model's (SQNR);
- a ``StaticCache`` with ``torch.compile(model.forward, fullgraph=True)``: one graph (no break, no recompile
  as the cache grows) whose logits equal the eager step's within a tolerance, and bit for bit with inductor's
  ``emulate_precision_casts``; on CUDA with ``mode="reduce-overhead"``, which must replay CUDA graphs.

On the CPU inductor compiles C++ with the system compiler; the compile tests use one layer to stay fast.
"""

import copy
import shutil

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")

QUANT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
NEW_TOKENS = 16
PROMPT = 8

# W8A8 logits vs the bf16 model's over the generated sequence (eager, CPU): measured 39.4-39.8 dB (int8) and
# 27.9-29.5 dB (fp8) over 3 seeds of the 2-layer model below. Random-weight logits are nearly flat, so greedy
# tokens are not compared (near-ties flip); the SQNR is the metric (torchao's).
W8A8_SQNR_DB = {"int8": 30.0, "fp8": 20.0}
# A decode step's logits vs the same model's full forward over the sequence (KV cache vs none): bf16 attention
# and matmuls at another M round differently; measured 41-51 dB (CPU), identical in some static-cache runs.
STEP_VS_FULL_SQNR_DB = 30.0
# Compiled vs eager step logits, worst step (default inductor config: it fuses and rounds bf16 chains once, and a
# W8A8 activation may then round to the next int8 / fp8 value): measured on the CPU 43-47 dB (int8), 34-48 dB
# (fp8). A wrong stride, a stale cache position or the replay of old inputs lands far below.
COMPILED_SQNR_DB = {"int8": 30.0, "fp8": 25.0}


# inductor compiles C++ on the CPU
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                               reason="torch.compile on the CPU needs a C++ compiler (g++, c++ or clang++)")


def sqnr_db(out, ref):
    """``10 log10(|ref|^2 / |out - ref|^2)`` in dB, in float64."""
    out, ref = out.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-300)))


def tiny_llama(layers=2, device="cpu", seed=0):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=None)  # no EOS: generate always makes NEW_TOKENS tokens
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device, torch.bfloat16).eval()


def quantized(bf16, name):
    model = cw.quantize_(copy.deepcopy(bf16), cw.W8A8Config(dtype=QUANT[name]),
                         filter_fn=lambda m, fqn: "lm_head" not in fqn)
    assert type(model.model.layers[0].self_attn.k_proj) is cw.W8A8Linear
    assert type(model.model.layers[-1].mlp.down_proj) is cw.W8A8Linear
    assert type(model.lm_head) is torch.nn.Linear
    return model


def _skip_without_fp8(name, device):
    if name == "fp8" and device == "cuda" and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")


# ----------------------------------------------------------------------------------------------------
# eager generate


def check_generate(device, name, cache_implementation):
    bf16 = tiny_llama(device=device)
    model = quantized(bf16, name)
    ids = torch.randint(3, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, cache_implementation=cache_implementation,
                             disable_compile=True, return_dict_in_generate=True, output_logits=True)
        seq = out.sequences
        assert seq.shape == (2, PROMPT + NEW_TOKENS) and torch.equal(seq[:, :PROMPT], ids)
        assert int(seq.min()) >= 0 and int(seq.max()) < 256
        steps = torch.stack(out.logits, 1)  # (2, NEW_TOKENS, V): the logits each new token was chosen from
        assert torch.equal(steps.argmax(-1), seq[:, PROMPT:]), "greedy: each token is its step's argmax"
        full = model(seq).logits[:, PROMPT - 1:-1]
        ref = bf16(seq).logits[:, PROMPT - 1:-1]
    assert torch.isfinite(steps).all()
    step_sqnr = sqnr_db(steps, full)
    assert step_sqnr > STEP_VS_FULL_SQNR_DB, f"decode steps vs full forward: {step_sqnr:.1f} dB"
    w8a8_sqnr = sqnr_db(full, ref)
    assert w8a8_sqnr > W8A8_SQNR_DB[name], f"{name} logits vs bf16: {w8a8_sqnr:.1f} dB"


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic_cache", "static_cache"])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_generate_eager_cpu(name, cache_implementation):
    check_generate("cpu", name, cache_implementation)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_generate_eager_cuda(name):
    _skip_without_fp8(name, "cuda")
    check_generate("cuda", name, None)


# ----------------------------------------------------------------------------------------------------
# compiled decode step on a static cache


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache around the test: the compiled forwards of every test share one code object, and an
    entry compiled under another inductor config would be reused."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def decode_steps(model, step, ids, tokens, max_cache_len=32):
    """Prefill ``ids`` eagerly into a new StaticCache, then one ``step(...)`` per column of ``tokens`` (each
    ``(B, 1)``); the logits of each step, cloned (a CUDA graph's outputs are overwritten by its next replay)."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    out = []
    for i in range(tokens.shape[1]):
        pos = torch.full_like(tokens[:, i:i + 1], ids.shape[1] + i)
        out.append(step(input_ids=tokens[:, i:i + 1].contiguous(), past_key_values=cache, position_ids=pos,
                        use_cache=True).logits.clone())
    return out


def compiled_vs_eager(device, name, steps, **compile_kwargs):
    """Eager and compiled logits of ``steps`` decode steps of a 1-layer W8A8 model, and the number of graphs
    dynamo compiled for them."""
    from torch._dynamo.utils import counters

    model = quantized(tiny_llama(layers=1, device=device), name)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 256, (2, PROMPT), generator=gen).to(device)
    tokens = torch.randint(3, 256, (2, steps), generator=gen).to(device)
    compiled = torch.compile(model.forward, fullgraph=True, **compile_kwargs)
    reduce_overhead = compile_kwargs.get("mode") == "reduce-overhead"

    def compiled_step(**kw):
        if reduce_overhead:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(**kw)

    with torch.no_grad():
        eager = decode_steps(model, model.forward, ids, tokens)
        graphs0 = counters["stats"]["unique_graphs"]
        out = decode_steps(model, compiled_step, ids, tokens)
        graphs = counters["stats"]["unique_graphs"] - graphs0
    return model, eager, out, graphs, (compiled_step, ids, tokens)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.full, needs_cxx])])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_compile_static_cache_cpu(name, backend, fresh_dynamo):
    """`torch.compile(model.forward, fullgraph=True)` over a static cache: one graph for every step, logits within
    `COMPILED_SQNR_DB` of eager at each step; traced through the fakes (aot_eager), and with inductor's default
    mode (C++ on the CPU, ~20 s of CPU per process when its cache is cold: the full run)."""
    _, eager, out, graphs, _ = compiled_vs_eager("cpu", name, steps=4, backend=backend)
    assert graphs == 1, f"{graphs} graphs compiled for 4 decode steps (a recompile as the cache grew?)"
    worst = min(sqnr_db(o, e) for o, e in zip(out, eager))
    assert worst > COMPILED_SQNR_DB[name], f"compiled vs eager, worst step: {worst:.1f} dB"


def _runtime_calls(fn, n):
    """CUDA runtime calls of ``n`` calls of ``fn`` by name, from the profiler: (graph launches, kernel launches)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return (sum("cudaGraphLaunch" in s for s in names),
            sum("cudaLaunchKernel" in s or "cuLaunchKernel" in s for s in names))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_compile_reduce_overhead_cuda(name, fresh_dynamo):
    """transformers' recipe, `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` over a static
    cache: logits within `COMPILED_SQNR_DB` of eager at each of 8 steps (the first warms up, the second records
    the CUDA graph, the rest replay it), one dynamo graph for all of them, CUDA graphs not skipped, and a
    replayed step launches a graph instead of its kernels."""
    from torch._dynamo.utils import counters

    _skip_without_fp8(name, "cuda")
    skips0 = counters["inductor"]["cudagraph_skips"]
    model, eager, out, graphs, (compiled_step, ids, tokens) = compiled_vs_eager(
        "cuda", name, steps=8, mode="reduce-overhead")
    assert graphs == 1, f"{graphs} graphs compiled for 8 decode steps (a recompile as the cache grew?)"
    assert counters["inductor"]["cudagraph_skips"] == skips0, "inductor skipped CUDA graphs (see TORCH_LOGS=perf_hints)"
    sq = [sqnr_db(o, e) for o, e in zip(out, eager)]
    assert min(sq) > COMPILED_SQNR_DB[name], f"compiled vs eager per step (dB): {[round(s, 1) for s in sq]}"

    # A new cache of the same shapes: no recompile (cudagraph trees may record again for its new static
    # addresses: two unprofiled steps), then 3 replays profiled: one graph launch per step and (almost) no kernel
    # launches, where 3 eager steps launch every kernel.
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = tokens[:, :1].contiguous()
        graphs0 = counters["stats"]["unique_graphs"]
        state = {"position": PROMPT}

        def step(fn):
            def run():
                fn(input_ids=tok, past_key_values=cache, position_ids=torch.full_like(tok, state["position"]),
                   use_cache=True)
                state["position"] += 1
            return run

        for _ in range(2):
            step(compiled_step)()
        compiled_graph_launches, compiled_kernels = _runtime_calls(step(compiled_step), 3)
        _, eager_kernels = _runtime_calls(step(model.forward), 3)
    assert counters["stats"]["unique_graphs"] == graphs0, "recompiled for a new cache of the same shapes"
    if eager_kernels == 0:
        pytest.skip("the profiler recorded no CUDA runtime calls (no CUPTI?): replay check not possible")
    assert compiled_graph_launches >= 3, f"{compiled_graph_launches} cudaGraphLaunch in 3 compiled steps"
    assert compiled_kernels * 5 < eager_kernels, (
        f"compiled steps launched {compiled_kernels} kernels, eager steps {eager_kernels}: not replaying a graph?")
