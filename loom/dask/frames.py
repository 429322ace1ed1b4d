"""Where the ``mpi://`` backend's frames live: receive blocks (one per message, recycled) and CUDA frames.

**Receive blocks.** Distributed's TCP comm reads a message's frames into one host buffer and slices it; the
``mpi://`` backend does the same: every host frame of a message is received, by MPI itself, into one slice of
one block (:meth:`BlockPool.take`), and Dask gets ``memoryview`` slices of it. Two copies disappear that way:

* Dask splits a frame above ``distributed.comm.shard`` (64 MiB by default) into shards and, on receipt, joins
  them with ``merge_memoryviews``, which is zero-copy only when the shards are adjacent slices of one buffer;
  with a buffer per shard it copies the whole frame into a new one (``host_array_from_buffers``).
* A fresh buffer above glibc's largest mmap threshold (32 MiB) is a new mapping each time: the kernel zeroes
  every page on first touch, a pass over the memory nearly as long as MPI's own copy into it (raw loom.comm
  reuses its buffer). Blocks of at least
  :data:`MIN_POOLED` bytes therefore come from a small pool.

A pooled block goes back to the pool only when nothing refers to its memory any more. Its memory is exported
through a ``ctypes`` array (the *owner*): every ``memoryview``, numpy array or slice Dask derives from a frame
keeps the owner alive (numpy collapses chains of arrays to their first non-array base, which is the owner), and a
``__del__`` of the owner hands the block back. It may run on any thread during a garbage
collection, so it only appends to a deque (atomic; no lock, no MPI call); :meth:`BlockPool.take` files the
returned blocks. At most :data:`POOL_BYTES` stay pooled; the rest are freed as usual.

**Numpy arrays framed directly** (:func:`dumps_arrays`, :func:`loads_arrays`). A message whose only
non-msgpack leaves are ``to_serialize(ndarray)`` of a plain dtype, C- or F-contiguous (a worker's ``get_data``
reply, a scattered array), is framed without Dask's ``protocol.dumps``: one msgpack frame where each array is an
extension object (frame index, dtype, shape, strides, writeable), then each array's memory as a frame of its
own. It is what Dask's numpy serializer sends (``serialize_numpy_ndarray``: a view of the array and those four
fields), without its per-message machinery (serializer dispatch, compression checks, metering contexts),
which costs more than MPI's copy of a 4 MiB frame on one host. The receiver builds each array over its frame
in the block (no copy), or, for a comm that does not deserialise (the scheduler), Dask's own ``Serialized``
of it. Arrays up to :data:`INLINE_ARRAY_MAX` carry their bytes inside the extension object instead (frame index
-1), so that a message of small arrays stays one frame. Anything else (other types, compression negotiated,
other serializers) takes Dask's path.

**CUDA frames** (objects with ``__cuda_array_interface__``, e.g. from Dask's ``"cuda"`` serializers) travel as
device tensors. A CUDA-aware MPI reads device memory outside every stream's order, so before the pointer reaches
MPI the stream that produced the frame must be done: the interface's ``stream`` entry (version 3) names it, and
:func:`frame_array` synchronizes that stream through an event recorded on it; loom.comm then also waits for the
current stream (:func:`loom.comm.buffers.device_ready`), which covers exporters without the entry (torch tensors
export version 2). Received CUDA frames are new device tensors, filled by MPI after loom.comm waited for the current
stream (the caching allocator may hand out memory that queued kernels still read).
"""

from __future__ import annotations

import collections
import ctypes
import threading

import msgpack
import numpy as np
from distributed.protocol.serialize import Serialize, Serialized, msgpack_decode_default, serialize
from distributed.protocol.utils import msgpack_opts
from distributed.utils import ensure_memoryview

__all__ = ["BlockPool", "POOL", "frame_array", "MIN_POOLED", "POOL_BYTES", "HOST", "CUDA", "dumps_arrays",
           "loads_arrays", "loads_plain", "NOT_PLAIN", "ARRAY_EXT"]

#: frame flags of a message's header (0 is a frame inline in the header)
HOST, CUDA = 1, 2
#: receive blocks from this size up are recycled (below it malloc reuses freed memory without new pages)
MIN_POOLED = 1 << 20
#: bytes of free blocks the pool keeps at most
POOL_BYTES = 256 << 20


def _size_class(n: int) -> int:
    """``n`` rounded up to one of four sizes per power of two (at most 25 % over; untouched pages cost no RAM)."""
    if n <= MIN_POOLED:
        return MIN_POOLED
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


