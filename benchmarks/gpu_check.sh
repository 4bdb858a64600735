#!/usr/bin/env bash
# Every GPU path of roformer_hf in one run on a CUDA machine: the GPU tests, bench_gpu.py and bench_gpu_paths.py.
# Each step has a time limit, and a step that fails or runs out leaves the next ones to run; every log and a summary
# of exit codes and seconds go to $OUT (default: gpu_check_out/).
#
#     bash benchmarks/gpu_check.sh                 # everything, at most 8 minutes
#     bash benchmarks/gpu_check.sh tests paths     # only the steps named (tests, bench, paths)
#
# It uses the python3 found first on PATH and the packages installed there (torch with CUDA, transformers, pytest),
# and roformer_hf from this checkout. Wheels in .whl/ (other versions of pure-Python packages, e.g. the transformers
# that constraints.txt pins) are installed into a folder put first on PYTHONPATH; nothing else is installed, so the
# script also runs on a machine without a network.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        .whl/*.whl > "$OUT/wheels.log" 2>&1 || echo "wheels: install failed (see wheels.log)" >> "$OUT/summary.txt"
    export PYTHONPATH=/tmp/gpu_check_site:$PYTHONPATH
fi
steps=${*:-tests bench paths}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s (limit $limit s): $*" >> "$OUT/summary.txt"
}

{
    nvidia-smi
    python3 -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'CUDA',
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device');
print('transformers', transformers.__version__, transformers.__file__)"
    python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|tokenizers|flash|triton|sentence|accelerate|ray) "
} > "$OUT/environment.txt" 2>&1

for name in $steps; do
    case $name in
        tests) step tests 120 python3 -m pytest -p no:cacheprovider -v -rs tests/features/test_gpu.py ;;
        bench) step bench_gpu 200 python3 benchmarks/bench_gpu.py --repeats 5 --warmup 2 ;;
        paths) step bench_gpu_paths 170 python3 benchmarks/bench_gpu_paths.py --repeats 5 --warmup 2 ;;
        *) echo "unknown step $name (tests, bench, paths)" >> "$OUT/summary.txt" ;;
    esac
done
cat "$OUT/summary.txt"
