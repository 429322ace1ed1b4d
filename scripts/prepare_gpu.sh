#!/usr/bin/env bash
# Ready a bare GPU machine for `make test-gpu` without a package registry.
#
# The machine's own python3 already has a CUDA torch; what loom still needs (MPICH, mpi4py, zstandard, pytest)
# travels as wheels in ./wheels, made beforehand on a machine that can reach the registry, for the GPU
# machine's Python version (what `python3 -V` prints there; 3.12 below):
#
#     pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#         --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#         -d wheels mpich mpi4py zstandard pytest pytest-timeout
#
# (`wheels/` is git-ignored; add any other module the import check below reports missing.) Then, on the GPU
# machine, from the checkout:
#
#     scripts/prepare_gpu.sh            # or: make prepare-gpu
#     source .gpu-env                   # PYTHONPATH and LOOM_MPIEXEC for this shell
#     make test-gpu
#
# Environment: PY (default python3), WHEELS (default ./wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=${WHEELS:-wheels}

"$PY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'

if [ -d "$WHEELS" ]; then
    # Only what is carried: whatever the python already has stays as it is (its torch above all).
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" mpich mpi4py zstandard pytest pytest-timeout
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
    exit 2
fi

cat > .gpu-env <<ENV
export PYTHONPATH=$PWD\${PYTHONPATH:+:\$PYTHONPATH}
export LOOM_MPIEXEC=$MPIEXEC
export GPU_PY=$PY
ENV
# shellcheck disable=SC1091
source .gpu-env
"$PY" -c 'import loom.cli, loom.comm, mpi4py, pytest; from loom.comm import world; print("loom ready:", loom.__file__, "ranks", world().size)'
echo "prepare_gpu: ready; run: source .gpu-env && make test-gpu"
