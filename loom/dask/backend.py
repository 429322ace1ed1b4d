"""Dask distributed's ``mpi://`` transport: ``Backend``, ``Connector``, ``Listener`` and ``Comm`` over loom.comm.

This module holds the transport's plan and the ``Backend`` that Dask's registry finds; the pieces live one
concern a module: :mod:`loom.dask.address` (addresses, the tag window), :mod:`loom.dask.wire` (message kinds and
header layout), :mod:`loom.dask.process` (the per-process engine and each connection's channel),
:mod:`loom.dask.handshake` (set-up: connector, listener, dispatcher) and :mod:`loom.dask.connection` (``MPIComm``:
reads, writes, close).

Addresses are ``mpi://HOST/RANK/PORT``: the host name (for Dask's same-host logic), the MPI rank of
COMM_WORLD, and a *port*, a number unique within that rank's process (listeners and client endpoints draw
from one counter). ``mpi://`` alone listens on this rank with a fresh port; ``mpi://RANK/PORT`` (no host)
also connects.

Wire plan (on COMM_WORLD's ``"dask"`` duplicate when every rank called :func:`start`, as loom's Dask entry
points do, so mpi:// traffic never meets another subsystem's; tags in the upper half of the running MPI's
``MPI_TAG_UB``, at most ``[2**24, 2**28)``, which also keeps them apart from loom's own small point-to-point
tags where the engine runs on COMM_WORLD itself; see :func:`tag_window`):

1. **Set-up, over MPI only.** Every rank has one *control tag* (the window's first). A connector allocates a fresh
   tag pair ``(t, t + 1)`` for what *it* receives, pre-posts a receive for the reply on ``t`` and sends
   ``CONNECT(request id, port, t, its port, its host)`` to the target rank's control tag. The target's dispatcher
   (one task per event loop with listeners, a :class:`loom.dask.handshake._ControlProbe` on loom's poller) allocates
   its own pair ``(u, u + 1)`` and answers ``ACCEPT(u)`` on ``t`` (or ``REFUSE``). Each side chose the tags it
   receives on, from a process-wide pool: a pair returns to it only once the peer's CLOSE and every message before
   it were matched, so a reused tag never meets a stale message and there is nothing to desynchronise; many
   listeners per rank, many connections to one rank and connections to the same rank all work alike. A connector
   that gives up (timeout) sends ``CANCEL(request id)`` so an accepted-but-abandoned server comm is aborted instead
   of waiting forever in its handshake.
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
3. **Reads wait on loom's poller.** A read is a :class:`loom.dask.connection._ReadOp` pollable: ``improbe`` on the
   data tag, then the header, then the pending frame receives. While nothing arrives the poller backs off to one
   test per 2 ms, so an idle process costs well under 5 % of a core, and spins while traffic flows. A read that
   follows a write on the same comm (a request and its reply) first polls inline for up to
   :data:`loom.dask.connection.INLINE_SPIN_S`, which saves the event-loop round trips that otherwise dominate
   small-message latency; a comm whose replies keep missing that window stops trying (see
   :meth:`loom.dask.connection.MPIComm._spin`). **Doorbells** (:mod:`loom.comm.doorbell`): the handshake carries
   each side's pid and host key, and a writer to a peer on this host rings the peer's doorbell after posting a
   message (a memory load, plus one datagram only when the peer's poller sleeps). Reads from such peers therefore
   sleep until rung (a 2 ms timer stays as the fallback) instead of backing off, and an oversubscribed rank does not
   spin at all. A write whose sends are still in flight keeps its sender on the timer back-off: only the sender's
   tests complete them.
4. **Close reaches the peer.** ``close()``/``abort()`` send ``CLOSE(messages sent, abort)`` on the peer's
   ``u + 1``. A reader drains what was sent before the close, then raises ``CommClosedError``; pending and
   later reads on the closing side raise at once; after that ``closed()`` is true on both ends.

5. **A dead peer closes its comms.** The handshake also carries each side's pid and host key; peers on this
   host are watched by pidfd (:mod:`loom.dask.liveness`). When a peer's process exits, every channel to it
   is marked dead: reads deliver what had already arrived, then raise ``CommClosedError``, as writes do,
   and connects to that rank are refused, exactly what Dask sees over TCP when a worker dies. Sends to it are
   dropped. Whether the other ranks outlive it is the launcher's matter (see :mod:`loom.dask.launcher`).

Finalisers and the liveness thread make no MPI call and take no lock, and no receive blocks
(:mod:`loom.dask.process`).
"""

from __future__ import annotations

from distributed.comm.registry import Backend

from .address import SCHEME, parse_mpi_address, tag_window
from .connection import MPIComm, set_spin
from .handshake import MPIConnector, MPIListener
from .process import engine, start

__all__ = ["MPIBackend", "MPIComm", "MPIConnector", "MPIListener", "parse_mpi_address", "set_spin", "start",
           "tag_window", "SCHEME"]


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
