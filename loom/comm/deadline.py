"""Blocking MPI calls that give up: a communicator's mpi4py communicator whose blocking calls have a deadline.

torch's groups carry a timeout (``init_process_group(timeout=...)``, ``new_group(timeout=...)``): a collective
that a peer never joins raises after it instead of blocking for ever. A blocking MPI call cannot be interrupted,
so :class:`Deadline` stands in for the communicator's ``mpi`` attribute (:meth:`Communicator.set_timeout
<loom.comm.Communicator.set_timeout>`) and runs each blocking call as its non-blocking twin (``Allreduce`` as
``Iallreduce``, ``Send`` as ``Isend``, ...), tested in a loop until it completes or the timeout passes.

Plan of one call: post the non-blocking twin; test it (a small message on one host is done at the first or
second test); keep testing, reading the clock every 64 tests and yielding the core (``sched_yield``) once
the wait passes :data:`SPIN_S`, so an oversubscribed peer gets the core it needs. MPICH moves a posted
operation only inside an MPI call, so the loop tests without sleeping, as MPI's own blocking calls spin
(measured at 2 ranks: 1-byte ``Iallreduce`` + test 1.9 us against ``Allreduce`` 1.6 us; 64 MiB the same).

Past the deadline: the request is *stranded* (kept, with its buffers, for as long as the communicator lives: MPI
may still write into them), the communicator is marked broken, and :class:`~loom.comm.CommTimeoutError` is
raised naming the call, the communicator and the timeout. Every later blocking call on it raises at once: the
ranks no longer agree on which collective comes next, so the owner makes a new communicator (torch: a new
group). Non-blocking calls and everything else pass through to the wrapped communicator unchanged.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .errors import CommError, CommTimeoutError

__all__ = ["Deadline", "SPIN_S"]

SPIN_S = 1e-3
"""Seconds a wait spins on tests alone before it also yields the core between them."""

_monotonic = time.monotonic
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class Deadline:
    """An mpi4py intracommunicator whose blocking calls raise after ``seconds``.

    Args:
        comm: the mpi4py communicator wrapped.
        seconds: the timeout of each blocking call.
        name: the communicator's name, for messages.
    """

    def __init__(self, comm: Any, seconds: float, name: str):
        if not seconds > 0:
            raise ValueError(f"communicator timeout {seconds!r} must be a positive number of seconds")
        self._comm = comm
        self._iallreduce = comm.Iallreduce  # bound once: a 1-byte allreduce is mostly Python (loom bench torch)
        self.seconds = float(seconds)
        self.name = name
        self.broken: str | None = None  # the call that timed out
        self.stranded: list[tuple[Any, Any]] = []  # (request, buffers) that never completed

    def __getattr__(self, name: str) -> Any:  # non-blocking calls, queries: the wrapped communicator's own
        value = getattr(self._comm, name)
        if callable(value):
            self.__dict__[name] = value  # cached: the next lookup is a plain instance attribute
        return value

    def __repr__(self) -> str:
        return f"Deadline({self._comm!r}, {self.seconds:g} s, {self.name!r})"

    @property
    def wrapped(self) -> Any:
        """The mpi4py communicator itself."""
        return self._comm

    def _wait(self, req: Any, what: str, keep: Any) -> None:
        """Test ``req`` until it completes or the timeout passes (the module's plan); the caller tested once."""
        test, clock = req.Test, _monotonic
        start = clock()
        end = start + self.seconds
        spin_until = start + SPIN_S
        n = 0
        while not test():
            n += 1
            if n & 63 == 0:
                now = clock()
                if now > end:
                    self.stranded.append((req, keep))
                    self.broken = what
                    raise CommTimeoutError(
                        f"{what} on communicator {self.name!r}: Timed out after {self.seconds:g} s (the "
                        f"communicator's timeout) waiting for its other ranks; a peer never joined it, or is stuck. "
                        f"The communicator is unusable from now on: make a new one")
                if now > spin_until:
                    _yield()

    def _check(self, what: str) -> None:
        if self.broken is not None:
            raise CommError(f"{what} on communicator {self.name!r}: an earlier {self.broken} on it timed out, so "
                            f"its ranks no longer agree on which operation comes next; make a new communicator (a "
                            f"new process group)")

    # ------------------------------------------------------------------ the blocking calls loom.comm makes
    def Barrier(self) -> None:
        if self.broken is not None:
            self._check("barrier")
        req = self._comm.Ibarrier()
        if not req.Test():
            self._wait(req, "barrier", None)

    def Bcast(self, buf, root: int = 0) -> None:
        if self.broken is not None:
            self._check("bcast")
        req = self._comm.Ibcast(buf, root)
        if not req.Test():
            self._wait(req, "bcast", buf)

    def Allreduce(self, sendbuf, recvbuf, op) -> None:
        if self.broken is not None:
            self._check("allreduce")
        req = self._iallreduce(sendbuf, recvbuf, op)
        if not req.Test():
            self._wait(req, "allreduce", (sendbuf, recvbuf))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op) -> None:
        if self.broken is not None:
            self._check("reduce_scatter")
        req = self._comm.Ireduce_scatter_block(sendbuf, recvbuf, op)
        if not req.Test():
            self._wait(req, "reduce_scatter", (sendbuf, recvbuf))

    def Allgather(self, sendbuf, recvbuf) -> None:
        if self.broken is not None:
            self._check("allgather")
        req = self._comm.Iallgather(sendbuf, recvbuf)
        if not req.Test():
            self._wait(req, "allgather", (sendbuf, recvbuf))

    def Allgatherv(self, sendbuf, recvbuf) -> None:
        if self.broken is not None:
            self._check("allgatherv")
        req = self._comm.Iallgatherv(sendbuf, recvbuf)
        if not req.Test():
            self._wait(req, "allgatherv", (sendbuf, recvbuf))

    def Alltoall(self, sendbuf, recvbuf) -> None:
        if self.broken is not None:
            self._check("alltoall")
        req = self._comm.Ialltoall(sendbuf, recvbuf)
        if not req.Test():
            self._wait(req, "alltoall", (sendbuf, recvbuf))

    def Alltoallv(self, sendbuf, recvbuf) -> None:
        if self.broken is not None:
            self._check("alltoallv")
        req = self._comm.Ialltoallv(sendbuf, recvbuf)
        if not req.Test():
            self._wait(req, "alltoallv", (sendbuf, recvbuf))

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        if self.broken is not None:
            self._check("send")
        req = self._comm.Isend(buf, dest, tag)
        if not req.Test():
            self._wait(req, f"send to rank {dest}", buf)

    def Recv(self, buf, source: int = -2, tag: int = -1, status=None) -> None:
        self._check("recv")
        req = self._comm.Irecv(buf, source, tag)
        if status is None:
            self._wait(req, f"recv from rank {source}", buf)
        else:  # a status wanted: test with it on the completing call
            self._wait(_WithStatus(req, status), f"recv from rank {source}", buf)

    def Sendrecv(self, sendbuf, dest: int, sendtag: int, recvbuf, source: int, recvtag: int) -> None:
        self._check("sendrecv")
        reqs = [self._comm.Irecv(recvbuf, source, recvtag), self._comm.Isend(sendbuf, dest, sendtag)]
        self._wait(_All(reqs), f"sendrecv with ranks {dest}/{source}", (sendbuf, recvbuf))


class _WithStatus:
    """A request tested with a status object (filled once it completes)."""

    __slots__ = ("req", "status")

    def __init__(self, req: Any, status: Any):
        self.req, self.status = req, status

    def Test(self) -> bool:
        return self.req.Test(self.status)


class _All:
    """Several requests tested as one."""

    __slots__ = ("reqs",)

    def __init__(self, reqs: list):
        self.reqs = reqs

    def Test(self) -> bool:
        from mpi4py import MPI

        return MPI.Request.Testall(self.reqs)
