#!/usr/bin/env bash
# Installs the carried vLLM 0.26 wheel set on the GPU machine (no network there), for the peer
# runs of bench/serving_suite.sh (MODES=... vllm). ../shared/peers/vllm-0.26/README.md says how
# the set is made and carried: parts .whl/vllm026.tar.part-NN, one per device call, each call
# copying its part to $WH (outside the working tree, kept while the machine is held).
#   WH=/tmp/wh VLLM_SITE=/tmp/site bash bench/vllm_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WH=${WH:-/tmp/wh}
SITE=${VLLM_SITE:-/tmp/site}
mkdir -p "$WH"
cp -n .whl/vllm026.tar.part-* "$WH/" 2>/dev/null || true
if [ ! -d "$SITE/vllm" ]; then
  # Every part, checked, before anything is unpacked.
  (cd "$WH" && sha256sum -c "$OLDPWD/.whl/SHA256SUMS" --quiet)
  mkdir -p "$WH/wheels"
  cat "$WH"/vllm026.tar.part-* | tar x -C "$WH/wheels"
  t0=$SECONDS
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WH"/wheels/*.whl
  echo "installed $(ls "$WH"/wheels/*.whl | wc -l) wheels into $SITE in $((SECONDS - t0)) s"
fi
# cutlass-dsl's .pth file, which --target ignores, is the second entry.
PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages HF_HUB_OFFLINE=1 \
  python3 -c "import vllm; print('vllm', vllm.__version__, 'imports')"
