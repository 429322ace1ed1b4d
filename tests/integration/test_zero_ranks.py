"""ShardedDataParallel (ZeRO stages 0-3) end to end: one mpiexec launch per rank count runs every exactness check
of tests/mpi/check_zero.py; world size 1 runs in-process in tests/unit/test_zero.py."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero_exact_against_one_process(n):
    proc = run_ranks(n, "tests/mpi/check_zero.py", timeout=600)
    assert_all_checks_passed(proc, "tests/mpi/check_zero.py")
