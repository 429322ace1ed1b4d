"""loom.comm checks, run on every rank: ``mpiexec -n K python tests/mpi/check_comm.py`` (K = 1..4).

Every operation is compared with a numpy/torch reference computed locally from data every rank can
regenerate (a generator seeded by a fresh base seed and the owning rank), on random data, for several dtypes,
non-contiguous inputs and outputs, zero-length counts and uneven splits.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from loom.comm import Mesh, Request, reset_stats, safety, stats, wait_all
from loom.testing import mpi_checks

BASE = None
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex128]


def data(rank: int, shape, dtype=torch.float64, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s tensor for this check: reproducible on every rank."""
    assert BASE is not None, "check_setup draws the checks' common seed: run LOOM_ONLY=check_setup,<check>"
    g = torch.Generator().manual_seed(BASE * 7919 + rank * 131 + salt)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) if not dtype.is_complex else \
            torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def setup(comm):
    global BASE
    BASE = comm.bcast_object(int(np.random.SeedSequence().entropy % (2**31)) if comm.rank == 0 else None)


def check_setup(comm):
    torch.set_default_dtype(torch.float64)
    setup(comm)
    assert isinstance(BASE, int)


def check_sendrecv_ring(comm):
    p, r = comm.size, comm.rank
    nxt, prv = (r + 1) % p, (r - 1) % p
    for salt, dtype in enumerate(DTYPES):
        x = data(r, (3, 5), dtype, salt)
        out = torch.empty((3, 5), dtype=dtype)
        comm.sendrecv(x, nxt, out, prv, tag=salt)
        assert torch.equal(out, data(prv, (3, 5), dtype, salt)), dtype


def check_send_recv_traps(comm):
    """Transposed sources, strided views, non-contiguous targets, numpy, requires_grad, zero-size."""
    p, r = comm.size, comm.rank
    if p < 2:
        return
    if r == 0:
        a = data(0, (4, 6), salt=1)
        comm.send(a.t(), 1, tag=1)                       # transposed: must arrive in logical order
        comm.send(a[:, ::2], 1, tag=2)                   # strided view: mpi4py alone raises BufferError
        comm.send(a.t().numpy(), 1, tag=3)               # numpy F-order
        comm.send(a.clone().requires_grad_(True), 1, tag=4)
        comm.send(torch.empty(0, 3), 1, tag=5)
        comm.send(a.to(torch.bfloat16), 1, tag=6)
    elif r == 1:
        a = data(0, (4, 6), salt=1)
        out = torch.empty(6, 4)
        comm.recv(out, 0, 1)
        assert torch.equal(out, a.t())
        out2 = torch.empty(4, 3)
        comm.recv(out2, 0, 2)
        assert torch.equal(out2, a[:, ::2])
        out3 = np.empty((6, 4))
        comm.recv(out3, 0, 3)
        np.testing.assert_array_equal(out3, a.t().numpy())
        out4 = torch.empty(4, 6)
        comm.recv(out4, 0, 4)                            # sent from a requires_grad tensor
        assert torch.equal(out4, a)
        comm.recv(torch.empty(0, 3), 0, 5)
        out6 = torch.empty(4, 6, dtype=torch.bfloat16)
        comm.recv(out6, 0, 6)
        assert torch.equal(out6, a.to(torch.bfloat16))
    comm.barrier()


