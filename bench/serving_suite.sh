#!/usr/bin/env bash
# The serving benchmark matrix on one GPU machine: for each model shape and server mode,
# start scripts/serve.py (random weights), run bench/serving.py over a sweep of
# request rates, quiet and under 2 x nproc thrashing processes with the frontend pinned to its
# own cores (SmartNIC role), plus one unpinned run (plots and tables: bench/serving_report.py).
# Usage: TOKENIZER=path/tokenizer.model [SHAPES=...] [MODES="persistent host vllm"] [RATES=2,4,8,inf]
#        [NUM_PROMPTS=48] [UNPINNED=gemma3-1b:persistent] [SLO_TTFT_MS=1000] [SLO_TPOT_MS=10]
#        [SERVE_ARGS="--gemv none ..." (more serve.py flags, e.g. KernelOptions')]
#        [BENCH_ARGS="--shared_prefix_len 1000" (more bench/serving.py flags)]
#        [PEER_DIR=.carry/peer VLLM_SITE=/tmp/vllm/site VLLM_ARGS="..."]
#        [CROSSCHECK="vllm persistent" CROSSCHECK_RATE=16] [SINGLE=1] [INTERFERENCE=1]
#        [BURST=1000 (after the sweeps, that many requests at once: <run>_n<BURST>_quiet)]
#        [BURST_CLIENTS="0,1:1 2,3:2 ..." (instead, the burst once per entry, the load
#         generator on those cores with that many processes: <run>_n<BURST>_c<cores>_p<n>_<i>)]
#        [TAG=name (a variant: results serving_$DEV_<shape>_<mode>_<TAG>_<run>.json)]
#        [MAX_CONTEXT=2048 (empty: blink-jax without --max_context, the load generator then
#         clipping to the server's own, as a new user runs it: MAX_CONTEXT= TAG=defaults)]
#        OUT=dir bash bench/serving_suite.sh
# Per server also: CROSSCHECK (modes): `vllm bench serve` beside bench.serving at one rate
# (bench/crosscheck.py, needs the vLLM install); SINGLE=1: single-stream decode, one request
# at a time (1,024-token prompts, 256 tokens out); INTERFERENCE=0 skips the thrasher runs.
# Mode vllm: the peer, vLLM 0.26 with random weights in the same shape (`--load-format dummy`)
# on the engine's cores, over the same prompts, seeds and rates: its model folders come from
# bench/vllm_install.sh (PEER_DIR), its packages too (VLLM_SITE).
# Every result keeps the server's version and effective settings from its startup log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # scripts/serve.py, python -m bench.serving
: "${TOKENIZER:?set TOKENIZER to a SentencePiece model}"
SHAPES=${SHAPES:-gemma3-1b gemma3-270m}
MODES=${MODES:-persistent host}
RATES=${RATES:-2,4,8,inf}  # light load to saturation (1B: ~7.5 req/s)
N=${NUM_PROMPTS:-48}
# Goodput counts the requests that meet both: a chat-like 1 s to the first token and 100
# tokens/s after it.
SLO_TTFT_MS=${SLO_TTFT_MS:-1000}
SLO_TPOT_MS=${SLO_TPOT_MS:-10}
UNPINNED=${UNPINNED-gemma3-1b:persistent}  # empty: none
OUT=${OUT:-/tmp/blink_serving}
DEV=${DEV:-h200}  # the results' file suffix (bench/gpu_check.sh sets it from the card)
mkdir -p "$OUT"
NCPU=$(nproc)
FRONT=0,1                       # the frontend's cores (a SmartNIC's, out of the host's reach)
# The load generator's, the network side (CLIENT=$FRONT puts it with the frontend, the
# default before 32c8fec: 1,000 requests at once then took ~1 s more TTFT on the clients than
# in the frontend, docs/PERFORMANCE.md, "Bursts with the load generator on cores of its own
# (revision 32c8fec)").
CLIENT=${CLIENT:-2,3}
ENGINE_CPUS=${ENGINE_CPUS:-4-$((NCPU - 1))}  # the engine shares these with the interference
INT=$((2 * NCPU))
PEER_DIR=${PEER_DIR:-.carry/peer}
VLLM_SITE=${VLLM_SITE:-/tmp/vllm/site}  # bench/vllm_install.sh unpacks it there
VLLM_PATH=$VLLM_SITE
CROSSCHECK=${CROSSCHECK-vllm persistent}  # set and empty: none
MAX_CONTEXT=${MAX_CONTEXT-2048}  # set and empty: the server's default context
SERVER_INFO="" SRV=""
touch "$OUT/.suite_start"
pack() {  # one archive of this suite's results (the device returns a limited number of files),
  # refreshed after each run
  tar czf "$OUT/serving_results.tgz" $(find bench/results -maxdepth 1 -newer "$OUT/.suite_start" \
    \( -name "serving_${DEV}_*" -o -name "crosscheck_${DEV}_*" \) 2>/dev/null)
}
bench() {  # label, port, interference, frontend cpus (empty: unpinned), [more bench.serving flags]
  python3 -m bench.serving --base_url "http://127.0.0.1:$2/v1" --num_prompts "$N" \
    ${SERVER_INFO:+--server_info "$SERVER_INFO"} --server_pid "$SRV" \
    --rates "$RATES" ${MAX_CONTEXT:+--max_context "$MAX_CONTEXT" --max_input_len 1024} \
    --interference "$3" \
    --slo_ttft_ms "$SLO_TTFT_MS" --slo_tpot_ms "$SLO_TPOT_MS" \
    --frontend_cpus "$4" ${4:+--client_cpus "$CLIENT"} --label "$1" --noplot \
    --out "bench/results/serving_${DEV}_$1.json" ${BENCH_ARGS:-} "${@:5}" 2>&1 \
    | grep -v "^[IW]1" | tail -6
  pack
}
gpu_free() {  # until the last server's GPU memory is back (vLLM's EngineCore exits after it)
  for _ in $(seq 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return
    sleep 0.5
  done
}
for shape in $SHAPES; do
  for mode in $MODES; do
    port=$((8100 + RANDOM % 800))
    log="$OUT/serve_${shape}_${mode}${TAG:+_$TAG}.log"
    echo "== $(date -u +%T) serve $shape $mode on :$port"
    if [ "$mode" = vllm ]; then
      # vLLM's defaults otherwise (chunked prefill, its attention backend, CUDA graphs).
      PYTHONPATH="$VLLM_PATH:$PYTHONPATH" \
        HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 taskset -c "$ENGINE_CPUS" \
        python3 -m vllm.entrypoints.openai.api_server --model "$PEER_DIR/$shape" \
        --tokenizer "$PEER_DIR/tokenizer" --served-model-name "random:$shape" \
        --load-format dummy --dtype bfloat16 --max-num-seqs 256 --max-model-len 2048 \
        --port "$port" ${VLLM_ARGS:-} >"$log" 2>&1 &
      kind=vllm
    else
      # Its defaults otherwise (256 sequences, 4,096 slots, the KV cache from the GPU's memory).
      # The frontend workers pin every thread of theirs to $FRONT (--frontend_cpus; an outside
      # `taskset -p` would pin their main threads only: PERFORMANCE.md, "Frontend cores").
      taskset -c "$ENGINE_CPUS" python3 scripts/serve.py --ckpt "random:$shape" \
        --tokenizer "$TOKENIZER" --mode "$mode" --port "$port" --frontend_cpus "$FRONT" \
        ${MAX_CONTEXT:+--max_context "$MAX_CONTEXT"} ${SERVE_ARGS:-} >"$log" 2>&1 &
      kind=blink
    fi
    srv=$! SRV=$!
    t0=$SECONDS
    for _ in $(seq 420); do  # vLLM: about 3 min (torch.compile, CUDA graph capture)
      curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
      kill -0 $srv 2>/dev/null || break
      sleep 1
    done
    echo "== $(date -u +%T) $shape $mode healthy after $((SECONDS - t0)) s"
    grep -E "serving loop on the device|op by op|engine up|API server version" "$log" | tail -2
    SERVER_INFO="$OUT/server_${shape}_${mode}${TAG:+_$TAG}.json"
    python3 -m bench.peer server_info --kind "$kind" --log "$log" --out "$SERVER_INFO"
    run="${shape}_${mode}${TAG:+_$TAG}"
    bench "${run}_quiet" "$port" 0 "$FRONT"
    # Prompt sets of their own (bench.serving gives rate k the set --seed + k): with prefix
    # caching on, a run that replayed another's prompts would be served from the cache. The
    # thrasher run sends the quiet run's lengths at its arrival times with other tokens
    # (--prompt_salt), so its ratios to the quiet run compare like for like.
    [ "${INTERFERENCE:-1}" = 0 ] || bench "${run}_int${INT}" "$port" "$INT" "$FRONT" \
      --prompt_salt 1
    if [ -n "${BURST:-}" ]; then  # saturation: BURST requests at once, on the same server
      if [ -z "${BURST_CLIENTS:-}" ]; then
        RATES=inf bench "${run}_n${BURST}_quiet" "$port" 0 "$FRONT" --num_prompts "$BURST" \
          --seed 200
      fi
      i=0
      for cp in ${BURST_CLIENTS:-}; do  # "cores:procs" each: the same burst per load generator
        i=$((i + 1)) cores=${cp%%:*} procs=${cp##*:}
        cores_label=${cores//,/-}
        # The same lengths with other tokens each time: no prefix-cache hits.
        RATES=inf bench "${run}_n${BURST}_c${cores_label}_p${procs}_${i}_quiet" "$port" 0 \
          "$FRONT" --num_prompts "$BURST" --seed 200 --prompt_salt "$((100 + i))" \
          --client_cpus "$cores" --client_procs "$procs"
      done
    fi
    if [ "${SINGLE:-0}" = 1 ]; then
      RATES=inf bench "${run}_single" "$port" 0 "$FRONT" --num_prompts 10 \
        --max_concurrency 1 --input_len 1024 --output_len 256 --seed 300
    fi
    if [[ " $CROSSCHECK " == *" $mode "* && -d $VLLM_SITE/vllm ]]; then
      taskset -c "$CLIENT" python3 -m bench.crosscheck --base_url "http://127.0.0.1:$port/v1" \
        --tokenizer "$PEER_DIR/tokenizer" --vllm_path "$VLLM_PATH" \
        --rate "${CROSSCHECK_RATE:-16}" --num_prompts "$N" --label "${shape}_${mode}" \
        --out "bench/results/crosscheck_${DEV}_${shape}_${mode}.json" 2>&1 | grep -v "^[IW]1" | tail -22
      pack
    fi
    if [[ " $UNPINNED " == *" $shape:$mode "* ]]; then
      for p in $(pgrep -f "nic_frontend.worker.*--port $port"); do  # all threads (-a)
        taskset -a -pc 0-$((NCPU - 1)) "$p" >/dev/null
      done
      RATES=inf bench "${run}_int${INT}_unpinned" "$port" "$INT" "" --seed 400
    fi
    kill -TERM $srv; wait $srv
    gpu_free
  done
done
pack
