"""Tiny random transformers models for the `cutlass_w8a8.hf` tests (optimize_, generate): Llama, Mistral, Qwen2
(q/k/v bias), Qwen3 (q/k norms), bf16, every projection's K and N a multiple of 128 (so block-scaled fp8 fuses:
q, k and v have N = 128), and their W8A8 copies; the greedy comparison of `cutlass_w8a8.generate` with transformers'
``generate`` (`check_greedy_against_transformers`), with, for MoE models, each path's routing (`RoutingRecorder`) and
the routing near-tie rule (`routing_flip`); the two paths' logit bound per scheme (`logits_rel_tol`)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re

import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.moe.families import family_of

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
# Bound on ||ours - reference|| / ||reference|| of one row's logits on the same prefix WITH INT8 PER-TOKEN
# ACTIVATIONS: measured on the CPU up to 4.9e-2 between the `sdpa` and `eager` attention paths of these models
# (expected larger than the GPU's roundings; not measured on a GPU), while a decode step with the padding keys
# visible, its own key masked or its positions not advanced measured 0.15 and more there (with QK_GAIN). The other
# schemes' bounds are this one times their derived noise ratio: `logits_rel_tol`.
LOGITS_REL_TOL = 0.1
# The greedy test's q / k projections are scaled by this: transformers' init (std 0.02) gives Llama near-uniform
# attention that hardly sees positions (a decode step that does not advance the positions moved its logits by
# <= 3e-2 relative, under LOGITS_REL_TOL); x4 makes that bug move them by 0.15 - 0.43. (Qwen3's q / k norms undo
# the gain: it sees positions already.) Which schemes catch those bugs: int8 (bound 0.1) catches all of them; the
# e4m3 schemes' derived bound (`logits_rel_tol`: 0.1 x ~2.3, about 0.23) catches only the upper part of that range
# (a bug moving the logits by 0.15 - 0.23 passes it), so for those the e4m3 cases depend on the int8 case of the
# same model: the mask / position / cache code is the same for every scheme (only the GEMMs' operands differ), and
# every kind runs an int8 case on the GPU (tests/hf/test_hf_generate_graph_cuda.py: each kind x every scheme) and on
# the CPU for Llama, Qwen2, Qwen3-MoE, Qwen2-MoE and GLM-4.5 (Qwen3 and Mixtral's CPU cases are e4m3 only).
QK_GAIN = 4.0
# Fewest (row, step) token comparisons on equal prefixes the greedy test must make over its 3 rows.
MIN_CHECKED = 6  # half of the greedy tests' 12 new tokens


# ---- the per-scheme bound: how much more noise an e4m3 scheme makes of the same bf16 roundings -------------------
# The activation rows the bound's model draws: unit Gaussian rows of the MoE tiny models' hidden size (RMSNorm's
# output, read by the router and the q / k / v, gate / up and expert GEMMs), 1 x 128 groups for fp8-block.
NOISE_ROWS, NOISE_K, NOISE_GROUP, NOISE_SEED = 4096, 256, 128, 0


def qdq_int(x: torch.Tensor, qmax: int = 127) -> torch.Tensor:
    """Per-row symmetric integer quantize-dequantize of float32 ``x`` ``(N, K)``: scale ``absmax / qmax``, levels
    ``round_half_even(x / scale)`` (int8 per-token: ``qmax`` 127; a level step of ``absmax / qmax``, absolute)."""
    scale = x.abs().amax(-1, keepdim=True) / qmax
    return torch.round(x / scale).clamp(-qmax, qmax) * scale


def qdq_float(x: torch.Tensor, dtype=torch.float8_e4m3fn, group: int | None = None) -> torch.Tensor:
    """Per-row (``group`` None) or per-``group``-column symmetric float quantize-dequantize of float32 ``x``
    ``(N, K)``: scale ``absmax / finfo(dtype).max``, ``x / scale`` rounded to ``dtype`` (nearest even; e4m3's level
    step is 2^-3 of the value's binade, relative)."""
    g = x.shape[-1] if group is None else group
    xg = x.unflatten(-1, (-1, g))
    scale = xg.abs().amax(-1, keepdim=True) / torch.finfo(dtype).max
    return ((xg / scale).to(dtype).float() * scale).flatten(-2)


# Each scheme's activation quantize-dequantize (the formats of `SCHEMES`' activations: its weights are the same on
# both paths and do not enter the comparison).
QDQ = {"int8": qdq_int,
       "fp8": qdq_float,
       "fp8-block": functools.partial(qdq_float, group=NOISE_GROUP)}


def requant_noise(qdq, rows: int = NOISE_ROWS, k: int = NOISE_K, seed: int = NOISE_SEED) -> float:
    """The relative noise that a one-bf16-ulp perturbation of activation rows leaves after ``qdq``:
    ``sqrt(mean ||qdq(x') - qdq(x)||^2 / mean ||qdq(x)||^2)`` over ``rows`` seeded rows ``x`` of ``k`` N(0, 1)
    values rounded to bf16, ``x'`` each element of ``x`` moved by one bf16 ulp up or down (seeded random sign),
    rounded to bf16. float32 arithmetic, deterministic for a seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16().float()
    sign = torch.randint(0, 2, (rows, k), generator=g).float() * 2 - 1
    _, e = torch.frexp(x)
    ulp = torch.ldexp(torch.ones_like(x), e - 8)  # bf16: 8 significant bits, x = m 2^e with m in [0.5, 1)
    x2 = (x + sign * ulp).bfloat16().float()
    q, q2 = qdq(x), qdq(x2)
    return float(((q2 - q).square().sum(-1).mean() / q.square().sum(-1).mean()).sqrt())


@functools.lru_cache(maxsize=None)
def logits_rel_tol(scheme: str) -> float:
    """The bound on the two paths' relative logit difference (``rel_err`` of one row's logits, or of one token's
    router logits) for a model whose activations are quantized with ``scheme`` (a key of `SCHEMES`):
    ``LOGITS_REL_TOL * max(1, requant_noise(QDQ[scheme]) / requant_noise(QDQ["int8"]))``. int8: 0.1 exactly.

    Model. The two paths compute the same quantized model; their activations differ by bf16 roundings, which
    reach the logits through the 8-bit activation levels they flip at each quantized GEMM's input (then read out
    linearly: a random linear readout keeps a perturbation's relative size). A perturbation ``eps`` of an element
    whose level step is ``h`` (``|eps| < h``) flips its level with probability ``|eps| / h``, by ``h``: expected
    squared error ``|eps| h``. With ``eps`` one bf16 ulp (2^-8 to 2^-7 of ``|x|``): int8 per-token's ``h =
    absmax / 127`` is absolute, e4m3's ``h`` is 2^-4 to 2^-3 of ``|x|``, so the e4m3 schemes turn the same ulps
    into more noise (the scale's own change, when the absmax element moves, is in the computation too).
    `requant_noise` computes it over seeded rows (`NOISE_ROWS` x `NOISE_K` unit Gaussian values, the RMSNorm'd
    hidden states of the MoE tiny models), each element moved by one ulp; the ratio to int8's is about 2.3 for
    per-token e4m3 and 1 x 128 e4m3 (rows captured from the tiny GLM-4.5's q / k / v / o, gate / up and expert
    inputs give 2.31 - 2.37; the heavier-tailed down projection inputs ``silu(g) u`` 1.8: their larger absmax
    coarsens int8's step; moving a tenth of the elements instead of all gives 2.2).

    Margin: the int8 bound's own (0.1 over its measured 4.9e-2, about 2x), carried by the ratio; no other factor.
    The ratio scales the whole int8 bound, also its part that is no quantization's (bf16 attention, softmax,
    lm_head), which an e4m3 scheme does not enlarge: an overestimate there; ``max(1, .)`` keeps that part for a
    scheme finer than int8. Not modeled: noise compounding over the layers (a flipped level is a perturbation
    larger than an ulp at the next GEMM; in the limit the noise is a level step, and the ratio that of the steps
    themselves, RMS e4m3 step over int8's: about 3.8 for these rows); the CPU's GLM-4.5 measurement (median
    router-logit difference 2.4e-2 with fp8 against 0.9e-2 with int8, 2.7x) sits between the two.

    Raises ValueError naming ``scheme`` when it is not a key of `SCHEMES`."""
    if scheme not in QDQ:
        raise ValueError(f"logits_rel_tol: scheme {scheme!r} is not one of {sorted(QDQ)}")
    ratio = requant_noise(QDQ[scheme]) / requant_noise(QDQ["int8"])
    return LOGITS_REL_TOL * max(1.0, ratio)


def check_greedy_against_transformers(ours, ours_logits, ref, length, *, scheme, routing=None, attention_mask=None):
    """Our greedy tokens against transformers', row by row, while the prefixes are equal.

    ``ours``: ``(B, L + NEW)`` tokens with ``ours_logits`` (``NEW`` ``(B, V)`` float32 logits that picked them,
    `GraphGenerator.logits_history`); ``ref``: ``model.generate(..., output_logits=True,
    return_dict_in_generate=True)`` (``ref.logits``: the raw, unprocessed logits of each step). At each step of a
    row whose tokens so far are equal (so both paths saw the same prefix):

    - each path's token is the argmax of its own logits (greedy picks what its logits say);
    - MoE models (``routing`` given): the two paths' expert selections at this step, `routing_flip`. Where they
      differ at some block (a near-tie of the float router, checked there), the flipped expert moves this step's
      logits by far more than rounding noise: the row is not compared further (its later steps see other hidden
      states), as after a token flip. Where they are equal at every block, the checks below run as for a dense
      model;
    - the two logit rows differ by at most ``logits_rel_tol(scheme)`` (relative, Frobenius; ``scheme``: the
      model's `SCHEMES` key, whose activation format sets how much bf16 noise the two paths' logits carry): a wrong
      mask / position / cache column / logits row fails here;
    - the tokens are equal, or, where they differ, the reference prefers its token over ours by at most
      ``2 * d``, ``d`` the largest |logit difference| of the two paths at this step: a near-tie that bf16 noise of
      that size can flip. Any larger gap is a wrong token. The row is then not compared further (the prefixes
      differ).

    ``routing``: ``(ours, reference)``, each path's `RoutingRecorder.steps` (one list of `LayerRouting` per step,
    the forward whose logits pick token ``i``: the prefill for ``i = 0``); row ``r`` of both is the batch's row
    ``r`` (a bucket's extra rows are not read). ``attention_mask``: the prompts' ``(B, L)`` mask; the prefill
    positions whose routing is compared are the row's prompt tokens (default: all ``L``; a padding position's
    hidden state reaches no other position).

    Raises ValueError (from `logits_rel_tol`) for a ``scheme`` not in `SCHEMES`. Returns the number of (row, step)
    pairs whose tokens were compared equal on equal prefixes."""
    assert ref.sequences.shape == ours.shape
    assert len(ours_logits) == len(ref.logits) == ours.shape[1] - length
    if routing is not None:
        ours_routing, ref_routing = routing
        assert len(ours_routing) == len(ref_routing) == len(ours_logits), (
            f"routing records: ours {len(ours_routing)} and transformers' {len(ref_routing)} steps, "
            f"expected {len(ours_logits)} (one forward per new token)")
    tol = logits_rel_tol(scheme)
    checked = 0
    for r in range(ours.shape[0]):
        assert torch.equal(ours[r, :length], ref.sequences[r, :length])
        for i in range(ours.shape[1] - length):
            o, w = ours_logits[i][r].double(), ref.logits[i][r].double()
            t_o, t_w = int(ours[r, length + i]), int(ref.sequences[r, length + i])
            where = f"row {r} step {i}"
            assert o[t_o] == o.max(), f"{where}: our token {t_o} is not the argmax of our logits"
            assert w[t_w] == w.max(), f"{where}: transformers' token {t_w} is not the argmax of its logits"
            if routing is not None:
                if i == 0 and attention_mask is not None:
                    positions = [int(p) for p in torch.nonzero(attention_mask[r]).flatten()]
                else:
                    positions = list(range(ref_routing[i][0].ids.shape[1]))
                if routing_flip(ours_routing[i], ref_routing[i], r, positions, where, scheme=scheme):
                    break
            err = rel_err(o, w)
            assert err <= tol, (f"{where}: logits differ from transformers' by {err:.3e} (relative) > "
                                f"{tol:.3g} ({scheme})")
            if t_o == t_w:
                checked += 1
                continue
            d, gap = float((o - w).abs().max()), float(w[t_w] - w[t_o])
            assert gap <= 2 * d, (f"{where}: token {t_o} instead of transformers' {t_w}, whose logit is ahead by "
                                  f"{gap:.3e} > 2 x the paths' max |logit difference| {d:.3e}")
            break
    return checked


# ---- MoE routing: what each path's routers chose -----------------------------------------------------------------


@dataclasses.dataclass
class LayerRouting:
    """One MoE block's router call in one forward: ``b`` rows of ``s`` positions, ``E`` experts, top-``k``.

    Attributes
    ----------
    layer : str
        The block's name in the model (``model.layers.1.mlp``).
    logits : torch.Tensor
        ``(b, s, E)`` float32: the router logits as the router returned them (values of its dtype: bf16 for
        Qwen3-MoE / Mixtral / OLMoE in a bf16 model, float32 for DeepSeek-V3 / GLM-4.5).
    choice : torch.Tensor
        ``(b, s, E)`` float32: the values its top-k chose by: the scores (``softmax`` in float32, or ``sigmoid``)
        plus the correction bias where the family has one (DeepSeek-V3's ``scores_for_choice``).
    ids : torch.Tensor
        ``(b, s, k)`` int64: the experts it selected (the ``top_k_index`` the block gave its experts).
    n_group, topk_group : int
        Grouped top-k: ``n_group`` groups of ``E / n_group`` experts, the ``topk_group`` groups whose two best
        choice values sum highest are the candidates (1, 1: no groups).
    last_layer : bool
        The block is in the model's last decoder layer: its output at a position reaches that position's logits
        only (the layer's keys and values come from its input, and no layer follows).
    """

    layer: str
    logits: torch.Tensor
    choice: torch.Tensor
    ids: torch.Tensor
    n_group: int = 1
    topk_group: int = 1
    last_layer: bool = False


class RoutingRecorder:
    """Forward hooks on the router of each MoE block of ``model`` (the blocks of a row of
    `cutlass_w8a8.moe.families`; the router is the row's `Routing.router` child, left in float by `quantize_`),
    recording every call as a `LayerRouting`.

    transformers 5's routers (5.17 and 5.24, for every family of the MoE greedy test: Qwen3-MoE, Mixtral,
    DeepSeek-V3, GLM-4.5, OLMoE) return ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`` for
    the ``T = b x s`` tokens of the block's input, row-major; the block passes ``top_k_index`` and the weights to
    its experts (`W8A8MoE` after `quantize_`). The choice values are recomputed from ``router_logits`` as the
    router computes them (`Routing.scoring`: ``softmax(logits, dtype=float32)`` or ``logits.sigmoid()``; plus
    the block's correction bias, `Routing.correction_bias`), the groups read from the router's attributes
    (`Routing.n_group` / `Routing.topk_group`).

    Parameters
    ----------
    model : torch.nn.Module
        A transformers MoE causal LM (quantized or not).
    batch : int
        The rows of the forwards recorded (a `GraphGenerator`'s bucket size, or the batch of ``model.generate``).
    routers : dict, optional
        ``{block name: module}``: hook these modules instead of the named blocks' own routers (`cutlass_w8a8.hf.
        DecodeStep`'s `MoeRouter` of each MoE layer, which returns the same triple); or ``{block name: (module,
        adapt)}``: hook ``module`` and record ``adapt(args, output)``, the triple, or nothing when it returns None
        (e.g. DecodeStep's experts module, called with the routing whichever op computed it). The choice values and groups are still those of the
        block's family and router. None: every block's own router.

    Raises
    ------
    ValueError
        ``model`` has no MoE block of a family of the table.
    AssertionError
        (when recording) a router returned something other than that triple, or ``T`` is not a multiple of
        ``batch``.
    """

    def __init__(self, model, batch: int, routers=None):
        from _moe_models import moe_blocks

        self.batch = batch
        self.routers = dict(routers or {})
        self.blocks = moe_blocks(model)
        self.layers = getattr(model.config, "num_hidden_layers", None)
        if not self.blocks:
            raise ValueError("RoutingRecorder: `model` has no MoE block of a cutlass_w8a8.moe.families row")
        self.calls: list = []
        self._handles: list = []

    def __enter__(self):
        import functools

        for name, block in self.blocks:
            entry = self.routers.get(name)
            module, adapt = entry if isinstance(entry, tuple) else (entry, None)
            router = module or getattr(block, family_of(block).routing.router)
            self._handles.append(router.register_forward_hook(functools.partial(self._hook, name, block, adapt)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def _hook(self, name, block, adapt, router, args, output):
        from _moe_models import correction_bias_of

        if adapt is not None:
            output = adapt(args, output)
            if output is None:
                return
        assert isinstance(output, tuple) and len(output) == 3, (
            f"{name}: the router returned {type(output).__name__}, expected transformers 5's (router_logits, "
            "top_k_weights, top_k_index)")
        logits, _, ids = output
        t, e = logits.shape
        assert t % self.batch == 0 and ids.shape[0] == t, (f"{name}: router logits {tuple(logits.shape)} / ids "
                                                           f"{tuple(ids.shape)} for a batch of {self.batch} rows")
        routing = family_of(block).routing
        with torch.no_grad():
            if routing.scoring == "softmax":
                choice = torch.softmax(logits, dim=-1, dtype=torch.float32)
            else:
                choice = logits.sigmoid()
            bias = correction_bias_of(block)
            if bias is not None:
                choice = choice + bias
        router = getattr(block, routing.router)  # the block's own (a hooked `routers` module may hold no groups)
        groups = ((int(getattr(router, routing.n_group)), int(getattr(router, routing.topk_group)))
                  if routing.n_group is not None else (1, 1))
        shape = (self.batch, t // self.batch)
        index = re.search(r"(?:^|\.)layers\.(\d+)\.", name)  # model.layers.<i>.mlp; otherwise not known: False
        last = index is not None and self.layers is not None and int(index.group(1)) == self.layers - 1
        self.calls.append(LayerRouting(name, logits.detach().float().reshape(*shape, e).cpu(),
                                       choice.float().reshape(*shape, e).cpu(),
                                       ids.detach().to(torch.int64).reshape(*shape, -1).cpu(), *groups, last))

    def steps(self) -> list:
        """The calls split into forwards: one list per forward of one `LayerRouting` per MoE block, in forward
        order."""
        n = len(self.blocks)
        assert len(self.calls) % n == 0, f"{len(self.calls)} router calls for {n} MoE blocks"
        out = [self.calls[j:j + n] for j in range(0, len(self.calls), n)]
        names = [name for name, _ in self.blocks]
        for s in out:
            assert [c.layer for c in s] == names, f"router calls {[c.layer for c in s]}, expected {names}"
        return out


def selection_margin(choice: torch.Tensor, ids, n_group: int = 1, topk_group: int = 1) -> float:
    """How far the selection ``ids`` (``k`` expert ids) is from changing under ``choice`` (``(E,)`` choice values
    of one token), as a router chooses (transformers' top-k; DeepSeek-V3's grouped top-k).

    Without groups: the last selected choice value minus the first unselected one, ``min_{e in S} c_e -
    max_{e not in S} c_e``. With groups (``G_j`` the sum of group ``j``'s two best choice values; the kept groups
    the ``topk_group`` largest ``G_j``, their experts the candidates): the smaller of that margin over the
    candidates and half the group margin ``(min_{kept} G - max_{dropped} G) / 2``. ``inf`` where nothing is left
    out; negative when ``ids`` is not a top-k of ``choice`` (``-inf``: an id outside the kept groups).
    Returns a float (float64 arithmetic on the float32 values)."""
    c = choice.double().flatten()
    e = c.numel()
    sel = torch.zeros(e, dtype=torch.bool)
    sel[torch.as_tensor(ids, dtype=torch.int64).flatten()] = True
    inf = float("inf")
    m_group, cand = inf, torch.ones(e, dtype=torch.bool)
    if n_group > 1:
        g = c.view(n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros(n_group, dtype=torch.bool)
        kept[g.topk(topk_group).indices] = True
        if (~kept).any():
            m_group = float(g[kept].min() - g[~kept].max())
        cand = kept.repeat_interleave(e // n_group)
    if (sel & ~cand).any():
        return -inf
    rest = cand & ~sel
    m_expert = float(c[sel].min() - c[rest].max()) if rest.any() else inf
    return min(m_expert, m_group / 2)


def routing_flip(ours_step, ref_step, row: int, positions, where: str = "", *, scheme: str) -> bool:
    """Whether our path's and transformers' expert selections differ at ``row`` in one forward (lists of
    `LayerRouting`, one per MoE block in forward order), checking that the difference is a routing near-tie.

    The blocks are compared in forward order at ``positions`` (of the forward's ``s``); the first block whose
    selected expert sets (order aside) differ at any of them is checked, at each such position; later blocks see
    hidden states that the flip changed and are not compared. (A flip in the last decoder layer at a position
    other than the forward's last, a prompt position of the prefill, is checked but changes nothing compared:
    that position's logits are not read, and no later layer or step sees its output; `LayerRouting.last_layer`.)
    With ``c`` and ``c'`` the reference's and our
    choice values of that block and token, ``delta = max_e |c_e - c'_e|`` and ``m`` the reference's margin
    (`selection_margin`):

    1. each path's selection is a top-k of its own choice values (margin >= 0): the recording reads the routers
       as they chose;
    2. ``m <= 2 * delta``, the near-tie rule. Bound: our path selected some ``b`` over the reference's ``a``
       (``a`` selected by the reference, ``b`` a candidate it left out), so ``c'_b >= c'_a`` and
       ``c_a - c_b = (c_a - c'_a) + (c'_a - c'_b) + (c'_b - c_b) <= delta + 0 + delta``, while ``m <= c_a - c_b``.
       With groups, a changed group choice needs ``m_group <= 4 delta`` by the same steps (a group's sum of its two
       best choice values moves by at most ``2 delta``), hence the half group margin in ``m``. Any larger margin
       is a selection these choice values cannot give: a wrong routing;
    3. the router logits ``z`` of that block and token differ by at most ``logits_rel_tol(scheme)`` (relative,
       Frobenius over the E experts; ``scheme``: the model's `SCHEMES` key): ``delta`` is the noise of the two
       paths' hidden states before the flip (the earlier blocks selected the same experts), read out by a linear
       router as the lm_head reads out the last hidden state, so bounded as the logits are. (Given 1, rule 2 holds
       for any selections; this bound is what keeps a grossly wrong hidden state from passing as a near-tie, as the
       logits bound does for a token flip.)

    Returns True when the selections differ (every check passed; the caller stops comparing the row), False when
    they are equal at every block (or differ only where nothing compared sees it). Raises AssertionError naming
    the block, ``where`` (row and step) and the position; ValueError (from `logits_rel_tol`) for a ``scheme`` not in
    `SCHEMES`."""
    tol = logits_rel_tol(scheme)
    assert len(ours_step) == len(ref_step), (f"{where}: {len(ours_step)} MoE blocks in our forward, "
                                             f"{len(ref_step)} in transformers'")
    for ours_l, ref_l in zip(ours_step, ref_step):
        assert ours_l.layer == ref_l.layer and ours_l.ids.shape[1] == ref_l.ids.shape[1], (
            f"{where}: our block {ours_l.layer} ({ours_l.ids.shape[1]} positions) against transformers' "
            f"{ref_l.layer} ({ref_l.ids.shape[1]})")
        flips = [p for p in positions
                 if set(ours_l.ids[row, p].tolist()) != set(ref_l.ids[row, p].tolist())]
        for p in flips:
            at = f"layer {ref_l.layer}, {where}, position {p}"
            c_w, c_o = ref_l.choice[row, p].double(), ours_l.choice[row, p].double()
            ids_w, ids_o = sorted(ref_l.ids[row, p].tolist()), sorted(ours_l.ids[row, p].tolist())
            m_w = selection_margin(c_w, ids_w, ref_l.n_group, ref_l.topk_group)
            m_o = selection_margin(c_o, ids_o, ours_l.n_group, ours_l.topk_group)
            delta = float((c_w - c_o).abs().max())
            assert m_w >= 0, (f"{at}: transformers' experts {ids_w} are not a top-k of its router's choice values "
                              f"(margin {m_w:.3e}): the routing record does not read the router")
            assert m_w <= 2 * delta, (f"{at}: experts {ids_o} instead of transformers' {ids_w}, whose selection "
                                      f"leads by a margin {m_w:.3e} > 2 x the paths' max |choice value difference| "
                                      f"{delta:.3e}: not a routing near-tie")
            assert m_o >= 0, (f"{at}: our experts {ids_o} are not a top-k of our router's choice values "
                              f"(margin {m_o:.3e}): the routing record does not read the router")
            err = rel_err(ours_l.logits[row, p], ref_l.logits[row, p])
            assert err <= tol, (f"{at}: experts {ids_o} instead of transformers' {ids_w} at router logits that "
                                f"differ from transformers' by {err:.3e} (relative) > {tol:.3g} ({scheme}): not "
                                "rounding noise")
        if any(not ref_l.last_layer or p == ref_l.ids.shape[1] - 1 for p in flips):
            return True
    return False


def optimized_moe_step(model, cache: int, batch: int, monkeypatch):
    """`optimize_(model)` (its notes silenced) and a `DecodeStep` of `cache` positions allocated for `batch` rows, with
    the fused MoE decode path and the one-kernel router taken on the CPU too (`W8A8MoE.uses_decode_path` and
    `router_route_applies` are False there: patched True, their CPU implementations being the reference chains)."""
    import warnings

    from cutlass_w8a8.hf import DecodeStep, optimize_

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimize_(model)
    monkeypatch.setattr(cw.W8A8MoE, "uses_decode_path", lambda self, x, k: True)
    monkeypatch.setattr(cw.W8A8MoE, "router_route_applies", lambda self, x, w, logits_dtype=None: True)
    step = DecodeStep(model, cache)
    step.allocate(batch)
    return step