def check_lazy_conjugate_and_negative_views(comm):
    """``z.conj()`` and ``z.conj().imag`` are contiguous views whose memory holds the values before the lazy
    operation: every path that hands a tensor to MPI by address (send, isend, recv into, allreduce fast and
    block-exchange paths, allgather, bcast, alltoall, ``out=``) must move the values the tensor reads."""
    p, r = comm.size, comm.rank
    z = torch.complex(data(0, (3, 5), salt=11), data(0, (3, 5), salt=12))
    zc, im = z.conj(), z.conj().imag
    assert zc.is_conj() and im.is_neg() and zc.is_contiguous()
    for x in (zc, im):
        want = x.resolve_conj().resolve_neg()
        assert torch.equal(comm.allreduce(x), want * p)
        assert torch.equal(comm.allgather(x), torch.cat([want] * p))
        assert torch.equal(comm.bcast(x if r == 0 else torch.zeros_like(want), 0), want)
        rows = x.reshape(1, -1).expand(p, -1).contiguous()
        assert torch.equal(comm.alltoall(rows), want.reshape(1, -1).expand(p, -1))
        out = torch.zeros_like(z).conj() if x.is_complex() else torch.zeros_like(z).conj().imag
        comm.allreduce(x, out=out)                       # a lazy-bit out: written as its values, not its memory
        assert torch.equal(out, want * p)
    from loom.comm import communicator as C

    saved, C._PAIRWISE_MIN = C._PAIRWISE_MIN, 0         # the block-exchange reduction takes tensors by address too
    try:
        assert torch.equal(comm.allreduce(im), im.resolve_neg() * p)
    finally:
        C._PAIRWISE_MIN = saved
    if p < 2:
        return
    if r == 0:
        comm.send(zc, 1, tag=21)
        comm.send(im, 1, tag=22)
        comm.isend(zc, 1, tag=23).wait()
        comm.send(z, 1, tag=24)
    elif r == 1:
        got = torch.empty_like(z)
        assert torch.equal(comm.recv(got, 0, 21), z.conj().resolve_conj())
        got_im = torch.empty(3, 5)
        assert torch.equal(comm.recv(got_im, 0, 22), -z.imag)
        req = comm.irecv(torch.empty_like(z), 0, 23)
        assert torch.equal(req.wait(), z.conj().resolve_conj())
        target = torch.zeros_like(z).conj()              # receive into a conjugate view: it reads back as sent
        comm.recv(target, 0, 24)
        assert torch.equal(target, z)
    comm.barrier()


def check_recv_into_strided_view(comm):
    p, r = comm.size, comm.rank
    if p < 2:
        return
    if r == 0:
        comm.send(data(0, (4, 4), salt=2), 1, tag=7)
    elif r == 1:
        big = torch.full((8, 4), -1.0)
        comm.recv(big[::2], 0, 7)
        assert torch.equal(big[::2], data(0, (4, 4), salt=2))
        assert torch.all(big[1::2] == -1.0)              # untouched rows stay untouched
    comm.barrier()


def check_nonblocking_p2p(comm):
    p, r = comm.size, comm.rank
    outs = [torch.empty(7) for _ in range(p)]
    reqs = [comm.irecv(outs[s], s, tag=11) for s in range(p)]
    reqs += [comm.isend(data(r, (7,), salt=10 + d), d, tag=11) for d in range(p)]
    results = wait_all(reqs)
    for s in range(p):
        assert results[s] is outs[s]
        assert torch.equal(outs[s], data(s, (7,), salt=10 + r))
    # test() polling and await from asyncio
    out = torch.empty(5)
    rq = comm.irecv(out, (r - 1) % p, tag=12)
    sq = comm.isend(data(r, (5,), salt=20), (r + 1) % p, tag=12)

    async def both():
        return await rq, await sq

    got, _ = asyncio.run(both())
    assert got is out and torch.equal(out, data((r - 1) % p, (5,), salt=20))
    assert rq.test() and sq.done
    assert Request.completed(3).wait() == 3


def check_bcast(comm):
    p = comm.size
    for root in range(p):
        for salt, dtype in enumerate([torch.float64, torch.bfloat16, torch.int32]):
            x = data(root, (2, 3), dtype, salt) if comm.rank == root else torch.zeros(2, 3, dtype=dtype)
            y = comm.bcast(x, root)
            assert y is x and torch.equal(x, data(root, (2, 3), dtype, salt))
    # numpy and a non-contiguous target
    big = np.zeros((4, 3))
    comm.bcast(big[::2], 0) if comm.rank else comm.bcast(data(0, (2, 3)).numpy(), 0)
    if comm.rank:
        np.testing.assert_array_equal(big[::2], data(0, (2, 3)).numpy())


