"""The benchmark timers of cutlass_w8a8.testing.timers: structure only (no speed is asserted)."""

import pytest
import torch

from cutlass_w8a8.testing import timers as bu

pytestmark = pytest.mark.cuda


def test_interleaved_times_every_case_and_reports_failures():
    x = torch.randn(1 << 20, device="cuda")
    sets = bu.rotating_arg_sets((x,), l2_bytes=1 << 20, max_bytes=1 << 26)
    failures = {}

    def broken(t):
        raise ValueError("refused")

    out = bu.bench_gpu_time_interleaved(
        {"add": (lambda t: t + 1, sets), "mul": (lambda t: t * 3, sets), "broken": (broken, sets)},
        replay_ms=0.2, replays=5, on_error=lambda name, exc: failures.setdefault(name, str(exc)))
    assert set(out) == {"add", "mul"}
    assert failures == {"broken": "refused"}
    for timing in out.values():
        assert timing.copies == len(sets) and timing.calls_per_replay % len(sets) == 0
        assert 0 < timing.min_ms <= timing.median_ms <= timing.max_ms
        assert timing.replays == 5


def test_interleaved_reraises_without_on_error():
    x = torch.randn(16, device="cuda")

    def broken(t):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        bu.bench_gpu_time_interleaved({"broken": (broken, [(x,)])}, replays=1)
