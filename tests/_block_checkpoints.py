"""Helpers for the block-scaled fp8 checkpoint tests (issue 26): tiny random Llama and Qwen3 models whose linears
have K a multiple of 128 (and some N that is not), checkpoints in the three block-fp8 forms, the float32
reference the tests dequantize themselves from the files, and the ``block_ckpt`` fixture.

The three forms:

- compressed-tensors ``FP8_BLOCK``, written by compressed-tensors itself as llm-compressor does
  (``apply_quantization_config`` with the preset, block scales from each 128 x 128 block's min / max with
  compressed-tensors' ``calculate_qparams``, ``ModelCompressor.compress_model``, ``save_pretrained``,
  ``update_config``): ``<linear>.weight`` e4m3, ``<linear>.weight_scale`` in the model dtype (bf16);
- transformers' native fp8 (``quant_method: fp8``, ``weight_block_size: [128, 128]``), written here from its
  documented layout (transformers' ``FineGrainedFP8Config`` / ``finegrained_fp8``): ``<linear>.weight`` e4m3 and
  ``<linear>.weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]``, float32 (DeepSeek-V3) or bf16 (Qwen3-FP8).

Nothing here uses a transformers quantizer: the reference reads the safetensors tensors and multiplies each
weight by its block scale in float32. Everything imports transformers / compressed-tensors; test files
importorskip them first.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_w8a8 as cw

from _checkpoints import logits, sqnr_db, stored_tensors, token_ids  # noqa: F401 (the row-wise helpers' own; the block tests import them from here)

BLOCK = 128
VOCAB = 320  # lm_head N = 320 = 2 * 128 + 64: a partial last row block
E4M3_MAX = 448.0


# ---- models ------------------------------------------------------------------------------------------------


def tiny_block_model(kind: str, seed: int = 0, intermediate: int = None, tie: bool = False):
    """A random bf16 transformers model for the block tests (2 layers, hidden 256, vocab 320, untied lm_head).

    ``"llama"``: 4 heads of 128, 2 KV heads (q N 512, k / v N 256, o K 512), MLP 512: every K a multiple of 128
    and every projection splits into whole 128-row blocks over 2 ranks (the tensor-parallel tests).
    ``"qwen3"``: q_norm / k_norm, 4 heads of 64, 1 KV head (q N 256, k / v N 64: one partial block), MLP 384.
    ``"qwen2"``: q / k / v biases (drawn N(0, 0.1) so that they matter), 4 heads of 64, 2 KV heads (k / v N
    128), MLP 384.
    ``intermediate`` overrides the MLP size (384 makes the llama's 2-rank split of gate / up / down break
    blocks; 320 gives down_proj K = 320, not a multiple of 128). ``tie``: lm_head tied to the input embedding
    (as the small Qwen3 models are).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, tie_word_embeddings=tie)
    if kind == "llama":
        config = LlamaConfig(**common, intermediate_size=intermediate or 512, num_key_value_heads=2, head_dim=128)
    elif kind == "qwen3":
        config = Qwen3Config(**common, intermediate_size=intermediate or 384, num_key_value_heads=1, head_dim=64)
    elif kind == "qwen2":
        config = Qwen2Config(**common, intermediate_size=intermediate or 384, num_key_value_heads=2)
    else:
        raise ValueError(kind)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms away from 1 so that they matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("proj.bias"):
                p.normal_(0, 0.1)
    return model.eval()


