"""Turning torch tensors and numpy arrays into MPI buffer specs, safely and cheaply.

Traps this module exists for (each measured with mpi4py 4.1 + MPICH 5.0 and tested in ``tests/``):

* A transposed (non-contiguous) torch tensor passed to mpi4py through DLPack is sent *in memory order*:
  silently wrong data. Every send buffer here is made contiguous first; a non-contiguous receive target is
  filled through a contiguous temporary and copied back.
* A strided view raises ``BufferError`` inside mpi4py: same cure.
* DLPack export costs ~12 us per call here, against ~2 us for a whole 1-byte ping-pong; we build the buffer
  from ``data_ptr()`` instead (``MPI.buffer.fromaddress``), which is what keeps loom within 1.2x of raw mpi4py.
* bfloat16/float16 have no portable MPI reduction (MPICH errors, Open MPI returns garbage): they travel as
  16-bit words and are reduced in float32 (see :func:`reduction_dtype`).
* ``requires_grad`` tensors cannot be exported by DLPack: communication never takes part in autograd
  (the differentiable collectives in ``loom.parallel`` wrap these calls in ``autograd.Function``s), so data
  is read through ``.detach()``.
* CUDA tensors go to MPI directly only when the MPI is CUDA-aware (``LOOM_CUDA_AWARE=1`` or detected);
  otherwise they are staged through host memory. A CUDA-aware MPI reads and writes device memory outside any
  stream's order, so before a device pointer is handed over, the work queued on the tensor's current stream
  (the kernels that produce it, or that still read a buffer a receive will overwrite) is waited for
  (:func:`device_ready`), as PyTorch's MPI backend synchronizes before it hands tensors to MPI.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import numpy as np
import torch
from mpi4py import MPI

from .. import settings

__all__ = [
    "Buffer",
    "as_bytes",
    "as_send",
    "mpi_dtype",
    "nbytes",
    "reduction_dtype",
    "empty_like_shape",
    "cuda_aware",
    "stage_out",
    "stage_in",
    "side_empty",
    "host_empty",
    "use_after",
    "copy_done",
    "wait_copy",
]

Buffer = torch.Tensor | np.ndarray

_fromaddress = MPI.buffer.fromaddress

# dtype -> MPI datatype used to *move* the data. 16-bit floats move as 16-bit words.
_TORCH_MPI: dict[torch.dtype, Any] = {
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_NUMPY_MPI: dict[np.dtype, Any] = {
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float16): MPI.UINT16_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint64): MPI.UINT64_T,
    np.dtype(np.uint32): MPI.UINT32_T,
    np.dtype(np.uint16): MPI.UINT16_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}
# dtypes that MPI cannot reduce portably: reduced in float32, then cast back.
_UPCAST = {torch.float16, torch.bfloat16, np.dtype(np.float16)}


def _detect_cuda_aware() -> bool:
    env = settings.get("cuda_aware")
    if env is not None:
        return env
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except MPI.Exception:
        return False


_CUDA_AWARE: bool | None = None


def cuda_aware() -> bool:
    """Whether CUDA tensors may be handed to MPI directly (else they are staged through host memory)."""
    global _CUDA_AWARE
    if _CUDA_AWARE is None:
        _CUDA_AWARE = _detect_cuda_aware()
    return _CUDA_AWARE


def mpi_dtype(x: Buffer) -> Any:
    """The MPI datatype loom uses to move ``x``; a clear ``TypeError`` for dtypes MPI cannot carry."""
    try:
        if isinstance(x, torch.Tensor):
            return _TORCH_MPI[x.dtype]
        return _NUMPY_MPI[x.dtype]
    except KeyError:
        known = sorted(str(d) for d in (_TORCH_MPI if isinstance(x, torch.Tensor) else _NUMPY_MPI))
        raise TypeError(
            f"dtype {x.dtype} cannot be sent by loom.comm; supported: {', '.join(known)}; "
            f"convert with .to(...) / .astype(...) first"
        ) from None


def is_floating(x: Buffer) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dtype.is_floating_point or x.dtype.is_complex
    return x.dtype.kind in "fc"


def nbytes(x: Buffer) -> int:
    """Payload size of ``x`` in bytes."""
    return x.nbytes


def reduction_dtype(x: Buffer):
    """The dtype a reduction of ``x`` runs in: float32 for 16-bit floats, else ``x``'s own."""
    if isinstance(x, torch.Tensor):
        return torch.float32 if x.dtype in _UPCAST else x.dtype
    return np.dtype(np.float32) if x.dtype in _UPCAST else x.dtype


