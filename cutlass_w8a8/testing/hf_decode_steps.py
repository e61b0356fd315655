"""bench/bench_hf.py's decode steps and timing loop, on a transformers ``LlamaForCausalLM`` with a
``StaticCache``: `Point` (one model and batch: its cache, its eager and compiled steps, the fixed prompt),
`GraphPoint` (the same model and batch through `cutlass_w8a8.hf.GraphGenerator`: its bucket's cache and
captured decode step),
`step_inputs`, `check_mode` (the logits of the check steps), `Timer` (CUDA events, or the host clock on the
CPU) and `time_interleaved` (the repetitions of every variant, round-robin). Here so that the script keeps
working when loaded by path (tests/bench/test_bench_hf_cpu.py); importing it touches no GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch

class Point:
    """One (model, batch): its cache, its eager and compiled steps, the fixed prompt.

    Every step passes the attention mask transformers' ``generate`` would build, as a fixed-shape 4-D bool mask
    ``(B, 1, 1, max_cache_len)`` (True = attend: the cache columns written so far), which transformers uses as
    it is. Without a mask transformers' sdpa path skips masking for one query token and attends to every column
    of the static cache, the unwritten ones included; a 2-D mask growing by one column per step would recompile
    the compiled step. The same mask as `cutlass_w8a8.hf.GraphGenerator`'s, so every mode computes the same
    attention."""

    def __init__(self, transformers: Any, model, prompt: torch.Tensor, max_cache_len: int):
        self.model = model
        self.prompt = prompt
        self.batch = prompt.shape[0]
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.valid = torch.zeros((self.batch, max_cache_len), dtype=torch.bool, device=prompt.device)
        self.compiled: Optional[Callable] = None

    def prefill(self) -> torch.Tensor:
        """Reset the cache and prefill the prompt with the uncompiled forward; the last position's logits."""
        self.cache.reset()
        self.valid.zero_()
        self.valid[:, : self.prompt.shape[1]] = True
        out = self.model(input_ids=self.prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits

    def step(self, mode: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One decode step, ``tokens`` and ``positions`` ``(B, 1)`` int64 on the device; the logits ``(B, 1, V)``.
        A compiled step's logits live in the CUDA graph's memory pool: clone them to keep them past the next step."""
        self.valid.scatter_(1, positions, True)  # the new token's cache column (position = column: no padding)
        if mode == "eager":
            fn = self.model.forward
        else:
            torch.compiler.cudagraph_mark_step_begin()
            fn = self.compiled
        return fn(input_ids=tokens, past_key_values=self.cache, position_ids=positions, use_cache=True,
                  attention_mask=self.valid[:, None, None, :]).logits


class GraphPoint:
    """One (model, batch) through `cutlass_w8a8.hf.GraphGenerator` (``sizes=[B]``): ``prefill`` is its eager
    prefill, ``step`` its decode step (static inputs written, the captured graph replayed; eagerly on the CPU).
    ``setup_s``: the seconds creating the bucket took (StaticCache, warm-up, capture)."""

    def __init__(self, generator_cls: Any, model, prompt: torch.Tensor, max_cache_len: int):
        self.prompt = prompt
        self.batch = prompt.shape[0]
        t0 = time.perf_counter()
        self.gen = generator_cls(model, max_cache_len=max_cache_len, sizes=[self.batch])
        self.gen.prefill(prompt)  # creates the bucket: cache, warm-up and capture
        if prompt.is_cuda:
            torch.cuda.synchronize()
        self.setup_s = time.perf_counter() - t0

    def prefill(self) -> torch.Tensor:
        return self.gen.prefill(self.prompt)[:, None, :]

    def step(self, mode: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens`` ``(B, 1)``; ``positions`` are the generator's own (prompt length + steps)."""
        return self.gen.decode(tokens[:, 0])[:, None, :]


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |out - ref|^2)`` in dB (torchao's accuracy metric), in float64."""
    out, ref = out.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-300)))


def step_inputs(n: int, batch: int, start: int, vocab: int, gen: torch.Generator, device) -> list[tuple]:
    """``n`` decode steps of random tokens at positions ``start, start + 1, ...``: ``(tokens, positions)``,
    each ``(batch, 1)`` int64, contiguous, on ``device``."""
    tokens = torch.randint(0, vocab, (n, batch, 1), generator=gen)
    return [(tokens[i].to(device), torch.full((batch, 1), start + i, dtype=torch.int64).to(device)) for i in range(n)]


@torch.no_grad()
def check_mode(point: Point, inputs: list[tuple], mode: str) -> tuple[list[torch.Tensor], list[float]]:
    """The logits (float32, CPU) of every check step in ``mode`` after a reset and the prefill, and the
    wall-clock seconds of each step (the first one from before the prefill: the time to the first decode token).
    In the compiled mode the first step is where the compile and the warm-up happen, the second where the CUDA
    graph is recorded."""
    t0 = time.perf_counter()
    point.prefill()
    logits, seconds = [], []
    for i, (tok, pos) in enumerate(inputs):
        if i:
            t0 = time.perf_counter()
        logits.append(point.step(mode, tok, pos).float().cpu())  # .cpu() waits for the step
        seconds.append(time.perf_counter() - t0)  # the first one includes the prefill
    return logits, seconds


class Timer:
    """Elapsed milliseconds of a block: CUDA events on the current stream (host launches included), or the
    host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start) -> Callable[[], float]:
        """A function giving the elapsed ms (after a synchronize, for CUDA events)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return lambda: start.elapsed_time(end)
        ms = (time.perf_counter() - start) * 1e3
        return lambda: ms


@torch.no_grad()
def time_interleaved(variants: dict[tuple, tuple], reps: int, steps: int, timer: Timer,
                     log: Callable[[str], None]) -> dict[tuple, dict[str, float]]:
    """``variants``: ``(model, mode) -> (point, inputs)``. Round-robin repetitions; per variant the median,
    min and max ms/token over them."""
    samples: dict[tuple, list[Callable[[], float]]] = {key: [] for key in variants}
    for rep in range(reps):
        for key, (point, inputs) in variants.items():
            point.prefill()
            start = timer.start()
            for tok, pos in inputs[:steps]:
                point.step(key[1], tok, pos)
            samples[key].append(timer.stop(start))
        log(f"  repetition {rep + 1}/{reps} done")
    if timer.cuda:
        torch.cuda.synchronize()
    out = {}
    for key, fns in samples.items():
        per_token = [fn() / steps for fn in fns]
        out[key] = {"median_ms": statistics.median(per_token), "min_ms": min(per_token), "max_ms": max(per_token),
                    "reps": reps, "steps": steps}
    return out

