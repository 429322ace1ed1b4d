#!/usr/bin/env bash
# One command for a GPU machine: prepare it, run the GPU test tier, then the GPU benchmarks by priority, each
# step under its own time limit and all of them within TOTAL seconds, so one ten-minute device command gives
# the most it can. A failed or timed-out step is recorded and the next one runs.
#
#     bash scripts/gpu_session.sh                  # everything, within TOTAL (default 540) seconds
#     bash scripts/gpu_session.sh --dry-run        # print the steps and their limits, run nothing
#     bash scripts/gpu_session.sh --only seqlen-p2,allreduce-cuda
#     bash scripts/gpu_session.sh --skip test-gpu
#
# Needs ./wheels (scripts/prepare_gpu.sh --download, made where the registry is reachable) unless the machine's
# python already has mpich, mpi4py, zstandard and pytest. Writes into OUT (default ./gpu-out): one log per step
# (<step>.log), the benchmarks' --json files, test-gpu.xml (JUnit), and summary.tsv (step, exit code, seconds;
# exit code 124 = timed out, "skipped" = no time left) which is also printed at the end.
#
# Environment: OUT, TOTAL (seconds for the whole session), PY (default python3), and <STEP>_S to change one
# step's limit (e.g. TEST_GPU_S=300; the step name upper-cased with - as _).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-gpu-out}
TOTAL=${TOTAL:-540}
PY=${PY:-python3}
DRY=0
ONLY=""
SKIP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --only) ONLY=",$2,"; shift ;;
        --skip) SKIP=",$2,"; shift ;;
        -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
        *) echo "gpu_session: unknown argument '$1'; see --help" >&2; exit 2 ;;
    esac
    shift
done
SUMMARY="$OUT/summary.tsv"
if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT"
    printf 'step\texit\tseconds\tlimit\n' > "$SUMMARY"
fi
START=$SECONDS

# step NAME LIMIT COMMAND...: run COMMAND with its output in OUT/NAME.log, killed after LIMIT seconds (or what is
# left of TOTAL, less a few seconds for the summary); a step with under MIN_S seconds left is skipped.
MIN_S=15
step() {
    local name=$1 limit=$2 var left rc t0
    shift 2
    var="$(echo "$name" | tr 'a-z-' 'A-Z_')_S"
    limit=${!var:-$limit}
    if { [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]]; } || [[ "$SKIP" == *",$name,"* ]]; then
        return 0
    fi
    left=$((TOTAL - (SECONDS - START) - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$DRY" = 1 ]; then
        local shown="$*"
        printf '%-16s %4ss  %s\n' "$name" "$limit" "${shown%%$'\n'*}"
        return 0
    fi
    if [ "$limit" -lt "$MIN_S" ]; then
        printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$SUMMARY"
        echo "== $name: skipped, ${left}s left"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*"
    t0=$SECONDS
    # timeout signals its whole process group, so mpiexec's ranks go with the launcher.
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0))s"
}

# Versions of what the figures depend on (a python program, so that `timeout` can run it).
VERSIONS='
import os, platform, subprocess, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
import mpi4py
from mpi4py import MPI
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0].strip())
print("CUDA-aware MPI:", getattr(MPI, "Query_cuda_support", lambda: "unknown")())
print("cpus", os.cpu_count(), "| LOOM_MPIEXEC", os.environ.get("LOOM_MPIEXEC"))
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
except (OSError, subprocess.SubprocessError) as e:
    print("nvidia-smi:", e)
'

LOOM=("$PY" -m loom.cli)
SEQLEN=(--layers 4 --hidden 1024 --heads 16 --kv-heads 8 --vocab 32000 --budget 6G --dtype bfloat16 --chunk 1024
        --attn-chunk 2048 --no-breakdown -v)

