"""CUDA hand-offs without a GPU (mocks; scripts/gpu_check.py runs the real thing): a device pointer goes to a
CUDA-aware MPI only after its stream's queued work is done, and FPDT's host pool reuses a pinned buffer through a
device-side stream wait instead of blocking the host on each chunk's copy."""

from __future__ import annotations

from unittest import mock

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
    buf = torch.empty(64, dtype=torch.uint8)
    ev = _Event()
    pool._items[7] = buf.view(torch.float32)
    pool._events[7] = ev
    pool.free(7)
    assert ev.host_waits == 0, "free() blocked the host on the chunk's copy"
    again = pool._pinned(64)
    assert again.data_ptr() == buf.data_ptr() and again.numel() == 64
    assert pool._stream.waited == [ev], "reuse must wait for the last copy on the side stream"