# ------------------------------------------------------------------ staging CUDA tensors through the host
# For an MPI that is not CUDA-aware. Plan: device -> host copies go into pinned buffers that are reused across
# calls (a free list, each buffer back when the last Python reference to its host view dies, and not handed out
# again before the copies that still read it are done: its event), on a side stream that first waits for the
# tensor's stream (the kernels that produce it); host -> device copies of results run on that stream and the
# caller's stream waits for them on the device, not on the host. Casts (bf16 -> fp32 for a sum) happen on the
# device before staging. ``Communicator.allreduce`` pipelines large tensors piece by piece (``staged_allreduce``),
# and so do alltoall, allgather and reduce_scatter, a piece along every block (``staged_blocks``), and alltoallv,
# a piece along every row (``staged_rows``); one pipeline (``_pipeline``) runs them all.

STAGE_PIECE = 4 << 20
"""Bytes per piece of a pipelined staged collective (copy piece i+1 while MPI moves piece i)."""


class _Pinned:
    """A free list of pinned host buffers (uint8, power-of-two sizes), with the event each must wait for.

    Locked: a progress thread stages (takes) and drops results (gives, from a finalizer) while the training
    thread does the same; without the lock two threads could be handed one buffer. A give only appends to a
    queue (atomic, no lock) that the next take moves into the free list under the lock: gives come from
    finalizers, which a garbage collection can run on a thread that holds the lock already (an allocation inside
    it), and waiting for the lock there would never end."""

    KEEP = 16  # buffers kept at most: the smallest go first

    def __init__(self, alloc: Callable[[int], torch.Tensor] | None = None):
        self.free: list[tuple[torch.Tensor, Any]] = []
        self._given: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=True))
        self.allocated = 0  # buffers pinned so far (a steady state pins none): what tests of reuse read

    def take(self, nbytes: int) -> torch.Tensor:
        got = None
        with self._lock:
            while self._given:
                self.free.append(self._given.popleft())
            if len(self.free) > self.KEEP:
                self.free.sort(key=lambda be: be[0].numel())
                del self.free[:len(self.free) - self.KEEP]
            for i, be in enumerate(self.free):
                if be[0].numel() >= nbytes:
                    got = self.free.pop(i)
                    break
        if got is not None:
            buf, ev = got
            if ev is not None:
                ev.synchronize()  # a host -> device copy may still read it
            return buf
        self.allocated += 1
        return self._alloc(1 << max(12, (max(nbytes, 1) - 1).bit_length()))

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        self._given.append((buf, event))


_PINNED = _Pinned()
_STREAMS: dict[Any, Any] = {}
_PENDING: dict[int, Any] = {}  # id(pooled host view) -> event of the last copy that reads it, or None


def _side_stream(device: torch.device, which: int = 0):
    """The staging stream of ``device``: 0 carries device -> host copies, 1 host -> device (two copy engines)."""
    s = _STREAMS.get((device, which))
    if s is None:
        s = _STREAMS[(device, which)] = torch.cuda.Stream(device=device)
    return s


def staging(x: Any) -> bool:
    """True when ``x`` is a CUDA tensor that must travel through host memory (an MPI that is not CUDA-aware)."""
    return isinstance(x, torch.Tensor) and x.is_cuda and not cuda_aware()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of ``shape`` over a pooled pinned buffer; the buffer returns to the pool when the tensor
    (the last Python reference to this view) is gone."""
    import weakref

    n = 1
    for d in shape:
        n *= int(d)
    nbytes = n * torch.empty((), dtype=dtype, device="cpu").element_size()
    pool = _PINNED  # the buffer goes back to the pool it came from (a test may swap in a pool of host memory)
    buf = pool.take(nbytes)
    view = buf[:nbytes].view(dtype).reshape(shape)
    key = id(view)
    _PENDING[key] = None

    def back():
        pool.give(buf, _PENDING.pop(key, None))

    weakref.finalize(view, back)
    return view


def to_host(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (CUDA) copied into a pooled pinned host tensor (or ``out``), on the side stream after the work queued
    on ``x``'s stream; returns once the copy is done (MPI reads it next): :func:`stage_out`, waited for."""
    host, event = stage_out(x, out)
    wait_copy(event)
    return host


