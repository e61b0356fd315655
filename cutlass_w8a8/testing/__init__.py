"""Test and benchmark support shared by tests/, bench/ and scripts/, as FlashInfer keeps it in
`flashinfer/testing/`: GPU timers (`timers`), fp32/fp64 references and tolerances (`references`), fuzz case
generators (`fuzz`), decode-attention references (`attention`), the benchmark GEMM shapes (`shapes`), argparse
types (`cli`), the writing of benchmark results (`report`), and the transformers decode benchmark's steps and
report (`hf_decode_steps`, `hf_decode_report`, for bench/bench_hf.py), and tensor-parallel test support (`tp`:
spawned process groups, the row-parallel error bounds), and the ops a step launches (`op_calls`). Importing it
touches no GPU.
"""
