"""Multi-path alltoallv on real ranks: relayed delivery equals direct alltoallv, errors on every rank, plans
agree across ranks. Runs at any rank count; topologies are chosen so that relays are forced where possible
(P=3: one node in a mesh, relays through the third rank; P=4: the 2 x 2 testbed, rail relays)."""

from __future__ import annotations

import numpy as np
import torch

from loom.multipath import alltoallv, plan, preset
from loom.multipath.planner import candidates, plan_from_flows
from loom.multipath.relay import schedule
from loom.testing import mpi_checks, seeded


def _topology(p: int):
    if p == 4:
        return preset("testbed", nodes=2, ranks_per_node=2, rails=2)
    return preset("shm", nodes=1, ranks_per_node=p, rails=1)


def _every_path_plan(topo, counts, row_bytes):
    """A plan that spreads every pair over all its candidate paths (forces every relay there is)."""
    demand = counts.astype(float) * row_bytes
    np.fill_diagonal(demand, 0)
    c = candidates(topo, demand)
    k = np.diff(c.ptr)
    return plan_from_flows(c, c.volume[c.pair_of] / k[c.pair_of], "every-path")


def _random_counts(g, p, hi, zeros=0.3):
    c = torch.randint(0, hi, (p, p), generator=g)
    c[torch.rand((p, p), generator=g) < zeros] = 0
    return c.numpy().astype(np.int64)


def check_forced_relays_equal_direct(comm):
    p = comm.size
    g = seeded(comm, 1)  # shared: the counts matrix is the same on every rank
    mine = torch.Generator().manual_seed(1000 + comm.rank)  # per rank: the data
    topo = _topology(p)
    relays_seen = 0
    for trial in range(6):
        counts = _random_counts(g, p, 40)
        rows = (3,) if trial % 2 else ()
        sc = counts[comm.rank].tolist()
        if trial % 3 == 0:
            x = torch.randn((sum(sc), *rows), dtype=torch.float64, generator=mine)
        else:
            x = torch.randint(-1000, 1000, (sum(sc), *rows), generator=mine, dtype=torch.int32).numpy()
        row_bytes = int(np.prod(rows, dtype=np.int64)) * (8 if trial % 3 == 0 else 4)
        pl = _every_path_plan(topo, counts, row_bytes)
        msgs = schedule(counts, pl, row_bytes, chunk_bytes=row_bytes * 3)
        relays_seen += sum(len(m.hops) > 2 for m in msgs)
        want, want_rc = comm.alltoallv(x, sc)
        got, got_rc = alltoallv(x, sc, comm, topology=topo, plan=pl, chunk_bytes=row_bytes * 3, window=2)
        assert got_rc == want_rc, (got_rc, want_rc)
        assert type(got) is type(want) and got.shape == want.shape and got.dtype == want.dtype
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert np.array_equal(got, want)
        # recv_counts given explicitly takes the same path.
        got2, _ = alltoallv(x, sc, comm, want_rc, topology=topo, plan=pl, chunk_bytes=row_bytes * 3, window=1)
        assert (torch.equal(got2, want) if isinstance(got2, torch.Tensor) else np.array_equal(got2, want))
        # The whole matrix given up front (no agreement collective) takes the same path.
        got3, _ = alltoallv(x, sc, comm, topology=topo, plan=pl, chunk_bytes=row_bytes * 3, counts=counts)
        assert (torch.equal(got3, want) if isinstance(got3, torch.Tensor) else np.array_equal(got3, want))
    if p >= 3:
        assert relays_seen > 0, "the topology should have forced relays"


def check_planned_hot_pair(comm):
    """The planner itself moves a heavy pair onto relays; delivery still equals direct."""
    p = comm.size
    topo = _topology(p)
    g = seeded(comm, 2)
    counts = _random_counts(g, p, 8, zeros=0.5)
    counts[0, p - 1] += 4096
    x = torch.randn((int(counts[comm.rank].sum()), 16), dtype=torch.float32)
    sc = counts[comm.rank].tolist()
    want, _ = comm.alltoallv(x, sc)
    got, _ = alltoallv(x, sc, comm, topology=topo, min_bytes=1024, chunk_bytes=8192)
    assert torch.equal(got, want)
    if p == 4:
        demand = counts * 64.0
        np.fill_diagonal(demand, 0)
        pl = plan(topo, demand, min_bytes=1024)
        assert pl.method == "mwu" and pl.moved_fraction() > 0.2, (pl.method, pl.moved_fraction())


def check_monitored_equals_direct_and_agrees(comm):
    """With a LinkMonitor every call is measured (a barrier, arrival times, one allreduce): delivery still equals
    direct, and every rank ends with the same estimates, version and plan (they re-plan alike)."""
    from loom.multipath.links import LinkMonitor

    p = comm.size
    topo = _topology(p)
    g = seeded(comm, 4)
    mon = LinkMonitor(topology=topo, replan=0.01)
    for _ in range(4):
        counts = _random_counts(g, p, 8, zeros=0.3)
        counts[0, p - 1] += 2048
        x = torch.randn((int(counts[comm.rank].sum()), 16), dtype=torch.float64)
        sc = counts[comm.rank].tolist()
        want, _ = comm.alltoallv(x, sc)
        got, _ = alltoallv(x, sc, comm, topology=topo, min_bytes=1024, chunk_bytes=8192, monitor=mon,
                           counts=counts)
        assert torch.equal(got, want)
    if p == 1:
        return  # one rank: a local copy, nothing to measure
    assert mon.calls == 4 and mon.measured == 4 and mon.plan is not None, (mon.calls, mon.measured)
    seen = comm.allgather_object((mon.health.tobytes(), mon.version, mon.plan.flows.tobytes()))
    assert all(s == seen[0] for s in seen), "ranks disagree on the learned capacities or the plan"


