"""The one-rank count of every check script in ``tests/checks.py``, in this process: the same ``check_*``
bodies the multi-rank launches run, in file order (later checks may use what earlier ones set up), on a
world of one rank."""

from __future__ import annotations

import pytest

from loom.comm import world
from loom.testing import load_checks, mpi_checks
from tests.checks import CHECKS

ONE = [c for c in CHECKS if 1 in c.ranks]


@pytest.fixture(autouse=True)
def _process_state():
    """A check script owns its process when launched; here it shares pytest's, so what it sets globally (torch's
    default dtype and threads, the random streams) is put back for the tests that run after it."""
    import random

    import numpy as np
    import torch

    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    rng, py, npr = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    random.setstate(py)
    np.random.set_state(npr)


@pytest.mark.parametrize("checks", ONE, ids=[c.script.split("/")[-1][:-3] for c in ONE])
def test_checks_on_one_rank(checks, capsys):
    if checks.needs:
        pytest.importorskip(checks.needs)
    module, found = load_checks(checks.script)
    assert world().size == 1
    mpi_checks(vars(module))
    out = capsys.readouterr().out
    missing = [name for name, _ in found if f"PASS {name} " not in out]
    assert found and not missing, missing
