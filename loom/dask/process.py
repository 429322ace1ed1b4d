"""The per-process mpi:// engine (tags, ports, listeners, sends in flight, liveness) and each connection's channel.

The engine holds the communicator, the tag pairs and ports, the listeners, the sends kept until done and the
peers' liveness and doorbells; a channel holds one connection's tags, message counters and close.

Finalisers and the liveness thread make no MPI call and take no lock: a comm dropped unclosed is queued and
closed by the engine's next :meth:`_Engine.tidy`. No receive blocks: messages drained from closed channels
are received with non-blocking requests, kept until they complete (steps 4 and 5 of the wire plan in
:mod:`loom.dask.backend`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import numpy as np

from loom.comm import ANY_SOURCE, Request, world
from loom.comm import doorbell

from . import liveness
from .address import tag_window
from .wire import _CLOSE

logger = logging.getLogger(__name__)


class _Engine:
    """Per-process state: the communicator, tags, ports, listeners, dispatchers, sends kept until done, peers'
    liveness.

    Threads: Dask runs one event loop per thread (a client has its own), so the engine's lists are shared.
    ``lock`` guards only list and counter updates; no MPI call is made while it is held. Finalisers and the
    liveness thread never take it: they append to ``dropped`` (a deque: atomic append) or flip flags.
    """

    def __init__(self, comm) -> None:
        self.comm = comm  # COMM_WORLD's "dask" duplicate (see start()), or COMM_WORLD itself
        self.rank = self.comm.rank
        self.size = self.comm.size
        self.host = socket.gethostname().replace("/", "_") or "localhost"
        self.lock = threading.Lock()
        self.ctrl_tag, self.last_tag = tag_window(self.comm.tag_ub)
        self._next_tag = self.ctrl_tag + 2
        self._free_tags: list[int] = []  # receive tags of finished channels, reused before fresh ones
        self._ports = itertools.count(1)
        self._reqs = itertools.count(1)
        self.listeners: dict[int, Any] = {}  # port -> its MPIListener
        self.dispatchers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}  # the control tag's, per loop
        # (requesting rank, request id) -> the MPIComm accepted for it, aborted if the connector cancels
        self.accepted: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()
        self.orphans: list[tuple[int, Request]] = []  # (peer, request) kept until done or the peer died
        self.lingering: list[_Channel] = []
        self.dropped: collections.deque[_Channel] = collections.deque()  # channels of comms nobody closed
        self.channels: weakref.WeakSet[_Channel] = weakref.WeakSet()
        self.flushed = False
        self.known: dict[int, int] = {}  # receive tag in use -> its peer rank (drained at exit, freed when done)
        self.doorbell = doorbell.get()  # this process's, before any handshake advertises it
        # Handshakes carry (pid, host key) always: the liveness watcher needs them even with doorbells off.
        self.pid, self.host_key = os.getpid(), doorbell.host_key()
        self.bells: dict[int, doorbell.Bell] = {}  # peer rank -> its doorbell, learned in handshakes
        self.liveness = liveness.Watcher(self._peer_died)
        atexit.register(self._flush)

    # ------------------------------------------------------------------------------------ peers
    def learn_peer(self, rank: int, pid: int, key: int) -> None:
        """What a handshake told about ``rank``: watch its process when it is on this host; open its doorbell
        (only a peer on this host with doorbells on has one)."""
        if key == self.host_key and rank != self.rank:
            self.liveness.watch(rank, pid)
        if rank not in self.bells:
            bell = doorbell.Bell.open(pid, key)
            if bell is not None:
                self.bells[rank] = bell

    def ring(self, rank: int) -> None:
        bell = self.bells.get(rank)
        if bell is not None:
            bell.ring()

    def is_dead(self, rank: int) -> bool:
        return rank in self.liveness.dead

    def _peer_died(self, rank: int) -> None:
        """On the liveness thread: mark every channel to ``rank`` dead; their readers and writers raise
        ``CommClosedError`` at their next test (no MPI call, no lock here)."""
        for chan in list(self.channels):
            if chan.peer == rank:
                chan.dead = True

    # ------------------------------------------------------------------------------------ exit
    def _flush(self, deadline_s: float = 5.0, quiet_s: float = 0.2) -> None:
        """At exit, before ``MPI_Finalize``: close every open channel, then drain what peers sent and wait for
        our own sends, until all sends completed and nothing arrived for ``quiet_s`` (or ``deadline_s``).

        Why: MPICH moves a large message by a rendezvous in which the receiver copies from the sender's memory
        (CMA). A process that exits with such a send pending leaves its peer an unreceivable message, on
        which the peer's ``MPI_Finalize`` fails an assertion and the launcher kills the whole job (seen here
        as intermittent exit code 9 at the end of clean runs). Every exiting rank drains and waits here, so
        two ranks shutting down together complete each other's messages. Sends to and receives from dead
        ranks are dropped: they will never complete.
        """
        if self.flushed:
            return
        self.flushed = True
        try:
            for chan in list(self.channels):
                if not chan.closed:
                    chan.send_close(abort=True)
            t0 = last = time.monotonic()
            while True:
                got = self._drain_all()
                pending = self.tidy()
                now = time.monotonic()
                if got:
                    last = now
                if (not pending and now - last >= quiet_s) or now - t0 >= deadline_s:
                    break
                time.sleep(0.002)
        except Exception:  # noqa: BLE001 - never fail at exit
            logger.debug("mpi:// exit flush failed", exc_info=True)

    def _drain_all(self) -> int:
        """Receive and drop every message waiting on a tag this process receives on (exit only):
        ``MPI_Finalize`` fails on a communicator that still holds unmatched messages."""
        got = 0
        pairs = [(self.ctrl_tag, ANY_SOURCE)] + [(t, p) for t, p in list(self.known.items())]
        for tag, peer in pairs:
            for t in (tag, tag + 1) if tag != self.ctrl_tag else (tag,):
                while (m := self.comm.improbe(peer, t)) is not None:
                    self._discard(m)
                    got += 1
        return got

    def _discard(self, m) -> None:
        """Receive a matched message into a scratch buffer without blocking (a large one from a rank that is
        busy, or dead, would block ``MPI_Mrecv``); the request is kept like a send's."""
        try:
            req = m.irecv(np.empty(m.nbytes, np.uint8))
        except Exception:  # noqa: BLE001 - a message from a process that already exited
            logger.debug("mpi:// could not drain a message from rank %d", m.source, exc_info=True)
            return
        with self.lock:
            self.orphans.append((m.source, req))

    # ------------------------------------------------------------------------------------ closed channels
    def linger(self, chan: "_Channel") -> None:
        """Remember a locally closed channel until its peer's CLOSE (and anything before it) is drained."""
        with self.lock:
            self.lingering.append(chan)

    def _drain(self) -> int:
        """Drop what arrived on closed channels; free the tags of those that are finished. Returns messages."""
        got = 0
        with self.lock:
            chans, self.lingering = self.lingering, []
        keep = []
        for chan in chans:
            if chan.dead or self.is_dead(chan.peer):
                self.finish(chan)
                continue
            while (m := self.comm.improbe(chan.peer, chan.recv_tag)) is not None:
                self._discard(m)
                chan.n_recv += 1
                got += 1
            if not chan.check_peer_close() or chan.n_recv < (chan.peer_total or 0):
                keep.append(chan)
            else:
                self.finish(chan)
        with self.lock:
            self.lingering.extend(keep)
        return got

    def finish(self, chan: "_Channel") -> None:
        """``chan`` is closed on both ends and everything its peer sent was matched: reuse its tags."""
        self.release_tag(chan.recv_tag, chan.peer)

    def release_tag(self, tag: int, peer: int) -> None:
        """Nothing more will arrive from ``peer`` on ``(tag, tag + 1)``: forget it, and reuse it."""
        with self.lock:
            if self.known.get(tag) == peer:
                del self.known[tag]
                self._free_tags.append(tag)

    def tidy(self) -> int:
        """Close channels whose comms were dropped unclosed, drain closed ones, forget completed or hopeless
        requests. Called from ordinary code (never from a finaliser). Returns the requests still pending."""
        while self.dropped:
            chan = self.dropped.popleft()
            if not chan.closed:
                chan.send_close(abort=True)
        if self.lingering:
            self._drain()
        with self.lock:
            reqs, self.orphans = self.orphans, []
        dead = self.liveness.dead
        pending = [(p, r) for p, r in reqs if p not in dead and not r.test()]
        with self.lock:
            self.orphans.extend(pending)
            return len(self.orphans)

    def new_tag(self) -> int:
        """A receive tag pair ``(t, t + 1)`` for a new channel: a freed one, else the next fresh one."""
        with self.lock:
            if self._free_tags:
                return self._free_tags.pop()
            tag = self._next_tag
            if tag + 1 > self.last_tag:
                raise OSError(f"mpi:// backend: all {(self.last_tag - self.ctrl_tag) // 2} connection tags of "
                              f"rank {self.rank} are in use (MPI_TAG_UB={self.comm.tag_ub}); close connections "
                              f"or run an MPI with a larger MPI_TAG_UB")
            self._next_tag += 2
            return tag

    def new_port(self) -> int:
        with self.lock:
            while True:
                port = next(self._ports)
                if port not in self.listeners:
                    return port

    def new_request_id(self) -> int:
        with self.lock:
            return next(self._reqs)

    def keep(self, reqs: list[Request], peer: int) -> None:
        """Keep requests to or from ``peer`` (and their buffers) alive until they complete, after their comm is
        gone; tidies closed channels on the way."""
        pending = [(peer, r) for r in reqs if not r.test()]
        if pending:
            with self.lock:
                self.orphans.extend(pending)
        self.tidy()

    # ----------------------------------------------------------------------------------- listeners
    def add_listener(self, listener: Any, port: int | None) -> int:
        with self.lock:
            if port is None:
                port = next(self._ports)
                while port in self.listeners:
                    port = next(self._ports)
            elif port in self.listeners:
                raise OSError(errno.EADDRINUSE, f"mpi:// port {port} of rank {self.rank} is already listening; "
                                                f"listen on mpi:// for a fresh port")
            self.listeners[port] = listener
        return port

    def remove_listener(self, port: int) -> None:
        with self.lock:
            listener = self.listeners.pop(port, None)
        loop = getattr(listener, "loop", None)
        if loop is None or self.loop_has_listeners(loop):
            return
        task = self.dispatchers.pop(loop, None)
        if task is not None and not task.done() and not loop.is_closed():
            # The last listener on this loop stopped: stop probing the control tag there.
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                task.cancel()
            else:
                loop.call_soon_threadsafe(task.cancel)

    def loop_has_listeners(self, loop) -> bool:
        with self.lock:
            return any(lst.loop is loop for lst in self.listeners.values())