# ---- writers -------------------------------------------------------------------------------------------------


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """``max |w|`` over each 128 x 128 block of a 2-D tensor (partial last blocks included), float32
    ``[ceil(N / 128), ceil(K / 128)]``."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float().abs()
    return padded.view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))


def expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """A ``[ceil(N / 128), ceil(K / 128)]`` block scale as float32 ``[N, K]`` (each block's value over its
    elements)."""
    return scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def quantize_blocks(w: torch.Tensor, scale_dtype: torch.dtype):
    """``(q e4m3 [N, K], scale [ceil(N / 128), ceil(K / 128)] in scale_dtype)``: scale = block absmax / 448
    rounded to ``scale_dtype``, q = the weight over that (stored) scale, saturated to +-448 and rounded to e4m3; a
    block of zeros gets scale 0 and q 0."""
    n, k = w.shape
    scale = (block_amax(w) / torch.tensor(E4M3_MAX)).to(scale_dtype)
    s = expand_blocks(scale, n, k)
    q = torch.where(s == 0, torch.zeros_like(s), w.float() / torch.where(s == 0, torch.ones_like(s), s))
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_native_fp8(model, path, scale_dtype=torch.float32, not_convert=(), quantization_config=None) -> None:
    """``model`` as a transformers-native block-fp8 checkpoint at ``path``: every ``nn.Linear`` except those named
    in ``not_convert`` stored as ``weight`` (e4m3) + ``weight_scale_inv`` (`quantize_blocks`, ``scale_dtype``),
    everything else as is; ``config.json`` with ``quantization_config`` (default ``{"quant_method": "fp8",
    "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}`` plus
    ``modules_to_not_convert`` when ``not_convert`` is given)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    if tied:  # the tied lm_head is not stored (its weight is the input embedding's)
        del state["lm_head.weight"]
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name not in not_convert and not (tied and name == "lm_head"):
            q, s = quantize_blocks(m.weight.detach(), scale_dtype)
            state[f"{name}.weight"] = q
            state[f"{name}.weight_scale_inv"] = s.contiguous()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    qc = quantization_config or {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": [BLOCK, BLOCK]}
    if not_convert and quantization_config is None:
        qc["modules_to_not_convert"] = list(not_convert)
    edit_config(path, lambda c: c.update(quantization_config=qc))


def write_ct_fp8_block(model, path, ignore=("lm_head",)) -> None:
    """``model`` quantized with compressed-tensors' ``FP8_BLOCK`` preset and written as llm-compressor does
    (block scales with compressed-tensors' own ``calculate_qparams`` from each block's min / max; the weights
    quantized by compressed-tensors' compressor). The scales are stored in the model dtype (bf16)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                quantization_status="initialized")
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for name, m in model.named_modules():
            s = getattr(m, "quantization_scheme", None)
            if s is None:
                continue
            w = m.weight.detach().float()
            n, k = w.shape
            nb, kb = -(-n // BLOCK), -(-k // BLOCK)
            padded = torch.zeros(nb * BLOCK, kb * BLOCK)
            padded[:n, :k] = w
            blocks = padded.view(nb, BLOCK, kb, BLOCK)
            ws, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), s.weights)
            m.weight_scale.copy_(ws.reshape(m.weight_scale.shape))
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


def edit_config(path, edit) -> None:
    """Rewrite ``path/config.json`` with ``edit(config_dict)`` (in place, or return a new dict)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    new = edit(cfg)
    with open(cfg_path, "w") as f:
        json.dump(cfg if new is None else new, f, indent=1)


def copy_checkpoint(src, dst, edit_config_fn=None, edit_tensors=None) -> str:
    """A copy of checkpoint ``src`` at ``dst``: ``config.json`` through ``edit_config_fn(dict)`` (in place or
    returning a new dict), the tensors through ``edit_tensors(dict)`` (in place) and rewritten when given, else
    the weight file symlinked. Returns ``dst``."""
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    for fname in os.listdir(src):
        if fname == "config.json" or (edit_tensors is not None and fname.endswith(".safetensors")):
            continue
        target = os.path.join(dst, fname)
        if not os.path.exists(target):
            os.symlink(os.path.join(os.path.abspath(src), fname), target)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    new = edit_config_fn(cfg) if edit_config_fn is not None else None
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg if new is None else new, f)
    if edit_tensors is not None:
        tensors = stored_tensors(src)
        edit_tensors(tensors)
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


# ---- the reference: the checkpoint dequantized by the test -----------------------------------------------------


def scale_key(tensors: dict, name: str):
    """The block-scale tensor name of linear ``name`` (``weight_scale_inv``, native; ``weight_scale``,
    compressed-tensors), or None when it is not quantized."""
    for leaf in ("weight_scale_inv", "weight_scale"):
        if f"{name}.{leaf}" in tensors:
            return f"{name}.{leaf}"
    return None


def dequantized_weights(path) -> dict:
    """``{linear name: float64 [N, K]}``: each stored e4m3 weight times its block scale, expanded over the
    block's elements (exact in float64: an e4m3 value, 4 significant bits, times a float32 / bf16 scale; float32
    would round the products of float32 scales)."""
    tensors = stored_tensors(path)
    out = {}
    for key, t in tensors.items():
        if key.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            name = key[: -len(".weight")]
            sk = scale_key(tensors, name)
            assert sk is not None, f"{key} is e4m3 with no block scale"
            n, k = t.shape
            assert tuple(tensors[sk].shape) == (-(-n // BLOCK), -(-k // BLOCK)), sk
            out[name] = t.double() * expand_blocks(tensors[sk], n, k).double()
    return out


def fake_quant_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to e4m3 per 1 x 128 group of its last dimension and dequantized, in float32, as the block
    layers quantize their input: scale = group absmax / 448 (IEEE division), q = x / scale saturated to +-448 and
    rounded to e4m3 (round half to even), a group of zeros gives zeros. Returns float32, ``x``'s shape."""
    xf = x.float()
    g = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    scale = g.abs().amax(-1, keepdim=True) / torch.tensor(E4M3_MAX)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.where(scale == 0, torch.zeros_like(g), g / safe).clamp(-E4M3_MAX, E4M3_MAX)
    return (q.to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


class FakeQuantBlockLinear(nn.Module):
    """A block-quantized linear of the reference: ``fake_quant_groups(x) @ W^T + b`` summed in float64 (``W`` the
    dequantized checkpoint weight), so that the result does not depend on the CPU's summation order; the output
    cast back to ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, bias):
        super().__init__()
        self.register_buffer("weight", weight.double())
        self.register_buffer("bias", None if bias is None else bias.double())

    def forward(self, x):
        return F.linear(fake_quant_groups(x).double(), self.weight, self.bias).to(x.dtype)


def float_config(path):
    """The checkpoint's transformers config without its ``quantization_config``."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    return cfg


def dequantized_reference(path, full_float32: bool = False, act_quant: bool = True):
    """The block-fp8 checkpoint at ``path`` as a plain transformers model built from its config (no
    quantizer), every tensor loaded from the files: each e4m3 linear a `FakeQuantBlockLinear` over its weight
    dequantized here (or, with ``act_quant=False``, an ``nn.Linear`` holding that weight), the rest as stored.

    ``full_float32=False``: the model in bf16 with the quantized linears summing in float64 and rounding to bf16
    (our layers' math without their float32 roundings); ``True``: the whole model in float32."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if full_float32 else torch.bfloat16
    model = AutoModelForCausalLM.from_config(float_config(path), dtype=dtype)
    tensors = stored_tensors(path)
    deq = dequantized_weights(path)
    state = {}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module in deq and leaf in ("weight_scale_inv", "weight_scale"):
            continue
        state[key] = deq[module] if module in deq and leaf == "weight" else t
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected, unexpected
    tied = model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(k.endswith("inv_freq") or (tied and k == "lm_head.weight") for k in missing), missing
    if act_quant:
        for name in deq:
            lin = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    FakeQuantBlockLinear(deq[name], None if lin.bias is None else lin.bias.detach()))
    return model.eval()


def ids(seed=2, batch=2, seq=24):
    return token_ids(seed, batch, seq, VOCAB)


def w8a8_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, cw.W8A8Linear)}


# ---- the checkpoints -------------------------------------------------------------------------------------------

# name: (model kind, writer, scale dtype of the stored block scales, linears left in float)
BLOCK_CHECKPOINTS = {
    "llama_ct": ("llama", "ct", torch.bfloat16, ()),  # lm_head quantized: N = 320, a partial block
    "qwen3_ct": ("qwen3", "ct", torch.bfloat16, ("lm_head",)),
    "llama_native_f32": ("llama", "native", torch.float32, ()),
    "qwen3_native_f32": ("qwen3", "native", torch.float32, ("lm_head",)),
    "llama_native_bf16": ("llama", "native", torch.bfloat16, ("lm_head",)),
    "qwen3_native_bf16": ("qwen3", "native", torch.bfloat16, ()),
    "qwen2_ct": ("qwen2", "ct", torch.bfloat16, ("lm_head",)),  # q / k / v biases
    "qwen2_native_f32": ("qwen2", "native", torch.float32, ("lm_head",)),
}


def write_tied_qwen3(path) -> None:
    """A native bf16-scale Qwen3 whose lm_head is tied to the input embedding (not stored), as the small
    ``Qwen/Qwen3-*-FP8`` checkpoints are."""
    write_native_fp8(tiny_block_model("qwen3", seed=6, tie=True), path, torch.bfloat16)


def write_sharded_copy(src, dst) -> None:
    """``src``'s tensors split over two safetensors files with a ``model.safetensors.index.json``."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    tensors = stored_tensors(src)
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(dst, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def write_block_checkpoint(name, path, seed=0, intermediate=None) -> None:
    """Write checkpoint ``name`` of `BLOCK_CHECKPOINTS` (``intermediate``: the MLP size override of
    `tiny_block_model`)."""
    kind, writer, scale_dtype, floats = BLOCK_CHECKPOINTS[name]
    model = tiny_block_model(kind, seed, intermediate)
    if writer == "ct":
        write_ct_fp8_block(model, path, ignore=floats)
    else:
        write_native_fp8(model, path, scale_dtype, not_convert=floats)


@pytest.fixture(scope="module")
def block_ckpt(tmp_path_factory):
    """``block_ckpt(name)``: the path of `BLOCK_CHECKPOINTS` checkpoint ``name``, written on first use; also
    ``"llama_native_f32_mlp384"`` / ``"llama_ct_mlp384"`` (MLP 384: a 2-rank split breaks blocks) and
    ``"llama_native_f32_mlp320"`` / ``"llama_ct_mlp320"`` (down_proj K = 320)."""
    root = tmp_path_factory.mktemp("block_ckpts")
    cache = {}

    def get(name):
        if name not in cache:
            path = str(root / name)
            base, _, mlp = name.partition("_mlp")
            write_block_checkpoint(base, path, intermediate=int(mlp) if mlp else None)
            cache[name] = path
        return cache[name]

    return get
