#!/usr/bin/env bash
# The compilation cache on a real start (ARCHITECTURE.md, "Compilation cache"): start
# scripts/serve.py (random weights) twice with one --compilation_cache_dir, ask each for the
# same greedy completion, and write what each start took, its loop report and its answer to
# $RESULT (default $OUT/restart.json). The second start should load the loop instead of
# compiling it, still run it as a device WHILE node, and give the same answer.
#   OUT=dir [RESULT=file] [SHAPE=gemma3-1b] [TOKENIZER=.carry/tokenizer.model] [CACHE=dir] \
#     [SERVE_ARGS="..."] bash bench/restart.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink_restart} SHAPE=${SHAPE:-gemma3-1b} PORT=${PORT:-8031}
RESULT=${RESULT:-$OUT/restart.json}
TOKENIZER=${TOKENIZER:-.carry/tokenizer.model}
CACHE=${CACHE:-$(mktemp -d /tmp/blink_xla_cache.XXXXXX)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
for run in 1 2; do
  log=$OUT/restart_serve_$run.log
  python3 scripts/serve.py --ckpt "random:$SHAPE" --tokenizer "$TOKENIZER" --port "$PORT" \
    --compilation_cache_dir "$CACHE" ${SERVE_ARGS:-} >"$log" 2>&1 &
  srv=$!
  t0=$(date +%s.%N)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $srv 2>/dev/null || break
    sleep 0.5
  done
  python3 -c "import sys, time; print(time.time() - float(sys.argv[1]))" "$t0" \
    >"$OUT/restart_start_$run.txt"
  model=$(curl -sf "http://127.0.0.1:$PORT/v1/models" |
    python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 24,
         \"temperature\": 0}" >"$OUT/restart_answer_$run.json"
  kill -INT $srv 2>/dev/null
  wait $srv
done
command="SHAPE=$SHAPE SERVE_ARGS='${SERVE_ARGS:-}' bash bench/restart.sh"
python3 - "$OUT" "$SHAPE" "$CACHE" "$RESULT" "$command" <<'EOF'
import json, pathlib, re, sys
from bench import common as C
out, shape, cache, result, command = sys.argv[1:]
out = pathlib.Path(out)
runs = []
for run in (1, 2):
  log = (out / f"restart_serve_{run}.log").read_text(errors="replace")
  answer = json.loads((out / f"restart_answer_{run}.json").read_text() or "{}")
  runs.append({
      "start_s": float((out / f"restart_start_{run}.txt").read_text()),
      "compile_line": next(iter(re.findall(r"compiled persistent loop in [\d.]+ s", log)), None),
      "loop_report": next(iter(re.findall(r"serving loop on the device: (.*)", log)), None),
      "host_driven": "NOT a device-side WHILE" in log,
      "text": (answer.get("choices") or [{}])[0].get("text")})
same = runs[0]["text"] is not None and runs[0]["text"] == runs[1]["text"]
C.write_result(result, "restart", runs, {"command": command, "shape": shape, "cache": cache,
                                         "same_answer": same})
print(json.dumps({"runs": runs, "same_answer": same}, indent=1))
EOF
