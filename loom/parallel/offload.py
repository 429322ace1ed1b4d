"""Chunk stores for the FPDT pipeline and the device-memory tracker that measures their effect.

Two stores share one interface (``put`` -> handle, ``prefetch``, ``get``, ``pop``, ``free``):

* :class:`DeviceStore` keeps chunks where they are (``offload=False``).
* :class:`HostPool` moves chunks to host memory and brings them back just in time (``offload=True``).
  On CUDA it uses pinned host buffers (recycled through a free list), a side stream for both directions and
  CUDA events, so no chunk transfer synchronises the host: the compute stream waits on an event only when it
  reads a chunk (FPDT paper, Sec. 4.2, double buffering). On CPU the same calls keep the host copies outside the
  :class:`MemoryTracker`'s view, so the memory a CUDA device would save is measurable on a laptop.

:class:`MemoryTracker` is the CPU analogue of ``torch.cuda.max_memory_allocated``: a ``TorchDispatchMode`` that
records every storage an operator returns while it is active and drops it when the storage is freed (a weak
reference callback), keeping the running and peak byte totals. Tensors that existed before (parameters,
inputs) are added with :meth:`MemoryTracker.track`. On CUDA it reads the allocator's counters instead.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import stats as _stats

__all__ = ["DeviceStore", "HostPool", "PinnedCache", "MemoryTracker", "untracked", "chunk_store", "transfer_stats",
           "reset_transfer_stats"]

_ACTIVE: list["MemoryTracker"] = []
_TOTALS = _stats.counters("offload", "host")  # the registry's live dict (loom.stats)


def transfer_stats() -> dict[str, int]:
    """Bytes every :class:`HostPool` of this process moved device->host and host->device (a copy)."""
    return {"to_host": _TOTALS.get("to_host", 0), "to_device": _TOTALS.get("to_device", 0)}


def reset_transfer_stats() -> None:
    _stats.reset("offload")


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Operators run inside this block allocate outside the active tracker's view (host-pool storage)."""
    for t in _ACTIVE:
        t._paused += 1
    try:
        yield
    finally:
        for t in _ACTIVE:
            t._paused -= 1


class MemoryTracker(TorchDispatchMode):
    """Peak bytes of live torch storages on the compute device while the tracker is active.

    Usage::

        with MemoryTracker() as mem:
            mem.track(*model.parameters(), tokens)
            model.loss(tokens, targets).backward()
        print(mem.peak)

    On CUDA (``device="cuda"``) the allocator's ``max_memory_allocated`` is used and :meth:`track` is a no-op,
    because the allocator already sees every device byte. On the CPU a DTensor counts as its local shard, and
    a storage resized in place (``UntypedStorage.resize_``, how torch FSDP2 frees and refills unsharded
    parameters) counts at its new size, freed when resized to zero.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.current = 0
        self.peak = 0
        self._paused = 0
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self._cuda_base = 0

    # -- CPU accounting ------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # a DTensor holds storage only through its local shard
        if local is not None:
            t = local
        if t.device.type != "cpu" or t.layout != torch.strided:
            return
        st = t.untyped_storage()
        n = st.nbytes()
        if n == 0:
            return
        key = st._cdata
        if key in self._live:
            return

        self._live[key] = (n, weakref.ref(st, self._on_gone(key)))
        self.current += n
        if self.current > self.peak:
            self.peak = self.current

    def _on_gone(self, key: int) -> Callable:
        """The finaliser of a counted storage: uncount it at its size then (a resize may have changed it)."""
        live, tracker = self._live, weakref.ref(self)

        def gone(_ref):
            entry = live.pop(key, None)
            tr = tracker()
            if entry is not None and tr is not None:
                tr.current -= entry[0]

        return gone

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        key = st._cdata
        entry = self._live.get(key)
        if entry is not None:
            self.current -= entry[0]
            ref = entry[1]
        else:
            ref = weakref.ref(st, self._on_gone(key))
        self._live[key] = (nbytes, ref)  # freed by resizing to 0, or by deletion at its last size
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors that were allocated before the tracker started (parameters, inputs)."""
        if self.device.type == "cuda":
            return
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._paused and self.device.type == "cpu":
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t)
        return out

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            _ACTIVE.append(self)
            return self
        _ACTIVE.append(self)
        orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, n):
            out = orig(st, n)
            if not tracker._paused:
                tracker._resized(st, int(n))
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
            self.current = torch.cuda.memory_allocated(self.device)
            return None
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


class DeviceStore:
    """Keeps chunks on the compute device (FPDT with ``offload=False``); counts nothing moved."""

    def __init__(self) -> None:
        self._items: dict[int, torch.Tensor] = {}
        self._next = 0
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def put(self, t: torch.Tensor) -> int:
        h = self._next
        self._next += 1
        self._items[h] = t
        return h

    def prefetch(self, h: int) -> None:  # noqa: D401 - nothing to do on the device
        return None

    def get(self, h: int) -> torch.Tensor:
        return self._items[h]

    def pop(self, h: int) -> torch.Tensor:
        return self._items.pop(h)

    def free(self, h: int) -> None:
        self._items.pop(h, None)

    def replace(self, h: int, t: torch.Tensor) -> None:
        """Store a new value under an existing handle (the dq accumulators are read-modify-written)."""
        self._items[h] = t


