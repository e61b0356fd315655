"""Tensor parallelism on the CPU: the sharding math in one process, then two processes with gloo
(`cutlass_w8a8.testing.tp.run_workers`: file:// rendezvous, 60 s collective timeout, the parent kills workers
that outlive 180 s; the worker functions are in tests/_tp_scenarios.py and return data the tests check here).

Tolerances, and where they come from:

- Column-parallel outputs are the full layer's output columns bit for bit (same quantized input, same weight
  rows and scales; the CPU GEMM sums exactly in float64).
- Row-parallel: the distributed output equals the bf16 sum of the two ranks' partial GEMMs plus the bias, bit
  for bit (gloo adds two bf16 values and rounds once, as torch does). Against the unsharded layer it differs by
  the two activation quantizations (per shard vs per row) and the roundings of the partials:
  `cutlass_w8a8.testing.tp.row_parallel_bound` derives the element-wise bound; a bias added twice exceeds it.
- Float32 decoder, TP=2 vs TP=1: only the summation order inside the row-parallel GEMMs and the 2-way reduce
  differ, each at most gamma_K = K u = 256 * 2**-24 = 1.5e-5 relative per output (K <= 256 here); we require a
  relative Frobenius error of the logits <= 2e-5 over 2 layers (measured: 2.4e-7).
- W8A8 decoder (int8, fp8), TP=2 vs TP=1: both approximate the same float model Lf (the dequantized weights in
  float32 with exact activations); TP=2 only quantizes the inputs of o_proj and down_proj per shard, with scales
  no larger than TP=1's (amax of a shard <= amax of the row), so its error against Lf is no larger in
  expectation. Required: ||L2 - Lf|| <= 1.25 ||L1 - Lf|| (the 25 % covers the sampling variation of two
  independent rounding-noise draws over ~6000 logits; measured ratios 1.00-1.03 aggregated over the steps), and
  hence, by the triangle inequality, ||L2 - L1|| <= 2.25 ||L1 - Lf|| (||L1 - Lf|| / ||Lf|| is about 1.2 % for int8
  and 4 % for fp8 on this model).
"""

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.distributed import ColumnParallelW8A8Linear, LLAMA_TP_PLAN, fuse_w8a8, shard_linear
from cutlass_w8a8.distributed import sharding as S
from cutlass_w8a8.distributed.plan import match_plan
from cutlass_w8a8.testing.tp import row_parallel_bound, row_parallel_rms_bound, run_workers

import _tp_scenarios as scen
from _tp_scenarios import TP_VS_TP1_ACCURACY, as_fp8, kept_rows, ok_value

WORLD = 2
TIMEOUT_S = 180
FLOAT32_TP_REL = 2e-5


