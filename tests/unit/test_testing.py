"""The rank-side harness's seeds (``loom.testing.seeded`` under ``mpi_checks``): a check's random data is
replayable from the one seed a failing check prints, so a failure seen once in CI can be run again."""

from __future__ import annotations

import re

import pytest
import torch

from loom import settings
from loom.testing import mpi_checks, seeded


def _draws(seed=None):
    got = []

    def check_draw(comm):
        got.append([torch.randn(3, generator=seeded(comm, 5)) for _ in range(2)])

    with settings.override(test_seed=seed):
        mpi_checks({"check_draw": check_draw})
    return got[0]


def test_a_fixed_seed_replays_the_data_and_calls_differ():
    a, b = _draws(1234), _draws(1234)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])  # two calls with one base in one check: different data
    assert not torch.equal(_draws()[0], _draws()[0])  # unset: a fresh seed per run


def test_a_failing_check_prints_the_seed_that_replays_it(capsys):
    got = []

    def check_fails(comm):
        got.append(torch.randn(3, generator=seeded(comm, 9)))
        raise AssertionError("planted")

    with settings.override(test_seed=None), pytest.raises(AssertionError, match="planted"):
        mpi_checks({"check_fails": check_fails})
    err = capsys.readouterr().err
    m = re.search(r"FAIL check_fails on rank 0 of 1: .*LOOM_TEST_SEED=(\d+) LOOM_ONLY=check_fails", err)
    assert m, "no replay line on stderr"
    with settings.override(test_seed=int(m[1])), pytest.raises(AssertionError, match="planted"):
        mpi_checks({"check_fails": check_fails})
    assert torch.equal(got[0], got[1])