def check_requires_grad_and_empty(comm):
    p = comm.size
    topo = _topology(p)
    x = torch.zeros((0, 4), requires_grad=True)
    got, rc = alltoallv(x, [0] * p, comm, topology=topo, min_bytes=0)
    assert got.shape == (0, 4) and rc == [0] * p


def check_mismatched_counts_raise_everywhere(comm):
    p = comm.size
    topo = _topology(p)
    x = torch.ones((p, 2))
    bad_rank = p - 1
    rc = [1] * p
    if comm.rank == bad_rank:
        rc = [2] + [1] * (p - 1)
    try:
        alltoallv(x, [1] * p, comm, rc, topology=topo)
    except ValueError as exc:
        assert f"rank {bad_rank} expects recv_counts" in str(exc), exc
    else:
        raise AssertionError("mismatched recv_counts did not raise")
    sc = [1] * p if comm.rank != 0 else [1] * (p + 1)
    try:
        alltoallv(torch.ones((sum(sc), 2)), sc, comm, topology=topo)
    except ValueError as exc:
        assert "rank 0:" in str(exc) and "send_counts has" in str(exc), exc
    else:
        raise AssertionError("wrong send_counts length did not raise")
    if p >= 2:
        x = torch.ones((p, 2), dtype=torch.float32 if comm.rank == 0 else torch.float64)
        try:
            alltoallv(x, [1] * p, comm, topology=topo)
        except ValueError as exc:
            assert "disagree on row shape/dtype" in str(exc), exc
        else:
            raise AssertionError("different dtypes did not raise")
        counts = np.full((p, p), 2, dtype=np.int64)
        if comm.rank == 0:
            counts[0, 1] = 3  # rank 0 planned for a different demand
        pl = _every_path_plan(topo, counts, 8)
        try:
            alltoallv(torch.ones((2 * p, 1), dtype=torch.float64), [2] * p, comm, topology=topo, plan=pl)
        except ValueError as exc:
            assert "disagree on the topology or plan" in str(exc), exc
        else:
            raise AssertionError("different plans on different ranks did not raise")
    comm.barrier()


def check_plan_same_on_every_rank(comm):
    topo = preset("h100", nodes=2)
    g = seeded(comm, 3)
    demand = torch.rand((topo.size, topo.size), generator=g).numpy() * 8e6
    pl = plan(topo, demand)
    pl.check()
    flows = comm.allgather_object(pl.flows.tobytes())
    assert all(f == flows[0] for f in flows)


def check_moe_exact_forward_backward(comm):
    """Expert-parallel MoE (multi-path dispatch) == single-process MoE, fp64, forward and all gradients."""
    from loom.parallel.moe import MoE, MoEConfig, _init, moe_reference

    p = comm.size
    topo = _topology(p)
    cfg = MoEConfig(dim=8, hidden=12, experts=2 * p, top_k=2, seed=7, dtype=torch.float64)
    g = seeded(comm, 4)
    lens = torch.randint(0, 9, (p,), generator=g).tolist()
    lens[0] = max(lens[0], 1)  # some rank may hold no tokens, but not all of them
    xs = torch.randn(sum(lens), cfg.dim, generator=g, dtype=torch.float64)
    rs = torch.randn(sum(lens), cfg.dim, generator=g, dtype=torch.float64)
    lo = sum(lens[:comm.rank])
    sl = slice(lo, lo + lens[comm.rank])
    from loom.multipath.links import LinkMonitor

    base = {"topology": topo, "min_bytes": 0, "chunk_bytes": 64, "planner": {"hysteresis": 0.0}}
    # The last variant learns link capacities from its own dispatches (measured calls, re-plans): still exact.
    for mp in (None, base, {**base, "monitor": LinkMonitor(topology=topo, replan=0.01)}):
        layer = MoE(cfg, comm, multipath=mp)
        x = xs[sl].clone().requires_grad_(True)
        y = layer(x)
        (y * rs[sl]).sum().backward()
        gate, w1, w2 = (t.clone().requires_grad_(True) for t in _init(cfg))
        xr = xs.clone().requires_grad_(True)
        yr = moe_reference(xr, gate, w1, w2, cfg.top_k)
        (yr * rs).sum().backward()
        # (torch.testing.assert_close imports torch.distributed.tensor: ~8 s per rank here.)
        def close(a, b):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
        close(y, yr[sl].detach())
        close(x.grad, xr.grad[sl])
        e0 = comm.rank * layer.local
        close(layer.w1.grad, w1.grad[e0:e0 + layer.local])
        close(layer.w2.grad, w2.grad[e0:e0 + layer.local])
        close(comm.allreduce(layer.gate.grad.contiguous()), gate.grad)


if __name__ == "__main__":
    mpi_checks(globals())
