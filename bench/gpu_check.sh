#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA handlers, then run named recipes (RECIPES below)
# or an A/B of two revisions.
#
#   OUT=dir bash bench/gpu_check.sh RECIPE...        e.g. tests executor sched
#   OUT=dir ARGS="--gemv none" TAG=nogemv bash bench/gpu_check.sh executor_quiet
#   OUT=dir AB="base=REV new=REV" [AB_RECIPE=executor_quiet] [AB_RUNS=2] bash bench/gpu_check.sh ab
#   bash bench/gpu_check.sh list                     the recipe table
#
# A recipe is one command line, run from the repository root with $out its result file
# (bench/results/<result>[_$TAG]_$DEV.json, copied to $OUT), $ARGS extra flags and $OUT the
# call's folder. Its whole output goes to $OUT/<recipe>.out.txt, the last $TAIL lines (XLA's
# INFO lines left out) to $OUT/log.txt. BUILD=0 skips the build, PACK=0 leaves the JSON files
# and logs unpacked (else $OUT/results.tgz and $OUT/logs.tgz: the device returns few files).
#
# A/B: each side of AB (name=REV, run in order, alternated AB_RUNS times: A B A B ...) is
#   REV a git revision: built in its own `git worktree` under $AB_DIR (default a temp dir),
#       with its own build dir, its libraries beside its sources, PYTHONPATH=that tree;
#   .   this working tree as it is (built in place by `build`);
#   DIR or FILE.tar[.gz]: a tree (e.g. `git archive REV`), copied or unpacked under $AB_DIR.
# Nothing of this working tree is overwritten. Each side runs AB_CMD_<name> (a command line,
# like a recipe's) if set, else the recipe AB_RECIPE_<name>, else AB_RECIPE; a tree of the old
# layout (scripts/bench_*.py, before bench/ existed) gets the recipe's <recipe>_legacy when
# the table has one. $ARGS of a side is AB_ARGS_<name>. Runs: $OUT/ab_<recipe>_<side>_<n>.json;
# combined (median, min-max, ratio to the first side): $OUT/ab_<recipe>[_$TAG].json by
# python -m bench.combine_ab, also bench/results/ab_<recipe>[_$TAG]_$DEV.json.
# The base of the cleanup, 021020b, has the old layout (python3 scripts/bench_executor.py):
#   AB="base=021020b new=." AB_RECIPE=executor_quiet AB_RUNS=2 BLINK_GIT_REVISION=<sha of .>
# runs executor_quiet_legacy in base's tree and executor_quiet in this one (batch 1 and 64,
# 1B shape, bf16, persistent, quiet), base new base new.
# The device's copy of the tree may carry a stale .git: results name BLINK_GIT_REVISION (for
# the tree itself), to be given literally by the caller; a side's revision must be in that .git.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/blink_gpu_out}
# The results' file suffix: the card's model (h200, h100), from nvidia-smi.
DEV=${DEV:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  grep -oiE 'h100|h200|a100|b200' | tr 'A-Z' 'a-z')}
DEV=${DEV:-gpu}
export DEV
TAIL=${TAIL:-30}
mkdir -p "$OUT"
# A call that carries .carry_xz/tokenizer.model.xz (1.7 MB, beside a vLLM part) instead of
# .carry/tokenizer.model (5.2 MB) gets the latter unpacked here.
if [[ ! -f .carry/tokenizer.model && -f .carry_xz/tokenizer.model.xz ]]; then
  mkdir -p .carry && python3 -c "import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], 'wb') as dst: shutil.copyfileobj(src, dst)" \
    .carry_xz/tokenizer.model.xz .carry/tokenizer.model
fi
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT
# JAX's persistent compilation cache for every benchmark of the call (the engine keeps a
# folder set here: ARCHITECTURE.md, "Compilation cache"): an A/B's second run of a side, or a
# recipe after a test that compiled the same program, loads it instead of compiling it again
# (the 1B's loop: 139 s compiled, 30 s loaded on an H100). FFI handlers are looked up by name
# when a program is loaded, so sides that differ only in ffi/ still run their own kernels.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/blink_xla_cache}
# XLA reads its log verbosity when it loads: the executor's device-loop report needs this line.
export TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_thunk=2 TF_CPP_MIN_LOG_LEVEL=0

