"""The checkpoint CLI (`python -m cutlass_w8a8.checkpoints` / `cutlass_w8a8.checkpoints.cli.main`): quantize a
float transformers checkpoint into a compressed-tensors one, ignore patterns, and what it refuses.

The float checkpoint is a tiny random Qwen2 with a word-level tokenizer, in a temporary directory; nothing is
downloaded.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import from_pretrained  # noqa: E402
from cutlass_w8a8.checkpoints import cli  # noqa: E402

from _checkpoints import VOCAB, _ids, _logits, _transformers_load, _w8a8_modules, tiny_model  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# the CLI


def _write_float_checkpoint(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tiny_model("qwen2", seed=4)
    model.save_pretrained(path)
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0").save_pretrained(path)
    return model


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_cli_quantize(tmp_path, dtype, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_float_checkpoint(src)
    assert cli.main(["quantize", str(src), str(dst), "--dtype", dtype]) == 0
    assert "linears quantized" in capsys.readouterr().out
    assert os.path.isfile(dst / "tokenizer.json") and os.path.isfile(dst / "tokenizer_config.json")
    model = from_pretrained(dst)
    mods = _w8a8_modules(model)
    assert len(mods) == 14 and isinstance(model.lm_head, nn.Linear)
    qd = torch.int8 if dtype == "int8" else torch.float8_e4m3fn
    assert all(m.quant_dtype == qd and m.input_scale is None and m.per_channel for m in mods.values())
    expect = cw.quantize_(_transformers_load(src, dtype=torch.bfloat16), cw.W8A8Config(dtype=qd),
                          filter_fn=lambda m, fqn: fqn != "lm_head")
    assert torch.equal(_logits(model, _ids()), _logits(expect, _ids()))


def test_cli_ignore_patterns_and_refusals(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _write_float_checkpoint(src)
    assert cli.main([str(src), str(dst), "--ignore", "lm_head", "re:.*mlp\\.down_proj$",
                     "model.layers.0.self_attn.q_proj"]) == 0
    model = from_pretrained(dst)
    floats = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    assert floats == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
                      "model.layers.1.mlp.down_proj"]
    assert cli.main([str(dst), str(tmp_path / "again")]) == 1  # already quantized
    assert "already quantized" in capsys.readouterr().err


def test_cli_refuses_before_loading(tmp_path, capsys):
    """What used to fail only after the model was loaded and quantized is refused first, with the reason: a DST
    that is a file (save_pretrained logged a line and wrote nothing, then NotADirectoryError; exit status 2, a
    usage error), --device cuda on a torch without CUDA (AssertionError from torch), a config.json that is not
    JSON (a bare JSONDecodeError; both exit status 1)."""
    src = tmp_path / "src"
    _write_float_checkpoint(src)
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    assert cli.main([str(src), str(a_file)]) == 2
    assert (f"python -m cutlass_w8a8 quantize: DST {a_file} is an existing file, not a directory; give a directory"
            in capsys.readouterr().err)
    assert a_file.read_text() == "kept"

    dst = tmp_path / "dst"
    with mock.patch.object(torch.cuda, "is_available", return_value=False), \
            mock.patch.object(torch.backends.cuda, "is_built", return_value=False):
        assert cli.main([str(src), str(dst), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m cutlass_w8a8 quantize: `--device` is 'cuda', but this torch build has no CUDA "
                          "support")
    assert err.rstrip().endswith("or load on the CPU with --device cpu")
    assert not dst.exists()

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen2",')
    assert cli.main([str(bad), str(dst)]) == 1
    err = capsys.readouterr().err
    assert f"python -m cutlass_w8a8 quantize: {bad / 'config.json'} is not valid JSON: " in err
    assert "repair the file or download the checkpoint again" in err
    assert not dst.exists()
