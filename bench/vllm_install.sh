#!/usr/bin/env bash
# Unpacks the carried vLLM 0.26 payload on the GPU machine (no network there), for the peer
# runs of bench/serving_suite.sh (MODES=... vllm). bench/vllm_payload.sh makes it here: parts
# .whl/vllm026.tar.xz.part-NN, one per device call, each call copying its part to $WH (outside
# the working tree, kept while the machine is held); this script runs after the last one:
#   WH=/tmp/wh VLLM_ROOT=/tmp/vllm bash bench/vllm_install.sh
# -> $VLLM_ROOT/site (VLLM_SITE for serving_suite.sh) and the peer's model folders in
#    .carry/peer (its PEER_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
WH=${WH:-/tmp/wh}
ROOT=${VLLM_ROOT:-/tmp/vllm}
mkdir -p "$WH" .carry
cp -n .whl/vllm026.tar.xz.part-* "$WH/" 2>/dev/null || true
if [ ! -d "$ROOT/site/vllm" ]; then
  # Every part, checked, before anything is unpacked.
  (cd "$WH" && sha256sum -c "$OLDPWD/.whl/SHA256SUMS" --quiet)
  mkdir -p "$ROOT"
  t0=$SECONDS
  cat "$WH"/vllm026.tar.xz.part-* | xz -d -T0 | tar x -C "$ROOT"
  echo "unpacked $(du -sh "$ROOT/site" | cut -f1) into $ROOT in $((SECONDS - t0)) s"
fi
rm -rf .carry/peer && cp -r "$ROOT/peer" .carry/peer
PYTHONPATH=$ROOT/site HF_HUB_OFFLINE=1 python3 -c "import vllm; print('vllm', vllm.__version__, 'imports')"