def check_allreduce(comm):
    p = comm.size
    for op, ref in [("sum", lambda xs: sum(xs)), ("max", lambda xs: torch.stack(xs).amax(0)),
                    ("min", lambda xs: torch.stack(xs).amin(0)), ("prod", lambda xs: torch.stack(xs).prod(0)),
                    ("avg", lambda xs: sum(xs) / p)]:
        xs = [data(s, (5, 3), salt=30) for s in range(p)]
        got = comm.allreduce(xs[comm.rank], op)
        torch.testing.assert_close(got, ref(xs), rtol=1e-12, atol=1e-12)
    # integers exact
    xi = [data(s, (9,), torch.int64, 31) for s in range(p)]
    assert torch.equal(comm.allreduce(xi[comm.rank]), sum(xi))
    # 16-bit floats: reduced in float32, compared with the float32 reference cast back (1 rounding)
    for dtype in (torch.bfloat16, torch.float16):
        xs = [data(s, (64,), dtype, 32) for s in range(p)]
        got = comm.allreduce(xs[comm.rank])
        ref = sum(x.float() for x in xs).to(dtype)
        assert got.dtype == dtype and torch.equal(got, ref), dtype
    # transposed input and out= (also in place)
    xs = [data(s, (4, 6), salt=33) for s in range(p)]
    got = comm.allreduce(xs[comm.rank].t())
    torch.testing.assert_close(got, sum(xs).t(), rtol=1e-12, atol=1e-12)
    buf = xs[comm.rank].clone()
    assert comm.allreduce(buf, out=buf) is buf
    torch.testing.assert_close(buf, sum(xs), rtol=1e-12, atol=1e-12)
    # numpy
    npx = [data(s, (3,), salt=34).numpy() for s in range(p)]
    np.testing.assert_allclose(comm.allreduce(npx[comm.rank]), sum(npx), rtol=1e-12)
    # results identical on every rank (bitwise)
    everyone = comm.allgather(got.reshape(1, -1).contiguous())
    assert all(torch.equal(everyone[0], e) for e in everyone)


def check_reduce_scatter(comm):
    p = comm.size
    xs = [data(s, (2 * p, 3), salt=40) for s in range(p)]
    got = comm.reduce_scatter(xs[comm.rank])
    torch.testing.assert_close(got, sum(xs)[2 * comm.rank: 2 * comm.rank + 2], rtol=1e-12, atol=1e-12)
    if p > 1:
        try:
            comm.reduce_scatter(torch.zeros(p + 1))
        except ValueError as exc:
            assert "does not divide" in str(exc) and "pad dim 0" in str(exc)
        else:
            raise AssertionError("reduce_scatter accepted an indivisible dim 0")


def check_pairwise_reductions(comm):
    """The block-exchange allreduce and reduce-scatter (LOOM_PAIRWISE_BYTES, forced here at every size): bit for
    bit the rank-order fold ``((x0 op x1) op x2) ...`` in the tensor's dtype, the same on every rank, for uneven
    sizes (fewer elements than ranks, 0 elements), in place, into out=, numpy, and every op."""
    import functools

    from loom.comm import communicator as C

    p, r = comm.size, comm.rank
    folds = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    saved, C._PAIRWISE_MIN = C._PAIRWISE_MIN, 0
    try:
        for dtype in (torch.float64, torch.float32, torch.int32):
            for n in (0, 1, p - 1, 2 * p + 1, 37):
                for op in ("sum", "max", "min", "prod", "avg"):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    xs = [data(s, (n,), dtype, 45 + n) for s in range(p)]
                    ref = functools.reduce(folds.get(op, torch.add), xs)
                    ref = ref / p if op == "avg" else ref
                    got = comm.allreduce(xs[r], op)
                    assert got.dtype == dtype and torch.equal(got, ref), (dtype, n, op)
                    buf = xs[r].clone()
                    assert comm.allreduce(buf, op, out=buf) is buf and torch.equal(buf, ref), (dtype, n, op, "inplace")
                    out = torch.empty_like(buf)
                    assert comm.allreduce(xs[r], op, out=out) is out and torch.equal(out, ref), (dtype, n, op, "out")
                    assert torch.equal(xs[r], data(r, (n,), dtype, 45 + n)), "the input was changed"
                    everyone = comm.allgather(got.reshape(1, -1))
                    assert all(torch.equal(everyone[0], e) for e in everyone)
                    rows = [data(s, (3 * p, 2), dtype, 46 + n) for s in range(p)]
                    rref = functools.reduce(folds.get(op, torch.add), rows)
                    rref = (rref / p if op == "avg" else rref)[3 * r:3 * r + 3]
                    assert torch.equal(comm.reduce_scatter(rows[r], op), rref), (dtype, op, "reduce_scatter")
                    into = torch.empty(3, 2, dtype=dtype)
                    assert comm.reduce_scatter(rows[r], op, out=into) is into and torch.equal(into, rref)
        npx = [data(s, (2, 5), torch.float32, 47).numpy() for s in range(p)]
        got = comm.allreduce(npx[r])
        assert isinstance(got, np.ndarray) and np.array_equal(got, functools.reduce(np.add, npx))
        safety.configure(check=True)  # out= of the block's shape passes the cross-rank check; another raises
        try:
            rows = [data(s, (3 * p, 2), salt=48) for s in range(p)]
            into = torch.empty(3, 2, dtype=torch.float64)
            assert comm.reduce_scatter(rows[r], out=into) is into
            assert torch.equal(into, functools.reduce(torch.add, rows)[3 * r:3 * r + 3])
            try:
                comm.reduce_scatter(rows[r], out=torch.empty(4, 2, dtype=torch.float64))
            except ValueError as exc:
                assert "out has shape (4, 2)" in str(exc), exc
            else:
                raise AssertionError("reduce_scatter accepted an out of the wrong shape")
        finally:
            safety.configure(check=False)
    finally:
        C._PAIRWISE_MIN = saved


