"""argparse types the benchmark scripts share: comma-separated integers and names."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

__all__ = ["int_list", "name_list"]


def int_list(high: Optional[int] = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: ``"1,8,32"`` -> ``[1, 8, 32]``, each in ``[1, high]`` (positive when ``high`` is
    None); anything else (no value, a non-integer, one out of range) is an ``ArgumentTypeError``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
        if high is None and (not values or any(v <= 0 for v in values)):
            raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
        if high is not None and (not values or any(not 1 <= v <= high for v in values)):
            raise argparse.ArgumentTypeError(f"expected integers in [1, {high}], got {text!r}")
        return values

    return parse


def name_list(choices: Sequence[str], ordered: bool = False) -> Callable[[str], list[str]]:
    """An argparse ``type``: ``"int8,bf16"`` -> a non-empty list of names among ``choices``, as given or, with
    ``ordered``, in the order of ``choices``; an unknown name is an ``ArgumentTypeError``."""
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return [c for c in choices if c in names] if ordered else names

    return parse
