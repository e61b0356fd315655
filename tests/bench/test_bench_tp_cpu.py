"""bench/bench_tp.py on the CPU: its command line, the options it sends to its processes, and the derived numbers
and report rendered from a synthetic results dict (target met / NOT met). The benchmark itself needs two GPUs
(tests/distributed/test_tp_cuda.py covers what it runs); this keeps its pieces honest between GPU runs."""

import json

import pytest

from _bench_cpu import loaded_bench


@pytest.fixture(scope="module")
def bench():
    with loaded_bench("bench_tp") as mod:
        yield mod


def test_defaults_and_quick(bench):
    a = bench.parse_args([])
    assert (a.layers, a.batches, a.quant, a.steps, a.warmup, a.max_seq, a.tp_lm_head) == (8, [1, 8], "int8", 100, 10,
                                                                                          512, True)
    q = bench.parse_args(["--quick", "--batches", "8,1,8", "--tp-lm-head"])
    assert (q.layers, q.steps, q.warmup, q.batches, q.tp_lm_head) == (2, 20, 3, [1, 8], True)
    assert bench.parse_args(["--quick", "--layers", "5"]).layers == 5
    assert bench.result_prefix(a) == "tp_8l_vocab_lm_head" and bench.result_prefix(q) == "tp_2l_vocab_lm_head"
    r = bench.parse_args(["--replicated-lm-head"])
    assert r.tp_lm_head is False and bench.result_prefix(r) == "tp_8l"


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--max-seq", "24"], ["--max-seq", "16384"], ["--steps", "0"],
                                  ["--batches", "0"], ["--quant", "int4"]])
def test_bad_arguments_exit(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_worker_options_are_plain_llama3_70b_dims(bench):
    opts = bench.worker_options(bench.parse_args(["--layers", "3", "--quant", "fp8"]))
    json.dumps(opts)  # plain data: it is pickled to the spawned processes
    from cutlass_w8a8.models import LlamaConfig

    c = LlamaConfig(**opts["config"])
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size) == (3, 8192, 28672, 64, 8, 128, 128256)
    # the 70B shapes shard over 2 ranks with every W8A8 N and K a multiple of 16
    assert c.num_heads % 2 == c.num_kv_heads % 2 == 0 and (c.intermediate_size // 2) % 16 == 0
    assert opts["quant"] == "fp8" and opts["batches"] == [1, 8]


def _rank(ms, no_reduce=None, nccl=None, nbytes=100e9, rel=0.0):
    b = {}
    for batch, t in ms.items():
        b[str(batch)] = {"graph": {"median_ms": t}, "graph_vs_eager_rel": rel, "nccl_kernel_ms": nccl}
        if no_reduce is not None:
            b[str(batch)]["no_reduce"] = {"median_ms": no_reduce[batch]}
    return {"batches": b, "weight_bytes_per_step": nbytes}


def _results(tp2_ms_batch1):
    return {"device": "NVIDIA H100 80GB HBM3", "git_commit": "abc", "batches": [1, 8], "quant": "int8", "max_seq": 512,
            "steps": 100, "tp_lm_head": False, "config": {**bench_config(), "num_layers": 8},
            "tp_vs_tp1_rel": {"1": 0.011, "8": 0.012},
            "tp1": [_rank({1: 4.0, 8: 4.4}, nbytes=9.0e9)],
            "tp2": [_rank({1: tp2_ms_batch1, 8: 2.9}, {1: 2.1, 8: 2.5}, nccl=0.2, nbytes=4.5e9),
                    _rank({1: tp2_ms_batch1 - 0.1, 8: 3.0}, {1: 2.0, 8: 2.6}, nccl=0.25, nbytes=4.5e9)]}


def bench_config():
    return dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8,
                head_dim=128)


