"""loom.stats: one registry that loom.comm, loom.compress, offload, sequence and the trainer record into."""

import pytest
import torch

from loom import stats
from loom.stats import Axis, flat_axis


@pytest.fixture(autouse=True)
def _clean():
    stats.reset()
    yield
    stats.reset()


def test_axis_names_are_typed_and_flatten_in_canonical_order():
    assert Axis.DP == "dp" and stats.AXES == ("dp", "pp", "sp", "tp", "ep")
    assert flat_axis(Axis.EP, Axis.DP) == flat_axis("dp", "ep") == "dp+ep"
    assert flat_axis("sp") == "sp"
    for bad in (("dp", "xp"), ("dp", "dp"), ()):
        with pytest.raises(ValueError, match="distinct mesh axes from dp, pp, sp, tp, ep"):
            flat_axis(*bad)


def test_add_snapshot_reset_and_live_counters():
    live = stats.counters("comm", "dp")
    stats.add("comm", "dp", allreduce=8)
    stats.add("comm", "dp", allreduce=8, send=1)
    assert live == {"allreduce": 16, "send": 1}
    assert stats.snapshot("comm") == {"dp": {"allreduce": 16, "send": 1}}
    snap = stats.snapshot()
    assert set(snap) == set(stats.KINDS) and snap["compress"] == {}
    stats.reset("comm")
    assert stats.snapshot("comm") == {} and live == {}
    stats.add("comm", "dp", send=2)
    assert live == {"send": 2}, "reset empties the dict in place: a kept reference stays valid"


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown stats kind 'bytes'; valid: comm, compress"):
        stats.add("bytes", "dp", n=1)


def test_axis_counter_is_a_view_that_reads_zero_when_unset():
    secs = stats.AxisCounter("time", "comm")
    assert secs["sp"] == 0 and "sp" not in secs and len(secs) == 0
    secs["sp"] += 0.5
    secs["sp"] += 0.25
    assert secs["sp"] == 0.75 and "sp" in secs and dict(secs) == {"sp": 0.75}
    assert stats.snapshot("time") == {"sp": {"comm": 0.75}}
    stats.reset()
    assert secs.get("sp", 0.0) == 0


def test_comm_and_compress_stats_are_views_over_the_registry():
    import loom.comm as lc
    import loom.compress as cz

    comm = lc.world()
    x = torch.randn(1024, dtype=torch.float64)
    lc.reset_stats()
    comm.allreduce(x)
    comm.bcast(x)
    assert lc.stats() == stats.snapshot("comm")
    assert "world" in lc.stats()
    stats.add("compress", "dp", raw=100, wire=25, calls=1)
    assert cz.stats() == {"dp": {"raw": 100, "wire": 25, "calls": 1}}
    cz.reset_stats()
    assert cz.stats() == {} and stats.snapshot("compress") == {}


def test_compressed_collective_records_raw_and_wire():
    import loom.comm as lc
    import loom.compress as cz

    x = torch.randn(1 << 15)
    cz.allreduce(x, lc.world(), "int8", min_bytes=0)
    rec = stats.snapshot("compress")["world"]
    assert set(rec) == {"raw", "wire", "calls"} and rec["calls"] == 1  # one rank: nothing crosses the wire


def test_offload_and_sequence_record_into_the_registry():
    from loom.parallel import offload, sequence

    stats.add("offload", "host", to_host=10, to_device=4)
    assert offload.transfer_stats() == {"to_host": 10, "to_device": 4}
    offload.reset_transfer_stats()
    assert offload.transfer_stats() == {"to_host": 0, "to_device": 0}
    stats.add("sequence", "sp", alltoall=3)
    assert sequence.alltoall_stats() == {"count": 3}
    sequence.reset_alltoall_stats()
    assert sequence.alltoall_stats() == {"count": 0}


def test_mesh_names_groups_with_flat_axis():
    from loom.comm import Mesh

    mesh = Mesh(ep=1, dp=1)
    assert mesh[("ep", "dp")].name == flat_axis("dp", "ep") == "dp+ep"
    assert mesh["ep"].name == "ep"
