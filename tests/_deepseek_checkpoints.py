"""DeepSeek-V3's native fp8 checkpoint layout, written by the tests from its description, and the reference the
tests dequantize themselves from the files (issue 35).

The layout (deepseek-ai/DeepSeek-V3, -R1, -V3.1, moonshotai/Kimi-K2): ``config.json`` with ``quantization_config =
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (V3.1 adds
``"scale_fmt": "ue8m0"``: every weight scale a power of two); every linear of the decoder stored as ``<name>.weight``
(e4m3 ``[N, K]``) and ``<name>.weight_scale_inv`` (float32 ``[ceil(N / 128), ceil(K / 128)]``, multiplying):

- MLA: ``self_attn.{q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}`` (``kv_a_proj_with_mqa``:
  N = kv_lora_rank + qk_rope_head_dim = 576, a partial last row block), ``q_a_layernorm`` / ``kv_a_layernorm``
  float;
- the first ``first_k_dense_replace`` layers dense: ``mlp.{gate,up,down}_proj``;
- the MoE layers: the routed experts per expert, ``mlp.experts.{e}.{gate,up,down}_proj``, the shared experts
  ``mlp.shared_experts.{gate,up,down}_proj``, the router ``mlp.gate.weight`` (bf16) and
  ``mlp.gate.e_score_correction_bias`` (float32), both left in float;
- embeddings, norms and ``lm_head`` in bf16;
- the multi-token-prediction layer ``model.layers.{num_hidden_layers}.*`` (``num_nextn_predict_layers = 1``): a
  whole MoE decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` (fp8), ``embed_tokens`` and ``shared_head.{norm,
  head}``, which transformers' model does not have;
- in several safetensors shards with ``model.safetensors.index.json`` (the MTP layer in the last one, as DeepSeek's).

The tiny model: transformers' own ``DeepseekV3Config`` / ``DeepseekV3ForCausalLM`` with H 256, 2 layers (the
first dense, MLP 512), 8 routed experts of I 256 in 2 groups (top-2 of the best group: ``n_group`` 2,
``topk_group`` 1), one shared expert, ``routed_scaling_factor`` 2.5, 4 heads (q / k head 128 + 64 rotary, v head
128), ``q_lora_rank`` 256, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576, vocab 512; every K a multiple of
128, and every MLP / expert size and the MLA projections q_b / kv_b (by heads) and o split into whole 128-blocks over
2 ranks. Random init with the routers' weights and ``lm_head`` scaled up (decisive routings and logits), a random
``e_score_correction_bias`` (so that the selection bias matters) and norms away from 1.

Everything here imports transformers / safetensors; test files importorskip them first.
"""

from __future__ import annotations

import json
import os
import types

import torch
from torch import nn

from _block_checkpoints import E4M3_MAX, block_amax, expand_blocks, quantize_blocks
from _checkpoints import stored_tensors
from _moe_models import FakeQuantExperts, FakeQuantLinear

VOCAB = 512
HIDDEN = 256
LAYERS = 2
EXPERTS = 8
MOE_I = 256
BLOCK = 128
PROJS = ("gate_proj", "up_proj", "down_proj")
NATIVE_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
ROUTER_GAIN = 5.0
LM_HEAD_GAIN = 8.0


