"""Helpers for the checkpoint tests: tiny transformers models, compressed-tensors checkpoints written by
compressed-tensors itself, and the reference model dequantized by the tests from the checkpoint's files (no
transformers quantizer: it changes between transformers versions).

Also the ``ckpt`` fixture (checkpoints written on first use, once per test module that imports it), the
checkpoint table it writes from, and the small model helpers the checkpoint test files share.

Everything here imports transformers / compressed-tensors; test files importorskip them first.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import cutlass_w8a8 as cw

VOCAB = 256
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def tiny_model(kind: str, seed: int = 0, num_key_value_heads: int = 2):
    """A random bf16 ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (q/k/v biases, drawn N(0, 0.1) so they matter):
    hidden 64, MLP 128, 4 heads, 2 KV heads (k/v N = 32; ``num_key_value_heads`` 1: N = 16), 2 layers, vocab 256.
    Every Linear has K and N multiples of 16."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=num_key_value_heads, max_position_embeddings=128, tie_word_embeddings=False)
    if kind not in ("llama", "qwen2"):
        raise ValueError(kind)
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    # built in bf16 (not cast to it afterwards, which would also cast the rotary inv_freq buffer that transformers'
    # loader keeps in float32), so that it equals the same model saved and loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if kind == "qwen2":
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.normal_(0, 0.1)
    return model.eval()


def scheme(name: str):
    """A compressed-tensors QuantizationScheme targeting every Linear: a preset (``W8A8``: int8 channel weights,
    dynamic per-token activations; ``FP8_DYNAMIC``: the same in e4m3; ``FP8``: e4m3 per-tensor weights, static
    per-tensor activations) or ``INT8_STATIC`` (int8 channel weights, static per-tensor activations),
    ``INT8_TENSOR_WEIGHTS`` (int8 per-tensor weights, dynamic per-token activations)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    def args(strategy, dynamic=False, type_="int"):
        return QuantizationArgs(num_bits=8, type=type_, symmetric=True, strategy=strategy, dynamic=dynamic)

    if name == "INT8_STATIC":
        return QuantizationScheme(targets=["Linear"], weights=args("channel"), input_activations=args("tensor"))
    if name == "INT8_TENSOR_WEIGHTS":
        return QuantizationScheme(targets=["Linear"], weights=args("tensor"),
                                  input_activations=args("token", dynamic=True))
    return preset_name_to_scheme(name, ["Linear"])


def write_ct_checkpoint(model, qscheme, path, calib_ids=None, ignore=("lm_head",), **save_kwargs) -> None:
    """Quantize ``model`` with compressed-tensors and write it the way llm-compressor does.

    ``apply_quantization_config``; weight scales from the weights and static activation scales from the absmax
    over a calibration forward (``calib_ids``), both with compressed-tensors' ``calculate_qparams``; status frozen;
    ``ModelCompressor.from_pretrained_model(model).compress_model(model)``; ``model.save_pretrained``;
    ``compressor.update_config(path)``.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig(config_groups={"group_0": qscheme}, ignore=list(ignore),
                                quantization_status="initialized")
    apply_quantization_config(model, config, show_progress=False)
    mods = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    amax = {}
    acts = qscheme.input_activations
    if acts is not None and acts.dynamic is False:
        def observe(name):
            def hook(mod, args):
                a = args[0].detach().abs().amax().float()
                amax[name] = torch.maximum(amax.get(name, a), a)
            return hook

        hooks = [m.register_forward_pre_hook(observe(n)) for n, m in mods.items()]
        for m in mods.values():
            m.quantization_enabled = False  # observe the float activations
        with torch.no_grad():
            model(calib_ids)
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for name, m in mods.items():
            w = m.weight
            s = m.quantization_scheme
            if s.weights.strategy == "channel":
                lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            ws, _ = calculate_qparams(lo, hi, s.weights)
            m.weight_scale.copy_(ws.reshape(m.weight_scale.shape))
            if name in amax:
                a = amax[name].to(w.dtype).reshape(1)
                xs, _ = calculate_qparams(-a, a, s.input_activations)
                m.input_scale.copy_(xs.reshape(m.input_scale.shape))
            m.quantization_status = QuantizationStatus.FROZEN
            m.quantization_enabled = True
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path, **save_kwargs)
    compressor.update_config(path)


