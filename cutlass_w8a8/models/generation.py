"""Greedy decoding over any decode step (a `LlamaDecoder`, or `cutlass_w8a8.runner.DecodeGraphRunner.step`)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["generate_greedy"]


def generate_greedy(step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                    prompt: torch.Tensor, max_new_tokens: int, slots: Optional[torch.Tensor] = None,
                    start: int = 0) -> torch.Tensor:
    """Greedy decoding: feed the prompt token by token, then the argmax of each step's logits.

    Nothing is read back to the host: the next tokens stay on the device, so the loop never waits for the
    GPU (and can run under ``torch.cuda.set_sync_debug_mode("error")``).

    Parameters
    ----------
    step : callable
        ``step(token_ids (B,), positions (B,), slots (B,)) -> logits (B, vocab)``, e.g. a `LlamaDecoder` or
        `cutlass_w8a8.runner.DecodeGraphRunner.step`. The logits may be overwritten by the next call.
    prompt : torch.Tensor
        ``(B, L)`` int64 token ids on the model's device, ``L >= 1``; all prompts have the same length.
    max_new_tokens : int
        Tokens to generate.
    slots : torch.Tensor, optional
        ``(B,)`` int64 cache slots on the device; default ``0..B-1``.
    start : int
        Position of the first prompt token (0: a fresh sequence; the cache rows are overwritten from there).

    Returns
    -------
    torch.Tensor
        ``(B, max_new_tokens)`` int64 generated tokens, on the device.
    """
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate_greedy: `prompt` must be (B, L) with L >= 1, got {tuple(prompt.shape)}")
    b, length = prompt.shape
    device = prompt.device
    if slots is None:
        slots = torch.arange(b, device=device)
    positions = torch.full((b,), start, dtype=torch.int64, device=device)
    logits = None
    for t in range(length):
        logits = step(prompt[:, t], positions, slots)
        positions = positions + 1
    out = torch.empty(b, max_new_tokens, dtype=torch.int64, device=device)
    for i in range(max_new_tokens):
        tok = logits.argmax(dim=-1)
        out[:, i] = tok
        if i + 1 < max_new_tokens:
            logits = step(tok, positions, slots)
            positions = positions + 1
    return out
