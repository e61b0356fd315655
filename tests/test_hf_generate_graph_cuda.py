"""`cutlass_w8a8.generate` / `GraphGenerator` on a GPU with CUDA graphs, on tiny optimized W8A8 transformers models
(tests/_hf_tiny.py): each decode step's logits replayed from the bucket's graph equal the same steps run eagerly
bit for bit (the capture records the eager kernels), and the greedy tokens equal ``model.generate``'s with a
``StaticCache`` of the same length. Skips without a GPU and the compiled extension (conftest's ``cuda`` marker)."""

import pytest
import torch

import cutlass_w8a8 as cw

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from _hf_tiny import quantized, tiny_model  # noqa: E402

from cutlass_w8a8.hf import GraphGenerator, optimize_  # noqa: E402

pytestmark = pytest.mark.cuda

CACHE = 64
NEW = 12
SCHEMES = ["int8", "fp8", pytest.param("fp8-block", marks=pytest.mark.sm90)]


def _model(kind, scheme, attn="sdpa"):
    if scheme != "int8" and not cw.supports_fp8():
        pytest.skip("no fp8 kernels on this device")
    return optimize_(quantized(tiny_model(kind, attn=attn), scheme).to("cuda"))


def _batch(b=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 256, (b, length), generator=g)
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[2, :1] = 0
    return ids.masked_fill(am == 0, 0).cuda(), am.cuda()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_replay_equals_eager_steps(kind, scheme, attn):
    model = _model(kind, scheme, attn)
    ids, am = _batch()
    graphed = GraphGenerator(model, max_cache_len=CACHE)
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False)
    assert graphed.use_graphs
    graphed.record_logits = eager.record_logits = True
    out_g = graphed.generate(ids, NEW, attention_mask=am)
    assert graphed._buckets[4].graph is not None and 4 in graphed.warmup_seconds
    out_e = eager.generate(ids, NEW, attention_mask=am)
    assert torch.equal(out_g, out_e)
    assert len(graphed.logits_history) == len(eager.logits_history) == NEW
    for i, (g, e) in enumerate(zip(graphed.logits_history, eager.logits_history)):
        assert torch.equal(g, e), f"step {i}"
    # a second call replays the same graphs on new prompts
    ids2, am2 = _batch(seed=1)
    assert torch.equal(graphed.generate(ids2, NEW, attention_mask=am2), eager.generate(ids2, NEW, attention_mask=am2))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers(kind, scheme):
    model = _model(kind, scheme)
    ids, am = _batch()
    ours = cw.generate(model, ids, NEW, attention_mask=am, max_cache_len=CACHE)
    cache = transformers.StaticCache(config=model.config, max_cache_len=CACHE)
    ref = model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(ours, ref)


def test_batch_above_the_buckets_gets_its_own_graph():
    model = _model("llama", "int8")
    ids = torch.randint(2, 256, (3, 5), generator=torch.Generator().manual_seed(2)).cuda()
    gen = GraphGenerator(model, max_cache_len=CACHE, max_batch=2)
    assert gen.bucket_size(3) == 3
    eager = GraphGenerator(model, max_cache_len=CACHE, use_graphs=False, max_batch=2)
    assert torch.equal(gen.generate(ids, 6), eager.generate(ids, 6))
    assert gen._buckets[3].graph is not None
