#!/usr/bin/env bash
# Ready a bare GPU machine for `make test-gpu` without a package registry.
#
# The machine's own python3 already has a CUDA torch; what loom still needs (MPICH, mpi4py, zstandard, pytest,
# msgpack and distributed for the Dask check, numpy in case) travels as wheels in ./wheels, made beforehand on a
# machine that can reach the registry:
#
#     PYVERS=3.12 scripts/prepare_gpu.sh --download   # the GPU machine's version (`python3 -V` there): ~42 MiB
#
# (`wheels/` is git-ignored; no torch, and nothing large: scipy and numba stay behind, and the steps that need
# them are skips.) Then, on the GPU machine, from the checkout:
#
#     scripts/prepare_gpu.sh            # or: make prepare-gpu
#     source .gpu-env                   # PYTHONPATH and LOOM_MPIEXEC for this shell
#     make test-gpu
#
# Last, it imports every module the GPU session uses and names the missing ones (`--check` does only that, on
# any machine). scripts/gpu_session.sh does all of it and the GPU benchmarks in one command.
# Environment: PY (default python3), WHEELS (default ./wheels), PYVERS (--download's Python versions).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-wheels}
PACKAGES=(mpich mpi4py zstandard pytest pytest-timeout msgpack distributed numpy)

# Every module the session imports, which present and which missing (scripts/gpu_session.py's NEEDS).
check_imports() {
    "$PY" scripts/gpu_session.py --imports
}

if [ "${1:-}" = "--check" ]; then
    check_imports
    exit 0
fi

if [ "${1:-}" = "--download" ]; then
    # Binary wheels only, for manylinux x86_64 and each Python version the GPU machine may have. No torch: the
    # GPU machine has its own, and none of these depend on it (the size check below would catch one that did).
    DL_PY=${DL_PY:-$(test -x .venv/bin/python && echo .venv/bin/python || echo python3)}
    for v in ${PYVERS:-3.12}; do
        "$DL_PY" -m pip download --quiet --only-binary=:all: --python-version "$v" --implementation cp \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
            -d "$WHEELS" "${PACKAGES[@]}"
    done
    if compgen -G "$WHEELS/torch-*" > /dev/null || compgen -G "$WHEELS/nvidia*" > /dev/null; then
        echo "prepare_gpu: a torch or nvidia wheel was pulled in; remove it from $WHEELS (the GPU machine has torch)" >&2
        exit 1
    fi
    size=$(du -sm "$WHEELS" | cut -f1)
    ls -1 "$WHEELS"
    echo "prepare_gpu: $WHEELS/ holds ${size} MiB; the device tool carries at most 64 MiB with the working tree"
    if [ "$size" -gt 56 ]; then
        echo "prepare_gpu: too large to carry; download for fewer versions (PYVERS=3.12)" >&2
        exit 1
    fi
    exit 0
fi

"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' \
    || echo "prepare_gpu: no CUDA torch in $PY; the GPU steps will fail or skip" >&2

if [ -d "$WHEELS" ]; then
    # Only what is carried: whatever the python already has stays as it is (its torch above all).
    # PIP_BREAK_SYSTEM_PACKAGES: a distribution's python refuses installs otherwise (PEP 668); older pips ignore it.
    # A python without pip gets the one it ships (ensurepip needs no network).
    "$PY" -m pip --version > /dev/null 2>&1 || "$PY" -m ensurepip --user
    # All at once; when that fails (a wheel for another python), one at a time, so that one does not stop the rest.
    if ! PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${PACKAGES[@]}"; then
        for p in "${PACKAGES[@]}"; do
            PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$p" \
                || echo "prepare_gpu: could not install $p from $WHEELS/" >&2
        done
    fi
else
    echo "prepare_gpu: no $WHEELS/ folder; assuming mpich, mpi4py, zstandard and pytest are installed" >&2
fi

# The mpiexec that came with the mpich wheel: next to this python's scripts, else the first on PATH.
MPIEXEC=$("$PY" -c 'import os, sys, sysconfig, shutil
for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable), os.path.expanduser("~/.local/bin")):
    p = os.path.join(d, "mpiexec")
    if os.access(p, os.X_OK):
        print(p); break
else:
    print(shutil.which("mpiexec") or "")')
if [ -z "$MPIEXEC" ]; then
    echo "prepare_gpu: no mpiexec found; install the mpich wheel (see the top of this script)" >&2
    check_imports
    exit 2
fi

cat > .gpu-env <<ENV
export PYTHONPATH=$PWD\${PYTHONPATH:+:\$PYTHONPATH}
export LOOM_MPIEXEC=$MPIEXEC
export GPU_PY=$PY
ENV
# shellcheck disable=SC1091
source .gpu-env
check_imports
echo "prepare_gpu: ready; run: source .gpu-env && make test-gpu"
