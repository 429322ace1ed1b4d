"""loom.comm's job-level safety scenarios on real ranks (tests/mpi/check_safety.py, one launch each); the
checks of tests/mpi/check_comm.py run from the table in tests/checks.py."""

import re

import pytest

from loom.testing import run_ranks

pytestmark = pytest.mark.mpi


def test_rank_that_raises_takes_the_job_down():
    # A job left hanging by the failed rank would hit the timeout and fail; how fast it dies is not asserted.
    proc = run_ranks(3, "tests/mpi/check_safety.py", "raise", timeout=60, expect_fail=True)
    assert "boom from the last rank" in proc.stderr and "[rank 2]" in proc.stderr, proc.stderr


@pytest.mark.parametrize("where, words", [("thread", "boom from a thread"), ("async", "ZeroDivisionError")])
def test_exception_in_a_thread_or_callback_takes_the_job_down(where, words):
    proc = run_ranks(2, "tests/mpi/check_safety.py", f"raise_{where}", timeout=60, expect_fail=True)
    assert words in proc.stderr and "[rank 1]" in proc.stderr and "aborting the job" in proc.stderr, proc.stderr


def test_check_mode_raises_on_every_rank():
    out = run_ranks(3, "tests/mpi/check_safety.py", "mismatch", env={"LOOM_CHECK": "1"}, timeout=60).stdout
    for r in range(3):
        assert f"rank {r} caught: loom check mode: allreduce" in out, out
        assert f"rank {r} caught counts:" in out, out
        assert f"rank {r} caught out: loom check mode: allreduce" in out, out
    assert "scenario done" in out


def test_watchdog_reports_the_stuck_collective():
    proc = run_ranks(2, "tests/mpi/check_safety.py", "watchdog", env={"LOOM_TIMEOUT": "2"}, timeout=60,
                     expect_fail=True)
    assert re.search(r"loom watchdog: stuck for [\d.]+ s .* in barrier\(\) on communicator 'world' rank 0/2",
                     proc.stderr), proc.stderr


def test_waiting_rank_stays_idle():
    out = run_ranks(2, "tests/mpi/check_safety.py", "idle", timeout=60).stdout
    assert "idle wait:" in out and "idle await:" in out and "scenario done" in out, out
