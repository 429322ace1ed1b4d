"""CUDA hand-offs without a GPU (mocks; scripts/gpu_check.py runs the real thing): a device pointer goes to a
CUDA-aware MPI only after its stream's queued work is done, and FPDT's host pool reuses a pinned buffer through a
device-side stream wait instead of blocking the host on each chunk's copy."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from loom.comm import buffers
from loom.parallel import offload


class _Stream:
    def __init__(self):
        self.synced = 0
        self.waited: list = []

    def synchronize(self):
        self.synced += 1

    def wait_event(self, ev):
        self.waited.append(ev)


def _cuda_like(x: torch.Tensor):
    """A stand-in for a CUDA tensor: what as_bytes/as_send read of it."""
    t = mock.MagicMock(spec=torch.Tensor)
    t.is_cuda = True
    t.device = torch.device("cuda", 0)
    t.dtype = x.dtype
    t.reshape.return_value.view.return_value = x
    return t


def test_device_pointer_goes_to_mpi_only_after_its_stream_is_done(monkeypatch):
    stream = _Stream()
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or stream)
    t = _cuda_like(torch.zeros(4))
    spec = buffers.as_bytes(t)
    assert stream.synced == 1 and asked == [torch.device("cuda", 0)]
    assert spec[1] is buffers.MPI.BYTE
    buffers.as_send(t)
    assert stream.synced == 2
    buffers.as_bytes(torch.zeros(4))  # host memory: nothing to wait for
    assert stream.synced == 2


class _Event:
    def __init__(self):
        self.host_waits = 0

    def synchronize(self):
        self.host_waits += 1


def test_host_pool_free_never_blocks_the_host_and_reuse_waits_on_the_stream():
    pool = offload.HostPool("cpu")
    pool._cuda = True
    pool._stream = _Stream()
    pool._cache = offload.PinnedCache(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    buf = torch.empty(64, dtype=torch.uint8)
    ev = _Event()
    pool._items[7] = buf.view(torch.float32)
    pool._events[7] = ev
    pool.free(7)
    assert ev.host_waits == 0, "free() blocked the host on the chunk's copy"
    again = pool._pinned(64)
    assert again.data_ptr() == buf.data_ptr() and again.numel() == 64
    assert pool._stream.waited == [ev], "reuse must wait for the last copy on the side stream"


class _CudaFrame:
    """A CUDA frame as another library exports it (``__cuda_array_interface__`` version 3)."""

    def __init__(self, stream):
        self.__cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0xD000, False), "version": 3,
                                         "stream": stream}


def _fake_cuda(monkeypatch):
    """torch.cuda stand-ins that log, in order, the hand-off to torch and the streams (with their device) waited
    for."""
    log: list = []

    class Ext:
        def __init__(self, handle, device=None):
            self.handle = (handle, device)

    class Event:
        def record(self, stream):
            log.append(("record", getattr(stream, "handle", stream)))

        def synchronize(self):
            log.append(("host waits",))

    monkeypatch.setattr(torch.cuda, "ExternalStream", Ext)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: ("legacy default", device))
    monkeypatch.setattr(torch, "as_tensor", lambda frame, device=None: log.append(("as_tensor", device))
                        or torch.zeros(4, device="meta"))
    return log


def test_dask_cuda_frame_waits_for_its_producer_stream_before_mpi_sees_it(monkeypatch):
    """The frame is wrapped on the device its pointer is on (no ``device=``: in a Dask thread "cuda" is cuda:0
    whatever the rank's GPU, and would copy it there), and the producer's stream is looked up on that device."""
    pytest.importorskip("distributed")
    from loom.dask import frames

    log = _fake_cuda(monkeypatch)
    meta = torch.device("meta")  # the stand-in frame's device
    arr, flag = frames.frame_array(_CudaFrame(stream=0x5EED))
    assert flag == frames.CUDA and arr.dtype == torch.uint8 and arr.numel() == 16
    assert log == [("as_tensor", None), ("record", (0x5EED, meta)), ("host waits",)], log
    log.clear()
    frames.frame_array(_CudaFrame(stream=1))  # the legacy default stream
    assert log[1:] == [("record", ("legacy default", meta)), ("host waits",)], log
    log.clear()
    frames.frame_array(_CudaFrame(stream=None))  # the producer says nothing to wait for (loom.comm still waits
    assert log == [("as_tensor", None)], log  # for the current stream: test above)


def test_dask_frames_on_host_take_no_cuda_path():
    pytest.importorskip("distributed")
    import numpy as np

    from loom.dask import frames

    arr, flag = frames.frame_array(memoryview(b"abc"))
    assert flag == frames.HOST and isinstance(arr, np.ndarray) and arr.tobytes() == b"abc"


class _LogStream:
    """A CUDA stream stand-in that logs what is asked of it (``log`` shared by every stream and event)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, ev):
        self.log.append((self.name, "waits for event", ev.name))

    def synchronize(self):
        self.log.append(("host waits for", self.name))


