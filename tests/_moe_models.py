"""Tiny random transformers MoE models and the float reference of `W8A8MoE`, shared by the MoE tests (layer,
checkpoints, tensor parallelism, decoder).

- `tiny_moe_model(kind)`: a deterministic random bf16 ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` (with its
  shared expert) or ``MixtralForCausalLM``: 8 experts, top-2, hidden 256, expert intermediate 128 (so
  block-scaled fp8 applies: H and I multiples of 128), 2 layers, 4 heads of 64, 2 KV heads, vocab 512.
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
# Router weights are scaled by this after the random init (std 0.02 * 5): decisive routings that load the experts
# unevenly (some empty at a few tokens), so that a rounding difference rarely flips a top-2 choice.
ROUTER_GAIN = 5.0
# lm_head scaled by this: logits spread (std ~2.5) so that greedy tokens have margins above bf16 rounding.
LM_HEAD_GAIN = 8.0


def tiny_moe_config(kind: str):
    """The transformers config of `tiny_moe_model` ``kind`` (one of `KINDS`, a ``model_type``; each row of
    `cutlass_w8a8.moe.families.FAMILIES` needs its ``model_type`` here: tests/moe/test_moe_families_cpu.py builds it)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  num_experts_per_tok=TOP_K, hidden_act="silu", eos_token_id=None)  # no EOS: generate runs to the end
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=64, intermediate_size=256, moe_intermediate_size=MOE_I,
                                           num_experts=EXPERTS, norm_topk_prob=True, decoder_sparse_step=1)
    if kind == "qwen2_moe":
        # Qwen2-MoE's router does not renormalize by default (norm_topk_prob False), its shared expert is a
        # dense SwiGLU MLP with a sigmoid gate (a Linear with N = 1: left in float by quantize_)
        return transformers.Qwen2MoeConfig(**common, intermediate_size=256, moe_intermediate_size=MOE_I,
                                           shared_expert_intermediate_size=256, num_experts=EXPERTS,
                                           norm_topk_prob=False, decoder_sparse_step=1)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=64, intermediate_size=MOE_I, num_local_experts=EXPERTS)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def tiny_moe_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A random ``kind`` causal LM (`KINDS`) in ``dtype``, eval mode, the same weights for the same ``seed``:
    transformers' init, then the routers' weights times `ROUTER_GAIN` and ``lm_head`` times `LM_HEAD_GAIN`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(kind), dtype=dtype)
    with torch.no_grad():
        for _, block in moe_blocks(model):
            getattr(block, family_of(block).routing.router).weight.mul_(ROUTER_GAIN)
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
