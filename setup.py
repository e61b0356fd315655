"""Build cutlass_w8a8: a torch CUDA extension plus one kernel library per GPU architecture.

    pip install nvidia-cutlass==4.2.0.0          # CUTLASS headers (or CUTLASS_W8A8_CUTLASS_DIR=<checkout>)
    pip install --no-build-isolation .           # builds against the torch already installed

What gets built (see csrc/gemm/kernel_api.h for why the split):
  cutlass_w8a8/_C.so               op implementations, argument checks, quantization kernels;
                                   compiled for every arch in TORCH_CUDA_ARCH_LIST
  cutlass_w8a8/_kernels_sm90.so    CUTLASS 3.x sm90 GEMMs, compiled only for sm_90a; built when
                                   TORCH_CUDA_ARCH_LIST names 9.0 / 9.0a (or, unset, when the local GPU is sm90)

Environment:
  TORCH_CUDA_ARCH_LIST      e.g. "9.0a"; unset: the local GPU's arch, else 9.0a
  MAX_JOBS                  parallel compile jobs (ninja)
  CUTLASS_W8A8_CUTLASS_DIR  a CUTLASS checkout to use instead of the nvidia-cutlass package
  CUTLASS_W8A8_NO_CUDA=1    install the pure-Python package only (also automatic with a CPU-only torch)
  CUTLASS_W8A8_TUNE=1       also build the sm90 tuning candidates (bench/tune_sm90.py); a comma list of tables
                            (int8, fp8, fp8-block, e.g. CUTLASS_W8A8_TUNE=fp8-block) builds only theirs; grouped:
                            the grouped (MoE) GEMM's (bench/bench_moe.py --grouped-configs)
"""

import glob
import importlib.util
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"cutlass_w8a8 setup: {msg}", file=sys.stderr)


def cuda_build_possible() -> tuple:
    """``(True, "")`` when the CUDA extension can be built, else ``(False, label)``: the local version label that
    says why not (see `version`)."""
    if os.environ.get("CUTLASS_W8A8_NO_CUDA") == "1":
        log("CUTLASS_W8A8_NO_CUDA=1: installing without the CUDA extension")
        return False, "nocuda.env"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        log("torch is not importable (install torch first, then pip install --no-build-isolation): "
            "installing without the CUDA extension")
        return False, "nocuda.notorch"
    if torch.version.cuda is None:
        log(f"torch {torch.__version__} is a CPU-only build: installing without the CUDA extension")
        return False, "nocuda.cputorch"
    if CUDA_HOME is None:
        log(f"torch {torch.__version__} has CUDA {torch.version.cuda} but no CUDA toolkit (nvcc) was found "
            "(set CUDA_HOME): installing without the CUDA extension")
        return False, "nocuda.nonvcc"
    return True, ""


def version(label: str) -> str:
    """``cutlass_w8a8.__version__`` plus the local label ``label``, e.g. ``0.1.0+cu130.sm90a``.

    pip shows a build's own output only with ``-v`` (checked with pip 23.2 and 26.3: the `log` lines above are
    hidden on success), but it always prints the installed version, "Successfully installed
    cutlass_w8a8-0.1.0+nocuda.cputorch": so the label says what was built. ``cu<CUDA>.sm<arch>...``: the CUDA
    extension for those arches; ``nocuda.<why>``: the pure-Python package only, because of ``env``
    (CUTLASS_W8A8_NO_CUDA=1), ``notorch`` (torch not importable), ``cputorch`` (a CPU-only torch) or ``nonvcc``
    (a CUDA torch but no CUDA toolkit).
    """
    import re

    with open(os.path.join(ROOT, "cutlass_w8a8", "__init__.py")) as f:
        base = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)
    return f"{base}+{label}"


def cutlass_include_dirs() -> list:
    root = os.environ.get("CUTLASS_W8A8_CUTLASS_DIR")
    if root:
        dirs = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    else:
        # Not `import cutlass`: that name belongs to the CuTe DSL. The headers ship inside cutlass_library.
        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 (offline: pip install "
                "--no-deps <path>/nvidia_cutlass-4.2.0.0-py3-none-any.whl), or set CUTLASS_W8A8_CUTLASS_DIR "
                "to a CUTLASS checkout")
        source = os.path.join(list(spec.submodule_search_locations)[0], "source")
        dirs = [os.path.join(source, "include"), os.path.join(source, "tools", "util", "include")]
    for d in dirs:
        if not os.path.isdir(d):
            raise RuntimeError(f"CUTLASS include directory {d} does not exist")
    return dirs


