"""The A/B knobs of the decode attention's split step (csrc/attention/decode_attention.cu; issue 36), each an
environment variable read once per process, so every check here runs in a fresh process:

- CUTLASS_W8A8_ATTN_SPLITS (split_rule_waves): unset (or "waves") the wave rule, the split count with the fewest
  waves of resident split CTAs times positions per CTA, from the split kernel's occupancy; "ctas" the CTAs-per-SM
  rule, the A/B value. Unset gives the bits of "waves", and not those of "ctas" on shapes where the two rules' split
  counts differ for any SM count and occupancy. Other splits, other bits: under "ctas" the reference tests pass, and
  the fused path's bitwise tests with their ctas-rule path checks (decode_attention_path asks the same function,
  splits_for, as the op).
- CUTLASS_W8A8_ATTN_PREFETCH=1 (attn_prefetch): split_partial issues the next step's K and V loads before the
  current step's math. The same float operations in the same order, so at the same split count the outputs must be
  bit-identical to the default's: computed in one process per setting from the same seeds, both under the ctas rule
  (the wave rule asks the occupancy of the variant that runs, which the prefetch's registers may lower, so its split
  count may differ), and compared with torch.equal, on the two-kernel path and on the fused path
  (cutlass_w8a8._ext.set_decode_attention_fused(True)), Qwen3-30B-A3B and Llama-3-8B heads, B 1 / 8, S 256 / 512 /
  4096, ragged positions, q's dtype / int8 / fp8 outputs. The kernels that ran must be the variant the variable
  names (the kernel's last template argument, from torch.profiler). Under the default rule the reference tests pass
  with it.
- CUTLASS_W8A8_ATTN_CTAS_PER_SM=N (ctas_per_sm, N in [1, 16], default 2): the split CTAs per SM the ctas rule aims
  at; read and checked under either rule, used by the ctas rule only. Another value changes that rule's splits,
  hence the bits, so it is checked against the float64 reference under SPLITS=ctas:
  test_decode_attention_cuda.py's reference, long-cache, ragged-row, independence and graph-replay tests and
  test_decode_attention_quant_cuda.py's composition tests pass at 8 (up to 4x the splits at 2).
  decode_attention_path (the fused plan) follows the same split count; under the wave rule it does not move.
- CUTLASS_W8A8_ATTN_COMBINE=row (combine_cluster_allowed): the one-block-per-row combine kernel where the cluster
  combine (8 blocks a row, sm90, H * D <= 8192) serves by default. The same weights and the same fmaf chain per
  element, an exact max for the row scale: bit-identical outputs (the combine does not change the split count under
  either rule), compared as for the prefetch under the default rule, and the combine kernels that ran are the ones
  each process asked for.
- CUTLASS_W8A8_ATTN_HEADS_PER_CTA=N (heads_per_cta_cap, N in 1, 2, 4, 8, default 4): the most query heads per CTA,
  G' = the largest of 8, 4, 2, 1 dividing the GQA group and at most N, for the split kernel, the fused kernel, the
  split count and the fused plan alike. At 8 and 1, Qwen3-30B-A3B heads (32 / 4 x 128, bf16) at B 1 / 3, S 256 /
  1000, ragged rows, match the float64 reference on both paths, decode_attention_quant's int8 output equals
  quantizing the plain output, the split / fused kernel that ran has kG = N (Llama-3-8B's group 4 keeps kG 4 at a
  cap of 4), and decode_attention_path gives Qwen3 the path of the layout whose group is N (the same H / G' head
  groups, hence the same split count and plan). A head's math does not depend on the CTA's other heads: at one split
  (CUTLASS_W8A8_ATTN_MIN_CHUNK=4096) every output equals (torch.equal) the default process's.
- cutlass_w8a8._ext.decode_attention_heads_per_cta (heads_per_cta itself) gives each group's G' unset and at caps 8,
  2 and 1 (a process each), and raises the op's ValueError for a bad cap.
- A bad value of any makes the op (and decode_attention_path) raise a ValueError naming the variable, not run.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from cutlass_w8a8 import _ext

pytestmark = pytest.mark.cuda

HERE = pathlib.Path(__file__)
ROOT = HERE.parents[2]
PREFETCH = "CUTLASS_W8A8_ATTN_PREFETCH"
CTAS = "CUTLASS_W8A8_ATTN_CTAS_PER_SM"
COMBINE = "CUTLASS_W8A8_ATTN_COMBINE"
SPLITS = "CUTLASS_W8A8_ATTN_SPLITS"
HEADS = "CUTLASS_W8A8_ATTN_HEADS_PER_CTA"
MIN_CHUNK = "CUTLASS_W8A8_ATTN_MIN_CHUNK"
KNOBS = (PREFETCH, CTAS, COMBINE, SPLITS, MIN_CHUNK, HEADS)

# test_decode_attention_cuda.py's accuracy, long-cache, ragged, independence and graph tests, and every lane layout
# (other_head_dims: 1 to 32 lanes a position, idle lanes past D, float32's two vectors a lane)
REFERENCE_TESTS = ("float64_reference or other_head_dims or long_cache or mixed_short_and_long or "
                   "cuda_graph_replay or rows_are_independent")


def _clean_env(**knobs) -> dict:
    """This process's environment without any attention knob, then ``knobs`` set."""
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update(knobs)
    return env


