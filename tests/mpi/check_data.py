"""GradReducer (plain and compressed data parallel) on real ranks, in both progress modes (``hooks``, ``thread``).

Every check compares with a single-process reference on random fp64 data: the full-batch gradient (exact to
1e-9), the mean of every replica's local gradient where branches are skipped on some ranks only (a tensor
without a gradient on one replica must neither hang nor desynchronise the replicas; unused everywhere keeps
``grad=None``), gradient accumulation over micro-batches (nothing launched before the last), and the compressed
path within its codec's stated error bound, with error feedback keeping exactly what the codec dropped. A
mechanism check (no timing) shows that the first bucket's reduction is posted and tested while backward runs.
The path CUDA buffers take without a CUDA-aware MPI (staged through the host by the reducer) runs on the CPU
(``data.HOST_STAGING``) and equals one process too.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from loom.parallel import data
from loom.parallel.data import GradReducer, allreduce_hook, dp_stats
from loom.testing import mpi_checks

WIDTHS = (5, 9, 4, 12, 7, 3, 11, 6, 8, 5, 10, 4, 9, 6)  # 13 layers of uneven size: uneven buckets
MODES = ("hooks", "thread")
TOL = 1e-9


class Deep(nn.Module):
    """13 ``Linear + tanh`` layers, each with a residual side branch that ``skip`` leaves out, and a layer
    nothing uses."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.side = nn.ModuleList(nn.Linear(b, b) for b in WIDTHS[1:])
        self.never = nn.Linear(3, 3)

    def forward(self, x, skip=()):
        for k, (lin, side) in enumerate(zip(self.layers, self.side)):
            x = torch.tanh(lin(x))
            if k not in skip:
                x = x + 0.5 * side(x)
        return x


def _model(seed: int = 0) -> Deep:
    torch.manual_seed(seed)
    return Deep().double()


def _batch(comm, rows: int, step: int):
    """The global batch of ``step`` (the same on every rank) and this rank's rows of it."""
    g = torch.Generator().manual_seed(1000 + step)
    n = rows * comm.size
    x = torch.randn(n, WIDTHS[0], generator=g, dtype=torch.float64)
    y = torch.randn(n, WIDTHS[-1], generator=g, dtype=torch.float64)
    mine = slice(comm.rank * rows, (comm.rank + 1) * rows)
    return x, y, x[mine], y[mine]


def _skip(rank: int) -> set[int]:
    return {k for k in range(len(WIDTHS) - 1) if (k + rank) % 3 == 0}


def _local_grads(model: Deep, x, y, skip=()) -> list[torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x, skip), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _close(got, want, what) -> None:
    assert (got is None) == (want is None), (what, got is None, want is None)
    if got is not None:
        err = (got - want).abs().max().item()
        assert err < TOL, (what, err)


def check_matches_one_process_deep(comm):
    """13 layers in many uneven buckets, fp64: the reduced gradients (and two SGD steps) equal one process on
    the global batch, to 1e-9; both progress modes, the non-blocking allreduce and a blocking hook."""
    for mode in MODES:
        for hook in (None, allreduce_hook):
            model, ref = _model(), _model()
            params = list(model.parameters())
            red = GradReducer(params, comm, grad_hook=hook, bucket_mb=700 * 8 / 2**20, progress=mode)
            assert red.progress == mode and len(red.buckets) >= 3, len(red.buckets)
            sizes = {b.numel() for b in red.buffers}
            assert len(sizes) > 1, "buckets should be uneven"
            opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
            for step in range(2):
                x, y, xl, yl = _batch(comm, 3, step)
                opt.zero_grad(set_to_none=True)
                red.start(1)
                nn.functional.mse_loss(model(xl), yl).backward()
                red.finish()
                want = _local_grads(ref, x, y)
                for j, (p, w) in enumerate(zip(params, want)):
                    _close(p.grad, w, (mode, hook is not None, step, j))
                opt.step()
                ref_opt.step()
            red.remove()


def _skipping_step(comm, model, red, opt, refs, step, prepare, what) -> None:
    """One step of ``model`` (each rank skipping its own branches) reduced by ``red``: every gradient is the mean
    of the replicas' local ones, simulated on ``refs`` (a missing one counts as zero; ``None`` where no replica
    had one); then the Adam step, which the references follow as every replica does."""
    params = list(model.parameters())
    x, y, xl, yl = _batch(comm, 2, step)
    opt.zero_grad(set_to_none=True)
    red.start(1)
    loss = nn.functional.mse_loss(model(xl, _skip(comm.rank)), yl)
    if prepare:  # the skipped branches' buckets launch during backward, with zeros from this rank
        red.prepare(loss)
    loss.backward()
    red.finish()
    local = [_local_grads(refs[r], x[2 * r:2 * r + 2], y[2 * r:2 * r + 2], _skip(r)) for r in range(comm.size)]
    for j, p in enumerate(params):
        had = [g[j] for g in local if g[j] is not None]
        _close(p.grad, sum(had) / comm.size if had else None, (*what, j))
    opt.step()
    for r in refs:
        for q, p in zip(r.parameters(), params):
            q.data.copy_(p.data)


