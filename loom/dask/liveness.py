"""Which peer ranks have died: the ``mpi://`` backend's failure detector.

MPI itself does not say when a peer dies unless the library runs in a fault-tolerant mode (MPICH's fails to
start here, see docs/guides/dask.md): a receive from a dead rank simply never completes and a small send
to it completes eagerly. So the backend watches its peers' processes instead.

Plan: every connection handshake carries the peer's pid and host key (:func:`loom.comm.doorbell.host_key`:
same boot and same pid namespace, so the pid means the same process). For a peer on this host, one
``pidfd`` is opened per rank and one daemon thread blocks in ``poll()`` on all of them (zero CPU while nobody
dies; the kernel wakes it when a process exits). When one fires, the rank is added to :attr:`Watcher.dead`
and the callback runs *on the watcher thread*: it only flips flags that the event loops' pollers read on
their next test (within the poller's 2 ms timer), so nothing here touches MPI or takes the engine's lock.

A peer on another host has no pid here; its death is seen by Dask's own heartbeats (the scheduler's
``worker-ttl``), and connections to it then time out as they would over TCP to a host that went silent.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Callable

__all__ = ["Watcher", "ignore_launcher_signal"]

logger = logging.getLogger(__name__)


class Watcher:
    """Watches peer processes by pidfd on one daemon thread; ``on_death(rank)`` runs there when one exits."""

    def __init__(self, on_death: Callable[[int], None]):
        self.dead: set[int] = set()
        self.pids: dict[int, int] = {}  # rank -> pid being watched
        self._on_death = [on_death]
        self._lock = threading.Lock()  # guards pids/_new between callers and the thread; never held in MPI
        self._new: list[tuple[int, int]] = []  # (rank, pidfd) to add to the poll set
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None

    def watch(self, rank: int, pid: int) -> bool:
        """Start watching ``rank``'s process ``pid`` (a process of this host); False if it cannot be watched.

        A pid that no longer exists marks the rank dead at once (it died before we looked)."""
        if not pid or rank in self.pids or rank in self.dead:
            return rank in self.pids
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._died(rank, pid)
            return True
        except (OSError, AttributeError):  # no pidfd (old kernel, not Linux): only Dask's heartbeats then
            return False
        with self._lock:
            self.pids[rank] = pid
            self._new.append((rank, fd))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="loom-dask-liveness", daemon=True)
                self._thread.start()
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the thread has wake-ups pending already
            pass
        return True

    def _died(self, rank: int, pid: int) -> None:
        if rank in self.dead:
            return
        self.dead.add(rank)
        logger.warning("mpi:// peer rank %d (pid %d) died; closing every connection to it", rank, pid)
        for callback in list(self._on_death):
            try:
                callback(rank)
            except Exception:  # noqa: BLE001 - the detector must keep running
                logger.exception("mpi:// death callback %r failed for rank %d", callback, rank)

    def add_callback(self, callback: Callable[[int], None]) -> None:
        """Also run ``callback(rank)`` on the watcher thread when a watched rank dies (flags and exits only)."""
        self._on_death.append(callback)

    def _run(self) -> None:
        poll = select.poll()
        poll.register(self._wake_r, select.POLLIN)
        fds: dict[int, int] = {}  # pidfd -> rank
        while True:
            with self._lock:
                new, self._new = self._new, []
            for rank, fd in new:
                fds[fd] = rank
                poll.register(fd, select.POLLIN)
            for fd, _ in poll.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                rank = fds.pop(fd)
                poll.unregister(fd)
                os.close(fd)
                self._died(rank, self.pids.get(rank, 0))


def ignore_launcher_signal() -> bool:
    """Survive MPICH's notice of a dead rank: under ``mpiexec -disable-auto-cleanup`` hydra sends ``SIGUSR1`` to
    every surviving rank, whose default action ends the process. Ignores it (the :class:`Watcher` finds the
    dead rank) when ``SIGUSR1`` still has its default action; main thread only. ``SIG_IGN`` rather than a
    Python handler: Python resets its own handlers to the default during interpreter shutdown, the moment a
    rank that finished first sends the others that notice. Returns whether the signal is handled."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return True
