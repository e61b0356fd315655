"""Test and benchmark support shared by tests/, bench/ and scripts/, as FlashInfer keeps it in
`flashinfer/testing/`: GPU timers (`timers`), fp32/fp64 references and tolerances (`references`), fuzz case
generators (`fuzz`), decode-attention references (`attention`), the benchmark GEMM shapes (`shapes`), argparse
types (`cli`) and the writing of benchmark results (`report`). Importing it touches no GPU.
"""
