#!/usr/bin/env bash
# `make gpu-check`: the GPU checks on a machine with torch already installed (no internet, no
# project venv; maybe no nvcc, maybe no transformers / peft / bitsandbytes). See docs/gpu.md.
#
#   bash bench/gpu_check.sh [all|tests|bench]     (default all: tests, then bench)
#
# Why it is written this way (a gpu-check that cannot come back empty):
# The first version built CUDA by force (no nvcc: nothing ran) and ran `pytest -m gpu` over the
# whole suite (one missing optional import aborted collection: nothing ran), and it put the
# worktree on PYTHONPATH, which no longer finds elastic_kernels.api (setup.py maps it from
# python_api/). So, in order, each step appending its output to $OUT/gpu_check.log and one line
# to $OUT/summary.txt before the next starts (a step that dies leaves what ran before it):
#  1. environment: torch, CUDA, Triton, nvcc, g++, GPUs, each optional package: printed;
#  2. install: elastic_kernels.api made importable: already (this worktree), else
#     `pip install --no-build-isolation --no-deps --no-index -e .` (offline, against the torch
#     there, the extension left to step 3), else a path hook ($OUT/.gpu_check_site/sitecustomize.py)
#     mapping elastic_kernels.api to python_api/;
#  3. build: the CUDA extension where nvcc is found; without nvcc the C++ part alone
#     (ELASTIC_SKIP_CUDA=1: the tests that need the CUDA kernels skip, saying so) and the Triton
#     kernels, which need no nvcc; without a compiler, no extension (ELASTIC_SKIP_EXT=1);
#  4. tests: an explicit list of files (GPU_TEST_FILES), each its own pytest process with its own
#     timeout, gpu-marked tests only; a file whose collection fails for want of an optional
#     package is reported "skipped: No module named X" and the next file runs; any other error
#     counts as a failure;
#  5. bench (a second command with its own time budget, GPU_CHECK_BENCH_S): each benchmark of
#     BENCHES with --device cuda --results $OUT, each bounded by what is left of the budget.
# The exit code is non-zero if a step failed; skipped files do not fail it.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
SUMMARY=$OUT/summary.txt
WHAT=${1:-all}
TESTS_BUDGET_S=${GPU_CHECK_TESTS_S:-420}   # all test files together
FILE_TIMEOUT_S=${GPU_CHECK_FILE_S:-180}    # one test file
BENCH_BUDGET_S=${GPU_CHECK_BENCH_S:-240}   # all benchmarks together
OPTIONAL=(transformers peft bitsandbytes torchao safetensors)   # what the GPU test files import
PYTEST_EXTRA=(${GPU_CHECK_PYTEST_ARGS:-})   # e.g. --collect-only (the dry run's test)
export ELASTIC_BENCH_RESULTS=$OUT   # bench/harness.py appends its rows here

# The GPU test files, each run on its own (`pytest -m gpu FILE`); add new ones here.
GPU_TEST_FILES=(${GPU_TEST_FILES:-
  tests/kernels/test_pack_ops.py
  tests/kernels/test_paged_linear.py
  tests/kernels/test_pool.py
  tests/kernels/test_quant.py
  tests/kernels/test_segmented_lora.py
  tests/kernels/test_segmented_lora_peft.py
  tests/runtime/test_runtime_device.py
  tests/runtime/test_stream_order.py
  tests/host/test_host_store.py
  tests/host/test_activation_offload.py
  tests/quant/test_quant_device.py
  tests/pipeline/test_pipeline_gpu.py
})
# Kernel benchmarks, each run as `$PYTHON <script> --device cuda --results $OUT`; add new ones here.
BENCHES=(${GPU_BENCHES:-
  bench/bench_pack.py
  bench/bench_paged_linear.py
  bench/bench_lora_linear.py
  bench/bench_pool.py
  bench/bench_offload.py
  bench/bench_quant.py
  bench/bench_segmented_lora.py
})

start=$(date +%s)
status=0
elapsed() { echo $(( $(date +%s) - start )); }
step() { echo "== gpu-check: $* ($(elapsed) s)" | tee -a "$LOG"; }
note() { echo "$*" | tee -a "$LOG" >>"$SUMMARY"; }   # one line in the summary and the log
run_logged() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

