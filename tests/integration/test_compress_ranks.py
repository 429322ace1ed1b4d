"""Compressed collectives on 1, 2, 3 (uneven) and 4 ranks: one mpiexec launch per rank count."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_compressed_collectives(n):
    proc = run_ranks(n, "tests/mpi/check_compress.py", timeout=180)
    assert_all_checks_passed(proc, "tests/mpi/check_compress.py")
