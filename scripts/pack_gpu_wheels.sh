#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what scripts/gpu_check.sh needs on a CUDA machine that has torch
# but not this project's other packages, for Python 3.12 on x86-64 Linux:
#   pyzmq, orjson, setproctitle, msgspec, llguidance  as wheels (.whl/*.whl)
#   flashinfer-python + apache-tvm-ffi                 unpacked and re-packed as one
#                                                      .whl/flashinfer.tar.xz (~20 MB instead of a
#                                                      62 MB wheel, so it travels in one call)
# flashinfer's other requirements (nvidia-ml-py, einops, ninja, click, tabulate, ...) are on the
# lent H200 already; cuDNN-frontend, CUTLASS-DSL and the NCCL extras are imported only by kernels
# this project does not call. gpu_check.sh unpacks the archive into its --target site.
#
#   bash scripts/pack_gpu_wheels.sh [FLASHINFER_VERSION]   (default 0.7.2.post1)
set -euo pipefail
cd "$(dirname "$0")/.."
FI_VERSION=${1:-0.7.2.post1}
DEST=.whl
mkdir -p "$DEST"
PLATFORMS=()
for tag in manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$1" "${@:2}"
}
download "$DEST" pyzmq orjson setproctitle msgspec llguidance
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
download "$STAGE/wheels" "flashinfer-python==$FI_VERSION" "apache-tvm-ffi>=0.1.11,<0.2"
mkdir -p "$STAGE/site"
for wheel in "$STAGE"/wheels/*.whl; do
    python3 -m zipfile -e "$wheel" "$STAGE/site"
done
tar -C "$STAGE/site" -cf - . | xz -T0 -6 > "$DEST/flashinfer.tar.xz"
ls -l "$DEST"
echo "pack_gpu_wheels: carry .whl (du: $(du -sh "$DEST" | cut -f1)) with scripts/gpu_check.sh"
