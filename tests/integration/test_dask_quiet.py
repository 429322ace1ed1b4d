"""``loom dask run`` is quiet by default: the client's output and its warnings show, Dask's INFO logging
(scheduler and worker start-up, connections) only with ``-v``."""

from __future__ import annotations

import os
import sys

import pytest

from loom.comm import launch

pytestmark = pytest.mark.mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLIENT = """
import warnings
from distributed import Client

client = Client()
print("RESULT", client.submit(lambda x: x + 1, 41).result())
warnings.warn("a warning from the client")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_dask_run_shows_the_client_and_hides_info_unless_verbose(tmp_path, verbose):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "LOOM_LAUNCHED": "1"}
    argv = [sys.executable, "-m", "loom.cli", "dask", "run", *(["-v"] if verbose else []), str(script)]
    proc = launch.run(3, argv, timeout=240, env=env, capture=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT 42" in proc.stdout and "a warning from the client" in proc.stderr, out
    info = [ln for ln in out.splitlines() if " - INFO - " in ln]
    assert bool(info) == verbose, out
