"""Block-scaled fp8 checkpoints (issue 26) loaded by `cutlass_w8a8.checkpoints.from_pretrained`: compressed-tensors
``FP8_BLOCK`` (written by compressed-tensors itself) and transformers' native fp8 format (float32 and bf16
``weight_scale_inv``), tiny random Llama, Qwen3 (q_norm / k_norm) and Qwen2 (q / k / v biases) models with
every K a multiple of 128 and N = 64 (Qwen3's k / v) and N = 320 (the lm_head, where quantized) not multiples
of 128. The layers must hold the stored e4m3
weights bit for bit and the scales cast to float32 exactly; the logits and greedy tokens are compared with the
checkpoint dequantized by the test itself from the safetensors tensors (tests/_block_checkpoints.py), no
transformers quantizer involved. What is refused: test_checkpoints_block_refusals.py; save, round trip and CLI:
test_checkpoints_block_save.py; tensor parallelism: test_checkpoints_block_tp.py.

Accuracy (CPU, torch 2.13, transformers 5.17 and 5.24; our logits against the reference, SQNR):

======================  ===================  ======================  ========================
checkpoint              per layer, teacher-  bf16 model, float64     all-float32 model, same
                        forced               quantized linears       activation quantization
======================  ===================  ======================  ========================
llama compressed-t.     float32 roundings    inf (equal)             24.0 dB
qwen3 compressed-t.     float32 roundings    inf (equal)             25.0 dB
llama native f32        float32 roundings    inf (equal)             24.3 dB
qwen3 native f32        float32 roundings    37.2 dB                 25.0 dB
llama native bf16       float32 roundings    inf (equal)             26.1 dB
qwen3 native bf16       float32 roundings    inf (equal)             23.5 dB
qwen2 compressed-t.     float32 roundings    inf (equal)             29.5 dB
qwen2 native f32        float32 roundings    inf (equal)             29.6 dB
======================  ===================  ======================  ========================

The first column is exact: each quantized layer, fed the very input it sees inside our model, is compared with
its reference ``fake_quant_groups(x) @ (q * s)^T`` summed in float64 and rounded to bf16; the two differ only by
our float32 roundings of the exact block sums (one bf16 ulp, or the float32 rounding bound where the sum cancels),
on < 1 % of the outputs. Across the whole model those rare ulps are amplified: an activation one bf16 ulp away
lands on another e4m3 value in a few percent of cases (the e4m3 step is 2**-3 relative, a bf16 ulp 2**-8), so the
model-level comparison is held at >= 30 dB (37.2 dB to equality; with a float32 reference, summed in the CPU's
BLAS order, it was 32.5 dB to equality, 2.5 dB above the bound); the all-float32 column (bf16 against exact
arithmetic in the rest of the model, amplified the same way) is held at >= 22 dB. The second column is the same
with oneDNN / MKL / ATen held to AVX2 or AVX-512 without AMX, 1 or 2 threads. Greedy tokens are identical over 16
new tokens for all eight here, but parted at a one-ulp near-tie for qwen2 native f32 with AVX2 and the float32
reference: the test allows them to part at a near-tie only (`_checkpoints.assert_greedy_tokens_agree`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

from cutlass_w8a8.checkpoints import from_pretrained  # noqa: E402
from cutlass_w8a8.testing.references import fp8_accum_bound  # noqa: E402

from _checkpoints import assert_greedy_tokens_agree, logits_sqnr_vs_references  # noqa: E402
from _full import quick_or_full  # noqa: E402

# block_ckpt: the checkpoint fixture, imported so that pytest finds it in this module
from _block_checkpoints import (  # noqa: E402, F401
    BLOCK, BLOCK_CHECKPOINTS, FakeQuantBlockLinear, block_ckpt, dequantized_reference, dequantized_weights,
    fake_quant_groups, ids, logits, scale_key, sqnr_db, stored_tensors, w8a8_modules)

SQNR_MIN_SAME_MATH = 30.0
SQNR_MIN_FLOAT32 = 22.0
NAMES = list(BLOCK_CHECKPOINTS)
# The quick CPU run (tests/conftest.py's `full` mark) compares the math of every family (llama; qwen3's q / k norms
# and N = 64; qwen2's biases) and every format (compressed-tensors, native float32 and bf16 scales, a quantized
# lm_head): the GPU run's three; the other five in the full run. Every checkpoint's tensors are checked in both.
QUICK = ("llama_ct", "qwen3_native_bf16", "qwen2_native_f32")


@pytest.mark.parametrize("name", NAMES)
def test_layers_hold_the_stored_tensors(block_ckpt, name):
    path = block_ckpt(name)
    floats = BLOCK_CHECKPOINTS[name][3]
    model = from_pretrained(path)
    stored = stored_tensors(path)
    mods = w8a8_modules(model)
    quantized = sorted(k[: -len(".weight")] for k, v in stored.items()
                       if k.endswith(".weight") and v.dtype == torch.float8_e4m3fn)
    assert sorted(mods) == quantized and len(mods) == 14 + ("lm_head" not in floats)
    for name_ in floats:
        lin = model.get_submodule(name_)
        assert type(lin) is nn.Linear and lin.weight.dtype == torch.bfloat16
        assert torch.equal(lin.weight, stored[f"{name_}.weight"])
    for n, m in mods.items():
        sk = scale_key(stored, n)
        assert stored[sk].dtype == BLOCK_CHECKPOINTS[name][2]
        assert m.weight_block_size == (BLOCK, BLOCK) and m.quant_dtype == torch.float8_e4m3fn
        assert m.input_scale is None
        if f"{n}.bias" in stored:
            assert torch.equal(m.bias, stored[f"{n}.bias"])
        else:
            assert m.bias is None
        assert torch.equal(m.weight.view(torch.uint8), stored[f"{n}.weight"].view(torch.uint8))
        assert m.weight_scale.dtype == torch.float32
        assert torch.equal(m.weight_scale, stored[sk].float())  # bf16 -> float32 is exact
        assert m.weight_scale.shape == (-(-m.out_features // BLOCK), m.in_features // BLOCK)
    for key in ("model.norm.weight", "model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(model.state_dict()[key], stored[key])
    if name.startswith("qwen3"):
        attn = model.model.layers[0].self_attn
        assert torch.equal(attn.q_norm.weight, stored["model.layers.0.self_attn.q_norm.weight"])
        assert attn.k_proj.out_features == 64 and attn.k_proj.weight_scale.shape == (1, 2)  # one partial block
    if name.startswith("qwen2"):
        assert model.model.layers[0].self_attn.k_proj.bias is not None
    if "lm_head" not in floats:
        assert mods["lm_head"].weight_scale.shape == (3, 2)  # N = 320: a partial last row block
    assert not model.training and getattr(model, "hf_quantizer", None) is None
    qc = model.config.quantization_config
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "block"


@pytest.mark.parametrize("name", quick_or_full(NAMES, QUICK))
def test_each_layer_matches_its_dequantized_reference(block_ckpt, name):
    """Teacher-forced: every quantized layer, on the input it receives in a forward pass of our model, against
    ``fake_quant_groups(x) @ (q * s)^T`` summed in float64 from the files. Only our float32 roundings differ: the
    sums are within 2 gamma_K sum_k |x_k w_k| of each other (gamma_K <= K 2**-24), and each is rounded to bf16
    once, so the outputs differ by at most one bf16 ulp of the larger plus that; they differ at all on < 1 % of
    the outputs."""
    path = block_ckpt(name)
    model = from_pretrained(path)
    deq, stored = dequantized_weights(path), stored_tensors(path)
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(n, (args[0], out)))
             for n, m in w8a8_modules(model).items()]
    logits(model, ids())
    for h in hooks:
        h.remove()
    assert sorted(seen) == sorted(deq)
    for n, (x, y) in seen.items():
        want = FakeQuantBlockLinear(deq[n], stored.get(f"{n}.bias"))(x)
        assert y.dtype == want.dtype == torch.bfloat16
        diff = (y.float() - want.float()).abs()
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(y.float().abs(), want.float().abs())
        magnitude = F.linear(fake_quant_groups(x).abs().double(), deq[n].abs().double()).float()
        assert (diff <= ulp + 2 * x.shape[-1] * 2.0 ** -24 * magnitude).all(), n
        assert float((diff > 0).float().mean()) < 0.01, n


@pytest.mark.parametrize("name", quick_or_full(NAMES, QUICK))
def test_logits_match_dequantized_checkpoint(block_ckpt, name):
    same_math, full32 = logits_sqnr_vs_references(block_ckpt(name), dequantized_reference, ids())
    print(f"{name}: SQNR {same_math:.1f} dB vs bf16 model with float64 linears, {full32:.1f} dB vs float32 model")
    assert same_math >= SQNR_MIN_SAME_MATH
    assert full32 >= SQNR_MIN_FLOAT32


@pytest.mark.parametrize("name", quick_or_full(NAMES, QUICK))
def test_greedy_tokens_match_dequantized_checkpoint(block_ckpt, name):
    path = block_ckpt(name)
    ours, ref = from_pretrained(path), dequantized_reference(path)
    assert_greedy_tokens_agree(ours, ref, ids(seed=10, batch=1, seq=8), 16, SQNR_MIN_SAME_MATH)


@pytest.mark.parametrize("name", ["llama_native_bf16", "qwen3_native_f32", "qwen2_native_f32"])
def test_transformers_reads_the_native_test_checkpoints_alike(block_ckpt, name):
    """The native checkpoints are written by the tests from the format's description; transformers' own reader
    (which dequantizes to bf16 on a CPU) must find every tensor where it expects it and the same weights. Only
    checkpoints whose quantized N are multiples of 128 (or below it): transformers 5.17's CPU dequantizer
    refuses a partial last block (``Weight shape (320, 256) not divisible by scale grid (3, 2)``)."""
    import warnings

    path = block_ckpt(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = stored_tensors(path)
    for n, w in dequantized_weights(path).items():
        mod = model.get_submodule(n)
        if mod.weight.dtype == torch.float8_e4m3fn:
            # with an fp8-capable GPU (sm89+) transformers keeps the checkpoint in its own FP8Linear (seen on the H100):
            # then the same bytes and the same block scales, where it put them
            assert torch.equal(mod.weight.cpu().view(torch.uint8), stored[f"{n}.weight"].view(torch.uint8)), n
            assert torch.equal(mod.weight_scale_inv.float().cpu(), stored[f"{n}.weight_scale_inv"].float()), n
        else:
            assert torch.equal(mod.weight, w.to(torch.bfloat16)), n


def test_tied_lm_head(tmp_path):
    """A native checkpoint whose lm_head is tied to the input embedding and not stored (the small Qwen3-FP8
    models): the lm_head stays a float nn.Linear sharing the embedding's weight."""
    from _block_checkpoints import write_tied_qwen3

    write_tied_qwen3(tmp_path)
    model = from_pretrained(tmp_path)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert len(w8a8_modules(model)) == 14
    x = ids()
    assert sqnr_db(logits(model, x), logits(dequantized_reference(tmp_path), x)) >= SQNR_MIN_SAME_MATH


