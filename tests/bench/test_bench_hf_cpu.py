"""bench/bench_hf.py's whole flow on the CPU (``--tiny``): build, quantize, optimize, static-cache prefill and
decode (eager, and cutlass_w8a8.generate's graph step run eagerly, with the step it ran recorded), our reference
decoder (``--decoder``: cutlass_w8a8.models.LlamaDecoder through DecodeGraphRunner, eager on the CPU), the
correctness checks, the warm-up times, the interleaved timing loop, the reports and the file names. The GPU run is
the benchmark; this keeps the script working between GPU runs."""

import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "bench_hf.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_hf", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The "cw" graph step (cutlass_w8a8.hf.DecodeStep) computes the transformers step's logits up to bf16 rounding, not
# bit for bit: its check steps' logits against the same model's eager ones must keep this SQNR (26 dB: the relative
# error 0.05 that tests/hf/test_hf_decode_step_cpu.py allows between the two steps; the tiny model measured 31-39 dB).
CW_GRAPH_MIN_SQNR_DB = 26.0


def graph_step_takes_step_arg() -> bool:
    """Whether this cutlass_w8a8's GraphGenerator takes ``step=`` (issue 28's "cw" decode step)."""
    import inspect

    import cutlass_w8a8 as cw

    return "step" in inspect.signature(cw.hf.GraphGenerator).parameters


