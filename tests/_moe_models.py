"""Tiny random transformers MoE models and the float reference of `W8A8MoE`, shared by the MoE tests (layer,
checkpoints, tensor parallelism, decoder).

- `tiny_moe_model(kind)`: a deterministic random bf16 ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` (with its
  shared expert) or ``MixtralForCausalLM`` (`KINDS`), or the causal LM of any other row of
  `cutlass_w8a8.moe.families.FAMILIES` (DeepSeek-V3 with MLA, grouped top-k and a random correction bias, GLM-4.5,
  OLMoE, ...: `tiny_moe_config`): 8 experts, top-2, hidden 256, expert intermediate 128 (so block-scaled fp8
  applies: H and I multiples of 128), 2 layers, 4 heads of 64, 2 KV heads, vocab 512, unless `tiny_moe_config`
  says otherwise.
- `fake_quant_act`: activations quantized and dequantized in float as `W8A8MoE` / `W8A8Linear` quantize them.
- `FakeQuantExperts`: the experts of a `W8A8MoE` computed from its dequantized weights in float32 or float64
  with the layer's activation quantization and rounding points (a drop-in ``experts`` module, as W8A8MoE).
- `dequantized_reference(model)`: a copy of a quantized model with every `W8A8MoE` a `FakeQuantExperts` and every
  `W8A8Linear` a float Linear of the same math (the "dequantized float32 reference").

Everything here imports transformers; test files importorskip it first.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.moe.families import family_of

KINDS = ("qwen3_moe", "qwen2_moe", "mixtral")
VOCAB = 512
HIDDEN = 256
MOE_I = 128
EXPERTS = 8
TOP_K = 2
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# A CUDA W8A8MoE vs its float64 reference, `FakeQuantExperts` (SQNR, dB; tests/moe/test_moe_layer_cuda.py and
# tests/moe/test_moe_decode_cuda.py). On the CPU the layer equals it bit for bit. On the GPU the
# float32 epilogues round once more than the reference, silu uses the device's exp, and fp8 tensor cores
# accumulate with fewer bits (docs EPILOGUES.md: row-wise fp8 4.5e-3 relative vs float64), so an intermediate
# may sit one bf16 ulp away and move one step of the next quantization (1/127 int8, 1/16 of a value's magnitude
# fp8). A CPU experiment perturbing w13 by 1e-3 relative noise gives 41.8 dB int8, 38.3 dB fp8; a wrong expert,
# scale or routing gives < 10 dB.
LAYER_SQNR_DB = {"int8": 40.0, "fp8": 30.0, "fp8-block": 30.0}
# Router weights are scaled by this after the random init (std 0.02 * 5): decisive routings that load the experts
# unevenly (some empty at a few tokens), so that a rounding difference rarely flips a top-2 choice.
ROUTER_GAIN = 5.0
# lm_head scaled by this: logits spread (std ~2.5) so that greedy tokens have margins above bf16 rounding.
LM_HEAD_GAIN = 8.0


# DeepSeek-V3's multi-head latent attention, tiny: kv_a_proj_with_mqa has N = kv_lora_rank + qk_rope_head_dim = 576
# (a partial 128-row block, as the real model's), q_a_proj N = q_lora_rank = 128, q_b_proj / kv_b_proj N = 4 heads x
# 128, o_proj K = 4 x 64: every K a multiple of 128, so that block fp8 applies to all of them.
MLA = dict(kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64)
# Per-expert correction biases (DeepSeek-V3's e_score_correction_bias, ...) are drawn after the init as this times a
# standard normal: of the order of the spread of the sigmoid scores, so that they change some tokens' experts.
BIAS_STD = 0.1


def tiny_moe_config(kind: str):
    """The transformers config of `tiny_moe_model` ``kind`` (a ``model_type``: `KINDS`, and every row of
    `cutlass_w8a8.moe.families.FAMILIES` needs its ``model_type`` here: tests/moe/test_moe_families_cpu.py builds
    it). All: hidden 256, expert intermediate 128 (H and I multiples of 128: block fp8 applies), 2 layers, 4 heads
    of 64, vocab 512; 8 experts top-2 unless said."""
    import transformers

    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  num_experts_per_tok=TOP_K, hidden_act="silu", eos_token_id=None)  # no EOS: generate runs to the end
    # DeepSeek-V3-like: layer 0 dense (first_k_dense_replace = 1, intermediate 256), layer 1 MoE with one shared
    # expert, routed scaling 2.5, renormalized; grouped top-k where a family's checkpoints use it
    ds = dict(common, intermediate_size=256, moe_intermediate_size=MOE_I, n_shared_experts=1,
              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1)
    ds_groups = dict(n_routed_experts=EXPERTS, n_group=2, topk_group=1)  # 2 groups of 4, one kept: top-2 of 4
    linear_attn = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
                       linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    if kind == "qwen3_moe":
        return t.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=256, moe_intermediate_size=MOE_I,
                                num_experts=EXPERTS, norm_topk_prob=True, decoder_sparse_step=1)
    if kind == "qwen2_moe":
        # Qwen2-MoE's router does not renormalize by default (norm_topk_prob False), its shared expert is a
        # dense SwiGLU MLP with a sigmoid gate (a Linear with N = 1: left in float by quantize_)
        return t.Qwen2MoeConfig(**common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                shared_expert_intermediate_size=256, num_experts=EXPERTS,
                                norm_topk_prob=False, decoder_sparse_step=1)
    if kind == "mixtral":
        return t.MixtralConfig(**common, head_dim=64, intermediate_size=MOE_I, num_local_experts=EXPERTS)
    if kind == "deepseek_v3":
        # 16 experts in 4 groups of 4, 2 groups kept, top-4; MLA (MLA above) with 4 key/value heads
        return t.DeepseekV3Config(**dict(ds, **MLA, num_key_value_heads=4, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=4, topk_group=2))
    if kind == "glm4_moe":  # GLM-4.5: no groups (n_group 1), partial rotary embedding
        return t.Glm4MoeConfig(**dict(ds, head_dim=64, n_routed_experts=EXPERTS, n_group=1, topk_group=1))
    if kind == "olmoe":  # softmax top-k, not renormalized (norm_topk_prob False, OLMoE's default)
        return t.OlmoeConfig(**common, intermediate_size=MOE_I, num_experts=EXPERTS, norm_topk_prob=False)
    if kind in ("deepseek_v32", "glm_moe_dsa"):  # DeepSeek sparse attention: an indexer of 2 heads of 64
        cls = t.DeepseekV32Config if kind == "deepseek_v32" else t.GlmMoeDsaConfig
        return cls(**dict(ds, **MLA, **ds_groups, num_key_value_heads=4, index_topk=16, index_head_dim=64,
                          index_n_heads=2))
    if kind == "deepseek_v2":  # DeepSeek-V2-Lite's greedy routing: softmax top-k, not renormalized, scaled
        return t.DeepseekV2Config(**dict(ds, **MLA, n_routed_experts=EXPERTS, num_key_value_heads=4,
                                         topk_method="greedy", norm_topk_prob=False))
    if kind in ("glm4_moe_lite", "axk1"):
        cls = t.Glm4MoeLiteConfig if kind == "glm4_moe_lite" else t.AXK1Config
        return cls(**dict(ds, **MLA, **ds_groups, num_key_value_heads=4))
    if kind == "kimi_linear":  # layer 0: KDA linear attention and a dense MLP; layer 1: MLA and the MoE block
        kw = {k: v for k, v in ds.items() if k not in ("n_shared_experts", "norm_topk_prob", "first_k_dense_replace")}
        return t.KimiLinearConfig(**dict(kw, **dict(MLA, q_lora_rank=None), num_key_value_heads=4, num_experts=EXPERTS,
                                         num_shared_experts=1, num_expert_group=2, topk_group=1,
                                         moe_renormalize=True, linear_head_dim=64, linear_num_heads=4,
                                         pad_token_id=None, bos_token_id=None,
                                         layer_types=["linear_attention", "full_attention"],
                                         mlp_layer_types=["dense", "sparse"]))
    if kind == "dots1":
        return t.Dots1Config(**dict(ds, **ds_groups, head_dim=64))
    if kind == "exaone_moe":
        return t.ExaoneMoeConfig(**dict(common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                        num_experts=EXPERTS, num_shared_experts=1, norm_topk_prob=True,
                                        routed_scaling_factor=2.5, n_group=2, topk_group=1, first_k_dense_replace=1,
                                        head_dim=64))
    if kind == "mimo_v2_flash":  # no shared experts
        return t.MiMoV2FlashConfig(**dict(common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                          n_routed_experts=EXPERTS, routed_scaling_factor=2.5, n_group=2,
                                          topk_group=1, norm_topk_prob=True, head_dim=64, v_head_dim=64))
    if kind == "solar_open":
        return t.SolarOpenConfig(**dict(common, moe_intermediate_size=MOE_I, n_routed_experts=EXPERTS,
                                        n_shared_experts=1, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                                        norm_topk_prob=True, head_dim=64))
    if kind == "qwen3_next":  # layer 0 gated delta net (linear attention), layer 1 full attention
        return t.Qwen3NextConfig(**dict(common, **linear_attn, intermediate_size=256, moe_intermediate_size=MOE_I,
                                        shared_expert_intermediate_size=256, num_experts=EXPERTS,
                                        norm_topk_prob=True, head_dim=64))
    if kind == "minimax_m2":  # sigmoid scores, the block's correction bias, always renormalized
        return t.MiniMaxM2Config(**dict(common, intermediate_size=MOE_I, num_local_experts=EXPERTS, head_dim=64,
                                        bos_token_id=None))
    if kind == "minimax":
        return t.MiniMaxConfig(**dict(common, intermediate_size=MOE_I, num_local_experts=EXPERTS, head_dim=64))
    if kind == "ernie4_5_moe":  # layer 0 dense, layer 1 MoE (softmax + the [1, E] correction bias, renormalized)
        return t.Ernie4_5_MoeConfig(**dict(common, intermediate_size=256, moe_intermediate_size=MOE_I, moe_k=TOP_K,
                                           moe_num_experts=EXPERTS, moe_num_shared_experts=1,
                                           moe_layer_start_index=1, moe_layer_end_index=1))
    if kind == "hy_v3":  # sigmoid + the block's correction bias, renormalized, router_scaling_factor
        return t.HYV3Config(**dict(common, intermediate_size=256, num_experts=EXPERTS, num_shared_experts=1,
                                   moe_intermediate_size=MOE_I, router_scaling_factor=2.5, head_dim=64))
    if kind == "flex_olmo":
        return t.FlexOlmoConfig(**dict(common, intermediate_size=MOE_I, num_experts=EXPERTS, norm_topk_prob=True,
                                       pad_token_id=None))
    if kind == "mellum":
        return t.MellumConfig(**dict(common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                     num_local_experts=EXPERTS, norm_topk_prob=True, head_dim=64))
    if kind == "laguna":  # sigmoid + the router's correction bias, renormalized; layer 0 dense
        return t.LagunaConfig(**dict(common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                     shared_expert_intermediate_size=256, num_experts=EXPERTS, head_dim=64))
    raise ValueError(f"kind must be one of {KINDS} or a model_type of cutlass_w8a8.moe.families.FAMILIES, got "
                     f"{kind!r}")


def correction_bias_of(block: nn.Module):
    """The correction bias tensor of a family's ``block`` (its row's `Routing.correction_bias` path), or None."""
    path = family_of(block).routing.correction_bias
    if path is None:
        return None
    obj = block
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def tiny_moe_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, **config_overrides):
    """A random ``kind`` causal LM (`tiny_moe_config`, with ``config_overrides`` set on it, e.g.
    ``q_lora_rank=None``) in ``dtype``, eval mode, the same weights for the same ``seed``: transformers' init, then
    the routers' weights times `ROUTER_GAIN`, each correction bias (a row's `Routing.correction_bias`; zero after
    transformers' init) `BIAS_STD` times a standard normal, ``lm_head`` times `LM_HEAD_GAIN`."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(kind)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for _, block in moe_blocks(model):
            getattr(block, family_of(block).routing.router).weight.mul_(ROUTER_GAIN)
            bias = correction_bias_of(block)
            if bias is not None:
                bias.copy_((BIAS_STD * torch.randn(bias.shape, generator=gen)).to(bias.dtype))
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    return model.eval()


