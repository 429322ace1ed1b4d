"""The mpi:// wire format: control operations, message kinds, the header, which frames travel inside it.

Steps 1 and 2 of the wire plan in :mod:`loom.dask.backend`.
"""

from __future__ import annotations

import struct

import numpy as np
from distributed.protocol.serialize import Serialize
from distributed.sizeof import safe_sizeof
from distributed.utils import ensure_memoryview

from . import frames as frames_mod

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

#: header messages up to this size are received at once; larger ones by a non-blocking receive
EAGER_HEADER = 4096

_HEAD = struct.Struct("<3Q")  # kind, number of frames, chunk bytes; then a u64 size and a u8 flag per frame
_HEAD1 = struct.Struct("<4QB")  # the header of a message of one frame
_CONNECT_FMT = struct.Struct("<8Q")  # op, request id, port, reply tag, client port, pid, host key, host length
_REPLY_WORDS = 5  # ACCEPT/REFUSE: op, tag, port, pid, host key (u64 each)


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
