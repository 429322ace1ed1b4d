"""Ulysses/FPDT attention and the Llama model against single-process references, at 1-4 ranks (one launch each)."""

import pytest

from loom.testing import run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sequence_parallel_exact(n):
    run_ranks(n, "tests/mpi/check_sequence.py", timeout=240)