def moe_blocks(model: nn.Module) -> list:
    """``[(fqn, block)]``: the sparse-MoE blocks of ``model`` of a family of `cutlass_w8a8.moe.families` (Qwen2-MoE,
    Qwen3-MoE, Mixtral, ...)."""
    return [(n, m) for n, m in model.named_modules() if family_of(m) is not None]


def fake_quant_act(x: torch.Tensor, quant_dtype: torch.dtype, scale=None, group_size: int = 0,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` quantized and dequantized as `W8A8MoE` quantizes a GEMM input: dynamic per row with scale
    ``absmax / 127`` (``/ 448`` for e4m3; float32, IEEE division), per 1 x ``group_size`` group of each row when
    ``group_size`` is 128, or static per tensor with ``scale``; round half to even and saturate (int8), or round
    to e4m3 after clamping to +-448. Returns ``compute_dtype``."""
    xf = x.float()
    if group_size:
        xf = xf.unflatten(-1, (-1, group_size))
    if scale is None:
        s = xf.abs().amax(-1, keepdim=True) / torch.tensor(_QMAX[quant_dtype])
    else:
        s = scale.float().reshape(())
    y = torch.where(s == 0, torch.zeros_like(xf), xf / torch.where(s == 0, torch.ones_like(s), s))
    if quant_dtype == torch.int8:
        q = torch.round(y).clamp(-128, 127)
    else:
        q = y.clamp(-448, 448).to(quant_dtype).float()
    out = q.to(compute_dtype) * s.to(compute_dtype)
    return out.flatten(-2) if group_size else out


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """``[E, N, K]`` 8-bit expert weights times their scales: per channel ``[E, N]`` or per 128 x 128 block
    ``[E, ceil(N / 128), ceil(K / 128)]``."""
    wf = w.to(compute_dtype)
    if scale.dim() == 3:
        n, k = w.shape[1:]
        s = scale.to(compute_dtype).repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
        return wf * s
    return wf * scale.to(compute_dtype).unsqueeze(-1)


class FakeQuantExperts(nn.Module):
    """The float reference of a `W8A8MoE`: its dequantized weights in ``compute_dtype`` (float32 or float64), the
    layer's activation quantization (`fake_quant_act`, of bf16 / fp16 / float32 hidden states as given) and its
    rounding points: each GEMM's output rounded to the
    layer's ``dtype``, ``silu(gate) * up`` in that dtype (silu rounded, then the product), the top-k weighted sum
    in float32 over j ascending, rounded once. Same call as W8A8MoE (router logits, or topk ids and weights)."""

    def __init__(self, layer, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.register_buffer("w13", dequantize_experts(layer.w13, layer.w13_scale, compute_dtype))
        self.register_buffer("w2", dequantize_experts(layer.w2, layer.w2_scale, compute_dtype))
        self.a13_scale, self.a2_scale = layer.a13_scale, layer.a2_scale
        self.quant_dtype, self.dtype, self.group_size = layer.quant_dtype, layer.dtype, layer.group_size
        self.num_experts, self.top_k, self.renormalize = layer.num_experts, layer.top_k, layer.renormalize

    def route(self, logits: torch.Tensor):
        """``(topk_weights float32, topk_ids int64)``: softmax in float32, top-k, renormalized if asked."""
        p = torch.softmax(logits.float(), dim=-1)
        w, ids = torch.topk(p, self.top_k, dim=-1)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        return w, ids

    def forward(self, hidden_states, router_logits_or_topk_ids, topk_weights=None):
        h = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, h)
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            x = x.float()
        if topk_weights is None:
            topk_weights, ids = self.route(router_logits_or_topk_ids.reshape(x.shape[0], -1))
        else:
            ids = router_logits_or_topk_ids.reshape(x.shape[0], -1)
        t, k = ids.shape
        cd, od = self.compute_dtype, self.dtype
        xq = fake_quant_act(x, self.quant_dtype, self.a13_scale, self.group_size, cd)  # [T, H]
        z = torch.zeros(t, k, h, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            tok, j = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            y13 = (xq[tok] @ self.w13[e].T).to(od)
            gate, up = y13.chunk(2, dim=-1)
            a = F.silu(gate) * up
            aq = fake_quant_act(a, self.quant_dtype, self.a2_scale, self.group_size, cd)
            z[tok, j] = (aq @ self.w2[e].T).to(od).float()
        wts = topk_weights.reshape(t, k).float()
        valid = (ids >= 0) & (ids < self.num_experts)
        out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        for jj in range(k):
            out = out + torch.where(valid[:, jj, None], wts[:, jj, None] * z[:, jj], torch.zeros_like(out))
        return out.to(od).to(hidden_states.dtype).reshape(hidden_states.shape)


class FakeQuantLinear(nn.Module):
    """A `W8A8Linear` computed from its dequantized weight in ``compute_dtype`` (float32 or float64) with its
    activation quantization (of the input as given), the output rounded to the layer's dtype, then to the
    input's."""

    def __init__(self, layer, compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.compute_dtype = compute_dtype
        w, s = layer.weight.to(compute_dtype), layer.weight_scale.to(compute_dtype)
        if layer.weight_block_size is not None:
            n, k = w.shape
            s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        else:
            s = s.reshape(-1, 1)
        self.register_buffer("weight", w * s)
        self.register_buffer("bias", None if layer.bias is None else layer.bias.to(compute_dtype))
        self.input_scale, self.quant_dtype, self.group_size = layer.input_scale, layer.quant_dtype, layer.group_size
        self.dtype = layer.dtype

    def forward(self, x):
        xq = fake_quant_act(x, self.quant_dtype, self.input_scale, self.group_size, self.compute_dtype)
        return F.linear(xq, self.weight, self.bias).to(self.dtype).to(x.dtype)


def dequantized_reference(model: nn.Module, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """A deep copy of the quantized ``model`` with every `W8A8MoE` replaced by a `FakeQuantExperts` and every
    `W8A8Linear` by a `FakeQuantLinear`: the model dequantized (``compute_dtype`` math, the same activation
    quantization and rounding points to the layers' dtype); the rest (routers, norms, attention, lm_head) as is.
    float64 makes the quantized layers' only difference from this reference the float32 rounding of their
    accumulator and scaling (rarely one bf16 ulp), so that routings and greedy tokens agree."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, cw.W8A8MoE):
            new = FakeQuantExperts(m, compute_dtype)
        elif isinstance(m, cw.W8A8Linear):
            new = FakeQuantLinear(m, compute_dtype)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(ref.get_submodule(parent), child, new)
    return ref.eval()


def _routers(model: nn.Module) -> dict:
    """``{name: router module}`` of every MoE block of a family row in ``model`` (the row's `Routing.router` child)."""
    out = {}
    for name, m in model.named_modules():
        fam = family_of(m)
        if fam is not None and hasattr(m, fam.routing.router):
            out[f"{name}.{fam.routing.router}"] = getattr(m, fam.routing.router)
    return out


def record_routing(model: nn.Module) -> tuple:
    """Record what every MoE router of ``model`` returns (transformers' routers return ``(router_logits,
    top_k_weights, top_k_index)``) on the next forward calls: returns ``(records, remove)``, ``records`` ``{router
    name: [outputs of each call, tensors detached on the CPU]}``, ``remove()`` unhooks."""
    records = {n: [] for n in _routers(model)}

    def hook(name):
        def fn(mod, args, out):
            records[name].append(tuple(t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in out))
        return fn

    handles = [r.register_forward_hook(hook(n)) for n, r in _routers(model).items()]
    return records, lambda: [h.remove() for h in handles]


def pin_routing(model: nn.Module, records: dict):
    """Make every MoE router of ``model`` return the recorded outputs of `record_routing` (call by call, each tensor
    on the live output's device and dtype) instead of its own: a comparison of two models' numerics that a routing
    near-tie flip (which their rounding noise can cause, and which moves a token's output by a whole expert) does not
    decide. Returns ``remove()``. Raises AssertionError when a router is called more often than recorded."""
    calls = {n: 0 for n in records}

    def hook(name):
        def fn(mod, args, out):
            i = calls[name]
            assert i < len(records[name]), f"router {name} called {i + 1} times, recorded {len(records[name])}"
            calls[name] += 1
            return tuple(r.to(device=o.device, dtype=o.dtype) if isinstance(o, torch.Tensor) else o
                         for r, o in zip(records[name][i], out))
        return fn

    routers = _routers(model)
    assert set(routers) == set(records), (sorted(routers), sorted(records))
    handles = [r.register_forward_hook(hook(n)) for n, r in routers.items()]
    return lambda: [h.remove() for h in handles]