class BlockPool:
    """Host blocks for received frames, recycled once nothing refers to them.

    Args:
        capacity: bytes of free blocks kept at most (the oldest free blocks are dropped first).
        min_bytes: smaller blocks are plain ``numpy.empty`` arrays, never pooled.
    """

    def __init__(self, capacity: int = POOL_BYTES, min_bytes: int = MIN_POOLED):
        self.capacity = capacity
        self.min_bytes = min_bytes
        self._free: collections.OrderedDict[int, list[np.ndarray]] = collections.OrderedDict()
        self._held = 0  # bytes in _free
        self._returned: collections.deque[np.ndarray] = collections.deque()  # appended by finalisers only
        self._lock = threading.Lock()  # take() runs on every event loop's thread; finalisers never lock
        self.reused = 0  # blocks handed out again (a counter for tests and benchmarks)
        self._owners: dict[int, type] = {}  # size class -> owner class (see _owner_type)

    def take(self, n: int) -> np.ndarray:
        """A writeable uint8 array of ``n`` bytes (contents undefined), recycled when large enough."""
        if n < self.min_bytes:
            return np.empty(n, np.uint8)
        size = _size_class(n)
        with self._lock:
            self._file_returned()
            free = self._free.get(size)
            raw = free.pop() if free else None
            if raw is not None:
                self._held -= size
                self.reused += 1
        if raw is None:
            raw = np.empty(size, np.uint8)
        owner = self._owner_type(size).from_buffer(raw)
        owner.raw = raw
        return np.frombuffer(owner, np.uint8, n)

    def _owner_type(self, size: int) -> type:
        """The owner class of blocks of ``size`` bytes: a ``ctypes`` array whose ``__del__`` hands its block
        back (cheaper per message than a ``weakref.finalize`` per block, which registers and later unregisters it)."""
        cls = self._owners.get(size)
        if cls is None:
            give_back = self._returned.append

            def __del__(owner) -> None:
                give_back(owner.raw)

            cls = self._owners[size] = type("_Block", (ctypes.c_uint8 * size,), {"__del__": __del__})
        return cls

    def _file_returned(self) -> None:
        """Move blocks given back by finalisers to the free lists, dropping the oldest beyond capacity."""
        while self._returned:
            raw = self._returned.popleft()
            self._free.setdefault(raw.nbytes, []).append(raw)
            self._free.move_to_end(raw.nbytes)
            self._held += raw.nbytes
        while self._held > self.capacity and self._free:
            size, blocks = next(iter(self._free.items()))
            blocks.pop(0)
            self._held -= size
            if not blocks:
                del self._free[size]

    @property
    def held(self) -> int:
        """Bytes of free blocks the pool keeps now."""
        with self._lock:
            self._file_returned()
            return self._held


POOL = BlockPool()

#: msgpack extension code of an array framed by :func:`dumps_arrays`
ARRAY_EXT = 76
#: dtype kinds framed as raw memory (Dask's numpy serializer sends these as views too; object, void and
#: structured dtypes take Dask's path)
_PLAIN_KINDS = frozenset("biufcmMSU")


class _Other(TypeError):
    """The message holds something :func:`dumps_arrays` does not frame."""


#: what :func:`loads_plain` returns for a frame it cannot decode
NOT_PLAIN = object()
#: frames up to this size go through this thread's reused unpacker (it copies what it is fed, and keeps a buffer
#: as large as the largest frame); larger ones through ``msgpack.loads``
UNPACK_MAX = 64 * 1024
#: arrays up to this many bytes travel inside the message's msgpack frame (copied by each packer and unpacker on
#: the way, cheap at this size), so a message of small arrays is one frame and takes the backend's one-frame path
#: rather than a header and a frame per array
INLINE_ARRAY_MAX = 16 * 1024


def _unpacker() -> msgpack.Unpacker:
    return msgpack.Unpacker(object_hook=msgpack_decode_default, use_list=False, **msgpack_opts)


class _Packers(threading.local):
    """This thread's msgpack packers. ``msgpack.dumps`` builds a ``Packer`` (and its 256 KiB buffer) on every
    call: 0.65-1.3 us for a 1-byte message (timeit), against 0.12-0.14 us for a reused packer. A packer is not
    thread-safe, hence one set per thread."""

    def __init__(self) -> None:
        self.meta = msgpack.Packer(use_bin_type=True)  # nested inside ``arrays``' pack: a packer of its own
        self.arrays = msgpack.Packer(use_bin_type=True, default=self._array)
        self.frames: list = [None]  # the message's frames: its msgpack frame's place, then the arrays' frames
        self.inlined = 0  # arrays the pack under way carries inside its own frame
        self.unpacker = _unpacker()

    def unpack(self, frame):
        """One msgpack object filling ``frame``, as Dask's ``loads`` decodes a message of one frame;
        :data:`NOT_PLAIN` on any error or trailing bytes (the unpacker is then replaced: it may hold them)."""
        u = self.unpacker
        start = u.tell()
        try:
            u.feed(frame)
            obj = u.unpack()
            if u.tell() - start == len(frame):
                return obj
        except Exception:  # noqa: BLE001 - Dask's own loads raises (and logs) it
            pass
        self.unpacker = _unpacker()
        return NOT_PLAIN

    def _array(self, obj):
        if type(obj) is not Serialize:
            raise _Other
        x = obj.data
        if (type(x) is not np.ndarray or x.dtype.kind not in _PLAIN_KINDS or x.dtype.fields is not None
                or not (x.flags.c_contiguous or x.flags.f_contiguous)):
            raise _Other
        raw = x.ravel(order="K").view(np.uint8)
        if raw.size <= INLINE_ARRAY_MAX:  # its bytes inside the extension object: (-1, ..., memory)
            self.inlined += 1
            meta = (-1, x.dtype.str, x.shape, x.strides, x.flags.writeable, raw.data)
        else:
            frames = self.frames
            frames.append(raw)
            meta = (len(frames) - 1, x.dtype.str, x.shape, x.strides, x.flags.writeable)
        return msgpack.ExtType(ARRAY_EXT, self.meta.pack(meta))