def test_bench_hf_tiny(tmp_path):
    bench = load_bench()
    rc = bench.main(["--tiny", "--batches", "1,2", "--reps", "2", "--steps", "2", "--check-steps", "3",
                     "--prompt-len", "8", "--max-cache-len", "16", "--out", str(tmp_path), "--dtypes",
                     "bf16,int8,fp8-block,int8-opt,fp8-block-opt", "--decoder"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["hf_decode_b1-2_cpu.json"]  # the batches in the name
    with open(tmp_path / "hf_decode_b1-2_cpu.json", encoding="utf-8") as f:
        res = json.load(f)
    models = ["bf16", "int8", "fp8-block", "int8-opt", "fp8-block-opt"]
    dec = bench.DECODER
    assert res["tiny"] and res["modes"] == ["eager", "graph"] and res["dtypes"] == models + [dec]
    assert res["failures"] == [] and not res["full_size"] and res["tag"] == "b1-2"
    for m in models[1:]:
        assert res["models"][m]["w8a8_linears"] == 2 * (4 if m.endswith("-opt") else 7)  # qkv, o, gate_up, down
        assert res["models"][m]["optimized"] == m.endswith("-opt")
    assert res["models"]["bf16"]["w8a8_linears"] == 0
    # our decoder: 2 layers of qkv, o, gate_up, down; the cache rounded up to a multiple of 16 (16 here)
    assert res["models"][dec]["w8a8_linears"] == 8 and res["models"][dec]["max_seq_len"] == 16
    assert res["models"][dec]["max_batch"] == 2 and res["models"][dec]["weight_bytes"] > 0
    takes_step = graph_step_takes_step_arg()
    assert res["graph_step_requested"] == ("auto" if takes_step else None)
    for b in ("1", "2"):
        for m in models:
            for mode in ("eager", "graph"):
                t = res["points"][b][m][mode]
                assert t["reps"] == 2 and t["steps"] == 2 and 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
                assert res["warmup"][b][m][mode]["first_token_s"] > 0
            # step="auto": the package's step for the optimized models where GraphGenerator has it, else
            # transformers' (with the reason where "auto" fell back)
            step = res["graph_step"][b][m]
            cw_step = takes_step and m.endswith("-opt")
            assert step["step"] == ("cw" if cw_step else "transformers")
            assert (step["reason"] is not None) == (takes_step and not cw_step)
            gve = res["accuracy"][b][m]["graph_vs_eager"]
            if cw_step:  # other kernels than the eager transformers step: equal up to bf16 rounding
                assert gve["worst_sqnr_db"] >= CW_GRAPH_MIN_SQNR_DB
            else:  # the graph path's steps run the eager step's calls: equal logits
                assert gve["max_abs"] == 0
        for m, floor in (("int8", 30.0), ("fp8-block", 20.0), ("int8-opt", 30.0), ("fp8-block-opt", 20.0)):
            # the tiny model measured ~36 dB (int8) and ~24 dB (block fp8)
            assert res["accuracy"][b][m]["eager_sqnr_vs_bf16_db"] > floor
        assert res["derived"][b]["eager"]["int8-opt"]["x_bf16_same_mode"] > 0
        # our decoder: a graph row only, timed with the others; on the CPU its "graph" runs the eager step
        t = res["points"][b][dec]
        assert list(t) == ["graph"] and t["graph"]["reps"] == 2 and 0 < t["graph"]["median_ms"]
        assert res["accuracy"][b][dec]["graph_vs_eager"]["max_abs"] == 0
        assert res["derived"][b]["graph"][dec]["x_bf16_same_mode"] > 0
        assert res["decoder"]["batches"][b]["graphs"] is False
    assert res["targets"] and all(t["met"] is None for t in res["targets"])  # no timing claims on the CPU
    vs_dec = res["targets_vs_decoder"]
    assert [(t["model"], t["batch"]) for t in vs_dec] == [(m, b) for b in (1, 2) for m in ("int8-opt", "fp8-block-opt")]
    for t in vs_dec:
        pt = res["points"][str(t["batch"])]
        assert t["ratio"] == pt[t["model"]]["graph"]["median_ms"] / pt[dec]["graph"]["median_ms"]
        assert t["met"] is None and t["target_max"] == 1.1
    report = (tmp_path / "hf_decode_b1-2_cpu.md").read_text(encoding="utf-8")
    assert report.startswith("# transformers LlamaForCausalLM decode: cpu\n")  # the device
    assert "not measurements" in report and "| 2 | graph | fp8-block-opt |" in report
    assert "| graph step |" in report and f"| 1 | graph | {dec} |" in report and "| 2 | eager | int8 |" in report
    assert ("| cw |" if takes_step else "| transformers |") in report
    assert "within 1.1x of our decoder's graph step" in report and "not measured here" not in report
    assert "fp8-block-opt graph (graph step " in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "hf_decode_b1-2_cpu.png").exists() and "matplotlib is not installed" in report
    else:
        assert (tmp_path / "hf_decode_b1-2_cpu.png").stat().st_size > 0

    # --recheck writes the same report (under the file's own tag) from the JSON
    again = tmp_path / "again"
    assert bench.main(["--recheck", str(tmp_path / "hf_decode_b1-2_cpu.json"), "--out", str(again)]) == 0
    rechecked = (again / "hf_decode_b1-2_cpu.md").read_text(encoding="utf-8")
    assert rechecked.split("\n## Targets")[0] == report.split("\n## Targets")[0]
    assert "within 1.1x of our decoder's graph step" in rechecked


def test_bench_hf_tiny_batch_8_alone(tmp_path):
    """One batch per call (the GPU runs do batch 1 and batch 8 apart): its own file names, its targets; a forced
    step (``--graph-step transformers``) where GraphGenerator takes ``step=``, else refused before any work."""
    bench = load_bench()
    argv = ["--tiny", "--batches", "8", "--reps", "1", "--steps", "2", "--check-steps", "3", "--prompt-len", "4",
            "--max-cache-len", "16", "--out", str(tmp_path), "--dtypes", "bf16,int8-opt", "--decoder",
            "--graph-step", "transformers"]
    if not graph_step_takes_step_arg():
        assert bench.main(argv) == 2 and not list(tmp_path.iterdir())
        argv = argv[:-2]
    assert bench.main(argv) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["hf_decode_b8_cpu.json"]
    with open(tmp_path / "hf_decode_b8_cpu.json", encoding="utf-8") as f:
        res = json.load(f)
    assert res["batches"] == [8] and list(res["points"]) == ["8"] and res["failures"] == []
    assert res["graph_step"]["8"]["int8-opt"] == {"step": "transformers", "reason": None}
    assert res["models"][bench.DECODER]["max_batch"] == 8
    report = (tmp_path / "hf_decode_b8_cpu.md").read_text(encoding="utf-8")
    assert "int8-opt graph batch 8: " in report and "(target >= 1.6x)" in report  # the graph path vs bf16 compiled
    assert "int8-opt graph (graph step transformers) batch 8: " in report  # ... and vs our decoder
    assert "batch 1:" not in report  # no batch-1 target lines in a batch-8 run


def test_bench_hf_decoder_config():
    """Our decoder's config at the benchmark's Llama-3-8B dimensions is LLAMA3_8B's (with the layers asked for)."""
    import transformers

    from cutlass_w8a8 import models

    bench = load_bench()
    for layers in (32, 2):
        assert bench.decoder_config(models, bench.llama_config(transformers, False, layers)) == \
            models.LLAMA3_8B.replace(num_layers=layers)


def test_bench_hf_graph_generator_step_arg():
    """``step=`` is passed only where GraphGenerator takes it; without it only "auto" runs (the transformers step)."""
    import functools
    import types

    bench = load_bench()

    class WithStep:
        def __init__(self, model, *, max_cache_len=None, sizes=None, step="auto"):
            self.step, self.step_reason = step, None

    class WithoutStep:
        def __init__(self, model, *, max_cache_len=None, sizes=None):
            pass

    made = bench.graph_generator(types.SimpleNamespace(hf=types.SimpleNamespace(GraphGenerator=WithStep)), "cw")
    assert isinstance(made, functools.partial) and made.keywords == {"step": "cw"}
    assert bench.graph_step_of(made(None)) == {"step": "cw", "reason": None}
    old = types.SimpleNamespace(hf=types.SimpleNamespace(GraphGenerator=WithoutStep))
    assert bench.graph_generator(old, "auto") is WithoutStep
    with pytest.raises(ValueError, match="no `step` argument"):
        bench.graph_generator(old, "transformers")
    assert bench.graph_step_of(WithoutStep(None)) == {"step": "transformers", "reason": None}


def test_bench_hf_args():
    bench = load_bench()
    args = bench.parse_args(["--quick", "--batches", "8,1,8", "--dtypes", "int8,bf16", "--no-compile"])
    assert (args.layers, args.batches, args.dtypes, args.modes) == (2, [1, 8], ["bf16", "int8"], ["eager", "graph"])
    quick = bench.parse_args(["--quick"])
    assert quick.dtypes == ["bf16", "int8", "int8-opt", "fp8-opt", "fp8-block-opt"] and (quick.reps, quick.steps) == (3, 12)
    assert bench.parse_args([]).modes == ["eager", "compiled", "graph"] and bench.parse_args([]).layers == 32
    assert len(bench.parse_args([]).dtypes) == 7
    assert bench.parse_args(["--tiny"]).modes == ["eager", "graph"]
    assert bench.parse_args(["--tiny", "--compile", "--no-graph"]).modes == ["eager", "compiled"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "int4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--max-cache-len", "40"])  # the 32-token prompt + 24 steps do not fit
    # file-name tags: the batches unless they are the default 1 and 8; --tag overrides
    assert (bench.parse_args([]).tag, bench.parse_args(["--batches", "8"]).tag) == ("", "b8")
    assert bench.parse_args(["--batches", "1"]).tag == "b1" and bench.parse_args(["--batches", "8,1"]).tag == ""
    assert bench.parse_args(["--batches", "1", "--tag", "h100-run2"]).tag == "h100-run2"
    assert (bench.results_prefix(""), bench.results_prefix("b1")) == ("hf_decode", "hf_decode_b1")
    with pytest.raises(SystemExit):
        bench.parse_args(["--tag", "a/b"])
    args = bench.parse_args(["--decoder", "--batches", "1"])
    assert args.decoder and args.graph_step == "auto" and "graph" in args.modes
    with pytest.raises(SystemExit):
        bench.parse_args(["--decoder", "--no-graph"])  # the decoder is a graph-mode row
    with pytest.raises(SystemExit):
        bench.parse_args(["--graph-step", "fast"])