def test_sharded_files_load_like_one(block_ckpt, tmp_path):
    from _block_checkpoints import write_sharded_copy

    for name in ("llama_native_f32", "llama_ct"):
        write_sharded_copy(block_ckpt(name), tmp_path / name)
        a, b = from_pretrained(tmp_path / name), from_pretrained(block_ckpt(name))
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)) for k in sa)


def test_float16_model(block_ckpt):
    path = block_ckpt("qwen3_native_bf16")
    model = from_pretrained(path, dtype=torch.float16)
    assert all(m.dtype == torch.float16 and m.weight_scale.dtype == torch.float32
               for m in w8a8_modules(model).values())
    out = logits(model, ids())
    assert out.dtype == torch.float16
    # fp16 instead of bf16: as close to the float32 model as the bf16 model (measured 24.6 dB, bf16 23.5 dB)
    assert sqnr_db(out, logits(dequantized_reference(path, full_float32=True), ids())) >= SQNR_MIN_FLOAT32


def test_native_model_cls_and_attn_implementation(block_ckpt):
    model = from_pretrained(block_ckpt("llama_native_f32"), model_cls=transformers.LlamaForCausalLM,
                            attn_implementation="eager")
    assert type(model) is transformers.LlamaForCausalLM and len(w8a8_modules(model)) == 15
    assert model.config._attn_implementation == "eager"
    assert torch.isfinite(logits(model, ids())).all()