_PACKERS = _Packers()


def dumps_arrays(msg) -> tuple[list, bool] | None:
    """``(frames, has_arrays)`` for a message of msgpack types and plain numpy arrays behind ``to_serialize``
    (the arrays' frames are uint8 views, no copy; without arrays it is Dask's own single msgpack frame);
    ``None`` for anything else, which Dask's ``protocol.dumps`` must frame."""
    packers = _PACKERS
    try:
        head = packers.arrays.pack(msg)
    except BaseException as exc:  # the hook may have met arrays first: hold none past this call, whatever ended it
        packers.frames = [None]
        packers.inlined = 0
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not ours to swallow
            raise
        return None  # _Other, or a type msgpack refuses: Dask's dumps decides (and reports)
    frames = packers.frames
    if len(frames) == 1 and not packers.inlined:  # no array met (the default hook never ran): most messages
        return [head], False
    packers.frames = [None]
    packers.inlined = 0
    frames[0] = head
    return frames, True


def loads_plain(frame):
    """Dask's ``protocol.loads`` of a message of one frame: with no sub-frames its object hook reduces to
    ``msgpack_decode_default`` (an ``__Serialized__``/``__Pickled__`` marker needs a second frame).
    :data:`NOT_PLAIN` on any error, so that Dask's own loads raises (and logs) it. ``msgpack.loads`` parses its
    five options on every call, ~0.3 us of a 1-byte read: small frames go through this thread's unpacker."""
    if len(frame) <= UNPACK_MAX:
        return _PACKERS.unpack(frame)
    try:
        return msgpack.loads(frame, object_hook=msgpack_decode_default, use_list=False, **msgpack_opts)
    except Exception:  # noqa: BLE001
        return NOT_PLAIN


def loads_arrays(frames: list, deserialize: bool = True):
    """The message :func:`dumps_arrays` framed: each array built over its frame (no copy), or, when not
    deserialising, the ``Serialized`` Dask's ``loads`` would give for it."""

    def ext(code: int, data: bytes):
        if code != ARRAY_EXT:
            return msgpack.ExtType(code, data)
        i, dtype, shape, strides, writeable, *inline = msgpack.loads(data)
        # an inlined array's bytes come as an immutable bytes object: copied (small) when it must be writeable
        buf = frames[i] if i >= 0 else bytearray(inline[0]) if writeable else inline[0]
        x = np.ndarray(shape, np.dtype(dtype), buffer=buf, strides=strides)
        if not writeable:
            x.flags.writeable = False
        return x if deserialize else Serialized(*serialize(x))

    return msgpack.loads(frames[0], object_hook=msgpack_decode_default, ext_hook=ext, use_list=False,
                         **msgpack_opts)


def _stream_of(cai: dict, device):
    """The stream (of ``device``, the frame's) the producer of a ``__cuda_array_interface__`` asks consumers to
    synchronize with, or None (entry absent or None: nothing named). Version 3 of the interface: 1 is the legacy
    and 2 the per-thread default stream, other values a ``cudaStream_t``."""
    import torch

    handle = cai.get("stream")
    if handle is None:
        return None
    if handle == 1:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(int(handle), device=device)


def _producer_done(frame, device) -> None:
    """Block until the stream that produced ``frame`` (on ``device``) finished it: an event on that stream,
    then a host wait."""
    import torch

    if isinstance(frame, torch.Tensor):
        return  # loom.comm waits for a tensor's current stream itself (buffers.device_ready)
    stream = _stream_of(frame.__cuda_array_interface__, device)
    if stream is not None:
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()


def frame_array(frame) -> tuple:
    """A frame as something loom.comm can send, with its flag: a uint8 numpy view (:data:`HOST`), or a flat
    uint8 CUDA tensor (:data:`CUDA`) whose producing stream has finished it."""
    if hasattr(frame, "__cuda_array_interface__"):
        import torch

        # Wrapped where the pointer lives: ``device="cuda"`` would mean this thread's current device (cuda:0 in
        # Dask's threads, whatever the rank is bound to) and copy a frame held on another GPU.
        t = torch.as_tensor(frame)
        _producer_done(frame, t.device)
        return t.view(torch.uint8).reshape(-1), CUDA
    return np.frombuffer(ensure_memoryview(frame), np.uint8), HOST


def cuda_block(n: int):
    """A new device buffer of ``n`` bytes for a received CUDA frame."""
    import torch

    from ..comm.devices import local_device

    return torch.empty(n, dtype=torch.uint8, device=local_device("cuda"))
