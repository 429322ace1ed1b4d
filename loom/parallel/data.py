"""Data parallelism: average gradients over model replicas with bucketed allreduces overlapped with backward.

Plan (:class:`GradReducer`), per training step on the ``dp`` communicator:

* buckets: the trainable tensors, in reverse registration order (roughly the order backward finishes them,
  as torch DDP), grouped by dtype into flat buckets of at most ``bucket_mb`` MiB; fixed at construction,
  identical on every replica. Each bucket owns one flat buffer for the whole run;
* gradients as bucket views (as torch DDP's ``gradient_as_bucket_view``): :meth:`GradReducer.start` points
  every ``.grad`` at its slice of the zeroed bucket buffer, so backward accumulates straight into the buffer
  and the allreduce runs in place: no gathering copy, no result buffer, no copy back. A ``.grad`` replaced
  in between (``zero_grad(set_to_none=True)`` after ``start``) is copied in at launch instead;
* readiness: a ``post_accumulate_grad`` hook counts accumulations; a tensor is final after ``expected``
  accumulations (one per micro-batch: the earlier micro-batches only accumulate, as under DDP's
  ``no_sync``), a bucket when all its tensors are;
* launch: ready buckets are launched strictly in bucket order (so every replica issues the same collectives
  in the same order): ``iallreduce(buffer, op="avg", out=buffer)``, or the user's blocking
  ``grad_hook(flat, comm, bucket_index) -> mean`` (the compression hook point, e.g.
  ``loom.compress.dp_hook``) whose result is copied into the buffer;
* progress (``progress=``), because MPICH moves a posted collective only inside an MPI call of the process:

  - ``"thread"``: a :class:`loom.comm.ProgressThread` of this reducer posts each launched bucket and tests
    the requests in flight while backward computes; a blocking ``grad_hook`` runs there too, so the
    compressed path overlaps backward as well. Costs a core while a reduction is in flight;
  - ``"hooks"``: the bucket is posted from the hook, and every later hook tests the requests in flight (no
    thread, no extra core; progress only at hook times, the rest at :meth:`finish`); a ``grad_hook`` runs
    inside the hook, blocking backward;
  - ``"auto"`` (default): ``"thread"`` when every rank on this node has a core for it beside its torch
    threads (:func:`default_progress`), else ``"hooks"``: on a node with as many ranks as cores a spinning
    thread would take its core from a peer's backward. MPICH's own asynchronous progress
    (``MPICH_ASYNC_PROGRESS=1``) is not used: its thread spins for the whole job, not only while a
    reduction is in flight, and must be chosen before MPI starts;
* devices: buffers live on the tensors' device. With a CUDA-aware MPI the allreduce takes the device buffer.
  Otherwise (:func:`stages_through_host`) the reducer stages it itself, so no hook waits on the host for a
  device copy: a launched bucket (widened to float32 on the device when 16-bit) is copied to a pooled pinned
  host buffer on a side stream after the compute stream, and its in-place ``iallreduce`` on the host buffer is
  posted (here or by the thread) once that copy's event has completed, looked at from later hooks, in launch
  order, or at :meth:`GradReducer.finish`, which waits; after the waits each mean is copied back into its
  bucket on the host->device side stream, the compute stream ordered after it on the device (no host sync);
* isolation: the reducer communicates on its own duplicate of ``comm`` (same ranks, same name for the byte
  counters), so the caller's collectives on ``comm`` never interleave with the buckets';
* finish (:meth:`GradReducer.finish`): launch what has not been launched (a bucket whose tensor got no
  gradient on this replica: no hang, it is reduced with zeros at the end, as DDP's
  ``find_unused_parameters=True`` but always on), reduce a map of which tensors got a gradient on each
  replica (one small allreduce after the buckets, in the same order on every rank), wait for every request.
  A tensor no replica produced a gradient for keeps the ``.grad`` it had before :meth:`start` (``None``
  stays ``None``: the optimizer skips it, as in one process); every other tensor's ``.grad`` is the mean, on
  every replica, also where this replica had none (so replicas never diverge).

Accounting (``loom.stats``, kind ``time``, scope ``dp``; :func:`dp_stats`, and :attr:`GradReducer.last` for
the last step): ``exposed_comm_s`` is the time backward was held up by the reduction (blocked in
:meth:`finish`, plus blocking hooks run inside backward); ``overlapped_comm_s`` the time before
:meth:`finish` during which at least one bucket's reduction was in flight (posted, not yet seen complete),
i.e. communication hidden behind backward; ``buckets``, ``posted_in_backward`` (launched before
:meth:`finish`) and ``tests_in_backward`` (tests of in-flight requests before :meth:`finish`) show the
mechanism without any timing.

Reuse (ZeRO stages 2-3): the piece that makes reductions progress is :class:`loom.comm.ProgressThread`; a
sharded engine submits each bucket's ``ireduce_scatter`` as ``worker.submit(lambda: comm.ireduce_scatter(x))``
from its hooks, in bucket order, and waits on the tickets where it needs the shard gradients.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import torch

from .. import settings
from .. import stats as _stats
from ..comm import Communicator, ProgressThread, Request, Ticket
from ..comm import buffers as _b

__all__ = ["GradHook", "GradReducer", "PROGRESS_MODES", "HOST_STAGING", "allreduce_hook", "check_progress",
           "default_progress", "dp_stats", "reset_dp_stats", "stages_through_host"]

GradHook = Callable[[torch.Tensor, Communicator, int], torch.Tensor]

PROGRESS_MODES = ("auto", "hooks", "thread")

HOST_STAGING: bool | None = None
"""Whether :class:`GradReducer` and :class:`loom.parallel.ShardedDataParallel` stage device buffers through host
memory themselves (:func:`stages_through_host`). ``None``: where the buffers are on CUDA and the MPI is not
CUDA-aware. ``True`` takes the staged path on the CPU too (its copies and ordering then run on a CPU-only machine:
``tests/mpi/check_data.py``, ``tests/mpi/check_zero_deep.py``); read when an engine is built."""


def stages_through_host(device: torch.device) -> bool:
    """Whether an engine whose buffers live on ``device`` hands loom.comm host copies it staged itself (with their
    copy events, so that no backward hook waits on the host for a device copy), rather than device tensors that
    loom.comm would copy to the host with a host wait per call (or hand to a CUDA-aware MPI as they are)."""
    if HOST_STAGING is not None:
        return HOST_STAGING
    return torch.device(device).type == "cuda" and not _b.cuda_aware()

_COUNTERS = ("exposed_comm_s", "overlapped_comm_s", "buckets", "posted_in_backward", "tests_in_backward")


def dp_stats() -> dict[str, float]:
    """Every :class:`GradReducer` of this process, summed over steps: seconds backward was held up by the
    reduction (``exposed_comm_s``), seconds of reduction hidden behind backward (``overlapped_comm_s``), and the
    mechanism counts (``buckets``, ``posted_in_backward``, ``tests_in_backward``); see the module docstring."""
    d = _stats.counters("time", "dp")  # a registry view
    return {k: d.get(k, 0.0) for k in _COUNTERS}


def reset_dp_stats() -> None:
    _stats.counters("time", "dp").clear()


def allreduce_hook(flat: torch.Tensor, comm: Communicator, bucket_index: int) -> torch.Tensor:
    """The default gradient hook: the mean of ``flat`` over ``comm`` (one allreduce)."""
    return comm.allreduce(flat, op="avg")


def check_progress(progress: str) -> None:
    """Refuse a ``progress=`` that is not one of :data:`PROGRESS_MODES`, or ``"thread"`` where MPI allows no
    second thread."""
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress={progress!r} is not one of {', '.join(PROGRESS_MODES)}")
    if progress == "thread" and not ProgressThread.available():
        raise ValueError("progress='thread' needs MPI at MPI_THREAD_MULTIPLE (mpi4py's default level; was "
                         "mpi4py.rc.thread_level changed?); use progress='hooks'")


def default_progress() -> str:
    """``"thread"`` when each rank on this node has a core for a progress thread beside its torch threads
    (``cores >= local ranks x (torch threads + 1)``) and MPI allows a second thread, else ``"hooks"``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    info = settings.launch_info()
    local = (info.local_size if info is not None and info.local_size else None) or (info.size if info else 1)
    if cores >= local * (torch.get_num_threads() + 1) and ProgressThread.available():
        return "thread"
    return "hooks"


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= max(a, end):  # empty (a bucket the thread posted only after finish began), or covered
            continue
        total += b - max(a, end)
        end = b
    return total


