"""Gradient reduction (stages 1-3): per-bucket reduce-scatters posted from backward, moved, compressed, consumed.

One reduce-scatter per bucket, posted as backward completes the bucket, moved by hooks or a progress thread,
compressed on request, and consumed into the shards' gradients as it completes.

Communication: gathers and reduce-scatters run on two duplicates of the group, so each keeps its own order.
MPICH makes no asynchronous progress, so posted reduce-scatters move only when tested (``progress=``, chosen
as :class:`loom.parallel.data.GradReducer` chooses, by :func:`loom.parallel.data.default_progress`):
``"hooks"``: every hook tests the outstanding requests (:meth:`GradReduction.test`, no thread, progress at hook
times only); ``"thread"``: a :class:`loom.comm.ProgressThread` posts each reduce-scatter and tests it while
backward computes (a core while one is in flight); gathers are tested from hooks in both modes. A
reduce-scatter is consumed (added into the block's gradient, its buffers dropped) as soon as it completes.
No hook waits for a reduce-scatter: a peer that never used a parameter (a branch taken on some ranks only)
posts that bucket's reduce-scatter only at the end of its backward, and before that it may wait for a gather
this rank would post only after the wait; so the reduce-scatters of a backward are waited for at its end (an
autograd engine callback, when every rank has posted all of its own;
:meth:`~loom.parallel.ShardedDataParallel.sync_grads`), and their buffers are bounded by the peers' progress
rather than by a count (stage 1, which posts outside backward, keeps at most ``MAX_PENDING`` outstanding). Time
spent blocked on a request is *exposed* communication, counted in :func:`loom.parallel.zero.zero_stats`, which
also holds, as :func:`loom.parallel.data.dp_stats` does, the reduce-scatter time hidden behind backward
(``overlapped_comm_s``: posted in backward, not yet seen complete when the step's ``sync_grads`` began) and the
mechanism counts (``buckets``, ``posted_in_backward``, ``tests_in_backward``);
:attr:`~loom.parallel.ShardedDataParallel.last` has the last step's.

Compression (``compress=``, a :class:`loom.compress.CompressionPolicy` or preset name), ZeRO++ style: the
gradient reduce-scatter uses the policy's ``dp`` codec (``hybrid``: int4) with its error feedback: each
bucket's gradient plus the residual of the last step is encoded block by block for the other ranks (this
rank's own block stays exact), one non-blocking ``ialltoallv`` of the bytes (every block encodes to the
codec's fixed wire size, so no counts are exchanged), each rank decodes and sums its block; what the encoding
dropped is this rank's new residual. A gradient codec without a fixed wire size runs its reduce-scatters after
backward. The residuals live with the shard and are saved in its checkpoint file (restored when loaded at the
same group size; at another size the layout they refer to is gone and they start from zero). The parameter
gathers' codec (``param_codec``) is :mod:`loom.parallel.zero.gather`'s.

Reductions are sums in the master dtype (a bf16 gradient is reduced in float32: MPI has no bf16 sum),
scaled by ``1 / P`` (``reduce="avg"``) or not (``"sum"``). A parameter without a gradient counts as a zero
gradient (as one process with ``zero_grad(set_to_none=False)``): a stateful optimizer still moves it; with
``missing_grad="skip"`` a bucket no rank produced a gradient for is skipped by the optimizer instead.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ... import stats as _stats
from ...comm import Communicator, ProgressThread, Request, Ticket
from ..data import _union
from .buckets import _Bucket
from .norms import _shard_grad, _ShardGrad
from .requests import _RS, _Then, _wait
from .staging import GradStaging, to_device

MAX_PENDING = 1  # outstanding gradient reduce-scatters (each holds a bucket's padded gradient)


def compression(compress: Any, param_codec: str | None, stage: int) -> tuple[Any, Any, Any]:
    """``(grad_codec, param_codec, error_feedback)`` for ``compress=`` and ``param_codec=`` at ``stage``."""
    if compress is None:
        if param_codec is not None:
            raise ValueError("param_codec needs compress= (a CompressionPolicy or preset name)")
        return None, None, None
    from ...compress import CompressionPolicy, ErrorFeedback, get_codec

    policy = CompressionPolicy.preset(compress) if isinstance(compress, str) else compress
    if not isinstance(policy, CompressionPolicy):
        raise TypeError(f"compress must be a loom.compress.CompressionPolicy or a preset name, got "
                        f"{type(compress).__name__}")
    if stage < 2:
        raise ValueError(f"compress needs stage 2 or 3 (the reduce-scatter it compresses), got stage {stage}")
    grad_codec = policy.codec_for("dp")
    if grad_codec is not None and grad_codec.name == "powersgd":
        raise ValueError("compress: powersgd needs whole matrices; a reduce-scatter of flat blocks cannot use "
                         "it; choose a blockwise dp codec (int4, int8) or another policy")
    error_feedback = ErrorFeedback() if policy.error_feedback and grad_codec is not None else None
    gather_codec = None
    if stage == 3 and (param_codec or grad_codec is not None):
        gather_codec = get_codec(param_codec or "int8")
    return grad_codec, gather_codec, error_feedback


class GradReduction:
    """The gradient reduce-scatters of one :class:`~loom.parallel.ShardedDataParallel` (``sdp``, whose buckets,
    shards, dtypes, ``scale`` and progress mode it reads): posting them as buckets complete (plain, staged through
    the host or compressed), testing them, adding each into its shard's gradient as it completes, and the step's
    accounting (:attr:`last`, :attr:`live`). ``comm``: the group's duplicate they run on, in their own order
    (``None`` at stage 0, which reduces with :class:`loom.parallel.data.GradReducer`)."""

    def __init__(self, sdp: Any, comm: Communicator | None):
        self.sdp = sdp
        self.comm = comm
        self.worker: ProgressThread | None = None
        self.pending: list[_RS] = []
        self.step_rs: list[_RS] = []  # this step's reduce-scatters, for the accounting in sync_grads
        self.tests = 0  # tests of outstanding reduce-scatters from hooks during backward (hooks mode)
        self.at_bwd_end: dict[str, int] = {}  # `live` when this step's first backward ended
        self.last: dict[str, float] = {}
        self.deferred: list[tuple[_Bucket, torch.Tensor]] = []  # compressed reduce-scatters run after backward
        self.next = -1  # the next bucket this backward posts (buckets strictly in descending order)
        self.accumulating = False  # a backward ran since the last reduction (missing_grad="skip" flags)
        self.staging = GradStaging(self._posted)

    # ------------------------------------------------------------------ posting
    def submit(self, post: Callable[[], Request]) -> "Request | Ticket":
        """Post a collective on the reduce-scatter communicator: here (``"hooks"``), or on the progress thread,
        which then tests it while backward computes (``"thread"``; every post goes there, so one thread issues
        them in order)."""
        if self.sdp.progress != "thread":
            return post()
        if self.worker is None:
            self.worker = ProgressThread(name=f"loom-zero-progress-{self.sdp.comm.name}")
        return self.worker.submit(post)

    def track(self, x: _RS) -> None:
        self.pending.append(x)
        self.step_rs.append(x)
        _stats.add("time", "zero", reduce_scatters=1)

    def _posted(self, index: int, req: Any, in_hook: bool) -> None:
        """A staged gradient's collective, posted once its copy to the host was done."""
        self.track(_RS(index, req, in_hook and self.sdp._bwd_open))

    def flat_grad(self, b: _Bucket) -> torch.Tensor:
        """The bucket's padded flat gradient: stage 2's, filled as the gradients arrived; stage 3's built now
        from the parameters' ``.grad`` (a missing one counts as zeros), which are dropped."""
        sdp = self.sdp
        grad, b.grad = b.grad, None
        if grad is None:
            sdp._progress()  # consume completed reduce-scatters first: their buffers go before this one comes
            grad = torch.zeros(b.padded, dtype=sdp.master_dtype, device=sdp.device)
        if sdp.stage == 3:
            for p, off in zip(b.params, b.offsets):
                if p.grad is not None:
                    grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
        return grad

    def post(self, b: _Bucket, in_hook: bool = False) -> None:
        """Post bucket ``b``'s reduce-scatter (stages 2-3)."""
        grad = self.flat_grad(b)
        codec = self.sdp.grad_codec
        if codec is not None:
            if codec.wire_bytes(b.shard, grad.dtype) is None:
                self.deferred.append((b, grad))  # a blocking collective: after backward (sync_grads)
                b.posted = True
                return
            req = self.compressed(b, grad, in_hook)
        elif self.sdp._staged:
            self.staging.put(b.index, grad, in_hook, lambda h: self.submit(lambda: self.comm.ireduce_scatter(h)))
            req = None
        else:
            req = self.submit(lambda: self.comm.ireduce_scatter(grad))
        if req is not None:
            self.track(_RS(b.index, req, in_hook))
        b.posted = True

    def post_ready(self) -> None:
        """Post the complete buckets from the next one down, strictly in descending order."""
        buckets = self.sdp.buckets
        while self.next >= 0:
            b = buckets[self.next]
            if b.ready < len(b.params):
                return
            self.post(b, in_hook=True)
            self.next -= 1

    def post_rest(self) -> None:
        """End of a backward: note the step's progress so far (:attr:`live`, at the first backward of a step),
        then post the buckets not posted yet (a missing gradient counts as zeros)."""
        if not self.at_bwd_end:
            self.at_bwd_end = self.live
        while self.next >= 0:
            self.post(self.sdp.buckets[self.next])
            self.next -= 1

    def post_stage1(self) -> None:
        """Stage 1, after backward: every bucket's full gradients flattened and reduce-scattered, at most
        ``MAX_PENDING`` outstanding."""
        sdp = self.sdp
        for b in sdp.buckets:
            grads = [p.grad for p in b.params]
            b.had = [h or g is not None for h, g in zip(b.had, grads)]
            if all(g is None for g in grads):
                flat = torch.zeros(b.padded, dtype=sdp.master_dtype, device=sdp.device)
            else:
                flat = b.flat(grads, sdp.master_dtype, sdp.device)
            if sdp._staged:  # the next bucket's copy is queued while this one's waits
                self.staging.put(b.index, flat, False, lambda h: self.submit(lambda: self.comm.ireduce_scatter(h)))
                self.staging.flush(block=True, keep=1)
            else:
                self.track(_RS(b.index, self.submit(lambda flat=flat: self.comm.ireduce_scatter(flat)), False))
            for p in b.params:
                p.grad = None
            self.drain(MAX_PENDING)

    def compressed(self, b: _Bucket, grad: torch.Tensor, in_hook: bool = False) -> "Request | _Then | None":
        """This rank's block of the sum of ``grad`` over the group, other ranks' blocks sent encoded: one
        non-blocking ``ialltoallv`` of the bytes (every block encodes to the codec's fixed wire size, so the
        receive counts are known without asking), decoded and summed when it completes. A codec without a
        fixed size (zstd) needs its counts exchanged first, a blocking collective: then it runs at once,
        and :meth:`post` keeps it out of backward. On the staged path the encoded bytes are queued for the host
        (:class:`GradStaging`; ``None`` is returned) and the received bytes come back to the device to be decoded."""
        sdp = self.sdp
        codec, ef, comm = sdp.grad_codec, sdp.error_feedback, self.comm
        y = ef.apply(b.index, grad) if ef is not None else grad
        r, n = comm.rank, b.shard
        residual = torch.zeros_like(y) if ef is not None else None
        wire = codec.wire_bytes(n, y.dtype)
        chunks, counts = [], []
        for j in range(comm.size):
            if j == r:
                counts.append(0)
                continue
            pkt = codec.encode(y[j * n:(j + 1) * n])
            chunks.append(pkt.data)
            counts.append(pkt.nbytes)
            if wire is not None and pkt.nbytes != wire:
                raise RuntimeError(f"codec {codec!r} encoded {n} elements into {pkt.nbytes} bytes, not the "
                                   f"{wire} its wire_bytes() states; the receive counts would disagree")
            if residual is not None:
                residual[j * n:(j + 1) * n] = y[j * n:(j + 1) * n] - codec.decode(pkt).to(y.dtype)
        if ef is not None:
            ef.set(b.index, residual)
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=y.device)
        own = y[r * n:(r + 1) * n].clone()

        def decode(got):
            recv, rc = got
            if recv.device != own.device:  # staged: received on the host
                recv = to_device(recv, sdp.device)
            acc, off = own, 0
            for j, c in enumerate(rc):
                if j != r:
                    acc += codec.decode(codec.from_wire(recv[off:off + c], (n,), y.dtype)).to(y.dtype)
                off += c
            return acc

        if wire is None:
            return _Then(self.submit(lambda: Request.completed(comm.alltoallv(send, counts),
                                                               what="compressed reduce-scatter")), decode)
        rc = [0 if j == r else wire for j in range(comm.size)]
        if sdp._staged:
            self.staging.put(b.index, send, in_hook,
                             lambda h: _Then(self.submit(lambda: comm.ialltoallv(h, counts, rc)), decode))
            return None
        return _Then(self.submit(lambda: comm.ialltoallv(send, counts, rc)), decode)

    # ------------------------------------------------------------------ completion
    def add(self, i: int, g: torch.Tensor) -> None:
        """Add a reduced block into shard ``i``'s gradient, scaled by the wrapper's ``scale``."""
        sdp = self.sdp
        if sdp._staged:
            g = to_device(g, sdp.device)
        sh = sdp.shards[i]
        if sh.grad is None:
            sh.grad = g.mul_(sdp.scale) if sdp.scale != 1.0 else g
        else:
            sh.grad.add_(g, alpha=sdp.scale)

    def drain(self, limit: int | None) -> None:
        """Consume completed reduce-scatters in posting order; wait until at most ``limit`` are outstanding
        (``None``: never wait, for hooks, which run while peers may still be in their backward)."""
        pending = self.pending
        while pending and (limit is not None and len(pending) > limit or pending[0].test()):
            x = pending.pop(0)
            self.add(x.index, _wait(x.req))

    def test(self) -> None:
        """Post the staged gradients whose copies are done, test every outstanding reduce-scatter once and
        consume those complete (never waits)."""
        self.staging.flush(block=False)
        for x in self.pending:
            if self.sdp._bwd_open and not isinstance(x.req, Ticket):
                self.tests += 1
            x.test()
        self.drain(None)

    def finish(self) -> None:
        """Wait for this step's reduce-scatters (the deferred compressed ones run now) and account for them;
        then every shard's gradient is complete: zeros where no gradient reached it, ``None`` where
        ``missing_grad="skip"`` skips its bucket, and a norm of it is the bucket's over the group."""
        for b, grad in self.deferred:
            self.pending.append(_RS(b.index, self.compressed(b, grad), False))  # no fixed size: not staged
        self.deferred.clear()
        self.tests = self.live["tests"]  # the progress thread's tests before the wait
        t0 = time.perf_counter()
        self.staging.flush(block=True)
        self.drain(0)
        self.account(t0, time.perf_counter())
        sdp = self.sdp
        skip = self.skipped() if sdp.missing_grad == "skip" else set()
        self.accumulating = False
        for i, sh in enumerate(sdp.shards):
            if i in skip:
                sh.grad = None
            elif sh.grad is None:  # no gradient reached it this step: zero, the same on every rank
                sh.grad = _shard_grad(torch.zeros_like(sh), sdp.comm)
            elif type(sh.grad) is not _ShardGrad:
                sh.grad = _shard_grad(sh.grad, sdp.comm)

    def wait_all(self) -> None:
        """Wait for every reduce-scatter in flight, staged ones included (MPI still reads their buffers)."""
        self.staging.flush(block=True)
        self.drain(0)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    # ------------------------------------------------------------------ missing gradients
    def fresh_accumulation(self) -> None:
        """The first backward after a reduction begins: a bucket whose shard gradient is ``None`` may stay
        ``None`` (``fresh``); one holding a gradient (earlier backward calls, or zeros from the optimizer's
        ``zero_grad(set_to_none=False)``) keeps it, as torch keeps a ``.grad`` that nothing adds to."""
        if self.accumulating:
            return
        self.accumulating = True
        for b, sh in zip(self.sdp.buckets, self.sdp.shards):
            b.fresh = sh.grad is None
            b.had = [False] * len(b.params)

    def skipped(self) -> set[int]:
        """``missing_grad="skip"``: the buckets whose shard gradient stays ``None`` (no rank produced a gradient
        for any of its parameters since it was ``None``), agreed by every rank (one allreduce of a flag per
        parameter). A bucket some of whose parameters got a gradient and others none cannot be skipped in part
        (the optimizer steps a shard whole): refused by name, on every rank alike."""
        sdp = self.sdp
        had = torch.tensor([h for b in sdp.buckets for h in b.had], dtype=torch.int32, device="cpu")
        had = sdp.comm.allreduce(had, op="max") if sdp.comm.size > 1 else had
        flags, skip, off = had.tolist(), set(), 0
        for b in sdp.buckets:
            mine, off = flags[off:off + len(b.params)], off + len(b.params)
            if b.fresh and not any(mine):
                skip.add(b.index)
            elif b.fresh and not all(mine):
                without = [n for n, h in zip(b.names, mine) if not h]
                with_ = [n for n, h in zip(b.names, mine) if h]
                raise ValueError(
                    f"missing_grad='skip': bucket {b.index} holds parameters with a gradient this step ({with_[:3]}) "
                    f"and without one on every rank ({without[:3]}); the optimizer steps a bucket's shard whole, so "
                    f"it cannot skip {without[0]!r} alone. Buckets hold one module's parameters under 'skip': "
                    f"use that module's parameters together, or pass missing_grad='zero' (a missing gradient "
                    f"counts as zeros)")
        return skip

    # ------------------------------------------------------------------ accounting
    def account(self, t0: float, t1: float) -> None:
        """This step's reduce-scatter accounting (:attr:`last`, :func:`loom.parallel.zero.zero_stats`);
        ``t0``-``t1``: blocked in ``sync_grads`` waiting for them."""
        rs, self.step_rs = self.step_rs, []
        inb = [x for x in rs if x.in_backward]
        self.last = {"exposed_s": t1 - t0, "overlapped_s": _union([x.interval(t0) for x in inb]),
                     "buckets": len(rs), "posted_in_backward": len(inb), "tests_in_backward": self.tests,
                     "first_tests": self.at_bwd_end.get("first_tests", 0),
                     "first_done": self.at_bwd_end.get("first_done", 0)}
        _stats.add("time", "zero", overlapped_comm_s=self.last["overlapped_s"], buckets=len(rs),
                   posted_in_backward=len(inb), tests_in_backward=self.tests)
        self.tests, self.at_bwd_end = 0, {}

    @property
    def live(self) -> dict[str, int]:
        """This step's reduce-scatters so far (mechanism counts, no timing): posted from gradient hooks, tests
        of outstanding ones during backward (hooks or progress thread), and the first posted one's tests and
        whether it was seen complete."""
        rs = self.step_rs
        first = rs[0] if rs and rs[0].in_backward else None
        tickets = sum(x.tested for x in rs if isinstance(x.req, Ticket))
        done = first is not None and (first.seen is not None or isinstance(first.req, Ticket) and first.req.done)
        return {"posted": sum(x.in_backward for x in rs), "tests": self.tests + tickets,
                "first_tests": first.tested if first is not None else 0, "first_done": int(done)}
