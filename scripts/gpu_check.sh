#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA handlers, run the GPU tests, run the benchmarks.
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [tests|sched|executor|all]...
# Results: bench/results/*.json (commit them) and copies plus logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD BLINK_HLO_DUMP=$OUT/hlo_loop.txt
parts=${*:-all}
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt"; }
has() { [[ " $parts " == *" $1 "* || " $parts " == *" all "* ]]; }

log "device"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv \
  2>&1 | tee -a "$OUT/log.txt"; python3 -c "import jax; print(jax.__version__, jax.devices())" \
  2>&1 | tail -1 | tee -a "$OUT/log.txt"

log "build"
cmake -S . -B build/device -G Ninja -DSKBUILD_STATE=editable -DPython_EXECUTABLE="$(which python3)" \
  >"$OUT/build.txt" 2>&1 && cmake --build build/device >>"$OUT/build.txt" 2>&1 \
  || { tail -30 "$OUT/build.txt"; exit 1; }
ls -la blink_jax/_lib | tee -a "$OUT/log.txt"

if has tests; then
  log "gpu tests"
  timeout 420 python3 -m pytest -m gpu tests/test_scheduler_backends.py tests/test_engine_gpu.py \
    -q -s -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/log.txt"
fi
if has variants; then
  log "loop cost variants: command-buffer flags x side-effecting FFI calls (1 lane)"
  for se in 0 1; do for fl in on off; do
    if [ $fl = off ]; then export BLINK_NO_COMMAND_BUFFERS=1; else unset BLINK_NO_COMMAND_BUFFERS; fi
    BLINK_FFI_SIDE_EFFECT=$se timeout 120 python3 scripts/bench_sched.py --lanes 1,64 --slots 4096 \
      --seconds 0.5 --repeats 3 --out /tmp/v_${se}_${fl}.json 2>&1 | grep -E "^(1|64) " \
      | sed "s/^/side_effect=$se flags=$fl: /" | tee -a "$OUT/log.txt"
  done; done
  unset BLINK_NO_COMMAND_BUFFERS
fi
if has sched; then
  log "scheduler microbenchmark"
  timeout 300 python3 scripts/bench_sched.py --lanes 1,64,256 --slots 4096 --seconds 1 \
    --repeats 3 --out bench/results/sched_step_h200.json 2>&1 | grep -v "^[IW]1" \
    | tail -12 | tee -a "$OUT/log.txt"
  cp bench/results/sched_step_h200.json "$OUT/" 2>/dev/null
fi
if has executor; then
  log "executor latency (Gemma 3 1B shape, bf16)"
  timeout 560 python3 scripts/bench_executor.py --config gemma3-1b --batches 1,64 \
    --prompt 1024 --tokens 128 --out bench/results/executor_latency_h200.json 2>&1 \
    | grep -v "^[IW]1" | tail -25 | tee -a "$OUT/log.txt"
  cp bench/results/executor_latency_h200.json "$OUT/" 2>/dev/null
fi
log "done"
