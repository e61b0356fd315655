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


def optimized(kind: str, scheme, *, qk_gain: float = 1.0, device="cpu", **kw):
    """``tiny_model(kind, **kw)`` with its q and k projections' weights times ``qk_gain`` (before quantization),
    quantized with ``scheme`` (`quantized`) and `cutlass_w8a8.optimize_`d, on ``device``; ``scheme`` None: the bf16
    model itself (``qk_gain`` applied)."""
    from cutlass_w8a8.hf import optimize_

    base = tiny_model(kind, **kw)
    if qk_gain != 1.0:
        with torch.no_grad():
            for name, p in base.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(qk_gain)
    if scheme is None:
        return base.to(device)
    return optimize_(quantized(base, scheme).to(device))


def left_padded_batch(b: int = 3, length: int = 7, seed: int = 0, device="cpu"):
    """``(input_ids, attention_mask)`` ``(b, length)`` int64: random tokens in [2, 256), left padding of 3 in row 1
    and 1 in row 2 (when they exist), padded positions holding token 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (b, length), generator=g)
    am = torch.ones_like(ids)
    if b > 1:
        am[1, :3] = 0
    if b > 2:
        am[2, :1] = 0
    return ids.masked_fill(am == 0, 0).to(device), am.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius), in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


# Our decode step and transformers' compute the same function with other roundings on the GPU (the batch padded
# to its bucket, 4 rows instead of 3, can pick other GEMM / lm_head kernels; another 4-D mask construction; an
# 8-bit activation level flipped by a bf16 rounding), so their logits on the same prefix differ by bf16 noise and
# the tiny random models' frequent near-ties (logits ~0.7, bf16 ulp 2^-8, many exact ties) flip greedy tokens.
# Bound on ||ours - reference|| / ||reference|| of one row's logits on the same prefix: measured on the CPU up to
# 4.9e-2 between the `sdpa` and `eager` attention paths of these models (expected larger than the GPU's
# roundings; not measured on a GPU), while a decode step with the padding keys visible, its own key masked or its
# positions not advanced measured 0.15 and more there (with QK_GAIN).
LOGITS_REL_TOL = 0.1
# The greedy test's q / k projections are scaled by this: transformers' init (std 0.02) gives Llama near-uniform
# attention that hardly sees positions (a decode step that does not advance the positions moved its logits by
# <= 3e-2 relative, under LOGITS_REL_TOL); x4 makes that bug move them by 0.15 - 0.43. (Qwen3's q / k norms undo
# the gain: it sees positions already.)
QK_GAIN = 4.0
# Fewest (row, step) token comparisons on equal prefixes the greedy test must make over its 3 rows.
MIN_CHECKED = 6  # half of the greedy tests' 12 new tokens


def check_greedy_against_transformers(ours, ours_logits, ref, length):
    """Our greedy tokens against transformers', row by row, while the prefixes are equal.

    ``ours``: ``(B, L + NEW)`` tokens with ``ours_logits`` (``NEW`` ``(B, V)`` float32 logits that picked them,
    `GraphGenerator.logits_history`); ``ref``: ``model.generate(..., output_logits=True,
    return_dict_in_generate=True)`` (``ref.logits``: the raw, unprocessed logits of each step). At each step of a
    row whose tokens so far are equal (so both paths saw the same prefix):

    - each path's token is the argmax of its own logits (greedy picks what its logits say);
    - the two logit rows differ by at most ``LOGITS_REL_TOL`` (relative, Frobenius): a wrong mask / position /
      cache column / logits row fails here;
    - the tokens are equal, or, where they differ, the reference prefers its token over ours by at most
      ``2 * d``, ``d`` the largest |logit difference| of the two paths at this step: a near-tie that bf16 noise of
      that size can flip. Any larger gap is a wrong token. The row is then not compared further (the prefixes
      differ).

    Returns the number of (row, step) pairs whose tokens were compared equal on equal prefixes."""
    assert ref.sequences.shape == ours.shape
    assert len(ours_logits) == len(ref.logits) == ours.shape[1] - length
    checked = 0
    for r in range(ours.shape[0]):
        assert torch.equal(ours[r, :length], ref.sequences[r, :length])
        for i in range(ours.shape[1] - length):
            o, w = ours_logits[i][r].double(), ref.logits[i][r].double()
            t_o, t_w = int(ours[r, length + i]), int(ref.sequences[r, length + i])
            where = f"row {r} step {i}"
            assert o[t_o] == o.max(), f"{where}: our token {t_o} is not the argmax of our logits"
            assert w[t_w] == w.max(), f"{where}: transformers' token {t_w} is not the argmax of its logits"
            err = rel_err(o, w)
            assert err <= LOGITS_REL_TOL, f"{where}: logits differ from transformers' by {err:.3e} (relative)"
            if t_o == t_w:
                checked += 1
                continue
            d, gap = float((o - w).abs().max()), float(w[t_w] - w[t_o])
            assert gap <= 2 * d, (f"{where}: token {t_o} instead of transformers' {t_w}, whose logit is ahead by "
                                  f"{gap:.3e} > 2 x the paths' max |logit difference| {d:.3e}")
            break
    return checked