def test_bench_hf_recheck(tmp_path):
    """--recheck re-evaluates the logits gates of a results file and keeps every measured value: a compiled
    SQNR below the gate becomes a failure, one above it none."""
    bench = load_bench()
    base = {"batches": [1], "modes": ["eager", "compiled"], "failures": ["batch 1 int8 compiled: RuntimeError: x"],
            "accuracy": {"1": {"bf16": {"compiled_vs_eager": {"worst_sqnr_db": 25.0, "max_abs": 0.3}},
                               "int8": {"compiled_vs_eager": {"worst_sqnr_db": 2.0, "max_abs": 1.0},
                                        "eager_sqnr_vs_bf16_db": 10.0}}}}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(base), encoding="utf-8")
    res = json.loads(path.read_text(encoding="utf-8"))
    bench.recheck(res, str(path))
    assert res["accuracy"]["1"]["bf16"]["compiled_vs_eager"]["ok"]
    assert not res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["ok"] and res["accuracy"]["1"]["int8"]["w8a8_ok"]
    assert res["failures"][0] == "batch 1 int8 compiled: RuntimeError: x"  # a raised variant stays a failure
    assert len(res["failures"]) == 2 and "compiled vs eager logits SQNR 2.0 dB" in res["failures"][1]
    assert res["accuracy"]["1"]["int8"]["compiled_vs_eager"]["worst_sqnr_db"] == 2.0 and "in.json" in res["rechecked"]


