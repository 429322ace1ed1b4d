#!/usr/bin/env bash
# The GPU session in one command: the plan, its limits and what it writes are in scripts/gpu_session.py.
#
#     bash scripts/gpu_session.sh              # on the GPU machine (its python3), results in ./gpu-out or $OUT
#     bash scripts/gpu_session.sh --dry-run    # the steps, their limits and commands
#     bash scripts/gpu_session.sh --rehearse   # every step here, CUDA replaced by the CPU, sizes shrunk
#
# PY picks the python (default: this checkout's .venv when there is one, else python3, as `make test-gpu`).
set -u
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PY:-}" ]; then
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
export PY
exec "$PY" scripts/gpu_session.py "$@"