_ENGINE: _Engine | None = None
_ENGINE_LOCK = threading.Lock()


def engine() -> _Engine:
    """The process's mpi:// engine (creates it, and initialises MPI, on first use).

    Made here, outside :func:`start`, it runs on COMM_WORLD itself in a world of several ranks (a duplicate
    is collective, and ranks reach their first use of mpi:// at different times); in a world of one rank on
    the ``"dask"`` duplicate, as after :func:`start`.
    """
    global _ENGINE
    if _ENGINE is None:
        w = world()
        comm = w.sub("dask") if w.size == 1 else w
        with _ENGINE_LOCK:
            if _ENGINE is None:
                _ENGINE = _Engine(comm)
    return _ENGINE


def running() -> _Engine | None:
    """The process's engine if one was made, else ``None`` (makes none, and no MPI call)."""
    return _ENGINE


def start() -> _Engine:
    """Collective over COMM_WORLD: start this rank's engine on COMM_WORLD's ``"dask"`` duplicate
    (``world().sub("dask")``), where mpi:// tags never meet another subsystem's messages nor the user's.

    ``loom dask run``, :func:`loom.dask.initialize`, :func:`loom.dask.launcher.serve` and ``loom bench dask``
    call it on every rank before any mpi:// traffic. Idempotent. If any rank already made its engine on its own
    (:func:`engine` used first), every rank keeps COMM_WORLD, so that all ranks agree on the communicator.
    """
    global _ENGINE
    w = world()
    made = _ENGINE is not None and _ENGINE.comm is w
    if w.allreduce_object(int(made), "max"):
        return engine()
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = _Engine(w.sub("dask"))
    return _ENGINE


