"""GradReducer on real ranks when a tensor's gradient is ``None`` on some replicas only (a branch one replica's
data skips): every replica ends with the same gradients (the mean over replicas, an unused tensor counting as
zero; fp64, exact to 1e-12) and, after an optimizer step, the same parameters; a tensor unused everywhere
keeps ``grad=None``. Both reduction paths: the default non-blocking allreduce and a gradient hook."""

from __future__ import annotations

import torch
from torch import nn

from loom.parallel.data import GradReducer, allreduce_hook
from loom.testing import mpi_checks


def check_replicas_agree_when_grads_are_none_on_some(comm):
    for hook in (None, allreduce_hook):
        torch.manual_seed(0)  # the same initial replicas
        a, b, never = nn.Linear(3, 3).double(), nn.Linear(3, 3).double(), nn.Linear(3, 3).double()
        params = [*a.parameters(), *b.parameters(), *never.parameters()]
        red = GradReducer(params, comm, grad_hook=hook, bucket_mb=40 / 2**20)  # ~40-byte buckets: several
        opt = torch.optim.Adam(params, lr=0.1)
        g = torch.Generator().manual_seed(100 + comm.rank)  # different data per replica
        local = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            red.start(1)
            x = torch.randn(2, 3, generator=g, dtype=torch.float64)
            y = a(x) if comm.rank == 0 else b(a(x))  # b is unused on rank 0 only
            y.sum().backward()
            local = [None if p.grad is None else p.grad.clone() for p in params]
            # what each replica had before the reduction: the reference mean counts None as zero
            before = comm.allgather_object([None if t is None else t.clone() for t in local])
            red.finish()
            for j, p in enumerate(params):
                # which replicas produced this gradient follows from the data path (a on all, b off rank 0,
                # never on none), not from .grad: the reducer may show an unused tensor's grad as a zero view
                had = [r[j] for rank, r in enumerate(before) if j < 2 or (j < 4 and rank != 0)]
                if not had:
                    assert p.grad is None, j  # unused everywhere: left alone, as in one process
                    continue
                want = sum(had) / comm.size
                assert p.grad is not None and (p.grad - want).abs().max().item() < 1e-12, (hook, j)
            opt.step()
        mine = torch.cat([p.detach().reshape(-1) for p in params])
        assert all(torch.equal(mine, other) for other in comm.allgather_object(mine)), "replicas diverged"
        red.remove()


if __name__ == "__main__":
    mpi_checks(globals())
