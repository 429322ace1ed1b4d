"""The tag ceiling in one process: what loom reads (``MPI_TAG_UB``, lowered by ``LOOM_TAG_UB``), the clear error
when a subsystem needs more tags, per-subsystem duplicates, and the pipeline's and the relay's own limits."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from loom.comm import communicator, world


@pytest.fixture
def ceiling(monkeypatch):
    def force(value):
        monkeypatch.setattr(communicator, "_TAG_UB", None)
        monkeypatch.setenv("LOOM_TAG_UB", str(value))
        return communicator.tag_ub()
    yield force
    monkeypatch.setattr(communicator, "_TAG_UB", None)


def test_tag_ceiling_is_the_mpis_or_lower(ceiling):
    from mpi4py import MPI

    mpi_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert ceiling(2**23 - 1) == min(mpi_ub, 2**23 - 1) == world().tag_ub
    assert ceiling(2**40) == mpi_ub
    with pytest.raises(ValueError, match="LOOM_TAG_UB='many' is not an integer"):
        ceiling("many")
    with pytest.raises(ValueError, match="must be >= 1"):
        ceiling(0)


def test_require_tags_names_the_need_and_the_ceiling(ceiling):
    ceiling(100)
    world().require_tags(100, "x")
    with pytest.raises(ValueError, match=r"the thing needs MPI tags up to 101, but LOOM_TAG_UB=100 is 100 .*32767.*; "
                                         r"use fewer"):
        world().require_tags(101, "the thing", "use fewer")


def test_sub_is_a_cached_private_duplicate():
    c = world()
    a = c.sub("unit-a")
    assert c.sub("unit-a") is a and c.sub("unit-b") is not a and a.mpi != c.mpi and a.name == c.name
    with pytest.raises(ValueError, match="non-empty name"):
        c.sub("")


def test_pipeline_refuses_more_stages_than_tags(ceiling):
    from loom.comm import Communicator
    from loom.parallel.partition import capture
    from loom.parallel.pipeline import Stage
    from mpi4py import MPI

    g = capture(nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]))
    comm = Communicator(MPI.COMM_SELF, name="self")
    ceiling(4 * 3 + 3)  # 4 stages: tag = 4 * boundary + kind, bounded by 4 * (4 - 1) + META (3)
    Stage(g, [1, 1, 1, 1], comm, index=0)
    ceiling(10)
    with pytest.raises(ValueError, match="a pipeline of 4 .*stages needs MPI tags up to 15, but LOOM_TAG_UB=10"):
        Stage(g, [1, 1, 1, 1], comm, index=0)


def test_relay_schedule_fits_its_tag_ceiling():
    from loom.multipath import preset
    from loom.multipath.planner import candidates, plan_from_flows
    from loom.multipath.relay import schedule

    topo = preset("shm", nodes=1, ranks_per_node=3, rails=1)
    counts = np.full((3, 3), 200, dtype=np.int64)
    demand = counts.astype(float) * 8
    np.fill_diagonal(demand, 0)
    c = candidates(topo, demand)
    k = np.diff(c.ptr)
    pl = plan_from_flows(c, c.volume[c.pair_of] / k[c.pair_of], "every-path")
    free = schedule(counts, pl, 8, chunk_bytes=8)
    assert len(free) > 40  # one row per relayed chunk: many messages
    capped = schedule(counts, pl, 8, chunk_bytes=8, max_messages=40)
    assert max(m.id + 1 for m in capped) <= 40  # message id travels as tag id + 1
    assert sum(m.rows for m in capped) == sum(m.rows for m in free) == int(counts.sum() - np.trace(counts))
