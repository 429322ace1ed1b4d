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
    """torch.cuda stand-ins that log, in order, the streams waited for and the hand-off to torch."""
    log: list = []

    class Ext:
        def __init__(self, handle):
            self.handle = handle

    class Event:
        def record(self, stream):
            log.append(("record", getattr(stream, "handle", stream)))

        def synchronize(self):
            log.append(("host waits",))

    monkeypatch.setattr(torch.cuda, "ExternalStream", Ext)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "legacy default")
    monkeypatch.setattr(torch, "as_tensor", lambda frame, device=None: log.append(("as_tensor", device))
                        or torch.zeros(4))
    return log


def test_dask_cuda_frame_waits_for_its_producer_stream_before_mpi_sees_it(monkeypatch):
    pytest.importorskip("distributed")
    from loom.dask import frames

    log = _fake_cuda(monkeypatch)
    arr, flag = frames.frame_array(_CudaFrame(stream=0x5EED))
    assert flag == frames.CUDA and arr.dtype == torch.uint8 and arr.numel() == 16
    assert log == [("record", 0x5EED), ("host waits",), ("as_tensor", "cuda")], log
    log.clear()
    frames.frame_array(_CudaFrame(stream=1))  # the legacy default stream
    assert log[:2] == [("record", "legacy default"), ("host waits",)], log
    log.clear()
    frames.frame_array(_CudaFrame(stream=None))  # the producer says nothing to wait for (loom.comm still waits
    assert log == [("as_tensor", "cuda")], log  # for the current stream: test above)


def test_dask_frames_on_host_take_no_cuda_path():
    pytest.importorskip("distributed")
    import numpy as np

    from loom.dask import frames

    arr, flag = frames.frame_array(memoryview(b"abc"))
    assert flag == frames.HOST and isinstance(arr, np.ndarray) and arr.tobytes() == b"abc"