def _report_results(report, with_decoder: bool = True) -> dict:
    """A bench_hf results dict (batch 1, eager and graph) as `run` leaves it before `derive`: bf16 and int8 whose
    graph path fell back to the transformers step (one reason, shared), int8-opt on the cw step, and, with
    ``with_decoder``, our decoder's graph row."""
    dec = report.DECODER

    def pt(ms):
        return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "reps": 1, "steps": 1}

    fell_back = {"step": "transformers", "reason": "`model.model.layers.0.self_attn` (LlamaAttention) is not fused"}
    res = {
        "device": "NVIDIA Test GPU", "device_slug": "nvidia-test-gpu", "tiny": False, "full_size": True,
        "torch_version": "2.x", "cuda_version": "13.0", "transformers_version": "5.x",
        "git_commit": "0123456789abcdef0123456789abcdef01234567", "git_dirty": False,
        "config": {"name": "llama3-8b", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "rope_theta": 500000.0, "attn_implementation": "sdpa"},
        "batches": [1], "modes": ["eager", "graph"], "dtypes": ["bf16", "int8", "int8-opt"],
        "prompt_len": 32, "max_cache_len": 256, "compile": None,
        "timing": {"method": "CUDA events", "reps": 1, "steps": 1},
        "models": {m: {"weight_bytes": 2**30} for m in ("bf16", "int8", "int8-opt")},
        "points": {"1": {"bf16": {"eager": pt(50.0), "graph": pt(9.0)}, "int8": {"eager": pt(45.0), "graph": pt(6.0)},
                         "int8-opt": {"eager": pt(40.0), "graph": pt(3.6)}}},
        "accuracy": {"1": {}}, "warmup": {"1": {}},
        "graph_step_requested": "auto",
        "graph_step": {"1": {"bf16": dict(fell_back), "int8": dict(fell_back), "int8-opt": {"step": "cw", "reason": None}}},
        "decoder": None, "failures": [], "errors": {},
    }
    if with_decoder:
        res["dtypes"].append(dec)
        res["models"][dec] = {"weight_bytes": 2**30, "call": "cutlass_w8a8.models.LlamaDecoder(config, quant='int8')"}
        res["points"]["1"][dec] = {"graph": pt(3.5)}
        res["decoder"] = {"build_s": 1.0, "batches": {"1": {"graphs": True}}}
    report.derive(res)
    res["targets_vs_decoder"] = report.targets_vs_decoder(res)
    return res


