"""scripts/gpu_run.sh's object cache (stages ``objcache`` / ``incremental``), run without a compiler or a GPU.

The script runs on a copy of csrc/, setup.py and itself, with a stand-in interpreter ($PYTHON) whose
``setup.py`` build fails at once (everything else is this Python). What is checked is the shell logic that
decides what ninja will see on the GPU machine:

- a matching archive (same repo path, torch and arch list) is unpacked, the source files whose sha256 differs from
  the archive's manifest are the ones reported changed and keep a current time, every other source is dated
  back to 2000-01-01, and a failing rebuild falls back to a clean build;
- an archive from another repo path is not used: a clean build instead.

Whether ninja then recompiles only the changed objects is a property of the GPU machine's build, not tested here.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_TIME = 946684800  # the script's OLD_TIME: 2000-01-01

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xz") is None,
                                reason="needs bash and xz")


def _copy_tree(dst: pathlib.Path) -> None:
    (dst / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "gpu_run.sh", dst / "scripts" / "gpu_run.sh")
    shutil.copy2(ROOT / "setup.py", dst / "setup.py")
    shutil.copytree(ROOT / "csrc", dst / "csrc")
    (dst / "cutlass_w8a8").mkdir()


def _manifest(repo: pathlib.Path, path: str) -> str:
    """The manifest gpu_run.sh writes (objcache_head, then source_sums), for repo path `path`."""
    head = [f"path {path}", f"torch {torch.__version__} {torch.version.cuda}", "arch 9.0a"]
    files = sorted([str(p.relative_to(repo)) for p in (repo / "csrc").rglob("*") if p.is_file()] + ["setup.py"])
    sums = [f"{hashlib.sha256((repo / f).read_bytes()).hexdigest()}  {f}" for f in files]
    return "\n".join(head + sums) + "\n"


def _write_archive(repo: pathlib.Path, manifest: str) -> None:
    """.objcache/obj-test.tar.xz holding build/objcache_manifest.txt, an object and a .so, as objcache writes."""
    (repo / ".objcache").mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("build/objcache_manifest.txt", manifest.encode()), ("build/temp/x.o", b"obj"),
                           ("cutlass_w8a8/_C.so", b"so")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    xz = subprocess.run(["xz", "-c"], input=buf.getvalue(), capture_output=True, check=True)
    (repo / ".objcache" / "obj-test.tar.xz").write_bytes(xz.stdout)


def _run(repo: pathlib.Path, tmp_path: pathlib.Path) -> tuple[int, str]:
    fake = tmp_path / "fakepy"
    fake.write_text("#!/usr/bin/env bash\n"
                    "# a build that fails at once; any other use is this Python\n"
                    'if [ "$1" = setup.py ]; then echo "stand-in build: failing"; exit 3; fi\n'
                    f'exec "{sys.executable}" "$@"\n')
    fake.chmod(0o755)
    # A stand-in cutlass_library first on the path: the script neither installs the wheel (absent from the copy's
    # .whl/; on the GPU machine the package may not be installed in the test's process) nor dates back the real
    # package's headers.
    stub = tmp_path / "stub_site" / "cutlass_library"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("CUTLASS_W8A8_GIT_COMMIT",)}
    env.update(PYTHON=str(fake), TORCH_CUDA_ARCH_LIST="9.0a", PATH=os.environ.get("PATH", ""),
               PYTHONPATH=os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH", "")])))
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(repo / "scripts" / "gpu_run.sh"), str(out), "incremental"], env=env,
                       capture_output=True, text=True, timeout=300)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return r.returncode, summary + r.stdout[-3000:] + r.stderr[-3000:]


def test_incremental_restores_and_dates_back_unchanged_sources(tmp_path):
    repo = tmp_path / "repo"
    _copy_tree(repo)
    _write_archive(repo, _manifest(repo, str(repo)))
    changed = repo / "csrc" / "attention" / "rope_kv_cache.cu"
    changed.write_text(changed.read_text() + "// changed after the archived build\n")
    rc, log = _run(repo, tmp_path)
    assert rc == 1, log  # the stand-in build fails, and so does the clean build it falls back to
    assert "incremental: 1 source file(s) changed since obj-test.tar.xz: csrc/attention/rope_kv_cache.cu" in log, log
    assert "incremental: the rebuild failed" in log and "(from clean)" in log, log
    assert changed.stat().st_mtime > OLD_TIME + 86400  # newer than every restored object
    others = [p for p in (repo / "csrc").rglob("*") if p.is_file() and p != changed] + [repo / "setup.py"]
    assert others and all(p.stat().st_mtime == OLD_TIME for p in others)
    # the CUTLASS headers (here the stand-in package) dated back with them
    assert (tmp_path / "stub_site" / "cutlass_library" / "__init__.py").stat().st_mtime == OLD_TIME


def test_an_archive_from_another_path_is_not_used(tmp_path):
    repo = tmp_path / "repo"
    _copy_tree(repo)
    _write_archive(repo, _manifest(repo, "/somewhere/else"))
    rc, log = _run(repo, tmp_path)
    assert rc == 1, log
    assert "incremental: no usable object cache (.objcache/obj-test.tar.xz), building from clean" in log, log
    assert "source file(s) changed" not in log, log
    assert not (repo / "build").exists()  # removed with the unusable archive's contents