# name | result file stem under bench/results ("-": none) | command line
RECIPES=$(cat <<'EOF'
build           | -                      | cmake -S . -B build/device -G Ninja -DSKBUILD_STATE=editable -DPython_EXECUTABLE="$(which python3)" ${CMAKE_ARGS:-} && cmake --build build/device && ls -la blink_jax/_lib
tests           | -                      | python3 -m pytest -m gpu ${GPU_TESTS:-$GPU_TEST_FILES} -rA -p no:cacheprovider $(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout ${TEST_TIMEOUT:-240}) --durations=12 $ARGS 2>&1 | tee "$OUT/tests.txt" | grep -E "^(PASSED|FAILED|ERROR|XFAIL)|^=+ .*(passed|failed|error)|Timeout|^[0-9.]+s call"
executor        | executor_latency       | python3 -m bench.executor --config gemma3-1b --prompt 1024 --tokens 128 --batches 1,64 --out "$out" $ARGS
executor_quiet  | executor_latency_quiet | python3 -m bench.executor --config gemma3-1b --prompt 1024 --tokens 128 --batches 1,64 --modes persistent --interference 0 --out "$out" $ARGS
executor_quiet_legacy | executor_latency_quiet | python3 scripts/bench_executor.py --config gemma3-1b --prompt 1024 --tokens 128 --batches 1,64 --modes persistent --interference 0 --out "$out" $ARGS
executor_host   | executor_latency_host  | python3 -m bench.executor --config gemma3-1b --prompt 1024 --tokens 128 --batches 1,64 --modes host --interference 0 --out "$out" $ARGS
sched           | sched_step             | python3 -m bench.sched --lanes 1,64,256 --slots 4096 --seconds 0.5 --repeats 3 --interference 32 --mailbox host,device --out "$out" $ARGS
sched_scan      | sched_scan             | python3 -m bench.sched --lanes 64,256 --slots 4096 --seconds 0.5 --repeats 3 --interference 32 --mailbox host --doorbell_us 0,200 --out "$out" $ARGS
sampling        | sampling               | python3 -m bench.sampling --rows 1,64,256 --search_ways ${WAYS:-1,3,15} --out "$out" $ARGS
gemv            | gemv                   | python3 -m bench.gemv --config gemma3-1b --out "$out" $ARGS
sched_host      | sched_step_host        | python3 -m bench.sched --lanes 1,64,256 --slots 4096 --seconds 0.5 --repeats 3 --mailbox host --out "$out" $ARGS
sched_host_legacy | sched_step_host      | python3 scripts/bench_sched.py --lanes 1,64,256 --slots 4096 --seconds 0.5 --repeats 3 --mailbox host --out "$out" $ARGS
step            | step                   | python3 -m bench.step --config gemma3-1b --out "$out" $ARGS
step_prefill    | step_prefill           | python3 -m bench.step --config gemma3-1b --batches 1,64 --prefill_lengths 256,1024,4096 --noscheduler --out "$out" $ARGS
step_mixed      | step_mixed             | python3 -m bench.step --config gemma3-1b --batches "" --prefill_lengths 4096 --mixed 4096:0,4096:64,4096:128,4096:256 --noscheduler --out "$out" $ARGS
mixed_profile   | mixed_kernels          | M=${MIXED:-4096:128}; rm -rf /tmp/step_profile; python3 -m bench.step --config gemma3-1b --batches "" --prefill_lengths "" --mixed $M --noscheduler --nocommand_buffers --steps 15 --profile /tmp/step_profile --profile_steps 5 --out "$OUT/step_profiled_mixed.json" $ARGS && python3 -m bench.kernel_profile --trace /tmp/step_profile/mixed_t${M%%:*}_d${M##*:} --iterations 5 --top 40 --out "$out" | head -60
kernel_profile  | kernel_profile         | for b in 1 64; do python3 -m bench.executor --config gemma3-1b --prompt 1024 --tokens 128 --modes persistent --batches $b --interference 0 --profile /tmp/blink_profile --out "$OUT/profiled_b$b.json" $ARGS && python3 -m bench.kernel_profile --trace /tmp/blink_profile/persistent_b$b --out "${out%.json}_b$b.json" | head -32 && find /tmp/blink_profile/persistent_b$b -name perfetto_trace.json.gz -exec cp {} "$OUT/perfetto_b$b.json.gz" \; ; done
step_profile    | step_kernels           | for b in ${PROFILE_BATCHES:-1 8 64}; do rm -rf /tmp/step_profile; python3 -m bench.step --config gemma3-1b --batches $b --prefill_lengths "" --noscheduler --nocommand_buffers --profile /tmp/step_profile --profile_steps 20 --out "$OUT/step_profiled_b$b.json" $ARGS && python3 -m bench.kernel_profile --trace /tmp/step_profile/decode_b$b --iterations 20 --top 40 --out "${out%.json}_b$b.json" | head -60; done
vllm_step       | vllm_step              | rm -rf /tmp/vllm_profile; python3 -m bench.vllm_step --peer_dir .carry/peer --config gemma3-1b --batches ${VLLM_STEP_BATCHES:-1,8} --profile_dir /tmp/vllm_profile --out "$out" $ARGS
attention       | attention              | python3 -m bench.attention --config gemma3-1b --batches ${ATTN_BATCHES:-16,64} --mixed ${ATTN_MIXED:-1024:48} --variants ${ATTN_VARIANTS:-ours,vllm} --out "$out" $ARGS
tp              | executor_tp            | for n in ${TP_SIZES:-1 2}; do python3 -m bench.executor --config ${TP_CONFIG:-gemma3-27b} --prompt 1024 --tokens 128 --batches 1,64 --modes persistent --interference 32 --tensor_parallel $n --out "${out%.json}_${TP_CONFIG:-gemma3-27b}_tp$n.json" $ARGS; done
hf              | hf_reference           | python3 -m bench.hf_reference --config gemma3-1b --prompt 1024 --tokens 128 --repeats 3 --compile ${HF_COMPILE:-eager,auto,max-autotune} --out "$out" $ARGS
serving         | -                      | TOKENIZER=${TOKENIZER:-.carry/tokenizer.model} bash bench/serving_suite.sh
vllm_install    | -                      | bash bench/vllm_install.sh
restart         | restart                | TOKENIZER=${TOKENIZER:-.carry/tokenizer.model} RESULT="$out" bash bench/restart.sh
hlo             | -                      | python3 -m bench.diag.dump_engine_hlo --config gemma3-1b --out "$OUT/loop_hlo_1b${TAG:+_$TAG}.txt" $ARGS | grep -E "copy instructions|KV cache|loop report|^kernels \(min"; gzip -f "$OUT/loop_hlo_1b${TAG:+_$TAG}.txt"
loop_overhead   | loop_overhead          | python3 -m bench.diag.loop_overhead --iters 20000 --repeats 2 --interference 32 --out "$out" $ARGS
loop_bisect     | loop_bisect            | python3 -m bench.diag.loop_overhead --iters 20000 --repeats 2 --interference 32 --variants trivial,nested,ffi_s,ffi_c,ffi_sc,model-gemma3-1b-b1,model-gemma3-1b-b1+ffi_sc --out "$out" $ARGS
model_loop      | model_loop             | python3 -m bench.diag.loop_overhead --iters 3000 --repeats 3 --interference 0 --variants model-gemma3-1b-b1,model-gemma3-1b-b8 --out "$out" $ARGS
cmdbuf_vlog     | -                      | python3 -m bench.sched --lanes 4 --slots 64 --seconds 0.3 --repeats 1 --out "$OUT/vlog_sched.json" > "$OUT/vlog_sched.txt" 2>&1; grep -oE "(Unsupported thunk kind|lowering is not enabled|not lowered)[^\"]*" "$OUT/vlog_sched.txt" | sort | uniq -c | head -20; gzip -f "$OUT/vlog_sched.txt"
EOF
)
# The test files with GPU tests (pytest -m gpu over all of tests/ would stop at the first
# module that does not import there).
GPU_TEST_FILES="tests/test_scheduler_backends.py tests/test_engine_gpu.py tests/test_device_region.py
  tests/test_pallas_attention.py tests/test_pallas_norm.py tests/test_pallas_prefill.py
  tests/test_cuda_gemv.py tests/test_cuda_sampler.py tests/test_scheduler_race.py
  tests/test_tensor_parallel.py"
export GPU_TEST_FILES=$(echo $GPU_TEST_FILES)
# Notes: executor = persistent vs host, quiet vs 2 x nproc thrashers; ARGS of the executor
# recipes take KernelOptions flags (--attention --prefill --norm --gemv --decode_rows);
# tp = issue 23 on a multi-GPU kind: per-token latency quiet and under thrashers at batch 1
# and 64 for each of TP_SIZES (default "1 2") with the TP_CONFIG shape (default the 27B,
# random weights; gemma3-12b on one GPU is the other comparison), the loop report saying
# whether it stayed a device WHILE; saturation through `serving` with
# SERVE_ARGS="--tensor_parallel N";
# sched_scan = what a scan of the 4,096 slots costs the schedule kernel (a doorbell rung every
# 200 us with nothing new: schedule_scan_us against doorbell_us 0), quiet and under thrashers;
# restart = serve.py started twice on one compilation cache (bench/restart.sh: start times,
# loop reports, the same greedy answer);
# gemv = each projection of a 1B step (and its LM head), XLA's matmul against the CUDA GEMV at
# every split count, in us, TB/s and J per product (ARGS="--splits auto --tokens 1,8
# --variants xla,partials,torch" adds torch's cuBLASLt, vLLM's kernels, at 1 and 8 tokens);
# vllm_step = vLLM's decode step at VLLM_STEP_BATCHES (default 1,8): ms and J per step (total
# and above idle) and its kernels by name at the first, beside `step` / `step_profile` for
# ours (issue 25's energy); after bench/vllm_install.sh, in the call that carries the last part;
# step_profile = the kernels of a bare decode step at PROFILE_BATCHES (default "1 8 64": a
# step of 8 rows took 2.1 ms against 1.5 at one on an H100, to be broken down);
# sampling = the sampler per step by mode (greedy, temperature, top-p, top-k) and rows, each
# search at WAYS thresholds per pass (default 1,3,15);
# executor_host with BLINK_HOST_MIN_GRAPH_SIZE=1 is finding 19; model_loop with
# ARGS=--xla_extra=... compares XLA flags (findings 20, 38).
# The vLLM peer (issue 27), in one lease (bench/lease.sh runs the whole choreography below from
# a plan file, bench/plans/; by hand: the machine goes back 30 s after a call: each call
# follows the last at once): `bash bench/vllm_payload.sh` here makes .whl/vllm026.tar.xz.part-NN
# (3 parts of 40 MiB); each call carries one part and .whl/SHA256SUMS and starts with
# `mkdir -p /tmp/wh && cp .whl/vllm026.tar.xz.part-* /tmp/wh/`, then does its run: the first
# builds (`bash bench/gpu_check.sh build`, or in its own session, `setsid nohup ... &`, which
# outlives the call) and serves blink-jax, the last runs `bash bench/vllm_install.sh` (it also
# puts the peer's model folders in .carry/peer) and then `MODES=vllm BUILD=0 bash
# bench/gpu_check.sh serving`. Each serving call (one or two servers, within its 10 minutes;
# vLLM's start alone takes about 1.3-2.5) carries .carry with the bundled tokenizer.model as
# .carry/tokenizer.model. A sweep of 100 requests per rate at 1-32 req/s and all at once takes
# about 3.5 minutes after the server's start; BURST=1000 adds the 1,000-request burst on the
# same server (about 20 s for blink-jax, 45 s for vLLM) instead of a second start. A call
# carries at most 64 MiB with the tree (about 12 MB, the serving results' per-request records
# gzipped beside them): one part and the tokenizer, not two parts; the tokenizer compresses to 1.7 MB (`mkdir -p .carry_xz && xz -9 -k -c
# .carry/tokenizer.model > .carry_xz/tokenizer.model.xz`; carry .carry_xz, which this script
# unpacks into .carry/ on the device). blink-jax's start took 128 s in the e33d055 lease; INTERFERENCE=1 at 2-32 req/s
# (quiet then thrashers) about 5.5 minutes with it. The GPU test files of `tests` take more
# than 200 s (TIMEOUT=200 killed them at e33d055): give them a call of their own.
declare -A RESULT CMD
ORDER=()
while IFS='|' read -r name result cmd; do
  name=$(echo $name) result=$(echo $result)
  [[ -z $name || $name == \#* ]] && continue
  RESULT[$name]=$result CMD[$name]=${cmd# }
  ORDER+=("$name")
done <<<"$RECIPES"

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt"; }
die() { log "ERROR: $*"; exit 1; }
g() { git -c safe.directory='*' "$@"; }

# run_cmd LABEL DIR OUTFILE COMMAND: the command in DIR with $out and $ARGS set; its output
# into $OUT/LABEL.out.txt, its tail into the log; the command's exit status.
run_cmd() {
  local label=$1 dir=$2
  ( cd "$dir" && export out=$3 ARGS=${ARGS:-} &&
    timeout "${TIMEOUT:-500}" bash -c "$4" ) >"$OUT/$label.out.txt" 2>&1
  local rc=$?
  grep -v "^[IW]1" "$OUT/$label.out.txt" | tail -n "$TAIL" | tee -a "$OUT/log.txt"
  [[ $rc == 0 ]] || log "$label: exit status $rc"
  return $rc
}

run_recipe() {  # NAME
  local name=$1 out
  [[ -n ${CMD[$name]:-} ]] || die "no recipe $name (bash bench/gpu_check.sh list)"
  if [[ ${RESULT[$name]} == - ]]; then out=$OUT/$name.json
  else out=bench/results/${RESULT[$name]}${TAG:+_$TAG}_$DEV.json; fi
  log "$name${ARGS:+ (ARGS=$ARGS)}"
  run_cmd "$name${TAG:+_$TAG}" "$ROOT" "$out" "${CMD[$name]}"
  local rc=$?
  [[ $out == bench/results/* ]] && cp "${out%.json}"*.json "$OUT/" 2>/dev/null
  return $rc
}

# ---- A/B ----
AB_TREES=()
ab_tree() {  # NAME REV: the side's tree, built, into TREE; fails with a message
  local name=$1 rev=$2 dir=$AB_DIR/$1
  TREE=$dir
  if [[ $rev == . ]]; then TREE=$ROOT; return; fi
  if [[ -d $rev ]]; then mkdir -p "$dir" && cp -a "$rev/." "$dir/" || return 1
  elif [[ -f $rev ]]; then mkdir -p "$dir" && tar -xf "$rev" -C "$dir" || return 1
  else
    if ! g cat-file -e "$rev^{commit}" 2>/dev/null; then
      log "ERROR: side $name: revision $rev is not in this tree's .git" \
        "(HEAD $(g rev-parse --short HEAD 2>/dev/null || echo ': no .git')). The device's .git" \
        "may be stale: give a revision it holds, or carry the tree: here, \`mkdir -p .ab &&" \
        "git archive -o .ab/$name.tar $rev\` (.ab in .git/info/exclude), carry .ab, AB=\"$name=.ab/$name.tar ...\""
      return 1
    fi
    g worktree add -q --detach "$dir" "$rev" || return 1
    AB_TREES+=("$dir")
  fi
  cmake -S "$dir" -B "$dir/build/ab" -G Ninja -DSKBUILD_STATE=editable \
    -DPython_EXECUTABLE="$(which python3)" ${CMAKE_ARGS:-} >"$OUT/build_ab_$name.txt" 2>&1 &&
    cmake --build "$dir/build/ab" >>"$OUT/build_ab_$name.txt" 2>&1 ||
    { tail -20 "$OUT/build_ab_$name.txt" | tee -a "$OUT/log.txt"; return 1; }
}

ab_revision() {  # NAME REV DIR: what the side's results name as their git revision
  if [[ $2 == . ]]; then
    echo "${BLINK_GIT_REVISION:-$(g rev-parse HEAD 2>/dev/null || echo unknown)$([[ -n $(g status --porcelain --untracked-files=no 2>/dev/null) ]] && echo -dirty)}"
  elif [[ -e $2 ]]; then echo "$2 (a tree)"
  else g rev-parse "$2^{commit}"; fi
}

ab_cleanup() {
  for t in "${AB_TREES[@]}"; do g worktree remove --force "$t" 2>/dev/null; done
  g worktree prune 2>/dev/null
  [[ ${AB_KEEP:-0} == 1 ]] || rm -rf "$AB_DIR"
}

run_ab() {
  local recipe=${AB_RECIPE:-executor_quiet} runs=${AB_RUNS:-2} sides=() n=0
  : "${AB:?set AB=\"base=REV new=REV\" (REV: a git revision, ., or a tree)}"
  AB_DIR=${AB_DIR:-$(mktemp -d /tmp/blink_ab.XXXXXX)}
  mkdir -p "$AB_DIR"
  trap ab_cleanup EXIT
  # An editable install of this tree (pip install -e .) puts an import hook ahead of
  # PYTHONPATH: a side's processes then drop it (sitecustomize), so each imports its own tree.
  local shim=
  if python3 -c "import sys; sys.exit(not any(type(f).__name__.startswith('ScikitBuild') for f in sys.meta_path))" 2>/dev/null; then
    shim=$AB_DIR/.site
    mkdir -p "$shim"
    cat >"$shim/sitecustomize.py" <<'PY'
import importlib.machinery, importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__name__.startswith("ScikitBuild")]
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None:  # the interpreter's own sitecustomize runs too
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
PY
  fi
  declare -A dir cmd rev
  local desc=()
  for v in $AB; do
    local name=${v%%=*} r=${v#*=}
    [[ $name =~ ^[A-Za-z0-9]+$ && $v == *=* ]] || die "AB: $v is not name=REV (name: letters and digits)"
    sides+=("$name")
    if [[ $r == HEAD && -n ${BLINK_GIT_REVISION:-} ]] &&
        [[ $(g rev-parse HEAD 2>/dev/null) != ${BLINK_GIT_REVISION%-dirty}* ]]; then
      die "side $name=HEAD: this .git's HEAD is $(g rev-parse --short HEAD 2>/dev/null), not" \
        "BLINK_GIT_REVISION=$BLINK_GIT_REVISION (a stale .git): use $name=. for this tree"
    fi
    log "A/B side $name: building $r"
    ab_tree "$name" "$r" || die "side $name ($r) not built"
    dir[$name]=$TREE
    rev[$name]=$(ab_revision "$name" "$r" "${dir[$name]}")
    # Which command: AB_CMD_<name>, AB_RECIPE_<name>, the legacy recipe for an old tree, AB_RECIPE.
    local rname=AB_RECIPE_$name cname=AB_CMD_$name pick
    pick=${!rname:-$recipe}
    if [[ -z ${!rname:-} && ! -f ${dir[$name]}/bench/__init__.py && -n ${CMD[${recipe}_legacy]:-} ]]; then
      pick=${recipe}_legacy
    fi
    [[ -n ${!cname:-} || -n ${CMD[$pick]:-} ]] || die "side $name: no recipe $pick"
    cmd[$name]=${!cname:-${CMD[$pick]}}
    local where
    where=$(cd "${dir[$name]}" && PYTHONPATH=${dir[$name]}${shim:+:$shim} \
      python3 -c "import blink_jax; print(blink_jax.__file__)" 2>&1 | tail -1)
    [[ $where == "${dir[$name]}"/* ]] || die "side $name: blink_jax imports from $where, not ${dir[$name]}"
    log "A/B side $name = $r (${rev[$name]}) in ${dir[$name]}: ${!cname:+AB_CMD_$name: }${cmd[$name]}"
    desc+=(--side "$name=$r (${rev[$name]}): ${cmd[$name]}")
  done
  if [[ $runs == 0 ]]; then log "AB_RUNS=0: the sides are built and import their own trees"; return; fi
  for ((i = 0; i < runs; i++)); do
    for name in "${sides[@]}"; do
      n=$((n + 1))
      log "A/B $recipe run $n: $name"
      local args=AB_ARGS_$name
      ARGS=${!args:-} BLINK_GIT_REVISION=${rev[$name]} PYTHONPATH=${dir[$name]}${shim:+:$shim} \
        TIMEOUT=${AB_TIMEOUT:-240} run_cmd "ab_${recipe}_${name}_$n" "${dir[$name]}" \
        "$OUT/ab_${recipe}_${name}_$n.json" "${cmd[$name]}"
    done
  done
  local combined=ab_${recipe}${TAG:+_$TAG}
  python3 -m bench.combine_ab --dir "$OUT" --prefix "ab_${recipe}_" --out "$OUT/$combined.json" \
    "${desc[@]}" --command "AB='$AB' AB_RECIPE=$recipe AB_RUNS=$runs bash bench/gpu_check.sh ab" \
    2>&1 | tee -a "$OUT/log.txt"
  cp "$OUT/$combined.json" "bench/results/${combined}_$DEV.json" 2>/dev/null
}

# ---- the call ----
parts=${*:-tests executor sched}
if [[ $parts == list ]]; then
  for name in "${ORDER[@]}"; do printf '%-22s %-24s %s\n' "$name" "${RESULT[$name]}" "${CMD[$name]}"; done
  exit 0
fi
[[ -n ${BLINK_GIT_REVISION:-} ]] || echo "== BLINK_GIT_REVISION unset: results name the device's .git HEAD ($(g rev-parse --short HEAD 2>/dev/null)), which may be stale" | tee -a "$OUT/log.txt"
log "device"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv \
  2>&1 | tee -a "$OUT/log.txt"; python3 -c "import jax; print(jax.__version__, jax.devices())" \
  2>&1 | tail -1 | tee -a "$OUT/log.txt"
# This tree is built unless BUILD=0, or the call is an A/B whose sides have their own trees.
if [[ ${BUILD:-1} != 0 && " $parts " != *" build "* ]] &&
    ! [[ $parts == ab && " ${AB:-} " != *"=. "* ]]; then
  run_recipe build || die "build failed ($OUT/build.out.txt)"
fi
# A command type this XLA does not know aborts every JAX process at flag parsing: check once.
if ! python3 -c "from blink_jax.executor import xla_flags; xla_flags.configure_command_buffers()
import jax; jax.numpy.ones(1).block_until_ready()" >/dev/null 2>&1; then
  export BLINK_COMMAND_BUFFER_TYPES=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,WHILE,CONDITIONAL
  log "XLA refused the default command types; using $BLINK_COMMAND_BUFFER_TYPES"
fi
for part in $parts; do
  if [[ $part == ab ]]; then run_ab
  else run_recipe "$part" || [[ $part != build ]] || die "build failed"; fi
done
# The JSON results as one archive, results.tgz, and the logs as logs.tgz (the device tool
# brings back a few files only); PACK=0 leaves them as files. An earlier invocation's archives
# in the same $OUT (one call running this script twice) are unpacked first, so they add up.
if [[ ${PACK:-1} != 0 ]]; then
  for a in results.tgz logs.tgz; do [[ -f $OUT/$a ]] && tar xzf "$OUT/$a" -C "$OUT"; done
  (cd "$OUT" && compgen -G "*.json" >/dev/null && tar czf results.tgz --remove-files *.json)
  (cd "$OUT" && compgen -G "*.out.txt" >/dev/null &&
    tar czf logs.tgz --remove-files *.out.txt $(ls build_ab_*.txt tests.txt serve_*.log \
      2>/dev/null))
fi
log "done"
