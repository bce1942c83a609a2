#!/usr/bin/env bash
# One call on a lent GPU (an H100 or H200) gives every figure of the CUDA backend:
#
#   bash benchmarks/gpu_check.sh            (from the repository root; OUT: where logs go)
#
#   env        the card, driver and versions
#   precompile every CUDA kernel compiled once, in parallel, into NUMBA_CACHE_DIR; then a
#              second process times a warm start (conv fwd+bwd and batch norm, from the cache)
#   probe      benchmarks/gpu_probe.py ${GPU_CHECK_PROBE:-knobs} (GPU_CHECK_PROBE="tiles_nhwc":
#              the conv tilings; its limit GPU_CHECK_PROBE_SECONDS, default 60)
#   cache      every fused op in a new process, twice: the second must compile nothing
#   tests      the CUDA tests for real (pytest -m cuda, several processes)
#   torch      numbafuse.torch on CUDA tensors against torch's own ops
#   train      python -m numbafuse.train on the GPU, eager and with --cuda-graph (3 epochs of
#              the digits, constant learning rate): accuracy and ms per step of each
#   bench      benchmarks/bench_gpu.py --quick (numbafuse and PyTorch each in its own process;
#              its kernel tables in float32 and float16, GPU_CHECK_BENCH_DTYPES=float32: those
#              of float32 alone)
#   steps      benchmarks/gpu_step_kernels.py: the digits step's device time per kernel and
#              from a graph, the batch-norm backward's AFFINE_GATE off and on
#   pair       with GPU_CHECK_BASE=<another checkout in the tree>: benchmarks/gpu_pair.py, the
#              per-call and training-step rows of both trees, alternating processes
#   hostpath   benchmarks/host_path.py: the same calls' host time with the device stubbed out
#              (what the stub leaves out, beside the bench table's real figures)
#   profile    benchmarks/gpu_profile.py: where the host time of a call goes
#   memcheck   compute-sanitizer memcheck on every fused op and a few training steps
#   racecheck  compute-sanitizer racecheck and synccheck on every fused op, racecheck on two
#              training steps of a narrow model (gpu_sanitize.py train_small); with
#              GPU_CHECK_RACE="ops train" on the memcheck section's steps instead (slow)
#
# The device image lacks what numba-cuda needs (NumPy < 2.5): carry the wheels in .whl/
# (see docs/benchmarks.md#gpu) and they are installed into /tmp/site first. Each section runs
# under its own time limit inside one overall budget (GPU_CHECK_SECONDS, default 540); a failing
# section loses nothing else; GPU_CHECK_SKIP="torch racecheck" leaves sections out.
# GPU_CHECK_TEST_PATHS: test files for the tests section (default: every CUDA test);
# GPU_CHECK_RACE: the racecheck section's parts, "ops", "train_small" (both by default) and/or
# "train". In $OUT:
# sections.log (every section's output in turn), summary.txt (what is printed last),
# bench_gpu.md and bench_gpu.json.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_SECONDS:-540}
START=$SECONDS
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numbafuse-cache}
JOBS=${GPU_CHECK_JOBS:-$(( $(nproc) > 2 ? $(nproc) - 2 : 1 ))}
SUMMARY="$OUT/summary.txt"
LOGS=$(mktemp -d)
: > "$SUMMARY"

if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -n 3
    export PYTHONPATH=/tmp/site:$(pwd)
else
    export PYTHONPATH=$(pwd)
fi

