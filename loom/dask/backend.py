"""Dask distributed's ``mpi://`` transport: ``Backend``, ``Connector``, ``Listener`` and ``Comm`` over loom.comm.

Addresses are ``mpi://HOST/RANK/PORT``: the host name (for Dask's same-host logic), the MPI rank of
COMM_WORLD, and a *port*, a number unique within that rank's process (listeners and client endpoints draw
from one counter). ``mpi://`` alone listens on this rank with a fresh port; ``mpi://RANK/PORT`` (no host)
also connects.

Wire plan (on COMM_WORLD's ``"dask"`` duplicate when every rank called :func:`start`, as loom's Dask entry
points do, so mpi:// traffic never meets another subsystem's; tags in the upper half of the running MPI's
``MPI_TAG_UB``, at most ``[2**24, 2**28)``, which also keeps them apart from loom's own small point-to-point
tags where the engine runs on COMM_WORLD itself; see :func:`tag_window`):

1. **Set-up, over MPI only.** Every rank has one *control tag* (the window's first). A connector allocates a
   fresh tag pair ``(t, t + 1)`` for what *it* receives, pre-posts a receive for the reply on ``t`` and sends
   ``CONNECT(request id, port, t, its port, its host)`` to the target rank's control tag. The target's
   dispatcher (one task per event loop with listeners, a :class:`_ControlProbe` on loom's poller) allocates
   its own pair ``(u, u + 1)`` and answers ``ACCEPT(u)`` on ``t`` (or ``REFUSE``). Each side chose the tags it
   receives on, from a process-wide pool: a pair returns to it only once the peer's CLOSE and every message
   before it were matched, so a reused tag never meets a stale message and there is nothing to desynchronise;
   many listeners per rank, many connections to one rank and connections to the same rank all work alike.
   A connector that gives up (timeout) sends ``CANCEL(request id)`` so an accepted-but-abandoned server
   comm is aborted instead of waiting forever in its handshake.
2. **Messages.** ``write`` serialises with Dask's ``to_frames`` and sends one MPI message: a header
   (``kind, nframes, chunk``, each frame's size and flag) followed by every frame below 64 KiB inline.
   Larger frames follow as separate messages on the same tag (MPI keeps their order), each split into
   chunks of at most ``chunk`` bytes (default 512 MiB; "very large frames split"), received by MPI straight
   into their slices of one host block per message (:mod:`loom.dask.frames`: as TCP's one read buffer, so
   Dask's shards of a split frame join without a copy; blocks above 1 MiB recycled). CUDA frames
   (``__cuda_array_interface__``) are flagged and travel as device tensors once their producing stream is
   done, zero-copy when the MPI is CUDA-aware and staged through the host by loom.comm otherwise.
   ``write`` returns once the sends are posted (like TCP's write buffer); the requests are kept until done.
   Messages of msgpack types and plain numpy arrays (most of Dask's traffic) are framed inline by
   :func:`loom.dask.frames.dumps_arrays`, the arrays as views (header flag ``_ARRAYS``), and rebuilt over the
   received block. Anything else is serialised by Dask (``protocol.dumps``/``loads``, offloaded to a thread
   above Dask's ``distributed.comm.offload`` size as its ``to_frames``/``from_frames`` do, called inline below it).
3. **Reads wait on loom's poller.** A read is a :class:`_ReadOp` pollable: ``improbe`` on the data tag, then
   the header, then the pending frame receives. While nothing arrives the poller backs off to one test per
   2 ms, so an idle process costs well under 5 % of a core, and spins while traffic flows. A read that
   follows a write on the same comm (a request and its reply) first polls inline for up to
   :data:`INLINE_SPIN_S`, which saves the event-loop round trips that otherwise dominate small-message
   latency; a comm whose replies keep missing that window stops trying (see :meth:`MPIComm._spin`).
   **Doorbells** (:mod:`loom.comm.doorbell`): the handshake carries each side's pid and host key, and a writer
   to a peer on this host rings the peer's doorbell after posting a message (a memory load, plus one datagram
   only when the peer's poller sleeps). Reads from such peers therefore sleep until rung (a 2 ms timer stays
   as the fallback) instead of backing off, and an oversubscribed rank does not spin at all. A write whose
   sends are still in flight keeps its sender on the timer back-off: only the sender's tests complete them.
4. **Close reaches the peer.** ``close()``/``abort()`` send ``CLOSE(messages sent, abort)`` on the peer's
   ``u + 1``. A reader drains what was sent before the close, then raises ``CommClosedError``; pending and
   later reads on the closing side raise at once; after that ``closed()`` is true on both ends.

5. **A dead peer closes its comms.** The handshake also carries each side's pid and host key; peers on this
   host are watched by pidfd (:mod:`loom.dask.liveness`). When a peer's process exits, every channel to it
   is marked dead: reads deliver what had already arrived, then raise ``CommClosedError``, as writes do,
   and connects to that rank are refused, exactly what Dask sees over TCP when a worker dies. Sends to it are
   dropped. Whether the other ranks outlive it is the launcher's matter (see :mod:`loom.dask.launcher`).

Finalisers and the liveness thread make no MPI call and take no lock: a comm dropped unclosed is queued and
closed by the engine's next :meth:`_Engine.tidy`. No receive blocks: messages drained from closed channels
are received with non-blocking requests, kept until they complete.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno
import inspect
import itertools
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import Any

import dask.config
import numpy as np
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.registry import Backend
from distributed import protocol
from distributed.protocol.serialize import Serialize
from distributed.comm.utils import OFFLOAD_THRESHOLD as _OFFLOAD
from distributed.comm.utils import from_frames, to_frames
from distributed.sizeof import safe_sizeof
from distributed.utils import nbytes
from distributed.utils import ensure_memoryview

from loom import settings
from loom.comm import ANY_SOURCE, Request, poller, world
from loom.comm import doorbell

from . import frames as frames_mod
from . import liveness

__all__ = ["MPIBackend", "MPIComm", "MPIConnector", "MPIListener", "parse_mpi_address", "set_spin", "start",
           "tag_window", "SCHEME"]

logger = logging.getLogger(__name__)

SCHEME = "mpi"

# Control-tag operations and replies.
_CONNECT, _CANCEL, _ACCEPT, _REFUSE = 1, 2, 3, 4
# Kinds on a connection's tags.
_DATA, _CLOSE = 1, 2
#: set in a DATA header's kind when the sender's serialisation copied nothing large (see _copy_cost): the
#: receiver's deserialisation is then as cheap, and runs inline whatever the message's size
_CHEAP = 1 << 8
#: set in a DATA header's kind when loom.dask.frames framed the message's numpy arrays (see dumps_arrays)
_ARRAYS = 1 << 9
# Frame flags in the header.
_INLINE, _HOST, _CUDA = 0, frames_mod.HOST, frames_mod.CUDA

#: frames below this many bytes travel inside the header message
INLINE_MAX = 64 * 1024
#: seconds the poller keeps testing at full speed after activity before it backs off: a Dask reply usually comes
#: within a Dask round trip, and a rank still spinning notices it without a sleep and a wake-up. With a core per
#: rank (the launcher's local size <= cores) a 1 ms spin costs an idle rank little, as Dask's own timers fire
#: only a few times a second. On an oversubscribed node every spinning microsecond is taken from a peer's
#: computation: the rank spins 200 us, or not at all with doorbells (loom.comm.doorbell), since a sender on
#: this host rings it awake. Override: ``LOOM_DASK_SPIN_US`` or ``distributed.comm.mpi.spin-us``.
dask.config.update_defaults(settings.dask_defaults())  # distributed.comm.mpi.* keys
_OVERSUBSCRIBED = (getattr(settings.launch_info(), "local_size", None) or 1) > (os.cpu_count() or 1)
_SPIN_DEFAULT = 1000 if not _OVERSUBSCRIBED else (0 if settings.get("doorbell") else 200)
SPIN_S = settings.get("dask_spin_us", fallback=_SPIN_DEFAULT) * 1e-6
#: how long a read right after a write on the same comm waits inline for the reply (see MPIComm._spin)
INLINE_SPIN_S = settings.get("dask_inline_us", fallback=0 if _OVERSUBSCRIBED else 50) * 1e-6
#: the longest probe loop of an inline read between two polls of its read op (see MPIComm._spin)
_SPIN_SLICE_S = 20e-6
#: header messages up to this size are received at once; larger ones by a non-blocking receive
EAGER_HEADER = 4096
#: frames above this many bytes are sent as several MPI messages of at most this size
CHUNK_BYTES = 512 * 1024 * 1024

_HEAD = struct.Struct("<3Q")  # kind, number of frames, chunk bytes; then a u64 size and a u8 flag per frame
_HEAD1 = struct.Struct("<4QB")  # the header of a message of one frame
_CONNECT_FMT = struct.Struct("<8Q")  # op, request id, port, reply tag, client port, pid, host key, host length
_REPLY_WORDS = 5  # ACCEPT/REFUSE: op, tag, port, pid, host key (u64 each)


def parse_mpi_address(loc: str) -> tuple[str | None, int | None, int | None]:
    """``"HOST/RANK/PORT"`` -> ``(host, rank, port)``; missing parts are ``None``.

    Accepted: ``""``, ``"HOST"``, ``"RANK"``, ``"HOST/RANK"``, ``"RANK/PORT"``, ``"HOST/RANK/PORT"``.
    """
    if not isinstance(loc, str):
        raise TypeError(f"mpi address location must be a str, got {type(loc).__name__}")
    loc = loc.strip()
    if loc.startswith(f"{SCHEME}://"):
        loc = loc[len(SCHEME) + 3:]
    if not loc:
        return None, None, None
    parts = loc.split("/")

    def num(text: str, what: str) -> int:
        if not text.isdigit():
            raise ValueError(
                f"mpi address {loc!r}: {what} {text!r} is not a non-negative integer; "
                f"write mpi://HOST/RANK/PORT (e.g. mpi://node1/2/7) or mpi:// to listen on this rank"
            )
        return int(text)

    if len(parts) == 3:
        return parts[0] or None, num(parts[1], "rank"), num(parts[2], "port")
    if len(parts) == 2:
        if parts[0].isdigit() and parts[1].isdigit():
            return None, int(parts[0]), int(parts[1])
        return parts[0] or None, num(parts[1], "rank"), None
    if len(parts) == 1:
        return (None, int(parts[0]), None) if parts[0].isdigit() else (parts[0], None, None)
    raise ValueError(f"mpi address {loc!r} has {len(parts)} '/'-separated parts; write mpi://HOST/RANK/PORT")


def _unparse(host: str | None, rank: int, port: int | None) -> str:
    loc = f"{rank}" if host is None else f"{host}/{rank}"
    return f"{SCHEME}://{loc}" if port is None else f"{SCHEME}://{loc}/{port}"


def tag_window(tag_ub: int) -> tuple[int, int]:
    """``(control tag, last tag)`` of the mpi:// backend under an MPI whose largest tag is ``tag_ub``.

    The backend takes the upper half of the tag space, at most ``[2**24, 2**28)`` (loom's own point-to-point
    tags are small): with MPICH's ``2**29 - 1`` that is ``[2**24, 2**28)``, under Open MPI over UCX
    (``2**23 - 1``) ``[2**22, 2**23)``, under the standard's minimum 32767 ``[16384, 32767]``, i.e. 8191
    connections open at once per rank (tags of closed connections are reused).
    """
    last = min(int(tag_ub), (1 << 28) - 1)
    ctrl = min(1 << 24, (last + 1) // 2)
    if last - ctrl < 64:
        raise ValueError(f"MPI_TAG_UB={tag_ub} leaves the mpi:// backend {max(last - ctrl, 0)} tags (it needs 64); "
                         f"the MPI standard guarantees 32767, so this MPI (or LOOM_TAG_UB) is misconfigured")
    return ctrl, last


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
        self.listeners: dict[int, MPIListener] = {}
        self.dispatchers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self.accepted: weakref.WeakValueDictionary[tuple[int, int], MPIComm] = weakref.WeakValueDictionary()
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
    def add_listener(self, listener: "MPIListener", port: int | None) -> int:
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

    def ensure_dispatcher(self, loop: asyncio.AbstractEventLoop) -> None:
        task = self.dispatchers.get(loop)
        if task is None or task.done():
            self.dispatchers[loop] = loop.create_task(self._dispatch(loop))

    def loop_has_listeners(self, loop) -> bool:
        with self.lock:
            return any(lst.loop is loop for lst in self.listeners.values())

    async def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve this rank's control tag while listeners live on ``loop``."""
        probe = _ControlProbe(self)
        try:
            while self.loop_has_listeners(loop):
                source, data = await poller().submit(probe)
                try:
                    self._handle_control(source, data)
                except Exception:  # noqa: BLE001 - a bad request must not kill the dispatcher
                    logger.exception("mpi:// control message from rank %d could not be handled", source)
        finally:
            if self.dispatchers.get(loop) is asyncio.current_task():
                del self.dispatchers[loop]

    def _handle_control(self, source: int, data: np.ndarray) -> None:
        op, req_id, port, reply_tag, client_port, pid, key, hlen = _CONNECT_FMT.unpack_from(data, 0)
        if op == _CANCEL:
            comm = self.accepted.pop((source, req_id), None)
            if comm is not None:
                logger.debug("connect request %d from rank %d was abandoned; aborting %r", req_id, source, comm)
                comm.abort()
            return
        if op != _CONNECT:
            raise ValueError(f"unknown control op {op}")
        host = bytes(data[_CONNECT_FMT.size:_CONNECT_FMT.size + hlen]).decode() or None
        self.learn_peer(source, pid, key)
        with self.lock:
            listener = self.listeners.get(port)
        if listener is None:
            self.keep([self.comm.isend(np.array([_REFUSE, 0, 0, self.pid, self.host_key], np.uint64), source,
                                       reply_tag)], source)
            self.ring(source)
            return
        tag = self.new_tag()
        self.keep([self.comm.isend(np.array([_ACCEPT, tag, port, self.pid, self.host_key], np.uint64), source,
                                   reply_tag)], source)
        self.ring(source)
        comm = MPIComm(
            _Channel(self, source, send_tag=reply_tag, recv_tag=tag),
            local_addr=listener.contact_address,
            peer_addr=_unparse(host, source, client_port),
            deserialize=listener.deserialize,
        )
        comm.allow_offload = listener.allow_offload
        self.accepted[(source, req_id)] = comm
        listener.accept(comm)


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


