"""Tiny random transformers models for the `cutlass_w8a8.hf` tests (optimize_, generate): Llama, Mistral, Qwen2
(q/k/v bias), Qwen3 (q/k norms), bf16, every projection's K and N a multiple of 128 (so block-scaled fp8 fuses:
q, k and v have N = 128), and their W8A8 copies."""

from __future__ import annotations

import copy

import torch

import cutlass_w8a8 as cw

KINDS = ("llama", "mistral", "qwen2", "qwen3")
SCHEMES = {
    "int8": cw.W8A8Config(dtype=torch.int8),
    "fp8": cw.W8A8Config(dtype=torch.float8_e4m3fn),
    "fp8-block": cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128)),
}
VOCAB = 256


def tiny_model(kind: str, seed: int = 0, layers: int = 2, unit_norms: bool = False, device="cpu",
               attn: str = "sdpa", eos_token_id=None):
    """A random bf16 ``<Kind>ForCausalLM``: hidden 128, 4 query and 4 key/value heads of 32, MLP 256, vocab 256,
    no tied embeddings, no sliding window. The RMSNorm weights are ``1 + 0.1 N(0, 1)`` (transformers initialises
    them to 1) unless ``unit_norms``; Qwen3's per-head q/k norms likewise."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=eos_token_id,
                  attn_implementation=attn)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common, use_sliding_window=False), transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common, use_sliding_window=False), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg)
    # as transformers loads a bf16 checkpoint: the rotary inverse frequencies stay float32 (a plain .to(bf16)
    # would round them, and the model would differ from the same weights saved and loaded)
    keep = {name: b.clone() for name, b in model.named_buffers() if "inv_freq" in name}
    model.to(torch.bfloat16)
    for name, b in keep.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, b)
    if not unit_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.1 * torch.randn_like(p))
    if kind == "qwen2":  # transformers initialises biases to 0: give q/k/v real biases
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.copy_(0.05 * torch.randn_like(p))
    return model.to(device).eval()


def quantized(model, scheme: str):
    """A ``quantize_``d deep copy of ``model`` (``lm_head`` left in bf16)."""
    return cw.quantize_(copy.deepcopy(model), SCHEMES[scheme], filter_fn=lambda m, fqn: "lm_head" not in fqn)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius), in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())
