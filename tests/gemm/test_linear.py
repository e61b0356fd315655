"""W8A8Linear and quantize_: construction, the module swap, state_dict, and the forward pass."""

import io
import sys
import warnings

import pytest
import torch
from torch import nn

import cutlass_w8a8 as cw
from cutlass_w8a8.testing.references import assert_close_to_reference, reference


def mlp(d=64, hidden=128, dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d, bias=False)).to(device, dtype)


def expected_forward(mod: cw.W8A8Linear, x):
    """float64 reference of the layer from its dequantized operands (weights and quantized activations)."""
    x2 = x.reshape(-1, mod.in_features)
    if mod.input_scale is None:
        q, s = torch.ops.cutlass_w8a8.quantize_per_token(x2, mod.quant_dtype)
    else:
        q, s = torch.ops.cutlass_w8a8.quantize_per_tensor(x2, mod.input_scale, mod.quant_dtype), mod.input_scale
    return reference(q, mod.weight.t(), s, mod.weight_scale, mod.bias)


def test_from_float_quantizes_per_channel():
    lin = nn.Linear(64, 48).bfloat16()
    mod = cw.W8A8Linear.from_float(lin)
    assert mod.weight.dtype == torch.int8 and mod.weight.shape == (48, 64)
    assert mod.weight_scale.shape == (48,) and mod.weight_scale.dtype == torch.float32
    w = lin.weight.float()
    torch.testing.assert_close(mod.weight_scale, w.abs().amax(1) / 127, rtol=0, atol=0)
    deq = mod.weight.float() * mod.weight_scale[:, None]
    assert ((deq - w).abs() <= mod.weight_scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(mod.bias, lin.bias)


def test_constructor_checks():
    with pytest.raises(ValueError, match="`in_features`"):
        cw.W8A8Linear(60, 32)
    with pytest.raises(ValueError, match="`out_features`"):
        cw.W8A8Linear(64, 0)
    with pytest.raises(TypeError, match="`dtype`"):
        cw.W8A8Linear(64, 32, dtype=torch.float32)
    with pytest.raises(TypeError, match="`quant_dtype`"):
        cw.W8A8Linear(64, 32, quant_dtype=torch.uint8)
    with pytest.raises(ValueError, match="in_features = 64"):
        cw.W8A8Linear(64, 32)(torch.randn(2, 32, dtype=torch.bfloat16))


def test_quantize_swaps_and_skips_with_warning():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Sequential(nn.Linear(128, 40), nn.Linear(40, 64)))
    model = model.bfloat16()
    with pytest.warns(UserWarning) as record:
        cw.quantize_(model)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "leaving module '2.0' in float: in_features=128 and out_features=40" in messages[0]
    assert "leaving module '2.1' in float: in_features=40 and out_features=64" in messages[1]
    assert {w.filename for w in record} == {__file__}  # stacklevel: the caller's line, not quantize.py
    assert isinstance(model[0], cw.W8A8Linear)
    assert isinstance(model[2][0], nn.Linear) and not isinstance(model[2][0], cw.W8A8Linear)
    assert isinstance(model[2][1], nn.Linear)  # K = 40