class GradReducer:
    """Average the gradients of ``params`` over ``comm`` as backward produces them.

    Args:
        params: this rank's trainable tensors (the same list, in the same order, on every replica).
        comm: the data-parallel communicator (the reducer duplicates it: collective, every replica constructs).
        grad_hook: ``hook(flat, comm, bucket_index) -> mean over comm`` (blocking); ``None`` uses a
            non-blocking in-place ``iallreduce(op="avg")``.
        bucket_mb: bucket size cap in MiB.
        progress: ``"auto"``, ``"hooks"`` or ``"thread"``: how reductions move during backward (module
            docstring); the choice made is :attr:`progress`.

    Attributes:
        last: the last finished step's accounting (``exposed_s``, ``overlapped_s``, ``buckets``,
            ``posted_in_backward``, ``tests_in_backward``, ``first_posted_at``: how many gradient hooks had run
            when bucket 0 was launched, ``hooks``: gradient hooks in the step).
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Communicator, *, grad_hook: GradHook | None = None,
                 bucket_mb: float = 25.0, progress: str = "auto"):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0")
        check_progress(progress)
        # The reductions run on a private duplicate: a progress thread posts them at moments of its own, which
        # must not interleave with the caller's collectives on ``comm`` in a different order on each rank.
        self.comm = comm.dup() if comm.size > 1 else comm
        self.hook = grad_hook
        self.progress = default_progress() if progress == "auto" else progress
        if comm.size == 1 and progress == "auto":
            self.progress = "hooks"  # nothing travels: no thread
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
        self._worker: ProgressThread | None = None
        # Device buffers without a CUDA-aware MPI: staged through the host here (module docstring, "devices").
        self._staged = (self.hook is None and comm.size > 1 and bool(self.buffers)
                        and stages_through_host(self.buffers[0].device))
        self._reset_step()
        self.expected = 1
        self.armed = False
        self.last: dict[str, float] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _reset_step(self) -> None:
        n = len(self.buckets)
        self._counts = [0] * len(self.params)
        self._used = [False] * len(self.params)
        self._had_grad = [False] * len(self.params)
        self._ready = [0] * n
        self._results: list[Request | Ticket | torch.Tensor | None] = [None] * n
        self._posted = [0.0] * n
        self._seen_done: list[float | None] = [None] * n
        self._tests = 0
        self._hooks = 0
        self._first_posted_at = -1
        self._blocked = 0.0  # seconds of blocking hooks run inside backward
        self._next = 0
        self._host: list[torch.Tensor | None] = [None] * n  # staged: each bucket's host copy, reduced in place
        self._copies: list[tuple[int, object]] = []  # staged: (bucket, copy event) launched, not yet posted

    @property
    def live(self) -> dict[str, int]:
        """This step so far (mechanism counts, no timing): buckets launched, tests of in-flight requests,
        gradient hooks run, and how many hooks had run when bucket 0 was launched (-1: not yet)."""
        tests = self._tests + sum(r.tests for r in self._results if isinstance(r, Ticket))
        return {"posted": self._next, "tests": tests, "hooks": self._hooks, "first_posted_at": self._first_posted_at}

    def start(self, expected: int) -> None:
        """Arm for one step in which each tensor is accumulated ``expected`` times.

        Every ``.grad`` becomes its slice of the bucket buffer, keeping its value (zero where it was ``None``).
        """
        self._reset_step()
        self.expected = expected
        self._had_grad = [p.grad is not None for p in self.params]
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

    def prepare(self, *outputs: torch.Tensor) -> None:
        """Before a backward from ``outputs``: count every tensor this backward cannot reach as accumulated
        (as DDP's ``find_unused_parameters`` after forward), so that a bucket holding a tensor unused on this
        replica is launched during backward instead of at :meth:`finish`. Optional: without it such a bucket,
        and every bucket after it, waits for :meth:`finish` (still exact, less overlap)."""
        if not self.armed:
            return
        reached: set[int] = set()
        seen: set = set()
        stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it writes
            if var is not None:
                reached.add(id(var))
            stack.extend(f for f, _ in fn.next_functions)
        for p in self.params:
            if id(p) not in reached:
                self._count(p)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self._hooks += 1
        self._used[self._where[id(p)][1]] = True
        self._count(p)
        if self._copies:
            self._post_staged(block=False)
        if self.progress == "hooks":
            self._test_inflight()

    def _count(self, p: torch.Tensor) -> None:
        i, k = self._where[id(p)]
        c = self._counts[k] + 1
        self._counts[k] = c
        if c == self.expected:
            self._ready[i] += 1
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1

    def _test_inflight(self) -> None:
        """Test every posted, not yet complete request once (MPICH moves it only inside an MPI call)."""
        for j in range(self._next):
            res = self._results[j]
            if isinstance(res, Request) and self._seen_done[j] is None:
                self._tests += 1
                if res.test():
                    self._seen_done[j] = time.perf_counter()

    def _launch(self, i: int) -> None:
        buf = self.buffers[i]
        for p, v in zip(self.buckets[i], self._views[i]):
            g = p.grad
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr():
                v.copy_(g)  # the gradient was replaced after start(): bring it into the bucket
        if self._first_posted_at < 0:
            self._first_posted_at = self._hooks
        self._posted[i] = time.perf_counter()
        if self._staged:  # copied to the host on a side stream; posted once there (_post_staged)
            src = buf if buf.dtype == _b.reduction_dtype(buf) else buf.to(_b.reduction_dtype(buf))  # widened here
            self._host[i], ev = _b.stage_out(src)
            self._copies.append((i, ev))
            self._post_staged(block=False)
        elif self.progress == "thread":
            if self._worker is None:
                self._worker = ProgressThread(name=f"loom-dp-progress-{self.comm.name}")
            self._results[i] = self._worker.submit(self._task(i))
        elif self.hook is None:
            self._results[i] = self.comm.iallreduce(buf, op="avg", out=buf)
        else:
            self._run_hook(i)
            now = time.perf_counter()
            self._seen_done[i] = now
            if self.armed:  # inside backward: backward waited for it
                self._blocked += now - self._posted[i]

    def _post_staged(self, block: bool) -> None:
        """Post the allreduces of the staged buckets whose copies to the host are done, in launch order (the same
        on every replica); ``block``: wait for the copies (at :meth:`finish`, never from a hook)."""
        while self._copies:
            i, ev = self._copies[0]
            if block:
                _b.wait_copy(ev)
            elif not _b.copy_done(ev):
                return
            self._copies.pop(0)
            host = self._host[i]
            post = lambda host=host: self.comm.iallreduce(host, op="avg", out=host)  # noqa: E731
            if self.progress == "thread":
                if self._worker is None:
                    self._worker = ProgressThread(name=f"loom-dp-progress-{self.comm.name}")
                self._results[i] = self._worker.submit(post)
            else:
                self._results[i] = post()

    def _land(self) -> None:
        """Staged: every bucket's mean back into its device buffer, on the host->device side stream; the compute
        stream waits for each copy on the device (a widened bucket is narrowed there), not the host."""
        for i, host in enumerate(self._host):
            if host is None:
                continue
            buf = self.buffers[i]
            if host.dtype == buf.dtype:
                _b.use_after(_b.stage_in(host, buf), buf)
            else:
                tmp = _b.side_empty(tuple(host.shape), host.dtype, buf.device)
                _b.use_after(_b.stage_in(host, tmp, fresh=True), tmp)
                buf.copy_(tmp)
        self._host = [None] * len(self.buckets)

    def _run_hook(self, i: int) -> torch.Tensor:
        buf = self.buffers[i]
        mean = self.hook(buf, self.comm, i)
        if mean is not buf:
            buf.copy_(mean)
        return buf

    def _task(self, i: int) -> Callable[[], object]:
        """What the progress thread runs for bucket ``i``: post its allreduce, or run the blocking hook."""
        if self.hook is None:
            buf = self.buffers[i]
            return lambda: self.comm.iallreduce(buf, op="avg", out=buf)
        return lambda: self._run_hook(i)

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all; ``.grad`` holds the mean (see the module docstring)."""
        t0 = time.perf_counter()
        posted_in_backward = self._next
        tests = self.live["tests"]  # before finish
        used = torch.tensor(self._used, dtype=torch.int32, device="cpu")
        self.armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._post_staged(block=True)
        if self.comm.size > 1:
            if self._worker is not None:  # after the buckets on the same thread: one collective order
                used = self._worker.submit(lambda: self.comm.allreduce(used)).wait()
            else:
                used = self.comm.allreduce(used)
        for j, res in enumerate(self._results):
            if isinstance(res, Ticket):
                res.wait()
                if res.done_at is not None and res.posted_at is not None:
                    self._posted[j] = res.posted_at
                    self._seen_done[j] = res.done_at
            elif isinstance(res, Request):
                res.wait()
        t1 = time.perf_counter()
        if self._staged:
            self._land()
        overlapped = _union([(self._posted[j], min(self._seen_done[j] or t0, t0)) for j in range(posted_in_backward)
                             if not (self.progress == "hooks" and self.hook is not None)])
        exposed = t1 - t0 + self._blocked
        self.last = {"exposed_s": exposed, "overlapped_s": overlapped, "buckets": len(self.buckets),
                     "posted_in_backward": posted_in_backward, "tests_in_backward": tests,
                     "first_posted_at": self._first_posted_at, "hooks": self._hooks}
        _stats.add("time", "dp", exposed_comm_s=exposed, overlapped_comm_s=overlapped, buckets=len(self.buckets),
                   posted_in_backward=posted_in_backward, tests_in_backward=tests)
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
        """Take the hooks off the tensors and stop the progress thread."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self.comm.size > 1:
            self.comm.free()
