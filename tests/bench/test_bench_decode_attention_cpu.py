"""bench/bench_decode_attention.py's pieces on the CPU (the benchmark itself needs a GPU): the kernel tags and the
--profile aggregation (median per kernel over calls, PDL off while profiling and restored after)."""

from __future__ import annotations

import pytest

from _bench_cpu import loaded_bench


@pytest.fixture(scope="module")
def bench():
    with loaded_bench("bench_decode_attention") as mod:
        yield mod


def test_kernel_tags(bench):
    ns = "void cutlass_w8a8::(anonymous namespace)::"
    assert bench._kernel_tag(ns + "decode_attention_split_kernel<__nv_bfloat16, 8, 16, 1>(Args)") == "split"
    assert bench._kernel_tag(ns + "decode_attention_combine_kernel<__nv_bfloat16, Int8Out, 2>(Args)") == "combine"
    cluster = ns + "decode_attention_combine_cluster_kernel<__nv_bfloat16, Int8Out, 1>(Args)"
    assert bench._kernel_tag(cluster) == "combine"
    assert bench._kernel_tag(ns + "decode_attention_fused_kernel<__nv_bfloat16, Int8Out, 8, 16, 1>(Args)") == "fused"
    assert bench._kernel_tag(ns + "rope_kv_cache_kernel<__nv_bfloat16>(Args)") == ""


def test_profile_takes_medians_with_pdl_off(bench, monkeypatch):
    pdl = []
    monkeypatch.setattr(bench._ext, "set_pdl", lambda on: pdl.append(on) or True)
    calls = iter([
        [("decode_attention_split_kernel<a>", 5.0), ("decode_attention_combine_kernel<b>", 2.0), ("memset", 1.0)],
        [("decode_attention_split_kernel<a>", 7.0), ("decode_attention_combine_kernel<b>", 3.0)],
        [("decode_attention_split_kernel<a>", 6.0), ("decode_attention_combine_kernel<b>", 4.0)],
    ])
    seen = []

    def fake_kernel_times(step):
        step()
        return next(calls)

    monkeypatch.setattr(bench, "cuda_kernel_times", fake_kernel_times)
    got = bench._profile(lambda *a: seen.append(a), (1, 2), calls=3)
    assert got == {"split": 6.0, "combine": 3.0}
    assert seen == [(1, 2)] * 3
    assert pdl == [False, True]  # off while profiling, then the previous setting back


def test_json_records_each_knob_as_set(bench, monkeypatch):
    """The JSON's knob keys: each A/B variable of csrc/attention/decode_attention.cu, its value as set, None unset."""
    assert set(bench.KNOB_ENVS.values()) == {"CUTLASS_W8A8_ATTN_MIN_CHUNK", "CUTLASS_W8A8_ATTN_CTAS_PER_SM",
                                             "CUTLASS_W8A8_ATTN_PREFETCH", "CUTLASS_W8A8_ATTN_COMBINE",
                                             "CUTLASS_W8A8_ATTN_SPLITS", "CUTLASS_W8A8_ATTN_HEADS_PER_CTA"}
    for name in bench.KNOB_ENVS.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUTLASS_W8A8_ATTN_CTAS_PER_SM", "8")
    monkeypatch.setenv("CUTLASS_W8A8_ATTN_PREFETCH", "1")
    monkeypatch.setenv("CUTLASS_W8A8_ATTN_COMBINE", "row")
    monkeypatch.setenv("CUTLASS_W8A8_ATTN_HEADS_PER_CTA", "4")
    assert bench._knob_envs() == {"min_chunk_env": None, "ctas_per_sm_env": "8", "prefetch_env": "1",
                                  "combine_env": "row", "splits_env": None, "heads_per_cta_env": "4"}
