#!/usr/bin/env bash
# Makes the vLLM 0.26 peer's payload for the GPU machine (no network there) on this machine:
# the wheel set of ../shared/peers/vllm-0.26/requirements-lean.txt unpacked (the way
# `pip install --target` lays it out), less the parts a Gemma 3 text model on a Hopper GPU never
# loads, plus the peer's model folders (python -m bench.peer model_dir), as one xz archive cut
# into parts of PART_MIB, each carried by one device call:
#
#   bash bench/vllm_payload.sh          -> .whl/vllm026.tar.xz.part-NN, .whl/SHA256SUMS
#
# Why: the wheels are 466 MiB (deflate); unpacked and xz-compressed, less the parts below, the
# set is about 3.7x smaller (119 MiB), so it travels in 3 calls of 40 MiB instead of 6 (a call
# carries 64 MiB with the working tree, about 14 MB of it since the serving results keep their
# per-request records gzipped, bench/results/README.md; the first call also carries the
# tokenizer, 1.7 MB, and an A/B's old tree, some 3 MB), and all of it fits one lease beside the
# runs. Left out, each checked in
# vLLM 0.26's sources (docs/PERFORMANCE.md, "Against vLLM in one lease"):
#   vllm_flash_attn/_vllm_fa2_C   FlashAttention 2: on SM90 vLLM takes FA3 (fa_utils.py), and
#                                 flash_attn_interface imports each version under try/except
#   _moe_C_stable_libtorch        MoE kernels, imported under contextlib.suppress(ImportError)
#   vllm-rs                       the Rust frontend, used only with VLLM_RUST_FRONTEND_PATH
#   nvidia_cutlass_dsl            CuTe DSL: only MoE routers' ll_bf16 GEMMs (DeepSeek, ...) and
#                                 Gemma 4's prefix masks use it, each behind an import check
# bench/vllm_install.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
REQ=${REQ:-../shared/peers/vllm-0.26/requirements-lean.txt}
PART_MIB=${PART_MIB:-40}
WORK=${WORK:-/tmp/vllm_payload}
mkdir -p "$WORK/wheels" .whl
PLAT="$(for n in $(seq 17 39); do printf -- '--platform manylinux_2_%s_x86_64 ' "$n"; done)"
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
TAGS="--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none $PLAT"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: $TAGS -d "$WORK/wheels" -r "$REQ"
rm -rf "$WORK/root" && mkdir -p "$WORK/root"
# shellcheck disable=SC2086
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: $TAGS \
  --target "$WORK/root/site" "$WORK/wheels"/*.whl
site=$WORK/root/site
rm -rf "$site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$site/vllm/_moe_C_stable_libtorch.abi3.so" \
  "$site/vllm/vllm-rs" "$site"/nvidia_cutlass_dsl* "$site"/bin
find "$site" -name __pycache__ -prune -exec rm -rf {} +
python3 -m bench.peer model_dir --configs gemma3-1b,gemma3-270m --out "$WORK/root/peer"
rm -f .whl/vllm026.tar.xz.part-* .whl/SHA256SUMS
tar cf - -C "$WORK/root" site peer | xz -T0 -9 | split -b "${PART_MIB}M" -d - .whl/vllm026.tar.xz.part-
(cd .whl && sha256sum vllm026.tar.xz.part-* >SHA256SUMS)
ls -la .whl
