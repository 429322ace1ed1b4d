"""Checks that run *on the testbed's ranks* (tests/integration/test_testbed_cluster.py runs them in a Testbed).

Each rank reads its own NIC byte counters from /sys (``ip netns exec`` mounts the namespace's sysfs), so the
route checks see which links really carried the bytes.
"""

import os

import numpy as np
import torch

from loom.testbed import current_topology
from loom.testbed.probe import measure
from loom.testing import mpi_checks, seeded

PAYLOAD = 4 << 20  # bytes of each route probe; background traffic (barriers, gathers) is a few KiB


def _topology():
    topo = current_topology()
    assert topo is not None, "LOOM_TESTBED_TOPOLOGY is not set: run this inside a Testbed"
    return topo


def _counters():
    out = {}
    for iface in ("rail", "intra"):
        base = f"/sys/class/net/{iface}/statistics"
        if os.path.isdir(base):
            with open(f"{base}/tx_bytes") as tx, open(f"{base}/rx_bytes") as rx:
                out[iface] = {"tx": int(tx.read()), "rx": int(rx.read())}
    return out


def _moved(comm, src, dst):
    """Send PAYLOAD bytes src -> dst; return every rank's counter deltas, indexed by rank."""
    comm.barrier()
    before = _counters()
    comm.barrier()
    buf = np.full(PAYLOAD, 7, np.uint8)
    if comm.rank == src:
        comm.send(buf, dst, tag=5)
    elif comm.rank == dst:
        got = comm.recv(np.zeros(PAYLOAD, np.uint8), src, tag=5)
        assert int(got.sum()) == 7 * PAYLOAD
    comm.barrier()
    after = _counters()
    delta = {k: {d: after[k][d] - before[k][d] for d in after[k]} for k in after}
    return comm.allgather_object(delta)


def check_detected_topology_equals_built(comm):
    """loom.multipath.detect finds the testbed from host names and NICs alone (no environment variable): the
    same ranks, nodes, rails, links and capacities as the description the testbed was built from."""
    from loom.multipath import Topology
    from loom.multipath.detect import detect

    saved = os.environ.pop("LOOM_TESTBED_TOPOLOGY", None)
    try:
        got = detect(comm)
    finally:
        if saved is not None:
            os.environ["LOOM_TESTBED_TOPOLOGY"] = saved
    built = Topology.from_dict(_topology())
    assert got.node_of == built.node_of and got.rail_of == built.rail_of, (got.node_of, got.rail_of)
    assert [lk.name for lk in got.links] == [lk.name for lk in built.links], (got.describe(), built.describe())
    # tc prints rates rounded to its units (200Mbit): equal to a millionth.
    np.testing.assert_allclose(got.capacity, built.capacity, rtol=1e-6)
    for s in range(comm.size):
        for d in range(comm.size):
            if s != d:
                assert got.static_route(s, d) == built.static_route(s, d), (s, d)


def check_placement(comm):
    topo = _topology()
    assert comm.size == len(topo["ranks"])
    me = topo["ranks"][comm.rank]
    per = len(topo["nodes"][0]["ranks"])
    assert int(os.environ["LOOM_TESTBED_NODE"]) == me["node"] == comm.rank // per
    assert int(os.environ["LOOM_TESTBED_RAIL"]) == me["rail"] == (comm.rank % per) % topo["rails"]
    assert os.environ["FI_TCP_IFACE"] == "rail" and os.environ["MPIR_CVAR_NOLOCAL"] == "1"
    assert os.path.isdir("/sys/class/net/rail")
    assert os.path.isdir("/sys/class/net/intra") == (per > 1)


def check_exact_collectives(comm):
    # Reference: every rank draws every rank's data from a shared seed; fp64, tolerance 1e-12 relative.
    g = seeded(comm)
    data = torch.randn(comm.size, 4096, comm.size, dtype=torch.float64, generator=g)
    got = comm.allreduce(data[comm.rank].clone())
    torch.testing.assert_close(got, data.sum(0), rtol=1e-12, atol=1e-12)
    a2a = comm.alltoall(data[comm.rank].reshape(comm.size, -1).clone())
    want = torch.stack([data[r].reshape(comm.size, -1)[comm.rank] for r in range(comm.size)])
    assert torch.equal(a2a, want)