def test_dtype_casts_keep_block_weights(block_ckpt):
    model = from_pretrained(block_ckpt("llama_native_f32"))
    before = {n: (m.weight.clone(), m.weight_scale.clone()) for n, m in w8a8_modules(model).items()}
    model = model.half()
    for n, m in w8a8_modules(model).items():
        assert m.dtype == torch.float16 and m.weight_block_size == (BLOCK, BLOCK)
        assert torch.equal(m.weight.view(torch.uint8), before[n][0].view(torch.uint8))
        assert torch.equal(m.weight_scale, before[n][1])
    assert torch.isfinite(logits(model, ids())).all()


# ---------------------------------------------------------------------------------------------------------------
# CUDA (skip without a GPU and the extension; block fp8 needs sm90)


@pytest.mark.sm90
@pytest.mark.parametrize("name", ["llama_ct", "qwen3_native_bf16", "qwen2_native_f32"])
def test_cuda_load_matches_the_reference(block_ckpt, name):
    """On an sm90 GPU (the block GEMM's only backend): the layers on the device, each layer teacher-forced against
    the test's dequantized reference within the CPU test's bound (the block GEMM sums each 128-wide K block in
    float32 and scales it, as the reference's float32 sum up to order; the 1 x 128 group quantization is the
    CPU's rule), and the logits as close to the float32 model as on the CPU (>= 22 dB; GPU and CPU runs differ
    by more than summation order elsewhere: attention, norms). Not yet run: written on a machine without a GPU."""
    path = block_ckpt(name)
    gpu = from_pretrained(path, device="cuda")
    mods = w8a8_modules(gpu)
    assert all(m.weight.is_cuda and m.weight_scale.is_cuda for m in mods.values())
    deq, stored = dequantized_weights(path), stored_tensors(path)
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: seen.__setitem__(n, (args[0].cpu(), out.cpu())))
             for n, m in mods.items()]
    x = ids()
    got = logits(gpu, x.cuda()).cpu()
    for h in hooks:
        h.remove()
    assert sorted(seen) == sorted(deq)
    for n, (xin, y) in seen.items():
        want = FakeQuantBlockLinear(deq[n], stored.get(f"{n}.bias"))(xin)
        diff = (y.float() - want.float()).abs()
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(y.float().abs(), want.float().abs())
        magnitude = F.linear(fake_quant_groups(xin).abs().double(), deq[n].abs().double()).float()
        # float32 summation, plus Hopper's fp8 tensor-core accumulation inside each 128-long K block
        # (cutlass_w8a8.testing.references.fp8_accum_bound, the bound the block GEMM's own tests hold): the first
        # H100 run showed that the float32-only bound this test was written with (on a CPU) does not model the GPU
        assert (diff <= ulp + (2 * xin.shape[-1] * 2.0 ** -24 + fp8_accum_bound(BLOCK)) * magnitude).all(), n
    assert sqnr_db(got, logits(dequantized_reference(path, full_float32=True), x)) >= SQNR_MIN_FLOAT32
