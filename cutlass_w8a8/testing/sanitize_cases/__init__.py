"""The cases `scripts/sanitize.py` runs under compute-sanitizer: every op of the schema (`cutlass_w8a8.ops._schema.OPS`,
the one DEF block) in the modes it serves, each result checked.

A `Case` names the schema ops it calls (``ops``) and runs them on small problems whose sizes cross the dispatch
buckets that matter (decode M <= 16 against the CUTLASS GEMMs, the grouped decode bound, empty experts, K tails,
row lengths that take the cluster kernels). `run_case` records, with a torch dispatch mode, which ops of the namespace
were called on the case's device, and fails the case when one it names was not: a case cannot claim an op it does not
drive. `coverage_errors` fails the whole run when an op of the schema is named by no case and is not in `NOT_DRIVEN`,
so a new op cannot go without a sanitizer run unnoticed.

Every result is checked, so a kernel that silently did nothing (or too little) shows:

- GEMMs (dense, decode, block, grouped) against the float64 product of the dequantized operands, within the bounds
  of the CUDA tests (`assert_close_to_reference`; `block_reference` for block fp8); outputs start as host-written
  NaN, so an element left unwritten fails;
- quantization, MoE routing (align, permute-quant, unpermute) bit for bit against the CPU implementations, which do
  the kernels' float32 arithmetic; `moe_topk_softmax` ids exactly and weights within a few float32 ulps;
- the fused quantizers (norm, SiLU, attention) bit for bit against the unfused chain on the same device, whose float
  outputs are within the CUDA tests' bounds of the CPU implementation (`ROW_ULPS`, `ROW_F32_REL`: a float32 sum
  order, expf against the CPU's exp, and the roundings to the dtype that follow);
- decode attention against its float64 reference (`cutlass_w8a8.testing.attention`); rope + cache writes within one
  ulp of the CPU, untouched entries unchanged;
- chains (`decode_layer`, the CUDA-graph cases) finite and within `LOOSE_REL` of the CPU chain; graph replays equal
  to the eager chain bit for bit.

The same cases run on the CPU (``device="cpu"``: the CPU implementations, no sanitizer), which is what
tests/ops/test_sanitize_cpu.py does, so their argument conventions stay right between GPU runs. On the CPU the graph
cases run their chains eagerly and `_graph_update_scaled_mm` (CUDA only: it rewrites a captured kernel node) is not
called; the case that drives it on the GPU runs the same GEMMs through ``scaled_mm_out`` instead.

compute-sanitizer specifics, handled here:

- Inputs are drawn on the host and copied over (initcheck counts a host-to-device copy as initialisation; it flagged
  thousands of reads of torch.randint's device output as uninitialised).
- initcheck does not count the sm90 epilogue's TMA stores as writes (H200, compute-sanitizer of CUDA 13.0): with
  ``prefill=True`` (scripts/sanitize.py sets it for initcheck) a GEMM that may store by TMA writes into a host-written
  NaN buffer (the out= op), and an op without an out= form at such sizes (`w8a8_linear` at M past the decode bound)
  runs but its output is not read back.
- CUDA-graph capture needs torch's caching allocator (a graph's memory pool), which scripts/sanitize.py turns off for
  exact bounds (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``): the graph cases (``graphs=True``) run in a second driver
  process with the allocator on.

The package: `core` (the context `Ctx`, the `@case` registry `CASES`, the checks, the op recorder, the coverage and
the driver) and the cases by area, registered at import in this order: `gemm` (dense GEMMs), `quant_norm`
(quantization, fused norm / SiLU), `attention` (decode attention, rope + cache, decode_layer), `moe` (routing, the
grouped GEMM), `graphs` (CUDA graphs).
"""

from .core import (BF16, CASES, DEFAULT_MS, F16, F32, FP8, GROUPED_DECODE_MAX_ROWS, I8, LOOSE_REL, NOT_DRIVEN, QMAX,
                   ROW_F32_REL, ROW_ULPS, Case, CaseResult, Ctx, Q, case, check_equal, check_gemm, check_loose,
                   check_row, check_ulps, coverage_errors, run_case, run_driver, select_cases)

# the area modules register their cases in CASES at import: this order is the registration (and run) order
from . import gemm, quant_norm, attention, moe, graphs  # noqa: E402,F401,I001

__all__ = ["CASES", "Case", "CaseResult", "Ctx", "DEFAULT_MS", "LOOSE_REL", "NOT_DRIVEN", "coverage_errors",
           "run_case", "run_driver", "select_cases"]