def test_derive_takes_the_slower_rank(bench):
    r = bench.derive(_results(2.4))
    d1, d8 = r["derived"]["1"], r["derived"]["8"]
    assert d1["tp1_ms"] == 4.0 and d1["tp2_ms"] == 2.4 and d1["speedup"] == pytest.approx(4.0 / 2.4)
    assert d1["allreduce_share"] == pytest.approx(1 - 2.1 / 2.4)
    assert d1["nccl_kernel_share"] == pytest.approx(0.25 / 2.4)
    assert d8["tp2_ms"] == 3.0 and d8["tp2_no_reduce_ms"] == 2.6
    assert r["bytes_bound_speedup"] == pytest.approx(9.0 / 4.5)
    assert r["target"]["met"] is True


@pytest.mark.parametrize("tp2_ms, verdict", [(2.4, "**met**"), (2.6, "**NOT met**")])
def test_report(bench, tp2_ms, verdict):
    r = bench.derive(_results(tp2_ms))
    md = bench.render_markdown(r)
    assert verdict in md and "NVIDIA H100 80GB HBM3" in md and "8 layers" in md
    row = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    assert f"| 4.000 | {tp2_ms:.3f} | {4.0 / tp2_ms:.2f}x |" in row
    assert "gain at most 2.00x" in md and "batch 8: 0.012" in md
    assert "INVALID" not in md and r["invalid"] == []


def test_report_without_batch_1(bench):
    r = _results(2.4)
    r["batches"] = [8]
    md = bench.render_markdown(bench.derive(r))
    assert "not measured (batch 1 not run)" in md and "| 1 |" not in md


def test_plot_writes_a_png_when_matplotlib_is_there(bench, tmp_path):
    path = tmp_path / "tp.png"
    bench.plot_results(bench.derive(_results(2.4)), str(path))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not path.exists()
    else:
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_impossible_figures_are_invalid_never_met(bench):
    """The run torchrun made of two copies at once: TP=1 at 5.06 ms, a 3.15x speedup against the 2.00x byte bound,
    an NCCL kernel share of 398 %: INVALID, the target not judged, nothing printed as met."""
    r = _results(5.06 / 3.15)
    r["tp1"] = [_rank({1: 5.06, 8: 4.4}, nbytes=9.0e9)]
    for rank in r["tp2"]:
        rank["batches"]["1"]["nccl_kernel_ms"] = 3.98 * 5.06 / 3.15
        rank["batches"]["1"]["no_reduce"]["median_ms"] = 1.2
    d = bench.derive(r)
    d1 = d["derived"]["1"]
    assert set(d1["invalid"]) == {"speedup", "nccl_kernel_share"}
    assert d["target"]["met"] is None and "speedup" in d["target"]["invalid"] and "NCCL" in d["target"]["invalid"]
    md = bench.render_markdown(d)
    row = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    assert "3.15x INVALID" in row and "398.0 % INVALID" in row
    assert "**INVALID (" in md and "**met**" not in md and "**NOT met**" not in md
    assert "2 figures beyond their physical bound" in md
    # a share below zero (no-reduce graphs slower than the real ones) is as impossible as one over 100 %
    r = _results(2.4)
    for rank in r["tp2"]:
        rank["batches"]["8"]["no_reduce"]["median_ms"] = 3.5
    d = bench.derive(r)
    assert set(d["derived"]["8"]["invalid"]) == {"allreduce_share"} and d["target"]["met"] is None


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, {"LOCAL_RANK": "1"},
                                 {"RANK": "0"}, {"TORCHELASTIC_RUN_ID": "none"}])
def test_refuses_under_torchrun(bench, monkeypatch, capsys, env):
    """Started by torchrun (any of its variables set), it exits with status 2 before parsing or spawning anything."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def no_spawn(*a, **kw):
        raise AssertionError("spawned ranks under a launcher")

    monkeypatch.setattr("cutlass_w8a8.testing.tp.run_workers", no_spawn)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "refusing to run under torchrun" in err and all(f"{k}={v}" in err for k, v in env.items())


def test_runs_without_launcher_variables(bench, monkeypatch):
    """No launcher variable: the refusal lets it through (to the GPU checks, which fail here on the CPU)."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    from cutlass_w8a8.testing.tp import refuse_under_launcher

    assert refuse_under_launcher("bench_tp.py") is None
