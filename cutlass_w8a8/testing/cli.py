"""argparse pieces the benchmark scripts share: comma-separated integers and names, and the checks of a (shape, M)
sweep's arguments."""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from .shapes import SHAPES, select_shapes

__all__ = ["chosen_shapes", "finish_sweep_args", "int_list", "name_list"]


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


def chosen_shapes(parser: argparse.ArgumentParser, filters: Optional[str],
                  shapes: tuple[tuple[str, int, int], ...] = SHAPES) -> list[tuple[str, int, int]]:
    """`select_shapes` of ``filters`` (the ``--shapes`` value) among ``shapes``; none matching is a
    ``parser.error`` (exit status 2) that lists the names."""
    chosen = select_shapes(filters, shapes)
    if not chosen:
        parser.error(f"--shapes {filters!r} matches none of {', '.join(s[0] for s in shapes)}")
    return chosen


def finish_sweep_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The checks and derived fields of a sweep over `SHAPES` and M: ``--replays`` at least 1 (else
    ``parser.error``), ``args.m_values`` (the distinct ``--m`` values, sorted) and ``args.shape_list``
    (`chosen_shapes` of ``--shapes``); returns ``args``."""
    if args.replays < 1:
        parser.error("--replays must be >= 1")
    args.m_values = sorted(set(args.m))
    args.shape_list = chosen_shapes(parser, args.shapes)
    return args