def to_device(host: torch.Tensor, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host result copied to ``device`` (into ``out`` when given) on the side stream; the caller's stream waits
    for the copy on the device (no host sync), and a pooled ``host`` is not reused before the copy is done."""
    dev = torch.empty(host.shape, dtype=host.dtype, device=device) if out is None else out
    side = _side_stream(dev.device, 1)
    cur = torch.cuda.current_stream(dev.device)
    side.wait_stream(cur)  # ``dev`` may have been in use on the caller's stream
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    cur.wait_event(ev)
    dev.record_stream(side)
    if id(host) in _PENDING:  # a pooled buffer: not handed out again before this copy has read it
        _PENDING[id(host)] = ev
    return dev


def stage_out(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """``x`` copied into a host tensor (``out``, or a pooled pinned one) without blocking the host: ``(host,
    event)``. On CUDA the copy is queued on the device's side stream after the work queued on the caller's
    stream (the kernels that produce ``x``) and ``event`` marks its end: MPI may read ``host`` once
    :func:`copy_done` says so (or after :func:`wait_copy`). A host ``x`` is copied at once (``event`` is
    ``None``), so the same code runs on a CPU-only machine, a copy where staging would copy.
    """
    x = x.detach()
    if not x.is_cuda:
        host = torch.empty(x.shape, dtype=x.dtype, device="cpu") if out is None else out
        host.copy_(x)
        return host, None
    host = pinned_empty(tuple(x.shape), x.dtype) if out is None else out
    side = _side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    x.record_stream(side)  # its memory is not handed out again before the copy has read it
    return host, ev


def copy_done(event: Any) -> bool:
    """Whether a copy queued by :func:`stage_out` / :func:`stage_in` has finished (never blocks)."""
    return event is None or bool(event.query())


def wait_copy(event: Any) -> None:
    """Block the host until a :func:`stage_out` copy has finished (MPI reads its host buffer next)."""
    if event is not None:
        event.synchronize()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor to stage data of ``device`` through: pooled pinned memory for a CUDA device (asynchronous
    copies need it), plain host memory otherwise."""
    if torch.device(device).type == "cuda":
        return pinned_empty(tuple(shape), dtype)
    return torch.empty(shape, dtype=dtype, device="cpu")


def side_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor on ``device`` that :func:`stage_in` may fill with ``fresh=True``: on CUDA it is allocated on
    the host -> device side stream, so its memory was last used (and freed) in that stream's order, and the copy
    into it need not wait for the caller's stream; :func:`use_after` then records the caller's uses."""
    if torch.device(device).type != "cuda":
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.stream(_side_stream(torch.device(device), 1)):
        return torch.empty(shape, dtype=dtype, device=device)


def stage_in(host: torch.Tensor, out: torch.Tensor, *, fresh: bool = False) -> Any:
    """Copy ``host`` into the device tensor ``out`` on the side stream and return the copy's event, without making
    any stream wait for it: the consumer calls :func:`use_after` where it first reads ``out``, so a prefetched
    copy overlaps the kernels queued meanwhile instead of ordering them all after it. ``fresh``: ``out`` came
    from :func:`side_empty` (nothing on the caller's stream uses it), so the copy does not wait for the caller's
    queued work either; otherwise it does (``out`` may still be read there). A pooled ``host`` is not handed out
    again before the copy has read it. A host ``out`` is filled at once (event ``None``)."""
    if not out.is_cuda:
        out.copy_(host)
        return None
    side = _side_stream(out.device, 1)
    if not fresh:
        side.wait_stream(torch.cuda.current_stream(out.device))
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(side)
    if not fresh:
        out.record_stream(side)
    if id(host) in _PENDING:
        _PENDING[id(host)] = ev
    return ev


def use_after(event: Any, out: torch.Tensor) -> None:
    """The caller's stream waits, on the device, for a :func:`stage_in` copy into ``out`` (no host sync), and
    ``out``'s memory is not reused before the work the caller queues from here on is done."""
    if event is not None:
        cur = torch.cuda.current_stream(out.device)
        cur.wait_event(event)
        out.record_stream(cur)


def _pipeline(dev: torch.device, src: torch.Tensor, res: torch.Tensor, cuts: list[tuple[int, int]],
              copy_out: Callable[[int, int], None], move: Callable[[int, int], None],
              copy_back: Callable[[int, int], None]) -> Any:
    """The stream plumbing of the pipelined staged collectives, over pieces ``cuts`` (``(lo, hi)`` each).

    Every ``copy_out(lo, hi)`` (device -> pinned host) is queued on side stream 0, after the caller's stream (the
    kernels that produce ``src``), with an event each; then per piece: the host waits for its event,
    ``move(lo, hi)`` runs the MPI call on pinned memory, and ``copy_back(lo, hi)`` (host -> device, into ``res``)
    is queued on side stream 1, so piece i+1 crosses the bus while MPI moves piece i and results flow back
    meanwhile. The caller's stream waits for the last copy back on the device, not on the host; ``src`` and
    ``res`` are not reused before their side stream is done with them. Returns that last event: a pinned buffer
    the copies back read must not be reused before it.
    """
    d2h, h2d, cur = _side_stream(dev, 0), _side_stream(dev, 1), torch.cuda.current_stream(dev)
    d2h.wait_stream(cur)
    h2d.wait_stream(cur)
    ready = []
    with torch.cuda.stream(d2h):
        for lo, hi in cuts:
            copy_out(lo, hi)
            ev = torch.cuda.Event()
            ev.record(d2h)
            ready.append(ev)
    for ev, (lo, hi) in zip(ready, cuts):
        ev.synchronize()
        move(lo, hi)
        with torch.cuda.stream(h2d):
            copy_back(lo, hi)
    with torch.cuda.stream(h2d):
        done = torch.cuda.Event()
        done.record(h2d)
    cur.wait_event(done)
    src.record_stream(d2h)
    res.record_stream(h2d)
    return done


def staged_allreduce(mpi_comm: Any, x: torch.Tensor, mop: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Allreduce a CUDA tensor through host memory in pipelined pieces; returns ``(result in the reduction dtype on
    the device, the pinned host buffer)``.

    Plan: cast on the device to the reduction dtype (bf16/fp16 widened to fp32 there, not on the host); pieces of
    ``STAGE_PIECE`` bytes through :func:`_pipeline`: each piece's device -> host copy queued on stream 0, then per
    piece ``MPI_Allreduce`` in place in the pinned buffer once its copy is done and its host -> device copy queued
    on stream 1. The caller's stream waits for the last copy on the device; the pinned buffer is not reused
    before it.
    """
    dev = x.device
    rdt = reduction_dtype(x)
    flat = x.detach().to(rdt).reshape(-1).contiguous()
    n = flat.numel()
    piece = max(1, STAGE_PIECE // max(flat.element_size(), 1))
    host = pinned_empty((n,), rdt)
    res = torch.empty_like(flat)
    mt = _TORCH_MPI[rdt]

    def copy_out(lo: int, hi: int) -> None:
        host[lo:hi].copy_(flat[lo:hi], non_blocking=True)

    def move(lo: int, hi: int) -> None:
        hp = host[lo:hi]
        mpi_comm.Allreduce(MPI.IN_PLACE, [_fromaddress(hp.data_ptr(), hp.nbytes), mt], mop)

    def copy_back(lo: int, hi: int) -> None:
        res[lo:hi].copy_(host[lo:hi], non_blocking=True)

    cuts = [(lo, min(lo + piece, n)) for lo in range(0, n, piece)]
    _PENDING[id(host)] = _pipeline(dev, flat, res, cuts, copy_out, move, copy_back)
    return res.view(x.shape), host


def staged_blocks(mpi_comm: Any, x: torch.Tensor, kind: str, mop: Any = None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block collective (``kind``: ``alltoall``, ``allgather`` or ``reduce_scatter``) of a CUDA tensor through
    host memory in pipelined pieces; returns ``(result as [rows, m] on the device, the pinned receive buffer)``.

    Layout: over ``p`` ranks the data is ``[p, m]`` blocks, block j of dim 0 to or from rank j (allgather's input
    is one block ``[1, m]``, reduce_scatter's output too). Piece k is columns ``[k q, (k+1) q)``
    of *every* block, so each piece is itself a valid alltoall / allgather / reduce_scatter_block of ``[rows, w]``
    blocks (a piece cut along dim 0 would not be: it would hold whole blocks for some ranks and none for the
    others). ``q`` makes the larger side of a piece ``STAGE_PIECE`` bytes; the last piece is shorter.

    Plan, as :func:`staged_allreduce` (the streams and events of :func:`_pipeline`): cast on the device
    (reduce_scatter widens bf16/fp16 to fp32 there, as a sum needs; alltoall and allgather move the bytes as they
    are); each piece's device -> host copy, strided piece into its contiguous ``[rows, w]`` slot of one pinned send
    buffer, queued on stream 0; per piece, once its copy is done, the MPI collective (``MPI_Alltoall``,
    ``MPI_Allgather`` or ``MPI_Reduce_scatter_block``) from its pinned slot into its slot of one pinned receive
    buffer, and its host -> device copy into the strided piece of the result queued on stream 1, so piece k+1
    crosses the bus while MPI moves piece k. The caller's stream waits for the last copy on the device; the
    pinned receive buffer is not reused before it (the send buffer's copies are done when the last MPI call is).

    Args:
        mpi_comm: the mpi4py communicator.
        x: the CUDA tensor; its elements in dim-0 order are the send side's ``[rows, m]`` blocks.
        kind: ``"alltoall"``, ``"allgather"`` or ``"reduce_scatter"``.
        mop: the MPI reduction op (reduce_scatter).
        out: a contiguous tensor on ``x``'s device, of the result's dtype and size, to receive into.
    """
    p = mpi_comm.Get_size()
    rows_in, rows_out = {"alltoall": (p, p), "allgather": (1, p), "reduce_scatter": (p, 1)}[kind]
    dev = x.device
    dt = reduction_dtype(x) if kind == "reduce_scatter" else x.dtype
    m = x.numel() // rows_in
    src = x.detach().to(dt).reshape(rows_in, m)
    res = torch.empty((rows_out, m), dtype=dt, device=dev) if out is None else out.view(rows_out, m)
    es = src.element_size()
    q = max(1, STAGE_PIECE // (p * es))
    cuts = [(lo, min(lo + q, m)) for lo in range(0, m, q)]
    hin, hout = pinned_empty((rows_in * m,), dt), pinned_empty((rows_out * m,), dt)
    # Only the reduction needs an element type: alltoall and allgather move bytes, so they carry any dtype
    # (uint16, float8, ...) as the host path does, not only the MPI-typed ones.
    mt = _TORCH_MPI[dt] if kind == "reduce_scatter" else None

    def copy_out(lo: int, hi: int) -> None:
        hin[rows_in * lo:rows_in * hi].view(rows_in, hi - lo).copy_(src[:, lo:hi], non_blocking=True)

    def move(lo: int, hi: int) -> None:
        a, b = hin[rows_in * lo:rows_in * hi], hout[rows_out * lo:rows_out * hi]
        sa, sb = _fromaddress(a.data_ptr(), a.nbytes), _fromaddress(b.data_ptr(), b.nbytes)
        if kind == "alltoall":
            mpi_comm.Alltoall([sa, _BYTE], [sb, _BYTE])
        elif kind == "allgather":
            mpi_comm.Allgather([sa, _BYTE], [sb, _BYTE])
        else:
            mpi_comm.Reduce_scatter_block([sa, mt], [sb, mt], mop)

    def copy_back(lo: int, hi: int) -> None:
        res[:, lo:hi].copy_(hout[rows_out * lo:rows_out * hi].view(rows_out, hi - lo), non_blocking=True)

    _PENDING[id(hout)] = _pipeline(dev, src, res, cuts, copy_out, move, copy_back)
    return res, hout


def staged_rows(mpi_comm: Any, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An alltoallv of a CUDA tensor's rows (dim 0: ``send_rows[j]`` rows to rank j, ``recv_rows[j]`` from it)
    through host memory in pipelined pieces; returns ``(the received rows as [sum(recv_rows), d] on the device,
    the pinned receive buffer)``, ``d`` being the elements of one row.

    Layout: piece k is elements ``[k q, (k+1) q)`` of *every* row, so each piece is itself an alltoallv of the
    same row counts, ``q`` elements wide (cut along dim 0 it would need counts of its own per rank). ``q`` makes
    the larger side of a piece ``STAGE_PIECE`` bytes; a tensor of one element per row is one piece.

    Plan (the streams and events of :func:`_pipeline`; bytes moved as they are, any dtype): each piece's strided
    rows copied device -> host into its contiguous ``[rows, q]`` slot of one pinned send buffer on stream 0; per
    piece, once its copy is done, ``MPI_Alltoallv`` of that slot (counts and displacements in bytes: rows times
    the piece's row width) into its slot of one pinned receive buffer, and its host -> device copy into the
    strided piece of the result queued on stream 1. The caller's stream waits for the last copy on the device.
    """
    n, m = int(sum(send_rows)), int(sum(recv_rows))
    d = 1
    for k in x.shape[1:]:
        d *= int(k)
    dev = x.device
    src = x.detach().reshape(n, d)
    res = torch.empty((m, d), dtype=x.dtype, device=dev)
    es = src.element_size()
    q = max(1, STAGE_PIECE // (max(n, m, 1) * es))
    cuts = [(lo, min(lo + q, d)) for lo in range(0, d, q)]
    hin, hout = pinned_empty((n * d,), x.dtype), pinned_empty((m * d,), x.dtype)

    def copy_out(lo: int, hi: int) -> None:
        hin[n * lo:n * hi].view(n, hi - lo).copy_(src[:, lo:hi], non_blocking=True)

    def move(lo: int, hi: int) -> None:
        a, b = hin[n * lo:n * hi], hout[m * lo:m * hi]
        row = (hi - lo) * es
        ss, rs = [c * row for c in send_rows], [c * row for c in recv_rows]
        sd, rd = [sum(ss[:j]) for j in range(len(ss))], [sum(rs[:j]) for j in range(len(rs))]
        mpi_comm.Alltoallv([_fromaddress(a.data_ptr(), a.nbytes), ss, sd, _BYTE],
                           [_fromaddress(b.data_ptr(), b.nbytes), rs, rd, _BYTE])

    def copy_back(lo: int, hi: int) -> None:
        res[:, lo:hi].copy_(hout[m * lo:m * hi].view(m, hi - lo), non_blocking=True)

    _PENDING[id(hout)] = _pipeline(dev, src, res, cuts, copy_out, move, copy_back)
    return res, hout


def plain(x: torch.Tensor) -> bool:
    """``x``'s memory, read in order, is its values: contiguous and without a lazy conjugate or negative bit
    (``z.conj()``, ``z.conj().imag``), whose raw bytes are the values before the lazy operation. Only a plain
    tensor may be handed to MPI by address."""
    return x.is_contiguous() and not x.is_conj() and not x.is_neg()


def host_view(x: Buffer) -> Buffer:
    """A contiguous host (CPU) version of ``x`` for reading, without autograd history, lazy conjugate and
    negative bits resolved. Zero-copy when possible; a CUDA tensor without a CUDA-aware MPI is staged into a
    pooled pinned buffer (:func:`to_host`)."""
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            x = x.detach()
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        if x.device.type == "cuda":
            if not cuda_aware():
                return to_host(x)
        elif x.device.type != "cpu":
            x = x.to("cpu")
        if not x.is_contiguous():
            x = x.contiguous()
        return x
    if not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    return x


_BYTE = MPI.BYTE


def device_ready(x: torch.Tensor) -> None:
    """Block until the work queued on ``x``'s device's current stream is done: ``x`` is then complete (and
    no queued kernel still reads it) when MPI touches its memory directly."""
    torch.cuda.current_stream(x.device).synchronize()


def as_bytes(x: Buffer) -> list:
    """``[buffer, MPI.BYTE]`` over ``x``'s bytes: how every non-reducing operation moves data.

    Moving raw bytes makes every dtype (bf16, fp16, bool, complex) travel the same way and keeps the spec
    cheap; only reductions need the element type (:func:`as_send`). Same preconditions as :func:`as_send`.
    """
    if isinstance(x, torch.Tensor):
        if x.is_cuda:
            device_ready(x)
            return [x.reshape(-1).view(torch.uint8), _BYTE]
        return [_fromaddress(x.data_ptr(), x.nbytes), _BYTE]
    return [x, _BYTE]


_T_RED = {k: v for k, v in _TORCH_MPI.items() if k not in _UPCAST}
_NP_RED = {k: v for k, v in _NUMPY_MPI.items() if k not in _UPCAST}


def fast_typed(x: Buffer) -> list | None:
    """Typed spec for the common case (contiguous CPU buffer of an MPI-reducible dtype), else ``None``."""
    t = type(x)
    if t is np.ndarray:
        if x.flags.c_contiguous and x.flags.writeable:
            mt = _NP_RED.get(x.dtype)
            if mt is not None:
                return [x, mt]
    elif t is torch.Tensor and x.is_cpu and not x.requires_grad and plain(x):
        mt = _T_RED.get(x.dtype)
        if mt is not None:
            return [_fromaddress(x.data_ptr(), x.nbytes), mt]
    return None


def as_send(x: Buffer) -> list:
    """``[buffer, datatype]`` (typed, for reductions) over ``x``; the caller keeps ``x`` alive until MPI is done.

    ``x`` must already be a host view (:func:`host_view`) when it may be non-contiguous, on a device or
    require grad; the fast paths below assume a contiguous CPU buffer.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type == "cuda":
            # CUDA-aware MPI: mpi4py understands __cuda_array_interface__ / DLPack for device memory.
            device_ready(x)
            return [x, _TORCH_MPI[x.dtype]]
        return [_fromaddress(x.data_ptr(), x.nbytes), _TORCH_MPI[x.dtype]]
    return [x, _NUMPY_MPI[x.dtype]]


def empty_like_shape(x: Buffer, shape: tuple[int, ...], *, device=None) -> Buffer:
    """A new contiguous buffer of the same kind and dtype as ``x`` with ``shape`` (pooled pinned memory when ``x``
    is a staged host view: the result goes back to the device too)."""
    if isinstance(x, torch.Tensor):
        if device is None and x.is_cpu and x.is_pinned():
            return pinned_empty(shape, x.dtype)
        return torch.empty(shape, dtype=x.dtype, device=device if device is not None else x.device)
    return np.empty(shape, dtype=x.dtype)


def recv_target(out: Buffer) -> Buffer:
    """A buffer MPI may write into directly for ``out``: ``out`` itself when contiguous and reachable."""
    if isinstance(out, torch.Tensor):
        if out.requires_grad and out.is_leaf:
            raise ValueError(
                "cannot receive into a tensor that requires grad (an in-place write to an autograd leaf); "
                "receive into a plain tensor and wrap it, or use the differentiable ops in loom.parallel"
            )
        if out.device.type == "cuda" and not cuda_aware():
            return pinned_empty(tuple(out.shape), out.dtype)
        if out.device.type != "cpu" and out.device.type != "cuda":
            return torch.empty(out.shape, dtype=out.dtype, device="cpu")
        if not plain(out):  # MPI writes raw memory: a conjugate-bit view would read it back conjugated
            return torch.empty(out.shape, dtype=out.dtype, device=out.device)
        return out
    if not out.flags.c_contiguous or not out.flags.writeable:
        if not out.flags.writeable:
            raise ValueError("cannot receive into a read-only numpy array; pass a writeable array")
        return np.empty(out.shape, dtype=out.dtype)
    return out


def direct_target(out: Buffer, like: Buffer) -> bool:
    """True when MPI may write straight into ``out`` for a result shaped and typed like ``like``'s host view."""
    if type(out) is not type(like) or out.dtype != like.dtype:
        return False
    if isinstance(out, torch.Tensor):
        return plain(out) and out.device == like.device and not (out.requires_grad and out.is_leaf)
    return out.flags.c_contiguous and out.flags.writeable


def finish_recv(out: Buffer, tmp: Buffer) -> Buffer:
    """Copy a temporary receive buffer back into ``out`` when :func:`recv_target` had to use one."""
    if tmp is not out:
        if isinstance(out, torch.Tensor):
            if out.is_cuda and not tmp.is_cuda:
                to_device(tmp, out.device, out=out) if plain(out) else out.copy_(tmp)
            else:
                out.copy_(tmp)
        else:
            out[...] = tmp
    return out


def cast(x: Buffer, dtype) -> Buffer:
    """``x`` in ``dtype`` (torch or numpy), a no-op when already so."""
    if isinstance(x, torch.Tensor):
        return x if x.dtype == dtype else x.to(dtype)
    return x if x.dtype == dtype else x.astype(dtype)
