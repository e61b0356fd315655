"""Test and benchmark support shared by tests/, bench/ and scripts/: GPU timers (`timers`), fp32/fp64
references and tolerances (`references`), fuzz case generators (`fuzz`) and decode-attention references
(`attention`), as FlashInfer keeps them in `flashinfer/testing/`. Importing it touches no GPU.
"""
