"""fp8_fast_accum (issue 37): the choice between row-wise fp8's fast-accumulation and accurate sm90 configs, from
W8A8Config through W8A8Linear to the ops' schema argument; its default decided once (ops/_limits.py FP8_FAST_ACCUM)."""

import copy
import dataclasses
import pickle
from unittest import mock

import pytest
import torch

import cutlass_w8a8 as cw
from cutlass_w8a8.ops import _limits
from cutlass_w8a8.ops._schema import OVERLOADS

FP8 = torch.float8_e4m3fn


def test_schema_default_is_the_one_constant():
    """scaled_mm, scaled_mm_out and w8a8_linear take `bool fp8_fast_accum` last, defaulting to FP8_FAST_ACCUM; so do
    the wrapper and W8A8Config."""
    for op in ("scaled_mm", "scaled_mm_out", "w8a8_linear"):
        arg = getattr(torch.ops.cutlass_w8a8, op).default._schema.arguments[-1]
        assert arg.name == "fp8_fast_accum" and str(arg.type) == "bool", op
        assert arg.default_value is _limits.FP8_FAST_ACCUM, op
    import inspect

    assert inspect.signature(cw.scaled_mm).parameters["fp8_fast_accum"].default is _limits.FP8_FAST_ACCUM
    assert cw.W8A8Config().fp8_fast_accum is _limits.FP8_FAST_ACCUM
    assert cw.W8A8Linear(64, 32).fp8_fast_accum is _limits.FP8_FAST_ACCUM


@pytest.mark.parametrize("fast", [True, False])
def test_config_round_trips(fast):
    """The field is in the repr, survives copy / pickle / dataclasses.replace, and is part of equality."""
    c = cw.W8A8Config(dtype=FP8, fp8_fast_accum=fast)
    assert f"fp8_fast_accum={fast}" in repr(c)
    assert pickle.loads(pickle.dumps(c)) == c == copy.deepcopy(c)
    assert dataclasses.replace(c, out_dtype=torch.float16).fp8_fast_accum is fast
    assert c != dataclasses.replace(c, fp8_fast_accum=not fast)


@pytest.mark.parametrize("bad", [None, 1, 0.0, "False", torch.tensor(True)])
def test_config_refuses_non_bool(bad):
    with pytest.raises(TypeError, match=r"W8A8Config: `fp8_fast_accum` must be a bool .*, got "):
        cw.W8A8Config(dtype=FP8, fp8_fast_accum=bad)
    with pytest.raises(TypeError, match=r"W8A8Linear: `fp8_fast_accum` must be a bool"):
        cw.W8A8Linear(64, 32, quant_dtype=FP8, fp8_fast_accum=bad)


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_wrapper_refuses_non_bool(bad):
    """The dispatcher would turn None / 1 into a bool (and a string into a RuntimeError): the wrapper checks first."""
    a = torch.randint(-8, 8, (4, 64), dtype=torch.int8)
    w = torch.randint(-8, 8, (32, 64), dtype=torch.int8)
    with pytest.raises(TypeError, match=r"scaled_mm: `fp8_fast_accum` must be a bool .*, got "):
        cw.scaled_mm(a, w.t(), torch.ones(4, 1), torch.ones(32), fp8_fast_accum=bad)
    with pytest.raises(TypeError, match=r"scaled_mm: `fp8_fast_accum` must be a bool"):
        cw.scaled_mm(a, w.t(), torch.ones(4, 1), torch.ones(32), out=torch.empty(4, 32, dtype=torch.bfloat16),
                     fp8_fast_accum=bad)


@torch.no_grad()
def test_cpu_result_does_not_depend_on_the_flag():
    """The CPU reference accumulates exact products in float32: both settings give the same bits (on sm90 they
    pick two kernel families, tests/gemm/test_scaled_mm_cuda.py)."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(8, 256, generator=g) * 4).to(FP8)
    w = (torch.randn(64, 256, generator=g) * 4).to(FP8)
    sa, sb = torch.rand(8, 1, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5
    fast = cw.scaled_mm(a, w.t(), sa, sb, fp8_fast_accum=True)
    accurate = cw.scaled_mm(a, w.t(), sa, sb, fp8_fast_accum=False)
    assert torch.equal(fast, accurate)
    x = torch.randn(8, 256, generator=g).to(torch.bfloat16)
    y1 = OVERLOADS.w8a8_linear(x, w, sb, None, None, torch.bfloat16, True)
    y0 = OVERLOADS.w8a8_linear(x, w, sb, None, None, torch.bfloat16, False)
    assert torch.equal(y1, y0)


@pytest.mark.parametrize("fast", [True, False])
@torch.no_grad()
def test_layer_passes_its_setting_to_the_ops(fast):
    """quantize_ with the config -> each W8A8Linear keeps fp8_fast_accum and hands it to w8a8_linear (float input)
    and scaled_mm (QuantizedActivation); the repr names it where it differs from the default."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, dtype=torch.bfloat16))
    cw.quantize_(model, cw.W8A8Config(dtype=FP8, fp8_fast_accum=fast))
    layer = model[0]
    assert isinstance(layer, cw.W8A8Linear) and layer.fp8_fast_accum is fast
    assert ("fp8_fast_accum=" in repr(layer)) == (fast != _limits.FP8_FAST_ACCUM)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    import cutlass_w8a8.linear as linear_mod

    seen = []
    real_linear, real_mm = linear_mod._w8a8_linear, linear_mod._op.scaled_mm

    def spy_linear(*args):
        seen.append(("w8a8_linear", args[-1]))
        return real_linear(*args)

    def spy_mm(*args):
        seen.append(("scaled_mm", args[-1]))
        return real_mm(*args)

    with mock.patch.object(linear_mod, "_w8a8_linear", spy_linear):
        layer(x)
    q, s = cw.quantize_fp8(x)
    with mock.patch.object(linear_mod._op, "scaled_mm", spy_mm):
        layer(cw.QuantizedActivation(q, s))
    assert seen == [("w8a8_linear", fast), ("scaled_mm", fast)]


def test_quantize_again_with_another_setting_is_refused():
    """A quantized model given quantize_ again with the other fp8_fast_accum is refused (never silently kept)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, dtype=torch.bfloat16))
    cw.quantize_(model, cw.W8A8Config(dtype=FP8, fp8_fast_accum=True))
    with pytest.raises(ValueError, match=r"asks for fp8_fast_accum=False but module '0' is already a W8A8Linear with "
                                         r"fp8_fast_accum=True"):
        cw.quantize_(model, cw.W8A8Config(dtype=FP8, fp8_fast_accum=False))
    with pytest.warns(UserWarning, match="already quantized"):  # the same config: nothing to do
        cw.quantize_(model, cw.W8A8Config(dtype=FP8, fp8_fast_accum=True))
