"""``Communicator``: loom's one door to MPI.

Vocabulary (fixed here for all of loom): a *rank* is an MPI process; an *axis* is a named dimension of a
:class:`~loom.comm.mesh.Mesh` (``dp``, ``pp``, ``sp``, ``tp``, ``ep``); a *dim* is a tensor dimension.
Tensor operations follow ``torch.distributed``'s names (lowercase ``send``/``allreduce`` move tensors and
numpy arrays); operations on picklable Python objects end in ``_object``.

Every operation accepts torch tensors (CPU; CUDA through CUDA-aware MPI or staged through the host) and
numpy arrays, and returns the same kind it was given. Collectives split and concatenate along dim 0.

Byte accounting: each call adds to ``comm.bytes_sent[op]`` the payload bytes *this rank* puts on the wire
under a bandwidth-optimal algorithm (so that numbers compare across implementations):

==================  ======================================================
send / isend        n
bcast               n on the root, 0 elsewhere (a tree sends n per edge; P-1 edges in all)
allreduce           2 n (P-1)/P   (reduce-scatter + allgather)
reduce_scatter      n (P-1)/P
allgather           n (P-1)       (n = this rank's piece)
alltoall(v)         bytes addressed to other ranks
==================  ======================================================

``loom.comm.stats()`` returns these counters for every communicator by name, so per-mesh-axis traffic is
``stats()["dp"]``.

Tags: the MPI standard guarantees tags up to 32767 only; ``MPI_TAG_UB`` says what the running MPI allows
(MPICH 2^31-1, Open MPI over ob1 2^31-1, over UCX 2^23-1). :attr:`Communicator.tag_ub` reads it (lowered by
``LOOM_TAG_UB`` for tests), and every subsystem that numbers its own tags checks its largest one against it with
:meth:`Communicator.require_tags` when it starts, so a too-small tag space is a clear error instead of
``MPI_ERR_TAG`` at the first message. :meth:`Communicator.sub` gives each subsystem its own duplicate, so two
subsystems numbering tags from 0 never match each other's messages.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Sequence

import numpy as np
import torch
from mpi4py import MPI

from .. import settings
from .. import stats as _stats
from . import buffers as _b
from . import safety as _safety
from .deadline import Deadline
from .errors import CommError
from .progress import Request

__all__ = ["Communicator", "world", "stats", "reset_stats", "tag_ub", "ANY_SOURCE", "ANY_TAG", "REDUCE_OPS",
           "MIN_TAG_UB"]

ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG

REDUCE_OPS: dict[str, Any] = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD, "avg": MPI.SUM}
_FAST_OPS = {k: v for k, v in REDUCE_OPS.items() if k != "avg"}

_as_send = _b.as_send
_as_bytes = _b.as_bytes
_host_view = _b.host_view
_fromaddress = MPI.buffer.fromaddress
_BYTE = MPI.BYTE
_IN_PLACE = MPI.IN_PLACE
_T_RED = _b._T_RED  # torch dtype -> MPI datatype, for the dtypes MPI reduces natively (not bf16/fp16)
_clock = time.perf_counter
_Tensor = torch.Tensor
_ndarray = np.ndarray


MIN_TAG_UB = 32767  # the MPI standard's guaranteed minimum for MPI_TAG_UB
_TAG_UB: int | None = None


def _forced_tag_ub() -> int | None:
    """``LOOM_TAG_UB``: a lower tag ceiling than the MPI's, to run the checks as under a smaller MPI."""
    return settings.get("tag_ub")


def tag_ub() -> int:
    """The largest tag this process may use: the MPI's ``MPI_TAG_UB`` (read from COMM_WORLD, where the standard
    puts it; every communicator shares it), lowered to ``LOOM_TAG_UB`` when that is set and smaller."""
    global _TAG_UB
    if _TAG_UB is None:
        value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        value = MIN_TAG_UB if value is None else int(value)
        forced = _forced_tag_ub()
        _TAG_UB = value if forced is None else min(value, forced)
    return _TAG_UB


def _op(op: str):
    try:
        return REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(REDUCE_OPS)}") from None


def _check_dim0(x, what: str) -> None:
    if x.ndim == 0:
        raise ValueError(f"{what} needs a tensor with at least one dim (it splits along dim 0); got a scalar. "
                         f"Use x.reshape(1) first")


def _to_device(x, like):
    """Move a host result back to ``like``'s device when ``like`` was a staged CUDA tensor. Reductions move first
    and cast after, so a 16-bit result is narrowed on the device and its pooled pinned buffer is what crosses the
    bus (an asynchronous copy; casting on the host first made a pageable copy and a host-side cast)."""
    if isinstance(like, _Tensor) and isinstance(x, _Tensor) and x.device != like.device:
        return _b.to_device(x, like.device) if like.is_cuda else x.to(like.device)
    return x


def _reducible(tensor):
    """``(x, xin)``: what the reduction reads (``x``: the host view, or a staged CUDA tensor itself, for its dtype,
    shape and bytes) and its host buffer in the reduction dtype; a staged 16-bit float is widened on the device."""
    if _b.staging(tensor):
        x = tensor.detach()
        return x, _host_view(x.to(_b.reduction_dtype(x)))
    x = _host_view(tensor)
    return x, _b.cast(x, _b.reduction_dtype(x))


def _row_bytes(x) -> int:
    """Bytes per index of dim 0."""
    n0 = x.shape[0]
    if n0:
        return x.nbytes // n0
    inner = 1
    for d in x.shape[1:]:
        inner *= int(d)
    return inner * (x.element_size() if isinstance(x, _Tensor) else x.itemsize)


