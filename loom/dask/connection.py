"""MPIComm, one established mpi:// connection: reads, writes and close.

Reads wait on loom's poller (or spin inline right after a write), writes frame the message and keep their
sends until done; steps 2-4 of the wire plan in :mod:`loom.dask.backend`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import weakref
from typing import Any

import dask.config
import numpy as np
from distributed import protocol
from distributed.comm.core import Comm, CommClosedError
from distributed.comm.utils import OFFLOAD_THRESHOLD as _OFFLOAD
from distributed.comm.utils import from_frames, to_frames
from distributed.utils import nbytes

from loom import settings
from loom.comm import Request, poller

from . import frames as frames_mod
from .address import parse_mpi_address
from .process import _Channel, _finalize_channel
from .wire import (_ARRAYS, _CHEAP, _CUDA, _DATA, _HEAD, _HEAD1, _HOST, _INLINE, EAGER_HEADER, INLINE_MAX,
                   _copy_cost, _layout, _layout_arrays)

__all__ = ["MPIComm", "set_spin"]

logger = logging.getLogger(__name__)


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
#: frames above this many bytes are sent as several MPI messages of at most this size
CHUNK_BYTES = 512 * 1024 * 1024


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
