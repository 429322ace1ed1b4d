"""A torch.distributed script with ``init_process_group("loom")``, as a user writes it, for every launcher.

``python torch_launchers.py env``: the ranks come from the launcher (torchrun, mpiexec with or without MASTER_*
exported, loom run); ``python torch_launchers.py spawn METHOD N``: this process starts N ranks with
``torch.multiprocessing.spawn`` and each calls ``init_process_group("loom", rank=r, world_size=N, ...)`` with
``init_method`` ``tcp://`` or ``file://``, or an explicit ``store``.

Each rank checks, against a one-process reference on random float64 data: an all_reduce, an all_gather,
all_gather_coalesced (torch's ``outputs[rank][tensor]`` layout), a send/recv ring, and a sub-group's all_reduce;
then it prints ``OK rank R/N world=<how MPI's world was made>``. Used by tests/integration/test_torch_launchers.py.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist

import loom  # noqa: F401 - registers the "loom" backend


def _data(rank: int) -> torch.Tensor:
    return torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 + rank))


def _checks() -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    every = [_data(k) for k in range(n)]
    x = every[r].clone()
    dist.all_reduce(x)
    want = every[0].clone()
    for k in range(1, n):
        want += every[k]
    assert torch.allclose(x, want, rtol=0, atol=1e-12), (x - want).abs().max()
    got = [torch.empty_like(every[0]) for _ in range(n)]
    dist.all_gather(got, every[r])
    assert all(torch.equal(g, e) for g, e in zip(got, every))
    outs = [[torch.empty(2, dtype=torch.float64), torch.empty(3, dtype=torch.float64)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [every[r][0, :2].clone(), every[r][2].clone()])
    for k in range(n):
        assert torch.equal(outs[k][0], every[k][0, :2]) and torch.equal(outs[k][1], every[k][2]), k
    recv = torch.empty(3, dtype=torch.float64)
    reqs = [dist.isend(every[r][1].clone(), (r + 1) % n), dist.irecv(recv, (r - 1) % n)]
    for q in reqs:
        q.wait()
    assert torch.equal(recv, every[(r - 1) % n][1])
    sub_ranks = list(range(0, n, 2))
    sub = dist.new_group(sub_ranks)
    if r in sub_ranks:
        y = torch.full((2,), float(r), dtype=torch.float64)
        dist.all_reduce(y, group=sub)
        assert y.tolist() == [float(sum(sub_ranks))] * 2, y
    from loom.torchdist import rendezvous

    how = "formed through the store" if rendezvous.bootstrapped() else "from the MPI launcher"
    print(f"OK rank {r}/{n} world={how}", flush=True)
    dist.destroy_process_group()


def _spawned(rank: int, n: int, method: str, where: str) -> None:
    if method == "tcp":
        dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{where}", rank=rank, world_size=n)
    elif method == "file":
        dist.init_process_group("loom", init_method=f"file://{where}", rank=rank, world_size=n)
    else:
        store = dist.TCPStore("127.0.0.1", int(where), n, is_master=rank == 0)
        dist.init_process_group("loom", store=store, rank=rank, world_size=n)
    _checks()


def main(argv: list[str]) -> int:
    if argv[0] == "env":
        dist.init_process_group("loom")
        _checks()
        return 0
    method, n = argv[1], int(argv[2])
    if method == "file":
        where = os.path.join(tempfile.mkdtemp(), "init")
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            where = str(s.getsockname()[1])
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(n, method, where), nprocs=n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
