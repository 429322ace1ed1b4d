"""Multi-path alltoallv and the MoE layer on real ranks: one launch per rank count runs every check."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_multipath_ranks(n):
    proc = run_ranks(n, "tests/mpi/check_multipath.py", timeout=150)
    assert_all_checks_passed(proc, "tests/mpi/check_multipath.py")