def _displs(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for n in sizes:
        out.append(acc)
        acc += n
    return out


_PAIRWISE_MIN: int | None = None  # LOOM_PAIRWISE_BYTES, read once (a settings read costs a 1-byte allreduce 25%)
_PAIRWISE_DTYPES = {torch.float64, torch.float32, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
_PAIRWISE_NP = {np.dtype(d) for d in (np.float64, np.float32, np.int64, np.int32, np.int16, np.int8, np.uint8)}
_FOLD = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}


def _pairwise_min() -> int:
    global _PAIRWISE_MIN
    if _PAIRWISE_MIN is None:
        _PAIRWISE_MIN = settings.get("pairwise_bytes")
    return _PAIRWISE_MIN


def _pairwise_view(x) -> torch.Tensor | None:
    """``x`` as a flat CPU tensor sharing its memory, when the pairwise reduction can take it (contiguous, writable,
    no autograd, a dtype torch and MPI reduce alike), else ``None``."""
    t = type(x)
    if t is _Tensor:
        if x.is_cpu and not x.requires_grad and _b.plain(x) and x.dtype in _PAIRWISE_DTYPES:
            return x.view(-1)
    elif t is _ndarray and x.flags.c_contiguous and x.flags.writeable and x.dtype in _PAIRWISE_NP:
        return torch.from_numpy(x.reshape(-1))
    return None


def _span(x: torch.Tensor, counts: list[int], es: int) -> list:
    """``[buffer, byte counts, byte displacements, BYTE]`` over flat ``x`` cut into blocks of ``counts`` elements."""
    return [_fromaddress(x.data_ptr(), x.nbytes), [c * es for c in counts], [d * es for d in _displs(counts)],
            _BYTE]


class Communicator:
    """A group of ranks that communicate: an mpi4py intracommunicator plus loom's safety and accounting.

    Args:
        mpi_comm: the mpi4py intracommunicator to wrap (not duplicated; use :meth:`dup` for isolation).
        name: label for byte accounting and error messages (a mesh axis name, ``"world"``, ...).
    """

    __slots__ = ("mpi", "name", "rank", "size", "bytes_sent", "_vcache", "_subs", "_inbox", "__weakref__")

    def __init__(self, mpi_comm: MPI.Intracomm, *, name: str = "world"):
        if not isinstance(mpi_comm, MPI.Intracomm):
            raise TypeError(f"Communicator wraps an mpi4py Intracomm, got {type(mpi_comm).__name__}")
        self.mpi = mpi_comm
        self.name = name
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        # the registry's live dict: every communicator of this name counts into one place (loom.stats)
        self.bytes_sent: dict[str, int] = _stats.counters("comm", name)
        self._vcache: dict[tuple, tuple] = {}
        self._subs: dict[str, Communicator] = {}
        # The pairwise reductions' receive buffer, kept: a fresh one per call faults in every page (a 64 MiB
        # allreduce's 32 MiB inbox: several ms).
        self._inbox = torch.empty(0, dtype=torch.uint8, device="cpu")

    def __repr__(self) -> str:
        return f"Communicator(name={self.name!r}, rank={self.rank}, size={self.size})"

    def rename(self, name: str) -> None:
        """Count this communicator's bytes under ``name`` from now on (a group named after it was made)."""
        self.name = name
        self.bytes_sent = _stats.counters("comm", name)
        if isinstance(self.mpi, Deadline):
            self.mpi.name = name

    def _count(self, op: str, n: int) -> None:
        d = self.bytes_sent
        d[op] = d.get(op, 0) + n

    # ------------------------------------------------------------------ point-to-point
    # send/recv keep a fast path for the common case (contiguous CPU buffer; a receive also needs no autograd):
    # at 1 byte loom's cost over raw mpi4py is these few lines, and each read of a torch tensor's attribute
    # costs about as much as a numpy array's whole check (`loom bench latency --buffer torch --vs raw-numpy`),
    # so the send reads each one once (a send only reads: requires_grad does not matter to it).
    def send(self, tensor: _b.Buffer, dest: int, tag: int = 0) -> None:
        """Send a tensor/array to ``dest`` (blocking until the buffer may be reused)."""
        t = type(tensor)
        if t is _ndarray and tensor.flags.c_contiguous:
            self.mpi.Send([tensor, _BYTE], dest, tag)
            n = tensor.nbytes
        elif t is _Tensor and tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            n = tensor.nbytes
            self.mpi.Send([_fromaddress(tensor.data_ptr(), n), _BYTE], dest, tag)
        else:
            tensor = _host_view(tensor)
            self.mpi.Send(_as_bytes(tensor), dest, tag)
            n = tensor.nbytes
        d = self.bytes_sent
        d["send"] = d.get("send", 0) + n

    def recv(self, out: _b.Buffer, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> _b.Buffer:
        """Receive into ``out`` (its shape and dtype say what to expect) and return it."""
        t = type(out)
        if t is _ndarray and out.flags.c_contiguous and out.flags.writeable:
            self.mpi.Recv([out, _BYTE], source, tag)
            return out
        if t is _Tensor and out.is_cpu and not out.requires_grad and out.is_contiguous() \
                and not (out.is_conj() or out.is_neg()):
            self.mpi.Recv([_fromaddress(out.data_ptr(), out.nbytes), _BYTE], source, tag)
            return out
        tmp = _b.recv_target(out)
        self.mpi.Recv(_as_bytes(tmp), source, tag)
        return _b.finish_recv(out, tmp)

    def isend(self, tensor: _b.Buffer, dest: int, tag: int = 0) -> Request:
        """Non-blocking send; ``tensor`` must not be modified until the request completes."""
        if type(tensor) is _ndarray and tensor.flags.c_contiguous:  # fast path (the Dask backend's headers)
            req = self.mpi.Isend([tensor, _BYTE], dest, tag)
            d = self.bytes_sent
            d["send"] = d.get("send", 0) + tensor.nbytes
            return Request([req], keep=tensor, what=("isend to", dest, self.name))
        x = _host_view(tensor)
        req = self.mpi.Isend(_as_bytes(x), dest, tag)
        self._count("send", x.nbytes)
        return Request([req], keep=x, what=("isend to", dest, self.name))

    def isend_eager(self, buf: "bytes | np.ndarray", dest: int, tag: int = 0) -> "Request | None":
        """Post a send of ``bytes`` or a contiguous uint8 numpy array and test it once: ``None`` when it already
        completed (MPI copied a small message out eagerly; the usual case), else the pending :class:`Request`.

        The cheapest send loom has (no request object when none is needed): for the Dask backend's small
        messages, whose latency is mostly Python.
        """
        req = self.mpi.Isend([buf, _BYTE], dest, tag)
        d = self.bytes_sent
        d["send"] = d.get("send", 0) + len(buf)
        if req.Test():
            return None
        return Request([req], keep=buf, what=("isend to", dest, self.name))

    def try_recv(self, source: int, tag: int, limit: int, spin_s: float = 0.0) -> "bytearray | Message | None":
        """Match the next message from ``source`` on ``tag`` (``MPI_Improbe``) without blocking: ``None`` when
        none is waiting; a new ``bytearray`` holding it when it is at most ``limit`` bytes (received at once,
        ``MPI_Mrecv``: such a message travelled eagerly); else the :class:`Message`, to receive with ``irecv``.

        ``spin_s``: keep probing for up to that many seconds before giving up, in a loop of nothing but the probe
        and a clock read (more probes per second than a Python poll loop makes: a message is seen sooner after it
        lands); the calling thread does nothing else meanwhile.
        """
        status = MPI.Status()
        improbe = self.mpi.Improbe
        msg = improbe(source, tag, status)
        if msg is None:
            if spin_s <= 0:
                return None
            clock = _clock
            end = clock() + spin_s
            while msg is None:
                if clock() >= end:
                    return None
                msg = improbe(source, tag, status)
        n = status.Get_count(MPI.BYTE)
        if n <= limit:
            out = bytearray(n)  # cheaper to make and to index than a small numpy array
            msg.Recv([out, _BYTE])
            return out
        return Message(msg, status.Get_source(), status.Get_tag(), n, self.name)

    def irecv(self, out: _b.Buffer, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Non-blocking receive into ``out``; ``request.wait()`` returns ``out``."""
        tmp = _b.recv_target(out)
        req = self.mpi.Irecv(_as_bytes(tmp), source, tag)
        if tmp is out:
            return Request([req], keep=tmp, finish=lambda: out, what=("irecv from", source, self.name))
        return Request([req], keep=tmp, finish=lambda: _b.finish_recv(out, tmp),
                       what=("irecv from", source, self.name))

    def sendrecv(self, tensor: _b.Buffer, dest: int, out: _b.Buffer, source: int, tag: int = 0) -> _b.Buffer:
        """Send ``tensor`` to ``dest`` while receiving ``out`` from ``source`` (deadlock-free exchange)."""
        x = _host_view(tensor)
        tmp = _b.recv_target(out)
        self.mpi.Sendrecv(_as_bytes(x), dest, tag, _as_bytes(tmp), source, tag)
        self._count("send", x.nbytes)
        return _b.finish_recv(out, tmp)

    def improbe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> "Message | None":
        """Match a pending message without receiving it (``MPI_Improbe``); ``None`` when none is waiting.

        For messages of unknown size (the Dask backend's headers): the returned :class:`Message` knows its
        ``source``, ``tag`` and ``nbytes``, and only ``Message.recv``/``irecv`` can receive it, so another
        thread probing the same source and tag cannot steal it.
        """
        status = MPI.Status()
        msg = self.mpi.Improbe(source, tag, status)
        if msg is None:
            return None
        return Message(msg, status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE), self.name)

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        self.mpi.Barrier()

    def bcast(self, tensor: _b.Buffer, root: int = 0) -> _b.Buffer:
        """Broadcast ``tensor`` from ``root`` in place (every rank passes a buffer of the same shape)."""
        if self.rank == root:
            x = _host_view(tensor)
            self.mpi.Bcast(_as_bytes(x), root)
            self._count("bcast", _b.nbytes(x))
            return tensor
        tmp = _b.recv_target(tensor)
        self.mpi.Bcast(_as_bytes(tmp), root)
        return _b.finish_recv(tensor, tmp)

    def allreduce(self, tensor: _b.Buffer, op: str = "sum", *, out: _b.Buffer | None = None) -> _b.Buffer:
        """Element-wise reduction across ranks; returns a new tensor (or ``out``), the same on every rank.

        ``op`` is ``sum``, ``max``, ``min``, ``prod`` or ``avg`` (sum / size, floating dtypes only).
        16-bit floats are reduced in float32 and cast back (MPI has no portable bf16/fp16 sum).
        ``out`` (same shape and dtype; may be ``tensor`` itself) avoids allocating the result.
        """
        # Fastest path, in place on a plain CPU tensor of an MPI-reducible dtype below the block exchange (a
        # 1-byte allreduce through the torch backend is mostly these lines: `loom bench torch --only latency`)
        if out is tensor and type(tensor) is _Tensor and tensor.is_cpu and not tensor.requires_grad \
                and (mt := _T_RED.get(tensor.dtype)) is not None and (mop := _FAST_OPS.get(op)) is not None \
                and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            n = tensor.nbytes
            if n < (_PAIRWISE_MIN or _pairwise_min()) or self.size == 1:
                self.mpi.Allreduce(_IN_PLACE, [_fromaddress(tensor.data_ptr(), n), mt], mop)
                d = self.bytes_sent
                d["allreduce"] = d.get("allreduce", 0) + 2 * n * (self.size - 1) // self.size
                return tensor
        mop = _op(op)
        if op == "avg" and not _b.is_floating(tensor):
            raise TypeError(f"allreduce op 'avg' needs a floating dtype, got {tensor.dtype}; use op='sum' "
                            f"and divide, or cast with .to(torch.float32)")
        if out is not None and tuple(out.shape) != tuple(tensor.shape):
            raise ValueError(f"allreduce: out has shape {tuple(out.shape)} but the input has "
                             f"{tuple(tensor.shape)}; pass an out of the same shape (or none)")
        if self.size > 1 and tensor.nbytes >= _pairwise_min() \
                and (res := self._pairwise_allreduce(tensor, op, out)) is not None:
            return res
        # Fast path: contiguous CPU buffers of an MPI-reducible dtype, no staging, no casts.
        if op != "avg" and (sin := _b.fast_typed(tensor)) is not None:
            res = out if out is not None and type(out) is type(tensor) and out.dtype == tensor.dtype else None
            if res is None and out is None:
                res = (np.empty(tensor.shape, tensor.dtype) if type(tensor) is _ndarray
                       else torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu"))
            sout = _b.fast_typed(res) if res is not None else None
            if sout is not None:
                if res is tensor:
                    self.mpi.Allreduce(MPI.IN_PLACE, sout, mop)
                else:
                    self.mpi.Allreduce(sin, sout, mop)
                d = self.bytes_sent
                d["allreduce"] = d.get("allreduce", 0) + 2 * tensor.nbytes * (self.size - 1) // self.size
                return res
        if _b.staging(tensor):  # a CUDA tensor, an MPI that is not CUDA-aware: pipelined through pinned memory
            res, _host = _b.staged_allreduce(self.mpi, tensor, mop)
            self._count("allreduce", 2 * _b.nbytes(tensor) * (self.size - 1) // max(self.size, 1))
            if op == "avg":
                res /= self.size
            res = res.to(tensor.dtype)
            if out is None:
                return res
            out.copy_(res)
            return out
        x = _host_view(tensor)
        rdt = _b.reduction_dtype(x)
        xin = _b.cast(x, rdt)
        direct = (out is not None and xin is x and tuple(out.shape) == tuple(x.shape)
                  and _b.direct_target(out, x))
        res = out if direct else _b.empty_like_shape(xin, tuple(xin.shape))
        if res is tensor and direct:
            self.mpi.Allreduce(MPI.IN_PLACE, _as_send(res), mop)
        else:
            self.mpi.Allreduce(_as_send(xin), _as_send(res), mop)
        self._count("allreduce", 2 * _b.nbytes(x) * (self.size - 1) // max(self.size, 1))
        if op == "avg":
            res /= self.size
        if direct:
            return out
        res = _b.cast(_to_device(res, tensor), x.dtype)
        return res if out is None else _b.finish_recv(out, res)

    def pairwise(self, tensor: _b.Buffer) -> bool:
        """Whether :meth:`allreduce` of ``tensor`` exchanges blocks and folds them with torch (at least
        ``LOOM_PAIRWISE_BYTES``, contiguous, on the host, a dtype torch and MPI reduce alike, 2 ranks or more)."""
        return self.size > 1 and tensor.nbytes >= _pairwise_min() and _pairwise_view(tensor) is not None

    def _pairwise(self, src: torch.Tensor, counts: list[int], dst: torch.Tensor, op: str) -> None:
        """Reduce block ``rank`` of flat ``src`` (cut into blocks of ``counts`` elements) across ranks into ``dst``.

        Each rank sends block j to rank j (one ``MPI_Alltoallv`` of bytes) and the owner folds the contributions
        with torch in rank order, ``((x0 op x1) op x2) ...`` in the tensor's dtype: vectorized, where MPI's own
        reduction loop is not, and the result is a fixed function of the inputs (the reference's rank-order fold,
        bit for bit). ``dst`` may be ``src``'s own block."""
        p, r, es = self.size, self.rank, src.element_size()
        n = counts[r]
        need = (p - 1) * n * es
        if self._inbox.numel() < need:
            self._inbox = torch.empty(need, dtype=torch.uint8, device="cpu")
        inbox = self._inbox[:need].view(src.dtype).view(p - 1, n)
        send = _span(src, counts, es)
        send[1][r] = 0
        self.mpi.Alltoallv(send, [_fromaddress(inbox.data_ptr(), inbox.nbytes), [0 if j == r else n * es for j in
                                  range(p)], [(j - (j > r)) * n * es for j in range(p)], _BYTE])
        start = sum(counts[:r])
        mine = src[start:start + n]
        fold = _FOLD[op]
        acc = None
        for j in range(p):
            c = mine if j == r else inbox[j - (j > r)]
            if acc is None:
                acc = c
            else:  # ranks before this one fold into the inbox, this rank's block and after into dst
                tgt = dst if j >= r else acc
                fold(acc, c, out=tgt)
                acc = tgt
        if op == "avg":
            dst.div_(p)

    def _pairwise_allreduce(self, tensor: _b.Buffer, op: str, out: _b.Buffer | None):
        """:meth:`allreduce` as :meth:`_pairwise` over ``size`` near-equal blocks, then an in-place
        ``MPI_Allgatherv`` of the reduced blocks: every rank ends with the owners' bits. ``None`` when the
        buffers do not qualify (then MPI's allreduce runs)."""
        flat = _pairwise_view(tensor)
        if flat is None:
            return None
        if out is tensor:
            res, into = out, flat
        elif out is None:
            res = tensor.clone() if type(tensor) is _Tensor else tensor.copy()
            into = _pairwise_view(res)
        else:
            into = _pairwise_view(out)
            if into is None or into.dtype != flat.dtype or tuple(out.shape) != tuple(tensor.shape) \
                    or type(out) is not type(tensor):
                return None
            into.copy_(flat)
            res = out
        p = self.size
        q, m = divmod(into.numel(), p)
        counts = [q + (j < m) for j in range(p)]
        start = q * self.rank + min(self.rank, m)
        self._pairwise(into, counts, into[start:start + counts[self.rank]], op)
        self.mpi.Allgatherv(MPI.IN_PLACE, _span(into, counts, into.element_size()))
        d = self.bytes_sent
        d["allreduce"] = d.get("allreduce", 0) + 2 * tensor.nbytes * (p - 1) // p
        return res

    def reduce_scatter(self, tensor: _b.Buffer, op: str = "sum", *, out: _b.Buffer | None = None) -> _b.Buffer:
        """Reduce across ranks, then rank r keeps block r of dim 0 (dim 0 must divide by the size)."""
        mop = _op(op)
        p = self.size
        if out is not None:
            n0, _ = self._check_blocks(tensor, "reduce_scatter")
            if tuple(out.shape) != (n0 // p, *tensor.shape[1:]):
                raise ValueError(f"reduce_scatter: out has shape {tuple(out.shape)} but this rank's block has "
                                 f"{(n0 // p, *tensor.shape[1:])}; pass an out of that shape (or none)")
        if p > 1 and tensor.nbytes >= _pairwise_min() and (flat := _pairwise_view(tensor)) is not None:
            n0, _ = self._check_blocks(tensor, "reduce_scatter")
            if op == "avg" and not flat.is_floating_point():
                raise TypeError(f"reduce_scatter op 'avg' needs a floating dtype, got {tensor.dtype}")
            shape = (n0 // p, *tensor.shape[1:])
            into = _pairwise_view(out) if out is not None and type(out) is type(tensor) else None
            if into is None or into.dtype != flat.dtype:
                out = (torch.empty(shape, dtype=flat.dtype, device="cpu") if type(tensor) is _Tensor
                       else np.empty(shape, tensor.dtype))
                into = _pairwise_view(out)
            self._pairwise(flat, [flat.numel() // p] * p, into, op)
            self._count("reduce_scatter", tensor.nbytes * (p - 1) // p)
            return out
        if _b.staging(tensor):  # pipelined through pinned memory, reduced in fp32 for bf16/fp16
            n0, _ = self._check_blocks(tensor, "reduce_scatter")
            res, _host = _b.staged_blocks(self.mpi, tensor, "reduce_scatter", mop)
            self._count("reduce_scatter", _b.nbytes(tensor) * (p - 1) // p)
            if op == "avg":
                res /= p
            return res.view(n0 // p, *tensor.shape[1:]).to(tensor.dtype)
        x, xin, res = self._reduce_scatter_buffers(tensor, "reduce_scatter")
        self.mpi.Reduce_scatter_block(_as_send(xin), _as_send(res), mop)
        self._count("reduce_scatter", _b.nbytes(x) * (p - 1) // p)
        if op == "avg":
            res /= p
        res = _b.cast(_to_device(res, tensor), x.dtype)
        return res if out is None else _b.finish_recv(out, res)

    def _staged_blocks(self, kind: str, tensor: torch.Tensor, shape: tuple[int, ...],
                       out: torch.Tensor | None) -> torch.Tensor:
        """alltoall / allgather of a staged CUDA tensor (:func:`~loom.comm.buffers.staged_blocks`), the pieces
        copied straight into ``out`` when it can take them (contiguous, same shape, dtype and device), else
        into a new tensor (copied into ``out`` after, on the caller's stream)."""
        direct = (out is not None and tuple(out.shape) == shape and out.dtype == tensor.dtype
                  and out.device == tensor.device and _b.plain(out) and not (out.requires_grad and out.is_leaf))
        res, _host = _b.staged_blocks(self.mpi, tensor, kind, out=out if direct else None)
        if out is None:
            return res.view(shape)
        if not direct:
            out.copy_(res.view(shape))
        return out

    def _check_blocks(self, tensor: _b.Buffer, what: str, other_fix: str = "") -> tuple[int, int]:
        """Check that dim 0 splits into one equal block per rank; return (dim 0, ranks)."""
        _check_dim0(tensor, what)
        n0, p = tensor.shape[0], self.size
        if n0 % p:
            raise ValueError(
                f"{what}: dim 0 of size {n0} does not divide by {p} ranks of {self.name!r}; "
                f"pad dim 0 to {-(-n0 // p) * p}{other_fix}"
            )
        return n0, p

    def _reduce_scatter_buffers(self, tensor: _b.Buffer, what: str):
        """Check that dim 0 splits over the ranks; return the host view, its reducible copy and the block buffer."""
        n0, p = self._check_blocks(tensor, what)
        x, xin = _reducible(tensor)
        return x, xin, _b.empty_like_shape(xin, (n0 // p, *xin.shape[1:]))

    def _allgather_buffers(self, tensor: _b.Buffer, out: _b.Buffer | None, what: str):
        """Return the host view, whether ``out`` can take the gather directly, and the buffer to gather into."""
        _check_dim0(tensor, what)
        x = _host_view(tensor)
        shape = (x.shape[0] * self.size, *x.shape[1:])
        direct = out is not None and tuple(out.shape) == shape and _b.direct_target(out, x)
        return x, direct, out if direct else _b.empty_like_shape(x, shape)

    def allgather(self, tensor: _b.Buffer, *, out: _b.Buffer | None = None) -> _b.Buffer:
        """Concatenate every rank's tensor along dim 0 (same shape on every rank); ``out`` to reuse a buffer."""
        if _b.staging(tensor):
            _check_dim0(tensor, "allgather")
            res = self._staged_blocks("allgather", tensor, (tensor.shape[0] * self.size, *tensor.shape[1:]), out)
            self._count("allgather", _b.nbytes(tensor) * (self.size - 1))
            return res
        x, direct, res = self._allgather_buffers(tensor, out, "allgather")
        self.mpi.Allgather(_as_bytes(x), _as_bytes(res))
        self._count("allgather", _b.nbytes(x) * (self.size - 1))
        if direct:
            return out
        return _to_device(res, tensor) if out is None else _b.finish_recv(out, _to_device(res, tensor))

    def allgatherv(self, tensor: _b.Buffer) -> tuple[_b.Buffer, list[int]]:
        """Concatenate along dim 0 when ranks hold different dim-0 sizes; returns ``(tensor, counts)``."""
        _check_dim0(tensor, "allgatherv")
        x = _host_view(tensor)
        counts_np = np.empty(self.size, dtype=np.int64)
        self.mpi.Allgather(np.array([x.shape[0]], dtype=np.int64), counts_np)
        counts = counts_np.tolist()
        row = _row_bytes(x)
        out = _b.empty_like_shape(x, (sum(counts), *x.shape[1:]))
        sizes = [c * row for c in counts]
        displs = _displs(sizes)
        self.mpi.Allgatherv(_as_bytes(x), [_as_bytes(out)[0], sizes, displs, _BYTE])
        self._count("allgather", _b.nbytes(x) * (self.size - 1))
        return _to_device(out, tensor), counts

    def alltoall(self, tensor: _b.Buffer, *, out: _b.Buffer | None = None) -> _b.Buffer:
        """Split dim 0 into ``size`` equal blocks, block j to rank j; returns the received blocks in rank order."""
        _, p = self._check_blocks(tensor, "alltoall", " or use alltoallv with explicit counts")
        if _b.staging(tensor):
            res = self._staged_blocks("alltoall", tensor, tuple(tensor.shape), out)
            self._count("alltoall", _b.nbytes(tensor) * (p - 1) // p)
            return res
        x = _host_view(tensor)
        direct = out is not None and tuple(out.shape) == tuple(x.shape) and _b.direct_target(out, x)
        res = out if direct else _b.empty_like_shape(x, tuple(x.shape))
        self.mpi.Alltoall(_as_bytes(x), _as_bytes(res))
        self._count("alltoall", _b.nbytes(x) * (p - 1) // p)
        if direct:
            return out
        return _to_device(res, tensor) if out is None else _b.finish_recv(out, _to_device(res, tensor))

    def _alltoallv_specs(self, x, send_counts, recv_counts):
        """Byte counts/displacements for Alltoallv, validated once per distinct (counts, row size) and cached."""
        row = _row_bytes(x)
        key = (tuple(send_counts), None if recv_counts is None else tuple(recv_counts), row)
        cached = self._vcache.get(key)
        if cached is None or recv_counts is None:
            cached = self._alltoallv_layout(x, send_counts, recv_counts, row)
            if recv_counts is not None:
                if len(self._vcache) > 64:
                    self._vcache.clear()
                self._vcache[key] = cached
        elif cached[5] != x.shape[0]:
            self._alltoallv_layout(x, send_counts, recv_counts, row)  # raises the clear error
        ss, sd, rs, rd, rc, _, sent, nrecv = cached
        out = _b.empty_like_shape(x, (nrecv, *x.shape[1:]))
        return ([_as_bytes(x)[0], ss, sd, _BYTE], [_as_bytes(out)[0], rs, rd, _BYTE], out, rc, sent)

    def _alltoallv_layout(self, x, send_counts, recv_counts, row):
        p = self.size
        sc = [int(c) for c in send_counts]
        if len(sc) != p:
            raise ValueError(
                f"alltoallv: send_counts has {len(sc)} entries but {self.name!r} has {p} ranks; "
                f"give one count (rows of dim 0) per destination rank"
            )
        if any(c < 0 for c in sc):
            raise ValueError(f"alltoallv: send_counts {sc} has a negative count; counts are rows of dim 0, >= 0")
        if sum(sc) != x.shape[0]:
            raise ValueError(
                f"alltoallv: send_counts {sc} sum to {sum(sc)} but dim 0 has {x.shape[0]} rows; "
                f"the counts must cover dim 0 exactly"
            )
        if recv_counts is None:
            rc = np.empty(p, dtype=np.int64)
            self.mpi.Alltoall(np.asarray(sc, dtype=np.int64), rc)
            rc = rc.tolist()
        else:
            rc = [int(c) for c in recv_counts]
            if len(rc) != p or any(c < 0 for c in rc):
                raise ValueError(f"alltoallv: recv_counts {rc} must have {p} entries (one per rank), all >= 0")
        ss = [c * row for c in sc]
        rs = [c * row for c in rc]
        return ss, _displs(ss), rs, _displs(rs), rc, x.shape[0], sum(ss) - ss[self.rank], sum(rc)

    def alltoallv(
        self,
        tensor: _b.Buffer,
        send_counts: Sequence[int],
        recv_counts: Sequence[int] | None = None,
    ) -> tuple[_b.Buffer, list[int]]:
        """Rows ``[sum(send_counts[:j]), +send_counts[j])`` of dim 0 go to rank j.

        Returns ``(received, recv_counts)``, the received rows concatenated in source-rank order. When
        ``recv_counts`` is not given it is learned with one small alltoall of the counts.
        """
        _check_dim0(tensor, "alltoallv")
        if _b.staging(tensor):  # pipelined through pinned memory, a piece along every row
            *_, rc, _, sent, nrecv = self._alltoallv_layout(tensor, send_counts, recv_counts, _row_bytes(tensor))
            res, _host = _b.staged_rows(self.mpi, tensor, [int(c) for c in send_counts], rc)
            self._count("alltoallv", sent)
            return res.view(nrecv, *tensor.shape[1:]), rc
        x = _host_view(tensor)
        s, r, out, rc, sent = self._alltoallv_specs(x, send_counts, recv_counts)
        self.mpi.Alltoallv(s, r)
        self._count("alltoallv", sent)
        return _to_device(out, tensor), rc

    # ------------------------------------------------------------------ non-blocking collectives
    def iallreduce(self, tensor: _b.Buffer, op: str = "sum", *, out: _b.Buffer | None = None) -> Request:
        """Non-blocking :meth:`allreduce`; ``wait()`` returns the reduced tensor.

        ``out=tensor`` reduces in place (``MPI_IN_PLACE``: no result buffer, no copy) when ``tensor`` is a
        contiguous host buffer of an MPI-reducible dtype; otherwise the result is copied into ``out``.
        """
        mop = _op(op)
        x, xin = _reducible(tensor)
        inplace = out is tensor and xin is x and x is tensor and _b.direct_target(out, x)
        res = x if inplace else _b.empty_like_shape(xin, tuple(xin.shape))
        req = self.mpi.Iallreduce(MPI.IN_PLACE if inplace else _as_send(xin), _as_send(res), mop)
        self._count("allreduce", 2 * _b.nbytes(x) * (self.size - 1) // max(self.size, 1))
        size = self.size

        def finish():
            if op == "avg":
                res.__itruediv__(size)
            if inplace:
                return out
            r = _b.cast(_to_device(res, tensor), x.dtype)
            return r if out is None else _b.finish_recv(out, r)

        return Request([req], keep=(xin, res), finish=finish, what=f"iallreduce on {self.name}")

    def iallgather(self, tensor: _b.Buffer, *, out: _b.Buffer | None = None) -> Request:
        """Non-blocking :meth:`allgather`; ``out`` (contiguous, ``size`` times the rows) to gather in place."""
        x, direct, res = self._allgather_buffers(tensor, out, "iallgather")
        req = self.mpi.Iallgather(_as_bytes(x), _as_bytes(res))
        self._count("allgather", _b.nbytes(x) * (self.size - 1))

        def finish():
            if direct:
                return out
            r = _to_device(res, tensor)
            return r if out is None else _b.finish_recv(out, r)

        return Request([req], keep=(x, res), finish=finish, what=f"iallgather on {self.name}")

    def ireduce_scatter(self, tensor: _b.Buffer, op: str = "sum") -> Request:
        """Non-blocking :meth:`reduce_scatter`; ``wait()`` returns this rank's block of the reduction."""
        mop = _op(op)
        p = self.size
        x, xin, res = self._reduce_scatter_buffers(tensor, "ireduce_scatter")
        req = self.mpi.Ireduce_scatter_block(_as_send(xin), _as_send(res), mop)
        self._count("reduce_scatter", _b.nbytes(x) * (p - 1) // p)

        def finish():
            if op == "avg":
                res.__itruediv__(p)
            return _b.cast(_to_device(res, tensor), x.dtype)

        return Request([req], keep=(xin, res), finish=finish, what=f"ireduce_scatter on {self.name}")

    def ialltoallv(
        self, tensor: _b.Buffer, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None
    ) -> Request:
        """Non-blocking :meth:`alltoallv`; ``wait()`` returns ``(received, recv_counts)``.

        If ``recv_counts`` is omitted they are exchanged first with a blocking alltoall of the counts.
        """
        _check_dim0(tensor, "ialltoallv")
        x = _host_view(tensor)
        s, r, out, rc, sent = self._alltoallv_specs(x, send_counts, recv_counts)
        req = self.mpi.Ialltoallv(s, r)
        self._count("alltoallv", sent)
        return Request([req], keep=(x, out, s, r), finish=lambda: (_to_device(out, tensor), rc),
                       what=f"ialltoallv on {self.name}")

    # ------------------------------------------------------------------ objects (pickled)
    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.mpi.send(data, dest, tag)
        self._count("send", len(data))

    def recv_object(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        return pickle.loads(self.mpi.recv(source=source, tag=tag))

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast(obj, root)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.mpi.allgather(obj)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.mpi.gather(obj, root)

    def allreduce_object(self, value: Any, op: str = "sum") -> Any:
        """Reduce Python numbers (or anything supporting the op) across ranks."""
        return self.mpi.allreduce(value, op=_op(op))

    # ------------------------------------------------------------------ structure
    def split(self, color: int, key: int | None = None, *, name: str | None = None) -> "Communicator":
        """Ranks with the same ``color`` form a new communicator, ordered by ``key`` (default: rank)."""
        sub = self.mpi.Split(int(color), self.rank if key is None else int(key))
        return Communicator(sub, name=name or f"{self.name}.split{color}")

    def group(self, ranks: Sequence[int], *, name: str | None = None) -> "Communicator":
        """A communicator of ``ranks`` of this one (their order is the new ranks' order), made by those ranks only
        (``MPI_Comm_create_group``: ranks outside it make no call, as torch's sub-group creators run only on
        members). Members must create their groups in the same order."""
        ranks = [int(r) for r in ranks]
        if self.rank not in ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks):
            raise ValueError(f"group(): ranks {ranks} must be distinct ranks of {self.name!r} (size {self.size}) "
                             f"and include this rank ({self.rank})")
        grp = self.mpi.Get_group().Incl(ranks)
        try:
            sub = self.mpi.Create_group(grp)
        finally:
            grp.Free()
        return Communicator(sub, name=name or f"{self.name}.group")

    def dup(self, *, name: str | None = None) -> "Communicator":
        """A communicator with the same ranks and an isolated message space (and this one's timeout)."""
        out = Communicator(self.mpi.Dup(), name=name or self.name)
        if self.timeout is not None:
            out.set_timeout(self.timeout)
        return out

    @property
    def timeout(self) -> float | None:
        """Seconds a blocking call on this communicator may wait (:meth:`set_timeout`), or ``None``: no limit."""
        return self.mpi.seconds if isinstance(self.mpi, Deadline) else None

    @property
    def broken(self) -> str | None:
        """What timed out on this communicator (then every later call raises), or ``None``."""
        return self.mpi.broken if isinstance(self.mpi, Deadline) else None

    def mark_broken(self, what: str) -> None:
        """Refuse every later blocking call: a non-blocking operation of this communicator was given up at its
        timeout, so its ranks no longer agree on which operation comes next (no-op without a timeout)."""
        if isinstance(self.mpi, Deadline):
            self.mpi.broken = str(what)

    def set_timeout(self, seconds: float | None) -> None:
        """Give every blocking call on this communicator a deadline of ``seconds`` (``None``: none), after which
        it raises :class:`~loom.comm.CommTimeoutError` and the communicator is unusable (see
        :mod:`loom.comm.deadline`: the calls run as their non-blocking twins, tested until done). Collective in
        meaning: give every rank the same timeout. Its duplicates (:meth:`dup`, :meth:`sub`) inherit it."""
        raw = self.mpi.wrapped if isinstance(self.mpi, Deadline) else self.mpi
        self.mpi = raw if seconds is None else Deadline(raw, seconds, self.name)

    def sub(self, subsystem: str) -> "Communicator":
        """This communicator's private duplicate for ``subsystem`` (``"pipeline"``, ``"relay"``, ``"dask"``, ...),
        made on first use and cached: tags a subsystem numbers itself never match another subsystem's messages
        nor user traffic on ``self``. Collective on first use of a name (every rank calls it, in the same
        order); free afterwards. Counters stay under this communicator's name."""
        got = self._subs.get(subsystem)
        if got is None:
            if not isinstance(subsystem, str) or not subsystem:
                raise ValueError(f"sub(): subsystem must be a non-empty name, got {subsystem!r}")
            got = self._subs[subsystem] = self.dup(name=self.name)
        return got

    @property
    def tag_ub(self) -> int:
        """The largest tag usable here (:func:`tag_ub`: ``MPI_TAG_UB``, or ``LOOM_TAG_UB`` when lower)."""
        return tag_ub()

    def require_tags(self, top: int, what: str, fix: str = "") -> None:
        """Raise ``ValueError`` (the same on every rank that asks) unless tags ``0..top`` fit this MPI."""
        ub = tag_ub()
        if top > ub:
            forced = _forced_tag_ub()
            why = f"LOOM_TAG_UB={forced}" if forced is not None and forced == ub else "this MPI's MPI_TAG_UB"
            raise ValueError(f"{what} needs MPI tags up to {top}, but {why} is {ub} (the standard guarantees only "
                             f"{MIN_TAG_UB}){'; ' + fix if fix else ''}")

    def free(self) -> None:
        raw = self.mpi.wrapped if isinstance(self.mpi, Deadline) else self.mpi
        if raw not in (MPI.COMM_WORLD, MPI.COMM_SELF) and raw != MPI.COMM_NULL:
            raw.Free()

    def abort(self, code: int = 1) -> None:
        """Take the whole job down (every rank of every communicator)."""
        MPI.COMM_WORLD.Abort(code)


_safety.attach(Communicator)  # check mode and the watchdog wrap its methods while they are on

_WORLD: Communicator | None = None


def world() -> Communicator:
    """COMM_WORLD as a :class:`Communicator`; also installs loom's abort-on-exception hook."""
    global _WORLD
    if _WORLD is None:
        _safety.install()
        tag_ub()  # a bad LOOM_TAG_UB fails here, at start, on every rank
        _WORLD = Communicator(MPI.COMM_WORLD, name="world")
    return _WORLD


def stats() -> dict[str, dict[str, int]]:
    """Bytes this rank sent, per communicator name and operation (a copy; the ``comm`` kind of loom.stats)."""
    return _stats.snapshot("comm")


def reset_stats() -> None:
    _stats.reset("comm")


class Message:
    """A message matched by :meth:`Communicator.improbe`: receive it with :meth:`recv` or :meth:`irecv`
    into a buffer of at least ``nbytes`` bytes (a numpy array or tensor; its bytes are filled)."""

    __slots__ = ("_msg", "source", "tag", "nbytes", "_name")

    def __init__(self, msg: MPI.Message, source: int, tag: int, nbytes: int, name: str):
        self._msg = msg
        self.source = source
        self.tag = tag
        self.nbytes = nbytes
        self._name = name

    def recv(self, out: _b.Buffer) -> _b.Buffer:
        """Receive the matched message into ``out`` now (``MPI_Mrecv``) and return ``out``."""
        if type(out) is _ndarray and out.flags.c_contiguous and out.flags.writeable:  # fast path (Dask headers)
            self._msg.Recv([out, _BYTE])
            return out
        tmp = _b.recv_target(out)
        self._msg.Recv(_as_send(tmp))
        return _b.finish_recv(out, tmp)

    def irecv_eager(self, out: np.ndarray) -> "Request | None":
        """Start receiving the matched message into a contiguous writeable uint8 numpy array (``MPI_Imrecv``) and
        test it once: ``None`` when it already completed (the usual case on one host, where the receiver copies
        the message itself), else the pending :class:`Request`. No request object when none is needed."""
        req = self._msg.Irecv([out, _BYTE])
        try:
            if req.Test():
                return None
        except MPI.Exception as exc:  # worded as Request.test words it
            raise CommError(f"irecv of a probed message from {self.source} on {self._name} failed: {exc}") from exc
        return Request([req], keep=out, what=("irecv of a probed message from", self.source, self._name))

    def irecv(self, out: _b.Buffer) -> Request:
        """Non-blocking receive of the matched message (``MPI_Imrecv``); ``wait()`` returns ``out``."""
        tmp = _b.recv_target(out)
        req = self._msg.Irecv(_as_send(tmp))
        return Request([req], keep=tmp, finish=lambda: _b.finish_recv(out, tmp),
                       what=f"irecv of a probed message from {self.source} on {self._name}")