# ---- one process: the sharding math --------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_rows_partition_each_matrix(world):
    sizes = [64, 16, 16]
    seen = []
    for r in range(world):
        ranges = S.column_rows(sizes, r, world)
        assert len(ranges) == 3
        offset = 0
        for (a, b), s in zip(ranges, sizes):  # rank r holds the r-th part of each matrix
            assert (a, b) == (offset + r * s // world, offset + (r + 1) * s // world)
            offset += s
        seen += [i for a, b in ranges for i in range(a, b)]
    assert sorted(seen) == list(range(96))


def test_shard_rows_and_cols_are_compact_copies():
    w = torch.arange(96 * 8, dtype=torch.float32).reshape(96, 8)
    rows = S.shard_rows(w, [64, 16, 16], 1, 2)
    assert torch.equal(rows, torch.cat([w[32:64], w[72:80], w[88:96]]))
    cols = S.shard_cols(w, 1, 2)
    assert torch.equal(cols, w[:, 4:8]) and cols.is_contiguous()
    assert cols.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    one = S.shard_rows(w, [96], 0, 2)  # a single range: still a copy, not a view keeping `w` alive
    assert one.untyped_storage().nbytes() == 48 * 8 * 4


@pytest.mark.parametrize("n, k, world, sizes, quantized, match", [
    (33, 64, 2, None, True, r"`out_features` = 33 is not divisible by the tensor-parallel world size 2"),
    (64, 64, 2, [33, 31], True, r"`output_sizes\[0\]` = 33 is not divisible"),
    (64, 64, 2, [32, 16], True, r"`output_sizes` = \[32, 16\] must be positive sizes summing to out_features = 64"),
    (48, 64, 2, None, True, r"out_features = 24 \(= 48 / 2\) and in_features = 64; the W8A8 GEMM kernels need"),
    (96, 64, 3, [48, 32, 16], True, r"`output_sizes\[1\]` = 32 is not divisible by the tensor-parallel world size 3"),
])
def test_column_shardable_errors(n, k, world, sizes, quantized, match):
    with pytest.raises(ValueError, match=match):
        S.check_column_shardable(n, k, world, sizes, "ColumnParallelW8A8Linear", quantized)


def test_column_shardable_float_has_no_alignment_rule():
    assert S.check_column_shardable(48, 64, 2, None, quantized=False) == [48]


@pytest.mark.parametrize("n, k, world, quantized, match", [
    (64, 33, 2, True, r"RowParallelW8A8Linear: `in_features` = 33 is not divisible by the tensor-parallel world "
                      r"size 2"),
    (64, 48, 2, True, r"in_features = 24 \(= 48 / 2\) and out_features = 64; the W8A8 GEMM kernels need"),
    (64, 33, 2, False, r"`in_features` = 33 is not divisible"),
])
def test_row_shardable_errors(n, k, world, quantized, match):
    with pytest.raises(ValueError, match=match):
        S.check_row_shardable(n, k, world, "RowParallelW8A8Linear", quantized)


def _w8a8(n, k=64, seed=0, per_channel=True, input_scale=None):
    lin = scen._float_linear(k, n, "cpu", seed)
    mod = cw.W8A8Linear.from_float(lin, input_scale=input_scale)
    if not per_channel:  # a per-tensor scale, as compressed-tensors' "tensor" strategy stores it
        w = lin.weight.float()
        s = w.abs().amax() / 127
        mod = cw.W8A8Linear.from_quantized(torch.round(w / s).clamp(-127, 127).to(torch.int8), s.reshape(1),
                                           bias=lin.bias, input_scale=input_scale)
    return mod


def test_fuse_w8a8_per_tensor_scales_become_per_channel():
    q, k, v = (_w8a8(n, seed=i, per_channel=False) for i, n in enumerate((64, 32, 32)))
    assert len({float(m.weight_scale) for m in (q, k, v)}) == 3
    fused, sizes = fuse_w8a8([q, k, v])
    assert sizes == [64, 32, 32] and fused.weight_scale.shape == (128,)
    assert torch.equal(fused.weight_scale, torch.cat([m.weight_scale.expand(m.out_features) for m in (q, k, v)]))
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(fused(x), torch.cat([q(x), k(x), v(x)], dim=-1))  # exact: same rows, same scales
    same, _ = fuse_w8a8([q, q])
    assert same.weight_scale.shape == (1,)  # one shared per-tensor scale stays per tensor
    mixed, _ = fuse_w8a8([_w8a8(32, seed=5), k])
    assert mixed.weight_scale.shape == (64,)


def test_fuse_w8a8_refusals():
    a = _w8a8(32, input_scale=torch.tensor([0.1]))
    b = _w8a8(32, seed=1, input_scale=torch.tensor([0.2]))
    with pytest.raises(ValueError, match=r"static `input_scale` values differ \(\[0.1"):
        fuse_w8a8([a, b])
    with pytest.raises(ValueError, match="some layers have `input_scale` and others do not"):
        fuse_w8a8([a, _w8a8(32)])
    with pytest.raises(ValueError, match="differ in `in_features`"):
        fuse_w8a8([_w8a8(32), _w8a8(32, k=128)])


def test_match_plan_by_name_suffix():
    assert match_plan("model.layers.3.self_attn.q_proj", LLAMA_TP_PLAN) == ("colwise", None)
    assert match_plan("layers.0.mlp.down_proj", LLAMA_TP_PLAN) == ("rowwise", None)
    assert match_plan("lm_head", LLAMA_TP_PLAN) == ("vocab", None)  # sharded over the vocabulary by default
    assert match_plan("model.embed_tokens", LLAMA_TP_PLAN) is None
    plan = {"layers.*.attn.wqkv": ("colwise", [64, 16, 16]), "layers.*.attn.wo": "rowwise"}
    assert match_plan("model.layers.7.attn.wqkv", plan) == ("colwise", [64, 16, 16])
    assert match_plan("model.layers.x.y.attn.wo", plan) is None  # "*" is one component
    with pytest.raises(ValueError, match="must be 'colwise', 'rowwise'"):
        match_plan("a.b", {"b": "diagonal"})


def test_misuse_without_a_group():
    lin = nn.Linear(64, 64, dtype=torch.bfloat16)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            ColumnParallelW8A8Linear.from_float(lin, None)
    with pytest.raises(ValueError, match="`style` must be 'colwise' or 'rowwise'"):
        shard_linear(lin, "diagonal", None)
    with pytest.raises(TypeError, match="quantize_: `tp_plan` is given without `tp_group`"):
        cw.quantize_(nn.Sequential(lin), tp_plan={"0": "colwise"})
    with pytest.raises(ValueError, match="quantize_: `tp_group` needs a model whose linears have names"):
        cw.quantize_(lin, tp_group=object())


def _simulated_row_parallel(full: cw.W8A8Linear, x: torch.Tensor, world: int) -> torch.Tensor:
    """What RowParallelW8A8Linear computes, in one process: each rank's partial GEMM on its columns (no bias), the
    bf16 sum of the partials in rank order, then the bias."""
    total = None
    for r in range(world):
        a, b = S.shard_range(full.in_features, r, world)
        part = cw.W8A8Linear.from_quantized(S.shard_cols(full.weight, r, world), full.weight_scale,
                                            input_scale=full.input_scale, dtype=full.dtype)(x[:, a:b].contiguous())
        total = part if total is None else total + part
    return total + full.bias


@pytest.mark.parametrize("quant, static", [(torch.int8, False), (torch.float8_e4m3fn, False), (torch.int8, True)])
def test_row_parallel_bounds_hold_and_catch_bugs(quant, static):
    """The worst-case bound (`row_parallel_bound`) and the norm bound (`row_parallel_rms_bound`) hold over random
    inputs with outliers (which make per-shard and per-row scales differ); the norm bound is tight enough that a
    bias added twice or a missing partial sum (no all-reduce) breaks it, and for int8 so is the worst case."""
    g = torch.Generator().manual_seed(0)
    lin = scen._float_linear(256, 64, "cpu", seed=11)
    input_scale = torch.tensor([0.08]) if static else None
    full = cw.W8A8Linear.from_float(lin, cw.W8A8Config(dtype=quant), input_scale=input_scale)
    for world in (2, 4):
        for trial in range(5):
            x = torch.randn(16, 256, generator=g)
            x[trial, (trial * 37) % 256] = 12.0  # an outlier in one shard of one row
            x = x.to(torch.bfloat16)
            y_full, y_tp = full(x), _simulated_row_parallel(full, x, world)
            bound = row_parallel_bound(x, full.weight, full.weight_scale, world, bias=full.bias,
                                       input_scale=full.input_scale)
            rms = row_parallel_rms_bound(x, full.weight, full.weight_scale, world, bias=full.bias,
                                         input_scale=full.input_scale)
            diff = (y_tp.double() - y_full.double()).abs()
            assert (diff <= bound).all(), f"world {world}: max excess {float((diff - bound).max())}"
            assert float(diff.norm()) <= rms
            doubled = (y_tp.double() + full.bias.double() - y_full.double()).abs()
            a, b = S.shard_range(256, 0, world)
            lone = cw.W8A8Linear.from_quantized(S.shard_cols(full.weight, 0, world), full.weight_scale,
                                                bias=full.bias, input_scale=full.input_scale)(x[:, a:b].contiguous())
            assert float(doubled.norm()) > rms and float((lone.double() - y_full.double()).norm()) > rms
            if quant == torch.int8:
                assert (doubled > bound).float().mean() > 0.5


# ---- two processes, gloo -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def core():
    """Rank 0's and rank 1's results of tests/_tp_scenarios.cpu_core_cases."""
    res = run_workers(scen.cpu_core_cases, WORLD, timeout_s=TIMEOUT_S, group_timeout_s=60)
    return [r.value for r in res]


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_column_parallel_is_the_full_layer_sliced(core, q):
    for rank in range(WORLD):
        d = ok_value(core[rank]["layers"][q])
        rows = kept_rows(rank)
        assert d["types"] == ["ColumnParallelW8A8Linear", "ColumnParallelW8A8Linear", "RowParallelW8A8Linear"]
        assert d["in_out"] == [(128, 48), (64, 96)]
        assert torch.equal(d["col_w"], d["full_w"][rows]) and torch.equal(d["col_s"], d["full_s"][rows])
        assert torch.equal(d["col_b"], d["full_b"][rows])
        assert torch.equal(d["col_y"], d["full_y"][:, rows])
        assert torch.equal(d["colg_y"], d["full_y"])  # gathered back into q, k, v order


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_row_parallel_is_the_sum_of_partials_plus_bias_once(core, q):
    d0, d1 = (ok_value(core[r]["layers"][q]) for r in range(WORLD))
    expected = (d0["row_partial"] + d1["row_partial"]) + d0["full_b"]
    for d in (d0, d1):
        assert torch.equal(d["row_y"], expected)
        assert torch.equal(d["row_s"], d["full_s"])  # the full per-channel scale on every rank
    assert torch.equal(torch.cat([as_fp8(d0["row_w"]), as_fp8(d1["row_w"])], 1).view(torch.uint8),
                       d0["full_w"].view(torch.uint8))


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_row_parallel_within_the_derived_bound(core, q):
    d = ok_value(core[0]["layers"][q])
    w, s, b = as_fp8(d["full_w"]), d["full_s"], d["full_b"]
    bound = row_parallel_bound(d["x"], w, s, WORLD, bias=b)
    diff = (d["row_y"].double() - d["full_y"].double()).abs()
    assert (diff <= bound).all(), float((diff - bound).max())
    assert float(diff.norm()) <= row_parallel_rms_bound(d["x"], w, s, WORLD, bias=b)
    static = row_parallel_bound(d["x"], w, s, WORLD, bias=b, input_scale=d["static_scale"])
    assert ((d["static_row_y"].double() - d["static_full_y"].double()).abs() <= static).all()


@pytest.mark.parametrize("q", ["int8", "fp8"])
def test_row_parallel_input_forms_agree(core, q):
    """A QuantizedActivation of the rank's slice (what decode_attention_quant / silu_mul_quant give it) and the
    full input with input_is_parallel=False give exactly the float-slice result."""
    for rank in range(WORLD):
        d = ok_value(core[rank]["layers"][q])
        assert torch.equal(d["row_q_y"], d["row_y"])
        assert torch.equal(d["row_full_input_y"], d["row_y"])


def test_float_parallel_layers(core):
    for rank in range(WORLD):
        d = ok_value(core[rank]["layers"]["float"])
        mag = d["x"].double().abs() @ d["w"].double().abs().t()
        u, k = 2.0**-24, 128
        col_bound = 2 * k * u * mag  # two float32 dot products of length K
        assert ((d["colg_y"].double() - d["full_y"].double()).abs() <= col_bound).all()
        row_bound = (k + k // 2 + 1) * u * mag + 2 * u * (mag + d["b"].double().abs())
        assert ((d["row_y"].double() - d["full_y"].double()).abs() <= row_bound).all()


@pytest.mark.parametrize("name", sorted(scen.ERRORS))
def test_misuse_raises_the_same_error_on_every_rank(core, name):
    import re

    got = [core[r]["errors"][name] for r in range(WORLD)]
    assert got[0][0] == "error", f"{name}: rank 0 did not raise"
    assert got[0][1] == "ValueError" and re.search(scen.ERRORS[name], got[0][2]), got[0]
    assert got[1] == got[0]


def test_group_works_after_the_errors(core):
    assert [ok_value(core[r]["errors"]["group_still_works"]) for r in range(WORLD)] == [3.0, 3.0]


@pytest.mark.parametrize("name", ["int8", "fp8", "float32", "int8_replicated_lm_head", "int8_kv1", "float32_kv1"])
def test_decoder_shard_structure(core, name):
    for rank in range(WORLD):
        d = ok_value(core[rank]["decoder"][name])
        assert d["same_weights"]  # TensorParallelLlamaDecoder(...) == shard_decoder_(full model of the same seed)
        # 4 query / 2 key-value heads over 2 ranks; with one key-value head (kv1) it is replicated: also (2, 1)
        assert d["heads"] == (2, 1)
        assert d["kv_cache_shape"] == (5, 2, 1, 32, 32)
        assert d["use_layer_op"] == [False, False]
        par = ["ColumnParallelW8A8Linear", "RowParallelW8A8Linear"] if not name.startswith("float32") else \
            ["ColumnParallelLinear", "RowParallelLinear"]
        assert set(par) <= set(d["types"])
        # lm_head: sharded over the vocabulary by default, replicated on request
        assert d["lm_head"] == ("Linear" if name.endswith("replicated_lm_head") else "ColumnParallelLinear")
        # the runner (eager on the CPU, batch 3 padded to its bucket 4) gives the model's rows: exactly for W8A8
        # (the CPU GEMM sums in float64), within float32 summation order for float32 (BLAS blocks by M)
        for a, b, c in zip(d["runner"], d["runner_eager"], d["tp"]):
            assert torch.equal(a, b)
            if name.startswith("float32"):
                assert float((a - c).norm() / c.norm()) <= FLOAT32_TP_REL
            else:
                assert torch.equal(a, c)


@pytest.mark.parametrize("name", ["float32", "float32_kv1"])
def test_decoder_float32_tp_equals_tp1(core, name):
    """Also with one key/value head replicated on both ranks (kv1): a rank holding the wrong key/value head, or
    attention grouping its query heads wrongly, would change the logits by far more than the summation order."""
    for rank in range(WORLD):
        d = ok_value(core[rank]["decoder"][name])
        l1, l2 = torch.stack(d["full"]), torch.stack(d["tp"])
        assert float((l2 - l1).norm() / l1.norm()) <= FLOAT32_TP_REL


@pytest.mark.parametrize("name", ["int8", "fp8", "int8_replicated_lm_head", "int8_kv1"])
def test_decoder_w8a8_tp_vs_tp1(core, name):
    d0, d1 = (ok_value(core[r]["decoder"][name]) for r in range(WORLD))
    for key in ("full", "tp"):  # replicated logits: identical on both ranks
        assert all(torch.equal(a, b) for a, b in zip(d0[key], d1[key]))
    l1, l2, lf = (torch.stack(d0[k]).double() for k in ("full", "tp", "ref"))
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    assert e1 / float(lf.norm()) < 0.1  # the reference is the right one (W8A8 error of a few percent)
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    assert float((l2 - l1).norm()) <= (1 + TP_VS_TP1_ACCURACY) * e1
    assert not torch.equal(l1, l2)  # the shards' own activation scales did act


@pytest.mark.parametrize("case", ["all", "up_float"])
def test_quantize_with_tp_group(core, case):
    for rank in range(WORLD):
        d = ok_value(core[rank]["quantize"][case])
        up = "ColumnParallelW8A8Linear" if case == "all" else "ColumnParallelLinear"
        if case == "up_float":
            assert d["requantize"] == ("error", "TypeError", "quantize_: up_proj is already a tensor-parallel shard "
                                       "(ColumnParallelLinear); quantize the full model, with tp_group=..., instead")
        assert d["types"] == {"gate_proj": "ColumnParallelW8A8Linear", "up_proj": up,
                              "down_proj": "RowParallelW8A8Linear"}
        # gate and up are exact column slices, so only down_proj's shard quantization separates TP from TP=1
        bound = row_parallel_bound(d["hidden"], d["down_w"], d["down_s"], WORLD, bias=d["down_b"])
        diff = (d["tp_y"].double() - d["full_y"].double()).abs()
        assert (diff <= bound).all()
        assert float(diff.norm()) <= row_parallel_rms_bound(d["hidden"], d["down_w"], d["down_s"], WORLD,
                                                            bias=d["down_b"])


# ---- two processes, gloo, transformers models -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from _checkpoints import scheme, tiny_model, write_ct_checkpoint

    path = str(tmp_path_factory.mktemp("tp_ckpt") / "llama_int8")
    write_ct_checkpoint(tiny_model("llama"), scheme("W8A8"), path)
    path_kv1 = str(tmp_path_factory.mktemp("tp_ckpt_kv1") / "llama_kv1_int8")
    write_ct_checkpoint(tiny_model("llama", seed=1, num_key_value_heads=1), scheme("W8A8"), path_kv1)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    res = run_workers(scen.hf_cases, WORLD, args=(path, ids, path_kv1), timeout_s=TIMEOUT_S, group_timeout_s=60)
    return path, ids, [r.value for r in res], path_kv1


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


def _check_tp_accuracy(l1, l2, lf):
    e1, e2 = float((l1 - lf).norm()), float((l2 - lf).norm())
    assert e1 / float(lf.norm()) < 0.1
    assert e2 <= TP_VS_TP1_ACCURACY * e1, (e1, e2)
    assert float((l2 - l1).norm()) <= (1 + TP_VS_TP1_ACCURACY) * e1


def test_from_pretrained_tp_reads_only_its_shards(hf):
    from _checkpoints import stored_tensors

    path, _, res, _ = hf
    stored = stored_tensors(path)
    planned = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
               "lm_head": 0}  # lm_head: this rank's vocab / 2 rows
    for rank in range(WORLD):
        d = ok_value(res[rank]["from_pretrained"])
        reads = {(name, kind): shape for name, kind, shape in d["reads"]}
        for key, t in stored.items():
            module, _, leaf = key.rpartition(".")
            proj = module.rsplit(".", 1)[-1]
            if proj in planned and leaf == "weight":
                n, k = t.shape
                assert (key, "whole") not in reads, f"{key} was read whole"
                assert reads[(key, "slice")] == ((n // 2, k) if planned[proj] == 0 else (n, k // 2))
            else:
                assert (key, "whole") in reads or (key, "slice") in reads, f"{key} was not read"
        assert d["types"]["lm_head"] == "ColumnParallelLinear" and d["types"]["model.layers.1.mlp.down_proj"] == \
            "RowParallelW8A8Linear"


def test_from_pretrained_tp_weights_are_the_stored_slices(hf):
    from _checkpoints import stored_tensors

    path, _, res, _ = hf
    st = stored_tensors(path)
    pre = "model.layers.0."
    for rank in range(WORLD):
        d = ok_value(res[rank]["from_pretrained"])
        q, o, down = (st[pre + k + ".weight"] for k in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"))
        assert torch.equal(d["q_w"], q[rank * 32:(rank + 1) * 32])
        assert torch.equal(d["q_s"], st[pre + "self_attn.q_proj.weight_scale"].reshape(-1)[rank * 32:(rank + 1) * 32])
        assert torch.equal(d["o_w"], o[:, rank * 32:(rank + 1) * 32])
        assert torch.equal(d["o_s"], st[pre + "self_attn.o_proj.weight_scale"].reshape(-1))
        assert torch.equal(d["down_w"], down[:, rank * 64:(rank + 1) * 64])


def test_from_pretrained_tp_logits_vs_tp1(hf):
    path, ids, res, _ = hf
    full = cw.from_pretrained(path, optimize=False)  # as the TP load (not optimized): same layers
    l1 = _logits(full, ids)
    lf = _logits(scen.dequantized_float_model(full), ids)
    l2 = [ok_value(res[r]["from_pretrained"])["logits"].double() for r in range(WORLD)]
    assert torch.equal(l2[0], l2[1])
    _check_tp_accuracy(l1, l2[0], lf)


def test_quantize_tp_on_a_transformers_model(hf):
    from _checkpoints import tiny_model

    _, ids, res, _ = hf
    full = cw.quantize_(tiny_model("llama", seed=0), filter_fn=lambda m, fqn: fqn != "lm_head")
    l1 = _logits(full, ids)
    lf = _logits(scen.dequantized_float_model(full), ids)
    d = [ok_value(res[r]["quantize_"]) for r in range(WORLD)]
    assert d[0]["q_type"] == "ColumnParallelW8A8Linear" and d[0]["o_type"] == "RowParallelW8A8Linear"
    assert torch.equal(d[0]["logits"], d[1]["logits"])
    _check_tp_accuracy(l1, d[0]["logits"].double(), lf)


# ---- key/value heads fewer than the ranks: replicated ---------------------------------------------------------


def test_kv_replicas_rule():
    assert [S.kv_replicas(8, kvh, 4) for kvh in (8, 4, 2, 1)] == [1, 1, 2, 4]
    assert S.column_rows([64, 16, 16], 3, 4, [1, 4, 4]) == [(48, 64), (64, 80), (80, 96)]  # head 0 on every rank
    assert [S.column_rows([64, 32, 32], r, 4, [1, 2, 2])[1] for r in range(4)] == [(64, 80)] * 2 + [(80, 96)] * 2
    with pytest.raises(ValueError, match=r"`config.num_key_value_heads` = 3 and the tensor-parallel world size 2 "
                                         r"divide neither way"):
        S.kv_replicas(6, 3, 2)
    with pytest.raises(ValueError, match=r"`config.num_attention_heads` = 6 is not divisible by the tensor-parallel "
                                         r"world size 4"):
        S.kv_replicas(6, 2, 4)
    with pytest.raises(ValueError, match=r"`replicas\[1\]` = 3 does not divide the tensor-parallel world size 4"):
        S.check_column_shardable(96, 64, 4, [64, 16, 16], replicas=[1, 3, 3])


def test_from_pretrained_tp_replicates_one_kv_head(hf):
    """One key/value head at TP=2: both ranks hold the whole k_proj / v_proj (head 0) and half the query heads,
    attention groups the rank's 2 query heads on it, and the logits meet the TP criterion against TP=1."""
    from _checkpoints import stored_tensors

    _, ids, res, path = hf
    st = stored_tensors(path)
    full = cw.from_pretrained(path, optimize=False)  # as the TP load (not optimized): same layers
    l1 = _logits(full, ids)
    lf = _logits(scen.dequantized_float_model(full), ids)
    d = [ok_value(res[r]["from_pretrained_kv1"]) for r in range(WORLD)]
    pre = "model.layers.0.self_attn."
    for rank in range(WORLD):
        assert d[rank]["k_type"] == "ColumnParallelW8A8Linear" and d[rank]["groups"] == 2
        assert torch.equal(d[rank]["k_w"], st[pre + "k_proj.weight"]) and torch.equal(d[rank]["v_w"],
                                                                                      st[pre + "v_proj.weight"])
        assert torch.equal(d[rank]["q_w"], st[pre + "q_proj.weight"][rank * 32:(rank + 1) * 32])
    assert torch.equal(d[0]["logits"], d[1]["logits"])
    _check_tp_accuracy(l1, d[0]["logits"].double(), lf)


def test_tensor_parallel_float32_one_kv_head_equals_tp1(hf):
    """Float32, one key/value head replicated at TP=2: only the summation order of the row-parallel layers and the
    2-way reduce differ from TP=1 (the FLOAT32_TP_REL criterion of the decoder)."""
    from _checkpoints import tiny_model

    _, ids, res, _ = hf
    l1 = _logits(tiny_model("llama", seed=1, num_key_value_heads=1).float(), ids)
    for rank in range(WORLD):
        d = ok_value(res[rank]["float_kv1"])
        assert d["groups"] == 2
        assert float((d["logits"].double() - l1).norm() / l1.norm()) <= FLOAT32_TP_REL
