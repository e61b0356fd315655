"""Which loaders read what ``python -m cutlass_w8a8 quantize`` writes (its ``--help`` and docs/LOADERS.md), checked
cell by cell: every scheme (int8, fp8, fp8-block) of every model family (Llama, Mistral, Qwen2, Qwen3; Qwen2-MoE,
Qwen3-MoE, Mixtral), written by `save_pretrained` (what the CLI calls), read by

- ours, `cutlass_w8a8.checkpoints.from_pretrained`: the same modules (W8A8Linear, W8A8MoE) holding the same buffers
  bit for bit (the round trips of tests/checkpoints/test_checkpoints_save.py and test_checkpoints_moe.py compare logits too);
- plain transformers, ``AutoModelForCausalLM.from_pretrained``, where `cli.TRANSFORMERS_READS` says it reads the
  output: no missing, unexpected or mismatched keys; every quantized linear holding our stored 8-bit weight and our
  scales in the model dtype (compressed-tensors creates its scale parameters in bf16); MoE experts dequantized to
  bf16 on load, equal to ours dequantized (float32 product rounded to bf16); finite logits. Where it says
  transformers does not read it (int8 and fp8-block MoE experts), the load raises; that is asserted for the
  transformers versions the claim was tested with (`cli.TRANSFORMERS_TESTED`) only.

vLLM is described by format only and not tested here. Tiny random models (1 layer; 2 experts of 128, top-1).
"""

from __future__ import annotations

import copy
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytest.importorskip("safetensors")

import cutlass_w8a8 as cw  # noqa: E402
from cutlass_w8a8.checkpoints import cli, from_pretrained, save_pretrained  # noqa: E402

SCHEMES = {
    "int8": cw.W8A8Config(dtype=torch.int8),
    "fp8": cw.W8A8Config(dtype=torch.float8_e4m3fn),
    "fp8-block": cw.W8A8Config(dtype=torch.float8_e4m3fn, weight_block_size=(128, 128)),
}
# Every projection spans at least two 128 x 128 blocks along N or K (a single block would make a block scale a
# per-tensor one, which readers that do not expand blocks still get right): dense hidden 128 with MLP 256, MoE
# hidden 256 with 2 experts of 128 (top-1).
_COMMON = dict(vocab_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DENSE = dict(_COMMON, hidden_size=128, intermediate_size=256)
_MOE = dict(_COMMON, hidden_size=256, intermediate_size=128, num_experts_per_tok=1)
CONFIGS = {
    "Llama": lambda: transformers.LlamaConfig(**_DENSE),
    "Mistral": lambda: transformers.MistralConfig(**_DENSE, sliding_window=None),
    "Qwen2": lambda: transformers.Qwen2Config(**_DENSE),
    "Qwen3": lambda: transformers.Qwen3Config(**_DENSE),
    "Qwen2-MoE": lambda: transformers.Qwen2MoeConfig(**_MOE, moe_intermediate_size=128, num_experts=2,
                                                     shared_expert_intermediate_size=128, decoder_sparse_step=1),
    "Qwen3-MoE": lambda: transformers.Qwen3MoeConfig(**_MOE, moe_intermediate_size=128, num_experts=2,
                                                     decoder_sparse_step=1, norm_topk_prob=True),
    "Mixtral": lambda: transformers.MixtralConfig(**_MOE, num_local_experts=2),
    # DeepSeek-V3's MLA at K multiples of 128 (q_a N 128; q_b, kv_b, o N 256; kv_a N 128 + 32 = 160, a partial
    # block), one shared expert, sigmoid routing with one group
    "DeepSeek-V3": lambda: transformers.DeepseekV3Config(
        **dict(_MOE, num_key_value_heads=4), moe_intermediate_size=128, n_routed_experts=2, n_shared_experts=1, first_k_dense_replace=0,
        n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32),
    "GLM-4.5": lambda: transformers.Glm4MoeConfig(**_MOE, moe_intermediate_size=128, n_routed_experts=2,
                                                  n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                                                  topk_group=1),
    # OLMoE's q / k norms span all heads (hidden_size): 8 heads of 32
    "OLMoE": lambda: transformers.OlmoeConfig(**dict(_MOE, num_attention_heads=8, num_key_value_heads=8), num_experts=2),
}
GROUP = {family: group for group, families in cli.FAMILIES.items() for family in families}


def _tested_transformers() -> bool:
    return ".".join(transformers.__version__.split(".")[:2]) in cli.TRANSFORMERS_TESTED


def _model(family: str):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.bfloat16).eval()
    with torch.no_grad():  # transformers' init leaves the norms at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model


def _transformers_load(path):
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)


