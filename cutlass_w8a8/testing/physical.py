"""Physical bounds of benchmark figures, the one check every report uses.

A measured figure beyond what physics allows is a broken measurement, not a result: two copies of a benchmark
timing each other, a cache that held what should have streamed, clocks read across runs. Such a figure is reported
as INVALID and the target it would have decided is not judged (``met`` None), never "met". The bounds are the ones
the benchmarks state:

- a speedup at most the ratio of the bytes the two runs must read (bench/bench_tp.py: TP=2 over TP=1);
- a share (a part of a time) within [0, 1];
- a rate at most its peak (weight bytes / time over the read rate measured in the same run; % of the datasheet
  HBM bandwidth or of the dense peak at most 100);
- a time at least its bandwidth-limited time (bench/bench_decoder.py: a step over its HBM-limited time >= 1).

Example::

    invalid = [physical_check(speedup, byte_bound, "batch 1 speedup TP=1 / TP=2"),
               share_check(nccl_share, "NCCL kernel share")]
    met, why = judge(speedup >= 1.6, *invalid)       # (None, "batch 1 speedup ... = 3.15 ...") when impossible
    line = f"target: {verdict(met, why)}"            # "target: INVALID (batch 1 speedup ...)"
"""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["INVALID", "judge", "mark", "physical_check", "share_check", "verdict"]

INVALID = "INVALID"


def physical_check(value: Optional[float], bound: Optional[float], what: str, *, sense: str = "<=") -> Optional[str]:
    """Why ``value`` cannot be a real measurement, or None when it can.

    Parameters
    ----------
    value : float or None
        The figure (None: not measured, nothing to check).
    bound : float or None
        Its physical bound (None: unknown, nothing to check).
    what : str
        The figure's name in the reason, e.g. ``"batch 1 speedup TP=1 / TP=2"``.
    sense : str
        ``"<="`` (default): physically ``value <= bound`` (a speedup, a share, a rate); ``">="``: ``value >= bound``
        (a time over its bandwidth-limited time).

    Returns
    -------
    str or None
        ``"<what> = <value> is beyond its physical bound (<sense> <bound>)"``; a NaN value is always invalid.

    Raises
    ------
    ValueError
        ``sense`` is not ``"<="`` or ``">="``.
    """
    if sense not in ("<=", ">="):
        raise ValueError(f"physical_check: `sense` must be '<=' or '>=', got {sense!r}")
    if value is None or bound is None:
        return None
    value = float(value)
    if math.isnan(value):
        return f"{what} is NaN"
    if value <= bound if sense == "<=" else value >= bound:
        return None
    return f"{what} = {value:.4g} is beyond its physical bound ({sense} {bound:.4g})"


def share_check(value: Optional[float], what: str) -> Optional[str]:
    """`physical_check` of a share: a part of a whole lies in [0, 1] (0 % to 100 %)."""
    return physical_check(value, 1.0, what) or physical_check(value, 0.0, what, sense=">=")


def judge(met: Optional[bool], *invalid: Optional[str]) -> tuple[Optional[bool], Optional[str]]:
    """A target's ``(met, invalid)``: ``(None, "<reasons>; ...")`` when any of ``invalid`` (reasons from
    `physical_check`, or None) is set, a figure it rests on being impossible; else ``(met, None)``."""
    reasons = [r for r in invalid if r]
    if reasons:
        return None, "; ".join(reasons)
    return met, None


def verdict(met: Optional[bool], invalid: Optional[str] = None, *, na: str = "n/a", not_met: str = "NOT met") -> str:
    """The words of a target's verdict: ``"INVALID (<reason>)"``, ``"met"``, ``not_met`` or ``na`` (not measured)."""
    if invalid:
        return f"{INVALID} ({invalid})"
    if met is None:
        return na
    return "met" if met else not_met


def mark(text: str, invalid: Optional[str]) -> str:
    """A table cell: ``text``, followed by ``INVALID`` when ``invalid`` is set."""
    return f"{text} {INVALID}" if invalid else text