def test_quantize_warning_names_a_numbered_module_at_the_callers_line():
    """A module named by its index reads as a module, not a count ("leaving module '4'", not "leaving 4"), and
    the warning points at the line that called quantize_, for a bare Linear too."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.Linear(64, 10))
    with pytest.warns(UserWarning) as record:
        cw.quantize_(model); line = sys._getframe().f_lineno  # noqa: E702
    assert [str(w.message) for w in record] == [
        "quantize_: leaving module '4' in float: in_features=64 and out_features=10 must be multiples of 16"]
    assert (record[0].filename, record[0].lineno) == (__file__, line)
    with pytest.warns(UserWarning, match="leaving the model in float") as record:
        lin = nn.Linear(40, 64)
        assert cw.quantize_(lin) is lin; line = sys._getframe().f_lineno  # noqa: E702
    assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_quantize_tied_weight_warning_names_both_modules():
    emb = nn.Embedding(32, 64)
    model = nn.ModuleDict({"embed": emb, "head": nn.Linear(64, 32, bias=False)})
    model["head"].weight = emb.weight
    with pytest.warns(UserWarning) as record:
        cw.quantize_(model)
    assert [str(w.message) for w in record] == [
        "quantize_: leaving module 'head' in float: its weight is shared with module 'embed' (tied embeddings); "
        "quantizing it would untie them"]
    assert record[0].filename == __file__


def test_quantize_on_a_quantized_model_warns_when_it_matches():
    """A second quantize_ with the same config changes nothing and says so (it used to be silent)."""
    model = cw.quantize_(mlp())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for config in (None, cw.W8A8Config(), cw.W8A8Config(out_dtype=torch.bfloat16)):
        with pytest.warns(UserWarning, match=r"already quantized: its 2 W8A8Linear layer\(s\) match `config`") as rec:
            assert cw.quantize_(model, config) is model
        assert rec[0].filename == __file__
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.warns(UserWarning, match="already quantized: its 1 W8A8Linear"):
        cw.quantize_(model[0])  # a bare W8A8Linear


def test_quantize_on_a_quantized_model_raises_for_another_scheme():
    """An int8 model asked for fp8 (or another output dtype) raises, naming `config` and the module, instead of
    keeping the int8 layers silently; a filter_fn that leaves them out makes a mixed model."""
    model = cw.quantize_(mlp())
    with pytest.raises(ValueError, match=r"^quantize_: `config` asks for dtype=torch.float8_e4m3fn but module '0' "
                                         r"is already a W8A8Linear with quant_dtype=torch.int8; "):
        cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"asks for out_dtype=torch.float16 but module '0' .* dtype=torch.bfloat16"):
        cw.quantize_(model, cw.W8A8Config(out_dtype=torch.float16))
    mixed = mlp()
    cw.quantize_(mixed, filter_fn=lambda m, fqn: fqn == "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cw.quantize_(mixed, cw.W8A8Config(dtype=torch.float8_e4m3fn), filter_fn=lambda m, fqn: fqn == "2")
    assert (mixed[0].quant_dtype, mixed[2].quant_dtype) == (torch.int8, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="module '2' is already a W8A8Linear with quant_dtype=torch.float8_e4m3fn"):
        cw.quantize_(mixed)  # no filter_fn: every layer must match


def test_quantize_on_a_block_quantized_model_compares_the_block_size():
    block = cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128))
    model = cw.quantize_(nn.Sequential(nn.Linear(256, 256)).bfloat16(), block)
    with pytest.warns(UserWarning, match="already quantized"):
        cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=[128, 128]))
    with pytest.raises(ValueError, match=r"asks for weight_block_size=None but module '0' is already a W8A8Linear "
                                         r"with weight_block_size=\(128, 128\)"):
        cw.quantize_(model, cw.W8A8Config(dtype=torch.float8_e4m3fn))


def test_quantize_filter_fn_gets_module_and_fqn():
    model = mlp()
    seen = []

    def only_first(module, fqn):
        seen.append((type(module).__name__, fqn))
        return fqn == "0"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cw.quantize_(model, filter_fn=only_first)
    assert seen == [("Linear", "0"), ("Linear", "2")]
    assert isinstance(model[0], cw.W8A8Linear) and type(model[2]) is nn.Linear


def test_state_dict_round_trip():
    model = cw.quantize_(mlp())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = nn.Sequential(cw.W8A8Linear(64, 128), nn.SiLU(), cw.W8A8Linear(128, 64, bias=False))
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), model(x))


def test_static_input_scale_round_trip():
    lin = nn.Linear(64, 32).bfloat16()
    mod = cw.W8A8Linear.from_float(lin, input_scale=torch.tensor(0.05))
    assert mod.input_scale.item() == pytest.approx(0.05)
    sd = mod.state_dict()
    assert "input_scale" in sd
    fresh = cw.W8A8Linear(64, 32, static_input_scale=True)
    fresh.load_state_dict(sd)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), mod(x))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_forward_matches_reference(device, static):
    lin = nn.Linear(256, 512).to(device, torch.bfloat16)
    mod = cw.W8A8Linear.from_float(lin, input_scale=torch.tensor(0.03, device=device) if static else None)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16, device=device)
    y = mod(x)
    assert y.shape == (2, 7, 512) and y.dtype == torch.bfloat16
    ref = expected_forward(mod, x)
    assert_close_to_reference(y.reshape(-1, 512), ref, torch.bfloat16, what="W8A8Linear")
    # and the quantized layer stays close to the float layer (SQNR in dB)
    y_float = lin(x).float()
    sqnr = 10 * torch.log10(y_float.pow(2).mean() / (y.float() - y_float).pow(2).mean())
    assert sqnr > 30, f"SQNR {sqnr:.1f} dB"


def test_float32_model_output_dtype():
    lin = nn.Linear(64, 32)
    mod = cw.W8A8Linear.from_float(lin)
    assert mod.dtype == torch.bfloat16
    y = mod(torch.randn(4, 64))
    assert y.dtype == torch.float32


@pytest.mark.cuda
def test_quantized_mlp_cuda_matches_cpu():
    """The same quantized model gives the same numbers on the GPU as with the CPU reference ops."""
    model_cpu = cw.quantize_(mlp(256, 512))
    model_gpu = cw.quantize_(mlp(256, 512, device="cuda"))
    for (k, v1), v2 in zip(model_cpu.state_dict().items(), model_gpu.state_dict().values()):
        assert torch.equal(v1, v2.cpu()), k  # weight quantization is bit-exact on both
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    y_cpu, y_gpu = model_cpu(x).float(), model_gpu(x.cuda()).float().cpu()
    rel = (y_gpu - y_cpu).norm() / y_cpu.norm()
    assert rel < 1e-2, rel