environment() {
  step "environment"
  run_logged "$PYTHON" - "${OPTIONAL[@]}" <<'EOF'
import importlib.util, os, shutil, sys
print("python", sys.version.split()[0], sys.executable)
try:
    import torch
    print("torch", torch.__version__, "| cuda", torch.version.cuda, "| devices", torch.cuda.device_count(),
          "|", ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "NO GPU visible")
except Exception as exc:  # noqa: BLE001
    print("torch: NOT IMPORTABLE:", exc)
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:  # noqa: BLE001
    print("triton: NOT IMPORTABLE:", exc)
print("nvcc", shutil.which("nvcc") or "absent", "| CUDA_HOME", os.environ.get("CUDA_HOME", "unset"),
      "| c++", shutil.which("c++") or shutil.which("g++") or "absent")
print("CUDA_VISIBLE_DEVICES", repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
for name in sys.argv[1:]:
    try:
        spec = importlib.util.find_spec(name)
        found = spec is not None
    except Exception:  # noqa: BLE001
        found = False
    if found and os.environ.get("GPU_CHECK_IMPORT", "1") == "0":  # the dry run's test: found, not imported
        print(f"optional {name}: present")
    elif found:
        try:
            mod = __import__(name)
            print(f"optional {name}: {getattr(mod, '__version__', '?')}")
        except Exception as exc:  # noqa: BLE001
            print(f"optional {name}: present but its import fails: {type(exc).__name__}: {str(exc)[:200]}")
    else:
        print(f"optional {name}: absent")
EOF
  command -v nvidia-smi >/dev/null && run_logged nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  HAVE_NVCC=0; { command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; } && HAVE_NVCC=1
  HAVE_CXX=0; { command -v c++ >/dev/null || command -v g++ >/dev/null; } && HAVE_CXX=1
  note "environment: nvcc $([ $HAVE_NVCC = 1 ] && echo found || echo absent), C++ compiler $([ $HAVE_CXX = 1 ] && echo found || echo absent)"
}

api_importable() {  # elastic_kernels.api imports, from this worktree
  "$PYTHON" -c 'import os, sys, elastic_kernels.api as a; sys.exit(0 if os.path.realpath(a.__file__).startswith(os.path.realpath(sys.argv[1])) else 1)' "$ROOT" >/dev/null 2>&1
}

install() {
  step "install (elastic_kernels.api importable from $ROOT)"
  if api_importable; then note "install: elastic_kernels.api already importable from this worktree"; return; fi
  if ELASTIC_SKIP_EXT=1 run_logged "$PYTHON" -m pip install --disable-pip-version-check --no-build-isolation --no-deps \
       --no-index -e . && api_importable; then
    note "install: pip install --no-build-isolation --no-deps --no-index -e . (offline, this torch)"; return
  fi
  # Fallback: a path hook maps elastic_kernels.api to python_api/ (what setup.py's package_dir does).
  local site=$OUT/.gpu_check_site
  mkdir -p "$site"
  cat >"$site/sitecustomize.py" <<EOF
import importlib.machinery, importlib.util, sys
_ROOT = ${ROOT@Q}
class _ApiFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "elastic_kernels.api":
            return importlib.util.spec_from_file_location(name, _ROOT + "/python_api/__init__.py",
                                                          submodule_search_locations=[_ROOT + "/python_api"])
        return None
sys.meta_path.insert(0, _ApiFinder)
EOF
  export PYTHONPATH=$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  if api_importable; then note "install: pip install failed; elastic_kernels.api mapped by $site/sitecustomize.py"
  else note "install: FAILED, elastic_kernels.api is not importable (see $LOG)"; status=1; fi
}

build() {
  if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then  # the dry run of tests/test_gpu_check.py: the extension built here
    step "build: skipped (GPU_CHECK_SKIP_BUILD=1)"; note "build: skipped (GPU_CHECK_SKIP_BUILD=1), the extension already there"
    return
  fi
  if [ "$HAVE_NVCC" = 1 ]; then
    step "build (CUDA: ELASTIC_FORCE_CUDA=1)"
    if run_logged env ELASTIC_FORCE_CUDA=1 "$PYTHON" setup.py build_ext --inplace; then
      note "build: CUDA extension built"; return
    fi
    note "build: the CUDA build FAILED (see $LOG); trying the C++ part alone"; status=1
  else
    step "build (no nvcc: C++ part only; the Triton kernels need no nvcc)"
  fi
  export ELASTIC_SKIP_CUDA=1
  if [ "$HAVE_CXX" = 1 ] && run_logged "$PYTHON" setup.py build_ext --inplace; then
    note "build: C++ extension without CUDA (ELASTIC_SKIP_CUDA=1): tests of the CUDA kernels skip; the Triton kernels run"
  else
    export ELASTIC_SKIP_EXT=1
    note "build: no extension (ELASTIC_SKIP_EXT=1): tests needing _C skip; the Triton kernels and torch references run"
  fi
}

tests() {
  step "GPU tests: ${#GPU_TEST_FILES[@]} files, each on its own (budget ${TESTS_BUDGET_S} s)"
  local t0=$SECONDS f rc out left reason
  for f in "${GPU_TEST_FILES[@]}"; do
    left=$(( TESTS_BUDGET_S - (SECONDS - t0) ))
    if [ "$left" -le 5 ]; then note "tests $f: NOT RUN, the tests' budget (${TESTS_BUDGET_S} s) is spent"; status=1; continue; fi
    step "pytest -m gpu $f"
    out=$(mktemp)
    timeout -k 10 "$(( left < FILE_TIMEOUT_S ? left : FILE_TIMEOUT_S ))" \
      "$PYTHON" -m pytest "$f" -m gpu -q -rs -p no:cacheprovider "${PYTEST_EXTRA[@]}" 2>&1 | tee "$out" >>"$LOG"
    rc=${PIPESTATUS[0]}
    tail -n 3 "$out"
    reason=$(grep -oE "ModuleNotFoundError: No module named '[A-Za-z0-9_.]+'" "$out" | head -n 1)
    local missing=${reason#*named \'}; missing=${missing%%[.\']*}
    if [ "$rc" -ne 0 ] && [ -n "$reason" ] && [[ " ${OPTIONAL[*]} " == *" $missing "* ]] \
       && grep -q "error.*during collection\|ERROR collecting" "$out"; then
      note "tests $f: skipped: $reason (optional package missing here)"
    elif [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]; then
      note "tests $f: $(grep -E '^[0-9]+ (passed|skipped|deselected|tests? collected)|^[0-9]+/[0-9]+ tests? collected|^=+ .*(passed|skipped|deselected|collected).* =+$|no tests ran' "$out" | tail -n 1 | tr -d '=' | xargs)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      note "tests $f: TIMED OUT"; status=1
    else
      note "tests $f: FAILED (pytest exit $rc): $(grep -E 'failed|error' "$out" | tail -n 1 | tr -d '=' | xargs)"; status=1
    fi
    rm -f "$out"
  done
}

benches() {
  step "benchmarks (budget ${BENCH_BUDGET_S} s)"
  local t0=$SECONDS bench name rc left
  for bench in "${BENCHES[@]}"; do
    name=$(basename "$bench" .py)
    left=$(( BENCH_BUDGET_S - (SECONDS - t0) ))
    if [ "$left" -le 5 ]; then note "bench $name: NOT RUN, the benchmarks' budget (${BENCH_BUDGET_S} s) is spent"; continue; fi
    step "$name"
    timeout -k 10 "$left" "$PYTHON" "$bench" --device cuda --results "$OUT" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then note "bench $name: done"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note "bench $name: TIMED OUT (budget)"; status=1
    else note "bench $name: FAILED (exit $rc)"; status=1; fi
  done
}

case "$WHAT" in
  all | tests | bench) ;;
  *) echo "usage: bash bench/gpu_check.sh [all|tests|bench]" >&2; exit 2 ;;
esac
[ "$WHAT" = bench ] || { : >"$LOG"; : >"$SUMMARY"; }
environment
install
if [ "$WHAT" != bench ] || ! ls elastic_kernels/_C*.so >/dev/null 2>&1; then build; fi
[ "$WHAT" = bench ] || tests
[ "$WHAT" = tests ] || benches
step "done, exit code $status"
echo "== summary ($SUMMARY):"
cat "$SUMMARY"
exit "$status"