def arch_list() -> list:
    """Arches from TORCH_CUDA_ARCH_LIST ("9.0a;8.9" or "9.0a 8.9"), or the local GPU's, or 9.0a."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a.strip() for a in env.replace(";", " ").split() if a.strip()]
    import torch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
    else:
        arch = "9.0a"
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    log(f"TORCH_CUDA_ARCH_LIST unset: building for {arch}")
    return [arch]


# torch's extension flags define these, which hide the half/bfloat16 operators CUTLASS relies on.
UNDEF_NO_HALF = [
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
# No -std for _C: torch picks the standard its headers need. The kernel libraries include no torch header and
# are compiled as C++17, which CUTLASS 4.2 is tested with.
NVCC_COMMON = ["-O3", "-DNDEBUG", "--expt-relaxed-constexpr", *UNDEF_NO_HALF]
# _C's sources: nvcc splits a file's device-code optimization (cicc, ptxas) over up to 4 threads. On the H200 build
# machine (16 cores) csrc/attention/decode_attention.cu alone took 228 s of _C's ~230 s wall (ninja log of 7cc3b2d's
# clean build), the other _C objects done by ~100 s; its phases (nvcc -time, sm_90a): ptxas 123 s, cicc 74 s, host
# gcc 21 s, cudafe++ 13 s. On this 2-core machine, -split-compile=0 (2 threads) took it from 264 s to 221 s.
NVCC_C = [*NVCC_COMMON, "--split-compile=4"]
CXX_COMMON = ["-O3", "-DNDEBUG"]


def kernel_library(name: str, entry: str, patterns: list, cutlass_inc: list, gencode: list):
    """One torch-free kernel library (csrc/gemm/kernel_api.h), compiled only for `gencode`'s targets, from `entry`
    and the files matching `patterns` (globs relative to the repository root)."""
    from torch.utils.cpp_extension import CUDAExtension

    sources = [entry] + sorted({os.path.relpath(p, ROOT) for f in patterns for p in glob.glob(os.path.join(ROOT, f))})
    return CUDAExtension(
        name=f"cutlass_w8a8.{name}",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), *cutlass_inc],
        # Explicit -gencode flags also stop torch from adding TORCH_CUDA_ARCH_LIST's. Hidden visibility: only
        # the C entry points (marked default) leave the library, never its copies of C++ template symbols.
        extra_compile_args={
            "cxx": [*CXX_COMMON, "-fvisibility=hidden"],
            "nvcc": [*NVCC_COMMON, "-std=c++17", *gencode, "-Xcompiler=-fvisibility=hidden"],
        },
        # every instantiation the dispatcher names must be defined: fail at link time, not at load
        extra_link_args=["-Wl,-z,defs"],
    )


# The folders whose sources make up `_C` (the torch extension: op entry points, checks, the row-wise,
# attention and decode kernels). A new .cu / .cpp in one of them is built without editing this file; the
# CUTLASS kernels live in the per-arch libraries below (csrc/gemm/sm80, sm89, sm90), never in `_C`.
TORCH_SOURCE_DIRS = ("csrc", "csrc/core", "csrc/gemm", "csrc/gemm/decode", "csrc/graphs", "csrc/quant",
                     "csrc/attention", "csrc/models", "csrc/moe")


# CUTLASS_W8A8_TUNE's table names -> (file prefix under csrc/gemm/sm90/instantiations_tune/, macro). The macro makes
# scaled_mm_sm90.cu count and dispatch that table's candidates, and compiles the candidates that run a shipped
# config's kernel in its file (csrc/gemm/generate_instantiations.py).
# "grouped": the grouped (MoE) GEMM's candidates of every family (csrc/gemm/sm90/grouped/grouped_sm90_config.cuh).
TUNE_TABLES = {"int8": ("int8_", "CUTLASS_W8A8_TUNE_INT8"), "fp8": ("fp8_", "CUTLASS_W8A8_TUNE_FP8"),
               "fp8-block": ("fp8block_", "CUTLASS_W8A8_TUNE_FP8_BLOCK"),
               "grouped": ("grouped_", "CUTLASS_W8A8_TUNE_GROUPED")}


def tune_tables() -> list:
    """The tables whose tuning candidates CUTLASS_W8A8_TUNE asks for: all for "1" (or "all"), none when unset, empty
    or "0", else its comma list of TUNE_TABLES names. Raises ValueError naming CUTLASS_W8A8_TUNE for another value."""
    value = os.environ.get("CUTLASS_W8A8_TUNE", "").strip()
    if value in ("", "0"):
        return []
    if value in ("1", "all"):
        return list(TUNE_TABLES)
    tables = [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in tables if t not in TUNE_TABLES]
    if unknown or not tables:
        raise ValueError(f"CUTLASS_W8A8_TUNE must be 1, all, 0 or a comma list of {', '.join(TUNE_TABLES)}, "
                         f"got {value!r}")
    return [t for t in TUNE_TABLES if t in tables]


def torch_sources() -> list:
    return sorted(os.path.relpath(p, ROOT) for d in TORCH_SOURCE_DIRS for ext in ("*.cu", "*.cpp")
                  for p in glob.glob(os.path.join(ROOT, d, ext)))


def extensions():
    from torch.utils.cpp_extension import CUDAExtension

    arches = arch_list()
    cutlass_inc = cutlass_include_dirs()
    exts = [
        CUDAExtension(
            name="cutlass_w8a8._C",
            sources=torch_sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            # No flag here may contain "arch": torch then adds the TORCH_CUDA_ARCH_LIST flags itself.
            extra_compile_args={"cxx": CXX_COMMON, "nvcc": NVCC_C},
            libraries=["dl"],
        )
    ]
    tables = tune_tables()
    tune = bool(tables)
    numbers = sorted({a.split("+")[0].rstrip("a") for a in arches})  # "8.0", "8.9", "9.0", ...
    if "9.0" in numbers:
        # the dense GEMMs' instantiations and the grouped (mixture-of-experts) GEMM (csrc/gemm/sm90/grouped)
        patterns = ["csrc/gemm/sm90/instantiations/*.cu", "csrc/gemm/sm90/grouped/*.cu"]
        patterns += [f"csrc/gemm/sm90/instantiations_tune/{TUNE_TABLES[t][0]}*.cu" for t in tables]
        tune_flags = ["-DCUTLASS_W8A8_TUNE"] + [f"-D{TUNE_TABLES[t][1]}" for t in tables] if tune else []
        if tune:
            log(f"CUTLASS_W8A8_TUNE={os.environ['CUTLASS_W8A8_TUNE']}: building the sm90 tuning candidates of "
                f"{', '.join(tables)}, and no other arch's kernels")
        exts.append(kernel_library(
            "_kernels_sm90", "csrc/gemm/sm90/scaled_mm_sm90.cu", patterns, cutlass_inc,
            # wgmma and setmaxnreg need the arch-specific sm_90a target; GDC makes CUTLASS's kernels wait on
            # griddepcontrol before their first global access, which launching them with PDL requires
            # The TMA descriptor encoder resolved once per process instead of per launch (scaled_mm_sm90.cu)
            ["-gencode=arch=compute_90a,code=sm_90a", "-DCUTLASS_ENABLE_GDC_FOR_SM90",
             "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL", "-DcuTensorMapEncodeTiled=cw8a8_cuTensorMapEncodeTiled",
             *tune_flags]))
    else:
        log(f"TORCH_CUDA_ARCH_LIST={';'.join(arches)} has no 9.0: the sm90 kernels are not built")
    sm8x = [n for n in numbers if n.startswith("8.")]
    if (sm8x or "9.0" in numbers) and not tune:
        # int8 for every listed 8.x arch; from the compute_80 source also PTX (any later GPU can run it) and,
        # with 9.0 listed, sm_90 code: the path CUTLASS_W8A8_FORCE_ARCH=sm80 tests on Hopper.
        codes = ["compute_80"] + [f"sm_{n.replace('.', '')}" for n in ("8.0", "9.0") if n in numbers]
        gencode = [f"-gencode=arch=compute_80,code={c}" for c in codes]
        gencode += [f"-gencode=arch=compute_{d},code=sm_{d}" for d in (n.replace(".", "") for n in sm8x) if d != "80"]
        exts.append(kernel_library("_kernels_sm80", "csrc/gemm/sm80/scaled_mm_sm80.cu",
                                   ["csrc/gemm/sm80/instantiations/*.cu"], cutlass_inc, gencode))
    if "8.9" in sm8x and not tune:
        exts.append(kernel_library("_kernels_sm89", "csrc/gemm/sm89/scaled_mm_sm89.cu",
                                   ["csrc/gemm/sm89/instantiations/*.cu"], cutlass_inc,
                                   ["-gencode=arch=compute_89,code=sm_89"]))
    return exts


def checked_build_ext():
    """torch's BuildExtension, plus a check that each built library uses the shared libstdc++.

    A compiler that links libstdc++ statically (seen: a wrapper g++ set as CC/CXX on a GPU image) gives the
    extension a second copy of libstdc++ beside torch's; the two disagree on locale facet ids and the first
    error message that formats an integer crashes. Fail the build instead, with the fix.
    """
    from torch.utils.cpp_extension import BuildExtension

    class CheckedBuildExtension(BuildExtension):
        def build_extension(self, ext):
            super().build_extension(ext)
            path = self.get_ext_fullpath(ext.name)
            with open(path, "rb") as f:
                static_libstdcxx = b"_txnal_cow_string_C1_for_exceptions" in f.read()
            if static_libstdcxx:
                raise RuntimeError(
                    f"{path} contains a static copy of libstdc++ (the C++ compiler CXX="
                    f"{os.environ.get('CXX', '<default>')} links it statically). It must share torch's "
                    "libstdc++: rebuild with the system compiler, e.g. CC=/usr/bin/gcc CXX=/usr/bin/g++ "
                    "CUDAHOSTCXX=/usr/bin/g++ pip install --no-build-isolation .")

    return CheckedBuildExtension.with_options(no_python_abi_suffix=True, use_ninja=True)


build_cuda, label = cuda_build_possible()
if build_cuda:
    import re

    import torch

    ext_modules = extensions()  # sets TORCH_CUDA_ARCH_LIST when it was unset
    cmdclass = {"build_ext": checked_build_ext()}
    arches = os.environ["TORCH_CUDA_ARCH_LIST"].replace(";", " ").split()
    label = "cu" + torch.version.cuda.replace(".", "") + "".join(
        ".sm" + re.sub(r"[^0-9a-z]", "", a.lower()) for a in arches)
else:
    ext_modules, cmdclass = [], {}

setup(version=version(label), ext_modules=ext_modules, cmdclass=cmdclass)
