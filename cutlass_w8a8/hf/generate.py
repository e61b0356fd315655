"""`generate` / `GraphGenerator`: transformers ``generate`` (greedy and sampling) for a transformers causal LM,
with the decode steps replayed from CUDA graphs on a ``StaticCache``, without torch.compile.

Per batch-size bucket (`cutlass_w8a8.runner.cuda_graph_batch_sizes`: 1, 2, 4, then multiples of 8 up to
``max_batch``; a larger batch gets a bucket of its own size), on first use: a ``transformers.StaticCache`` of
``max_cache_len`` positions, static input buffers (``tokens`` ``(b, 1)``, ``positions`` ``(b, 1)`` int64, the
key-validity row ``valid`` ``(b, max_cache_len)`` bool) and, on CUDA, one decode step captured with
`cutlass_w8a8.graphs.capture` (warm-up on a side stream, one shared memory pool for all buckets: the runner's
`cutlass_w8a8.runner.GraphPool`, the buckets chosen by its `cutlass_w8a8.runner.bucket_for`). A call then:

1. pads the batch up to its bucket (extra rows: pad tokens, all valid; their tokens are dropped), resets the
   cache, and runs the prefill eagerly through ``model.forward`` with the 2-D ``attention_mask`` and
   ``position_ids = cumsum(attention_mask) - 1`` (0 on padding), as transformers' ``generate`` does;
2. per new token: picks it from the last logits (float32) as transformers does (greedy ``argmax``; sampling:
   transformers' own ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` in that order, then
   ``softmax`` and ``torch.multinomial``), replaces it by ``pad_token_id`` in rows that already produced an EOS,
   writes it into the static ``tokens``, advances ``positions`` and marks the new cache column valid (``copy_`` /
   in-place writes), and replays the graph (or runs the same step eagerly: on the CPU, or ``use_graphs=False``).

Two decode steps (``step=``):

- ``"cw"`` (chosen by ``"auto"`` for an `optimize_`d model that `DecodeStep.why_not` accepts): `DecodeStep`, the
  package's decoder-layer code over the model's own fused modules and weights (fused residual-add + norm +
  quantization, one rotary + KV-write kernel, split-KV decode attention with ``o_proj``'s quantization fused, the
  four GEMMs; on per-token / per-tensor layers one ``decode_layer`` op per layer) on a KV cache of its own
  ``(slots, 2, KVH, max_cache_len, D)`` per layer, one for all buckets. The prefill runs through ``model.forward``
  on a ``DynamicCache`` as below; its keys and values are then copied into that cache, each left-padded row moved
  to start at column 0, so that column = position. Logits equal transformers' eager step up to bf16 rounding (not
  bit for bit: see `cutlass_w8a8.hf.decode_step`).
- ``"transformers"`` (any other model, or asked for): the model's own forward, captured, as follows.

The transformers decode step is ``model(input_ids=tokens, position_ids=positions, attention_mask=mask, <cache>=cache,
use_cache=True)`` with a 4-D mask built inside the step from ``valid``, in the form transformers builds it for
the model's ``attn_implementation``: bool ``(b, 1, 1, max_cache_len)`` (True = attend) for ``sdpa``, additive
``0 / finfo(dtype).min`` in the model dtype for ``eager``. transformers returns a 4-D mask unchanged, so no mask
code with host synchronisation runs in the captured step. The StaticCache keeps its write position in a device
tensor that the step advances in place, so replays need no host state.

Supported: decoder-only transformers causal LMs whose cache layers are all full attention (no sliding window:
transformers' sliding ``StaticCache`` layers keep a host-side length), left-padded batches; with the
transformers step, ``attn_implementation`` ``"sdpa"`` or ``"eager"`` (the ``"cw"`` step's prefill runs whatever
the model is set to). Options: `SUPPORTED_GENERATE_KWARGS`; anything else is a ValueError naming it.
Defaults come from ``model.generation_config`` and then transformers' own defaults (``do_sample=False``,
``temperature=1.0``, ``top_k=50``, ``top_p=1.0``), as ``model.generate`` resolves them; other fields of
``model.generation_config`` (repetition penalty, ...) are not applied.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..runner import GraphPool, bucket_for, bucket_sizes, cuda_graph_batch_sizes
from .decode_step import DecodeStep

__all__ = ["generate", "GraphGenerator", "SUPPORTED_GENERATE_KWARGS"]

SUPPORTED_GENERATE_KWARGS = ("attention_mask", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                             "pad_token_id", "generator")
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
_ATTN = ("sdpa", "eager")
_STEPS = ("auto", "cw", "transformers")
# how often (in steps) the loop reads back whether every row has produced an EOS (one host sync each time)
_EOS_CHECK_EVERY = 8


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


class _Bucket:
    """One batch-size bucket: its StaticCache, static inputs and (on CUDA) captured decode step."""

    def __init__(self, size: int):
        self.size = size
        self.cache = None
        self.tokens = self.positions = self.valid = None
        self.graph = None
        self.logits = None  # the graph's static output (b, V)
        self.slots = None  # the "cw" step's cache slots 0 .. b - 1


class GraphGenerator:
    """Decode-step CUDA graphs of a transformers causal LM, one per batch-size bucket, and ``generate`` over them.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only causal LM (``LlamaForCausalLM``, ...; optimized by `cutlass_w8a8.optimize_` or not), in
        eval mode, all on one device, ``config._attn_implementation`` ``"sdpa"`` or ``"eager"``.
    max_cache_len : int
        StaticCache length: prompt length + ``max_new_tokens`` - 1 must fit (default 4096, capped at
        ``config.max_position_embeddings`` when that is smaller).
    max_batch : int
        Largest bucket of the default buckets (default 8).
    sizes : sequence of int, optional
        The buckets; default ``cuda_graph_batch_sizes(max_batch)``. The model's kernel-family bounds below the
        largest are added (`cutlass_w8a8.runner.bucket_sizes`), so a bucket's graph runs the GEMM kernels eager
        runs for every batch it holds.
    use_graphs : bool, optional
        Capture and replay CUDA graphs (default: when the model is on a CUDA device). False runs the same
        steps eagerly (the CPU path, and the reference the graph tests compare with).
    warmup : int
        Eager decode steps on the side stream before each capture (default 2).
    step : {"auto", "cw", "transformers"}
        The decode step (module docstring). ``"auto"`` (default): ``"cw"`` when `DecodeStep.why_not` accepts the
        model, else ``"transformers"``.

    Attributes
    ----------
    step : str
        The step chosen: ``"cw"`` or ``"transformers"``.
    requested_step : str
        The ``step`` argument (``"auto"``, ``"cw"`` or ``"transformers"``).
    step_reason : str or None
        Why ``step="auto"`` chose ``"transformers"`` (`DecodeStep.why_not`'s reason); None otherwise.
    warmup_seconds : dict
        ``{bucket size: seconds}`` spent creating each bucket (cache allocation, warm-up and capture; host time,
        the GPU work queued by then not waited for).
    record_logits : bool
        Set to True to keep, in ``logits_history``, a float32 clone of the real rows' logits that picked each new
        token of the last ``generate`` call (the graph-vs-eager tests compare them). Default False.
    logits_history : list of torch.Tensor
        ``(B, V)`` float32 per new token, on the model's device, when ``record_logits``.

    Warnings
    --------
    On an H100 (bench_hf at Llama-3-8B dims, 2026-11-27), ``torch.compile(mode="reduce-overhead")`` models were
    stepped between replays of these graphs (or of `cutlass_w8a8.runner.DecodeGraphRunner`'s). A later compiled step
    then failed with an illegal memory access. The probable cause is a captured bf16 GEMM's cuBLAS workspace: it was
    allocated outside the graph, and torch.compile's graph trees free it. `cutlass_w8a8.graphs.capture` now
    allocates that workspace inside the graph's pool (see its module docstring). That fix has not yet been run on a
    GPU (tests/graphs/test_graphs_cublas_workspace_cuda.py, scripts/repro_compile_and_graphs.py).

    Raises
    ------
    TypeError
        ``model`` is not an ``nn.Module`` with a ``config``.
    ValueError
        ``max_cache_len`` / ``max_batch`` / ``sizes`` not positive; ``step`` not one of the three, or ``"cw"`` on
        a model `DecodeStep` does not run (the message gives its reason); ``attn_implementation`` not supported
        by the transformers step; ``use_graphs=True`` on a model that is not on a CUDA device.
    """

    def __init__(self, model: nn.Module, *, max_cache_len: Optional[int] = None, max_batch: int = 8,
                 sizes=None, use_graphs: Optional[bool] = None, warmup: int = 2, step: str = "auto"):
        if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
            raise TypeError(f"GraphGenerator: `model` must be a transformers model (an nn.Module with a config), "
                            f"got {type(model).__name__}")
        cfg = model.config
        if getattr(cfg, "is_encoder_decoder", False):
            raise ValueError("GraphGenerator: `model` must be a decoder-only causal LM, got an encoder-decoder")
        if step not in _STEPS:
            raise ValueError(f"GraphGenerator: `step` must be one of {_STEPS}, got {step!r}")
        why = DecodeStep.why_not(model)
        if step == "cw" and why is not None:
            raise ValueError(f"GraphGenerator: step='cw' cannot run this model: {why}")
        self.requested_step = step
        self.step = "cw" if why is None and step != "transformers" else "transformers"
        self.step_reason = why if step == "auto" and self.step == "transformers" else None
        attn = getattr(cfg, "_attn_implementation", None)
        if self.step == "transformers" and attn not in _ATTN:
            raise ValueError(f"GraphGenerator: `model.config._attn_implementation` must be one of {_ATTN}, got "
                             f"{attn!r} (load the model with attn_implementation='sdpa')")
        if max_cache_len is None:
            max_cache_len = min(4096, getattr(cfg, "max_position_embeddings", 4096) or 4096)
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"GraphGenerator: `max_cache_len` must be a positive int, got {max_cache_len!r}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"GraphGenerator: `max_batch` must be a positive int, got {max_batch!r}")
        sizes = sorted(set(cuda_graph_batch_sizes(max_batch) if sizes is None else sizes))
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"GraphGenerator: `sizes` must be positive ints, got {sizes!r}")
        sizes = bucket_sizes(model, sizes[-1], sizes)  # the dispatch bounds added: graph == eager at every batch
        self.device = _model_device(model)
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise ValueError(f"GraphGenerator: `use_graphs=True` needs the model on a CUDA device, it is on "
                             f"{self.device}")
        import inspect

        import transformers

        self._transformers = transformers
        self.model = model
        self.max_cache_len = max_cache_len
        self.sizes = sizes
        self.use_graphs = bool(use_graphs)
        self.warmup = warmup
        self.attn = attn
        self.dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
        self._cache_kw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self._buckets: dict = {}
        self._graphs = GraphPool(self.device)  # the buckets' one pool and capture stream, made on first capture
        self.warmup_seconds: dict = {}
        self.record_logits = False
        self.logits_history: list = []
        self._current = None  # (bucket, B, L) of the batch prefill started
        self._written = 0  # cache columns written (prompt + decode steps)
        self._cw = DecodeStep(model, max_cache_len) if self.step == "cw" else None

    # ---- buckets ----------------------------------------------------------------------------------------

    def bucket_size(self, batch: int) -> int:
        """The bucket a batch of ``batch`` rows runs in: the smallest size >= ``batch``, else ``batch`` itself."""
        size = bucket_for(self.sizes, batch)
        return batch if size is None else size

    def _decode(self, bk: _Bucket) -> torch.Tensor:
        """One decode step on ``bk``'s static inputs; the last position's logits ``(b, V)``."""
        if self._cw is not None:
            return self._cw(bk.tokens.view(-1), bk.positions.view(-1), bk.slots)
        if self.attn == "sdpa":
            mask = bk.valid[:, None, None, :]
        else:
            mask = torch.where(bk.valid, torch.zeros((), dtype=self.dtype, device=self.device),
                               torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device))
            mask = mask[:, None, None, :]
        out = self.model(input_ids=bk.tokens, position_ids=bk.positions, attention_mask=mask,
                         use_cache=True, **{self._cache_kw: bk.cache})
        return out.logits[:, -1, :]

    @torch.no_grad()
    def _bucket(self, size: int) -> _Bucket:
        bk = self._buckets.get(size)
        if bk is not None:
            return bk
        import time

        t0 = time.perf_counter()
        bk = _Bucket(size)
        if self._cw is not None:
            # one cache for every bucket (one batch runs at a time), with the largest bucket's slots; a larger
            # batch reallocates it, and the graphs captured on the old one are dropped (captured again on use)
            if self._cw.allocate(max(size, max(self.sizes))):
                self._buckets.clear()
            bk.slots = torch.arange(size, device=self.device)
        else:
            bk.cache = self._transformers.StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
        if bk.cache is not None and any(getattr(layer, "is_sliding", False) for layer in getattr(bk.cache, "layers", [])):
            raise ValueError("GraphGenerator: the model has sliding-window attention layers (config.sliding_window / "
                             "layer_types); their StaticCache layers keep a host-side length, which a CUDA graph "
                             "cannot replay: use model.generate")
        dev = self.device
        bk.tokens = torch.zeros((size, 1), dtype=torch.int64, device=dev)
        bk.positions = torch.zeros((size, 1), dtype=torch.int64, device=dev)
        bk.valid = torch.zeros((size, self.max_cache_len), dtype=torch.bool, device=dev)
        if self.use_graphs:
            bk.valid[:, 0] = True  # warm-up / capture steps attend to one (zero) key: no all-masked rows
            self._decode(bk)  # the cache's lazy allocation, on the current stream (not the capture's side stream)
            bk.graph, bk.logits = self._graphs.capture(lambda: self._decode(bk), (), warmup=self.warmup)
        self._buckets[size] = bk
        self.warmup_seconds[size] = time.perf_counter() - t0
        return bk

    def _step(self, bk: _Bucket) -> torch.Tensor:
        if bk.graph is not None:
            bk.graph.replay()
            return bk.logits
        return self._decode(bk)

    # ---- prefill and decode steps ----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                pad_token_id: int = 0) -> torch.Tensor:
        """Start a sequence batch: pad it up to its bucket, reset the bucket's cache and run the prompt through
        ``model.forward`` eagerly (creating the bucket, and capturing its graph, on its first use).

        Parameters
        ----------
        input_ids : torch.Tensor
            ``(B, L)`` int64 on the model's device (as `generate`; L <= ``max_cache_len``).
        attention_mask : torch.Tensor, optional
            ``(B, L)`` 0 / 1, left padding (as `generate`); default all ones.
        pad_token_id : int
            The token of the bucket's extra rows.

        Returns
        -------
        torch.Tensor
            ``(B, V)`` logits of each prompt's last position (the model's dtype).
        """
        b_in, _, am = self._check_inputs(input_ids, 1, attention_mask)
        return self._prefill(input_ids, am, pad_token_id)[:b_in]

    def _prefill(self, input_ids, am, pad):
        b_in, length = input_ids.shape
        dev = self.device
        bk = self._bucket(self.bucket_size(b_in))
        b = bk.size
        ids = torch.full((b, length), pad, dtype=torch.int64, device=dev)
        ids[:b_in] = input_ids
        mask2d = torch.ones((b, length), dtype=torch.int64, device=dev)
        mask2d[:b_in] = am
        pos = mask2d.cumsum(-1) - 1
        pos = pos.masked_fill(mask2d == 0, 0)
        bk.valid.zero_()
        bk.valid[:, :length] = mask2d.bool()
        bk.tokens.fill_(pad)
        if self._cw is not None:
            cache = self._transformers.DynamicCache()
        else:
            cache = bk.cache
            cache.reset()
        out = self.model(input_ids=ids, attention_mask=mask2d, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: cache})
        if self._cw is not None:  # the prompt's keys / values, each row moved left by its padding
            pads = length - mask2d.sum(-1) if bool((am == 0).any()) else None
            self._cw.load_prefill(cache, pads, length)
        bk.positions.copy_(pos[:, -1:])
        self._current = (bk, b_in, length)
        self._written = length
        return out.logits[:, -1, :]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the batch `prefill` started: ``tokens`` ``(B,)`` int64 (the tokens just chosen, on
        the device) are written into the bucket's static inputs (``copy_``), the positions advance by one, the next
        cache column becomes valid, and the graph replays (or the step runs eagerly).

        Returns
        -------
        torch.Tensor
            ``(B, V)`` logits: a view of the graph's static output, overwritten by the next step (clone to keep).

        Raises
        ------
        RuntimeError
            No `prefill` before, or the cache is full (``max_cache_len`` columns written).
        """
        if getattr(self, "_current", None) is None:
            raise RuntimeError("GraphGenerator.decode: call prefill first")
        bk, b_in, _ = self._current
        if self._written >= self.max_cache_len:
            raise RuntimeError(f"GraphGenerator.decode: the cache's {self.max_cache_len} positions are full")
        bk.tokens[:b_in, 0] = tokens
        bk.positions += 1
        bk.valid[:, self._written] = True
        self._written += 1
        return self._step(bk)[:b_in]

    # ---- generate ---------------------------------------------------------------------------------------

    def _option(self, name, value):
        if value is not None:
            return value
        gc = getattr(self.model, "generation_config", None)
        v = getattr(gc, name, None) if gc is not None else None
        return _HF_DEFAULTS.get(name) if v is None else v

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """Generate ``max_new_tokens`` tokens after each prompt, as ``model.generate`` does for these options.

        Parameters
        ----------
        input_ids : torch.Tensor
            ``(B, L)`` int64 token ids on the model's device, ``L >= 1``, left-padded when ``attention_mask`` has
            zeros.
        max_new_tokens : int
            ``>= 1``; ``L + max_new_tokens - 1 <= max_cache_len``.
        attention_mask : torch.Tensor, optional
            ``(B, L)`` of 0 / 1 (int or bool), each row zeros then ones (left padding). Default all ones.
        do_sample : bool, optional
            Sampling (True) or greedy (False); default ``model.generation_config.do_sample`` else False.
        temperature : float, optional
            ``> 0``, applied when sampling and not 1.0 (default from the generation config, else 1.0).
        top_k : int, optional
            ``>= 0`` (0: off), applied when sampling (default from the generation config, else 50).
        top_p : float, optional
            In ``(0, 1]``, applied when sampling and below 1.0 (default from the generation config, else 1.0).
        eos_token_id : int or sequence of int, optional
            Default ``model.generation_config.eos_token_id``. A row that produced one gets ``pad_token_id`` from
            then on; generation stops early when every row has (the output is then shorter, as transformers').
        pad_token_id : int, optional
            Default ``model.generation_config.pad_token_id``, else the first EOS id, else 0.
        generator : torch.Generator, optional
            For ``torch.multinomial`` when sampling (default: torch's global generator, as transformers).

        Returns
        -------
        torch.Tensor
            ``(B, L + n)`` int64: the prompts followed by the ``n <= max_new_tokens`` new tokens.

        Raises
        ------
        ValueError
            An unsupported keyword (the message names it and lists `SUPPORTED_GENERATE_KWARGS`); ``input_ids`` not
            2-D with ``L >= 1`` or not on the model's device; ``max_new_tokens`` < 1 or too long for
            ``max_cache_len``; ``attention_mask`` of another shape, with values other than 0 / 1, right-padded, or
            with an all-zero row; ``temperature`` / ``top_k`` / ``top_p`` out of range; a sliding-window model.
        TypeError
            ``input_ids`` not an integer tensor; ``max_new_tokens`` not an int.
        """
        unknown = [k for k in kwargs if k not in SUPPORTED_GENERATE_KWARGS]
        if unknown:
            raise ValueError(f"cutlass_w8a8.generate: unsupported argument(s) {unknown}; supported: "
                             f"{list(SUPPORTED_GENERATE_KWARGS)} (use model.generate for the others)")
        b_in, length, am = self._check_inputs(input_ids, max_new_tokens, kwargs.get("attention_mask"))
        do_sample = bool(self._option("do_sample", kwargs.get("do_sample")))
        processors = self._processors(kwargs) if do_sample else []
        eos = self._option_eos(kwargs.get("eos_token_id"))
        pad = kwargs.get("pad_token_id")
        if pad is None:
            pad = getattr(getattr(self.model, "generation_config", None), "pad_token_id", None)
        if pad is None:
            pad = int(eos[0]) if eos is not None else 0
        generator = kwargs.get("generator")
        dev = self.device
        logits = self._prefill(input_ids, am, pad)
        new = torch.empty((b_in, max_new_tokens), dtype=torch.int64, device=dev)
        unfinished = torch.ones(b_in, dtype=torch.bool, device=dev)
        all_done = torch.zeros(max_new_tokens, dtype=torch.bool, device=dev)
        eos_t = None if eos is None else torch.tensor(eos, dtype=torch.int64, device=dev)
        n = max_new_tokens
        self.logits_history = []
        for i in range(max_new_tokens):
            scores = logits[:b_in].to(dtype=torch.float32)
            if self.record_logits:
                self.logits_history.append(scores.clone())
            if do_sample:
                for p in processors:
                    scores = p(None, scores)
                probs = torch.softmax(scores, dim=-1)
                tok = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
            else:
                tok = torch.argmax(scores, dim=-1)
            if eos_t is not None:
                tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
                unfinished &= ~torch.isin(tok, eos_t)
                all_done[i] = ~unfinished.any()
            new[:, i] = tok
            if i + 1 == max_new_tokens:
                break
            if eos_t is not None and (i + 1) % _EOS_CHECK_EVERY == 0 and bool(all_done[: i + 1].any()):
                break
            logits = self.decode(tok)
        if eos_t is not None:
            done = torch.nonzero(all_done).flatten()
            if done.numel():
                n = int(done[0]) + 1
        return torch.cat([input_ids, new[:, :n]], dim=1)

    def _check_inputs(self, input_ids, max_new_tokens, attention_mask):
        where = "cutlass_w8a8.generate"
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
            raise TypeError(f"{where}: `input_ids` must be an integer tensor (B, L), got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.shape[0] < 1:
            raise ValueError(f"{where}: `input_ids` must be (B, L) with B, L >= 1, got shape {tuple(input_ids.shape)}")
        if input_ids.device != self.device:
            raise ValueError(f"{where}: `input_ids` is on {input_ids.device} but the model is on {self.device}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise TypeError(f"{where}: `max_new_tokens` must be an int, got {type(max_new_tokens).__name__}")
        b, length = input_ids.shape
        if max_new_tokens < 1:
            raise ValueError(f"{where}: `max_new_tokens` must be >= 1, got {max_new_tokens}")
        if length + max_new_tokens - 1 > self.max_cache_len:
            raise ValueError(f"{where}: prompt length {length} + `max_new_tokens` {max_new_tokens} - 1 exceeds the "
                             f"cache's max_cache_len = {self.max_cache_len}")
        if attention_mask is None:
            return b, length, torch.ones((b, length), dtype=torch.int64, device=self.device)
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, length):
            raise ValueError(f"{where}: `attention_mask` must be a tensor of `input_ids`' shape {(b, length)}, got "
                             f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
        am = attention_mask.to(device=self.device, dtype=torch.int64)
        if bool(((am != 0) & (am != 1)).any()):
            raise ValueError(f"{where}: `attention_mask` must hold only 0 and 1")
        if bool((am[:, 1:] < am[:, :-1]).any()):
            raise ValueError(f"{where}: `attention_mask` must be left-padded (each row zeros, then ones); a row has a "
                             "0 after a 1 (right padding)")
        if bool((am[:, -1] == 0).any()):
            raise ValueError(f"{where}: `attention_mask` has a row of padding only")
        return b, length, am

    def _processors(self, kwargs) -> list:
        t = self._option("temperature", kwargs.get("temperature"))
        k = self._option("top_k", kwargs.get("top_k"))
        p = self._option("top_p", kwargs.get("top_p"))
        where = "cutlass_w8a8.generate"
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (t > 0 and math.isfinite(t)):
            raise ValueError(f"{where}: `temperature` must be a finite number > 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"{where}: `top_k` must be an int >= 0 (0: off), got {k!r}")
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p <= 1):
            raise ValueError(f"{where}: `top_p` must be in (0, 1], got {p!r}")
        lp = self._transformers.generation.logits_process
        out = []
        if t != 1.0:
            out.append(lp.TemperatureLogitsWarper(float(t)))
        if k != 0:
            out.append(lp.TopKLogitsWarper(top_k=k, min_tokens_to_keep=1))
        if p < 1.0:
            out.append(lp.TopPLogitsWarper(top_p=float(p), min_tokens_to_keep=1))
        return out

    def _option_eos(self, eos):
        if eos is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            return None
        eos = [eos] if isinstance(eos, int) else list(eos)
        if not eos or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in eos):
            raise ValueError(f"cutlass_w8a8.generate: `eos_token_id` must be an int >= 0 or a sequence of them, got "
                             f"{eos!r}")
        return eos


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, max_cache_len: Optional[int] = None,
             use_graphs: Optional[bool] = None, step: str = "auto", **kwargs) -> torch.Tensor:
    """`GraphGenerator.generate` with a `GraphGenerator` kept on ``model`` (made on the first call, with
    ``max_cache_len``, ``use_graphs`` and ``step``; made again when a call asks for a larger ``max_cache_len``,
    other ``use_graphs`` or another ``step``), so its captured graphs serve later calls.

    Parameters
    ----------
    model, input_ids, max_new_tokens, **kwargs
        As `GraphGenerator` / `GraphGenerator.generate` (``kwargs``: `SUPPORTED_GENERATE_KWARGS`).
    max_cache_len : int, optional
        The StaticCache length; default: the kept generator's if it fits, else ``L + max_new_tokens`` rounded up
        to a multiple of 256.
    use_graphs : bool, optional
        As `GraphGenerator` (default: on CUDA).
    step : {"auto", "cw", "transformers"}
        As `GraphGenerator` (default ``"auto"``: the package's own decode step for an `optimize_`d model).

    Returns
    -------
    torch.Tensor
        ``(B, L + n)`` int64, as ``model.generate`` returns for these options.

    Raises
    ------
    As `GraphGenerator` and `GraphGenerator.generate`.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"cutlass_w8a8.generate: `input_ids` must be a (B, L) tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}")
    need = input_ids.shape[1] + (max_new_tokens if isinstance(max_new_tokens, int) else 0)
    gen = model.__dict__.get("_cw_graph_generator")
    want_graphs = gen.use_graphs if (gen is not None and use_graphs is None) else use_graphs
    if (gen is None or (max_cache_len is not None and max_cache_len != gen.max_cache_len)
            or gen.max_cache_len < need - 1 or (want_graphs is not None and want_graphs != gen.use_graphs)
            or step != gen.requested_step):
        size = max_cache_len if max_cache_len is not None else -(-need // 256) * 256
        gen = GraphGenerator(model, max_cache_len=size, use_graphs=use_graphs, step=step)
        model.__dict__["_cw_graph_generator"] = gen
    return gen.generate(input_ids, max_new_tokens, **kwargs)
