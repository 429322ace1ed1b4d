"""``--max-seconds`` bounds each size's timing loop: ``loom.comm.measure.time_op`` checks its clock after every
call above 1 MiB (and once calls turn out slow), so a loop overshoots by at most one call. A fake clock
advanced by the timed function counts calls instead of measuring time."""

from __future__ import annotations

import pytest

from loom.comm import measure as omb  # the timing loop the bench commands use


class _Solo:
    size = 1

    def barrier(self):
        pass


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(omb.time, "perf_counter", lambda: now[0])
    return now


def _timed(clock, seconds_per_call: float, *, warmup: int, iters: int, max_seconds: float, nbytes: int):
    calls = []

    def fn():
        clock[0] += seconds_per_call
        calls.append(1)

    mean = omb.time_op(fn, _Solo(), warmup, iters, max_seconds=max_seconds, nbytes=nbytes)
    return len(calls), mean


def test_large_messages_check_the_bound_after_every_call(clock):
    # 10 warm-up + 100 timed calls of 1 s each under a 3.5 s bound: 4 calls each (the 4th crosses it).
    calls, mean = _timed(clock, 1.0, warmup=10, iters=100, max_seconds=3.5, nbytes=64 << 20)
    assert calls == 8
    assert mean == pytest.approx(1.0)


def test_slow_small_calls_are_bounded_too(clock):
    calls, _ = _timed(clock, 1.0, warmup=0, iters=1000, max_seconds=3.5, nbytes=8)
    assert calls == 4


def test_fast_small_calls_keep_blocks_of_64(clock):
    calls, _ = _timed(clock, 1e-6, warmup=5, iters=300, max_seconds=10.0, nbytes=8)
    assert calls == 305
