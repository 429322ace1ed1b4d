"""Data parallelism: average gradients over model replicas with bucketed allreduces overlapped with backward.

Plan (:class:`GradReducer`), per training step on the ``dp`` communicator:

* buckets: the trainable tensors, in reverse registration order (roughly the order backward finishes them),
  grouped by dtype into flat buckets of at most ``bucket_mb`` MiB; fixed at construction, identical on every
  replica. Each bucket owns one flat buffer for the whole run;
* gradients as bucket views (as torch DDP's ``gradient_as_bucket_view``): :meth:`GradReducer.start` points
  every ``.grad`` at its slice of the zeroed bucket buffer, so backward accumulates straight into the buffer
  and the allreduce runs in place: no gathering copy, no result buffer, no copy back. A ``.grad`` replaced
  in between (``zero_grad(set_to_none=True)`` after ``start``) is copied in at launch instead;
* readiness: a ``post_accumulate_grad`` hook counts accumulations; a tensor is final after ``expected``
  accumulations (one per micro-batch), a bucket when all its tensors are;
* launch: ready buckets are launched strictly in bucket order (so every replica issues the same collectives
  in the same order): either ``iallreduce(buffer, op="avg", out=buffer)`` is started (default: overlaps the
  remaining backward; every hook tests the outstanding requests, since MPICH progresses a non-blocking
  collective only when tested), or the user's ``grad_hook(flat, comm, bucket_index) -> mean`` is called (the
  compression hook point; blocking) and its result copied into the buffer;
* finish (:meth:`GradReducer.finish`): launch what has not been launched, reduce a map of which tensors got
  a gradient on each replica (one small allreduce, as DDP's ``find_unused_parameters``), wait for every
  request. A tensor no replica produced a gradient for keeps the ``.grad`` it had before :meth:`start`
  (``None`` stays ``None``: the optimizer skips it, as in one process); every other tensor's ``.grad`` is the
  mean, on every replica, also where this replica had none (so replicas never diverge).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .. import stats as _stats
from ..comm import Communicator, Request

__all__ = ["GradHook", "GradReducer", "allreduce_hook", "dp_stats", "reset_dp_stats"]

GradHook = Callable[[torch.Tensor, Communicator, int], torch.Tensor]



def dp_stats() -> dict[str, float]:
    """Seconds every :class:`GradReducer` of this process spent blocked in :meth:`GradReducer.finish`."""
    return {"exposed_comm_s": _stats.counters("time", "dp").get("exposed_comm_s", 0.0)}  # a registry view


def reset_dp_stats() -> None:
    _stats.counters("time", "dp").clear()


def allreduce_hook(flat: torch.Tensor, comm: Communicator, bucket_index: int) -> torch.Tensor:
    """The default gradient hook: the mean of ``flat`` over ``comm`` (one allreduce)."""
    return comm.allreduce(flat, op="avg")


class GradReducer:
    """Average the gradients of ``params`` over ``comm`` as backward produces them.

    Args:
        params: this rank's trainable tensors (the same list, in the same order, on every replica).
        comm: the data-parallel communicator.
        grad_hook: ``hook(flat, comm, bucket_index) -> mean over comm``; ``None`` uses a non-blocking
            in-place ``iallreduce(op="avg")`` overlapped with the rest of backward.
        bucket_mb: bucket size cap in MiB.
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Communicator, *, grad_hook: GradHook | None = None,
                 bucket_mb: float = 25.0):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        self.comm = comm
        self.hook = grad_hook
        cap = int(bucket_mb * (1 << 20))
        self.buckets: list[list[torch.Tensor]] = []
        open_: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
        for p in reversed(list(params)):
            cur, size = open_.get(p.dtype, ([], 0))
            if cur and size + p.numel() * p.element_size() > cap:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            open_[p.dtype] = (cur, size + p.numel() * p.element_size())
        for cur, _ in open_.values():
            if cur:
                self.buckets.append(cur)
        self.params = [p for b in self.buckets for p in b]
        self._where = {id(p): (i, k) for k, (i, p) in enumerate((i, p) for i, b in enumerate(self.buckets) for p in b)}
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                        for b in self.buckets]
        self._views: list[list[torch.Tensor]] = []
        for b, buf in zip(self.buckets, self.buffers):
            off, vs = 0, []
            for p in b:
                vs.append(buf[off:off + p.numel()].view_as(p))
                off += p.numel()
            self._views.append(vs)
        self._counts = [0] * len(self.params)
        self._ready = [0] * len(self.buckets)
        self._results: list[Request | torch.Tensor | None] = [None] * len(self.buckets)
        self._had_grad: list[bool] = [False] * len(self.params)
        self._next = 0
        self.expected = 1
        self.armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def start(self, expected: int) -> None:
        """Arm for one step in which each tensor is accumulated ``expected`` times.

        Every ``.grad`` becomes its slice of the bucket buffer, keeping its value (zero where it was ``None``).
        """
        self.expected = expected
        self._counts = [0] * len(self.params)
        self._had_grad = [p.grad is not None for p in self.params]
        self._ready = [0] * len(self.buckets)
        self._results = [None] * len(self.buckets)
        self._next = 0
        with torch.no_grad():
            for b, vs in zip(self.buckets, self._views):
                for p, v in zip(b, vs):
                    g = p.grad
                    if g is None:
                        v.zero_()
                    elif g.data_ptr() != v.data_ptr():
                        v.copy_(g)
                    else:
                        continue
                    p.grad = v
        self.armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        i, k = self._where[id(p)]
        c = self._counts[k] + 1
        self._counts[k] = c
        if c == self.expected:
            self._ready[i] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1
        for res in self._results:  # MPICH moves a posted collective only when it is tested
            if isinstance(res, Request):
                res.test()

    def _launch(self, i: int) -> None:
        buf = self.buffers[i]
        for p, v in zip(self.buckets[i], self._views[i]):
            g = p.grad
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)  # the gradient was replaced after start(): bring it into the bucket
        if self.hook is None:
            self._results[i] = self.comm.iallreduce(buf, op="avg", out=buf)
        else:
            mean = self.hook(buf, self.comm, i)
            if mean is not buf:
                buf.copy_(mean)
            self._results[i] = buf

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all; ``.grad`` holds the mean (see the module docstring)."""
        used = torch.tensor([self._counts[k] > 0 for k in range(len(self.params))], dtype=torch.int32)
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self.armed = False
        t0 = time.perf_counter()
        if self.comm.size > 1:
            used = self.comm.allreduce(used)
        for res in self._results:
            if isinstance(res, Request):
                res.wait()
        _stats.add("time", "dp", exposed_comm_s=time.perf_counter() - t0)
        k = 0
        for b, vs in zip(self.buckets, self._views):
            for p, v in zip(b, vs):
                if used[k] or self._had_grad[k]:
                    if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                        p.grad = v
                else:
                    p.grad = None  # no replica produced one: as in one process, the optimizer skips it
                k += 1
        self._results = [None] * len(self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