def fake_quant(x: torch.Tensor, quant_dtype: torch.dtype, input_scale=None) -> torch.Tensor:
    """``x`` quantized and dequantized in float32 as `W8A8Linear` quantizes its input: per token with scale
    ``absmax / 127`` (``/ 448`` for e4m3) when ``input_scale`` is None, else per tensor with it; round half to even
    and saturate (int8), or round to e4m3 after clamping to +-448. Returns float32."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(-1, keepdim=True) / torch.tensor(_QMAX[quant_dtype])
    else:
        scale = input_scale.float().reshape(())
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = torch.where(scale == 0, torch.zeros_like(xf), xf / safe)
    if quant_dtype == torch.int8:
        q = torch.round(y).clamp(-128, 127)
    else:
        q = y.clamp(-448, 448).to(quant_dtype).float()
    return q * scale


def _matches(target: str, name: str, module) -> bool:
    """compressed-tensors' ``targets`` / ``ignore`` entries, as the test checkpoints use them: a module class name
    (``"Linear"``), ``"re:<regex>"`` (matched against the whole module name) or a module name."""
    if target.startswith("re:"):
        return re.fullmatch(target[3:], name) is not None
    return target == name or target == type(module).__name__


def _scheme_of(qc: dict, name: str, module):
    """The ``config_groups`` entry of ``quantization_config`` ``qc`` that quantizes module ``name`` (None when no
    group targets it or ``ignore`` names it)."""
    if any(_matches(t, name, module) for t in qc.get("ignore") or []):
        return None
    groups = [g for g in qc["config_groups"].values() if any(_matches(t, name, module) for t in g["targets"])]
    assert len(groups) <= 1, f"{name}: matched by {len(groups)} config groups"
    return groups[0] if groups else None


class FakeQuantLinear(torch.nn.Module):
    """A quantized Linear of the reference: ``fake_quant(x) @ weight^T + bias`` (weight the dequantized checkpoint
    weight, ``q * weight_scale``, exact in float64) summed in float64, so that the result does not depend on the CPU's
    summation order (a float32 GEMM's does: other bf16 roundings, amplified through the model by the next layers'
    8-bit quantization); the output cast back to ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias, quant_dtype: torch.dtype, input_scale=None):
        super().__init__()
        self.register_buffer("weight", weight.double())
        self.register_buffer("bias", None if bias is None else bias.double())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float())
        self.quant_dtype = quant_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quant(x, self.quant_dtype, self.input_scale).double(), self.weight, self.bias).to(x.dtype)


def decompressed_reference(path, full_float32: bool = False):
    """The checkpoint at ``path`` dequantized by these tests from its safetensors files, as a plain float
    transformers model with the activation quantization of `W8A8Linear` applied in float32 (no transformers
    quantizer, no compressed-tensors module state: only the files and the config's ``quantization_config``).

    Each quantized Linear (one with a ``weight_scale`` in the files) becomes a `FakeQuantLinear` holding the float64
    weight ``q * weight_scale`` (exact: per channel, scale ``[N, 1]``, or per tensor, ``[1]``) and computing
    ``fake_quant(x) @ W^T + b`` in float64: per token when its config group's ``input_activations`` are dynamic
    per ``token``, with the stored ``input_scale`` when they are static per ``tensor``. The group is matched from
    ``targets`` / ``ignore`` and must agree with the files (an ``input_scale`` exactly where the activations are
    static; int8 weights for ``type: int``, e4m3 for ``float``), else AssertionError. Every other tensor is loaded
    as stored (cast to the model dtype) with ``load_state_dict(strict=True)``.

    ``full_float32=False`` (default): the model (embedding, norms, attention, lm_head) in bf16, each quantized
    Linear summing in float64 and rounding to bf16 - the math of our layers, without their float32 roundings.
    ``full_float32=True``: the whole model in float32 (the accuracy of the bf16 model against exact arithmetic).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg.pop("quantization_config")
    dtype = torch.float32 if full_float32 else torch.bfloat16
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=dtype)
    stored = stored_tensors(path)
    quantized = {k[: -len(".weight_scale")] for k in stored if k.endswith(".weight_scale")}
    swaps, state = {}, {}
    for name, m in model.named_modules():
        s = _scheme_of(qc, name, m) if isinstance(m, torch.nn.Linear) else None
        assert (s is not None) == (name in quantized), f"{name}: config group {s} but weight_scale stored: " \
                                                      f"{name in quantized}"
        if s is None:
            continue
        w, a = s["weights"], s["input_activations"]
        q, ws = stored.pop(f"{name}.weight"), stored.pop(f"{name}.weight_scale").float()
        assert q.dtype == {"int": torch.int8, "float": torch.float8_e4m3fn}[w["type"]], (name, q.dtype, w)
        assert ws.numel() == {"channel": q.shape[0], "tensor": 1}[w["strategy"]], (name, ws.shape, w)
        static = (a["strategy"], a["dynamic"]) == ("tensor", False)
        assert static or (a["strategy"], a["dynamic"]) == ("token", True), (name, a)
        assert (f"{name}.input_scale" in stored) == static, name
        xs = stored.pop(f"{name}.input_scale") if static else None
        qd = {"int": torch.int8, "float": torch.float8_e4m3fn}[a["type"]]
        swaps[name] = FakeQuantLinear(q.double() * ws.double().reshape(-1, 1), stored.pop(f"{name}.bias", None), qd,
                                      xs)
        state[f"{name}.weight"] = m.weight  # replaced below; keeps load_state_dict strict
        if m.bias is not None:
            state[f"{name}.bias"] = m.bias
    state.update({k: v.to(dtype) for k, v in stored.items()})
    model.load_state_dict(state, strict=True)
    for name, layer in swaps.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return model.eval()


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in dB (inf when equal)."""
    x, ref = x.double(), ref.double()
    noise = (x - ref).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