section() {  # section NAME LIMIT_S COMMAND...: run it, log it, one summary line
    local name=$1 limit=$2 left rc t0
    shift 2
    if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
        echo "=== $name: skipped (GPU_CHECK_SKIP)" | tee -a "$SUMMARY"
        return
    fi
    left=$(( BUDGET - (SECONDS - START) ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, budget spent" | tee -a "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    t0=$SECONDS
    echo "=== $name (limit $limit s)"
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc $rc in $(( SECONDS - t0 )) s$([ $rc -eq 124 ] && echo ' (TIMED OUT)')" \
        | tee -a "$SUMMARY"
    { echo "################ $name (rc $rc)"; cat "$LOGS/$name.log"; } >> "$OUT/sections.log"
    tail -n "${TAIL:-6}" "$LOGS/$name.log" | cut -c1-400 | sed 's/^/    /' >> "$SUMMARY"
}

section env 30 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv;
    python3 -c "import sys, numpy, numba, importlib.metadata as m; print(sys.version.split()[0], \"numpy\", numpy.__version__, \"numba\", numba.__version__, *(p + \" \" + m.version(p) for p in (\"numba-cuda\", \"cuda-core\", \"cuda-bindings\", \"torch\")))";
    nproc; lscpu | grep "Model name"; which compute-sanitizer'

section precompile 150 python3 -m numbafuse.precompile --cuda -j "$JOBS"
section warm 60 python3 -c '
import time; t0 = time.perf_counter()
import numpy as np, numbafuse as nf
from numbafuse import cuda as c
x = c.to_device(np.random.default_rng(0).standard_normal((8, 16, 32, 32)).astype(np.float32))
w = c.to_device(np.random.default_rng(1).standard_normal((16, 16, 3, 3)).astype(np.float32))
y = nf.conv_bias_relu(x, w, padding=1); g = nf.conv_bias_relu_backward(y, x, w, y, padding=1)
y2 = nf.batchnorm_add_relu(x, x, c.to_device(np.ones(16, np.float32)), c.to_device(np.zeros(16, np.float32)))
c.numba_cuda.synchronize(); print(f"warm import + conv fwd/bwd + batch norm: {time.perf_counter() - t0:.2f} s")'

TAIL=20 section probe "${GPU_CHECK_PROBE_SECONDS:-60}" python3 benchmarks/gpu_probe.py \
    ${GPU_CHECK_PROBE:-knobs}

# the disk cache: a second process running every fused op must load every kernel (compile
# none); NUMBA_DEBUG_CACHE prints "[cache] data saved to ..." for each kernel compiled
section cache 60 bash -c 'for run in first second; do
    NUMBA_DEBUG_CACHE=1 python3 benchmarks/gpu_sanitize.py ops > /tmp/cache_$run.log 2>&1;
    echo "$run process: $(grep -c "data saved" /tmp/cache_$run.log) kernels compiled and saved," \
         "$(grep -c "data loaded" /tmp/cache_$run.log) loaded"; done'
TAIL=12 section tests 200 python3 -m pytest ${GPU_CHECK_TEST_PATHS:-} -m cuda -q \
    -n "${GPU_CHECK_TEST_PROCESSES:-8}" -p no:cacheprovider \
    --timeout 120 --maxfail 40 --durations 10 -W ignore::DeprecationWarning
section torch 60 python3 benchmarks/gpu_sanitize.py torch
TAIL=4 section train 90 bash -c 'for graph in "" --cuda-graph; do
    echo "numbafuse.train --device cuda --schedule constant --epochs 3 $graph:";
    python3 -m numbafuse.train --device cuda --schedule constant --epochs 3 --no-progress \
        $graph 2>&1 | tail -n 1; done'
TAIL=80 section bench 220 python3 benchmarks/bench_gpu.py --quick --worker-timeout 180 \
    --rounds "${GPU_CHECK_BENCH_ROUNDS:-2}" --dtypes "${GPU_CHECK_BENCH_DTYPES:-float32,float16}" \
    --markdown "$OUT/bench_gpu.md" --json "$OUT/bench_gpu.json"
# the digits step's device time kernel by kernel (PyTorch's profiler) and from a graph, with
# the CUDA batch norm's AFFINE_GATE off (the default) and on (run 16 found it slower; the walk's
# loads were reordered after, untimed)
TAIL=4 section steps 60 bash -c 'for gate in off on; do
    python3 benchmarks/gpu_step_kernels.py --rounds 2 --affine-gate $gate > /tmp/steps_$gate.log 2>&1;
    cat /tmp/steps_$gate.log; done; grep -h "^tree" /tmp/steps_off.log /tmp/steps_on.log'
# this tree against another checkout carried in the tree (GPU_CHECK_BASE=.base, made by
# `git archive <rev> | tar -x -C .base`): per-call and training-step figures, alternating
if [ -n "${GPU_CHECK_BASE:-}" ]; then
    TAIL=30 section pair 200 python3 benchmarks/gpu_pair.py --base "$GPU_CHECK_BASE" \
        --rounds "${GPU_CHECK_PAIR_ROUNDS:-3}" --jobs "$JOBS"
fi
TAIL=6 section hostpath 60 python3 benchmarks/host_path.py --rounds 3
TAIL=4 section profile 60 bash -c 'python3 benchmarks/gpu_profile.py --calls 100 && python3 benchmarks/gpu_profile.py --calls 100 --sort cumtime --top 30'
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
    /opt/nvidia/*/compute-sanitizer 2> /dev/null | head -n 1)
SAN="${SANITIZER:-compute-sanitizer} --error-exitcode 9 --print-limit 20"
# (each run ends with one API error of cuda.core's pool teardown, cuMemPoolSetAccess on an
# invalid device ordinal: see docs/benchmarks.md#gpu; so the two run whatever the first's status)
section memcheck 90 bash -c "$SAN --tool memcheck python3 benchmarks/gpu_sanitize.py ops;
    $SAN --tool memcheck python3 benchmarks/gpu_sanitize.py train"
# (racecheck on `train`'s steps did not finish inside 60 s on an H200 in runs 12 and 13:
# train_small is two steps of a narrow model; GPU_CHECK_RACE="ops train" for the long one)
RACE="${GPU_CHECK_RACE:-ops train_small}"
section racecheck 150 bash -c "set -e; if [[ ' $RACE ' == *' ops '* ]]; then
    $SAN --tool racecheck python3 benchmarks/gpu_sanitize.py ops;
    $SAN --tool synccheck python3 benchmarks/gpu_sanitize.py ops; fi;
    if [[ ' $RACE ' == *' train_small '* ]]; then
    $SAN --tool racecheck python3 benchmarks/gpu_sanitize.py train_small; fi;
    if [[ ' $RACE ' == *' train '* ]]; then
    $SAN --tool racecheck python3 benchmarks/gpu_sanitize.py train; fi"

echo "=== gpu_check: $(( SECONDS - START )) s in all" | tee -a "$SUMMARY"
echo; echo "################ SUMMARY"; cat "$SUMMARY"