class _ControlProbe:
    """Pollable: the next message on this rank's control tag, as ``(source, bytes array)``.

    Counts as rung (``bell``): connectors on this host that know this rank's doorbell ring it, and the first
    connection from a rank (or one from another host) waits at most the poller's timer, 2 ms, once.
    """

    __slots__ = ("eng",)
    bell = True

    def __init__(self, eng: _Engine):
        self.eng = eng

    def poll(self) -> tuple[bool, Any]:
        m = self.eng.comm.improbe(ANY_SOURCE, self.eng.ctrl_tag)
        if m is None:
            return False, None
        buf = np.empty(m.nbytes, np.uint8)
        m.recv(buf)
        return True, (m.source, buf)


def set_spin(*, poll_us: float | None = None, inline_us: float | None = None) -> tuple[float, float]:
    """Set this process's spin windows in microseconds (None keeps one); returns the previous ``(poll, inline)``.

    The defaults depend on whether this node has a core per rank (``MPI_LOCALNRANKS`` against the cores):
    ``LOOM_DASK_SPIN_US`` / ``LOOM_DASK_INLINE_US`` override them for a whole job; this is for a process that
    knows better, e.g. a benchmark whose other ranks sleep while two of them ping-pong.
    """
    global SPIN_S, INLINE_SPIN_S
    before = (SPIN_S * 1e6, INLINE_SPIN_S * 1e6)
    for name, value in (("poll_us", poll_us), ("inline_us", inline_us)):
        if value is not None and not 0 <= value <= 1e6:
            raise ValueError(f"set_spin: {name}={value} must be between 0 and 1e6 microseconds")
    if poll_us is not None:
        SPIN_S = poll_us * 1e-6
    if inline_us is not None:
        INLINE_SPIN_S = inline_us * 1e-6
    return before


