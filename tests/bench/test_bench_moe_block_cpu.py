"""bench/bench_moe.py's block part (issue 35: the whole MoE block with its routing and shared expert, at DeepSeek-V3 and
GLM-4.5-Air dims) on the CPU: the models' dims against transformers' config classes, our block built from
transformers' (the two shared-expert placements sharing the routed experts' 8-bit weights, the shared expert's
quantization, outputs against the bf16 block), the derived numbers, the targets and the report from a synthetic
results dict, and the measuring flow end to end at tiny DeepSeek-like and GLM-like dims on the ops' CPU references
(the timers faked). The benchmark itself needs a GPU; this keeps its pieces honest between GPU runs."""

import time
from types import SimpleNamespace

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.testing import timers

from _bench_cpu import FakeEvent, loaded_benches

#: bench/bench_moe.py and the siblings it imports by name, in import order (as tests/bench/test_bench_moe_cpu.py)
MODULES = ("_moe_common", "_moe_configs", "_moe_block", "_moe_decode", "_moe_report", "bench_moe")

needs_moe = pytest.mark.skipif(not hasattr(cw, "moe_route"), reason="no moe_route (issue 35) in this tree")


@pytest.fixture(scope="module")
def mods():
    with loaded_benches(*MODULES) as loaded:
        yield SimpleNamespace(block=loaded["_moe_block"], report=loaded["_moe_report"], main=loaded["bench_moe"])


def _tiny(block):
    """DeepSeek-like (groups 4 / top 2 of 16 experts, scaling 2.5) and GLM-like (one group, scaling 1.0) blocks with
    the same transformers classes, dims multiples of 128 (block fp8)."""
    return {"deepseek-v3": block.BlockModel("DeepseekV3Config", "deepseek_v3", "DeepseekV3MoE", 16, 4, 256, 128, 4, 2,
                                            2.5, 1),
            "glm-4.5-air": block.BlockModel("Glm4MoeConfig", "glm4_moe", "Glm4MoeMoE", 8, 2, 128, 128, 1, 1, 1.0, 1)}


def test_block_models_are_the_config_defaults(mods):
    """The dims of the block part are transformers' DeepseekV3Config / Glm4MoeConfig defaults (DeepSeek-V3's and
    GLM-4.5-Air's), and the issue's numbers."""
    transformers = pytest.importorskip("transformers")
    spec = mods.block.BLOCK_MODELS
    ds, glm = spec["deepseek-v3"], spec["glm-4.5-air"]
    assert (ds.experts, ds.top_k, ds.intermediate, ds.hidden, ds.shared) == (256, 8, 2048, 7168, 1)
    assert (ds.n_group, ds.topk_group, ds.scaling) == (8, 4, 2.5)
    assert (glm.experts, glm.top_k, glm.intermediate, glm.hidden, glm.shared) == (128, 8, 1408, 4096, 1)
    assert (glm.n_group, glm.topk_group, glm.scaling) == (1, 1, 1.0)
    for name, s in spec.items():
        c = getattr(transformers, s.config)()
        assert (s.experts, s.top_k, s.hidden, s.intermediate, s.n_group, s.topk_group, s.scaling, s.shared,
                s.renormalize) == (c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                                   c.n_group, c.topk_group, c.routed_scaling_factor, c.n_shared_experts,
                                   c.norm_topk_prob), name