def _fake_streams(monkeypatch):
    import contextlib

    log: list = []
    streams = {0: _LogStream("d2h", log), 1: _LogStream("h2d", log)}
    caller = _LogStream("compute", log)

    class Event:
        def __init__(self):
            self.name = None

        def record(self, stream):
            self.name = f"end of {stream.name}"
            log.append(("record", stream.name))

        def synchronize(self):
            log.append(("host waits for event", self.name))

        def query(self):
            return False

    monkeypatch.setattr(buffers, "_side_stream", lambda device, which=0: streams[which])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return log


def _cuda_tensor(log, name):
    t = mock.MagicMock(spec=torch.Tensor)
    t.is_cuda = True
    t.device = torch.device("cuda", 0)
    t.detach.return_value = t
    t.copy_.side_effect = lambda src, non_blocking=False: log.append(("copy into", name, non_blocking))
    t.record_stream.side_effect = lambda s: log.append((name, "kept for", s.name))
    return t


def test_staged_copies_never_block_the_host_and_order_streams_on_the_device(monkeypatch):
    """ZeRO's staging (loom.comm.buffers.stage_out/stage_in/use_after): a gradient's copy to the host waits for
    the compute stream on the device and returns at once (its event says when MPI may read it); a result's copy
    back does not make the compute stream wait until the consumer asks (use_after), so a prefetched bucket's copy
    overlaps the kernels queued meanwhile; a buffer from side_empty is filled without waiting for compute."""
    log = _fake_streams(monkeypatch)
    grad, host = _cuda_tensor(log, "grad"), mock.MagicMock(spec=torch.Tensor)
    host.copy_.side_effect = lambda src, non_blocking=False: log.append(("copy into", "host", non_blocking))
    got, ev = buffers.stage_out(grad, out=host)
    assert got is host and ev.name == "end of d2h"
    assert log == [("d2h", "waits for", "compute"), ("copy into", "host", True), ("record", "d2h"),
                   ("grad", "kept for", "d2h")], log
    assert not buffers.copy_done(ev) and buffers.copy_done(None)
    log.clear()
    full = _cuda_tensor(log, "full")
    ev = buffers.stage_in(torch.zeros(4), full, fresh=True)
    assert log == [("copy into", "full", True), ("record", "h2d")], log  # no wait on compute, compute not made to wait
    log.clear()
    buffers.use_after(ev, full)
    assert log == [("compute", "waits for event", "end of h2d"), ("full", "kept for", "compute")], log
    log.clear()
    buffers.stage_in(torch.zeros(4), full)  # a buffer the compute stream may still read: the copy waits for it
    assert log[0] == ("h2d", "waits for", "compute") and ("full", "kept for", "h2d") in log, log
    assert not any(e[0].startswith("host waits") for e in log), log


def test_staged_copies_on_the_host_are_plain_copies():
    x = torch.arange(6.0)
    host, ev = buffers.stage_out(x)
    assert ev is None and torch.equal(host, x) and host.data_ptr() != x.data_ptr()
    out = torch.zeros(6)
    assert buffers.stage_in(host, out) is None and torch.equal(out, x)
    buffers.use_after(None, out)
    buffers.wait_copy(None)
    assert buffers.side_empty((3,), torch.float64, torch.device("cpu")).dtype == torch.float64
    assert buffers.host_empty((2,), torch.float32, torch.device("cpu")).shape == (2,)


def test_pinned_pool_hands_a_buffer_to_one_taker_at_a_time():
    """The staging pool is used by the training thread and a progress thread at once (ZeRO's thread mode):
    two takers must never hold the same buffer."""
    import threading

    from loom.testing import race

    pool = buffers._Pinned(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    for _ in range(4):
        pool.give(torch.empty(4096, dtype=torch.uint8))
    held: set[int] = set()
    clash: list[int] = []
    guard = threading.Lock()

    def worker(_):
        for _ in range(3000):
            buf = pool.take(100)
            with guard:
                if buf.data_ptr() in held:
                    clash.append(buf.data_ptr())
                held.add(buf.data_ptr())
            with guard:
                held.discard(buf.data_ptr())
            pool.give(buf)

    race(worker)
    assert not clash, f"{len(clash)} buffers were handed to two takers at once"


def test_pinned_pool_counts_what_it_pins_and_reuses_a_returned_buffer():
    """What tests/gpu/check_comm_cuda.py reads to tell reuse from fresh pinning. A returned buffer waits in the
    pool's queue (not its free list) until the next take, so the free list alone cannot show reuse."""
    pool = buffers._Pinned(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    pool.give(pool.take(5000))
    assert not pool.free and pool.allocated == 1
    for _ in range(3):
        pool.give(pool.take(5000))
    assert pool.allocated == 1
    held = pool.take(5000)
    pool.take(5000)  # the other one is in use: a second buffer
    assert pool.allocated == 2 and held.numel() == 8192
