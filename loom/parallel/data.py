"""Data parallelism: average gradients over model replicas with bucketed allreduces overlapped with backward.

Plan (:class:`GradReducer`), per training step on the ``dp`` communicator:

* buckets: the trainable tensors, in reverse registration order (roughly the order backward finishes them),
  grouped by dtype into flat buckets of at most ``bucket_mb`` MiB; fixed at construction, identical on every
  replica;
* readiness: a ``post_accumulate_grad`` hook counts accumulations; a tensor is final after ``expected``
  accumulations (one per micro-batch), a bucket when all its tensors are;
* launch: ready buckets are launched strictly in bucket order (so every replica issues the same collectives
  in the same order): the bucket's gradients are copied into one flat buffer and either
  ``iallreduce(flat, op="avg")`` is started (default: overlaps the remaining backward), or the user's
  ``grad_hook(flat, comm, bucket_index) -> mean`` is called (the compression hook point; blocking);
* finish (:meth:`GradReducer.finish`): launch what has not been launched (tensors unused this step count as
  zero), wait for every request, copy the means back into ``.grad``. A tensor unused on *some* replicas gets
  the mean on every replica (one small allreduce of a used-bitmap says which, as DDP does with
  ``find_unused_parameters``): leaving its ``grad`` ``None`` where it was unused would let the optimizer skip it
  there and step it elsewhere, and the replicas would drift apart. Only a tensor unused everywhere keeps
  ``grad=None``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..comm import Communicator, Request

__all__ = ["GradHook", "GradReducer", "allreduce_hook"]

GradHook = Callable[[torch.Tensor, Communicator, int], torch.Tensor]


def allreduce_hook(flat: torch.Tensor, comm: Communicator, bucket_index: int) -> torch.Tensor:
    """The default gradient hook: the mean of ``flat`` over ``comm`` (one allreduce)."""
    return comm.allreduce(flat, op="avg")


class GradReducer:
    """Average the gradients of ``params`` over ``comm`` as backward produces them.

    Args:
        params: this rank's trainable tensors (the same list, in the same order, on every replica).
        comm: the data-parallel communicator.
        grad_hook: ``hook(flat, comm, bucket_index) -> mean over comm``; ``None`` uses a non-blocking
            ``iallreduce(op="avg")`` overlapped with the rest of backward.
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
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._counts: dict[int, int] = {}
        self._ready = [0] * len(self.buckets)
        self._results: list[Request | torch.Tensor | None] = [None] * len(self.buckets)
        self._next = 0
        self.expected = 1
        self.armed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b]

    def start(self, expected: int) -> None:
        """Arm for one step in which each tensor is accumulated ``expected`` times."""
        self.expected = expected
        self._counts.clear()
        self._ready = [0] * len(self.buckets)
        self._results = [None] * len(self.buckets)
        self._next = 0
        self.armed = True

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        k = id(p)
        c = self._counts.get(k, 0) + 1
        self._counts[k] = c
        if c == self.expected:
            b = self._bucket_of[k]
            self._ready[b] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1

    def _launch(self, i: int) -> None:
        ps = self.buckets[i]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        if self.hook is None:
            self._results[i] = self.comm.iallreduce(flat, op="avg")
        else:
            self._results[i] = self.hook(flat, self.comm, i)

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, write the means into ``.grad``."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self.armed = False
        used = [p.grad is not None for ps in self.buckets for p in ps]
        used = self.comm.allreduce(torch.tensor(used, dtype=torch.uint8), "max").tolist()
        k = 0
        for i, ps in enumerate(self.buckets):
            res = self._results[i]
            mean = res.wait() if isinstance(res, Request) else res
            off = 0
            for p in ps:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(mean[off:off + n].view_as(p))
                elif used[k]:  # unused here, used by another replica: take the same mean
                    p.grad = mean[off:off + n].view_as(p).to(p.dtype).clone()
                off += n
                k += 1
        self._results = [None] * len(self.buckets)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
