#!/usr/bin/env bash
# One call on a fresh GPU machine: install the CUTLASS headers, build from clean, run the whole test suite,
# the main job and the benchmarks, writing logs and JSON to OUT_DIR.
#
#   scripts/gpu_run.sh OUT_DIR [STAGES]
#
# STAGES is a comma list, default "build,test,demo,bench": build (clean build + editable install), rebuild (an in-place
# build without removing build/: only changed sources recompile, for a second call on a warm machine), reuse
# (build only when the extension is not already built and importable: a second call on a warm machine), cached (unpack
# the .so files of an earlier build of the same sources from .socache/, else build: see below), incremental (the
# same, else recompile only the sources changed since an earlier build whose objects are in .objcache/: see below),
# objcache (after a build, write its objects for a later "incremental"), test
# (pytest, the whole suite), demo (python -m cutlass_w8a8), bench (bench/bench_gemm.py --quick), bench-full
# (every M), bench-block (bench/bench_gemm.py --block: block-scaled fp8 against torch's blockwise scaled_mm, row-wise
# fp8 and bf16 on the DeepSeek-V3 and Qwen3 shapes, every M, and the fp8 accuracy table; extra arguments in
# $BLOCK_ARGS, e.g. "--shapes dsv3" / "--shapes q3" to split it over two calls, or "--quick"), decoder
# (bench/bench_decoder.py; extra arguments in $DECODER_ARGS, e.g. "--config qwen3-30b-a3b --batches 1,8" for the
# Qwen3-MoE decoder), moe (bench/bench_moe.py: the grouped GEMM, ours int8 / fp8 / block vs torch's fp8
# scaled_grouped_mm and bf16 _grouped_mm, and the whole MoE layer vs transformers' bf16 experts, at Qwen3-30B-A3B and
# Mixtral-8x7B dims; extra arguments in $MOE_ARGS, e.g. "--quick"; MOE_ARGS="--parts decode" runs issue 36's decode part
# instead: fused vs unfused MoE layer at T <= 16, moe_decode_<device>.{json,md,png}), graph-update
# (bench/bench_graph_update.py), decode-gemm (bench/bench_decode_gemm.py; $DECODE_GEMM_ARGS), m1-torchao
# (bench/bench_m1_torchao.py: W8A8Linear vs torchao int8 weight-only + compile at M = 1; $M1_ARGS), host (bench/bench_host.py: host time per eager call), hf (bench/bench_hf.py:
# transformers Llama-3-8B dims, bf16 vs W8A8, eager and compiled; extra arguments in $HF_ARGS), fuzz (scripts/fuzz.py, 1000 cases), soak (scripts/soak.py),
# sanitize (scripts/sanitize.py, every schema op; the tools in $SANITIZE_TOOLS, default all four, $SANITIZE_JOBS at a
# time, default 4; see the stage), build-tune + tune (the sm90 tuning build,
# of the tables in $TUNE_TABLES: CUTLASS_W8A8_TUNE's value, default 1 = all, e.g. "fp8-block" or "fp8,fp8-block", or
# "grouped" for the grouped GEMM's, which stage moe times with MOE_ARGS="--parts gemm --grouped-configs waves"; then
# bench/tune_sm90.py, one run per config table in $TUNE_DTYPES, default $TUNE_TABLES' or all three, extra arguments in
# $TUNE_ARGS, e.g. "--m 256,1024 --shapes dsv3"). Offline: the nvidia-cutlass wheel is taken from .whl/ (git-ignored; copy
# nvidia_cutlass-4.2.0.0-py3-none-any.whl there) when cutlass_library is not importable.
# Optional, also from .whl/ when present and not importable, outside the Python environment: a torchao wheel
# (torchao-*.whl, installed with --target /tmp/site: bench_gemm.py's torchao columns) and Warp without its CPU
# compiler (warp-*-cuda-only.tar.xz, untarred into /tmp/warp_pkg: tests/graphs/test_warp_cuda.py); both directories
# go on PYTHONPATH. Without them those columns and tests are left out with a printed reason.
# Any other wheels in .whl/ (compressed-tensors and what it needs, llm-compressor, ...: the checkpoint tests)
# are installed with pip --no-deps --target /tmp/site as well, when their package is not importable.
# $PYTEST_ARGS replaces the test stage's selection (default: tests, the whole suite); $PYTEST_SHARDS=N runs the
# whole suite as N concurrent pytest processes instead.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_run.sh OUT_DIR [STAGES]}
STAGES=${2:-build,test,demo,bench}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # scripts/ and bench/ import the package from here
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The commit the tree was copied from, for the benchmark's provenance, when the copy's .git is stale:
#   git rev-parse HEAD > .whl/COMMIT   (before sending the tree; .whl/ is git-ignored and carried)
[ -f .whl/COMMIT ] && export CUTLASS_W8A8_GIT_COMMIT=$(cat .whl/COMMIT)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
# The GPU image sets CC/CXX/CUDAHOSTCXX to a wrapper g++ that links libstdc++ statically, which an extension
# sharing torch's libstdc++ must not do (setup.py refuses such a build); use the system g++ (13.3 there).
if [ -x /usr/bin/g++ ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
PY=${PYTHON:-python3}
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stamp() { echo "== $(date +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

stamp "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
stamp "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)'); nvcc: $(nvcc --version | tail -1)"

# The build cache (stage "cached"): the last GPU build's .so files, keyed by a hash of csrc/, setup.py, the torch
# version and TORCH_CUDA_ARCH_LIST. A build writes them to $OUT/so-KEY.tar.xz.NN (xz, parts under the 16 MiB a
# returned file may have); put the parts back together here as .socache/so-KEY.tar.xz (git-ignored) and carry
# .socache: a later call with "cached" unpacks them instead of building (about 300 s) when the key matches, and
# builds as "build" does when it does not.
so_key() {
  { find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum
    $PY -c 'import torch; print(torch.__version__, torch.version.cuda)'; echo "$TORCH_CUDA_ARCH_LIST"; } \
    | sha256sum | cut -c1-16
}
# The object cache (stages "objcache" and "incremental"): a clean build compiles all of csrc/ (about 420 s on 16
# cores); most calls change a few files. "objcache", after a build, writes $OUT/obj-KEY.tar.xz.NN: build/ (ninja's
# files and logs, the objects, the linked libraries) and the .so files, with build/objcache_manifest.txt (the repo's
# path, torch, the arch list, then every csrc/ and setup.py file's sha256); put the parts together here as
# .objcache/obj-KEY.tar.xz (git-ignored; keep the newest only: it is carried) and carry .objcache. "incremental":
#   - the .so cache when it matches the sources exactly (as "cached");
#   - else the newest .objcache/obj-*.tar.xz whose path, torch and arch list match this machine's: unpacked, the
#     sources the manifest lists unchanged dated back to 2000, changed or new ones left at the checkout's time, the
#     CUTLASS headers dated back too (pip gives them the install time), then "rebuild": ninja recompiles the changed
#     sources and what includes them (its deps log, restored with the objects and their times), setuptools relinks
#     the extensions whose sources changed;
#   - else, or when that rebuild fails, a clean build.
objcache_head() {
  echo "path $PWD"
  $PY -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'
  echo "arch $TORCH_CUDA_ARCH_LIST"
}
source_sums() { find csrc setup.py -type f | LC_ALL=C sort | xargs sha256sum; }
OLD_TIME=946684800  # 2000-01-01
incremental_from=
if has incremental && ! has build && ! has build-tune; then
  key=$(so_key)
  obj=$(ls -t .objcache/obj-*.tar.xz 2>/dev/null | head -1)
  if [ -f ".socache/so-$key.tar.xz" ]; then
    STAGES="$STAGES,cached"
  elif [ -n "$obj" ] && rm -rf build && tar -xJf "$obj" && [ -f build/objcache_manifest.txt ] \
       && [ "$(head -3 build/objcache_manifest.txt)" == "$(objcache_head)" ]; then
    changed=$(diff <(tail -n +4 build/objcache_manifest.txt) <(source_sums) | sed -n 's/^> [0-9a-f]*  //p')
    find csrc setup.py -type f -exec touch -d "@$OLD_TIME" {} +
    for f in $changed; do touch "$f"; done  # newer than every restored object
    incremental_from=$obj
    STAGES="$STAGES,rebuild"
    stamp "incremental: $(echo "$changed" | grep -c .) source file(s) changed since $(basename "$obj"): $(echo $changed | cut -c1-300)"
  else
    rm -rf build cutlass_w8a8/*.so
    stamp "incremental: no usable object cache (${obj:-none in .objcache/}), building from clean"
    STAGES="$STAGES,build"
  fi
fi

if has cached && ! has build && ! has build-tune; then
  key=$(so_key)
  if [ -f ".socache/so-$key.tar.xz" ] && tar -C cutlass_w8a8 -xJf ".socache/so-$key.tar.xz" \
     && $PY -c "import sys, cutlass_w8a8 as cw; sys.exit(not cw.cuda_ops_available())" 2>/dev/null; then
    stamp "cached: the .so files of key $key unpacked, no build ($($PY -c 'import cutlass_w8a8 as cw; print(cw.extension_status())'))"
  else
    stamp "cached: no usable .socache/so-$key.tar.xz, building"
    STAGES="$STAGES,build"
  fi
fi

if has reuse && ! has build && ! has build-tune; then
  if $PY -c "import sys, cutlass_w8a8 as cw; sys.exit(not cw.cuda_ops_available())" 2>/dev/null; then
    stamp "reuse: the extension is built and loads ($($PY -c 'import cutlass_w8a8 as cw; print(cw.extension_status())'))"
  else
    stamp "reuse: nothing usable built here, building"
    STAGES="$STAGES,build"
  fi
fi

if has build || has build-tune || has rebuild; then
  if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    $PY -m pip install -q --no-deps --no-index .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl >"$OUT/pip_cutlass.log" 2>&1 \
      || { stamp "FAIL: installing the nvidia-cutlass wheel from .whl/"; exit 1; }
  fi
  # pyproject.toml's SPDX `license` needs setuptools >= 77 (PEP 639); --no-build-isolation uses the machine's.
  if ! $PY -c "import sys, setuptools; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    $PY -m pip install -q --no-deps --no-index .whl/setuptools-*.whl >"$OUT/pip_setuptools.log" 2>&1 \
      || { stamp "FAIL: setuptools < 77 and no usable setuptools wheel in .whl/"; exit 1; }
  fi
  if [ -n "$incremental_from" ]; then  # see "incremental": the installed CUTLASS headers older than the objects
    cutlass_dir=$($PY -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')
    find "$cutlass_dir" -exec touch -h -d "@$OLD_TIME" {} +
  fi
  if has build || has build-tune; then rm -rf build cutlass_w8a8/*.so; fi  # rebuild: ninja redoes changed sources only
  has build-tune && export CUTLASS_W8A8_TUNE=${TUNE_TABLES:-1}
  # pip install -e (PEP 660) compiles in a temporary directory: nothing survives for ninja to reuse. The stages that
  # reuse objects (rebuild, incremental, objcache) build in place instead: setup.py build_ext --inplace keeps ninja's
  # files and objects in build/ and puts the .so files in cutlass_w8a8/, which imports from the checkout (PYTHONPATH
  # above). --force: setuptools would skip an extension whose listed sources are older than its .so and so miss a
  # header-only change; ninja still recompiles only what changed (its deps log), then each extension is relinked.
  if has rebuild || has incremental || has objcache; then
    build_cmd=("$PY" setup.py build_ext --inplace --force)
  else
    build_cmd=("$PY" -m pip install --no-build-isolation --no-deps -v -e .)
  fi
  t0=$(date +%s)
  "${build_cmd[@]}" >"$OUT/build.log" 2>&1
  rc=$?
  t1=$(date +%s)
  stamp "build: rc=$rc in $((t1 - t0)) s (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS${CUTLASS_W8A8_TUNE:+ TUNE=$CUTLASS_W8A8_TUNE}${incremental_from:+, incremental: $(grep -cE '^\[[0-9]+/[0-9]+\]' "$OUT/build.log") ninja step(s)})"
  if [ $rc -ne 0 ] && [ -n "$incremental_from" ]; then
    cp "$OUT/build.log" "$OUT/build_incremental.log"
    stamp "incremental: the rebuild failed (build_incremental.log), building from clean"
    incremental_from=
    rm -rf build cutlass_w8a8/*.so
    t0=$(date +%s)
    "${build_cmd[@]}" >"$OUT/build.log" 2>&1
    rc=$?
    t1=$(date +%s)
    stamp "build: rc=$rc in $((t1 - t0)) s (from clean)"
  fi
  if [ $rc -ne 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -40; exit 1; fi
  ls -la cutlass_w8a8/*.so | tee -a "$OUT/summary.txt"
  $PY -c "import cutlass_w8a8 as cw; print(cw.extension_status())" | tee -a "$OUT/summary.txt"
  if ! has build-tune; then  # the build cache (see "cached" above); a tuning build is not the default one
    key=$(so_key)
    (cd cutlass_w8a8 && tar -cf - *.so) | xz -T0 -6 | split -b 15M -d - "$OUT/so-$key.tar.xz."
    stamp "build cache: $(ls "$OUT"/so-"$key".tar.xz.* | wc -l) part(s) of so-$key.tar.xz in $OUT (cat them into .socache/)"
    if has objcache; then  # see "incremental"
      { objcache_head; source_sums; } > build/objcache_manifest.txt
      tar -cf - build cutlass_w8a8/*.so | xz -T0 -6 | split -b 15M -d - "$OUT/obj-$key.tar.xz."
      stamp "object cache: $(ls "$OUT"/obj-"$key".tar.xz.* | wc -l) part(s), $(cat "$OUT"/obj-"$key".tar.xz.* | wc -c) bytes, of obj-$key.tar.xz in $OUT (cat them into .objcache/)"
    fi
  fi
fi

# Optional peers for the tests and benchmarks (see the header): installed once per machine, then reused.
if has test || has bench || has bench-full || has m1-torchao; then
  tao_whl=$(ls .whl/torchao-*.whl 2>/dev/null | head -1)
  if [ -z "$tao_whl" ]; then
    stamp "torchao: no wheel in .whl/; the torchao benchmark columns are left out"
  elif $PY -c "import torchao" >/dev/null 2>&1; then
    stamp "torchao: already importable ($($PY -c 'import torchao; print(torchao.__version__)' 2>/dev/null | tail -1))"
  else
    if [ ! -d /tmp/site/torchao ]; then
      $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$tao_whl" \
        >"$OUT/pip_torchao.log" 2>&1 || stamp "torchao: installing $tao_whl failed (see pip_torchao.log)"
      # the wheel also ships torchao's own tests as a top-level 'test' package, which would shadow the stdlib's
      grep -q '^test/__init__.py,' /tmp/site/torchao-*.dist-info/RECORD 2>/dev/null && rm -rf /tmp/site/test
    fi
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
    if ver=$($PY -c 'import torchao; print(torchao.__version__)' 2>"$OUT/torchao_import.log" | tail -1); then
      stamp "torchao: $ver from $tao_whl (/tmp/site on PYTHONPATH)"
    else
      stamp "torchao: $tao_whl does not import, its columns are left out: $(tail -1 "$OUT/torchao_import.log")"
    fi
  fi
  warp_tar=$(ls .whl/warp-*.tar.xz 2>/dev/null | head -1)
  if [ -z "$warp_tar" ]; then
    stamp "warp: no tarball in .whl/; tests/graphs/test_warp_cuda.py skips"
  elif $PY -c "import warp" >/dev/null 2>&1; then
    stamp "warp: already importable ($($PY -c 'import warp; print(warp.__version__)' 2>/dev/null | tail -1))"
  else
    if [ ! -f /tmp/warp_pkg/warp/__init__.py ]; then
      mkdir -p /tmp/warp_pkg && tar -xJf "$warp_tar" -C /tmp/warp_pkg || stamp "warp: untarring $warp_tar failed"
    fi
    export PYTHONPATH="/tmp/warp_pkg:$PYTHONPATH"
    if ver=$($PY -c 'import warp; print(warp.__version__)' 2>"$OUT/warp_import.log" | tail -1); then
      stamp "warp: $ver from $warp_tar (/tmp/warp_pkg on PYTHONPATH)"
    else
      stamp "warp: $warp_tar does not import, tests/graphs/test_warp_cuda.py skips: $(tail -1 "$OUT/warp_import.log")"
    fi
  fi
fi

# Other wheels (.whl/*.whl but the CUTLASS and torchao ones): test and benchmark dependencies missing here
if has test || has hf; then
  extra=()
  for w in .whl/*.whl; do
    case "$(basename "$w")" in nvidia_cutlass-*|torchao-*) continue ;; esac
    [ -f "$w" ] && extra+=("$w")
  done
  if [ ${#extra[@]} -gt 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${extra[@]}" >"$OUT/pip_extra.log" 2>&1 \
      || stamp "extra wheels: install failed (see pip_extra.log)"
    [[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] || export PYTHONPATH="/tmp/site:$PYTHONPATH"
    stamp "extra wheels: ${#extra[@]} from .whl/ into /tmp/site"
  fi
fi

# the whole matrix (tests/conftest.py): the tests marked `full`, skipped by the README's quick CPU command, run here
has test && export CUTLASS_W8A8_FULL_TESTS=${CUTLASS_W8A8_FULL_TESTS:-1}
if has test && [ -n "${PYTEST_SHARDS:-}" ]; then
  # The whole suite as PYTEST_SHARDS pytest processes on the one GPU at once, test files dealt round-robin (a clean
  # build plus the serial suite no longer fit one 10-minute device call). Each shard: tests_<i>.log, junit_<i>.xml.
  t0=$(date +%s)
  mapfile -t files < <(find tests -name "test_*.py" | sort)
  pids=()
  for ((i = 0; i < PYTEST_SHARDS; i++)); do
    shard=()
    for ((j = i; j < ${#files[@]}; j += PYTEST_SHARDS)); do shard+=("${files[j]}"); done
    $PY -m pytest "${shard[@]}" -q -rs -p no:cacheprovider --junitxml="$OUT/junit_$i.xml" >"$OUT/tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < PYTEST_SHARDS; i++)); do
    wait "${pids[i]}"; rc=$?
    stamp "tests shard $i/$PYTEST_SHARDS: rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests_$i.log")"
    [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error" "$OUT/tests_$i.log" | head -30; status=1; }
  done
elif has test; then
  t0=$(date +%s)
  $PY -m pytest ${PYTEST_ARGS:-tests} -q -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" >"$OUT/tests.log" 2>&1
  rc=$?
  stamp "tests: rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error" "$OUT/tests.log" | head -30; status=1; }
fi

if has demo; then
  $PY -m cutlass_w8a8 >"$OUT/demo.log" 2>&1
  rc=$?
  stamp "demo: rc=$rc"
  cat "$OUT/demo.log"
  [ $rc -ne 0 ] && status=1
fi

if has bench || has bench-full; then
  mode=--quick
  has bench-full && mode=
  $PY bench/bench_gemm.py $mode --out "$OUT" >"$OUT/bench.log" 2>&1
  rc=$?
  stamp "bench: rc=$rc"
  tail -40 "$OUT/bench.log"
  [ $rc -ne 0 ] && status=1
fi

run_stage() {  # name, log, command...: run, stamp rc, print the log's tail, remember failure
  local name=$1 log=$2; shift 2
  local t0=$(date +%s)
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  stamp "$name: rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -30 "$OUT/$log"
  [ $rc -ne 0 ] && status=1
  return 0
}

has bench-block && run_stage bench-block bench_block.log $PY bench/bench_gemm.py --block --out "$OUT" ${BLOCK_ARGS:-}
has decoder && run_stage decoder decoder.log $PY bench/bench_decoder.py --out "$OUT" ${DECODER_ARGS:-}
has moe && run_stage moe moe.log $PY bench/bench_moe.py --out "$OUT" ${MOE_ARGS:-}
has decode-gemm && run_stage decode-gemm decode_gemm.log $PY bench/bench_decode_gemm.py --out "$OUT" ${DECODE_GEMM_ARGS:-}
has m1-torchao && run_stage m1-torchao m1_torchao.log $PY bench/bench_m1_torchao.py --out "$OUT" ${M1_ARGS:-}
has host && run_stage host host.log $PY bench/bench_host.py --out "$OUT" ${HOST_ARGS:-}
has hf && run_stage hf hf.log $PY bench/bench_hf.py --out "$OUT" ${HF_ARGS:-}
has graph-update && run_stage graph-update graph_update.log $PY bench/bench_graph_update.py --out "$OUT"
has fuzz && run_stage fuzz fuzz.log $PY scripts/fuzz.py --cases 1000 --seed 0 --dtypes int8,fp8 --max-seconds 400
has soak && run_stage soak soak.log $PY scripts/soak.py
if has sanitize; then
  # scripts/sanitize.py: every schema op under each tool, the tools $SANITIZE_JOBS at a time (default 4: all at once,
  # one sanitizer process each on the one GPU), racecheck (the slowest) with its --quick selection. Each tool's two
  # driver processes (eager cases uncached, CUDA-graph cases cached) share $SANITIZE_TIMEOUT seconds, by default
  # 520 s divided over the rounds the jobs need, so the stage fits one 10-minute device call. Extra arguments in
  # $SANITIZE_ARGS (e.g. "--cases grouped|moe"). Full reports: $OUT/sanitize/<tool>_<eager|graphs>.log.
  san_tools=$(echo ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck} | tr ' ' ',')
  san_jobs=${SANITIZE_JOBS:-4}
  san_n=$(echo "$san_tools" | tr ',' '\n' | wc -l)
  san_rounds=$(( (san_n + san_jobs - 1) / san_jobs ))
  run_stage sanitize sanitize.log $PY scripts/sanitize.py --tools "$san_tools" --jobs "$san_jobs" \
    --quick-tools racecheck --timeout "${SANITIZE_TIMEOUT:-$((520 / san_rounds))}" --log-dir "$OUT/sanitize" \
    ${SANITIZE_ARGS:-}
fi

if has tune; then
  tune_default="int8 fp8 fp8-block"  # or the tables $TUNE_TABLES built
  case "${TUNE_TABLES:-1}" in 1|all) ;; *) tune_default=${TUNE_TABLES//,/ } ;; esac
  tune_default=${tune_default//grouped/}  # the grouped candidates: bench_moe.py --grouped-configs (stage moe)
  for dtype in ${TUNE_DTYPES:-$tune_default}; do  # one file each, so a run cut short keeps what finished
    run_stage "tune $dtype" "tune_$dtype.log" $PY bench/tune_sm90.py --dtypes $dtype --out "$OUT" ${TUNE_ARGS:-}
  done
fi

cat "$OUT/summary.txt"
exit $status
