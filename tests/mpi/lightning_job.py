"""A PyTorch Lightning run as a user writes it, on 2 CPU processes Lightning starts itself: ``python lightning_job.py
BACKEND STRATEGY OUT``. STRATEGY is ``ddp`` (``DDPStrategy(process_group_backend=BACKEND)``) or ``fsdp2``
(``ModelParallelStrategy``: ``fully_shard`` in ``configure_model`` over the data-parallel mesh). The model trains
4 steps on fixed data, in float64 (float32 under ModelParallelStrategy, which refuses 64-bit); rank 0 writes the
initial and final weights to OUT (a torch file) for tests/integration/test_clients.py, which compares the loom
run with the gloo run.
"""

from __future__ import annotations

import sys

import lightning.pytorch as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import loom  # noqa: F401 - registers the "loom" backend


class Regressor(L.LightningModule):
    def __init__(self, shard: bool):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
        self.shard = shard

    def configure_model(self):
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(backend: str, strategy: str, out: str) -> None:
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float64 if strategy == "ddp" else torch.float32
    data = TensorDataset(torch.randn(32, 6, generator=gen, dtype=dtype), torch.randn(32, 2, generator=gen, dtype=dtype))
    if strategy == "ddp":
        strat = DDPStrategy(process_group_backend=backend)
    else:
        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend=backend)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strat, max_steps=4,
                        precision="64-true" if strategy == "ddp" else "32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = Regressor(strategy == "fsdp2")
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
               for k, v in model.net.state_dict().items()}
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).state_dict()  # as Regressor made it
    if trainer.global_rank == 0:
        torch.save({"final": weights, "start": start}, out)
        print(f"lightning {strategy} over {backend}: {trainer.world_size} processes, {trainer.global_step} steps")


if __name__ == "__main__":
    main(*sys.argv[1:4])
