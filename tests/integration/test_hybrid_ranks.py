"""HybridParallel end to end: one mpiexec launch per rank count runs every exactness check (see
tests/mpi/check_hybrid.py): (partitions, replicas) in {(1,1) on a split, (2,1), (1,2)} on 2 ranks and
{(2,2), (4,1)} on 4; world size 1 runs in-process in tests/unit/test_hybrid.py."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 4])
def test_hybrid_exact_against_one_process(n):
    proc = run_ranks(n, "tests/mpi/check_hybrid.py", timeout=400)
    assert_all_checks_passed(proc, "tests/mpi/check_hybrid.py")


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_replicas_agree_when_some_grads_are_none(n):
    proc = run_ranks(n, "tests/mpi/check_data.py", timeout=120)
    assert_all_checks_passed(proc, "tests/mpi/check_data.py")
