#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine with torch already installed (no internet): build the
# extension with its CUDA part, run the GPU tests, then the kernel benchmarks on the GPU.
# One log ($OUT/gpu_check.log) and the CSV rows of each benchmark go to $OUT (default ./out):
# few files, since the device tool returns at most 8. Tests failing do not stop the benchmarks, but
# the script exits non-zero at the end if anything failed. Budget: well under 8 minutes on one
# H200 (build ~2 min, tests and benches ~1-2 min each).
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
export ELASTIC_BENCH_RESULTS=$OUT   # bench/harness.py appends its rows here
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# Kernel benchmarks, each run as `$PYTHON <script> --device cuda --results $OUT`; add new ones here.
BENCHES=(
  bench/bench_pack.py
  bench/bench_paged_linear.py
  bench/bench_lora_linear.py
  bench/bench_pool.py
  bench/bench_offload.py   # host store -> pool pages H2D (pinned store vs pinned/pageable copy_) + layer loop
  bench/bench_quant.py     # dequant of quantized chunk blobs (NF4 / nested / int8), Triton vs copy_ bandwidth
)

start=$(date +%s)
status=0
step() { echo "== gpu-check: $* ($(( $(date +%s) - start )) s)" | tee -a "$LOG"; }

step "environment"
$PYTHON -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")' 2>&1 | tee -a "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG" || true

step "build (ELASTIC_FORCE_CUDA=1)"
if ! ELASTIC_FORCE_CUDA=1 $PYTHON setup.py build_ext --inplace 2>&1 | tee -a "$LOG"; then
  echo "gpu-check: build failed, see $LOG"
  exit 1
fi

step "GPU tests (pytest -m gpu)"
$PYTHON -m pytest -m gpu -q -p no:cacheprovider --durations=10 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then echo "gpu-check: GPU tests failed (pytest exit code $rc)"; status=1; fi

for bench in "${BENCHES[@]}"; do
  name=$(basename "$bench" .py)
  step "$name"
  $PYTHON "$bench" --device cuda --results "$OUT" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "gpu-check: $name failed (exit code $rc)"; status=1; fi
done

step "done, exit code $status"
exit "$status"
