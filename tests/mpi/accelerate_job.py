"""An accelerate run as a user writes it, under torchrun: ``torchrun --nproc-per-node 2 accelerate_job.py BACKEND
OUT``. accelerate picks gloo for CPU processes and refuses ``InitProcessGroupKwargs(backend="loom")`` ("Your
assigned backend loom is not available"); its own docs' way to use another backend is to initialize the group
first, which ``Accelerator`` then uses: ``dist.init_process_group(BACKEND)``. The model trains 4 steps in float64
on fixed data (``accelerator.prepare`` shards the loader and wraps the model in DDP); rank 0 writes the initial
and final weights to OUT for tests/integration/test_clients.py.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import loom  # noqa: F401 - registers the "loom" backend


def main(backend: str, out: str) -> None:
    dist.init_process_group(backend)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 6, generator=gen, dtype=torch.float64),
                         torch.randn(32, 2, generator=gen, dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=4, shuffle=False))
    for step, (x, y) in enumerate(loader):
        if step == 4:
            break
        loss = ((model(x) - y) ** 2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    final = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    if accelerator.is_main_process:
        torch.save({"final": final, "start": start}, out)
        print(f"accelerate over {dist.get_backend()}: {accelerator.num_processes} processes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