def assert_greedy_tokens_agree(ours, ref, prompt: torch.Tensor, new_tokens: int, sqnr_min: float) -> None:
    """Greedy ``generate`` of ``ours`` and of ``ref`` (the same math in another order) from ``prompt`` (1, P): the
    same ``new_tokens`` tokens, or they part at a near-tie of the two models and not elsewhere.

    Tiny random models have flat logits (top-2 gaps of one bf16 ulp occur every few tokens), and each model's
    decode step (KV cache, M = 1) rounds differently from its full forward and from the other model, so identical
    tokens over 16 steps depend on the CPU's summation orders (test_checkpoints_block's qwen2 native f32 parted at
    token 13 with oneDNN / ATen / MKL held to AVX2). At the first step where the tokens differ both models are run
    on the common prefix: ours's token must be within ``2 max|L_ours - L_ref| + 2 ulp`` of the reference's choice
    in the reference's logits (the two models' difference there, and each decode step's own bf16 rounding of its
    logits, one ulp each way), and the two models' logits over the prefix must agree at ``sqnr_min`` dB. A wrong
    decode path (a stale KV cache) picks a token far from the reference's choice; wrong math fails the SQNR."""
    from cutlass_w8a8.testing.references import ulp

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    a, b = ours.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert a.shape == b.shape == (1, prompt.shape[1] + new_tokens)
    if torch.equal(a, b):
        return
    p = int((a[0] != b[0]).nonzero()[0])
    with torch.no_grad():
        la_all, lb_all = (m(b[:, :p]).logits[0] for m in (ours, ref))
    dtype = lb_all.dtype if lb_all.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    same = sqnr_db(la_all, lb_all)  # over the prefix, as the logits tests measure a whole sequence
    la, lb = la_all[-1].double(), lb_all[-1].double()
    gap = float(lb[b[0, p]] - lb[a[0, p]])
    tol = 2 * float((la - lb).abs().max()) + 2 * float(ulp(lb[b[0, p]].reshape(1), dtype))
    assert gap <= tol and same >= sqnr_min, (
        f"greedy tokens part at step {p - prompt.shape[1]} of {new_tokens}: ours {int(a[0, p])}, reference "
        f"{int(b[0, p])}, {gap:.4g} apart in the reference's logits (near-tie allowance {tol:.4g}); logits "
        f"{same:.1f} dB (>= {sqnr_min})")


