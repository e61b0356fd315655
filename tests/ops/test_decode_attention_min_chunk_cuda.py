"""CUTLASS_W8A8_ATTN_MIN_CHUNK (csrc/attention/decode_attention.cu min_chunk: the least positions per split of a full
cache, read once per process; an A/B knob of issue 36's attention work). Another value changes the split count, hence
the bits, so it is checked against the float64 reference: test_decode_attention_cuda.py's reference, long-cache,
ragged-row and graph tests pass in a process with 16 positions per split (at most S / 16 splits, twice the default's
cap; under the default wave rule min_chunk is also a CTA's fixed cost in the split count's model). A value that is
not a multiple of 8 in [8, 4096] makes the op raise a ValueError naming the variable, not run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda

HERE = pathlib.Path(__file__)
ENV = "CUTLASS_W8A8_ATTN_MIN_CHUNK"


def _env(value: str) -> dict:
    return {**os.environ, ENV: value}


def test_smaller_chunks_still_match_the_reference():
    if os.environ.get(ENV):
        pytest.skip(f"{ENV} is already set in this process")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
           str(HERE.parent / "test_decode_attention_cuda.py"), "-k",
           "float64_reference or long_cache or mixed_short_and_long or cuda_graph_replay or rows_are_independent"]
    r = subprocess.run(cmd, env=_env("16"), capture_output=True, text=True, timeout=900, cwd=HERE.parents[2])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("value", ["7", "0", "8192", "abc"])
def test_a_bad_value_raises_naming_the_variable(value):
    code = ("import torch, cutlass_w8a8 as cw\n"
            "from cutlass_w8a8.testing.attention import make_inputs\n"
            "q, kv, slots, pos = make_inputs(1, 8, 8, 64, 256, torch.bfloat16, 'cuda', seed=0)\n"
            "try:\n"
            "    cw.decode_attention(q, kv, slots, pos)\n"
            "except ValueError as exc:\n"
            "    print('RAISED', exc)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(value), capture_output=True, text=True, timeout=300,
                       cwd=HERE.parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RAISED" in r.stdout and f"{ENV} must be a multiple of 8 in [8, 4096], got '{value}'" in r.stdout, r.stdout
