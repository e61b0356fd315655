"""cutlass_w8a8.testing.physical: the one check of benchmark figures against their physical bounds (a speedup over
its byte bound, a share outside [0, 1], a rate over its peak, a time under its bandwidth limit) and the verdict words
the reports print: INVALID, never met."""

import math

import pytest

from cutlass_w8a8.testing.physical import INVALID, judge, mark, physical_check, share_check, verdict


def test_physical_check():
    assert physical_check(2.0, 2.0, "speedup") is None  # on the bound is possible
    assert physical_check(1.9, 2.0, "speedup") is None
    why = physical_check(3.15, 2.0, "batch 1 speedup")
    assert why == "batch 1 speedup = 3.15 is beyond its physical bound (<= 2)"
    assert physical_check(1.2, 1.0, "step / HBM limit", sense=">=") is None
    assert "(>= 1)" in physical_check(0.8, 1.0, "step / HBM limit", sense=">=")
    assert physical_check(None, 2.0, "x") is None and physical_check(5.0, None, "x") is None  # not measured
    assert physical_check(math.nan, 2.0, "x") == "x is NaN"
    with pytest.raises(ValueError, match="sense"):
        physical_check(1.0, 2.0, "x", sense="<")


def test_share_check():
    assert share_check(0.0, "s") is None and share_check(1.0, "s") is None and share_check(0.4, "s") is None
    assert "(<= 1)" in share_check(3.98, "NCCL kernel share")
    assert "(>= 0)" in share_check(-0.05, "all-reduce share")
    assert share_check(None, "s") is None


def test_judge_and_verdict():
    assert judge(True) == (True, None) and judge(False, None, None) == (False, None)
    met, why = judge(True, None, "a = 3 is beyond its physical bound (<= 2)", "b is NaN")
    assert met is None and why == "a = 3 is beyond its physical bound (<= 2); b is NaN"
    assert verdict(met, why) == f"{INVALID} (a = 3 is beyond its physical bound (<= 2); b is NaN)"
    assert verdict(True) == "met" and verdict(False) == "NOT met" and verdict(None) == "n/a"
    assert verdict(None, na="–") == "–" and verdict(False, not_met="not met") == "not met"
    assert verdict(True, "impossible").startswith(INVALID)  # never "met" with a reason
    assert mark("3.15x", "why") == "3.15x INVALID" and mark("1.62x", None) == "1.62x"