def _skip_if_a_knob_is_set():
    if any(os.environ.get(k) for k in KNOBS):
        pytest.skip("an attention knob is already set in this process")


def _pytest(env: dict, *args: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


# --- PREFETCH: the same bits ------------------------------------------------------------------------------------

# (name, H, KVH): Qwen3-30B-A3B (group 8: G' = 4 heads per unit at the default cap, CUTLASS_W8A8_ATTN_HEADS_PER_CTA)
# and Llama-3-8B (G' = 4); D = 128
LAYOUTS = [("qwen3", 32, 4), ("llama3", 32, 8)]
# S 256 / 512 / 4096: the two kernels for both layouts at the default cap (8 head groups x more than 4 splits
# overflow one cluster of 16 x 2 units); the float16 case at S 128 below (at most 4 splits, 8 x 4 units) takes the
# fused path where it is allowed (sm90) under either rule
SEQS = [256, 512, 4096]
BATCHES = [1, 8]


def _positions(b: int, s: int, seed: int) -> list[int]:
    """Ragged rows: 0, S - 1, 1, S // 2 first (a one-position row, the full cache), then random."""
    g = torch.Generator().manual_seed(seed)
    first = [0, s - 1, 1, s // 2]
    return (first + torch.randint(0, s, (max(b - 4, 0),), generator=g).tolist())[:b]


def _cases():
    """(key, H, KVH, D, B, S, dtype, seed): the layouts x B x S in bfloat16, plus float16 and float32 (the split
    kernel's other instantiations), G' = 1 and 2, and lanes left idle past D (D = 40: 5 vectors over 8 lanes, both
    paths; float32 D = 192: 48 vectors over 32 lanes, two a lane)."""
    out = []
    for name, h, kvh in LAYOUTS:
        for s in SEQS:
            for b in BATCHES:
                out.append((f"{name}-b{b}-s{s}-bf16", h, kvh, 128, b, s, torch.bfloat16, 10 * b + s))
    out.append(("qwen3-b8-s512-fp16", 32, 4, 128, 8, 512, torch.float16, 7))
    out.append(("qwen3-b8-s128-fp16", 32, 4, 128, 8, 128, torch.float16, 11))  # the fused path in float16
    out.append(("llama3-b8-s512-fp32", 32, 8, 128, 8, 512, torch.float32, 8))
    out.append(("h12-kvh2-b3-s1000-d64-bf16", 12, 2, 64, 3, 1000, torch.bfloat16, 9))  # G' = 2, kLanes 8
    # G' = 1 (at most 8 splits, up to 64 units: fused where resident, up to 16 CTAs of 4 units)
    out.append(("h8-kvh8-b3-s256-bf16", 8, 8, 128, 3, 256, torch.bfloat16, 12))
    out.append(("h4-kvh2-b5-s300-d40-bf16", 4, 2, 40, 5, 300, torch.bfloat16, 13))
    out.append(("h4-kvh2-b5-s300-d192-fp32", 4, 2, 192, 5, 300, torch.float32, 14))
    # H * D = 8192: the cluster combine's two vectors a thread (the row combine's too)
    out.append(("h64-kvh8-b3-s700-bf16", 64, 8, 128, 3, 700, torch.bfloat16, 15))
    # rows the cluster combine's 8 CTAs share unevenly: 2 vectors (6 CTAs idle), 30 (a short last part), 1054 (two
    # vectors a thread, a short second one)
    out.append(("h1-kvh1-b3-s300-d8-bf16", 1, 1, 8, 3, 300, torch.bfloat16, 16))
    out.append(("h3-kvh1-b3-s300-d40-fp16", 3, 1, 40, 3, 300, torch.float16, 17))
    out.append(("h17-kvh1-b2-s300-d248-bf16", 17, 1, 248, 2, 300, torch.bfloat16, 18))
    return out


def _calls(ops, args: tuple, fp8: bool) -> dict:
    """The op variants compared, each a callable returning a tuple of outputs: decode_attention, and
    decode_attention_quant to int8 (dynamic per-token scale) and, where fp8 kernels exist, to fp8 (static scale)."""
    calls = {"plain": lambda: (ops.decode_attention(*args),),
             "int8": lambda: ops.decode_attention_quant(*args, torch.int8, None)}
    if fp8:
        static = torch.full((1,), 0.01, device="cuda")
        calls["fp8-static"] = lambda: ops.decode_attention_quant(*args, torch.float8_e4m3fn, static)
    return calls


def _compute_outputs(path: str) -> None:
    """Run in a child process: every case's outputs on the two-kernel path and on the fused path (the switch on),
    saved to ``path`` with the path each took and the attention kernels that ran (kernel names)."""
    import cutlass_w8a8 as cw
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.testing.attention import make_inputs
    from cutlass_w8a8.testing.timers import cuda_kernel_times

    ops = torch.ops.cutlass_w8a8
    dev = torch.cuda.current_device()
    fp8 = cw.supports_fp8()
    results, paths, names, profiled = {}, {}, set(), set()
    previous = _ext.set_decode_attention_fused(False)
    try:
        for key, h, kvh, d, b, s, dtype, seed in _cases():
            q, kv, slots, pos = make_inputs(b, h, kvh, d, s, dtype, "cuda", seed=seed, positions=_positions(b, s, seed))
            scale = 1.0 / math.sqrt(d)
            for fused in (False, True):
                _ext.set_decode_attention_fused(fused)
                mode = "fused" if fused else "split"
                paths[f"{key}/{mode}"] = _ext.decode_attention_path(dev, b, h, kvh, s, d, dtype)
                calls = _calls(ops, (q, kv, slots, pos, scale), fp8)
                for variant, call in calls.items():
                    outs = call()
                    results[f"{key}/{mode}/{variant}"] = [
                        (t.view(torch.uint8) if t.element_size() == 1 else t).cpu() for t in outs]
                # the kernels that ran: once per path, dtype and row width (the combine's variant follows H * D)
                if (paths[f"{key}/{mode}"], dtype, h * d) not in profiled:
                    profiled.add((paths[f"{key}/{mode}"], dtype, h * d))
                    names.update(n for n, _ in cuda_kernel_times(calls["int8"]) if "decode_attention_" in n)
    finally:
        _ext.set_decode_attention_fused(previous)
    torch.save({"results": results, "paths": paths, "names": sorted(names)}, path)


def _outputs_in_a_process(tmp_path, env: dict, tag: str) -> dict:
    out = tmp_path / f"{tag}.pt"
    r = subprocess.run([sys.executable, str(HERE), str(out)], env=env, capture_output=True, text=True, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


def _variants(names: list[str]) -> set[str]:
    """The last template argument (kPrefetch) of each split / fused kernel name."""
    found = set()
    for n in names:
        if "decode_attention_split_kernel" not in n and "decode_attention_fused_kernel" not in n:
            continue
        m = re.search(r"decode_attention_(?:split|fused)_kernel<.*, (true|false)>\(", n)
        assert m is not None, n
        found.add(m.group(1))
    return found


def _assert_same_outputs(base: dict, other: dict) -> None:
    """Two processes' _outputs_in_a_process results: the same cases, and every output of `other` equal
    (torch.equal) to `base`'s, same dtype and shape, base's free of NaN."""
    assert base["results"].keys() == other["results"].keys()
    for key, expect in base["results"].items():
        got = other["results"][key]
        assert len(got) == len(expect), key
        for i, (x, y) in enumerate(zip(got, expect)):
            assert x.dtype == y.dtype and x.shape == y.shape, (key, i)
            assert not torch.isnan(y.float()).any(), (key, i)
            assert torch.equal(x, y), f"{key} output {i}"


def test_prefetch_gives_the_default_bits(tmp_path):
    """At the same split count (both processes under CUTLASS_W8A8_ATTN_SPLITS=ctas, whose count does not follow the
    kernel's occupancy) every output of CUTLASS_W8A8_ATTN_PREFETCH=1 equals (torch.equal) the process without it, on
    both paths; the kernels that ran are the variants each process asked for; the fused path served some cases on
    sm90."""
    _skip_if_a_knob_is_set()
    base = _outputs_in_a_process(tmp_path, _clean_env(**{SPLITS: "ctas"}), "default")
    pref = _outputs_in_a_process(tmp_path, _clean_env(**{SPLITS: "ctas", PREFETCH: "1"}), "prefetch")
    assert base["paths"] == pref["paths"]  # the variant does not change the plan
    assert len(base["results"]) >= 2 * 3 * 2 * 2 * 2
    _assert_same_outputs(base, pref)
    if torch.cuda.get_device_capability()[0] == 9:
        assert "fused" in base["paths"].values(), base["paths"]  # the fused kernels' variant ran too
    if base["names"] and pref["names"]:  # empty where the profiler records no CUDA kernels (no CUPTI)
        assert _variants(base["names"]) == {"false"}, base["names"]
        assert _variants(pref["names"]) == {"true"}, pref["names"]


def test_prefetch_still_matches_the_reference():
    """test_decode_attention_cuda.py's float64-reference, long-cache, ragged, independence and graph tests, and the
    fused path's bitwise tests against the two kernels (test_decode_attention_fused_cuda.py), with
    CUTLASS_W8A8_ATTN_PREFETCH=1 under the default (wave) rule, whose split counts then follow the variant's
    occupancy."""
    _skip_if_a_knob_is_set()
    _pytest(_clean_env(**{PREFETCH: "1"}), str(HERE.parent / "test_decode_attention_cuda.py"), "-k", REFERENCE_TESTS)
    _pytest(_clean_env(**{PREFETCH: "1"}), str(HERE.parent / "test_decode_attention_fused_cuda.py"))


# --- COMBINE: the row combine gives the cluster combine's bits ----------------------------------------------------

def _combine_kernels(names: list[str]) -> set[str]:
    return {m.group(1) for n in names if (m := re.search(r"(decode_attention_combine\w*_kernel)<", n))}


def _cluster_vectors(names: list[str]) -> set[str]:
    """The last template argument (output vectors a thread) of each cluster combine kernel name."""
    return {m.group(1) for n in names if (m := re.search(r"decode_attention_combine_cluster_kernel<.*, (\d+)>\(", n))}


def test_row_combine_gives_the_cluster_combine_bits(tmp_path):
    """Every output with CUTLASS_W8A8_ATTN_COMBINE=row equals (torch.equal) the default process's (the wave rule's
    splits, the same in both: the combine is not the split kernel whose occupancy the rule asks), on both paths (the
    fused path has no combine kernel: the same bits trivially); on sm90 the default ran the cluster combine and the
    row process only the one-block-per-row combine."""
    _skip_if_a_knob_is_set()
    base = _outputs_in_a_process(tmp_path, _clean_env(), "default")
    row = _outputs_in_a_process(tmp_path, _clean_env(**{COMBINE: "row"}), "row")
    assert base["paths"] == row["paths"]
    _assert_same_outputs(base, row)
    if base["names"] and row["names"]:  # empty where the profiler records no CUDA kernels (no CUPTI)
        assert _combine_kernels(row["names"]) == {"decode_attention_combine_kernel"}, row["names"]
        if torch.cuda.get_device_capability()[0] == 9:
            assert "decode_attention_combine_cluster_kernel" in _combine_kernels(base["names"]), base["names"]
            assert _cluster_vectors(base["names"]) == {"1", "2"}, base["names"]  # both variants ran


# --- SPLITS: unset is the wave rule; the ctas rule's splits still match the reference ------------------------------

# Llama-3-8B heads (32 / 8 x 128, 8 (row, head group) pairs a row) at S 4096, every row at its last position, float32
# (its output shows any change of the summation order; a 16-bit output would round most of them away). At B 3, 5
# and 8 the ctas rule's chunk (ceil(S / splits) rounded up to 8 positions) differs from the wave rule's for at least
# one of them at every SM count in [16, 300] and every occupancy of 1 to 16 split CTAs per SM (worked through both
# rules of choose_splits for each pair): other chunks, another summation order.
RULE_BATCHES = (3, 5, 8)


def _rule_outputs(tmp_path, env: dict, tag: str) -> dict:
    """decode_attention's float32 output per batch of RULE_BATCHES, computed in a process with ``env``."""
    out = tmp_path / f"rule-{tag}.pt"
    code = ("import sys, torch, cutlass_w8a8 as cw\n"
            "from cutlass_w8a8.testing.attention import make_inputs\n"
            "out = {}\n"
            f"for b in {RULE_BATCHES!r}:\n"
            "    q, kv, slots, pos = make_inputs(b, 32, 8, 128, 4096, torch.float32, 'cuda', seed=b,\n"
            "                                    positions=[4095] * b)\n"
            "    out[b] = cw.decode_attention(q, kv, slots, pos).cpu()\n"
            "torch.save(out, sys.argv[1])\n")
    r = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return torch.load(out)


def test_unset_is_the_wave_rule(tmp_path):
    """With CUTLASS_W8A8_ATTN_SPLITS unset every output equals (torch.equal) the process with SPLITS=waves, and at
    least one differs from the process with SPLITS=ctas (RULE_BATCHES: the two rules split some row differently)."""
    _skip_if_a_knob_is_set()
    unset = _rule_outputs(tmp_path, _clean_env(), "unset")
    waves = _rule_outputs(tmp_path, _clean_env(**{SPLITS: "waves"}), "waves")
    ctas = _rule_outputs(tmp_path, _clean_env(**{SPLITS: "ctas"}), "ctas")
    assert unset.keys() == waves.keys() == ctas.keys() == set(RULE_BATCHES)
    for b in RULE_BATCHES:
        assert torch.isfinite(unset[b]).all() and torch.isfinite(ctas[b]).all(), b
        assert torch.equal(unset[b], waves[b]), f"B {b}: unset differs from SPLITS=waves"
    assert any(not torch.equal(unset[b], ctas[b]) for b in RULE_BATCHES), "unset gave SPLITS=ctas's bits everywhere"


def test_ctas_splits_still_match_the_reference():
    """With CUTLASS_W8A8_ATTN_SPLITS=ctas (the CTAs-per-SM rule, the A/B value): test_decode_attention_cuda.py's
    float64-reference, long-cache, ragged, independence and graph-replay tests, decode_attention_quant against the
    composition, and the fused path's bitwise tests against the two kernels with their ctas-rule path checks
    (test_decode_attention_fused_cuda.py)."""
    _skip_if_a_knob_is_set()
    env = _clean_env(**{SPLITS: "ctas"})
    _pytest(env, str(HERE.parent / "test_decode_attention_cuda.py"), "-k", REFERENCE_TESTS + " or split_unevenly")
    _pytest(env, str(HERE.parent / "test_decode_attention_quant_cuda.py"), "-k",
            "equals_composition or long_cache_mixed_rows or split_unevenly")
    _pytest(env, str(HERE.parent / "test_decode_attention_fused_cuda.py"))


# --- CTAS_PER_SM: other splits under the ctas rule, still the reference ---------------------------------------------

def test_more_ctas_per_sm_still_match_the_reference():
    """With CUTLASS_W8A8_ATTN_SPLITS=ctas and CUTLASS_W8A8_ATTN_CTAS_PER_SM=8 (up to 4x the splits at 2):
    test_decode_attention_cuda.py's float64-reference, long-cache, ragged, independence and graph-replay tests (a
    captured graph's splits come from shapes only), and decode_attention_quant against quantizing
    decode_attention's output (test_decode_attention_quant_cuda.py)."""
    _skip_if_a_knob_is_set()
    env = _clean_env(**{SPLITS: "ctas", CTAS: "8"})
    _pytest(env, str(HERE.parent / "test_decode_attention_cuda.py"), "-k", REFERENCE_TESTS)
    _pytest(env, str(HERE.parent / "test_decode_attention_quant_cuda.py"), "-k",
            "equals_composition or long_cache_mixed_rows")


def _path_in_a_process(env: dict) -> str:
    """decode_attention_path of Llama-3-8B heads (32 / 8 x 128) at B 16, S 512, bfloat16, the fused path allowed."""
    code = ("import torch, cutlass_w8a8\n"
            "from cutlass_w8a8 import _ext\n"
            "_ext.set_decode_attention_fused(True)\n"
            "print('PATH', _ext.decode_attention_path(0, 16, 32, 8, 512, 128, torch.bfloat16))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    paths = re.findall(r"^PATH (\w+)$", r.stdout, re.M)
    assert len(paths) == 1, r.stdout
    return paths[0]


def test_ctas_per_sm_reaches_the_fused_plan():
    """decode_attention_path asks choose_splits too: under SPLITS=ctas, Llama-3-8B (32 / 8 x 128) at B 16, S 512
    (128 (row, head group) pairs) has ceil(2 SMs / 128) splits at the default CTAS_PER_SM and ceil(8 SMs / 128) at
    CUTLASS_W8A8_ATTN_CTAS_PER_SM=8 (at most 16: S / 32). The fused plan fits 8 x splits units in one cluster of at
    most 16 CTAs of 2 units, so splits <= 4: CTAS_PER_SM 2's for up to 256 SMs, 8's for at most 64. So on an sm90
    with 64 < SMs <= 256 the path is fused at 2 and split at 8. Under the wave rule (unset) CTAS_PER_SM=8 leaves
    the path as it is without it."""
    _skip_if_a_knob_is_set()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-kernel path runs on sm90")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 64 < sms <= 256:
        pytest.skip(f"{sms} SMs: the shape's paths differ from the ones asserted here")
    assert _path_in_a_process(_clean_env(**{SPLITS: "ctas"})) == "fused"
    assert _path_in_a_process(_clean_env(**{SPLITS: "ctas", CTAS: "8"})) == "split"
    assert _path_in_a_process(_clean_env(**{CTAS: "8"})) == _path_in_a_process(_clean_env())


# --- HEADS_PER_CTA: at most N query heads per CTA ------------------------------------------------------------------

# (name, H, KVH): Qwen3-30B-A3B (group 8: G' 4 by default, 8 at a cap of 8) and Llama-3-8B (group 4: G' 4); D = 128,
# bfloat16
HEADS_LAYOUTS = [("qwen3", 32, 4), ("llama3", 32, 8)]
HEADS_BATCHES = (1, 3)
HEADS_SEQS = (256, 1000)


def _kernel_groups(names) -> set[int]:
    """The kG template argument (query heads per CTA or unit) of each split / fused kernel name."""
    found = set()
    for n in names:
        m = (re.search(r"decode_attention_split_kernel<[^,<>]+, (\d+),", n)
             or re.search(r"decode_attention_fused_kernel<[^,<>]+, [^,]+, (\d+),", n))
        if m is not None:
            found.add(int(m.group(1)))
    return found


def _heads_outputs(path: str) -> None:
    """Run in a child process (under the knobs of its environment): for each HEADS_LAYOUTS x HEADS_BATCHES x
    HEADS_SEQS case, on the two-kernel path and on the fused path (the switch on), decode_attention checked against
    the float64 reference and decode_attention_quant (int8, dynamic) against quantizing that output bit for bit;
    saved to ``path``: the outputs, the kG of the split / fused kernels that ran per (layout, path), and
    decode_attention_path of 32 query heads over KVH = 32, 16, 8, 4 (groups 1, 2, 4, 8) at each (B, S)."""
    from cutlass_w8a8 import _ext
    from cutlass_w8a8.testing.attention import (
        assert_close_to_reference,
        make_inputs,
        reference,
    )
    from cutlass_w8a8.testing.timers import cuda_kernel_times

    ops = torch.ops.cutlass_w8a8
    dev = torch.cuda.current_device()
    results, paths, groups = {}, {}, {}
    previous = _ext.set_decode_attention_fused(False)
    try:
        for fused in (False, True):
            _ext.set_decode_attention_fused(fused)
            mode = "fused" if fused else "split"
            for b in HEADS_BATCHES:
                for s in HEADS_SEQS:
                    for kvh in (32, 16, 8, 4):
                        paths[f"kvh{kvh}-b{b}-s{s}/{mode}"] = _ext.decode_attention_path(
                            dev, b, 32, kvh, s, 128, torch.bfloat16)
        for name, h, kvh in HEADS_LAYOUTS:
            for b in HEADS_BATCHES:
                for s in HEADS_SEQS:
                    seed = 100 * b + s
                    q, kv, slots, pos = make_inputs(b, h, kvh, 128, s, torch.bfloat16, "cuda", seed=seed,
                                                    positions=_positions(b, s, seed))
                    scale = 1.0 / math.sqrt(128)
                    ref = reference(q, kv, slots, pos, scale)
                    for fused in (False, True):
                        _ext.set_decode_attention_fused(fused)
                        key = f"{name}-b{b}-s{s}/{'fused' if fused else 'split'}"
                        plain = ops.decode_attention(q, kv, slots, pos, scale)
                        assert_close_to_reference(plain, ref, torch.bfloat16, key)
                        q8, s8 = ops.decode_attention_quant(q, kv, slots, pos, scale, torch.int8, None)
                        e8, es = ops.quantize_per_token(plain, torch.int8)
                        assert torch.equal(q8, e8) and torch.equal(s8, es), key
                        results[key] = [plain.cpu(), q8.cpu(), s8.cpu()]
                        group_key = f"{name}/{_ext.decode_attention_path(dev, b, h, kvh, s, 128, torch.bfloat16)}"
                        if group_key not in groups:
                            call = functools.partial(ops.decode_attention, q, kv, slots, pos, scale)
                            names = [n for n, _ in cuda_kernel_times(call)]
                            groups[group_key] = sorted(_kernel_groups(names))
    finally:
        _ext.set_decode_attention_fused(previous)
    torch.save({"results": results, "paths": paths, "groups": groups}, path)


def _heads_in_a_process(tmp_path, env: dict, tag: str) -> dict:
    out = tmp_path / f"heads-{tag}.pt"
    r = subprocess.run([sys.executable, str(HERE), "heads", str(out)], env=env, capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("cap", [8, 1])
def test_heads_per_cta_cap_matches_the_reference(tmp_path, cap):
    """With CUTLASS_W8A8_ATTN_HEADS_PER_CTA=cap: Qwen3 heads match the float64 reference on both paths and the int8
    op equals the composition (checked in the child); the kernels that ran hold G' = min(group, cap) heads (where
    the profiler records kernels); decode_attention_path gives Qwen3 (group 8) the path of the layout of group cap,
    whose head groups are the same, and the groups at or below both caps (the default's and this one) their unset
    path."""
    _skip_if_a_knob_is_set()
    default_cap = _ext.decode_attention_heads_per_cta(8)  # a group of 8: the cap itself, unset here (the default)
    base = _heads_in_a_process(tmp_path, _clean_env(), "unset")
    got = _heads_in_a_process(tmp_path, _clean_env(**{HEADS: str(cap)}), f"cap{cap}")
    assert got["results"].keys() == base["results"].keys()
    assert len(got["results"]) == len(HEADS_LAYOUTS) * len(HEADS_BATCHES) * len(HEADS_SEQS) * 2
    for b in HEADS_BATCHES:
        for s in HEADS_SEQS:
            for mode in ("split", "fused"):
                # Qwen3's G' becomes cap: the path (split count, plan) of H / cap head groups, as group cap's
                # (at cap 8 that layout is Qwen3's own: the check below that its plan moved stands instead)
                assert got["paths"][f"kvh4-b{b}-s{s}/{mode}"] == got["paths"][f"kvh{32 // cap}-b{b}-s{s}/{mode}"]
                # groups at or below both caps keep their G', hence their path
                for kvh in (32, 16, 8):
                    if 32 // kvh <= min(cap, default_cap):
                        key = f"kvh{kvh}-b{b}-s{s}/{mode}"
                        assert got["paths"][key] == base["paths"][key], key
    if cap == 8 and torch.cuda.get_device_capability()[0] == 9:
        # Qwen3 at B 1, S 256, fused path allowed: 8 groups of 4 x 8 splits (64 units) take the two kernels at the
        # default cap, 4 groups of 8 x 8 splits (32 units) one cluster at a cap of 8
        assert base["paths"]["kvh4-b1-s256/fused"] == "split", base["paths"]
        assert got["paths"]["kvh4-b1-s256/fused"] == "fused", got["paths"]
    if any(base["groups"].values()):  # empty where the profiler records no CUDA kernels (no CUPTI)
        assert {k: v for k, v in base["groups"].items() if k.startswith("qwen3/")} and all(
            v == [default_cap] for k, v in base["groups"].items() if k.startswith("qwen3/")), base["groups"]
        assert all(v == [4] for k, v in base["groups"].items() if k.startswith("llama3/")), base["groups"]
        assert all(v == [cap] for k, v in got["groups"].items() if k.startswith("qwen3/")), got["groups"]
        assert all(v == [min(4, cap)] for k, v in got["groups"].items() if k.startswith("llama3/")), got["groups"]


def test_heads_per_cta_cap_gives_the_same_bits_at_one_split(tmp_path):
    """At one split (CUTLASS_W8A8_ATTN_MIN_CHUNK=4096: at most S / 4096 splits, so one for S < 8192, whatever G')
    every output with CUTLASS_W8A8_ATTN_HEADS_PER_CTA=8 and =1 equals (torch.equal) the default's: a head's float
    operations do not depend on the other heads of its CTA."""
    _skip_if_a_knob_is_set()
    base = _heads_in_a_process(tmp_path, _clean_env(**{MIN_CHUNK: "4096"}), "one-split")
    for cap in ("8", "1"):
        got = _heads_in_a_process(tmp_path, _clean_env(**{MIN_CHUNK: "4096", HEADS: cap}), f"one-split-cap{cap}")
        _assert_same_outputs(base, got)


def test_fused_path_under_a_cap_of_8():
    """test_decode_attention_fused_cuda.py (the one-kernel path against the two kernels, bit for bit, and the paths
    of the target shapes) in a process with CUTLASS_W8A8_ATTN_HEADS_PER_CTA=8: Qwen3-30B-A3B's groups of G' = 8
    (the default 4 leaves that fused instantiation to this run)."""
    _skip_if_a_knob_is_set()
    _pytest(_clean_env(**{HEADS: "8"}), str(HERE.parent / "test_decode_attention_fused_cuda.py"))


# GQA groups H / KVH and the G' of each for a cap (CUTLASS_W8A8_ATTN_HEADS_PER_CTA; None: unset, the default 4): the
# largest of 8, 4, 2, 1 that divides the group and is at most the cap
HEADS_GROUPS = (1, 2, 3, 4, 6, 8, 12, 16)
HEADS_PER_CTA = {None: (1, 2, 1, 4, 2, 4, 4, 4), "8": (1, 2, 1, 4, 2, 8, 4, 8), "2": (1, 2, 1, 2, 2, 2, 2, 2),
                 "1": (1, 1, 1, 1, 1, 1, 1, 1)}


@pytest.mark.parametrize("cap", list(HEADS_PER_CTA), ids=lambda c: f"cap-{c or 'unset'}")
def test_heads_per_cta_query(cap):
    """cutlass_w8a8._ext.decode_attention_heads_per_cta (heads_per_cta, the function the kernels, the split count and
    the fused plan ask) gives HEADS_PER_CTA's G' for each group: unset in this process, each cap in a fresh one (the
    variable is read once per process). A group outside [1, 65535] raises a ValueError naming `group`."""
    _skip_if_a_knob_is_set()
    if cap is None:
        got = tuple(_ext.decode_attention_heads_per_cta(g) for g in HEADS_GROUPS)
        for bad in (0, -8, 65536):
            with pytest.raises(ValueError, match=r"heads_per_cta: `group` .* must be in \[1, 65535\], got"):
                _ext.decode_attention_heads_per_cta(bad)
    else:
        code = ("from cutlass_w8a8 import _ext\n"
                f"print('G', [_ext.decode_attention_heads_per_cta(g) for g in {HEADS_GROUPS!r}])\n")
        r = subprocess.run([sys.executable, "-c", code], env=_clean_env(**{HEADS: cap}), capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("G "))
        got = tuple(ast.literal_eval(line[2:]))
    assert got == HEADS_PER_CTA[cap], dict(zip(HEADS_GROUPS, got))


def test_heads_per_cta_query_refuses_a_bad_cap():
    """With a bad CUTLASS_W8A8_ATTN_HEADS_PER_CTA, decode_attention_heads_per_cta raises the op's ValueError (the same
    message, naming the variable), in a fresh process."""
    code = ("import torch, cutlass_w8a8 as cw\n"
            "from cutlass_w8a8 import _ext\n"
            "from cutlass_w8a8.testing.attention import make_inputs\n"
            "q, kv, slots, pos = make_inputs(1, 8, 8, 64, 256, torch.bfloat16, 'cuda', seed=0)\n"
            "for call in (lambda: _ext.decode_attention_heads_per_cta(8),\n"
            "             lambda: cw.decode_attention(q, kv, slots, pos)):\n"
            "    try:\n"
            "        call()\n"
            "        print('RAN')\n"
            "    except ValueError as exc:\n"
            "        print('RAISED', str(exc).splitlines()[0])\n")
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(**{HEADS: "3"}), capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("RAN", "RAISED"))]
    assert len(lines) == 2 and lines[0] == lines[1], r.stdout
    assert f"{HEADS} must be 1, 2, 4 or 8, got '3'" in lines[0], r.stdout


# --- bad values ---------------------------------------------------------------------------------------------------

# each variable's bad values and the C++ message (csrc/attention/decode_attention.cu: attn_prefetch, ctas_per_sm,
# combine_cluster_allowed, split_rule_waves, heads_per_cta_cap)
# and one accepted value each, set after them: the op and decode_attention_path then run
GOOD_VALUES = {PREFETCH: "0", CTAS: "3", COMBINE: "cluster", SPLITS: "ctas", HEADS: "4"}
BAD_VALUES = {PREFETCH: ("must be 0 or 1 (or unset)", ("2", "yes", "true")),
              CTAS: ("must be an integer in [1, 16]", ("0", "17", "abc", "2.5", "-1")),
              COMBINE: ("must be cluster or row (or unset)", ("rows", "1", "Cluster")),
              SPLITS: ("must be waves or ctas (or unset)", ("wave", "2", "CTAS")),
              HEADS: ("must be 1, 2, 4 or 8", ("3", "16", "x", "0", "-4"))}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_value_raises_naming_the_variable(name):
    """The op and decode_attention_path raise a ValueError naming the variable (read before any launch) instead of
    silently running the default. A fresh process per variable (each is read once per process), its bad values in
    turn: a read that raised leaves the variable unread (C++ tries a static initialization that threw again on the
    next call), so each call reads the value just set. The other variables are unset: each process reads the others'
    defaults (heads_per_cta_cap is read first, then attn_prefetch, then combine_cluster_allowed, then the split
    rule's). Then an accepted value (GOOD_VALUES) runs both."""
    message, values = BAD_VALUES[name]
    code = ("import os, torch, cutlass_w8a8 as cw\n"
            "from cutlass_w8a8 import _ext\n"
            "from cutlass_w8a8.testing.attention import make_inputs\n"
            "q, kv, slots, pos = make_inputs(1, 8, 8, 64, 256, torch.bfloat16, 'cuda', seed=0)\n"
            f"for value in {values!r}:\n"
            f"    os.environ[{name!r}] = value\n"
            "    for call in (lambda: cw.decode_attention(q, kv, slots, pos),\n"
            "                 lambda: _ext.decode_attention_path(0, 1, 8, 8, 256, 64, torch.bfloat16)):\n"
            "        try:\n"
            "            call()\n"
            "            print('RAN', repr(value))\n"
            "        except ValueError as exc:\n"
            "            print('RAISED', exc)\n"
            f"os.environ[{name!r}] = {GOOD_VALUES[name]!r}\n"
            "cw.decode_attention(q, kv, slots, pos)\n"
            "_ext.decode_attention_path(0, 1, 8, 8, 256, 64, torch.bfloat16)\n"
            "print('GOOD')\n")
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RAN" not in r.stdout, r.stdout
    for value in values:
        assert r.stdout.count(f"{name} {message}, got '{value}'") == 2, (value, r.stdout)
    assert "GOOD" in r.stdout, r.stdout  # the accepted value runs


@pytest.mark.parametrize("rule", [None, "waves", "ctas"], ids=["splits-unset", "splits-waves", "splits-ctas"])
def test_a_bad_ctas_per_sm_raises_under_either_rule(rule):
    """CUTLASS_W8A8_ATTN_CTAS_PER_SM is read (and checked) under either split rule: under the wave rule (the
    default: SPLITS unset, or SPLITS=waves), which does not use it, a bad value still raises instead of being
    ignored, and so it does under SPLITS=ctas, which uses it."""
    code = ("import torch, cutlass_w8a8 as cw\n"
            "from cutlass_w8a8.testing.attention import make_inputs\n"
            "q, kv, slots, pos = make_inputs(1, 8, 8, 64, 256, torch.bfloat16, 'cuda', seed=0)\n"
            "try:\n"
            "    cw.decode_attention(q, kv, slots, pos)\n"
            "    print('RAN')\n"
            "except ValueError as exc:\n"
            "    print('RAISED', exc)\n")
    env = _clean_env(**{CTAS: "abc"}) if rule is None else _clean_env(**{SPLITS: rule, CTAS: "abc"})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{CTAS} must be an integer in [1, 16], got 'abc'" in r.stdout, r.stdout


if __name__ == "__main__":  # the child process of the bit-equality tests
    if len(sys.argv) == 3 and sys.argv[1] == "heads":
        _heads_outputs(sys.argv[2])
    else:
        _compute_outputs(sys.argv[1])