def stored_tensors(path) -> dict:
    """Every tensor of a safetensors checkpoint directory (single file or sharded), as stored."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fname in files:
        out.update(load_file(os.path.join(path, fname)))
    return out


def copy_with_config(src, dst, edit) -> str:
    """A copy of checkpoint ``src`` at ``dst`` whose ``config.json`` is ``edit(config_dict)`` (edit in place or
    return a new dict); the weight files are symlinked. Returns ``dst``."""
    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):
        if fname != "config.json":
            target = os.path.join(dst, fname)
            if not os.path.exists(target):
                os.symlink(os.path.join(os.path.abspath(src), fname), target)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    new = edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg if new is None else new, f)
    return dst


# ---- the checkpoints the tests load, and the helpers the test files share -----------------------------------

# name: (model kind, scheme, quant dtype, static activations, per-channel weights)
CT_CHECKPOINTS = {
    "llama_int8_dynamic": ("llama", "W8A8", torch.int8, False, True),
    "qwen2_fp8_dynamic": ("qwen2", "FP8_DYNAMIC", torch.float8_e4m3fn, False, True),
    "qwen2_int8_static": ("qwen2", "INT8_STATIC", torch.int8, True, True),
    "llama_fp8_static_tensor": ("llama", "FP8", torch.float8_e4m3fn, True, False),
    "qwen2_int8_tensor_weights": ("qwen2", "INT8_TENSOR_WEIGHTS", torch.int8, False, False),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """``ckpt(name)``: the path of checkpoint ``name`` (CT_CHECKPOINTS, ``llama_int8_dynamic_sharded``,
    ``llama_int8_smoothquant_gptq``), written on first use."""
    root = tmp_path_factory.mktemp("ckpts")
    cache = {}

    def get(name):
        if name not in cache:
            path = str(root / name)
            if name == "llama_int8_smoothquant_gptq":
                _write_llmcompressor_checkpoint(str(root), path)
            else:
                sharded = name.endswith("_sharded")
                kind, sname = CT_CHECKPOINTS[name.removesuffix("_sharded")][:2]
                torch.manual_seed(1)
                calib = torch.randint(0, VOCAB, (4, 32))
                kw = {"max_shard_size": "40KB"} if sharded else {}
                write_ct_checkpoint(tiny_model(kind), scheme(sname), path, calib, **kw)
            cache[name] = path
        return cache[name]

    return get


def _write_llmcompressor_checkpoint(root, path):
    """llm-compressor's oneshot on a saved tiny Llama: SmoothQuant, then GPTQ with the W8A8 preset (lm_head
    ignored), calibrated on 8 random sequences in an in-memory dataset (no network)."""
    try:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        try:
            from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier
        except ImportError:  # llm-compressor < 0.14
            from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
        from tokenizers import Tokenizer, models, pre_tokenizers
    except Exception as e:  # ImportError, or a broken install of one of its many dependencies
        pytest.skip(f"llm-compressor (with datasets, tokenizers) does not import: {type(e).__name__}: {e}")
    import transformers

    base = os.path.join(root, "llama_bf16_base")
    tiny_model("llama").save_pretrained(base)  # oneshot reads the config back from model.config.name_or_path
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")
    g = torch.Generator().manual_seed(3)
    ds = Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB, (32,), generator=g).tolist() for _ in range(8)],
                            "attention_mask": [[1] * 32 for _ in range(8)]})
    recipe = [SmoothQuantModifier(smoothing_strength=0.8),
              GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=8, max_seq_length=32,
            processor=tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Attempting to save a model with offloaded modules" (it has none)
        model.save_pretrained(path, save_compressed=True)


def _w8a8_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, cw.W8A8Linear)}


def token_ids(seed=2, batch=2, seq=24, vocab=VOCAB):
    """``[batch, seq]`` int64 token ids drawn uniformly from ``[0, vocab)`` with a CPU generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def logits(model, input_ids):
    """``model(input_ids).logits`` without autograd."""
    with torch.no_grad():
        return model(input_ids).logits


_ids, _logits = token_ids, logits  # the names tests/checkpoints/test_checkpoints_cli.py imports


def logits_sqnr_vs_references(path, reference, input_ids: torch.Tensor) -> tuple:
    """The checkpoint at `path` loaded by `cutlass_w8a8.checkpoints.from_pretrained`: the SQNR in dB of its logits for
    `input_ids` (int64 (batch, seq)) against `reference(path)` (the same math: a bf16 model with float32 quantized
    layers) and against `reference(path, full_float32=True)` (a float32 model), as (same_math, float32)."""
    from cutlass_w8a8.checkpoints import from_pretrained

    ours = _logits(from_pretrained(path), input_ids)
    return (sqnr_db(ours, _logits(reference(path), input_ids)),
            sqnr_db(ours, _logits(reference(path, full_float32=True), input_ids)))


def _transformers_load(path, **kw):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **kw)


def _quantized_tiny(kind="qwen2", dtype=torch.int8, seed=0):
    model = tiny_model(kind, seed)
    cw.quantize_(model, cw.W8A8Config(dtype=dtype), filter_fn=lambda m, fqn: fqn != "lm_head")
    return model