def check_allgather(comm):
    p = comm.size
    for dtype in (torch.float64, torch.bfloat16, torch.bool):
        xs = [data(s, (2, 3), dtype, 50) for s in range(p)]
        assert torch.equal(comm.allgather(xs[comm.rank]), torch.cat(xs))
    # transposed input
    xs = [data(s, (3, 2), salt=51) for s in range(p)]
    assert torch.equal(comm.allgather(xs[comm.rank].t()), torch.cat([x.t() for x in xs]))
    # uneven dim 0 including zero rows
    ys = [data(s, (s % 3, 4), salt=52) for s in range(p)]
    got, counts = comm.allgatherv(ys[comm.rank])
    assert counts == [s % 3 for s in range(p)] and torch.equal(got, torch.cat(ys))


def check_alltoall(comm):
    p = comm.size
    xs = [data(s, (p * 2, 3), salt=60) for s in range(p)]
    got = comm.alltoall(xs[comm.rank])
    ref = torch.cat([xs[s][2 * comm.rank: 2 * comm.rank + 2] for s in range(p)])
    assert torch.equal(got, ref)


def _quarters(rank: int, shape, dtype, salt: int) -> torch.Tensor:
    """Rank ``rank``'s data in quarter-integers: a sum over a few ranks is exact in fp64 and bf16 in any order
    (MPI's order of adding the ranks may change with the message size, so with a piece's)."""
    return ((data(rank, shape, salt=salt) * 4).round() / 4).to(dtype)


def _pipelined(log: list, pieces: int, *names: str) -> None:
    """``log`` (loom.testing.staged_on_host's) holds one staged call per name in ``names``, each of which queued
    every piece's device -> host copy before its first MPI call, ran each piece's MPI call (``name``) after its
    own copy's event, and had the caller's stream wait (on the device) for the event after the last copy back."""
    starts = [i for i, e in enumerate(log) if e == ("wait", "d2h", "cur")]
    assert len(starts) == len(names), (names, log)
    for name, lo, hi in zip(names, starts, starts[1:] + [len(log)]):
        call = log[lo:hi]
        while call[-1][0] == "host waits":  # the next call's pooled buffers waiting for this call's last copy
            call.pop()
        assert call[1] == ("wait", "h2d", "cur"), call
        queued = call[2:2 + pieces]
        assert [e[:2] for e in queued] == [("record", "d2h")] * pieces, (name, pieces, call)
        assert call[2 + pieces:2 + 3 * pieces] == [e for q in queued for e in (("host waits", q[2]), ("mpi", name))], \
            (name, pieces, call)
        done = call[2 + 3 * pieces][2:]
        assert call[2 + 3 * pieces:] == [("record", "h2d", *done), ("wait_event", "cur", *done)], (name, call)