@needs_moe
@pytest.mark.parametrize("model", ["deepseek-v3", "glm-4.5-air"])
def test_ours_built_from_transformers_block(mods, model):
    """transformers' block: bf16 experts and shared expert, float32 router holding bf16 values, a non-zero bias. Ours,
    per scheme: both placements share the routed layer (its routing: the router's own bias tensor) and its experts'
    storage with the first E experts of the fused layer; expert E of the fused layer is the shared expert's
    [gate; up] / down quantized as the package quantizes an expert; our routing equals transformers' router's (ids
    as sets, weights to float32 rounding); both placements agree with each other and with the bf16 block within the
    experts layer's bound."""
    pytest.importorskip("transformers")
    b = mods.block
    spec = _tiny(b)[model]
    gen = torch.Generator().manual_seed(3)
    hf = b.hf_block(spec, "cpu", gen)
    assert hf.experts.gate_up_proj.dtype == torch.bfloat16
    assert hf.shared_experts.down_proj.weight.dtype == torch.bfloat16
    gw = hf.gate.weight
    assert gw.dtype == torch.float32 and torch.equal(gw, gw.to(torch.bfloat16).float())
    bias = hf.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bool(bias.abs().max() > 0)
    x = torch.randn(7, spec.hidden, generator=gen).to(torch.bfloat16)
    ref = hf(x).float()
    _, w_ref, ids_ref = hf.gate(x)
    sh = hf.shared_experts
    for scheme in b.SCHEMES:
        cfg = b.scheme_config(cw, scheme)
        built = b.build_ours(cw, hf, spec, scheme)
        sep, fused = built[f"ours_{scheme}"], built[f"ours_{scheme}_fused"]
        assert fused.routed is sep.routed and fused.shared is None and sep.fused is None
        assert sep.routed.correction_bias is hf.gate.e_score_correction_bias and sep.routed.scoring == "sigmoid"
        assert (sep.routed.n_group, sep.routed.topk_group, sep.routed.scaling_factor) == (spec.n_group,
                                                                                          spec.topk_group, spec.scaling)
        assert fused.fused.num_experts == spec.experts + 1
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            assert getattr(sep.routed, name).data_ptr() == getattr(fused.fused, name).data_ptr()
            assert getattr(sep.routed, name).shape[0] == spec.experts
        q, s = cw.moe.quantize_expert_weights(torch.cat([sh.gate_proj.weight, sh.up_proj.weight])[None], cfg.dtype,
                                              cfg.weight_block_size)
        assert torch.equal(fused.fused.w13[spec.experts:].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(fused.fused.w13_scale[spec.experts:], s)
        assert torch.equal(sep.shared.gate_up.weight.view(torch.uint8), q[0].view(torch.uint8))
        w, ids = sep.routing(x)
        order, order_ref = ids.long().argsort(1), ids_ref.argsort(1)
        assert torch.equal(ids.long().gather(1, order), ids_ref.gather(1, order_ref))
        torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=0)
        out_sep, out_fused = sep(x), fused(x)
        assert out_sep.dtype == out_fused.dtype == torch.bfloat16 and out_sep.shape == x.shape
        for out in (out_sep, out_fused):
            assert mods.main.rel_err(out, ref) < mods.main.BLOCK_REL_TOL
        # the two placements run the same quantized products and differ in how the sum is rounded: separate rounds the
        # routed sum and the shared output to bf16 and adds them in bf16, fused sums in float32 and rounds once; two
        # bf16 roundings at most, 2 * 2^-8
        assert mods.main.rel_err(out_fused, out_sep) < 2 ** -7


def _block_points(block):
    pts = []
    for t in (1, 4096):
        tm = {"hf_block": 400e-3 if t == 1 else 9.0, **{m: (150e-3 if t == 1 else 5.0) for m in block.OURS_BLOCK}}
        tm["ours_block_fused"] = 140e-3 if t == 1 else 5.5
        pts.append({"model": "deepseek-v3", "T": t, "time_ms": tm, "errors": {}, "experts_hit_mean": 64.0,
                    "rel_err_vs_hf_bf16": {m: 0.05 for m in block.OURS_BLOCK},
                    "routing_check": {"mismatch_fraction": 0.0}, "eager_ms": {"hf_block": 1.0},
                    "eager_host_ms": {"hf_block": 0.9},
                    "active_weight_bytes_mean": {"hf_block": 9 * 88e6, **{m: 9 * 44e6 for m in block.OURS_BLOCK}}})
    return pts


def test_block_derive_targets_and_report(mods, tmp_path):
    """The speedups over transformers' block, the shared-expert placement per scheme, the read fraction at T <= 16,
    issue 35's items for both placements, the report's block section and figure; a block-only run has no gemm or
    layer items."""
    r = mods.report
    res = {"device": "NVIDIA H200", "read_GBps_max": 4000.0, "gemm_points": [], "layer_points": [],
           "block_points": _block_points(mods.block), "block_routing": "cutlass_w8a8.ops.moe.moe_route",
           "block_errors": {"glm-4.5-air ours_block": "RuntimeError: x"}, "timing": {"method": "x"},
           "block_models": {"deepseek-v3": {"block": "DeepseekV3MoE", "experts": 256, "intermediate": 2048,
                                            "hidden": 7168, "top_k": 8, "n_group": 8, "topk_group": 4, "scaling": 2.5,
                                            "shared": 1, "weight_bytes": {"hf_block": 22.5e9, "ours_block": 11.3e9}}}}
    r.derive(res, timers.geomean)
    d1, d4 = (p["derived"] for p in res["block_points"])
    assert d1["ours_block_x_hf_block"] == pytest.approx(400 / 150)
    assert d1["ours_block_fused_x_hf_block"] == pytest.approx(400 / 140)
    assert d1["block_separate_over_fused"] == pytest.approx(150 / 140) and d1["block_shared_faster"] == "fused"
    assert d4["block_shared_faster"] == "separate" and d4["best_block_x_hf_block"] == pytest.approx(9 / 5)
    assert d1["int8_shared_faster"] == "separate"  # equal times: the fused one is not faster
    assert d1["ours_block_read_fraction"] == pytest.approx(9 * 44e6 / 150e-6 / 1e9 / 4000)
    assert "ours_block_read_fraction" not in d4  # T > 16
    items = {it["key"]: it for it in res["targets"]["items"]}
    assert set(items) == {"block_ours_block_T1", "block_ours_block_fused_T1", "block_ours_block_T4096",
                          "block_ours_block_fused_T4096"}
    assert items["block_ours_block_T1"]["met"] is True and items["block_ours_block_T1"]["bound"] == 2.5
    assert items["block_ours_block_T4096"]["value"] == pytest.approx(1.8) and items["block_ours_block_T4096"]["met"]
    assert items["block_ours_block_fused_T4096"]["met"] is True  # 9 / 5.5 = 1.64 >= 1.5
    md = r.render_markdown(res)
    assert "## MoE block, routing and shared expert included (issue 35)" in md
    assert "cutlass_w8a8.ops.moe.moe_route" in md
    assert "| deepseek-v3 | 1 | 1.00 (separate) | 1.00 (separate) | 1.07 (fused) |" in md
    assert "- deepseek-v3 block: the shared expert is faster fused at T = 1; separate at T = 4096" in md
    assert "glm-4.5-air ours_block: RuntimeError: x" in md and "hf_block 22.5 GB" in md
    assert "## Grouped GEMM" not in md
    pytest.importorskip("matplotlib")
    r.plot_results(res, str(tmp_path / "moe.png"))
    assert (tmp_path / "moe.png").stat().st_size > 0


