#!/usr/bin/env bash
# Build the runtime image offline as an OCI layout, then convert it to a block image.
#
#   build-image.sh BASE_LAYOUT MODEL_DIR OUT_LAYOUT [DEST]
#
# BASE_LAYOUT: an OCI layout of runtime/container/Containerfile's image (CUDA + vLLM + runtime),
#   exported once (see the Containerfile's header); no daemon or network is needed here.
# MODEL_DIR: a checkpoint, typically `runtime quantize`'s FP8 output; it becomes its own layer
#   at /models/model, which the image's entrypoint serves.
# DEST: where `imagetool convert` publishes the block image, STORE/NAME[:TAG] (e.g.
#   s3://bucket/images/runtime:v1); without it the layout is built but not converted.
set -euo pipefail

if [[ $# -lt 3 ]]; then
    sed -n '2,13p' "$0"
    exit 2
fi
base="$1" model="$2" out="$3" dest="${4:-}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-python3}"

(cd "$here" && "$python" -m runtime.cli -v build-image "$base" "$model" "$out")

if [[ -n "$dest" ]]; then
    # The model layer is last; with a startup profile (--profile) imagetool lays the files
    # out in the order the server reads them.
    (cd "$here" && "$python" -m imagetool.cli convert "oci:$out:latest" "$dest")
fi
