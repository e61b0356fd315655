"""Nothing the checkpoint tools do loses a checkpoint or writes one that does not load (issue 33):

- the ``quantize`` CLI never writes into its source, refuses a non-empty DST without ``--overwrite``, writes into a
  temporary directory and renames it at the end (a failed run leaves no DST, or the old one intact);
- what it cannot quantize is refused before anything is written, with exit status 2 and a message naming it: an
  MoE block other than the supported ones (PhiMoE: sparsemixer routing), transformers' Conv1D (GPT-2), a head transformers would
  initialize randomly (BERT), ``--device gpu``;
- ``save_pretrained`` refuses, before writing, a model whose checkpoint ``from_pretrained`` would refuse, and checks
  the written files' headers after writing;
- ``from_pretrained`` given a file, ``device="gpu"``, or a checkpoint missing weights of the model.

Tiny float checkpoints (hidden 64, 1 layer) written into temporary directories; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import cli, from_pretrained, save_pretrained  # noqa: E402

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


def _quiet():
    transformers.logging.set_verbosity_error()


def _float_checkpoint(path, kind: str = "llama") -> str:
    """A random tiny float checkpoint of ``kind`` (llama, phimoe, gpt2, bert) at ``path``."""
    _quiet()
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY))
    elif kind == "phimoe":  # an MoE block of no family: its sparsemixer routing is not a top-k moe_route computes
        model = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**_TINY, num_local_experts=4,
                                                                         num_experts_per_tok=2))
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=64, bos_token_id=1, eos_token_id=2))
    elif kind == "bert":  # the encoder alone, as bert-base-uncased stores it for BertModel: no LM head
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64))
    else:
        raise ValueError(kind)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _snapshot(root) -> dict:
    """``{relative path: sha256}`` of every file under ``root``, and every directory (value None)."""
    out = {}
    for dp, dns, fns in os.walk(root):
        for d in dns:
            out[os.path.relpath(os.path.join(dp, d), root)] = None
        for f in fns:
            with open(os.path.join(dp, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dp, f), root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _leftovers(parent) -> list:
    """Temporary directories the writers left in ``parent`` (their names start with a dot)."""
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def _quant_method(path) -> str:
    with open(os.path.join(path, "config.json")) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    return groups["group_0"]["weights"]["type"]


# ---- CLI: paths ----------------------------------------------------------------------------------------------


def test_quantize_into_its_source_is_refused_and_leaves_it_byte_identical(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "llama")
    before = _snapshot(src)
    assert cli.main(["quantize", src, src]) == 2
    assert "is SRC" in capsys.readouterr().err
    assert cli.main(["quantize", src, str(tmp_path / "llama" / ".." / "llama"), "--overwrite"]) == 2  # same realpath
    os.symlink(src, tmp_path / "link")
    assert cli.main(["quantize", str(tmp_path / "link"), src, "--overwrite"]) == 2  # through a link
    assert _snapshot(src) == before


def test_dst_inside_src_and_src_inside_dst_are_refused(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "llama")
    before = _snapshot(src)
    assert cli.main([src, os.path.join(src, "int8")]) == 2
    assert "lies inside SRC" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(src, "int8"))
    assert cli.main([src, str(tmp_path), "--overwrite"]) == 2
    assert f"SRC {src} lies inside DST {tmp_path}" in capsys.readouterr().err
    assert _snapshot(src) == before


def test_non_empty_dst_needs_overwrite_which_replaces_it_whole(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "llama")
    dst = tmp_path / "out"
    assert cli.main([src, str(dst), "--scheme", "int8"]) == 0
    assert _quant_method(dst) == "int"
    (dst / "stale.txt").write_text("from an earlier run")
    before = _snapshot(dst)
    # refused without --overwrite: nothing changes
    assert cli.main([src, str(dst), "--scheme", "fp8"]) == 2
    err = capsys.readouterr().err
    assert f"DST {dst} exists and is not empty" in err and "--overwrite to replace it" in err
    assert _snapshot(dst) == before
    # --overwrite: the old directory replaced as a whole (its stray file gone), no temporary directory left
    assert cli.main([src, str(dst), "--scheme", "fp8", "--overwrite"]) == 0
    assert _quant_method(dst) == "float" and not (dst / "stale.txt").exists()
    assert _leftovers(tmp_path) == []
    assert isinstance(from_pretrained(dst).model.layers[0].mlp.down_proj, cw.W8A8Linear)
    # a non-empty directory that is not a checkpoint is never replaced
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    assert cli.main([src, str(other), "--overwrite"]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    assert (other / "a.txt").read_text() == "mine"
    # an empty existing directory is used as is
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([src, str(empty)]) == 0 and (empty / "model.safetensors").is_file()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failure_mid_save_leaves_no_dst_or_the_old_one(tmp_path, monkeypatch, overwrite):
    src = _float_checkpoint(tmp_path / "llama")
    dst = tmp_path / "out"
    if overwrite:
        assert cli.main([src, str(dst)]) == 0
    before = _snapshot(dst) if overwrite else None
    real = transformers.PreTrainedModel.save_pretrained

    def half_then_fail(self, path, **kw):
        real(self, path, **kw)  # the files are there ...
        raise KeyboardInterrupt  # ... and the run is interrupted before the end

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", half_then_fail)
    args = [src, str(dst), "--scheme", "fp8"] + (["--overwrite"] if overwrite else [])
    with pytest.raises(KeyboardInterrupt):
        cli.main(args)
    assert (_snapshot(dst) == before) if overwrite else not dst.exists()
    assert _leftovers(tmp_path) == []


# ---- CLI: refused models, before anything is written ---------------------------------------------------------


def test_unsupported_moe_block_is_refused_before_writing(tmp_path, capsys):
    from cutlass_w8a8.moe.families import block_classes, family_names

    src = _float_checkpoint(tmp_path / "phimoe", "phimoe")
    dst = tmp_path / "out"
    assert cli.main([src, str(dst)]) == 2
    err = capsys.readouterr().err
    assert "MoE block 'model.layers.0.mlp' (PhimoeSparseMoeBlock) is not supported" in err
    assert f"supported MoE blocks: {', '.join(block_classes())} ({family_names()})" in " ".join(err.split())
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_conv1d_model_is_refused_naming_conv1d(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "gpt2", "gpt2")
    assert cli.main([src, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "GPT2LMHeadModel holds 4 transformers Conv1D layers (transformer.h.0.attn.c_attn" in err
    assert "Conv1D (GPT-2's linear layer, weight stored [K, N]) is not supported" in err
    assert "no linear was quantized" not in err
    assert not (tmp_path / "out").exists()


def test_randomly_initialized_head_is_refused(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "bert", "bert")
    assert cli.main([src, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds no weights for ['cls.predictions.bias'" in err and "of BertLMHeadModel" in err
    assert "transformers would initialize them randomly" in err
    assert not (tmp_path / "out").exists()


def test_device_gpu_asks_for_cuda(tmp_path, capsys):
    src = _float_checkpoint(tmp_path / "llama")
    assert cli.main([src, str(tmp_path / "out"), "--device", "gpu"]) == 2
    assert "`--device` is 'gpu'; did you mean 'cuda'?" in capsys.readouterr().err
    assert cli.main([src, str(tmp_path / "out"), "--device", "banana"]) == 2
    assert "neither a torch device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_help_states_exit_statuses_and_loaders(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Exit status: 0 written and checked; 1 the source cannot be quantized or written" in out
    assert "2 refused: bad usage" in out
    assert "tested with transformers 5.17 and 5.24" in out


# ---- from_pretrained messages --------------------------------------------------------------------------------


def _quantized_checkpoint(path) -> str:
    _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)).to(torch.bfloat16)
    cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    save_pretrained(model, path)
    return str(path)


def test_from_pretrained_messages(tmp_path):
    path = _quantized_checkpoint(tmp_path / "q")
    with pytest.raises(ValueError, match=r"`path` '.*model\.safetensors' is a file; pass the folder that holds "
                                         r"config\.json"):
        from_pretrained(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"`path` '.*config\.json' is a file; pass the folder that holds config"):
        cw.from_pretrained(os.path.join(path, "config.json"))
    with pytest.raises(ValueError, match=r"`device` is 'gpu'; did you mean 'cuda'\?"):
        from_pretrained(path, device="gpu")
    with pytest.raises(ValueError, match=r"`device` is 'gpu:1'; did you mean 'cuda:1'\?"):
        cw.from_pretrained(path, device="gpu:1")


def test_from_pretrained_refuses_missing_weights(tmp_path):
    """A checkpoint without weights the model needs (here lm_head, untied) would be completed with random ones
    by transformers: refused, naming them."""
    from safetensors.torch import load_file, save_file

    path = _quantized_checkpoint(tmp_path / "q")
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["lm_head.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds no weights for \['lm_head\.weight'\] of LlamaForCausalLM; "
                                         r"transformers would initialize them randomly"):
        from_pretrained(path)


# ---- save_pretrained: what the loader would refuse is not written ----------------------------------------------


def _fused_like(model):
    """``model`` with layer 0's q_proj moved to a module name the architecture does not have (as a fused
    ``qkv_proj`` would be)."""
    attn = model.model.layers[0].self_attn
    attn.qkv_proj = attn.q_proj
    del attn.q_proj
    return model


@pytest.mark.parametrize("saver", ["checkpoints", "top-level"])
def test_save_refuses_what_the_loader_would_refuse_and_writes_nothing(tmp_path, saver):
    _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)).to(torch.bfloat16)
    cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    _fused_like(model)
    dst = tmp_path / "out"
    save = save_pretrained if saver == "checkpoints" else cw.save_pretrained
    with pytest.raises(ValueError, match=r"^cutlass_w8a8\.save_pretrained: `model` gives a checkpoint that "
                                         r"cutlass_w8a8\.from_pretrained would refuse, so nothing was written to "
                                         r"'.*out': the checkpoint has no tensor "
                                         r"'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        save(model, dst)
    assert not dst.exists() and _leftovers(tmp_path) == []
    # an existing directory is left as it was
    dst.mkdir()
    (dst / "keep.txt").write_text("kept")
    with pytest.raises(ValueError, match=r"so nothing was written to"):
        save(model, dst)
    assert os.listdir(dst) == ["keep.txt"]


def test_save_refuses_moe_outside_a_known_block_and_writes_nothing(tmp_path):
    cfg = transformers.Qwen3MoeConfig(**_TINY, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                      decoder_sparse_step=1, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    block = model.model.layers[0].mlp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    block.__class__ = type("OtherMoeBlock", (nn.Module,), {"forward": block.forward})
    from cutlass_w8a8.moe.families import family_names

    with pytest.raises(ValueError, match=r"W8A8MoE 'model\.layers\.0\.mlp\.experts' is not the `experts` of a "
                                         + re.escape(family_names("or")) + r" block \(its parent is OtherMoeBlock\)"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_save_checks_the_written_files(tmp_path, monkeypatch):
    """What transformers' save_pretrained wrote is checked from the files' headers: a tensor lost on the way (here
    removed by a patched writer) is caught and nothing reaches ``path``."""
    from safetensors.torch import load_file, save_file

    _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)).to(torch.bfloat16)
    cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    real = transformers.PreTrainedModel.save_pretrained

    def lossy(self, path, **kw):
        real(self, path, **kw)
        f = os.path.join(path, "model.safetensors")
        tensors = load_file(f)
        tensors["model.layers.0.mlp.up_proj.weight_scale"] = tensors["model.layers.0.mlp.up_proj.weight_scale"][:8]
        save_file(tensors, f, metadata={"format": "pt"})

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", lossy)
    with pytest.raises(ValueError, match=r"`model` was written by transformers' save_pretrained as files that "
                                         r"cutlass_w8a8\.from_pretrained would refuse, so nothing was written to "
                                         r"'.*out': checkpoint tensor "
                                         r"'model\.layers\.0\.mlp\.up_proj\.weight_scale' is F32 \[8, 1\]"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_an_interrupted_save_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """``save_pretrained`` into an existing checkpoint directory, interrupted once transformers has written its
    files: the directory keeps its old files, byte for byte, and no temporary directory is left."""
    _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)).to(torch.bfloat16)
    cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    dst = tmp_path / "out"
    save_pretrained(model, dst)
    before = _snapshot(dst)
    real = transformers.PreTrainedModel.save_pretrained

    def interrupted(self, path, **kw):
        real(self, path, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_pretrained(model, dst, max_shard_size="20KB")  # would have written shards and an index
    assert _snapshot(dst) == before and _leftovers(tmp_path) == []


def test_save_into_an_earlier_checkpoint_replaces_its_weight_files(tmp_path):
    """A save into a directory holding a sharded checkpoint: the old shards and index are removed (a stale index
    would be read instead of the new file), other files kept."""
    _quiet()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)).to(torch.bfloat16)
    cw.quantize_(model, cw.W8A8Config(), filter_fn=lambda m, fqn: fqn != "lm_head")
    dst = tmp_path / "out"
    save_pretrained(model, dst, max_shard_size="20KB")
    assert (dst / "model.safetensors.index.json").is_file()
    (dst / "README.md").write_text("notes")
    save_pretrained(model, dst)
    assert sorted(os.listdir(dst)) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert isinstance(from_pretrained(dst).model.layers[0].self_attn.q_proj, cw.W8A8Linear)
