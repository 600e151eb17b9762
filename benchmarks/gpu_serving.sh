#!/usr/bin/env bash
# Every GPU measurement of the per-step overhead targets in one run (about 6-8 minutes on an H200):
#   1. the CUDA-graph tests (tests/acceleration/test_cuda_graphs.py: replays equal eager forwards, padded buckets);
#   2. the built-in model, closed loop at concurrency 16: diffusers one at a time and static batches,
#      step mode eager and with CUDA graphs, the ceiling, batch-1 overhead, the launch overhead the
#      graphs remove (benchmarks/serving.py --arms ...,step_graphs);
#   3. where a step's host time goes at 16 requests (benchmarks/step_overhead.py);
#   4. the SD3-medium architecture (weightless folder, dummy weights, bf16) at 1024x1024: step mode
#      vs the ceiling and diffusers' static batches, with model FLOPs utilisation.
# Each command's output is printed and kept under OUT_DIR (default gpu-results/; $OUT on the device
# tool's machine); each has its own timeout so one hang cannot take the whole budget.
#
# Usage (repository root, on a CUDA machine with this package's dependencies importable):
#   bash benchmarks/gpu_serving.sh [OUT_DIR]
#   SMOKE=1 bash benchmarks/gpu_serving.sh /tmp/smoke   # the same commands, tiny sizes, on any device
# Where the machine has no package index (the device tool's H200), carry the missing wheels in .whl/
# (diffusers==0.42.1, transformers>=5.20,<5.25, av, ...: see the device tool's README); they are
# installed into /tmp/site first.
set -uo pipefail
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
py=${PYTHON:-python3}
"$py" - <<'EOF' 2>&1 | tee "$out/device.txt"
import torch, diffusers, transformers
print("torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
import diffserve  # noqa: F401  (the package imports with what is installed)
EOF

if [ -n "${SMOKE:-}" ]; then  # tiny sizes: checks the commands, measures nothing
    digits="--concurrency 2 --num-requests 4 --steps 2 --repeats 1 --overhead-runs 2"
    sd3="--size 256 --steps 2 --concurrency 1 --num-requests 1 --overhead-runs 1"
    overhead="--requests 2 --steps 30 --repeats 1"
else
    digits="--concurrency 16 --num-requests 64 --steps 20 --max-batch-size 32 --repeats 3"
    sd3="--size 1024 --steps 28 --concurrency 4 --num-requests 8 --max-batch-size 8 --overhead-runs 3"
    overhead="--requests 16 --repeats 3"
fi
graphs=$("$py" -c "import torch; print(',step_graphs' if torch.cuda.is_available() else '')")

run() {  # run NAME TIMEOUT_S COMMAND...: print it, keep its output in $out/NAME.txt
    local name=$1 limit=$2; shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | grep -v -e "Warning" -e "warnings.warn" | tee "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}

run cuda_graph_tests 100 "$py" -m pytest -q -p no:cacheprovider tests/acceleration/test_cuda_graphs.py
run digits_serving 200 "$py" benchmarks/serving.py $digits --arms "baseline,static,step$graphs" --json
run digits_step_layers 60 "$py" benchmarks/step_overhead.py $overhead
if [ -n "${SMOKE:-}" ] && [ -z "$graphs" ]; then
    echo "=== sd3_medium_1024: skipped (SMOKE on a machine without CUDA: a 2B-parameter dummy model on the CPU)"
    exit 0
fi
"$py" benchmarks/sd3_config_folder.py --out /tmp/sd3-medium-arch >/dev/null
run sd3_medium_1024 210 "$py" benchmarks/serving.py --model /tmp/sd3-medium-arch --load-format dummy --guidance 7 \
    $sd3 --arms "static,step" --json
