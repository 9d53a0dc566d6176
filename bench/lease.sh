#!/usr/bin/env bash
# A lease of several device calls that runs a plan of serving runs, blink-jax's and the vLLM
# peer's, on one GPU machine. Why several calls: a call carries at most 64 MiB with the tree
# and runs at most 10 minutes, and the machine goes back 30 s after a call ends, while the
# vLLM payload is three parts of 40 MiB (bench/vllm_payload.sh) and a plan runs for longer. So
# the first call starts the whole plan in the background (it outlives the call, working in a
# copy of the tree that later calls' copies cannot land under), the next calls bring one part
# each, the one with the last part installs vLLM, and every later call waits for a run and
# brings its results back, one archive per run, so that whatever the budget allows is kept.
# Each call follows the last at once (docs/PERFORMANCE.md, "Serving at real scale").
#
#   call 1     bash bench/lease.sh start PLAN      carry .whl/vllm026.tar.xz.part-00, .carry_xz
#   call 2     bash bench/lease.sh part            carry .whl/vllm026.tar.xz.part-01 (and each
#                                                  further part but the last, a call each)
#   call 3     bash bench/lease.sh install         carry the last part (-02), .whl/SHA256SUMS
#   then       bash bench/lease.sh collect RUN [S]  until RUN is done or S seconds (default
#                                                   540) pass: $OUT/RUN.tgz, the progress
#              bash bench/lease.sh status           the progress so far
#              bash bench/lease.sh stop             ends the plan's job and its runs
#
# PLAN: a file in the tree, one run per line, `name | VAR=value ...`: the environment of one
# `bash bench/gpu_check.sh serving` (MODES, TAG, RATES, SERVE_ARGS, BURST, ...; RECIPE=name
# runs that recipe of gpu_check.sh instead, e.g. RECIPE=mixed_profile), on top of
# what the start call exports (SHAPES, BLINK_GIT_REVISION, CLIENT, ...); `#` starts a comment.
# The runs go in order after one build; a run with MODES=vllm (or RECIPE=vllm_step or
# RECIPE=attention, which import vLLM, unless ATTN_VARIANTS=ours) first waits for the install.
# A plan without vLLM runs needs no parts: `start` and `collect` calls only.
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
W=${LEASE_TREE:-/tmp/blink_lease_tree}  # the plan's copy of the tree
L=${LEASE_DIR:-/tmp/blink_lease}        # progress, logs, each run's OUT folder
WH=${WH:-/tmp/wh}                       # the vLLM parts (bench/vllm_install.sh's WH)
mkdir -p "$L/out"
note() { echo "$(date +%T) $*" >>"$L/progress"; }
bring_parts() { mkdir -p "$WH" && cp "$SRC"/.whl/vllm026.tar.xz.part-* "$WH/" 2>/dev/null; }

run_plan() {  # the background job of `start`
  cd "$W" || exit 1
  note "build"
  OUT=$L/out/build bash bench/gpu_check.sh build >"$L/build.log" 2>&1
  note "build rc=$?"
  touch "$L/build.done"
  while IFS= read -r line; do
    line=${line%%#*}
    [[ $line == *"|"* ]] || continue
    local name vars
    name=${line%%|*} vars=${line#*|}
    name=${name//[[:space:]]/}
    # vLLM's serving runs and the recipes that import it wait for its install (the
    # attention recipe not with ATTN_VARIANTS=ours: our kernels alone).
    if [[ " $vars " =~ [[:space:]](MODES=vllm|RECIPE=vllm_step|RECIPE=attention)[[:space:]] &&
          ! " $vars " =~ [[:space:]]ATTN_VARIANTS=ours[[:space:]] ]]; then
      for _ in $(seq 300); do [[ -f $L/install.done ]] && break; sleep 2; done
      [[ -f $L/install.done ]] || note "$name: no vLLM install after 600 s"
    fi
    local recipe=serving  # or the line's RECIPE= (a recipe of bench/gpu_check.sh)
    [[ " $vars " =~ [[:space:]]RECIPE=([a-z_]+)[[:space:]] ]] && recipe=${BASH_REMATCH[1]}
    note "start $name"
    # The plan's words are shell assignments, quotes and all (SERVE_ARGS="--a 1 --b 2").
    eval "env $vars BUILD=0 OUT='$L/out/$name' bash bench/gpu_check.sh $recipe" \
      >"$L/$name.log" 2>&1
    note "end $name rc=$?"
    touch "$L/$name.done"
  done <"$W/$PLAN"
  note "plan done"
}

case ${1:-} in
start)
  PLAN=${2:?start PLAN: a plan file in the tree}
  [[ -f $SRC/$PLAN ]] || { echo "no plan $SRC/$PLAN" >&2; exit 2; }
  bring_parts
  rm -rf "$W" && mkdir -p "$W" &&
    tar cf - -C "$SRC" --exclude=./.venv --exclude=./.venv-ci --exclude=./.git . | tar xf - -C "$W"
  note "plan $PLAN"
  export PLAN L W
  setsid nohup bash "$W/bench/lease.sh" _run >"$L/lease.log" 2>&1 </dev/null &
  echo $! >"$L/pid"
  echo "started $PLAN in $W"
  ;;
_run) run_plan ;;
part)
  bring_parts && ls "$WH"
  ;;
install)
  bring_parts
  for _ in $(seq 60); do [[ -f $W/bench/vllm_install.sh ]] && break; sleep 2; done
  mkdir -p "$W/.whl" && cp "$SRC/.whl/SHA256SUMS" "$W/.whl/"
  (cd "$W" && WH=$WH bash bench/vllm_install.sh) >"$L/install.log" 2>&1
  rc=$?
  note "install rc=$rc"
  [[ $rc == 0 ]] && touch "$L/install.done"
  tail -3 "$L/install.log"
  ;;
collect)
  name=${2:?collect RUN [SECONDS]} wait_s=${3:-540}
  for _ in $(seq $((wait_s / 2))); do [[ -f $L/$name.done ]] && break; sleep 2; done
  cat "$L/progress"
  if [[ -d $L/out/$name ]]; then
    tar czf "${OUT:-.}/$name.tgz" -C "$L" "out/$name" "$name.log" progress 2>/dev/null
    echo "== $name: $([[ -f $L/$name.done ]] && echo done || echo running), ${OUT:-.}/$name.tgz"
  fi
  ;;
status) cat "$L/progress" ;;
stop)  # the plan's job and what it started (it leads a session of its own)
  [[ -f $L/pid ]] && kill -- -"$(cat "$L/pid")" 2>/dev/null; note "stopped" ;;
*) sed -n '2,24p' "$0"; exit 2 ;;
esac
