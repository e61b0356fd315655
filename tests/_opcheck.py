"""opcheck with fp8 operands, shared by the op tests (tests/ops/test_opcheck.py, tests/gemm/test_decode_gemm_*.py,
tests/gemm/test_grouped_mm_*.py, tests/ops/test_decode_attention_quant_cuda.py)."""

import torch

from _full import opcheck


# torch's schema check (test_schema) compares every tensor argument before and after the call with
# torch.allclose, which has no float8 kernel ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'):
# with fp8 operands it runs the other checks, and `inputs_unchanged` checks the mutation annotations instead.
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_SCHEMA = ALL_UTILS[1:]


def run_opcheck(op, args):
    has_fp8 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in args)
    opcheck(op, args, test_utils=NO_SCHEMA if has_fp8 else ALL_UTILS)
    if has_fp8:
        inputs_unchanged(op, args)


def inputs_unchanged(op, args):
    """What test_schema checks for the mutation annotations: only `Tensor(a!)` arguments change."""
    schema = op.default._schema
    before = [t.clone() if isinstance(t, torch.Tensor) else None for t in args]
    op(*args)
    for arg, old, new in zip(schema.arguments, before, args):
        if old is None:
            continue
        mutable = arg.alias_info is not None and arg.alias_info.is_write
        same = torch.equal(old.view(torch.uint8), new.view(torch.uint8)) if old.element_size() == 1 else \
            torch.equal(old.nan_to_num(), new.nan_to_num())
        if not mutable:
            assert same, f"{schema.name}: `{arg.name}` changed but is not annotated as mutable"