def check_staged_block_collectives(comm):
    """alltoall, allgather and reduce_scatter (sum, avg) of CUDA tensors without a CUDA-aware MPI, pipelined in
    pieces along every block (loom.testing.staged_on_host: the same code on host tensors, streams faked), equal
    the plain host collective exactly in fp64 and bf16 (bf16 reduced in fp32): uneven block sizes, pieces of
    one column, of several that do not divide the block, and wider than the block; a transposed input; ``out=``
    taken directly and through a copy. Every call pipelines in order (:func:`_pipelined`). One rank cannot show
    a layout bug: it runs at 2 and 3 ranks too."""
    from loom.comm import buffers
    from loom.testing import staged_on_host

    p, r = comm.size, comm.rank
    saved = buffers.STAGE_PIECE
    try:
        for salt, dtype in enumerate((torch.float64, torch.bfloat16)):
            es = torch.empty((), dtype=dtype).element_size()
            for rows, cols in ((3, 7), (2, 5)):  # blocks of 21 and 10 elements
                m = rows * cols
                x = _quarters(r, (p * rows, cols), dtype, 90 + salt)
                xt = _quarters(r, (cols, p * rows), dtype, 92 + salt).t()
                y = _quarters(r, (rows, cols), dtype, 94 + salt)
                plain = {"alltoall": comm.alltoall(x), "alltoall t": comm.alltoall(xt), "allgather": comm.allgather(y),
                         "allgather t": comm.allgather(xt), "reduce_scatter": comm.reduce_scatter(x),
                         "avg": comm.reduce_scatter(x, "avg"), "reduce_scatter t": comm.reduce_scatter(xt)}
                for q in (1, 4, 64):  # columns of a block per piece (4 divides neither 21 nor 10)
                    buffers.STAGE_PIECE = (q + 1) * p * es - 1  # not a multiple: a piece is its floor, q columns
                    pieces = -(-m // q)
                    wide = -(-m // max(1, buffers.STAGE_PIECE // (p * 4))) if dtype == torch.bfloat16 else pieces
                    got = {}
                    for key, name, op, arg, extra, n in [
                        ("alltoall", "Alltoall", comm.alltoall, x, (), pieces),
                        ("alltoall t", "Alltoall", comm.alltoall, xt, (), pieces),
                        ("allgather", "Allgather", comm.allgather, y, (), pieces),
                        ("allgather t", "Allgather", comm.allgather, xt, (), -(-p * m // q)),  # one block of p m
                        ("reduce_scatter", "Reduce_scatter_block", comm.reduce_scatter, x, (), wide),  # fp32 pieces
                        ("avg", "Reduce_scatter_block", comm.reduce_scatter, x, ("avg",), wide),
                        ("reduce_scatter t", "Reduce_scatter_block", comm.reduce_scatter, xt, (), wide),
                    ]:
                        with staged_on_host(comm) as log:
                            got[key] = op(arg, *extra)
                        _pipelined(log, n, name)
                    with staged_on_host(comm) as log:
                        out = torch.full((p * rows, cols), float("nan"), dtype=dtype)
                        assert comm.alltoall(x, out=out) is out  # contiguous: the pieces land in it directly
                        got["alltoall out"] = out
                        outt = torch.full((cols, p * rows), float("nan"), dtype=dtype).t()
                        assert comm.allgather(y, out=outt) is outt  # strided: through a new tensor
                        got["allgather out"] = outt
                    _pipelined(log, pieces, "Alltoall", "Allgather")
                    plain["alltoall out"], plain["allgather out"] = plain["alltoall"], plain["allgather"]
                    for key, want in plain.items():
                        assert got[key].dtype == dtype and got[key].shape == want.shape, (key, got[key].shape)
                        assert torch.equal(got[key], want), (key, dtype, rows, cols, q)
                assert torch.equal(x, _quarters(r, (p * rows, cols), dtype, 90 + salt))  # the input untouched
    finally:
        buffers.STAGE_PIECE = saved


def _counts(s: int, p: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(BASE + 17 * s + salt)
    c = torch.randint(0, 4, (p,), generator=g)
    c[torch.rand(p, generator=g) < 0.3] = 0              # plenty of zero-length pieces
    return c.tolist()


def check_alltoallv(comm):
    p, r = comm.size, comm.rank
    for salt, dtype in enumerate([torch.float64, torch.bfloat16, torch.int16]):
        counts = [_counts(s, p, salt) for s in range(p)]
        xs = [data(s, (sum(counts[s]), 3), dtype, 70 + salt) for s in range(p)]
        got, rc = comm.alltoallv(xs[r], counts[r])
        assert rc == [counts[s][r] for s in range(p)]
        pieces = []
        for s in range(p):
            off = sum(counts[s][:r])
            pieces.append(xs[s][off: off + counts[s][r]])
        assert torch.equal(got, torch.cat(pieces)), dtype
        got2, _ = comm.alltoallv(xs[r], counts[r], rc)    # with known recv counts
        assert torch.equal(got2, got)
    # transposed input rows
    counts = [_counts(s, p, 9) for s in range(p)]
    xs = [data(s, (4, sum(counts[s])), salt=79) for s in range(p)]
    got, _ = comm.alltoallv(xs[r].t(), counts[r])
    ref = torch.cat([xs[s].t()[sum(counts[s][:r]): sum(counts[s][:r]) + counts[s][r]] for s in range(p)])
    assert torch.equal(got, ref)
    # bad counts: clear local error
    for bad, needle in [([1] * (p + 1), "entries"), ([-1] + [0] * (p - 1), "negative"), ([5] + [0] * (p - 1), "sum")]:
        try:
            comm.alltoallv(torch.zeros(2, 1), bad)
        except ValueError as exc:
            assert needle in str(exc), str(exc)
        else:
            raise AssertionError(f"alltoallv accepted counts {bad}")


def check_staged_alltoallv(comm):
    """alltoallv of CUDA tensors without a CUDA-aware MPI, pipelined in pieces along every row (staged_on_host:
    the same code on host tensors, streams faked), equals the plain host alltoallv exactly: uneven counts with
    zeros, rows of 5 elements cut into pieces of 1, 2 (not dividing 5) and all of them, rows of one element,
    a transposed input, bf16 and int16, recv counts given or learned. Every call pipelines in order."""
    from loom.comm import buffers
    from loom.testing import staged_on_host

    p, r = comm.size, comm.rank
    saved = buffers.STAGE_PIECE
    try:
        for salt, (dtype, shape) in enumerate([(torch.float64, (5,)), (torch.bfloat16, (5,)), (torch.int16, ()),
                                                (torch.float64, "t")]):
            counts = [_counts(s, p, 40 + salt) for s in range(p)]
            n = [sum(c) for c in counts]
            if shape == "t":  # rows of a transposed tensor
                xs = [data(s, (5, n[s]), dtype, 110 + salt).t() for s in range(p)]
            else:
                xs = [data(s, (n[s], *shape), dtype, 110 + salt) for s in range(p)]
            want, rc = comm.alltoallv(xs[r], counts[r])
            width = xs[r][0].numel() if n[r] else (xs[r].shape[1] if xs[r].dim() > 1 else 1)
            es = xs[r].element_size()
            rows = max(n[r], sum(rc), 1)
            for q in (1, 2, 64):  # elements of a row per piece
                buffers.STAGE_PIECE = (q + 1) * rows * es - 1  # not a multiple: a piece is its floor, q elements
                with staged_on_host(comm) as log:
                    got, rc2 = comm.alltoallv(xs[r], counts[r], rc)
                _pipelined(log, -(-width // min(q, width)) if width else 0, "Alltoallv")
                assert rc2 == rc and got.dtype == dtype and got.shape == want.shape, (got.shape, want.shape)
                assert torch.equal(got, want), (dtype, shape, q)
                with staged_on_host(comm):
                    learned, rc3 = comm.alltoallv(xs[r], counts[r])  # recv counts learned first
                assert rc3 == rc and torch.equal(learned, want), (dtype, shape, q)
    finally:
        buffers.STAGE_PIECE = saved


def check_nonblocking_collectives(comm):
    p, r = comm.size, comm.rank
    xs = [data(s, (6,), salt=80) for s in range(p)]
    q1 = comm.iallreduce(xs[r], "avg")
    q2 = comm.iallgather(xs[r].reshape(2, 3))
    counts = [_counts(s, p, 81) for s in range(p)]
    ys = [data(s, (sum(counts[s]), 2), salt=82) for s in range(p)]
    q3 = comm.ialltoallv(ys[r], counts[r])
    red, gath, (a2a, rc) = wait_all([q1, q2, q3])
    torch.testing.assert_close(red, sum(xs) / p, rtol=1e-12, atol=1e-12)
    assert torch.equal(gath, torch.cat([x.reshape(2, 3) for x in xs]))
    assert torch.equal(a2a, torch.cat([ys[s][sum(counts[s][:r]): sum(counts[s][:r]) + counts[s][r]]
                                       for s in range(p)]))


def check_objects(comm):
    p, r = comm.size, comm.rank
    assert comm.allgather_object({"r": r}) == [{"r": s} for s in range(p)]
    assert comm.bcast_object("hi" if r == 0 else None) == "hi"
    assert comm.allreduce_object(r + 1) == p * (p + 1) // 2
    if p > 1:
        if r == 0:
            comm.send_object(("x", 1), 1, tag=5)
        elif r == 1:
            assert comm.recv_object(0, 5) == ("x", 1)


def check_mesh_and_split(comm):
    p, r = comm.size, comm.rank
    shapes = [{"dp": p}]
    if p % 2 == 0:
        shapes.append({"dp": p // 2, "sp": 2})
        shapes.append({"pp": 2, "dp": p // 2})
    for shape in shapes:
        mesh = Mesh(shape)
        assert mesh.rank_of(**mesh.coords) == r
        for axis in shape:
            sub = mesh[axis]
            assert sub.size == shape[axis] and sub.rank == mesh.coords[axis] and sub.name == axis
            members = sub.allgather_object(r)
            # members differ only in this axis' coordinate, and are ordered by it
            expect = [mesh.rank_of(**{axis: i}) for i in range(shape[axis])]
            assert members == expect, (shape, axis, members, expect)
        flat = mesh[tuple(shape)]
        assert flat.size == p and flat.rank == r
    try:
        Mesh(dp=p + 1)
    except ValueError as exc:
        assert f"has {p}" in str(exc) and "product" in str(exc)
    else:
        raise AssertionError("Mesh accepted a wrong product")
    sub = comm.split(r % 2, name="halves")
    assert sub.size == len(range(r % 2, p, 2))
    d = comm.dup(name="dupe")
    assert d.allreduce_object(1) == p


def check_byte_accounting(comm):
    p = comm.size
    reset_stats()
    x = torch.zeros(4 * p, dtype=torch.float32)   # 16p bytes
    comm.allreduce(x)
    comm.allgather(x)
    comm.alltoall(x)
    counts = [1] * p
    comm.alltoallv(torch.zeros(p, 3, dtype=torch.float64), counts, counts)
    if p % 2 == 0:
        Mesh(dp=p // 2, sp=2)["sp"].allreduce(x)
    # send counts its bytes on each of its paths: numpy, a plain tensor, one that requires grad, a strided view
    f32 = torch.float32
    sent = [np.zeros(3, np.uint8), torch.zeros(5, dtype=f32), torch.zeros(2, dtype=f32, requires_grad=True),
            torch.zeros(4, 2, dtype=f32)[:, 0]]
    before = comm.bytes_sent.get("send", 0)
    if p > 1:
        nxt, prv = (comm.rank + 1) % p, (comm.rank - 1) % p
        for i, buf in enumerate(sent):
            out = np.empty_like(buf) if isinstance(buf, np.ndarray) else torch.empty(buf.shape, dtype=f32)
            if comm.rank % 2 == 0:
                comm.send(buf, nxt, tag=i)
                comm.recv(out, prv, tag=i)
            else:
                comm.recv(out, prv, tag=i)
                comm.send(buf, nxt, tag=i)
    st = stats()
    nb = 16 * p
    assert comm.bytes_sent.get("send", 0) - before == (3 + 20 + 8 + 16 if p > 1 else 0), st["world"]
    assert st["world"].get("allreduce", 0) == 2 * nb * (p - 1) // p
    assert st["world"].get("allgather", 0) == nb * (p - 1)
    assert st["world"].get("alltoall", 0) == nb * (p - 1) // p
    assert st["world"].get("alltoallv", 0) == 24 * (p - 1)
    if p % 2 == 0:
        assert st["sp"]["allreduce"] == 2 * nb * 1 // 2


if __name__ == "__main__":
    mpi_checks(globals())
