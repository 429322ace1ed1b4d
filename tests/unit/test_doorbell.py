"""loom.comm.doorbell: a ring wakes a poller that sleeps on it, no ring is sent to a poller awake, only peers of
this host (same key) whose doorbell exists can be rung, and only by this user: the flag file is created
exclusively, not through links, 0600 and ours; rings from another uid are dropped; stale clean-up never
touches another user's file (the uid tests need root, to act as another user)."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import threading
import time

import pytest

from loom.comm import doorbell, poller

pytestmark = pytest.mark.skipif(doorbell.get() is None, reason="doorbells need Linux and /dev/shm")


class _Rung:
    """A pollable that counts as rung (``bell``) and completes only once a ring has been drained: nothing but
    the ring can complete it, so the poller must sleep and be woken by it (its timer is 60 s)."""

    bell = True

    def __init__(self, own: doorbell.Doorbell):
        self.own = own
        self.rings0 = own.rings

    def poll(self):
        return self.own.rings > self.rings0, "done"


def _ring_when_asleep(bell: doorbell.Bell, own: doorbell.Doorbell) -> None:
    deadline = time.monotonic() + 20
    while own.flag[0] == 0 and time.monotonic() < deadline:  # wait until the poller raised its flag
        time.sleep(0.001)
    bell.ring()


def test_ring_wakes_a_poller_asleep_on_a_60_s_timer():
    own = doorbell.get()
    bell = doorbell.Bell.open(*doorbell.address())
    assert bell is not None
    item = _Rung(own)

    async def main():
        p = poller()
        p.backoff.spin_s, p.backoff.max_sleep_s = 0.0, 60.0  # only a ring can wake it in time
        t = threading.Thread(target=_ring_when_asleep, args=(bell, own))
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


def test_flag_file_is_this_users_0600_regular_file():
    own = doorbell.get()
    st = os.lstat(own.path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600


def test_flag_file_is_never_created_through_a_link(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    link = tmp_path / "loom-bell.link"
    link.symlink_to(target)
    with pytest.raises(OSError):
        doorbell._create_flag(str(link))
    assert target.read_bytes() == b"keep", "the link's target was written through"
    own_leftover = tmp_path / "loom-bell.leftover"  # this user's leftover of a dead process: replaced
    own_leftover.write_bytes(b"x" * 64)
    own_leftover.chmod(0o644)
    doorbell._create_flag(str(own_leftover)).close()
    assert stat.S_IMODE(own_leftover.stat().st_mode) == 0o600


_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
_NOBODY = 65534


@_ROOT
def test_another_users_files_are_neither_used_nor_deleted(tmp_path):
    own = doorbell.get()
    theirs = os.path.join(doorbell._DIR, f"loom-bell.{own.key:016x}.4194302")
    with open(theirs, "wb") as f:
        f.write(b"\0" * 64)
    os.chown(theirs, _NOBODY, _NOBODY)
    try:
        own._clean_stale()
        assert os.path.exists(theirs), "root deleted another user's flag file"
        assert doorbell.Bell.open(4194302, own.key) is None, "another user's flag file was mapped"
        foreign = tmp_path / "loom-bell.foreign"
        foreign.write_bytes(b"\0" * 64)
        os.chown(foreign, _NOBODY, _NOBODY)
        with pytest.raises(PermissionError):
            doorbell._create_flag(str(foreign))
    finally:
        os.unlink(theirs)


@_ROOT
def test_rings_from_another_uid_are_dropped():
    own = doorbell.get()
    own.drain()
    rings, foreign = own.rings, own.foreign
    pid = os.fork()
    if pid == 0:  # child: become another user, ring this process, exit
        code = 1
        try:
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            s.sendto(b"\1", doorbell._socket_name(own.key, own.pid))
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    mine = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    mine.sendto(b"\1", doorbell._socket_name(own.key, own.pid))
    deadline = time.monotonic() + 10
    while own.rings + own.foreign < rings + foreign + 2 and time.monotonic() < deadline:
        own.drain()
        time.sleep(0.01)
    assert (own.rings - rings, own.foreign - foreign) == (1, 1)
