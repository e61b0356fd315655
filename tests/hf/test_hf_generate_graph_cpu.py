"""`cutlass_w8a8.generate` / `cutlass_w8a8.hf.GraphGenerator` with ``step="transformers"`` (the model's own forward as
the decode step) on the CPU (no graphs: the same steps run eagerly), on tiny transformers models
(tests/_hf_tiny.py), optimized W8A8 and plain bf16 (the ``"cw"`` step: tests/hf/test_hf_decode_step_cpu.py):

- greedy tokens equal ``model.generate(..., do_sample=False)``'s given a ``StaticCache`` of the same length (the
  same attention arithmetic: with the same masks the logits are bit for bit those of transformers' loop), for a
  left-padded batch that runs in a larger bucket, with ``sdpa`` and ``eager`` attention;
- sampling (temperature, top_k, top_p) draws the same tokens from the same torch seed;
- EOS: rows that finished get ``pad_token_id``, the output stops when every row has finished, as transformers';
- the refusals: unsupported keywords (named), right padding, too long for the cache, attention implementations
  and sliding-window models it does not run.
"""

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import left_padded_batch, optimized, tiny_model  # noqa: E402

from cutlass_w8a8.hf import GraphGenerator  # noqa: E402

CACHE = 48
NEW = 8


def _model(kind="llama", scheme="int8", attn="sdpa", **kw):
    return optimized(kind, scheme, attn=attn, **kw)


_batch = left_padded_batch


def _hf(model, ids, am, **kw):
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    return model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=kw.pop("max_new_tokens", NEW),
                          **kw)


@pytest.mark.parametrize("kind,scheme,attn", [("llama", "int8", "sdpa"), ("llama", "int8", "eager"),
                                              ("qwen3", "fp8", "sdpa"), ("qwen2", "int8", "sdpa"),
                                              ("mistral", "fp8-block", "sdpa"), ("llama", None, "sdpa")])
def test_greedy_tokens_equal_transformers(kind, scheme, attn):
    model = _model(kind, scheme, attn)
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    assert not gen.use_graphs and gen.bucket_size(3) == 4
    ours = gen.generate(ids, NEW, attention_mask=am, do_sample=False)
    ref = _hf(model, ids, am, do_sample=False)
    assert ours.shape == (3, 7 + NEW)
    assert torch.equal(ours, ref)
    # a second call reuses the bucket (its cache is reset) and gives the same tokens
    assert torch.equal(gen.generate(ids, NEW, attention_mask=am), ours)
    assert list(gen.warmup_seconds) == [4]


def test_batch_one_without_mask_equals_transformers():
    model = _model("qwen3", "int8")
    ids, _ = _batch(b=1)
    ours = cw.generate(model, ids, NEW, max_cache_len=CACHE, step="transformers")
    ref = _hf(model, ids, torch.ones_like(ids), do_sample=False)
    assert torch.equal(ours, ref)


def test_sampling_draws_transformers_tokens():
    model = _model("llama", "int8")
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    kw = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(123)
    ref = _hf(model, ids, am, **kw)
    torch.manual_seed(123)
    ours = gen.generate(ids, NEW, attention_mask=am, **kw)
    assert torch.equal(ours, ref)
    torch.manual_seed(124)
    assert not torch.equal(gen.generate(ids, NEW, attention_mask=am, **kw), ours)  # it does sample


