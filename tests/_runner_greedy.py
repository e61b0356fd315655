"""The decoder CUDA tests' checks of `cutlass_w8a8.runner.DecodeGraphRunner` (tests/models/test_decoder_cuda.py,
test_decoder_block_cuda.py, test_decoder_moe_cuda.py): `random_host_inputs`, a decode step's random inputs;
`bucket_steps`, each bucket's graph replayed on new inputs beside the eager step at the same padded batch;
`greedy_graph_and_eager`, greedy decoding through graph replays on a side stream under sync debug mode "error"
against the runner's eager steps."""

from __future__ import annotations

import torch

from cutlass_w8a8.models import generate_greedy


def random_host_inputs(batch, gen, *, vocab: int, max_seq: int, max_batch: int):
    """Random ``(token_ids, positions, slots)`` CPU int64 tensors of ``batch`` rows: tokens below ``vocab``, positions
    below ``max_seq``, distinct slots below ``max_batch`` (the test files bind the last three to their model's)."""
    tok = torch.randint(0, vocab, (batch,), generator=gen)
    pos = torch.randint(0, max_seq, (batch,), generator=gen)
    slots = torch.randperm(max_batch, generator=gen)[:batch]
    return tok, pos, slots


def bucket_steps(runner, host_inputs, steps: int, gen: torch.Generator):
    """For every bucket ``b`` of ``runner`` (in ``runner.sizes`` order), full and padded (``b - 1`` rows, where the
    runner puts that many rows in bucket ``b``), ``steps`` steps on new inputs ``host_inputs(n, gen)`` each: yields
    ``(b, n, i, (tok, pos, slots), graph, eager)``, the logits of the step replayed from the bucket's graph and of the
    eager step at the same padded batch (clones), before the next step runs."""
    for b in runner.sizes:
        for n in sorted({b, b - 1} - {0}):
            if runner.bucket(n) != b:
                continue
            for i in range(steps):
                tok, pos, slots = host_inputs(n, gen)
                graph = runner.step(tok, pos, slots).clone()
                eager = runner.step(tok, pos, slots, use_graph=False).clone()
                yield b, n, i, (tok, pos, slots), graph, eager


def greedy_graph_and_eager(runner, model, prompt: torch.Tensor, slots: torch.Tensor, new_tokens: int,
                           rows=(3, 4)) -> dict:
    """For each ``n`` in ``rows``: ``model``'s cache reset, ``new_tokens`` greedy tokens after ``prompt[:n]`` (slots
    ``slots[:n]``) through the runner's eager steps; the cache reset again, the same through its graphs on a side
    stream with torch's sync debug mode "error" (a host synchronisation raises). Returns ``{n: (graph, eager)}``,
    each ``(n, new_tokens)`` int64."""
    out = {}
    for n in rows:
        model.reset_cache()
        eager = generate_greedy(lambda t, p, s: runner.step(t, p, s, use_graph=False), prompt[:n], new_tokens,
                                slots[:n])
        model.reset_cache()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(stream):
                graph = generate_greedy(runner.step, prompt[:n], new_tokens, slots[:n])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stream.synchronize()
        out[n] = (graph, eager)
    return out