def check_same_rail_is_direct(comm):
    topo = _topology()
    per = len(topo["nodes"][0]["ranks"])
    if len(topo["nodes"]) < 2:
        return
    d = _moved(comm, 0, per)  # node 0 local 0 -> node 1 local 0, both on rail 0
    assert d[0]["rail"]["tx"] >= PAYLOAD, d
    assert d[per]["rail"]["rx"] >= PAYLOAD, d
    if per > 1:
        assert d[0]["intra"]["tx"] < PAYLOAD // 4, d


def check_intra_node_uses_intra_link(comm):
    topo = _topology()
    if len(topo["nodes"][0]["ranks"]) < 2:
        return
    d = _moved(comm, 0, 1)
    assert d[0]["intra"]["tx"] >= PAYLOAD and d[1]["intra"]["rx"] >= PAYLOAD, d
    assert d[0]["rail"]["tx"] < PAYLOAD // 4 and d[1]["rail"]["rx"] < PAYLOAD // 4, d


def check_cross_rail_takes_static_route(comm):
    topo = _topology()
    per = len(topo["nodes"][0]["ranks"])
    if len(topo["nodes"]) < 2 or topo["rails"] < 2:
        return
    src, dst = 0, per + 1  # node 0 rail 0 -> node 1 rail 1: no direct link
    path = topo["routes"][f"{src}->{dst}"]
    assert path == ["r0", "node0", "r1", "rail1", f"r{dst}"], path
    d = _moved(comm, src, dst)
    # r0 -> (intra) -> r1 forwards -> (rail 1) -> dst; r0's own rail NIC and node 1's rail-0 rank stay idle.
    assert d[src]["intra"]["tx"] >= PAYLOAD, d
    assert d[1]["intra"]["rx"] >= PAYLOAD and d[1]["rail"]["tx"] >= PAYLOAD, d
    assert d[dst]["rail"]["rx"] >= PAYLOAD, d
    assert d[src]["rail"]["tx"] < PAYLOAD // 4, d
    assert d[per]["rail"]["rx"] < PAYLOAD // 4, d


def _rate(comm, name):
    row = measure(comm, _topology(), name, seconds=1.5)
    return comm.bcast_object(row, root=0)  # rank 0 is in every class


def check_rail_rate_within_20_percent(comm):
    topo = _topology()
    if len(topo["nodes"]) < 2 or topo["rail_gbit"] == 0:
        return
    row = _rate(comm, "rail")
    want = topo["rail_gbit"]
    assert 0.8 * want <= row["achieved_gbit"] <= 1.2 * want, row


def check_two_rails_carry_twice_one_rail(comm):
    topo = _topology()
    if len(topo["nodes"]) < 2 or topo["rails"] != 2 or topo["rail_gbit"] == 0:
        return
    one, two = _rate(comm, "rail"), _rate(comm, "rails")
    ratio = two["achieved_gbit"] / one["achieved_gbit"]
    assert 1.6 <= ratio <= 2.4, (ratio, one, two)


def check_torch_loom_backend_across_nodes(comm):
    """init_process_group("loom") across the testbed's nodes, whose host names resolve nowhere: rank 0's store
    is reached by an address of its interfaces; an allreduce over the loom backend and over a gloo group of the
    same job (on the rail NIC: GLOO_SOCKET_IFNAME) are exact."""
    import socket

    import torch.distributed as dist

    import loom  # noqa: F401 - registers the backend

    names = comm.allgather_object(socket.gethostname())
    assert len(set(names)) == len(_topology()["nodes"]) > 1, names
    dist.init_process_group("loom")
    try:
        for group in (None, dist.new_group(backend="gloo")):
            x = torch.full((1000,), float(comm.rank + 1), dtype=torch.float64)
            dist.all_reduce(x, group=group)
            assert torch.equal(x, torch.full_like(x, comm.size * (comm.size + 1) / 2))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mpi_checks(globals())
