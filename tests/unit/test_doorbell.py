"""loom.comm.doorbell: a ring wakes a poller that sleeps on it, no ring is sent to a poller awake, and only
peers of this host (same key) whose doorbell exists can be rung."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from loom.comm import doorbell, poller

pytestmark = pytest.mark.skipif(doorbell.get() is None, reason="doorbells need Linux and /dev/shm")


class _Ready:
    """A pollable that counts as rung (``bell``) and completes once ``ready`` is set."""

    bell = True

    def __init__(self):
        self.ready = threading.Event()

    def poll(self):
        return self.ready.is_set(), "done"


def _ring_when_asleep(item: _Ready, bell: doorbell.Bell, own: doorbell.Doorbell) -> None:
    deadline = time.monotonic() + 20
    while own.flag[0] == 0 and time.monotonic() < deadline:  # wait until the poller raised its flag
        time.sleep(0.001)
    item.ready.set()
    bell.ring()


def test_ring_wakes_a_poller_asleep_on_a_60_s_timer():
    own = doorbell.get()
    bell = doorbell.Bell.open(*doorbell.address())
    assert bell is not None
    item = _Ready()

    async def main():
        p = poller()
        p.backoff.spin_s, p.backoff.max_sleep_s = 0.0, 60.0  # only a ring can wake it in time
        t = threading.Thread(target=_ring_when_asleep, args=(item, bell, own))
        t.start()
        try:
            return await asyncio.wait_for(p.submit(item), 30)
        finally:
            t.join()

    rings, sent = own.rings, bell.sent
    assert asyncio.run(main()) == "done"
    assert bell.sent == sent + 1 and own.rings >= rings + 1
    assert own.flag[0] == 0, "the flag is lowered once no poller sleeps"


def test_no_ring_is_sent_while_nobody_sleeps():
    bell = doorbell.Bell.open(*doorbell.address())
    sent = bell.sent
    for _ in range(100):
        bell.ring()
    assert bell.sent == sent


def test_items_without_a_bell_keep_the_timer_backoff():
    """A pending item that nobody rings (a plain request) is polled on the timer, as before doorbells."""

    class Later:
        def __init__(self):
            self.t = time.monotonic() + 0.05

        def poll(self):
            return time.monotonic() > self.t, 7

    async def main():
        return await asyncio.wait_for(poller().submit(Later()), 10)

    assert asyncio.run(main()) == 7


def test_only_peers_of_this_host_with_a_doorbell_can_be_rung():
    pid, key = doorbell.address()
    assert doorbell.Bell.open(pid, key ^ 1) is None, "another host key: another machine or namespace"
    assert doorbell.Bell.open(0, key) is None, "pid 0: the peer has no doorbell"
    dead = 4_194_000 + (os.getpid() % 300)  # above any pid this machine hands out
    assert doorbell.Bell.open(dead, key) is None, "no doorbell file for that pid"


def test_stale_flag_files_of_dead_processes_are_removed():
    own = doorbell.get()
    stale = os.path.join(doorbell._DIR, f"loom-bell.{own.key:016x}.4194301")
    with open(stale, "wb") as f:
        f.write(b"\0" * 64)
    own._clean_stale()
    assert not os.path.exists(stale)
    assert os.path.exists(own.path), "this process's own flag file stays"
