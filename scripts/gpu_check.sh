#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA handlers, run the GPU tests, run the benchmarks.
# Usage: OUT=/some/dir bash scripts/gpu_check.sh [tests|bisect|diag|overhead|sched|schedab|executor|variants|fused|warmup|hlo|dotsr|xlaflags|pallas|norm|ffw|profile|stepprofile|prefill|hostdiag|hostgraph|hf|serving|step|all]...
# Results: bench/results/*.json (commit them) and copies plus logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
# XLA reads its log verbosity when it loads: the executor's device-loop report needs this line.
export TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_thunk=2 TF_CPP_MIN_LOG_LEVEL=0
parts=${*:-all}
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt"; }
has() { [[ " $parts " == *" $1 "* || " $parts " == *" all "* ]]; }
# bench_executor.py in the 1B shape (1k-token prompts, 128 tokens) into
# bench/results/executor_latency[_NAME]_h200.json; prints the table's last LINES lines.
exec_bench() {  # NAME LINES [bench_executor flags...]
  local file=bench/results/executor_latency${1:+_$1}_h200.json lines=$2; shift 2
  timeout ${EXEC_TIMEOUT:-240} python3 scripts/bench_executor.py --config gemma3-1b --prompt 1024 \
    --tokens 128 --out "$file" "$@" 2>&1 | grep -v "^[IW]1" | tail -$lines | tee -a "$OUT/log.txt"
  cp "$file" "$OUT/" 2>/dev/null
}
# VAR=value,... (a variant's or the tests' environment) exported in the calling (sub)shell.
export_vars() { [[ -z $1 ]] || export ${1//,/ }; }
# The compiled 1B-shape serving loop into $OUT/loop_hlo_1b[_NAME].txt.gz: copies of the KV
# cache, the loop report and kernels per bucket branch.
dump_hlo() {  # NAME [dump_engine_hlo flags...]
  local file=$OUT/loop_hlo_1b${1:+_$1}.txt; shift
  timeout 300 python3 scripts/dump_engine_hlo.py --config gemma3-1b --out "$file" "$@" 2>&1 \
    | grep -E "copy instructions|KV cache|loop report|^kernels \(min" | tee -a "$OUT/log.txt"
  gzip -f "$file"  # its bucket-1 kernel list (..._bucket1_kernels.txt) stays beside it
}

# The device's copy of the tree may carry a stale .git: results name BLINK_GIT_REVISION, to be
# given literally by the caller (a $(git rev-parse ...) in the device command runs there).
[[ -n ${BLINK_GIT_REVISION:-} ]] || echo "== BLINK_GIT_REVISION unset: results name the device's .git HEAD ($(git rev-parse --short HEAD 2>/dev/null)), which may be stale" | tee -a "$OUT/log.txt"
log "device"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv \
  2>&1 | tee -a "$OUT/log.txt"; python3 -c "import jax; print(jax.__version__, jax.devices())" \
  2>&1 | tail -1 | tee -a "$OUT/log.txt"

python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1 | tee -a "$OUT/log.txt"
log "build"
cmake -S . -B build/device -G Ninja -DSKBUILD_STATE=editable -DPython_EXECUTABLE="$(which python3)" \
  >"$OUT/build.txt" 2>&1 && cmake --build build/device >>"$OUT/build.txt" 2>&1 \
  || { tail -30 "$OUT/build.txt"; exit 1; }
ls -la blink_jax/_lib | tee -a "$OUT/log.txt"
# A command type this XLA does not know aborts every JAX process at flag parsing: check once.
if ! python3 -c "from blink_jax import xla_flags; xla_flags.configure_command_buffers()
import jax; jax.numpy.ones(1).block_until_ready()" >/dev/null 2>&1; then
  export BLINK_COMMAND_BUFFER_TYPES=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,WHILE,CONDITIONAL
  log "XLA refused the default command types; using $BLINK_COMMAND_BUFFER_TYPES"
fi
if has bisect; then
  log "which loop bodies CPU interference reaches (device_while per loop)"
  timeout ${BISECT_TIMEOUT:-330} python3 scripts/diag_loop_overhead.py --iters 20000 --repeats 2 \
    --interference 32 --variants ${BISECT_VARIANTS:-trivial,nested,ffi_s,ffi_c,ffi_sc,ffi_f,model-gemma3-1b-b1,model-gemma3-1b-b1+ffi_sc,model-gemma3-1b-b1+ffi_f} \
    --out bench/results/loop_bisect_h200.json 2>&1 | grep -v "^[IW]1" | tail -24 | tee -a "$OUT/log.txt"
  cp bench/results/loop_bisect_h200.json "$OUT/" 2>/dev/null
fi

if has tests; then
  log "gpu tests"
  # TESTS_ENV: VAR=value,... for the tests only (e.g. BLINK_CUDA_GEMV=1)
  # The whole output (XLA's INFO log included) goes to $OUT/tests.txt; the log keeps each
  # test's outcome and the summary (a tail of the output drowned them in XLA's log).
  ( export_vars "${TESTS_ENV:-}"
    timeout ${TESTS_TIMEOUT:-500} python3 -m pytest -m gpu ${GPU_TESTS:-tests/test_scheduler_backends.py tests/test_engine_gpu.py tests/test_device_region.py tests/test_pallas_attention.py tests/test_pallas_norm.py tests/test_pallas_prefill.py tests/test_pallas_ffw.py tests/test_pallas_out.py tests/test_cuda_gemv.py} \
      -rA -p no:cacheprovider --timeout ${TEST_TIMEOUT:-240} --durations=12 ) >"$OUT/tests.txt" 2>&1
  echo "pytest exit status $?" >>"$OUT/tests.txt"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)|^=+ .*(passed|failed|error)|exit status|Timeout|^[0-9.]+s call" \
    "$OUT/tests.txt" | tee -a "$OUT/log.txt"
fi
if has diag; then
  log "why XLA does or does not build a device WHILE (VLOG of the command-buffer pass)"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 timeout 150 \
    python3 scripts/bench_sched.py --lanes 4 --slots 64 --seconds 0.3 --repeats 1 \
    --out /tmp/diag.json > "$OUT/vlog_sched.txt" 2>&1
  grep -E "^(4) " "$OUT/vlog_sched.txt" | tee -a "$OUT/log.txt"
  grep -oE "(Unsupported thunk kind|lowering is not enabled|not lowered)[^\"]*" "$OUT/vlog_sched.txt" \
    | sort | uniq -c | head -20 | tee -a "$OUT/log.txt"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 timeout 200 python3 -c "
from blink_jax.xla_flags import configure_command_buffers
configure_command_buffers()
import jax.numpy as jnp
from blink_jax import Engine, SamplingParams
from blink_jax.config import tiny_config
from blink_jax.model import Gemma
with Engine(Gemma(tiny_config('gemma3', vocab_size=512), dtype=jnp.float32), None, max_seqs=4,
            page_size=4, max_context=128, buckets=(4, 16), max_top_logprobs=2) as e:
  print('ENGINE LOOP', e.loop_report)
  print(e.generate(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4)).token_ids)
