"""bench/bench_decoder.py's kernel classes: which kind of work each GPU kernel of a decode step is, the bytes
each class must move in one step, and the per-class table (measured time against the time the HBM bandwidth
allows for those bytes).

Nothing here touches the GPU: `classify_kernel` works on the kernel names torch.profiler reports (demangled
C++ names such as ``void cutlass_w8a8::(anonymous namespace)::rowwise_cluster_kernel<...>(...)``, or the flat
names of cuBLAS kernels such as ``nvjet_tst_64x8_64x16_4x1_v_bz_TNT``), and `step_class_bytes` reads the
shapes of a `cutlass_w8a8.models.LlamaDecoder` (on any device).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple, Optional

# The classes, in the order the tables show them.
CLASSES = ("gemm w8a8", "gemm bf16", "attention", "norm/act (+quant)", "quant", "rope + kv write", "moe routing", "copy",
           "other")

OTHER_NAMES_MAX = 20  # distinct names of "other" kernels kept in the results, each cut to OTHER_NAME_CHARS
OTHER_NAME_CHARS = 120
KERNELS_MAX = 16  # kernel heads kept per profiled step (summarize_kernels' by_kernel), those of the most time


class Rule(NamedTuple):
    """A kernel is of class ``cls`` when every non-empty key tuple has a key in its part of the lowercased
    name: ``head`` in the function's qualified name (before its template arguments), ``name`` and ``also`` in
    the whole name (template arguments and parameters included)."""

    cls: str
    head: tuple[str, ...] = ()
    name: tuple[str, ...] = ()
    also: tuple[str, ...] = ()


# Matched in order, most specific first; the first rule that matches decides. Every kernel of ours lives in
# namespace cutlass_w8a8, so a name containing "cutlass" says nothing by itself (the old rules counted the
# fused norms as GEMMs). The C++ kernel each rule targets (grep csrc/ for __global__):
KERNEL_RULES: tuple[Rule, ...] = (
    # CUDA runtime copies and fills: torch.profiler's "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"
    Rule("copy", head=("memcpy", "memset")),
    # csrc/attention/decode_attention.cu: the split-KV pair decode_attention_split_kernel +
    # decode_attention_combine_cluster_kernel (sm90) or decode_attention_combine_kernel (the combine also quantizes
    # for a W8A8 o_proj: decode_attention_quant), or
    # the one decode_attention_fused_kernel (a cluster per row) where it serves;
    # earlier builds: the one decode_attention_kernel
    Rule("attention", head=("decode_attention",)),
    # csrc/attention/rope_kv_cache.cu: rope_kv_cache_kernel (rotary embedding + the k/v write into the cache; with
    # Qwen3's q / k head norms applied first)
    Rule("rope + kv write", head=("rope_kv_cache",)),
    # csrc/moe/routing.cu: route_kernel (moe_route / moe_topk_softmax: scores, top-k, weights), align_kernel
    # (moe_align: the pairs sorted by expert) and unpermute_kernel (moe_unpermute: the weighted top-k sum);
    # csrc/moe/router_route.cu: router_route_kernel (moe_router_route: the router GEMM and the routing in one)
    Rule("moe routing", head=("::route_kernel", "::align_kernel", "::unpermute_kernel", "::router_route_kernel")),
    # csrc/moe/permute_quant.cu: moe_permute_quant, a row-wise kernel RowwiseOp<Permute, ...> (the gather of the
    # routed rows and their quantization for the gate/up grouped GEMM)
    Rule("quant", head=("rowwise_",), name=("permute",)),
    # csrc/quant/rowwise_reduce.cuh: rowwise_regs_kernel / rowwise_cluster_kernel / rowwise_loop_kernel, whose
    # template argument names the op: RowwiseOp<RmsNorm, T, O> (csrc/quant/rms_norm.cu: rms_norm,
    # fused_add_rms_norm, rms_norm_quant) or RowwiseOp<SiluMul, T, O> (csrc/quant/silu_mul.cu: silu_mul,
    # silu_mul_quant); earlier builds: RmsNormRow<T, O> / SiluMulRow<T, O>. (RowwiseOp<Permute, ...>, MoE's
    # moe_permute_quant, is not a norm: "quant", above.)
    Rule("norm/act (+quant)", head=("rowwise_",), name=("rmsnorm", "silumul")),
    # csrc/quant/quantize.cu: the standalone activation quantizers (quantize_per_token / quantize_per_tensor);
    # csrc/quant/quantize_group.cu: per 1 x 128 group (quantize_per_token_group, a block-scaled layer's input)
    Rule("quant", head=("per_token_regs_kernel", "per_token_loop_kernel", "per_tensor_kernel", "per_group_kernel")),
    # csrc/gemm/decode/decode_kernels.cuh: the M <= 16 GEMM and its split-K reduction
    Rule("gemm w8a8", head=("decode_gemm_kernel", "decode_reduce_kernel")),
    # csrc/gemm/decode/grouped_decode.cu (grouped_scaled_mm at T <= 64) and csrc/moe/moe_decode.cu (the MoE decode
    # path: the gate/up and down GEMMs, which at top_k >= 4 quantize x and h themselves; below, or with
    # CUTLASS_W8A8_MOE_DECODE_PREP=1, its prep kernel quantizes x)
    Rule("gemm w8a8", head=("grouped_decode_kernel", "moe_decode_gate_up_kernel", "moe_decode_down_kernel",
                            "moe_decode_down_tm_kernel")),
    Rule("quant", head=("moe_decode_prep_kernel",)),
    # csrc/gemm/sm90 (CUTLASS 3.x: cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>) and
    # csrc/gemm/sm80, sm89 (CUTLASS 2.x: cutlass::Kernel / Kernel2<cutlass::gemm::kernel::...>). cuBLAS's own
    # CUTLASS kernels are cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_...>: no "cutlass::gemm" inside,
    # so they fall through to "gemm bf16".
    Rule("gemm w8a8", head=("cutlass::device_kernel", "cutlass::kernel"), name=("cutlass::gemm",)),
    # any other kernel of ours: unclassified, so it shows among the "other" names
    Rule("other", head=("cutlass_w8a8::",)),
    # attention of other libraries: torch's SDPA (flash, memory-efficient "fmha_cutlass...", cuDNN "sdpa")
    Rule("attention", name=("fmha", "flash", "attention", "sdpa", "softmax")),
    # cuBLAS / cuBLASLt 8-bit GEMMs (torch._int_mm, torch._scaled_mm): not this model's, named so that they are
    # not counted as bf16
    Rule("gemm w8a8", name=("imma", "i8i8", "s8s8", "e4m3"), also=("gemm", "xmma", "nvjet")),
    # cuBLAS / cuBLASLt: nvjet_* (Hopper), sm90_xmma_gemm_*, cutlass::Kernel2<cutlass_80_...>, gemv*,
    # gemmSN_*, splitKreduce_kernel: the bf16 model's linears and the bf16 lm_head
    Rule("gemm bf16", name=("nvjet", "xmma", "cublas", "gemv", "gemm", "splitkreduce", "cutlass")),
)

_ANON = re.compile(r"\(anonymous( namespace)?\)")


def kernel_head(name: str) -> str:
    """The lowercased qualified function name of a kernel name: ``"void a::(anonymous namespace)::k<T>(P)"`` ->
    ``"a::anon::k"``; a flat name (``"nvjet_tst_..."``, ``"Memcpy HtoD (Pinned -> Device)"``) up to its
    first ``<`` or ``(``."""
    s = _ANON.sub("anon", name.lower()).strip()
    if s.startswith("void "):
        s = s[5:]
    cut = min((i for i in (s.find("<"), s.find("(")) if i >= 0), default=len(s))
    return s[:cut].strip()


def classify_kernel(name: str) -> str:
    """The class (one of `CLASSES`) of a GPU kernel, from its name as torch.profiler reports it: the first
    rule of `KERNEL_RULES` that matches, else "other"."""
    low = _ANON.sub("anon", name.lower())
    head = kernel_head(name)
    for rule in KERNEL_RULES:
        if rule.head and not any(k in head for k in rule.head):
            continue
        if rule.name and not any(k in low for k in rule.name):
            continue
        if rule.also and not any(k in low for k in rule.also):
            continue
        return rule.cls
    return "other"


def summarize_kernels(events: Iterable[tuple[str, float]]) -> dict[str, Any]:
    """Group ``(kernel name, duration in microseconds)`` pairs by class.

    Returns ``{"kernels": count, "busy_ms": sum of durations (ms), "by_class": {class: {"count", "ms"}}
    (classes with no kernel left out), "other_names": the distinct names classed "other" (at most
    `OTHER_NAMES_MAX`, sorted, each cut to `OTHER_NAME_CHARS` characters, so a misclassification shows),
    "by_kernel": {kernel_head(name): {"class", "count", "ms"}}}`` (the `KERNELS_MAX` heads of the most time, in
    decreasing time, ties by head (times rounded to 1e-9 ms): where a class's time goes, e.g. the decode GEMM
    against the MoE decode path's kernels)."""
    by_class: dict[str, dict[str, float]] = {}
    by_kernel: dict[str, dict[str, Any]] = {}
    others: set[str] = set()
    count, busy = 0, 0.0
    for name, us in events:
        cls = classify_kernel(name)
        entry = by_class.setdefault(cls, {"count": 0, "ms": 0.0})
        entry["count"] += 1
        entry["ms"] += us / 1e3
        kernel = by_kernel.setdefault(kernel_head(name), {"class": cls, "count": 0, "ms": 0.0})
        kernel["count"] += 1
        kernel["ms"] += us / 1e3
        count += 1
        busy += us / 1e3
        if cls == "other":
            others.add(name[:OTHER_NAME_CHARS])
    top = sorted(by_kernel.items(), key=lambda kv: (-round(kv[1]["ms"], 9), kv[0]))[:KERNELS_MAX]
    return {"kernels": count, "busy_ms": busy, "by_class": by_class,
            "other_names": sorted(others)[:OTHER_NAMES_MAX], "by_kernel": dict(top)}


# ----------------------------------------------------------------------------------------------------
# bytes each class must move in one step

CLASS_BYTES_NOTES = (
    ("gemm w8a8", "every 8-bit weight with its float32 scales (the 8-bit lm_head included when quantized) + per "
                  "GEMM the rows' 8-bit input with its float32 scales (one per row; one per 1x128 group for a "
                  "block-scaled layer) and their output in the model dtype"),
    ("gemm bf16", "the weights of the float nn.Linear layers (the bf16 lm_head; every linear of the bf16 model) + "
                  "per GEMM the rows' input and output in the model dtype"),
    ("attention", "the KV-cache positions read (as in the HBM-limited step time) + per layer the rows' query "
                  "heads and their output (8-bit with a row scale when o_proj is a per-token W8A8 layer: the "
                  "quantization folded into attention; else, a block-scaled o_proj included, the model dtype)"),
    ("norm/act (+quant)", "per RMSNorm its weight, the rows in (x, and the residual stream when there is one) "
                          "and out (the stream, and y: 8-bit with its scales when its consumer is W8A8: one per "
                          "row, or one per 1x128 group for a block-scaled layer); per SiLU*mul the rows' gate and "
                          "up in, the product out (8-bit likewise)"),
    ("quant", "per standalone quantization kernel that ran: the rows of o_proj's input (num_heads * head_dim) "
              "in the model dtype, out in 8 bits with o_proj's scales (per row, or per 1x128 group: a "
              "block-scaled o_proj quantizes attention's output itself)"),
    ("rope + kv write", "per layer the rows' q, k, v heads in, the rotated q and k heads out, k and v into the "
                        "cache, and the rows' (cos, sin) float32 table entries"),
    ("moe routing", "not counted (MoE steps: the class table has counts and times only)"),
    ("copy", "not counted (the step's host-to-device input copy)"),
    ("other", "the rows' embedding vectors and rotary-table rows, each read and written once"),
)


def _parts(weights: int = 0, kv: int = 0, activations: int = 0) -> dict[str, int]:
    return {"weights": weights, "kv": kv, "activations": activations, "total": weights + kv + activations}


def step_class_bytes(model: Any, rows: int, kv_positions: int, kv_bytes_per_position: int,
                     quant_kernels: int = 0) -> dict[str, Optional[dict[str, int]]]:
    """Bytes each kernel class must move in one decode step of ``rows`` rows (the bucket's, padded rows
    included), each byte once: a floor, counted as `CLASS_BYTES_NOTES` says.

    Parameters
    ----------
    model : cutlass_w8a8.models.LlamaDecoder
        Read for its modules' shapes and dtypes only (``W8A8Linear`` / ``nn.Linear`` projections, RMSNorms).
    rows : int
        Rows the step's kernels run.
    kv_positions, kv_bytes_per_position : int
        Cache positions the attention reads (per layer; see bench_decoder's ``kv_tokens_read``) and the bytes
        of one position over all layers (keys and values).
    quant_kernels : int
        Standalone quantization kernels that ran in the step (from its profile).

    Returns
    -------
    dict
        ``{class: {"weights", "kv", "activations", "total"} (bytes)}`` for every class of `CLASSES`; None for
        "copy". The weights of "gemm w8a8", "gemm bf16" and "norm/act (+quant)" add up to
        ``model.weight_nbytes(include_embedding=False)``.
    """
    from torch import nn

    from cutlass_w8a8.linear import W8A8Linear

    cfg = model.config
    e = model.embed_tokens.weight.element_size()  # the model dtype (activations, cache)
    hidden, heads, kvh, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def nbytes(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    def scale_bytes(width: int, consumer) -> int:  # float32 activation scales of one row for a W8A8 consumer
        return 4 * (width // 128) if getattr(consumer, "group_size", 0) else 4

    def out_bytes(width: int, consumer) -> int:  # a row-wise output for `consumer`: 8-bit + its scales, or float
        return rows * (width + scale_bytes(width, consumer)) if isinstance(consumer, W8A8Linear) else rows * width * e

    def attention_out(o_proj) -> int:  # quantized inside attention only for a per-token / per-tensor o_proj
        return out_bytes(heads * d, o_proj) if not getattr(o_proj, "group_size", 0) else rows * heads * d * e

    w8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    fl = [m for m in model.modules() if isinstance(m, nn.Linear)]
    gemm_w8a8 = _parts(
        weights=sum(nbytes(m.weight) + nbytes(m.weight_scale) + nbytes(m.input_scale) + nbytes(m.bias) for m in w8),
        activations=sum(rows * (m.in_features + scale_bytes(m.in_features, m)) + rows * m.out_features * e
                        for m in w8))
    gemm_bf16 = _parts(weights=sum(nbytes(m.weight) + nbytes(m.bias) for m in fl),
                       activations=sum(rows * (m.in_features + m.out_features) * e for m in fl))

    layers = list(model.layers)
    o_projs = [layer.self_attn.o_proj for layer in layers]
    attention = _parts(kv=kv_positions * kv_bytes_per_position,
                       activations=sum(rows * heads * d * e + attention_out(o) for o in o_projs))

    norm_w, norm_a = 0, 0
    norms = []
    for i, layer in enumerate(layers):
        norms.append((layer.input_layernorm, layer.self_attn.qkv_proj, i > 0))  # layer 0: no residual yet
        norms.append((layer.post_attention_layernorm, layer.mlp.gate_up_proj, True))
    norms.append((model.norm, model.lm_head, True))
    for norm, consumer, has_residual in norms:
        norm_w += nbytes(norm.weight)
        # in: x (+ the residual stream); out: the updated stream (+) and y
        norm_a += rows * hidden * e * (3 if has_residual else 1) + out_bytes(hidden, consumer)
    inter = cfg.intermediate_size
    for layer in layers:
        norm_a += rows * 2 * inter * e + out_bytes(inter, layer.mlp.down_proj)
    norm_act = _parts(weights=norm_w, activations=norm_a)

    # the standalone quantization kernels that ran quantize o_proj's input (a block-scaled o_proj's, per group)
    o_scale = scale_bytes(heads * d, o_projs[0]) if o_projs else 4
    quant = _parts(activations=quant_kernels * rows * (heads * d * e + heads * d + o_scale))
    rope = _parts(activations=len(layers) * rows * ((heads + 2 * kvh) * d * e + (heads + kvh) * d * e
                                                    + 2 * kvh * d * e + d * 4))
    other = _parts(activations=rows * hidden * e * 2 + rows * d * 4 * 2)
    return {"gemm w8a8": gemm_w8a8, "gemm bf16": gemm_bf16, "attention": attention, "norm/act (+quant)": norm_act,
            "quant": quant, "rope + kv write": rope, "moe routing": None, "copy": None, "other": other}


def class_table(profile: dict[str, Any], class_bytes: Optional[dict[str, Optional[dict[str, int]]]],
                hbm_gbps: Optional[float]) -> dict[str, dict[str, Any]]:
    """Per class of `CLASSES`: ``count`` and measured ``ms`` (sum of kernel durations, from `summarize_kernels`),
    ``bytes`` it must move (`step_class_bytes`' total, None where not counted), ``allowed_ms`` = bytes / the
    HBM bandwidth (``hbm_gbps`` GB/s, 1 GB = 1e9 B; None without one) and ``ratio`` = ms / allowed_ms (None
    where either is missing or zero). A ``"total"`` entry sums them over the classes with bytes.

    ``class_bytes`` None (a MoE model: `step_class_bytes` models the dense layers only): counts and times only, every
    ``bytes`` / ``allowed_ms`` / ``ratio`` None, the total's too."""
    table: dict[str, dict[str, Any]] = {}
    by_class = profile.get("by_class", {})
    counted = class_bytes is not None
    class_bytes = class_bytes or {}
    tot_count, tot_ms, tot_bytes = 0, 0.0, 0
    for cls in CLASSES:
        entry = by_class.get(cls, {"count": 0, "ms": 0.0})
        parts = class_bytes.get(cls)
        nbytes = parts["total"] if parts is not None else None
        allowed = nbytes / (hbm_gbps * 1e9) * 1e3 if nbytes is not None and hbm_gbps else None
        ratio = entry["ms"] / allowed if allowed else None
        table[cls] = {"count": entry["count"], "ms": entry["ms"], "bytes": nbytes, "allowed_ms": allowed,
                      "ratio": ratio}
        tot_count += entry["count"]
        tot_ms += entry["ms"]
        tot_bytes += nbytes or 0
    if not counted:
        tot_bytes = None
    allowed = tot_bytes / (hbm_gbps * 1e9) * 1e3 if hbm_gbps and tot_bytes is not None else None
    table["total"] = {"count": tot_count, "ms": tot_ms, "bytes": tot_bytes, "allowed_ms": allowed,
                      "ratio": tot_ms / allowed if allowed else None}
    return table
