"""bench/bench_decoder.py's reports: the models and modes it compares and its targets at batch 1, the Markdown
tables (latency, bandwidth, HBM bound, capture, kernels), `render_markdown` of a results dict and
`plot_results` (needs matplotlib).
"""

from __future__ import annotations

from typing import Any, Optional

MODELS = ("bf16", "int8", "fp8")
MODES = ("eager", "graph")
# Targets at batch 1 (Llama-3-8B dimensions, all layers): int8 graph over bf16 graph, W8A8 graph over eager.
TARGET_INT8_OVER_BF16 = 1.7
TARGET_GRAPH_OVER_EAGER = 1.5


def _fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _mib(n: Optional[int]) -> str:
    return "–" if n is None else f"{n / 2**20:.0f}"


def latency_table(results: dict[str, Any]) -> str:
    """Markdown: per-token latency (ms per step) of every model and mode, and the speedups, per batch."""
    models = [m for m in MODELS if m in results["models"]]
    cols = [(m, mode) for m in models for mode in MODES]
    speed = [("int8 graph / bf16 graph", "int8_graph_x_bf16_graph"), ("int8 graph / eager", "int8_graph_x_int8_eager"),
             ("fp8 graph / bf16 graph", "fp8_graph_x_bf16_graph"), ("fp8 graph / eager", "fp8_graph_x_fp8_eager"),
             ("bf16 graph / eager", "bf16_graph_x_bf16_eager")]
    speed = [(label, key) for label, key in speed if key.split("_")[0] in models]
    head = "| batch | " + " | ".join(f"{m} {mode} ms" for m, mode in cols) + " | " + " | ".join(
        f"{label} (x)" for label, _ in speed) + " |"
    rows = [head, "|---:|" + "---:|" * (len(cols) + len(speed))]
    for b in results["batches"]:
        cells = [_fmt(results["models"][m]["batches"][str(b)][mode]["median_ms"], ".3f") for m, mode in cols]
        cells += [_fmt(results["derived"][str(b)].get(key), ".2f") for _, key in speed]
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def bandwidth_table(results: dict[str, Any]) -> str:
    """Markdown: weight bytes per step and the weight-read bandwidth of the graph steps."""
    models = [m for m in MODELS if m in results["models"]]
    rows = ["| batch | " + " | ".join(f"{m} graph GB/s (of copy)" for m in models) + " |",
            "|---:|" + "---:|" * len(models)]
    for b in results["batches"]:
        d = results["derived"][str(b)]
        rows.append(f"| {b} | " + " | ".join(
            f"{_fmt(d.get(f'{m}_graph_weight_GBps'), '.0f')} ({_fmt(d.get(f'{m}_graph_weight_GBps_over_copy'), '.2f')})"
            for m in models) + " |")
    return "\n".join(rows)