def test_bench_hf_report_renders_graph_step_and_decoder(tmp_path, monkeypatch):
    """The "graph step" column, auto's fall-back notes, our decoder's row, description bullet and targets come from
    cutlass_w8a8.testing.hf_decode_report's renderer for a results dict (no GPU, no run), and bench_hf.py writes
    that report unchanged; the PNG plots the decoder's row."""
    from cutlass_w8a8.testing import hf_decode_report as report

    dec = report.DECODER
    res = _report_results(report)
    md = report.render_markdown(res)
    lines = md.splitlines()

    def row(mode, m):
        (found,) = [ln for ln in lines if ln.startswith(f"| 1 | {mode} | {m} |")]
        return found

    assert "| graphs replay after s | graph step |" in md and "|---:|:---|:---|---:|---:|---:|---:|---:|:---|" in md
    assert row("eager", "int8-opt").endswith("| – |")
    assert row("graph", "int8-opt").startswith("| 1 | graph | int8-opt | 3.600 | 2.50x |")
    assert row("graph", "int8-opt").endswith("| cw |")
    for m in ("bf16", "int8"):  # one reason: one note, numbered 1, for both rows
        assert row("graph", m).endswith("| transformers (auto fell back, note 1) |")
    assert [ln for ln in lines if ln.startswith(("1. ", "2. "))] == [
        "1. `step='auto'` chose the transformers step: `model.model.layers.0.self_attn` (LlamaAttention) is not fused"]
    assert row("graph", dec).startswith(f"| 1 | graph | {dec} | 3.500 | 2.57x |")
    assert row("graph", dec).endswith("| DecodeGraphRunner |")
    assert not [ln for ln in lines if ln.startswith(f"| 1 | eager | {dec} |")]
    # description: the graph bullet names both steps; the graph-step and decoder bullets
    (graph_bullet,) = [ln for ln in lines if ln.startswith("- graph: ")]
    assert "GraphGenerator(model, sizes=[B], step='auto')" in graph_bullet
    assert "`cutlass_w8a8.hf.DecodeStep`" in graph_bullet and "`DynamicCache`" in graph_bullet
    assert "With step `transformers`" in graph_bullet and "`StaticCache`" in graph_bullet
    assert "- graph step: the decode step the graph path captured, `GraphGenerator(..., step='auto')`" in md
    assert f"- {dec}: `cutlass_w8a8.models.LlamaDecoder(config, quant='int8')` at the same dimensions" in md
    assert md.index(f"- {dec}: ") < md.index("## Per-token latency and warm-up")
    # targets against our decoder in place of the "not measured here" line
    assert ("- int8-opt graph (graph step cw) batch 1: 3.600 ms/token = 1.03x our decoder's graph step (3.500 ms, "
            "same run) (target: graph ms/token within 1.1x of our decoder's graph step): met") in lines
    assert "not measured here" not in md and md.index("## Targets") < md.index("(graph step cw) batch 1")
    assert ", git 0123456789ab\n" in md  # a hash: its first 12 digits

    # bench_hf.py writes the renderer's report as it is (no post-processing of the Markdown)
    bench = load_bench()
    paths = bench.write(dict(res, tag="b1"), str(tmp_path))
    assert os.path.basename(paths["md"]) == "hf_decode_b1_nvidia-test-gpu.md"
    written = (tmp_path / "hf_decode_b1_nvidia-test-gpu.md").read_text(encoding="utf-8")
    assert written == report.render_markdown(json.loads((tmp_path / "hf_decode_b1_nvidia-test-gpu.json").read_text()))
    assert not hasattr(bench, "render")

    # without our decoder: no decoder row or bullet, the "not measured here" line; a non-hash commit note shown whole
    res = _report_results(report, with_decoder=False)
    assert res["targets_vs_decoder"] == []
    res["git_commit"] = "e99cc65 (stale .git of the copy)"
    md = report.render_markdown(res)
    assert dec not in md and "DecodeGraphRunner" not in md and "| cw |" in md
    assert "(not measured here)" in md and ", git e99cc65 (stale .git of the copy)\n" in md
    # a GraphGenerator without step= (older results): the transformers step only
    res["graph_step_requested"] = None
    md = report.render_markdown(res)
    assert "- graph: `cutlass_w8a8.hf.GraphGenerator(model, sizes=[B])`'s decode step (the same call" in md
    assert "DecodeStep" not in md

    # the PNG: our decoder is a bar series of the latency panel, with a bar in the graph group only
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs, close = [], plt.close
    monkeypatch.setattr(plt, "close", figs.append)
    report.plot_results(_report_results(report), str(tmp_path / "plot.png"))
    (fig,) = figs
    ax_lat = fig.axes[0]
    labels = [t.get_text() for t in ax_lat.get_legend().get_texts()]
    assert labels == ["bf16", "int8", "int8-opt", dec]
    heights = [bar.get_height() for bar in ax_lat.containers[labels.index(dec)]]
    assert heights[1] == 3.5 and heights[0] != heights[0]  # graph group: 3.5 ms; eager group: NaN (no bar)
    close(fig)