class PinnedCache:
    """Pinned host buffers reused across chunk stores, layers and steps (one per CUDA device).

    Every FPDT block makes a new :class:`HostPool` each step, and a step asks for the same chunk sizes as the
    last, so the buffers are kept here between steps, keyed by size, each with the CUDA event of the last copy
    that used it: reusing one makes the copy stream wait for that event (a device-side wait; the host never
    blocks). The cache holds at most the high-water mark of buffers in use minus those in use now; a miss
    drops cached buffers of other sizes first (after a change of sequence length), so it never grows past
    one step's offloaded bytes. A dropped buffer goes back to torch's pinned allocator, which orders its
    reuse by its own events.

    Args:
        alloc: ``nbytes -> uint8 tensor`` (default: ``torch.empty(..., pin_memory=True)``).
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor] | None = None):
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self.cached = 0
        self.in_use = 0
        self.high = 0
        self.allocated = 0  # buffers made (a steady state makes none)

    def take(self, nbytes: int, wait: Callable[[object], None]) -> torch.Tensor:
        """A buffer of ``nbytes``; ``wait(event)`` orders its reuse after the last copy that used it."""
        lst = self._free.get(nbytes)
        if lst:
            buf, ev = lst.pop()
            self.cached -= nbytes
            if ev is not None:
                wait(ev)
        else:
            for n in sorted(self._free, reverse=True):  # make room: the largest other sizes go first
                while self._free[n] and self.cached + self.in_use + nbytes > self.high:
                    self._free[n].pop()
                    self.cached -= n
            buf = self._alloc(nbytes)
            self.allocated += 1
        self.in_use += nbytes
        self.high = max(self.high, self.in_use)
        return buf

    def give(self, buf: torch.Tensor, event: object) -> None:
        """Return a buffer with the event of the last copy that used it."""
        n = buf.numel()
        self.in_use -= n
        if self.cached + self.in_use + n <= self.high:
            self._free.setdefault(n, []).append((buf, event))
            self.cached += n


_PINNED: dict[torch.device, PinnedCache] = {}
_STREAMS: dict[torch.device, object] = {}


def _cuda_side(device: torch.device) -> tuple[PinnedCache, object]:
    """The pinned cache and the copy stream of a CUDA device (one each per process, so that pools share them)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
        _PINNED[device] = PinnedCache()
    return _PINNED[device], _STREAMS[device]


class HostPool(DeviceStore):
    """Chunks live in host memory between uses; ``prefetch`` starts the copy back, ``get`` waits for it.

    Plan on CUDA: ``put`` records an event on the compute stream, the side stream waits for it and copies the
    chunk into a pinned buffer (non-blocking), recording a "stored" event; ``prefetch`` makes the side stream
    wait for "stored", allocates the device buffer and copies back, recording a "ready" event; ``get`` makes the
    compute stream wait for "ready" (a device-side wait, the host never blocks). At most the chunks that were
    prefetched and not yet popped are resident: the FPDT loops prefetch one chunk ahead (double buffering).
    Pinned buffers return to the device's :class:`PinnedCache` when their chunk is freed, with the event of the
    last copy that used them, and serve the next step's chunks; the copy stream is the device's one side
    stream. No call synchronises the host.

    On CPU, ``put`` clones the chunk outside the tracker's view (the "host") and ``get`` clones it back
    inside it (the "device"), so the tracker sees exactly what a device would hold.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._ready: dict[int, torch.Tensor] = {}
        self._events: dict[int, object] = {}
        if self._cuda:
            self._cache, self._stream = _cuda_side(self.device)

    def _pinned(self, nbytes: int) -> torch.Tensor:
        # the last copy out of (or into) a reused buffer completes before the next one starts
        return self._cache.take(nbytes, self._stream.wait_event)

    def put(self, t: torch.Tensor) -> int:
        h = self._next
        self._next += 1
        nbytes = t.numel() * t.element_size()
        self.bytes_to_host += nbytes
        _stats.add("offload", "host", to_host=nbytes)
        if self._cuda:
            t = t.contiguous()
            buf = self._pinned(nbytes)
            host = buf.view(t.dtype).view(t.shape)
            cur = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._stream):
                self._stream.wait_stream(cur)
                host.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._events[h] = ev
            self._items[h] = host
            return h
        with untracked():
            self._items[h] = t.detach().clone(memory_format=torch.contiguous_format)
        return h

    def prefetch(self, h: int) -> None:
        if h in self._ready or h not in self._items:
            return
        host = self._items[h]
        self.bytes_to_device += host.numel() * host.element_size()
        _stats.add("offload", "host", to_device=host.numel() * host.element_size())
        if self._cuda:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(self._events[h])
                dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            self._events[h] = ev
            self._ready[h] = dev
            return
        self._ready[h] = host.clone()

    def get(self, h: int) -> torch.Tensor:
        self.prefetch(h)
        dev = self._ready.pop(h)
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self._events[h])
            dev.record_stream(cur)
        return dev

    def pop(self, h: int) -> torch.Tensor:
        dev = self.get(h)
        self.free(h)
        return dev

    def free(self, h: int) -> None:
        host = self._items.pop(h, None)
        self._ready.pop(h, None)
        ev = self._events.pop(h, None)
        if host is not None and self._cuda:
            self._cache.give(host.view(-1).view(torch.uint8), ev)

    def replace(self, h: int, t: torch.Tensor) -> None:
        self.free(h)
        nbytes = t.numel() * t.element_size()
        self.bytes_to_host += nbytes
        _stats.add("offload", "host", to_host=nbytes)
        if self._cuda:
            h2 = self.put(t)
            self.bytes_to_host -= nbytes
            _stats.add("offload", "host", to_host=-nbytes)
            self._items[h] = self._items.pop(h2)
            self._events[h] = self._events.pop(h2)
            return
        with untracked():
            self._items[h] = t.detach().clone(memory_format=torch.contiguous_format)


def chunk_store(offload: bool, device: torch.device | str) -> DeviceStore:
    """The store FPDT uses: a :class:`HostPool` when ``offload`` else a :class:`DeviceStore`."""
    return HostPool(device) if offload else DeviceStore()