def hbm_table(results: dict[str, Any]) -> str:
    """Markdown: bytes a step must read, the HBM-limited step time and measured / limit, per batch and model."""
    models = [m for m in MODELS if m in results["models"]]
    rows = ["| batch | " + " | ".join(f"{m} GB read | {m} limit ms | {m} graph / limit | {m} eager / limit"
                                      for m in models) + " |",
            "|---:|" + "---:|" * (4 * len(models))]
    for b in results["batches"]:
        d = results["derived"][str(b)]
        cells = []
        for m in models:
            point = results["models"][m]["batches"][str(b)]
            nbytes = point.get("bytes_read")
            cells += [_fmt(nbytes / 1e9 if nbytes is not None else None, ".3f"), _fmt(point.get("hbm_limit_ms"), ".3f"),
                      _fmt(d.get(f"{m}_graph_over_hbm_limit"), ".2f"), _fmt(d.get(f"{m}_eager_over_hbm_limit"), ".2f")]
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def capture_table(results: dict[str, Any]) -> str:
    rows = ["| model | weights GiB | KV cache GiB | graphs | capture s | pool MiB | reserved +MiB "
            "| logits SQNR vs bf16 dB |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODELS:
        r = results["models"].get(m)
        if r is None:
            continue
        c = r["capture"]
        sq = r.get("logits_vs_bf16", {}).get("sqnr_db")
        rows.append(f"| {m} | {r['weight_bytes'] / 2**30:.2f} | {r['cache_bytes'] / 2**30:.2f} | {len(c['sizes'])} "
                    f"| {c['seconds']:.2f} | {_mib(c['pool_bytes'])} | {_mib(c['reserved_delta_bytes'])} "
                    f"| {_fmt(sq, '.1f')} |")
    return "\n".join(rows)


def kernel_table(results: dict[str, Any]) -> str:
    """Markdown: the kernels of one batch-1 step (profiled), by kind: count and busy milliseconds."""
    kinds = ("gemm", "quant", "norm/act/rope", "attention", "copy", "other")
    rows = ["| model | mode | step ms | kernels | busy ms | " + " | ".join(f"{k} n / ms" for k in kinds) + " |",
            "|:---|:---|---:|---:|---:|" + "---:|" * len(kinds)]
    for m in MODELS:
        r = results["models"].get(m)
        if r is None or "1" not in r["batches"]:
            continue
        point = r["batches"]["1"]
        for mode in MODES:
            prof = point.get(f"{mode}_kernels") or {}
            if "error" in prof or not prof:
                rows.append(f"| {m} | {mode} | {point[mode]['median_ms']:.3f} | – | – | "
                            + " | ".join("–" for _ in kinds) + " |")
                continue
            cells = []
            for k in kinds:
                e = prof["by_kind"].get(k)
                cells.append(f"{e['count']} / {e['ms']:.3f}" if e else "0")
            rows.append(f"| {m} | {mode} | {point[mode]['median_ms']:.3f} | {prof['kernels']} "
                        f"| {prof['busy_ms']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(results: dict[str, Any]) -> str:
    commit = results.get("git_commit")
    commit_text = f"git {commit[:12]}{' (dirty)' if results.get('git_dirty') else ''}" if commit else "git: n/a"
    c = results["config"]
    t = results["targets"]
    lines = [
        f"# Decoder benchmark: {results['device']}",
        "",
        f"- torch {results['torch_version']} (CUDA {results['cuda_version']}), {commit_text}",
        f"- {c['name']} dimensions, {c['num_layers']} layers: hidden {c['hidden_size']}, MLP {c['intermediate_size']}, "
        f"heads {c['num_heads']}/{c['num_kv_heads']} x {c['head_dim']}, vocab {c['vocab_size']}; random weights",
        f"- KV cache {results['max_seq']} tokens (attention reads all of it every step); lm_head "
        f"{'W8A8' if results['quant_lm_head'] else 'bf16'} in the W8A8 models; embedding bf16",
        f"- per-token latency = median of {results['timing']['steps']} steps timed by CUDA events around each "
        "step (host launches included), host inputs through pinned buffers",
        f"- device copy bandwidth {results['copy_GBps']:.0f} GB/s (bytes read + written)",
        "",
        "## Per-token latency",
        "",
        latency_table(results),
        "",
        "## Weight-read bandwidth of the graph steps",
        "",
        bandwidth_table(results),
        "",
        "## HBM-limited step time",
        "",
        f"- {results.get('hbm_note') or 'no HBM bandwidth recorded'}. Bytes read per step: every weight but the "
        "embedding (lm_head included) + the KV cache the step's attention reads, "
        f"{next((m.get('kv_read') for m in results['models'].values() if m.get('kv_read')), '?')}, at the "
        f"benchmark's positions ({results['max_seq'] // 2}), for the rows of the step's bucket, each byte once "
        "(1 GB = 1e9 B); limit = bytes / bandwidth; measured / limit >= 1.",
        "",
        hbm_table(results),
        "",
        "## Kernels of one step at batch 1 (torch.profiler; busy = sum of kernel durations)",
        "",
        kernel_table(results),
        "",
        "## Capture, memory, accuracy",
        "",
        capture_table(results),
        "",
        "## Targets (batch 1)",
        "",
    ]
    if "int8_graph_x_bf16_graph" in t:
        def verdict(met):
            return "n/a" if met is None else ("met" if met else "NOT met")
        lines += [
            f"- int8 graph vs bf16 graph: {_fmt(t['int8_graph_x_bf16_graph'], '.2f')}x "
            f"(target >= {t['int8_graph_x_bf16_graph_target']}): {verdict(t['int8_graph_x_bf16_graph_met'])}; "
            f"ratio of weight bytes read per step: {_fmt(t['weight_bytes_bf16_over_int8'], '.2f')}x",
            f"- W8A8 (int8) graph vs eager: {_fmt(t['w8a8_graph_x_eager'], '.2f')}x "
            f"(target >= {t['w8a8_graph_x_eager_target']}): {verdict(t['w8a8_graph_x_eager_met'])}",
        ]
    else:
        lines.append("- batch 1 not measured")
    if results["errors"]:
        lines += ["", "## Models that did not run", ""]
        lines += [f"- `{m}`: `{msg}`" for m, msg in results["errors"].items()]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, Any], path: str) -> None:
    """PNG: per-token latency against batch (one line per model and mode), and the speedups with targets."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax_lat, ax_x) = plt.subplots(1, 2, figsize=(13, 5))
    batches = results["batches"]
    for m in MODELS:
        r = results["models"].get(m)
        if r is None:
            continue
        for mode, style in (("eager", "--"), ("graph", "-")):
            ys = [r["batches"][str(b)][mode]["median_ms"] for b in batches]
            ax_lat.plot(batches, ys, style, marker="o", markersize=4, label=f"{m} {mode}")
    ax_lat.set_ylabel("ms per step (= per token of each sequence)")
    ax_lat.set_title("Per-token decode latency")
    for key, label in (("int8_graph_x_bf16_graph", "int8 graph / bf16 graph"),
                       ("int8_graph_x_int8_eager", "int8 graph / int8 eager"),
                       ("fp8_graph_x_bf16_graph", "fp8 graph / bf16 graph"),
                       ("bf16_graph_x_bf16_eager", "bf16 graph / bf16 eager")):
        xy = [(b, results["derived"][str(b)].get(key)) for b in batches]
        xy = [(b, y) for b, y in xy if y is not None]
        if xy:
            ax_x.plot(*zip(*xy), marker="o", markersize=4, label=label)
    for y, label in ((TARGET_INT8_OVER_BF16, "target int8/bf16 (batch 1)"),
                     (TARGET_GRAPH_OVER_EAGER, "target graph/eager (batch 1)")):
        ax_x.axhline(y, color="gray", linestyle=":", linewidth=1)
        ax_x.annotate(label, xy=(0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8, color="gray")
    ax_x.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax_x.set_ylabel("speedup (x)")
    ax_x.set_title("Speedups")
    for ax in (ax_lat, ax_x):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("batch (sequences)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    c = results["config"]
    fig.suptitle(f"{c['name']} x {c['num_layers']} layers, {results['device']}, torch {results['torch_version']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