def _poller():
    """This loop's loom poller, its spin phase set to :data:`SPIN_S` (see there)."""
    p = poller()
    p.backoff.spin_s = SPIN_S
    return p


class _SendProgress:
    """Pollable over a write's sends that are still in flight (messages beyond MPI's eager limit need the
    sender to make progress while the receiver pulls them). Submitting it keeps the poller testing them at
    spin speed until they complete, instead of at its backed-off rate; nobody awaits its future.

    Never counts as rung (no ``bell`` attribute): nobody rings a sender when its sends complete, and only
    its own tests may move them, so while it is pending the poller keeps its timer back-off."""

    __slots__ = ("reqs", "chan")

    def __init__(self, reqs: list[Request], chan: "_Channel"):
        self.reqs = reqs
        self.chan = chan

    def poll(self) -> tuple[bool, Any]:
        if self.chan.dead:  # a rendezvous send to a dead rank never completes: stop testing it
            return True, None
        self.reqs = [r for r in self.reqs if not r.test()]
        return not self.reqs, None


def _ignore_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.debug("mpi:// send failed: %r", fut.exception())


class _Channel:
    """One end of a connection: peer rank, the tags, message counters and in-flight sends.

    Kept apart from :class:`MPIComm` so that a finaliser can close a dropped comm without resurrecting it.
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


class _ReadOp:
    """Pollable for one ``read``: header, then the separate frames; result is the frame list."""

    __slots__ = ("comm", "chan", "frames", "reqs", "head", "head_req", "misses", "cheap", "arrays")

    def __init__(self, comm: "MPIComm"):
        self.comm = comm
        self.chan = comm._chan
        self.misses = 1  # see poll: the close tag is not probed on a read's first miss
        self.cheap = False  # the message's header carried _CHEAP
        self.arrays = False  # ... and _ARRAYS
        self.frames: list | None = None
        self.reqs: list[Request] = []
        self.head: np.ndarray | None = None
        self.head_req: Request | None = None

    @property
    def bell(self) -> bool:
        """Rung: waiting for the next message from a peer that rings this process (not while a large one is
        being received, which the poller drives at spin speed).

        The poller asks this right before it sleeps and then tests twice more: the first also probes the close
        tag (misses restart at 0), so a CLOSE that rang this process is seen before it sleeps again.
        """
        if self.chan.bell is None or self.reqs or self.head_req is not None:
            return False
        self.misses = 0
        return True

    def poll(self, spin_s: float = 0.0) -> tuple[bool, Any]:
        """Test once; ``spin_s``: while no message has begun, probe for it for up to that long (an inline read)."""
        chan = self.chan
        if self.comm._closed:
            raise CommClosedError(f"{self.comm!r} was closed while reading")
        if self.frames is None:
            if self.head_req is None:
                m = chan.eng.comm.try_recv(chan.peer, chan.recv_tag, EAGER_HEADER, spin_s)
                if m is None:
                    # The close tag is probed on every 8th miss, and on the first test after the poller was rung
                    # (``bell`` resets misses): a waiting read costs one probe per test, not two, a reply that
                    # comes within a few tests (a request's) costs none, and a close is seen within 8 tests.
                    self.misses += 1
                    if self.misses & 7 == 1 and chan.check_peer_close():
                        self.comm._mark_closed()
                        why = "aborted" if chan.peer_aborted else "closed"
                        raise CommClosedError(f"{self.comm!r}: the peer {why} the connection")
                    if chan.dead:  # everything it sent was received: like TCP's EOF after the buffered data
                        raise self.comm._peer_died()
                    return False, None
                chan.n_recv += 1
                if type(m) is bytearray:
                    self.head = m  # already received: small messages travel eagerly
                else:
                    self.head = np.empty(m.nbytes, np.uint8)
                    # A large header may need the sender's progress to arrive: never block the loop on it. On one
                    # host it is usually complete at once (the receiver copies it): no request object then.
                    self.head_req = m.irecv_eager(self.head)
            if self.head_req is not None:
                if not self.head_req.test():
                    if chan.dead:
                        raise self.comm._peer_died()
                    return False, None
                self.head_req = None
            self._start(self.head)
            self.head = None
        reqs = self.reqs  # reversed: the first pending chunk is last
        while reqs and reqs[-1].test():
            reqs.pop()
        if reqs:
            if chan.dead:
                raise self.comm._peer_died()
            return False, None
        return True, self.frames

    def _start(self, buf: np.ndarray) -> None:
        kind, n, chunk = _HEAD.unpack_from(buf, 0)
        if kind & ~(_CHEAP | _ARRAYS) != _DATA:
            raise CommClosedError(f"{self.comm!r}: unexpected message kind {int(kind)} on the data tag")
        self.cheap = bool(kind & _CHEAP)
        self.arrays = bool(kind & _ARRAYS)
        if n == 1 and buf[32] == _INLINE:  # the common small message: one inline frame
            self.frames = [memoryview(buf)[33:]]
            return
        sizes = np.frombuffer(buf, np.uint64, n, 24).tolist()
        flags = np.frombuffer(buf, np.uint8, n, 24 + 8 * n).tolist()
        mv = memoryview(buf)
        off = 24 + 9 * n
        # Every host frame lands in its slice of one block, in frame order (see loom.dask.frames): Dask's shards
        # of one split frame are then adjacent, and its merge of them is a view, not a copy.
        total = sum(size for size, flag in zip(sizes, flags) if flag == _HOST)
        block = frames_mod.POOL.take(total) if total else None
        view = memoryview(block) if total else None
        at = 0
        frames: list = []
        chan = self.chan
        comm = chan.eng.comm
        for size, flag in zip(sizes, flags):
            if flag == _INLINE:
                frames.append(mv[off:off + size])
                off += size
                continue
            if flag == _CUDA:
                target = frames_mod.cuda_block(size)
                frames.append(target)
            else:
                target = block[at:at + size]
                frames.append(view[at:at + size])
                at += size
            for lo in range(0, max(size, 1), chunk):
                self.reqs.append(comm.irecv(target[lo:lo + chunk], chan.peer, chan.recv_tag))
                chan.n_recv += 1
        self.reqs.reverse()
        self.frames = frames


def _copy_cost(msg, depth: int = 0) -> int:
    """Bytes of ``msg`` that Dask's serialisation copies or pickles (-1: unknown): its ``sizeof`` less the
    contiguous numpy arrays of plain dtypes behind ``to_serialize`` (as a worker's ``get_data`` reply carries
    them), which Dask's numpy serializer frames as views of the array. Small dicts, lists and tuples are
    looked into, two levels deep; anything else counts whole, as Dask counts it."""
    t = type(msg)
    if t is Serialize:
        x = msg.data
        if type(x) is np.ndarray and not x.dtype.hasobject and (x.flags.c_contiguous or x.flags.f_contiguous):
            return 0
    elif depth < 3 and (t is dict or t is list or t is tuple) and len(msg) <= 16:
        total = 0
        for item in (msg.values() if t is dict else msg):
            cost = _copy_cost(item, depth + 1)
            if cost < 0:
                return -1
            total += cost
        return total + 64 * len(msg)  # keys, msgpack's framing
    return safe_sizeof(msg, default_size=-1)


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _layout(frames: list) -> tuple[list[int], bytearray, list, int]:
    """Each frame's size, flag and what to send (``(sizes, flags, arrays, inline bytes)``).

    Frames below :data:`INLINE_MAX` travel inside the header, except one that continues the previous separate
    frame in memory (the last shard of a frame Dask split): it is sent separately too, so that the receiver's
    block holds every shard of the frame side by side and Dask joins them without a copy.
    """
    n = len(frames)
    sizes = [0] * n
    flags = bytearray(n)
    arrays: list = [None] * n
    inline = 0
    prev_end = -1  # end address of the previous frame when it was sent separately from host memory
    for i, f in enumerate(frames):
        if hasattr(f, "__cuda_array_interface__"):
            arr, flag = frames_mod.frame_array(f)
            prev_end = -1
        else:
            mv = f if type(f) is bytes else ensure_memoryview(f)
            size = len(mv) if type(mv) is bytes else mv.nbytes
            arr = None
            if size < INLINE_MAX and (prev_end < 0 or not size
                                      or _address(arr := np.frombuffer(mv, np.uint8)) != prev_end):
                sizes[i] = size
                arrays[i] = mv
                inline += size
                prev_end = -1
                continue
            arr, flag = (arr if arr is not None else np.frombuffer(mv, np.uint8)), _HOST
            prev_end = _address(arr) + size
        sizes[i] = arr.nbytes
        flags[i] = flag
        arrays[i] = arr
    return sizes, flags, arrays, inline


def _layout_arrays(frames: list) -> tuple[list[int], bytearray, list, int]:
    """:func:`_layout` of what :func:`loom.dask.frames.dumps_arrays` framed: a ``bytes`` frame, then flat uint8
    arrays. Their sizes are known and no frame continues another (none was split), so nothing is looked up: on the
    critical path of a large message, right after a copy has flushed the caches, every Python step counts."""
    sizes = [len(frames[0])]
    sizes += [a.size for a in frames[1:]]
    flags = bytearray(_HOST if size >= INLINE_MAX else _INLINE for size in sizes)
    inline = sum(size for size, flag in zip(sizes, flags) if flag == _INLINE)
    # What is sent separately goes as a uint8 array (a large msgpack frame: many small arrays, long strings);
    # what is copied into the header as a buffer bytearray's slice assignment takes (it refuses an ndarray).
    arrays = [(np.frombuffer(f, np.uint8) if type(f) is bytes else f) if flag else
              (f if type(f) is bytes else memoryview(f)) for f, flag in zip(frames, flags)]
    return sizes, flags, arrays, inline


class MPIComm(Comm):
    """An established ``mpi://`` connection (one reader and one writer at a time, as every Dask comm)."""

    max_shard_size = None  # set from Dask's config on first write (distributed.comm.shard)

    def __init__(self, chan: _Channel, *, local_addr: str, peer_addr: str, deserialize: bool = True):
        self._closed = False
        self._chan = chan
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        super().__init__(deserialize=deserialize)
        self._reader: _ReadOp | None = None
        self._op: _ReadOp | None = None  # the read op, reused by every read that finds it idle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_write = -1.0  # perf_counter() at the end of the last write (see _spin)
        self._writes = 0
        self._poller = None  # (loop, its poller): looked up once, not on every write
        self._spin_fail = 0
        self._spin_skip = 0
        self._remote = chan.peer != chan.eng.rank  # a peer in this process can never answer during a spin
        self._finalizer = weakref.finalize(self, _finalize_channel, chan)
        self._finalizer.atexit = False

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def peer_rank(self) -> int:
        return self._chan.peer

    @property
    def same_host(self) -> bool:
        return parse_mpi_address(self._local_addr)[0] == parse_mpi_address(self._peer_addr)[0]

    async def read(self, deserializers=None):
        if self._closed:
            raise CommClosedError(f"{self!r} is closed")
        op = self._op
        if op is None or op.frames is not None or op.head_req is not None or op.reqs:
            op = self._op = _ReadOp(self)  # the last one was abandoned mid-message: a fresh one
        else:
            op.misses = 1
        self._reader = op
        self._loop = asyncio.get_running_loop()
        try:
            done, frames = op.poll()
            if (not done and self._spin_skip == 0 and self._remote
                    and time.perf_counter() - self._last_write < INLINE_SPIN_S):
                done, frames = self._spin(op)
            elif self._spin_skip:
                self._spin_skip -= 1
            if not done:
                frames = await _poller().submit(op)
        except CommClosedError:
            self._mark_closed()
            raise
        except BaseException:
            # Cancelled mid-message (e.g. a timeout): what was received is unknown, so the comm is unusable.
            self.abort()
            raise
        finally:
            self._reader = None
        op.frames = None  # done: the next read reuses it
        if op.arrays:
            return frames_mod.loads_arrays(frames, self.deserialize)
        if len(frames) == 1:
            msg = frames_mod.loads_plain(frames[0])
            if msg is not frames_mod.NOT_PLAIN:
                return msg
        if (op.cheap or not (_OFFLOAD and self.allow_offload and self.deserialize)
                or sum(map(nbytes, frames)) <= _OFFLOAD):
            # Dask's from_frames without its coroutine (it too deserialises inline below the offload threshold).
            try:
                return protocol.loads(frames, deserialize=self.deserialize, deserializers=deserializers)
            except EOFError:
                self.abort()
                raise CommClosedError(f"{self!r}: aborted on truncated data") from None
        try:
            return await from_frames(frames, deserialize=self.deserialize, deserializers=deserializers,
                                     allow_offload=self.allow_offload)
        except EOFError:
            self.abort()
            raise CommClosedError(f"{self!r}: aborted on truncated data") from None

    def _spin(self, op: "_ReadOp") -> tuple[bool, Any]:
        """Wait for a reply inline, without a trip through the event loop, for at most :data:`INLINE_SPIN_S`:
        until its header comes, in loom.comm's probe loop (``try_recv``'s ``spin_s``), then testing its frames.

        Only right after a write on this comm (a request/reply exchange, where the answer usually comes within
        tens of microseconds); the loop is blocked meanwhile, so a spin that times out makes this comm skip
        the next 1, 2, 4, ... 64 chances (reset by a spin that succeeds): a comm whose replies are slow
        (a stream, a long computation) soon stops spinning and costs the loop at most ~1/64 of a spin per read.
        """
        clock = time.perf_counter
        end = clock() + INLINE_SPIN_S
        poll = op.poll
        while (left := end - clock()) > 0:
            # The probe loop checks neither the close tag nor the peer's death: at most _SPIN_SLICE_S of it per
            # poll, so a longer window (set_spin) still sees a CLOSE within 8 polls, as the poller does.
            done, frames = poll(min(left, _SPIN_SLICE_S))
            if done:
                self._spin_fail = 0
                return True, frames
        self._spin_fail = min(64, 2 * self._spin_fail or 1)
        self._spin_skip = self._spin_fail
        return False, None

    async def write(self, msg, serializers=None, on_error="message"):
        chan = self._chan
        if self._closed or chan.closed:
            raise CommClosedError(f"{self!r} is closed")
        # The peer's CLOSE is probed on the first write and every 8th after it (one MPI probe saved per write):
        # like TCP, a write may succeed after the peer closed; the next read, or a later write, raises.
        if chan.dead:
            raise self._peer_died()
        self._writes += 1
        if self._writes & 7 == 1 and chan.check_peer_close():
            self._mark_closed()
            raise CommClosedError(f"{self!r}: the peer closed the connection")
        if MPIComm.max_shard_size is None:
            import dask

            MPIComm.max_shard_size = dask.utils.parse_bytes(dask.config.get("distributed.comm.shard"))
        frames, arrays = self._serialise_inline(msg, serializers, on_error)
        cheap = frames is not None and bool(_OFFLOAD and self.allow_offload)  # only when the cost was checked
        if frames is None:
            context = {"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options}
            frames = await to_frames(msg, allow_offload=self.allow_offload, serializers=serializers,
                                     on_error=on_error, context=context, frame_split_size=MPIComm.max_shard_size)
        if self._closed:
            raise CommClosedError(f"{self!r} was closed while serialising")
        try:
            n, reqs = self._send_frames(frames, cheap, arrays)
        except BaseException:
            self.abort()
            raise
        bell = chan.bell
        if bell is not None:
            bell.ring()
        loop = asyncio.get_running_loop()
        cached = self._poller
        if cached is None or cached[0] is not loop:
            cached = self._poller = (loop, _poller())
        pending = [r for r in reqs if not r.test()] if reqs else reqs
        if pending:
            cached[1].submit(_SendProgress(pending, chan)).add_done_callback(_ignore_result)
        elif cached[1].pending:
            cached[1].nudge()  # a reply is usually on its way: reads waiting on this loop test at once
        self._last_write = time.perf_counter()
        return n

    def _serialise_inline(self, msg, serializers, on_error) -> tuple[list | None, bool]:
        """``(frames, arrays)``: the message framed here, on the loop's thread, or ``(None, False)`` when it belongs
        in Dask's offload thread (``distributed.comm.offload``).

        A message of msgpack types and plain numpy arrays behind ``to_serialize`` (most of Dask's traffic:
        requests, replies, heartbeats, a worker's ``get_data`` reply) is framed by
        :func:`loom.dask.frames.dumps_arrays` (``arrays`` true when it holds arrays) whatever its size, unless it
        holds arrays and compression was negotiated or the serializers exclude Dask's own. Its arrays are framed
        as views, and msgpack holds the GIL while it packs the rest, so in Dask's thread the same work would
        stall this loop as long; the message is therefore not sized first (Dask's ``sizeof``, or
        :func:`_copy_cost`): the size would decide nothing.

        Anything else goes through Dask's ``protocol.dumps``: inline when what it would copy is at most Dask's
        offload size, where, unlike Dask, arrays that serialise as views (:func:`_copy_cost`) do not count, since
        a thread hop on each end costs more than framing views. A message framed inline is marked cheap to
        deserialise too (:data:`_CHEAP`). A message refused part-way has had what precedes the refused object
        packed once here for nothing: Dask's messages put small fields first and wrap bulk data in
        ``Serialize``/``ToPickle``, which is refused as soon as it is met.
        """
        done = frames_mod.dumps_arrays(msg)
        if done is not None and (not done[1] or (not self.handshake_options.get("compression")
                                                 and (serializers is None or "dask" in serializers))):
            return done
        if _OFFLOAD and self.allow_offload and not 0 <= _copy_cost(msg) <= _OFFLOAD:
            return None, False  # _copy_cost: at most the message's sizeof, less its arrays framed as views
        context = {"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options}
        try:
            frames = list(protocol.dumps(msg, serializers=serializers, on_error=on_error, context=context,
                                         frame_split_size=MPIComm.max_shard_size))
        except Exception:
            logger.info("Unserializable Message: %s", msg)
            raise
        return frames, False

    def _send_frames(self, frames: list, cheap: bool = False, framed_arrays: bool = False) -> tuple[int, list[Request]]:
        chan = self._chan
        n = len(frames)
        if n == 1 and type(frames[0]) is bytes and len(frames[0]) < INLINE_MAX:  # the common small message
            kind = _DATA | (_ARRAYS if framed_arrays else 0)  # arrays inlined in the frame (frames.INLINE_ARRAY_MAX)
            head = _HEAD1.pack(kind, 1, CHUNK_BYTES, len(frames[0]), _INLINE) + frames[0]
            req = chan.eng.comm.isend_eager(head, chan.peer, chan.send_tag)
            chan.n_sent += 1
            if req is None:  # sent eagerly (the usual case): nothing to keep
                return len(head), []
            chan.sends.append(req)
            chan.prune()
            return len(head), [req]
        sizes, flags, arrays, inline = (_layout_arrays if framed_arrays else _layout)(frames)
        chunk = CHUNK_BYTES
        head = bytearray(24 + 9 * n + inline)
        kind = _DATA | (_CHEAP if cheap else 0) | (_ARRAYS if framed_arrays else 0)
        struct.pack_into(f"<3Q{n}Q", head, 0, kind, n, chunk, *sizes)
        head[24 + 8 * n:24 + 9 * n] = flags
        off = 24 + 9 * n
        for i in range(n):
            if flags[i] == _INLINE:
                head[off:off + sizes[i]] = arrays[i]
                off += sizes[i]
        start = len(chan.sends)
        chan.isend(np.frombuffer(head, np.uint8))
        sent = 1
        for i in range(n):
            if flags[i] != _INLINE:
                arr = arrays[i]
                for lo in range(0, max(sizes[i], 1), chunk):
                    chan.isend(arr[lo:lo + chunk])
                    sent += 1
        chan.n_sent += sent
        reqs = chan.sends[start:]
        chan.prune()
        return len(head) + sum(sizes[i] for i in range(n) if flags[i] != _INLINE), reqs

    def _peer_died(self) -> CommClosedError:
        """The peer rank's process exited: close this end (no CLOSE is sent) and say so."""
        self._mark_closed()
        return CommClosedError(f"{self!r}: peer rank {self._chan.peer} died")

    def _mark_closed(self, abort: bool = False) -> bool:
        """Close this end once, sending CLOSE (or ABORT) to the peer; True if this call closed it."""
        if self._closed:
            return False
        self._closed = True
        self._chan.send_close(abort=abort)
        self._finalizer.detach()
        return True

    def _wake_reader(self) -> None:
        op = self._reader
        if op is None or self._loop is None:
            return
        exc = CommClosedError(f"{self!r} was closed while reading")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            poller().cancel(op, exc)
        elif not self._loop.is_closed():
            # Another thread: the poller notices ``_closed`` on its next test (within its back-off, <= 2 ms).
            pass

    async def close(self):
        """Close cleanly: messages already written are still delivered, then the peer's reads raise."""
        if self._mark_closed(abort=False):
            self._wake_reader()

    def abort(self) -> None:
        """Close at once; the peer's pending and later reads raise ``CommClosedError``."""
        if self._mark_closed(abort=True):
            self._wake_reader()

    def closed(self) -> bool:
        """True once this end closed, or a read or write found the peer gone (as TCP's comm: a peer's close is
        not looked for here, so BatchedSend does not fail a message that is simply dropped at shutdown)."""
        return self._closed

    @property
    def extra_info(self) -> dict:
        return {"rank": self._chan.eng.rank, "peer_rank": self._chan.peer}


class _Reply:
    """Pollable: the target's answer to a CONNECT (it rings this process once it has sent it)."""

    __slots__ = ("req", "eng", "rank")
    bell = True

    def __init__(self, req: Request, eng: _Engine, rank: int):
        self.req = req
        self.eng = eng
        self.rank = rank

    def poll(self) -> tuple[bool, Any]:
        if self.req.test():
            return True, None
        if self.eng.is_dead(self.rank):
            raise ConnectionRefusedError(f"mpi:// rank {self.rank} died before answering a connection request")
        return False, None


class MPIConnector(Connector):
    """Opens ``mpi://`` connections: the whole set-up is a CONNECT on the target rank's control tag."""

    async def connect(self, address, deserialize=True, **connection_args):
        host, rank, port = parse_mpi_address(address)
        if rank is None or port is None:
            raise ValueError(f"cannot connect to mpi address {address!r}: it needs a rank and a port "
                             f"(mpi://HOST/RANK/PORT, as a listener's contact_address prints it)")
        eng = engine()
        if rank >= eng.size:
            raise ConnectionRefusedError(
                f"mpi://{address}: rank {rank} is not in this MPI world of {eng.size} ranks")
        if eng.is_dead(rank):
            raise ConnectionRefusedError(f"mpi://{address}: rank {rank} died")
        tag = eng.new_tag()
        eng.known[tag] = rank
        my_port = eng.new_port()
        req_id = eng.new_request_id()
        reply = np.zeros(_REPLY_WORDS, np.uint64)
        wait = eng.comm.irecv(reply, rank, tag)
        hb = eng.host.encode()
        msg = np.frombuffer(_CONNECT_FMT.pack(_CONNECT, req_id, port, tag, my_port, eng.pid, eng.host_key, len(hb))
                            + hb, np.uint8)
        eng.keep([eng.comm.isend(msg, rank, eng.ctrl_tag)], rank)
        eng.ring(rank)
        try:
            await _poller().submit(_Reply(wait, eng, rank))
        except BaseException:
            if not eng.is_dead(rank):
                cancel = np.frombuffer(_CONNECT_FMT.pack(_CANCEL, req_id, port, tag, my_port, eng.pid, eng.host_key,
                                                         0), np.uint8)
                eng.keep([eng.comm.isend(cancel, rank, eng.ctrl_tag), wait], rank)
                eng.ring(rank)
            raise
        op, peer_tag = int(reply[0]), int(reply[1])
        eng.learn_peer(rank, int(reply[3]), int(reply[4]))
        if op != _ACCEPT:
            eng.release_tag(tag, rank)  # the one reply arrived; nothing else will come on this pair
            raise ConnectionRefusedError(f"mpi://{address}: no listener on port {port} of rank {rank}")
        chan = _Channel(eng, rank, send_tag=peer_tag, recv_tag=tag)
        return MPIComm(chan, local_addr=_unparse(eng.host, eng.rank, my_port),
                       peer_addr=_unparse(host, rank, port), deserialize=deserialize)


class MPIListener(BaseListener):
    """Accepts ``mpi://`` connections on one port of this rank (any number of listeners per rank)."""

    prefix = f"{SCHEME}://"  # read by distributed.Worker's start-up log, like TCPListener.prefix

    def __init__(self, address: str, comm_handler, deserialize: bool = True, allow_offload: bool = True,
                 handshake_overrides: dict | None = None, **connection_args: Any):
        super().__init__()
        host, rank, port = parse_mpi_address(address)
        eng = engine()
        if rank is not None and rank != eng.rank:
            raise ValueError(f"cannot listen on mpi address {address!r} from rank {eng.rank}: a rank listens "
                             f"only on its own addresses; use mpi:// (or mpi://{eng.host}/{eng.rank})")
        self._eng = eng
        self._want_port = port
        self.port: int | None = None
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self.handshake_overrides = handshake_overrides
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.port = self._eng.add_listener(self, self._want_port)
        self._eng.ensure_dispatcher(self.loop)

    def stop(self) -> None:
        if self.port is not None:
            self._eng.remove_listener(self.port)

    def accept(self, comm: MPIComm) -> None:
        """Hand a new comm to this listener's event loop (called by the dispatcher, maybe from another loop)."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(self._handle(comm))
        else:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._handle(comm)))

    async def _handle(self, comm: MPIComm) -> None:
        try:
            await self.on_connection(comm, self.handshake_overrides)
        except CommClosedError:
            logger.debug("mpi:// connection from %s closed before the handshake completed", comm.peer_address)
            return
        result = self.comm_handler(comm)
        if inspect.isawaitable(result):
            await result

    def _check_started(self) -> None:
        if self.port is None:
            raise ValueError("invalid operation on a non-started MPIListener; await listener.start() first")

    @property
    def listen_address(self) -> str:
        self._check_started()
        return _unparse(self._eng.host, self._eng.rank, self.port)

    @property
    def contact_address(self) -> str:
        return self.listen_address


class MPIBackend(Backend):
    """The ``mpi`` scheme (registered through the ``distributed.comm.backends`` entry point)."""

    def get_connector(self) -> MPIConnector:
        return MPIConnector()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args) -> MPIListener:
        return MPIListener(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        host, rank, _ = parse_mpi_address(loc)
        if host is not None:
            return host
        eng = engine()
        if rank is None or rank == eng.rank:
            return eng.host
        return f"rank{rank}"

    def resolve_address(self, loc: str) -> str:
        parse_mpi_address(loc)  # validate
        return loc

    def get_local_address_for(self, loc: str) -> str:
        parse_mpi_address(loc)
        eng = engine()
        return f"{eng.host}/{eng.rank}"