" > "$OUT/vlog_engine.txt" 2>&1
  grep "ENGINE LOOP" "$OUT/vlog_engine.txt" | tee -a "$OUT/log.txt"
  grep -oE "(Unsupported thunk kind|lowering is not enabled|not lowered)[^\"]*" "$OUT/vlog_engine.txt" \
    | sort | uniq -c | head -20 | tee -a "$OUT/log.txt"
  gzip -f "$OUT/vlog_sched.txt" "$OUT/vlog_engine.txt"
fi
if has overhead; then
  log "loop overhead: which loop elements slow down under CPU interference"
  for cb in ${CMD_BUFFERS:-true false}; do
    timeout 250 python3 scripts/diag_loop_overhead.py --command_buffers=$cb --iters 20000 --repeats 2 \
      --interference 32 --out bench/results/loop_overhead_h200_cb_$cb.json 2>&1 \
      | grep -v "^[IW]1" | tail -21 | tee -a "$OUT/log.txt"
    cp bench/results/loop_overhead_h200_cb_$cb.json "$OUT/" 2>/dev/null
  done
fi
if has sched; then
  log "scheduler microbenchmark"
  timeout 400 python3 scripts/bench_sched.py --lanes 1,64,256 --slots 4096 --seconds 0.5 \
    --repeats 3 --interference 32 --mailbox ${SCHED_MAILBOX:-host,device} --out bench/results/sched_step_h200.json 2>&1 | grep -v "^[IW]1" \
    | tail -12 | tee -a "$OUT/log.txt"
  [[ ${SCHED_FUSED:-1} == 1 ]] && log "scheduler microbenchmark, fused step (blink_step: one kernel per step)" &&
  timeout 300 python3 scripts/bench_sched.py --fused --lanes 1,64,256 --slots 4096 --seconds 0.5 \
    --repeats 3 --out bench/results/sched_step_fused_h200.json 2>&1 | grep -v "^[IW]1" \
    | tail -6 | tee -a "$OUT/log.txt"
  cp bench/results/sched_step_h200.json bench/results/sched_step_fused_h200.json "$OUT/" 2>/dev/null