def check_unused_on_some_ranks(comm):
    """Side branches skipped on some ranks only (each rank its own set) and one layer unused everywhere, with
    and without :meth:`GradReducer.prepare` marking them before backward: no hang, every gradient the mean of
    the replicas' local ones (a missing one counts as zero), ``None`` where no replica had one, replicas
    identical after Adam steps."""
    for mode, prepare in ((m, p) for m in MODES for p in (False, True)):
        model = _model()
        params = list(model.parameters())
        red = GradReducer(params, comm, bucket_mb=500 * 8 / 2**20, progress=mode)
        opt = torch.optim.Adam(params, lr=0.05)
        refs = [_model() for _ in range(comm.size)]  # every replica's local step, simulated here
        for step in range(2):
            _skipping_step(comm, model, red, opt, refs, step, prepare, (mode, step))
        assert model.never.weight.grad is None
        mine = torch.cat([p.detach().reshape(-1) for p in params])
        assert all(torch.equal(mine, other) for other in comm.allgather_object(mine)), "replicas diverged"
        red.remove()


def check_accumulation_reduces_on_the_last_micro_batch(comm):
    """Three micro-batches per step (``start(3)``), each backward after :meth:`GradReducer.prepare`: nothing is
    launched before the last backward, something during it, and the result equals one process on the global
    batch to 1e-9."""
    for mode in MODES:
        model, ref = _model(), _model()
        params = list(model.parameters())
        red = GradReducer(params, comm, bucket_mb=600 * 8 / 2**20, progress=mode)
        x, y, xl, yl = _batch(comm, 6, 0)
        red.start(3)
        for m in range(3):
            rows = slice(2 * m, 2 * m + 2)
            loss = nn.functional.mse_loss(model(xl[rows]), yl[rows]) / 3
            red.prepare(loss)  # `never` (bucket 0) gets no gradient: counted as done, so bucket 0 can go
            loss.backward()
            if m < 2:
                assert red.live["posted"] == 0, (mode, m, red.live)
        assert red.live["posted"] >= 1, (mode, red.live)  # launched during the last backward
        red.finish()
        for j, (p, w) in enumerate(zip(params, _local_grads(ref, x, y))):
            _close(p.grad, w, (mode, j))
        red.remove()


def check_compressed_within_bound(comm):
    """The compressed path (``loom.compress.dp_hook``, error feedback on) in both modes: every element within
    the codec's stated bound of the exact mean (``(sum_i e(y_i) + e(s)) / P``, ``y_i`` a rank's bucket plus its
    residual, ``s`` the reduced shard), and the residuals, summed over ranks, exactly what the codec dropped."""
    try:
        from loom.compress import CompressionPolicy, dp_hook
    except ImportError:
        return
    if comm.size == 1:
        return
    for codec in ("int8", "bf16"):
        for mode in MODES:
            model, ref = _model(), _model()
            params = list(model.parameters())
            hook = dp_hook(CompressionPolicy(dp=codec, min_bytes=0))
            red = GradReducer(params, comm, grad_hook=hook, bucket_mb=900 * 8 / 2**20, progress=mode)
            c = hook.codec
            for step in range(2):
                x, y, xl, yl = _batch(comm, 3, step)
                before = {i: hook.error_feedback.get(i) for i in range(len(red.buckets))}
                model.zero_grad(set_to_none=True)
                red.start(1)
                nn.functional.mse_loss(model(xl), yl).backward()
                red.finish()
                local = dict(zip(map(id, ref.parameters()), _local_grads(ref, xl, yl)))
                by_id = {id(p): q for p, q in zip(params, ref.parameters())}
                for i, bucket in enumerate(red.buckets):
                    g = torch.cat([(local[id(by_id[id(p)])] if local[id(by_id[id(p)])] is not None
                                    else torch.zeros_like(p)).reshape(-1) for p in bucket])
                    y_i = g if before[i] is None else g + before[i].reshape(-1)
                    ys = torch.stack(comm.allgather_object(y_i))
                    exact = ys.sum(0)
                    got = red.buffers[i]
                    e_in = sum(c.error_bound(t) for t in ys)
                    bound = (e_in + c.error_bound(exact.abs() + e_in)) / comm.size + 1e-12
                    err = (got - exact / comm.size).abs()
                    assert bool((err <= bound).all()), (codec, mode, step, i, (err - bound).max().item())
                    res = torch.stack(comm.allgather_object(hook.error_feedback.get(i).reshape(-1))).sum(0)
                    drop = (exact - got * comm.size - res).abs().max().item()
                    assert drop < TOL, (codec, mode, step, i, drop)
                with torch.no_grad():
                    for p, q in zip(params, ref.parameters()):
                        q.copy_(p)
            red.remove()


