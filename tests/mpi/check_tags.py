"""Loom's own tags under a forced tag ceiling (``LOOM_TAG_UB``, as on an MPI whose ``MPI_TAG_UB`` is small, e.g.
Open MPI over UCX: 2**23 - 1, or the standard's minimum 32767): the ceiling is what loom reads, each subsystem
talks on its own duplicate, and the pipeline (1F1B and interleaved) and a relayed all-to-allv still equal
their references (the checks of check_hybrid.py / check_multipath.py, fp64 1e-10 / bit-exact)."""

from __future__ import annotations

import os

import torch
from check_hybrid import run_case  # noqa: E402  (tests/mpi is the script's directory)
from check_multipath import check_forced_relays_equal_direct  # noqa: E402
from mpi4py import MPI

from loom.comm import tag_ub
from loom.testing import mpi_checks


def check_ceiling_is_read(comm):
    forced = int(os.environ["LOOM_TAG_UB"])
    mpi_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert mpi_ub >= 32767, mpi_ub
    assert tag_ub() == comm.tag_ub == min(forced, mpi_ub), (tag_ub(), forced, mpi_ub)
    a, b = comm.sub("pipeline"), comm.sub("relay")
    assert comm.sub("pipeline") is a and a is not b and a.mpi != comm.mpi and b.mpi != a.mpi
    assert a.size == comm.size and a.rank == comm.rank
    # The same tag on two subsystems' communicators never matches across them.
    peer = (comm.rank + 1) % comm.size
    src = (comm.rank - 1) % comm.size
    ra = a.irecv(torch.empty(1, dtype=torch.int64), src, tag=5)
    rb = b.irecv(torch.empty(1, dtype=torch.int64), src, tag=5)
    b.send(torch.tensor([2]), peer, tag=5)
    a.send(torch.tensor([1]), peer, tag=5)
    assert int(ra.wait()[0]) == 1 and int(rb.wait()[0]) == 2


def check_pipeline_under_ceiling(comm):
    if comm.size == 4:
        run_case(comm, "resmlp", 2, 2, "1f1b", 4, "adam")
        run_case(comm, "resmlp", 4, 1, "interleaved", 4, "adam")
    else:
        run_case(comm, "branchy", 2, 1, "1f1b", 4, "sgd")


def check_relay_under_ceiling(comm):
    check_forced_relays_equal_direct(comm)


if __name__ == "__main__":
    mpi_checks(globals())