fi
if has schedab; then
  # The scheduler microbenchmark of other ffi/ sources against this tree's, alternated in one
  # call (ratios from the same machine). SCHED_AB: name=folder pairs run in order, a folder
  # holding an ffi/ (e.g. `git archive REV ffi | tar -x -C ab_base`; "." is this tree).
  # Combine the run files afterwards with scripts/combine_ab.py (one file, median table).
  log "scheduler A/B: ${SCHED_AB:=base=ab_base new=. base=ab_base new=.}"
  cp -r ffi /tmp/ffi_new; n=0
  for v in $SCHED_AB; do
    name=${v%%=*} dir=${v#*=}
    rm -rf ffi && cp -r "$([[ $dir == . ]] && echo /tmp/ffi_new || echo "$dir/ffi")" ffi
    cmake --build build/device >>"$OUT/build.txt" 2>&1 || { tail -20 "$OUT/build.txt"; break; }
    for f in "" --fused; do
      n=$((n + 1))  # (not inside the pipeline: its commands run in subshells)
      timeout 120 python3 scripts/bench_sched.py $f --lanes 1,64,256 --slots 4096 --seconds 0.5 \
        --repeats 3 --mailbox host --out "$OUT/sched_ab_${name}${f:+_fused}_$n.json" 2>&1 \
        | grep "^host" | cut -c1-120 | sed "s/^/$name /" | tee -a "$OUT/log.txt"
    done
  done
  rm -rf ffi && cp -r /tmp/ffi_new ffi
fi
if has executor; then
  log "executor latency (Gemma 3 1B shape, bf16)"
  exec_bench "" 25 --batches 1,64
fi
if has variants; then
  # EXEC_VARIANTS: name:VAR=value,...[:--flag,...] (environment of the engine, "base:" =
  # defaults; then bench_executor flags, e.g. "fused::--fused"), run in order; EXEC_BATCHES
  # (default 1,64); persistent mode, quiet.
  log "engine per-token latency per environment: ${EXEC_VARIANTS:=base: gemv:BLINK_CUDA_GEMV=1}"
  for v in $EXEC_VARIANTS; do
    name=${v%%:*} rest=${v#*:}
    envs=${rest%%:*} args=
    [[ $rest == *:* ]] && args=${rest#*:}
    ( export_vars "$envs"
      exec_bench variant_$name 6 --batches ${EXEC_BATCHES:-1,64} --modes persistent \
        --interference 0 ${args//,/ } ) | sed "s/^/$name /"
  done
fi
if has fused; then
  log "fused step (one scheduler call per step), persistent mode"
  exec_bench fused 8 --fused --modes persistent --batches 1,64
fi
if has warmup; then
  log "engine per-token latency: warm-up workload vs shutdown-only warm-up (finding 16)"
  for w in workload shutdown; do
    exec_bench warmup_$w 6 --modes persistent --warm_up $w --batches 1,64
  done
fi
if has hlo; then
  log "copies in the compiled 1B-shape serving loop (a whole-cache copy per step is a bug)"
  dump_hlo ""
fi
if has dotsr; then
  log "batch-1 model step with XLA's dot-strength-reduction pass on vs off (finding 20)"
  # The pass rewrites every vector x matrix dot under 10M elements (each 1B-shape projection
  # at one row) as multiply + reduce. xla_flags turns it off unless XLA_FLAGS already names
  # --xla_disable_hlo_passes: the empty list turns it back on.
  for sr in on off; do
    extra=""; [ $sr = on ] && extra=--xla_disable_hlo_passes=
    timeout 240 python3 scripts/diag_loop_overhead.py --iters ${DOTSR_ITERS:-3000} --repeats 3 \
      --interference 0 --variants model-gemma3-1b-b1,model-gemma3-1b-b8 --xla_extra="$extra" \
      --out bench/results/dotsr_${sr}_h200.json 2>&1 | grep -v "^[IW]1" | tail -4 | tee -a "$OUT/log.txt"
  done
  cp bench/results/dotsr_*_h200.json "$OUT/" 2>/dev/null
fi
if has xlaflags; then
  log "bare batch-1/8 model step under other XLA flags (kernel-bound step, finding 20)"
  # name=flags pairs; "default" is the baseline of the same run (cublas: --xla_gpu_enable_triton_gemm=false
  # and pdl: --xla_gpu_enable_pdl=true were measured at 50abb19, xlaflags_*_h200.json).
  for v in ${XLA_VARIANTS:-default= exhaustive=--xla_gpu_exhaustive_tiling_search=true splitk1=--xla_gpu_experimental_force_split_k=1}; do
    timeout 200 python3 scripts/diag_loop_overhead.py --iters ${XLA_ITERS:-3000} --repeats 3 \
      --interference 0 --variants model-gemma3-1b-b1,model-gemma3-1b-b8 --xla_extra="${v#*=}" \
      --out bench/results/xlaflags_${v%%=*}_h200.json 2>&1 | grep -v "^[IW]1" | tail -3 | tee -a "$OUT/log.txt"
  done
  cp bench/results/xlaflags_*_h200.json "$OUT/" 2>/dev/null
fi
if has pallas; then
  log "Pallas decode attention: kernels per branch and per-token latency vs the jnp reference"
  dump_hlo pallas --attention pallas
  # kind:interference threads:most splits (BLINK_PALLAS_MAX_SPLITS) per run.
  for v in ${PALLAS_VARIANTS:-reference:0:16 pallas:32:16 pallas:0:32}; do
    IFS=: read -r a inter splits <<<"$v"
    name=attn_$a; [ $a = pallas ] && name=attn_pallas_s$splits
    BLINK_PALLAS_MAX_SPLITS=$splits exec_bench $name 6 --batches 1,64 --modes persistent \
      --interference $inter --attention $a
  done
fi
if has norm; then
  log "Pallas residual add + RMSNorm: kernels per branch and per-token latency vs XLA's norms"
  dump_hlo norm --norm pallas
  for n in ${NORM_VARIANTS:-reference pallas}; do
    exec_bench norm_$n 6 --batches 1,64 --modes persistent --interference 0 --norm $n
  done
fi
if has ffw; then
  log "fused down projection (BLINK_PALLAS_FFW=1) and merge + output projection (BLINK_PALLAS_OUT=1) vs XLA's"
  # Per layer first (splits:block_n:block_k variants; pick the best with BLINK_PALLAS_FFW_*),
  # then kernels per branch and the engine's per-token latency with the defaults.
  timeout 300 python3 scripts/bench_ffw.py --config gemma3-1b --tokens 1,8 \
    ${FFW_VARIANTS:+--variants $FFW_VARIANTS} --out bench/results/ffw_kernel_h200.json 2>&1 \
    | grep -v "^[IW]1" | tail -12 | tee -a "$OUT/log.txt"
  cp bench/results/ffw_kernel_h200.json "$OUT/" 2>/dev/null
  BLINK_PALLAS_FFW=1 BLINK_PALLAS_OUT=1 dump_hlo ffw_out
  # name:BLINK_PALLAS_FFW:BLINK_PALLAS_OUT:BLINK_CUDA_GEMV (pallas_out: the merge inside the
  # output projection; cuda_gemv: the down projection as ffi/gemv_cuda.cu)
  for v in ${PARTIAL_VARIANTS:-base:0:0:0 ffw:1:0:0 gemv:0:0:1 gemv_out:0:1:1}; do
    IFS=: read -r name f o g <<<"$v"
    BLINK_PALLAS_FFW=$f BLINK_PALLAS_OUT=$o BLINK_CUDA_GEMV=${g:-0} exec_bench partial_$name 6 \
      --batches 1,64 --modes persistent --interference 0
  done
fi
if has profile; then
  log "where a serving-loop iteration's GPU time goes (jax.profiler trace, kernels by kind)"
  for b in 1 64; do  # one engine per trace: the trace ends after the engine's shutdown
    EXEC_TIMEOUT=${PROFILE_TIMEOUT:-150} exec_bench profiled_b$b 3 --modes persistent \
      --batches $b --interference 0 --profile /tmp/blink_profile
    python3 scripts/kernel_profile.py --trace /tmp/blink_profile/persistent_b$b \
      --out bench/results/kernel_profile_b${b}_h200.json 2>&1 | grep -v "^[IW]1" | head -32 \
      | tee -a "$OUT/log.txt"
    cp bench/results/kernel_profile_b${b}_h200.json "$OUT/" 2>/dev/null
    find /tmp/blink_profile/persistent_b$b -name perfetto_trace.json.gz \
      -exec cp {} "$OUT/perfetto_b$b.json.gz" \;
  done
fi
if has stepprofile; then
  log "per-kernel time of the bare decode step (single steps traced; kernels launched one by one)"
  # PROFILE_VARIANTS: name:VAR=value,... (environment of the traced step; "base:" = defaults)
  for v in ${PROFILE_VARIANTS:-base:}; do
    name=${v%%:*} envs=${v#*:}
    for b in ${PROFILE_BATCHES:-1 64}; do
      rm -rf /tmp/step_profile
      ( export_vars "$envs"
        timeout 200 python3 scripts/bench_step.py --config gemma3-1b --batches $b --prefill "" \
          --noscheduler --nocommand_buffers --profile /tmp/step_profile --profile_steps 20 \
          --out "$OUT/step_profiled_${name}_b$b.json" ) 2>&1 | grep -v "^[IW]1" \
        | tail -1 | sed "s/^/$name /" | tee -a "$OUT/log.txt"
      suffix=$([[ $name == base ]] || echo "_$name")
      python3 scripts/kernel_profile.py --trace /tmp/step_profile/decode_b$b --iterations 20 \
        --top 40 --out bench/results/step_kernels_b${b}${suffix}_h200.json 2>&1 \
        | grep -v "^[IW]1" | head -60 | tee -a "$OUT/log.txt"
      cp bench/results/step_kernels_b${b}${suffix}_h200.json "$OUT/" 2>/dev/null
    done
  done
fi
if has prefill; then
  log "prefill steps: jnp reference vs the decode kernel for every bucket vs the prefill kernel"
  # name:attention:BLINK_PALLAS_MAX_ROWS:BLINK_PALLAS_PREFILL
  for v in ${PREFILL_VARIANTS:-reference:reference:64:0 decode:pallas:1000000:0 prefill:pallas:64:1}; do
    IFS=: read -r name a rows pre <<<"$v"
    BLINK_PALLAS_MAX_ROWS=$rows BLINK_PALLAS_PREFILL=$pre timeout 250 python3 scripts/bench_step.py \
      --config gemma3-1b --batches 1,64 --prefill 256,1024,4096 --scheduler=false --attention $a \
      --out bench/results/step_prefill_${name}_h200.json 2>&1 | grep -v "^[IW]1" | tail -7 | tee -a "$OUT/log.txt"
  done
  cp bench/results/step_prefill_*_h200.json "$OUT/" 2>/dev/null
fi
if has hostdiag; then
  log "host mode: what XLA does per step (host mode's batch-1 token is ~3x the bare step)"
  TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_thunk=3,conditional_thunk=3 \
    timeout 200 python3 scripts/bench_executor.py --modes host --batches 1 --interference 0 \
    --prompt 256 --tokens 64 --out "$OUT/hostdiag.json" > "$OUT/vlog_host.txt" 2>&1
  grep -v "^[IW]1" "$OUT/vlog_host.txt" | tail -3 | tee -a "$OUT/log.txt"
  for p in "Executing warm up iteration" "Update command buffer" "Evict" "Execute command buffer"; do
    echo "$p: $(grep -c "$p" "$OUT/vlog_host.txt")" | tee -a "$OUT/log.txt"
  done
  gzip -f "$OUT/vlog_host.txt"
fi
if has hostgraph; then
  log "host mode with small CUDA graphs launched as plain kernels (finding 19)"
  for g in 1 ${HOST_GRAPH_SIZES:-8}; do
    BLINK_HOST_MIN_GRAPH_SIZE=$g exec_bench host_graph$g 3 --modes host --batches 1,64 \
      --interference 0
  done
fi
if has hf; then
  log "HF transformers single-stream reference (Gemma 3 1B shape, random weights)"
  timeout 300 python3 scripts/bench_hf_reference.py --config gemma3-1b --prompt 1024 \
    --tokens 128 --repeats 3 --compile ${HF_COMPILE:-eager,auto,max-autotune} --out bench/results/hf_reference_h200.json 2>&1 \
    | grep -v "^[IW]1" | tail -6 | tee -a "$OUT/log.txt"
  cp bench/results/hf_reference_h200.json "$OUT/" 2>/dev/null
fi
if has serving; then
  log "serving matrix"
  TOKENIZER=${TOKENIZER:-.carry/tokenizer.model} OUT=$OUT timeout ${SERVING_TIMEOUT:-500} \
    bash scripts/bench_serving_suite.sh 2>&1 | tee -a "$OUT/log.txt"
fi
if has step; then
  log "model step costs and floors (Gemma 3 1B shape)"
  timeout 400 python3 scripts/bench_step.py --config gemma3-1b --out bench/results/step_h200.json \
    ${STEP_ARGS:-} 2>&1 | grep -v "^[IW]1" | tail -16 | tee -a "$OUT/log.txt"
  cp bench/results/step_h200.json "$OUT/" 2>/dev/null
fi
# The JSON results as one archive, results.tgz (the device tool brings back a few files
# only); PACK=0 leaves them as files.
if [[ ${PACK:-1} != 0 ]] && compgen -G "$OUT/*.json" >/dev/null; then
  (cd "$OUT" && tar czf results.tgz --remove-files $(ls *.json 2>/dev/null))
fi
log "done"