def test_eos_pads_finished_rows_and_stops_early():
    model = _model("llama", "int8")
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    free = gen.generate(ids, NEW, attention_mask=am)
    eos = int(free[0, 7 + 2])  # row 0's third new token
    ours = gen.generate(ids, NEW, attention_mask=am, eos_token_id=eos, pad_token_id=0)
    ref = _hf(model, ids, am, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(ours, ref)
    assert (ours[0, 7 + 3:] == 0).all()
    # every row ends on its first new token: transformers stops after one token, and so does generate
    first = gen.generate(ids, NEW, attention_mask=am)[:, 7].tolist()
    out = gen.generate(ids, NEW, attention_mask=am, eos_token_id=first, pad_token_id=0)
    assert out.shape == (3, 8) and torch.equal(out, _hf(model, ids, am, do_sample=False, eos_token_id=first,
                                                          pad_token_id=0))


def test_generation_config_defaults_apply():
    model = _model("llama", "int8")
    ids, am = _batch()
    model.generation_config.do_sample = True
    model.generation_config.top_k = 5
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    torch.manual_seed(7)
    ref = _hf(model, ids, am)
    torch.manual_seed(7)
    assert torch.equal(gen.generate(ids, NEW, attention_mask=am), ref)


def test_generate_keeps_its_generator_on_the_model():
    model = _model("llama", "int8", layers=1)
    ids, _ = _batch(b=2)
    cw.generate(model, ids, 4, max_cache_len=CACHE)
    gen = model.__dict__["_cw_graph_generator"]
    cw.generate(model, ids, 4)
    assert model.__dict__["_cw_graph_generator"] is gen
    cw.generate(model, ids, 60)  # longer than the cache: a new generator, its length rounded up to 256
    assert model.__dict__["_cw_graph_generator"].max_cache_len == 256


def test_refusals():
    model = _model("llama", "int8", layers=1)
    ids, am = _batch()
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    with pytest.raises(ValueError, match=r"unsupported argument\(s\) \['repetition_penalty'\]; supported: "):
        gen.generate(ids, 2, repetition_penalty=1.2)
    with pytest.raises(ValueError, match=r"`attention_mask` must be left-padded"):
        gen.generate(ids, 2, attention_mask=am.flip(1))
    with pytest.raises(ValueError, match=r"`attention_mask` must hold only 0 and 1"):
        gen.generate(ids, 2, attention_mask=am * 2)
    with pytest.raises(ValueError, match=r"exceeds the cache's max_cache_len = 48"):
        gen.generate(ids, CACHE, attention_mask=am)
    with pytest.raises(ValueError, match=r"`max_new_tokens` must be >= 1, got 0"):
        gen.generate(ids, 0)
    with pytest.raises(TypeError, match=r"`input_ids` must be an integer tensor"):
        gen.generate(ids.float(), 2)
    with pytest.raises(ValueError, match=r"`top_p` must be in \(0, 1\], got 1.5"):
        gen.generate(ids, 2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number > 0, got 0"):
        gen.generate(ids, 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"`use_graphs=True` needs the model on a CUDA device, it is on cpu"):
        GraphGenerator(model, use_graphs=True)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"`model.config._attn_implementation` must be one of \('sdpa', 'eager'\), "
                                         r"got 'flex_attention'"):
        GraphGenerator(model, step="transformers")


def test_sliding_window_model_is_refused():
    model = tiny_model("mistral", layers=1)
    model.config.sliding_window = 16
    gen = GraphGenerator(model, max_cache_len=CACHE, step="transformers")
    ids, am = _batch()
    with pytest.raises(ValueError, match=r"sliding-window attention layers"):
        gen.generate(ids, 2, attention_mask=am)


@pytest.mark.full  # 7-15 s each on 2 CPU cores (W8A8MoE's CPU references at every decode step)
@pytest.mark.parametrize("kind,scheme", [("deepseek_v3", "int8"), ("glm4_moe", "fp8-block"), ("olmoe", "int8")])
def test_moe_families_greedy_tokens_equal_transformers(kind, scheme):
    """The MoE families' case of tests/hf/test_hf_generate_graph_cuda.py (`_moe_greedy_case`: a tiny quantized
    DeepSeek-V3 / GLM-4.5 / OLMoE, the transformers step) with the steps run eagerly on the CPU: the tokens are
    transformers' ``generate`` tokens with a ``StaticCache``, bit for bit (the same arithmetic on the CPU)."""
    import test_hf_generate_graph_cuda as gpu_cases

    ours, ref = gpu_cases._moe_greedy_case(kind, scheme, "cpu")
    assert torch.equal(ours, ref.sequences)
