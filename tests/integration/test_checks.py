"""Every multi-rank check script of ``tests/checks.py`` at each of its rank counts above one: one ``mpiexec``
launch per (script, rank count), and every ``check_*`` of the script must report ``PASS``."""

from __future__ import annotations

import pytest

from loom.testing import ROOT, assert_all_checks_passed, run_ranks
from tests.checks import CHECKS, ELSEWHERE

pytestmark = pytest.mark.mpi

CASES = [(c, n, ()) for c in CHECKS for n in c.ranks if n > 1] + [(c, n, names) for c in CHECKS for n, names in c.only]


@pytest.mark.parametrize("checks, n, names", CASES,
                         ids=[f"{c.script.split('/')[-1][:-3]}-{n}" for c, n, _ in CASES])
def test_checks_pass_on_ranks(checks, n, names):
    if checks.needs:
        pytest.importorskip(checks.needs)
    env = {"LOOM_ONLY": ",".join(names)} if names else None
    proc = run_ranks(n, checks.script, timeout=checks.timeout, env=env)
    if names:
        missing = [k for k in names if f"PASS {k} " not in proc.stdout]
        assert not missing, f"{checks.script} on {n} ranks: no PASS from {missing}\n{proc.stdout}"
    else:
        assert_all_checks_passed(proc, checks.script)


def test_every_check_script_is_in_the_table():
    listed = {c.script for c in CHECKS} | set(ELSEWHERE)
    present = {f"tests/mpi/{p.name}" for p in (ROOT / "tests" / "mpi").glob("check_*.py")}
    assert present <= listed, f"add these to tests/checks.py: {sorted(present - listed)}"
    assert listed <= present, f"tests/checks.py names missing scripts: {sorted(listed - present)}"
