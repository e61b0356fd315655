"""bench/bench_moe.py ``--grouped-configs`` (issue 37): entries of the sm90 grouped GEMM's tables forced with the tuning
op ``_grouped_scaled_mm_config``, timed in the gemm part beside the shipped dispatch (``ours_int8`` / ``ours_fp8`` /
``ours_block``) and torch's ``F.scaled_grouped_mm``, with a bit-for-bit check against one reference entry per table.

The tables (csrc/gemm/sm90/grouped/grouped_sm90_config.cuh; names from the library's
``cw8a8_sm90_grouped_config_name``): the shipped ``*_Small`` / ``*_Mid`` / ``*_Large`` entries, then the tuning
candidates of a ``CUTLASS_W8A8_TUNE=grouped`` build. A method is ``<family>[<entry name>]``, ``family`` ``ours_int8``
(int8, per-token x per-channel), ``ours_fp8`` (row-wise e4m3, per-token x per-channel) or ``ours_block`` (1x128 x
128x128 block scales). Every entry whose method name contains one of the option's substrings is timed (an entry
substring such as ``64x128x128_c1x1_pingpong`` picks that tile in every table that has it; ``ours_int8[`` every int8
entry; ``ours_int8[64x128`` only int8's), and so is its table's bit reference `BIT_REFERENCE`; a table with no
matching entry is left out. The references (`BIT_REFERENCE`): for int8 and block fp8 the shipped Large entry (so
a default build has it; int8 accumulates exactly in int32 and every entry applies the same float32 epilogue, so every
int8 entry must equal it bit for bit; block fp8's is the wave mainloop's 128x256 tile, whose sums are CUTLASS's
blockwise mainloop's), for row-wise fp8 CUTLASS's promoted 128x128 cooperative candidate (the shipped row-wise
entries use fast accumulation, a different sum; a tuning build only). The wave mainloop performs the same products in
the same K order with one promotion per 128 of K, so its outputs are expected to equal the reference's bit for bit. A
fast-accumulation entry (`FAST_ACCUM` in its name: the tensor cores' own accumulator over the whole K loop, a different
sum) is not compared: its bits column reads "n/a" (its float64 check still applies).

bench/ is on sys.path when the script runs; the tests load this file by name.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# family -> (cw8a8_config_table id, activation key, its scale key, weight attribute, its scale attribute)
FAMILIES = {"ours_int8": (0, "a_int8", "sa_int8", "w_int8", "s_int8"),
            "ours_fp8": (1, "a_fp8", "sa_fp8", "w_fp8", "s_fp8"),
            "ours_block": (2, "a_block", "sa_block", "w_block", "s_block")}
# Each family's bit reference: an entry name, or SHIPPED_LARGE (the table's shipped *_Large entry, whatever its tile:
# present in a default build too).
SHIPPED_LARGE = 2  # kNumGroupedConfigs' order: Small, Mid, Large
BIT_REFERENCE: dict[str, Any] = {"ours_int8": SHIPPED_LARGE, "ours_fp8": "128x128x128_c1x1_cooperative_persistent",
                                 "ours_block": SHIPPED_LARGE}
FAST_ACCUM = "_fastaccum"  # config_name's mark of fast accumulation (scaled_mm_sm90_config.cuh)


def method_name(family: str, entry: str) -> str:
    return f"{family}[{entry}]"


def base_method(name: str) -> str:
    """``ours_block`` of ``ours_block[<entry>]`` (and of ``ours_block``)."""
    return name.split("[", 1)[0]


def table_names(cw: Any) -> dict[int, list[str]]:
    """{table id: entry names} of the int8, fp8 and block grouped tables of the loaded sm90 library."""
    import ctypes

    lib = cw._ext.kernel_library("_kernels_sm90")
    if lib is None or not hasattr(lib, "cw8a8_sm90_grouped_config_name"):
        raise RuntimeError("--grouped-configs: the sm90 kernel library (with cw8a8_sm90_grouped_config_name) is not "
                           "loaded")
    lib.cw8a8_sm90_grouped_config_name.restype = ctypes.c_char_p
    return {t: [lib.cw8a8_sm90_grouped_config_name(t, i).decode() for i in range(lib.cw8a8_sm90_grouped_num_configs(t))]
            for t, *_ in FAMILIES.values()}


def reference_names(names: dict[int, list[str]]) -> dict[str, Optional[str]]:
    """{family: its `BIT_REFERENCE` entry's name in the loaded tables, None when the table lacks it (row-wise fp8's
    promoted candidate outside a tuning build)}."""
    out = {}
    for family, (table, *_) in FAMILIES.items():
        ref = BIT_REFERENCE[family]
        if isinstance(ref, int):
            out[family] = names[table][ref] if ref < len(names[table]) else None
        else:
            out[family] = ref if ref in names[table] else None
    return out


def selected(names: dict[int, list[str]], substrings: list[str]) -> dict[str, list[tuple[int, str]]]:
    """{family: [(index, name), ...]}: the entries whose method name (``<family>[<name>]``) contains one of
    ``substrings``, then the family's bit reference (`reference_names`) if not among them; a family with no such entry
    is left out. An entry listed under two indices (an alias bucket) counts once, by its first index. Raises when no
    family has such an entry, or when one that has lacks its reference (the candidates, and row-wise fp8's reference,
    are in a ``CUTLASS_W8A8_TUNE=grouped`` build only)."""
    refs = reference_names(names)
    out = {}
    for family, (table, *_) in FAMILIES.items():
        first = {}
        for i, n in enumerate(names[table]):
            first.setdefault(n, i)
        entries = [(i, n) for n, i in first.items() if any(s in method_name(family, n) for s in substrings)]
        if not entries:
            continue
        ref = refs[family]
        if ref is None:
            raise RuntimeError(f"--grouped-configs {','.join(substrings)}: the {family} grouped table "
                               f"({', '.join(names[table])}) has no {BIT_REFERENCE[family]}: build with "
                               "CUTLASS_W8A8_TUNE=grouped")
        if ref not in [n for _, n in entries]:
            entries.append((first[ref], ref))
        out[family] = entries
    if not out:
        tables = "; ".join(f"{family}: {', '.join(names[t])}" for family, (t, *_) in FAMILIES.items())
        raise RuntimeError(f"--grouped-configs {','.join(substrings)}: no grouped table entry matches ({tables}); the "
                           "tuning candidates need a CUTLASS_W8A8_TUNE=grouped build")
    return out


def config_methods(cw: Any, wts: Any, entries: dict[str, list[tuple[int, str]]]) -> dict[str, Callable]:
    """``name -> fn(act, offs)`` for each selected entry: ``_grouped_scaled_mm_config`` into a fresh bfloat16 output
    (the same operands as the family's shipped method)."""
    op = torch.ops.cutlass_w8a8._grouped_scaled_mm_config
    methods = {}
    for family, items in entries.items():
        _, ak, sk, wk, wsk = FAMILIES[family]
        b, sb = getattr(wts, wk).transpose(1, 2), getattr(wts, wsk)
        for index, name in items:
            def fn(a, o, ak=ak, sk=sk, b=b, sb=sb, index=index):
                out = torch.empty(a[ak].shape[0], b.shape[2], dtype=torch.bfloat16, device=a[ak].device)
                op(out, a[ak], b, a[sk], sb, o, None, index)
                return out
            methods[method_name(family, name)] = fn
    return methods


def comparable(name: str) -> bool:
    """Whether a method's entry computes the reference's sum (not a fast-accumulation entry, see the top)."""
    return FAST_ACCUM not in name


def bit_identity(outs: dict[str, torch.Tensor], routed: int,
                 refs: dict[str, Optional[str]]) -> dict[str, Optional[bool]]:
    """{method: whether its first ``routed`` rows equal, bit for bit, its family's reference method's (``refs``:
    `reference_names`; int8: the shipped Large entry, which every int8 entry must equal: exact int32 sums, the same
    epilogue)}; None when the reference did not run or the entry is not `comparable` (fast accumulation: a different
    sum)."""
    result = {}
    for name, out in outs.items():
        family = base_method(name)
        ref = outs.get(method_name(family, refs[family])) if refs.get(family) else None
        result[name] = (None if ref is None or not comparable(name)
                        else bool(torch.equal(out[:routed], ref[:routed])))
    return result


def _bits(name: str, same: Optional[bool]) -> str:
    if same is not None:
        return "yes" if same else "NO"
    return "–" if comparable(name) else "n/a"


def _fmt(v: Optional[float], spec: str) -> str:
    return "–" if v is None else format(v, spec)


def config_markdown(points: list[dict[str, Any]]) -> list[str]:
    """The report's section for the forced entries: per point, each entry's time, its ratio to the family's shipped
    dispatch and torch_fp8's time over it, and whether it equals the reference bit for bit."""
    rows = [p for p in points if p.get("configs")]
    if not rows:
        return []
    lines = ["## Grouped GEMM: forced table entries (--grouped-configs)", "",
             ("Times in us; x shipped = the family's shipped dispatch time / entry's (> 1: entry faster); x torch = "
              "torch_fp8 time / entry's; bits = output equal bit for bit to the family's reference entry (int8 and block "
              "fp8: the shipped Large entry; row-wise fp8: the promoted 128x128x128_c1x1_cooperative_persistent "
              "candidate; n/a: a fast-accumulation entry, a different sum, not compared; – : the reference did not "
              "run)."), "",
             "| model | gemm | T | rows | entry | us | x shipped | x torch | bits |", "|" + "---|" * 9]
    for p in rows:
        tm = p["time_ms"]
        for name, same in p["configs"]["bit_identical"].items():
            base = base_method(name)
            v = tm.get(name)
            lines.append(f"| {p['model']} | {p['gemm']} | {p['T']} | {p['rows']} | {name} | "
                         f"{_fmt(None if v is None else v * 1e3, '.1f')} | "
                         f"{_fmt(tm[base] / v if v and base in tm else None, '.3f')} | "
                         f"{_fmt(tm['torch_fp8'] / v if v and 'torch_fp8' in tm else None, '.3f')} | "
                         f"{_bits(name, same)} |")
    lines.append("")
    return lines