def test_bench_hf_tiny_qwen3_moe(tmp_path):
    """``--config qwen3-30b-a3b --tiny``: the whole flow on a tiny Qwen3MoeForCausalLM (experts W8A8MoE, routers
    bf16), the config's name in the file names and the title, the graph step named per row and in issue 36's target
    line; our decoder at the same (MoE) dims."""
    bench = load_bench()
    rc = bench.main(["--tiny", "--config", "qwen3-30b-a3b", "--batches", "1", "--reps", "1", "--steps", "2",
                     "--check-steps", "3", "--prompt-len", "8", "--max-cache-len", "16", "--out", str(tmp_path),
                     "--dtypes", "bf16,int8,int8-opt,fp8-block-opt", "--decoder"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["hf_decode_qwen3-30b-a3b_b1_cpu.json"]
    with open(tmp_path / "hf_decode_qwen3-30b-a3b_b1_cpu.json", encoding="utf-8") as f:
        res = json.load(f)
    assert res["config_name"] == "qwen3-30b-a3b" and res["failures"] == [] and not res["full_size"]
    assert res["config"]["model_class"] == "Qwen3MoeForCausalLM" and res["config"]["num_experts"] == 8
    assert res["layers_rule"] is None  # --tiny: 2 layers, no rule
    for m in ("int8", "int8-opt", "fp8-block-opt"):
        assert res["models"][m]["w8a8_moe"] == 2  # one per layer
        assert res["models"][m]["w8a8_linears"] == 2 * (2 if m.endswith("-opt") else 4)  # qkv, o / q, k, v, o
    assert res["models"]["bf16"]["w8a8_moe"] == 0
    takes_step = graph_step_takes_step_arg()
    for m in ("bf16", "int8", "int8-opt", "fp8-block-opt"):
        step = res["graph_step"]["1"][m]
        assert step["step"] == ("cw" if takes_step and m.endswith("-opt") else "transformers")
        gve = res["accuracy"]["1"][m]["graph_vs_eager"]
        assert gve["worst_sqnr_db"] >= CW_GRAPH_MIN_SQNR_DB if step["step"] == "cw" else gve["max_abs"] == 0
    assert res["accuracy"]["1"]["int8-opt"]["eager_sqnr_vs_bf16_db"] > 20.0  # the tiny model measured ~34 dB
    assert res["accuracy"]["1"][bench.DECODER]["graph_vs_eager"]["max_abs"] == 0
    # issue 36's target only (the Llama targets and the warm-up target are the Llama model's), the step named
    assert [(t["model"], t["mode"], t["batch"], t["target"], t["issue"]) for t in res["targets"]] == [
        ("int8-opt", "graph", 1, 2.5, "issue 36"), ("fp8-block-opt", "graph", 1, 2.5, "issue 36")]
    report = (tmp_path / "hf_decode_qwen3-30b-a3b_b1_cpu.md").read_text(encoding="utf-8")
    assert report.startswith("# transformers Qwen3MoeForCausalLM decode: cpu\n")
    assert "MLP: 8 experts of 128, top-2 renormalized" in report and "the routers stay bf16" in report
    step = "cw" if takes_step else "transformers"
    assert (f"- int8-opt graph (graph step {step}) batch 1: – over bf16 compiled (target >= 2.5x, issue 36): n/a"
            in report)
    assert "(target >= 1.6x)" not in report and "graph warm-up" not in report


def test_bench_hf_quantized_copy_leaves_bf16_alone():
    """`quantized_copy` copies only the module tree: the bf16 model's tensors and modules are unchanged after
    quantized and optimized copies; the copies hold W8A8MoE experts and the bf16 model's own routers."""
    import torch
    import transformers

    import cutlass_w8a8 as cw

    bench = load_bench()
    bf16 = bench.build_bf16(transformers, bench.qwen3_moe_config(transformers, True, 2), torch.device("cpu"), 0)
    before = {k: v.clone() for k, v in bf16.state_dict().items()}
    classes = {name: type(m) for name, m in bf16.named_modules()}
    copies = {m: bench.quantized_copy(cw, bf16, m) for m in ("int8", "int8-opt", "fp8-block-opt")}
    after = bf16.state_dict()
    assert list(after) == list(before) and all(after[k].equal(v) for k, v in before.items())
    assert {name: type(m) for name, m in bf16.named_modules()} == classes
    for m, model in copies.items():
        for i in range(2):
            block, ref = model.model.layers[i].mlp, bf16.model.layers[i].mlp
            assert isinstance(block.experts, cw.W8A8MoE) and block.gate is ref.gate  # the router: bf16, shared
            assert model.model.layers[i].self_attn is not bf16.model.layers[i].self_attn
        assert cw.hf.is_optimized(model) == m.endswith("-opt") and not cw.hf.is_optimized(bf16)


def test_bench_hf_qwen3_moe_config_and_layers():
    """The Qwen3-MoE config is `cutlass_w8a8.models.QWEN3_30B_A3B`'s dims (our decoder's config of it equals the
    owner's); `layer_bytes` counts a layer's parameters as the dims give them; `fit_layers` applies the rule."""
    import transformers

    from cutlass_w8a8 import models

    bench = load_bench()
    d = models.QWEN3_30B_A3B
    for layers in (48, 3):
        cfg = bench.qwen3_moe_config(transformers, False, layers)
        assert bench.decoder_config(models, cfg) == d.replace(num_layers=layers)
        assert (cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (128, 128, 8, True)
    H, E, I, D = d.hidden_size, d.num_experts, d.moe_intermediate_size, d.head_dim
    proj = H * (d.num_heads * D) * 2 + H * (d.num_kv_heads * D) * 2  # q, o; k, v
    matrices = proj + E * 3 * H * I  # the experts' gate, up and down
    other = E * H + 2 * H + 2 * D  # router; input / post-attention norms; q / k head norms
    fixed, per_layer = bench.layer_bytes(transformers, "qwen3-30b-a3b", 0, 1, 256, 0)
    assert per_layer == 2 * (matrices + other) and fixed == 2 * (2 * d.vocab_size * H + H)  # embedding, lm_head, norm
    kv = 2 * 2 * d.num_kv_heads * D * 8 * 256 * 2  # two caches of K and V, batch 8, 256 positions, bf16
    assert bench.layer_bytes(transformers, "qwen3-30b-a3b", 2, 8, 256, 3)[1] == per_layer + 2 * (matrices + 2 * other) + 3 * kv
    assert bench.fit_layers(100 * 2**30, 2**30, 2**30, 200) == 84  # (0.85 x 100 - 1) GiB / 1 GiB per layer
    assert bench.fit_layers(1000 * 2**30, 2**30, 2**30, 48) == 48
    with pytest.raises(ValueError, match="not one layer fits"):
        bench.fit_layers(2**30, 2**30, 2**30, 48)
    args = bench.parse_args(["--config", "qwen3-30b-a3b", "--batches", "1"])
    assert args.layers is None and args.tag == "b1"  # resolved on the GPU by fit_layers
    assert bench.parse_args(["--config", "qwen3-30b-a3b", "--quick"]).layers == 2
    assert bench.parse_args(["--config", "qwen3-30b-a3b", "--layers", "24"]).layers == 24
    assert bench.results_prefix("b1", "qwen3-30b-a3b") == "hf_decode_qwen3-30b-a3b_b1"
    assert bench.results_prefix("", "qwen3-30b-a3b") == "hf_decode_qwen3-30b-a3b"
    assert bench.results_prefix("b1", "llama3-8b") == bench.results_prefix("b1") == "hf_decode_b1"


def test_bench_hf_glm_layer_bytes_counts_an_moe_layer():
    """GLM-4.5-Air's first layer is dense (intermediate 10944) and the others MoE (128 experts of 1408 + 1 shared):
    `layer_bytes` counts an MoE layer, so the fit rule chooses fewer than the 46 layers on an H200 (139.3 GiB free), not
    all 46 of a dense layer's size (which ran out of memory there)."""
    import transformers

    from cutlass_w8a8.testing.model_dims import GLM_45_AIR

    bench = load_bench()
    d = GLM_45_AIR
    H, E, I = d["hidden_size"], d["n_routed_experts"], d["moe_intermediate_size"]
    fixed, per_layer = bench.layer_bytes(transformers, "glm-4.5-air", 0, 1, 256, 0)
    assert per_layer >= 2 * (E + 1) * 3 * H * I  # the routed and shared experts' gate, up and down in bf16
    assert fixed == 2 * (2 * d["vocab_size"] * H + H)  # embedding, lm_head, final norm
    _, per_layer_int8 = bench.layer_bytes(transformers, "glm-4.5-air", 1, 1, 256, 2)
    assert bench.fit_layers(int(139.3 * 2**30), fixed, per_layer_int8, 46) < 20


def test_bench_hf_tiny_glm45_air(tmp_path):
    """``--config glm-4.5-air --tiny``: the whole flow on a tiny Glm4MoeForCausalLM (a dense first layer, then a MoE
    layer: experts W8A8MoE, the router float32, a shared expert; q / k / v bias, partial rotary), the config's name in
    the file names and the title, the -opt models on the "cw" step, no targets (none is set for it); the dims of the
    full config are GLM-4.5-Air's, from the one owner bench/_moe_block.py shares."""
    import transformers

    from cutlass_w8a8.testing.model_dims import GLM_45_AIR

    bench = load_bench()
    full = bench.glm45_air_config(transformers, False, 46)
    assert (full.hidden_size, full.num_hidden_layers, full.num_attention_heads, full.num_key_value_heads,
            full.head_dim) == (4096, 46, 96, 8, 128)
    assert (full.n_routed_experts, full.moe_intermediate_size, full.n_shared_experts, full.num_experts_per_tok,
            full.n_group, full.topk_group, full.routed_scaling_factor) == (128, 1408, 1, 8, 1, 1, 1.0)
    assert (full.first_k_dense_replace, full.intermediate_size, full.attention_bias, full.use_qk_norm) == (
        1, 10944, True, False)
    assert full.rope_parameters["partial_rotary_factor"] == 0.5 and full.rope_parameters["rope_theta"] == 1e6
    assert bench.CONFIGS["glm-4.5-air"]["full_layers"] == GLM_45_AIR["num_hidden_layers"] == 46
    rc = bench.main(["--tiny", "--config", "glm-4.5-air", "--batches", "1", "--reps", "1", "--steps", "2",
                     "--check-steps", "3", "--prompt-len", "8", "--max-cache-len", "16", "--out", str(tmp_path),
                     "--dtypes", "bf16,int8,int8-opt,fp8-block-opt"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["hf_decode_glm-4.5-air_b1_cpu.json"]
    with open(tmp_path / "hf_decode_glm-4.5-air_b1_cpu.json", encoding="utf-8") as f:
        res = json.load(f)
    assert res["config_name"] == "glm-4.5-air" and res["failures"] == [] and not res["full_size"]
    c = res["config"]
    assert c["model_class"] == "Glm4MoeForCausalLM" and c["num_experts"] == 8 and c["first_k_dense_replace"] == 1
    assert c["partial_rotary_factor"] == 0.5 and c["head_dim"] == 32
    for m in ("int8", "int8-opt", "fp8-block-opt"):
        assert res["models"][m]["w8a8_moe"] == 1  # layer 1; layer 0 is dense
        # q, k, v, o of 2 layers, gate / up / down of the dense MLP and of the shared expert; fused: qkv, o,
        # gate_up, down
        assert res["models"][m]["w8a8_linears"] == (2 * 2 + 2 * 2 if m.endswith("-opt") else 2 * 4 + 2 * 3)
    takes_step = graph_step_takes_step_arg()
    for m in ("bf16", "int8", "int8-opt", "fp8-block-opt"):
        step = res["graph_step"]["1"][m]
        assert step["step"] == ("cw" if takes_step and m.endswith("-opt") else "transformers"), (m, step)
        gve = res["accuracy"]["1"][m]["graph_vs_eager"]
        assert gve["worst_sqnr_db"] >= CW_GRAPH_MIN_SQNR_DB if step["step"] == "cw" else gve["max_abs"] == 0
    assert res["accuracy"]["1"]["int8-opt"]["eager_sqnr_vs_bf16_db"] > 20.0
    assert res["targets"] == []
    report = (tmp_path / "hf_decode_glm-4.5-air_b1_cpu.md").read_text(encoding="utf-8")
    assert report.startswith("# transformers Glm4MoeForCausalLM decode: cpu\n")
    assert "MLP: 8 experts of 128, top-2 renormalized" in report
    assert "(MLP above: the first 1 layer(s)' dense MLP; the others' blocks also have 1 shared expert(s) of 128)" in report
