"""Loom under a small MPI tag space: the pipeline and a relayed all-to-allv at forced tag ceilings of 2**23 - 1
(Open MPI over UCX) and 32767 (the MPI standard's minimum); see tests/mpi/check_tags.py."""

import pytest

from loom.testing import assert_all_checks_passed, run_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ceiling", [2**23 - 1, 32767])
def test_pipeline_and_relay_under_tag_ceiling(ceiling):
    proc = run_ranks(4, "tests/mpi/check_tags.py", timeout=300, env={"LOOM_TAG_UB": str(ceiling)})
    assert_all_checks_passed(proc, "tests/mpi/check_tags.py")