class _Channel:
    """One end of a connection: peer rank, the tags, message counters and in-flight sends.

    Kept apart from :class:`loom.dask.connection.MPIComm` so that a finaliser can close a dropped comm without
    resurrecting it.
    """

    __slots__ = ("eng", "peer", "send_tag", "recv_tag", "n_sent", "n_recv", "peer_total", "peer_aborted",
                 "closed", "dead", "sends", "prune_at", "bell", "__weakref__")

    def __init__(self, eng: _Engine, peer: int, *, send_tag: int, recv_tag: int):
        self.eng = eng
        self.peer = peer
        self.send_tag = send_tag
        self.recv_tag = recv_tag
        self.n_sent = 0  # MPI messages sent on send_tag (headers and chunks)
        self.n_recv = 0  # MPI messages received on recv_tag
        self.peer_total: int | None = None  # the peer's n_sent when it closed
        self.peer_aborted = False
        self.closed = False
        self.dead = eng.is_dead(peer)  # set by the liveness thread when the peer's process exits
        self.sends: list[Request] = []
        self.prune_at = 16
        self.bell = eng.bells.get(peer)  # the peer's doorbell: rung after every message posted to it
        eng.channels.add(self)
        eng.known[recv_tag] = peer

    def isend(self, arr, tag: int | None = None) -> None:
        self.sends.append(self.eng.comm.isend(arr, self.peer, self.send_tag if tag is None else tag))

    def prune(self) -> None:
        """Drop completed sends; amortised O(1) per send (the threshold doubles with what stays pending, so a
        burst of writes the peer has not received yet is not re-tested in full on every write)."""
        if len(self.sends) > self.prune_at:
            self.sends = [r for r in self.sends if not r.test()]
            self.prune_at = max(16, 2 * len(self.sends))

    def send_close(self, abort: bool) -> None:
        """Tell the peer how many messages to expect before the end (idempotent via ``closed``)."""
        if self.closed:
            return
        self.closed = True
        if self.dead:
            self.sends = []
            self.eng.finish(self)
            return
        try:
            self.isend(np.array([_CLOSE, self.n_sent, int(abort)], np.uint64), self.send_tag + 1)
            if self.bell is not None:
                self.bell.ring()
        except Exception:  # noqa: BLE001 - closing must not raise (MPI may be finalised at exit)
            logger.debug("could not send CLOSE to rank %d", self.peer, exc_info=True)
        if self.peer_total is None or self.n_recv < self.peer_total:
            self.eng.linger(self)
        else:
            self.eng.finish(self)
        sends, self.sends = self.sends, []
        self.eng.keep(sends, self.peer)

    def check_peer_close(self) -> bool:
        """Receive the peer's CLOSE if it came; True when nothing more will arrive from the peer."""
        if self.peer_total is None:
            m = self.eng.comm.improbe(self.peer, self.recv_tag + 1)
            if m is None:
                return False
            buf = np.empty(3, np.uint64)
            m.recv(buf)
            self.peer_total = int(buf[1])
            self.peer_aborted = bool(buf[2])
        return self.peer_aborted or self.n_recv >= self.peer_total


def _finalize_channel(chan: _Channel) -> None:
    """A comm was dropped unclosed. The garbage collector runs this at any allocation, possibly while this
    thread holds the engine's lock or is inside MPI, so it only queues the channel (no MPI call, no lock):
    the engine's next :meth:`_Engine.tidy` sends its CLOSE."""
    if not chan.closed:
        chan.eng.dropped.append(chan)