def check_reduction_overlaps_backward(comm):
    """The mechanism, not a timing: with 13 layers in small buckets, bucket 0 is launched before backward's
    last gradient hook, and is tested while backward runs (by later hooks, or by the progress thread without
    any call from the training loop); the counters of ``dp_stats()`` record it."""
    if comm.size == 1:
        return
    for mode in MODES:
        model = _model()
        red = GradReducer(list(model.parameters()), comm, bucket_mb=400 * 8 / 2**20, progress=mode)
        assert len(red.buckets) >= 4
        s0 = dp_stats()
        x, y, xl, yl = _batch(comm, 2, 0)
        red.start(1)
        loss = nn.functional.mse_loss(model(xl), yl)
        red.prepare(loss)
        loss.backward()
        live = red.live
        assert live["posted"] >= 1 and 0 < live["first_posted_at"] < live["hooks"], (mode, live)
        if mode == "hooks":
            assert live["tests"] >= 1, live  # tested by the hooks of later layers
        else:
            deadline = time.monotonic() + 120  # a hang guard, not a timing: the thread must test it unprompted
            while red.live["tests"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert red.live["tests"] >= 1, red.live
        red.finish()
        last, s1 = red.last, dp_stats()
        assert last["posted_in_backward"] >= 1 and last["tests_in_backward"] >= 1, (mode, last)
        assert s1["posted_in_backward"] - s0["posted_in_backward"] == last["posted_in_backward"], (s0, s1, last)
        assert s1["buckets"] - s0["buckets"] == len(red.buckets), (s0, s1, last)
        assert last["exposed_s"] >= 0 and last["overlapped_s"] >= 0, last
        red.remove()


class _StagedOnly:
    """The reducer's communicator, refusing any tensor the reducer did not stage on the host itself (a bucket
    buffer handed over as it is would be staged by loom.comm with a host wait inside the hook)."""

    def __init__(self, comm, staged: dict):
        self._comm, self._staged = comm, staged

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def iallreduce(self, t, *args, **kwargs):
        assert t.untyped_storage().data_ptr() in self._staged, "iallreduce was handed an unstaged tensor"
        return self._comm.iallreduce(t, *args, **kwargs)


def check_host_staged_path_matches_one_process(comm):
    """``data.HOST_STAGING = True`` (what CUDA buffers run without a CUDA-aware MPI) on the CPU, both progress
    modes, branches skipped on some ranks (with ``prepare``, so buckets launch during backward): every gradient
    the mean of the replicas' local ones (1e-9), ``None`` where no replica had one; the allreduces see only host
    copies the reducer staged; no hook waits on the host for a staging copy."""
    if comm.size == 1:
        return  # nothing travels: no staging
    staged: dict = {}
    waits = [0]
    saved = data.HOST_STAGING, data._b.stage_out, data._b.wait_copy

    def stage_out(x, out=None):
        host, ev = saved[1](x, out)
        staged[host.untyped_storage().data_ptr()] = host  # kept alive: no later tensor reuses the address
        return host, ev

    def wait_copy(ev):
        waits[0] += torch._C._current_graph_task_id() != -1  # inside backward
        return saved[2](ev)

    data.HOST_STAGING, data._b.stage_out, data._b.wait_copy = True, stage_out, wait_copy
    try:
        for mode in MODES:
            model = _model()
            params = list(model.parameters())
            red = GradReducer(params, comm, bucket_mb=500 * 8 / 2**20, progress=mode)
            assert red._staged, mode
            red.comm = _StagedOnly(red.comm, staged)
            opt = torch.optim.Adam(params, lr=0.05)
            refs = [_model() for _ in range(comm.size)]
            for step in range(2):
                _skipping_step(comm, model, red, opt, refs, step, True, ("staged", mode, step))
            assert red.last["posted_in_backward"] >= 1, red.last
            red.remove()
    finally:
        data.HOST_STAGING, data._b.stage_out, data._b.wait_copy = saved
    assert waits[0] == 0, f"{waits[0]} host waits for a staging copy inside backward"


if __name__ == "__main__":
    mpi_checks(globals())
