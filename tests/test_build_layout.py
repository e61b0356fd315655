"""Source-tree checks that need no compiler: generated files are current, the build script is sane."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "csrc/gemm/generate_instantiations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_instantiations_are_current():
    """Every (operand, output, config) of the dispatch tables has its file, with the generated text."""
    gen = load_generator()
    expected = gen.expected_files()
    csrc = ROOT / "csrc" / "gemm"
    on_disk = {str(p.relative_to(csrc)): p.read_text() for p in csrc.glob("sm*/instantiations*/*.cu")}
    assert set(on_disk) == set(expected), "rerun: python csrc/gemm/generate_instantiations.py"
    for name, text in expected.items():
        assert on_disk[name] == text, f"{name} is stale: rerun the generator"
    sizes = gen.table_sizes(csrc / "sm90/scaled_mm_sm90_dispatch.cuh")
    assert sizes["Int8Configs"] >= 2 and sizes["Fp8Configs"] >= 2
    assert gen.table_sizes(csrc / "sm80/scaled_mm_sm80_dispatch.cuh")["Fp8Configs"] >= 2


def test_package_imports_without_extension():
    import cutlass_w8a8

    status = cutlass_w8a8.extension_status()
    assert "_C:" in status and "_kernels_sm90:" in status