def tiny_deepseek_config():
    """The tiny ``DeepseekV3Config`` of the module docstring."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=MOE_I,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=256, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, num_nextn_predict_layers=1, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)


def tiny_deepseek_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A random tiny ``DeepseekV3ForCausalLM`` in ``dtype`` (eval mode; the same weights for the same ``seed``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(), dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_GAIN)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    return model.eval()


def quantize_blocks_ue8m0(w: torch.Tensor):
    """``(q e4m3 [N, K], scale float32 [ceil(N / 128), ceil(K / 128)])`` with each block's scale its absmax / 448
    rounded up to a power of two (DeepSeek-V3.1's ``scale_fmt: ue8m0``; a zero block gets 2**-126)."""
    n, k = w.shape
    amax = block_amax(w) / torch.tensor(E4M3_MAX)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax))), torch.full_like(amax, 2.0 ** -126))
    q = (w.float() / expand_blocks(scale, n, k)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def native_tensors(model, ue8m0: bool = False, mtp: bool = True) -> dict:
    """The tensors of `model` (a float ``DeepseekV3ForCausalLM``) as DeepSeek's files hold them (module docstring),
    plus (``mtp``) a multi-token-prediction layer ``model.layers.{num_hidden_layers}`` made from the last layer's
    tensors and its own extras."""
    quant = quantize_blocks_ue8m0 if ue8m0 else (lambda w: quantize_blocks(w, torch.float32))
    out = {}

    def put_linear(name, w):
        q, s = quant(w.detach())
        out[f"{name}.weight"] = q
        out[f"{name}.weight_scale_inv"] = s.contiguous()

    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    for key, t in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if module in linears:
            continue
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            continue
        if key.endswith("mlp.gate.weight"):
            t = t.to(torch.bfloat16)  # DeepSeek stores the router in bf16 (transformers keeps it in float32)
        out[key] = t.detach().clone().contiguous()
    for name in sorted(linears):
        put_linear(name, model.get_submodule(name).weight)
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            i = m.gate_up_proj.shape[1] // 2
            for e in range(m.gate_up_proj.shape[0]):
                put_linear(f"{name}.{e}.gate_proj", m.gate_up_proj[e, :i])
                put_linear(f"{name}.{e}.up_proj", m.gate_up_proj[e, i:])
                put_linear(f"{name}.{e}.down_proj", m.down_proj[e])
    if mtp:
        last, nxt = f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."
        g = torch.Generator().manual_seed(7)
        for key in [k for k in out if k.startswith(last)]:
            out[nxt + key[len(last):]] = out[key].clone()
        for leaf in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            out[nxt + leaf] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        out[nxt + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[nxt + "shared_head.head.weight"] = out["lm_head.weight"].clone()
        q, s = quant(torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.02)
        out[nxt + "eh_proj.weight"], out[nxt + "eh_proj.weight_scale_inv"] = q, s
    return out


def mtp_names(tensors) -> list:
    return sorted(k for k in tensors if k.startswith(f"model.layers.{LAYERS}."))


def write_native_deepseek(path, seed: int = 0, ue8m0: bool = False, mtp: bool = True, edit=None) -> str:
    """The tiny model of ``seed`` written at ``path`` in DeepSeek-V3's native fp8 layout (module docstring), in
    three shards (layer 0 and the embedding; layer 1; the MTP layer, the final norm and lm_head) with
    ``model.safetensors.index.json``; ``ue8m0``: power-of-two scales and ``scale_fmt: "ue8m0"``. ``edit(tensors,
    config_dict)`` may change either before they are written. Returns ``path``."""
    from safetensors.torch import save_file

    model = tiny_deepseek_model(seed)
    tensors = native_tensors(model, ue8m0, mtp)
    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(NATIVE_QC, **({"scale_fmt": "ue8m0"} if ue8m0 else {}))
    if edit is not None:
        edit(tensors, cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)

    def shard(key):
        if key.startswith("model.layers.0.") or key == "model.embed_tokens.weight":
            return 1
        return 2 if key.startswith(f"model.layers.{LAYERS - 1}.") else 3

    weight_map = {k: f"model-0000{shard(k)}-of-00003.safetensors" for k in tensors}
    for fname in sorted(set(weight_map.values())):
        save_file({k: tensors[k] for k, f in weight_map.items() if f == fname}, os.path.join(path, fname),
                  metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return str(path)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """``q * scale`` per 128 x 128 block, in ``dtype`` (float64: exact for e4m3 times a float32 scale)."""
    n, k = q.shape
    return q.to(dtype) * expand_blocks(scale, n, k).to(dtype)


def file_reference(path, full_float32: bool = False, act_quant: bool = True):
    """The native DeepSeek checkpoint at ``path`` as a plain transformers ``DeepseekV3ForCausalLM`` (built from its
    config without the quantization_config) holding the weights this function dequantizes from the files (weight
    times its block scale, float64), the MTP layer's tensors left out (the model has no such module).

    ``act_quant=True``: the experts a `FakeQuantExperts` and each quantized linear a `FakeQuantLinear`, float64 sums
    with our activation quantization (e4m3 per 1 x 128 group) and rounding points; ``False``: the dequantized
    weights in transformers' own modules (exact activations, the model's dtype). Routers, norms, embeddings,
    attention and lm_head are transformers' own either way. ``full_float32``: the model in float32 instead of
    bf16."""
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    dtype = torch.float32 if full_float32 else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=dtype)
    stored = stored_tensors(path)
    for k in mtp_names(stored):
        del stored[k]
    deq = {}
    for key in [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]:
        name = key[: -len(".weight")]
        deq[name] = dequantize(stored.pop(key), stored.pop(f"{name}.weight_scale_inv"))
    experts = {}
    for name, block in model.named_modules():
        if name.endswith(".mlp") and hasattr(block, "experts"):
            e_ = block.experts.gate_up_proj.shape[0]
            w13 = torch.stack([torch.cat([deq.pop(f"{name}.experts.{e}.gate_proj"),
                                          deq.pop(f"{name}.experts.{e}.up_proj")]) for e in range(e_)])
            w2 = torch.stack([deq.pop(f"{name}.experts.{e}.down_proj") for e in range(e_)])
            experts[name] = (w13, w2)
            stored[f"{name}.experts.gate_up_proj"], stored[f"{name}.experts.down_proj"] = w13, w2
    stored.update({f"{name}.weight": w for name, w in deq.items()})
    state = dict(model.state_dict())
    biases = {k: stored[k] for k in state if k.endswith("e_score_correction_bias")}
    for k in list(state):
        if k in stored:
            state[k] = stored.pop(k).to(state[k].dtype)  # the router stays float32 where transformers holds it so
    assert not stored, f"tensors the reference did not place: {sorted(stored)[:4]}"
    model.load_state_dict(state, strict=True)
    for k, v in biases.items():  # as stored (float32; transformers 5.17's from_config builds them in the model dtype)
        router = model.get_submodule(k.rpartition(".")[0])
        router.e_score_correction_bias = v.clone()
    if not act_quant:
        return model.eval()
    for name, (w13, w2) in experts.items():
        block = model.get_submodule(name)
        layer = types.SimpleNamespace(
            w13=w13, w13_scale=torch.ones(w13.shape[:2]), w2=w2, w2_scale=torch.ones(w2.shape[:2]), a13_scale=None,
            a2_scale=None, quant_dtype=torch.float8_e4m3fn, dtype=dtype, group_size=BLOCK, num_experts=w13.shape[0],
            top_k=block.gate.top_k, renormalize=True)
        block.experts = FakeQuantExperts(layer, torch.float64)
    for name, w in deq.items():
        layer = types.SimpleNamespace(weight=w, weight_scale=torch.ones(w.shape[0]), weight_block_size=None,
                                      bias=None, input_scale=None, quant_dtype=torch.float8_e4m3fn, group_size=BLOCK,
                                      dtype=dtype)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, FakeQuantLinear(layer, torch.float64))
    return model.eval()