step prepare 120 env PY="$PY" bash scripts/prepare_gpu.sh
# Whatever prepare managed, the rest runs with the checkout on PYTHONPATH and the wheel's mpiexec.
# shellcheck disable=SC1091
[ -f .gpu-env ] && source .gpu-env
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export GPU_PY=$PY
step versions 30 "$PY" -c "$VERSIONS"
# The GPU tier (tests/gpu, what `make test-gpu` runs) in two steps, FPDT's CUDA kernels first (never run on a
# GPU before, and quick), each test bounded so that one hang cannot take the step.
# --timeout is pytest-timeout's: a python that came with pytest but not the plugin (no wheels/ carried) would
# reject the option and run no test at all.
PER_TEST=()
"$PY" -c 'import pytest_timeout' > /dev/null 2>&1 && PER_TEST=(--timeout 180)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=0 ${PER_TEST[@]+"${PER_TEST[@]}"})
step test-fpdt 150 "${PYTEST[@]}" --junitxml="$OUT/test-fpdt.xml" tests/gpu/test_fpdt_cuda.py
step test-gpu 240 "${PYTEST[@]}" --junitxml="$OUT/test-gpu.xml" --ignore=tests/gpu/test_fpdt_cuda.py tests/gpu
# 64 MiB allreduce of CUDA tensors against host tensors through the (not CUDA-aware) MPI, in one run; before
# the longer benchmarks because it takes about half a minute.
step allreduce-cuda 60 "${LOOM[@]}" bench allreduce --ranks 2 --device cuda -m 1M -M 64M --rounds 3 \
    --iterations-large 20 --warmup-large 3 --max-seconds 5 --json "$OUT/allreduce-cuda.json"
step allreduce-bf16 40 "${LOOM[@]}" bench allreduce --ranks 2 --device cuda --dtype bfloat16 -m 1M -M 64M --rounds 2 \
    --iterations-large 20 --warmup-large 3 --max-seconds 5 --json "$OUT/allreduce-bf16.json"
# Ulysses' alltoall (bf16) on CUDA tensors against host tensors, pipelined pieces along every rank's block.
step alltoall-cuda 40 "${LOOM[@]}" bench alltoall --ranks 2 --device cuda --dtype bfloat16 -m 1M -M 32M --rounds 2 \
    --iterations-large 20 --warmup-large 3 --max-seconds 5 --json "$OUT/alltoall-cuda.json"
# The issue's FPDT-vs-Ulysses figure: P = 1 and 2 ranks sharing the GPU, 6 GiB per rank, bf16.
step seqlen-p1 100 "${LOOM[@]}" bench seqlen "${SEQLEN[@]}" --json "$OUT/seqlen-p1.json"
step seqlen-p2 130 "${LOOM[@]}" bench seqlen --ranks 2 "${SEQLEN[@]}" --json "$OUT/seqlen-p2.json"
# ZeRO's capacity on the CUDA allocator, 4 ranks sharing the GPU, 1 GiB each (the goal: stage 3 fits >= 3.5x
# the parameters of plain data parallelism).
step zero-cuda 100 "${LOOM[@]}" bench zero --ranks 4 --device cuda --skip peers --budget 1G --width 1024 \
    --json "$OUT/zero-cuda.json"
# MFU and offload overlap at the FPDT limit on a ~1.2B-parameter Llama (P = 1), the search capped at
# SEQLEN_CUDA_MAX tokens so that it fits its step (one step at 1M tokens is minutes of attention alone).
step seqlen-cuda 150 "$PY" scripts/seqlen_cuda.py --layers 20 --hidden 2048 --heads 16 --kv-heads 4 --vocab 64000 \
    --budget 100G --chunk 8192 --attn-chunk 32768 --no-breakdown --repeats 1 --peak-tflops 989 \
    --max-seq "${SEQLEN_CUDA_MAX:-131072}" --json "$OUT/seqlen-cuda.json"
# CPU timings on the machine's 16 cores, a core per rank (the peers run on the CPU: NCCL refuses two ranks on
# one GPU).
step zero-r2 90 "${LOOM[@]}" bench zero --ranks 2 --skip capacity --rounds 2 --json "$OUT/zero-r2.json"
step zero-r4 90 "${LOOM[@]}" bench zero --ranks 4 --peer-ranks 4 --skip capacity --rounds 2 --json "$OUT/zero-r4.json"
step parallel-r4 90 "${LOOM[@]}" bench parallel --ranks 4 --json "$OUT/parallel-r4.json"

if [ "$DRY" = 1 ]; then
    echo "(limits are upper bounds; a step starts only with ${MIN_S}s or more of TOTAL=${TOTAL}s left)"
    exit 0
fi
echo "== summary ($((SECONDS - START))s of ${TOTAL}s; exit 124 = timed out)"
column -t "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
