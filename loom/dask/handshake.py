"""Connection set-up over MPI alone: MPIConnector, MPIListener and the control tag's dispatcher.

:class:`MPIConnector` sends CONNECT to the target rank's control tag, whose dispatcher (one per event loop with
listeners) answers ACCEPT or REFUSE and hands the new comm to its :class:`MPIListener` (step 1 of the wire plan
in :mod:`loom.dask.backend`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any

import numpy as np
from distributed.comm.core import BaseListener, CommClosedError, Connector

from loom.comm import ANY_SOURCE, Request, poller

from .address import SCHEME, _unparse, parse_mpi_address
from .connection import MPIComm, _poller
from .process import _Channel, _Engine, engine
from .wire import _ACCEPT, _CANCEL, _CONNECT, _CONNECT_FMT, _REFUSE, _REPLY_WORDS

__all__ = ["MPIConnector", "MPIListener"]

logger = logging.getLogger(__name__)


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


def _ensure_dispatcher(eng: _Engine, loop: asyncio.AbstractEventLoop) -> None:
    """A dispatcher serves this rank's control tag on ``loop`` (one per loop with listeners)."""
    task = eng.dispatchers.get(loop)
    if task is None or task.done():
        eng.dispatchers[loop] = loop.create_task(_dispatch(eng, loop))


async def _dispatch(eng: _Engine, loop: asyncio.AbstractEventLoop) -> None:
    """Serve this rank's control tag while listeners live on ``loop``."""
    probe = _ControlProbe(eng)
    try:
        while eng.loop_has_listeners(loop):
            source, data = await poller().submit(probe)
            try:
                _handle_control(eng, source, data)
            except Exception:  # noqa: BLE001 - a bad request must not kill the dispatcher
                logger.exception("mpi:// control message from rank %d could not be handled", source)
    finally:
        if eng.dispatchers.get(loop) is asyncio.current_task():
            del eng.dispatchers[loop]


def _handle_control(eng: _Engine, source: int, data: np.ndarray) -> None:
    """A CONNECT answered (ACCEPT with a fresh tag pair and a new comm for the listener, or REFUSE), or a
    CANCEL's accepted comm aborted."""
    op, req_id, port, reply_tag, client_port, pid, key, hlen = _CONNECT_FMT.unpack_from(data, 0)
    if op == _CANCEL:
        comm = eng.accepted.pop((source, req_id), None)
        if comm is not None:
            logger.debug("connect request %d from rank %d was abandoned; aborting %r", req_id, source, comm)
            comm.abort()
        return
    if op != _CONNECT:
        raise ValueError(f"unknown control op {op}")
    host = bytes(data[_CONNECT_FMT.size:_CONNECT_FMT.size + hlen]).decode() or None
    eng.learn_peer(source, pid, key)
    with eng.lock:
        listener = eng.listeners.get(port)
    if listener is None:
        eng.keep([eng.comm.isend(np.array([_REFUSE, 0, 0, eng.pid, eng.host_key], np.uint64), source,
                                 reply_tag)], source)
        eng.ring(source)
        return
    tag = eng.new_tag()
    eng.keep([eng.comm.isend(np.array([_ACCEPT, tag, port, eng.pid, eng.host_key], np.uint64), source,
                             reply_tag)], source)
    eng.ring(source)
    comm = MPIComm(
        _Channel(eng, source, send_tag=reply_tag, recv_tag=tag),
        local_addr=listener.contact_address,
        peer_addr=_unparse(host, source, client_port),
        deserialize=listener.deserialize,
    )
    comm.allow_offload = listener.allow_offload
    eng.accepted[(source, req_id)] = comm
    listener.accept(comm)


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
        _ensure_dispatcher(self._eng, self.loop)

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
