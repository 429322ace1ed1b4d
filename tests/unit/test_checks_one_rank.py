"""The one-rank count of every check script in ``tests/checks.py``, in this process: the same ``check_*``
bodies the multi-rank launches run, in file order (later checks may use what earlier ones set up), on a
world of one rank."""

from __future__ import annotations

import pytest

from loom.comm import world
from loom.testing import load_checks, mpi_checks
from tests.checks import CHECKS

ONE = [c for c in CHECKS if 1 in c.ranks]


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