def _check_transformers_model(ours, theirs, info, moe: bool):
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    n_lin = n_moe = 0
    for name, m in ours.named_modules():
        if isinstance(m, cw.W8A8Linear):
            lin = theirs.get_submodule(name)
            assert lin.weight.dtype == m.weight.dtype, name
            assert torch.equal(lin.weight.view(torch.uint8), m.weight.view(torch.uint8)), name
            assert torch.equal(lin.weight_scale.reshape(-1), m.weight_scale.reshape(-1).to(torch.bfloat16)), name
            n_lin += 1
        elif isinstance(m, cw.W8A8MoE):
            experts = theirs.get_submodule(name)
            for got, w, s in ((experts.gate_up_proj, m.w13, m.w13_scale), (experts.down_proj, m.w2, m.w2_scale)):
                assert torch.equal(got, (w.float() * s.unsqueeze(-1)).to(torch.bfloat16)), name
            n_moe += 1
        elif isinstance(m, torch.nn.Linear):
            assert torch.equal(theirs.get_submodule(name).weight, m.weight), name
    assert n_lin > 0 and (n_moe > 0) == moe
    with torch.no_grad():
        assert torch.isfinite(theirs(torch.arange(2, 10).reshape(1, 8)).logits).all()


def _same_tensor(model, key, a, b) -> bool:
    """``b`` (loaded) holds ``a`` (``model``'s) bit for bit; or, for a tensor transformers keeps in float32 whatever
    the model dtype (``model._keep_in_fp32_modules_strict``: DeepSeek-V3's ``e_score_correction_bias``, which
    transformers 5.17's ``from_config`` builds in bf16 and its loader, as ours, reads into float32), ``a`` in
    float32 exactly."""
    if a.dtype == b.dtype:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    keep = [p for p in getattr(model, "_keep_in_fp32_modules_strict", None) or () if p in key]
    return bool(keep) and b.dtype == torch.float32 and torch.equal(b, a.float())


@pytest.mark.parametrize("family", list(CONFIGS))
def test_what_reads_the_output(tmp_path, family):
    base = _model(family)
    for scheme, config in SCHEMES.items():
        ours = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Qwen2-MoE's shared_expert_gate (N = 1) left in float
            cw.quantize_(ours, config, filter_fn=lambda m, fqn: fqn != "lm_head")
        assert (GROUP[family] == "MoE") == any(isinstance(m, cw.W8A8MoE) for m in ours.modules())
        path = tmp_path / scheme
        save_pretrained(ours, path)
        where = f"{family} {scheme}"

        back = from_pretrained(path)  # ours: the same modules holding the same buffers, bit for bit
        assert {n: type(m) for n, m in ours.named_modules()} == {n: type(m) for n, m in back.named_modules()}, where
        sa, sb = ours.state_dict(), back.state_dict()
        assert sa.keys() == sb.keys(), where
        assert all(_same_tensor(ours, k, sa[k], sb[k]) for k in sa), where

        if scheme in cli.TRANSFORMERS_READS[GROUP[family]]:
            theirs, info = _transformers_load(path)
            _check_transformers_model(ours, theirs, info, GROUP[family] == "MoE")
        elif _tested_transformers():
            with pytest.raises((RuntimeError, ValueError)):
                _transformers_load(path)


def _table_rows(text: str) -> dict:
    """``{family group: [cell per scheme]}`` of the loaders table of the CLI's docstring."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s+[\w., -]+\((dense|MoE)\)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = re.split(r"\s{2,}", m.group(2).strip())
    return rows


def test_the_help_and_docs_state_what_the_tests_check():
    rows = _table_rows(cli.__doc__)
    assert set(rows) == set(cli.FAMILIES)
    for group, cells in rows.items():
        assert len(cells) == len(SCHEMES)
        for scheme, cell in zip(SCHEMES, cells):
            assert cell.split(", ") == ["ours"] + (["tf"] if scheme in cli.TRANSFORMERS_READS[group] else []) + \
                ["vLLM"], (group, scheme, cell)
    assert f"tested with transformers {' and '.join(cli.TRANSFORMERS_TESTED)}" in " ".join(cli.__doc__.split())
    docs = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "LOADERS.md")
    with open(docs) as f:
        text = f.read()
    for group, families in cli.FAMILIES.items():
        for family in families:
            row = next(line for line in text.splitlines() if line.startswith(f"| {family} "))
            cells = [c.strip() for c in row.strip("|").split("|")][1:]
            for scheme, cell in zip(SCHEMES, cells):
                assert ("transformers" in cell and "not" not in cell) == (scheme in cli.TRANSFORMERS_READS[group]), \
                    (family, scheme, cell)