def test_block_read_fraction_beyond_the_read_rate_is_invalid(mods):
    """Ours streaming the hit experts' weights faster than the run's read rate: the T = 1 speedup is INVALID, never
    met."""
    res = {"read_GBps_max": 1000.0, "gemm_points": [], "layer_points": [], "block_points": _block_points(mods.block)}
    mods.report.derive(res, timers.geomean)
    items = {it["key"]: it for it in res["targets"]["items"]}
    it = items["block_ours_block_T1"]
    assert it["met"] is None and "ours_block deepseek-v3 T=1 read fraction = 2.64" in it["invalid"]
    assert items["block_ours_block_T4096"]["invalid"] is None


def _fake_timers():
    def interleaved(cases, replay_ms, replays, on_error=None):
        out = {}
        for name, (fn, sets) in cases.items():
            t0 = time.perf_counter()
            for s in sets:
                fn(*s)
            ms = (time.perf_counter() - t0) * 1e3 / len(sets)
            out[name] = timers.GpuTiming(ms, ms, ms, len(sets), len(sets), replays)
        return out

    return SimpleNamespace(bench_gpu_time_interleaved=interleaved, rotation_count=timers.rotation_count,
                           l2_cache_bytes=lambda: 1, read_bandwidth_gbps=lambda: 3000.0, geomean=timers.geomean)


@needs_moe
def test_block_flow_on_cpu(mods, monkeypatch):
    """`run` with ``--parts block`` at tiny DeepSeek-like and GLM-like dims on the CPU references: every point checks
    the routing against transformers' router (no token differs) and every ours against the bf16 block, times
    transformers' block and the six ours, eager-times the block ones at T = 1; the targets and the report come out.
    ``--block-schemes block`` builds and times that scheme only."""
    pytest.importorskip("transformers")
    b, main = mods.block, mods.main
    monkeypatch.setattr(main, "DEVICE", "cpu")
    monkeypatch.setattr(b, "BLOCK_MODELS", _tiny(b))
    monkeypatch.setattr(b, "BLOCK_SETS", 2)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(main, "provenance", lambda device, root: {"device": device, "git_commit": None})
    args = main.parse_args(["--parts", "block", "--models", "deepseek-v3,glm-4.5-air", "--block-tokens", "1,5",
                            "--replays", "1", "--eager-max-t", "1", "--eager-steps", "1"])
    res = main.run(args, cw, _fake_timers())
    assert res["gemm_points"] == [] and res["layer_points"] == [] and res.get("block_errors", {}) == {}
    assert [(p["model"], p["T"]) for p in res["block_points"]] == [("deepseek-v3", 1), ("deepseek-v3", 5),
                                                                   ("glm-4.5-air", 1), ("glm-4.5-air", 5)]
    for p in res["block_points"]:
        assert set(p["time_ms"]) == {"hf_block", *b.OURS_BLOCK} and p["errors"] == {}
        assert p["routing_check"]["mismatch_fraction"] == 0.0
        assert all(p["rel_err_vs_hf_bf16"][m] < main.BLOCK_REL_TOL for m in b.OURS_BLOCK)
        assert set(p["eager_ms"]) == ({"hf_block", "ours_block", "ours_block_fused"} if p["T"] == 1 else set())
        assert all(p["derived"][f"{m}_x_hf_block"] > 0 for m in b.OURS_BLOCK)
        assert p["derived"]["block_shared_faster"] in ("separate", "fused")
    info = res["block_models"]["deepseek-v3"]
    assert info["experts"] == 16 and info["weight_bytes"]["hf_block"] > info["weight_bytes"]["ours_block"]
    assert {it["key"] for it in res["targets"]["items"]} >= {"block_ours_block_T1", "block_ours_block_fused_T1"}
    assert "### Shared expert" in main.render_markdown(res)
    args = main.parse_args(["--parts", "block", "--models", "glm-4.5-air", "--block-tokens", "1", "--block-schemes",
                            "block", "--replays", "1", "--eager-max-t", "0"])
    res = main.run(args, cw, _fake_timers())
    (p,) = res["block_points"]
    assert set(p["time_ms"]) == {"hf_block", "ours_block", "ours_block_fused"} and p["eager_ms"] == {}
    assert set(res["block_models"]["glm-4.5-air"]["weight_bytes"]) == {"hf_block", "ours_block"}
