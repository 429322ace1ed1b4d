"""``loom bench compress-train``: data-parallel training under compression policies, same run, same seeds.

For each policy (``none``, ``naive``, ``hybrid`` presets, or ``dp=CODEC`` for a dp-only policy with error
feedback) the same model is trained from the same weights on the same per-rank data for ``--steps`` steps;
gradients are averaged by :class:`loom.parallel.data.GradReducer` with ``loom.compress.dp_hook(policy)`` as
its gradient hook (every policy, ``none`` included, goes through the same blocking hook, so step times
compare like for like). Reported per policy:

* final loss: mean training loss over the last ``--tail`` steps (all ranks) and the held-out loss at the end
  (one fixed batch, identical on every rank), with the gap to ``none``;
* step time: median wall time per step (max over ranks), and the time inside the gradient hook;
* dp bytes per step on the wire (this rank, ``loom.compress.stats()["dp"]``) raw and compressed, and ratio;
* ``@link``: a *model*, not a measurement: the measured step plus the compressed dp bytes per step over a
  link of ``--link-gbps`` (no overlap), for when links are slower than this machine's shared memory.

Model: the Llama-style decoder from ``loom.models`` (``--model llama``, default) on a synthetic language (a
sparse random Markov chain: each token has 4 likely successors; the loss floor is its entropy), or a residual
MLP regressing a random teacher network (``--model mlp``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn

from .. import cli_args
from ..comm import Mesh, world
from ..compress import CompressionPolicy, dp_hook, reset_stats, stats
from . import omb

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench compress-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--policies", default="none,naive,hybrid",
                   help="comma list of presets (none, naive, hybrid) or dp=CODEC (dp only, error feedback on)")
    p.add_argument("--model", choices=("llama", "mlp"), default="llama", help="model trained")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per policy")
    p.add_argument("-b", "--batch", type=int, default=8, help="per-rank batch (sequences or samples)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (llama)")
    p.add_argument("--hidden", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks / residual blocks")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary (llama)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--bucket-mb", type=float, default=0.25, help="gradient bucket cap (MiB)")
    p.add_argument("--tail", type=int, default=30, help="steps averaged for the final training loss")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--link-gbps", type=float, default=1.0, help="link speed for the modelled @link column")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _policy(spec: str) -> CompressionPolicy:
    spec = spec.strip()
    if spec.startswith("dp="):
        return CompressionPolicy(dp=spec[3:], error_feedback=True)
    return CompressionPolicy.preset(spec)


class ResMLP(nn.Module):
    """``x -> W_in -> [x + W2 gelu(W1 norm(x))] * layers -> W_out``."""

    def __init__(self, d_in: int, hidden: int, layers: int, d_out: int, *, seed: int = 1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(d_in, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(layers))
        self.out = nn.Linear(hidden, d_out)
        with torch.no_grad():  # identical weights on every rank without communicating
            for name, p in self.named_parameters():
                if p.ndim > 1:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
                else:  # biases 0, LayerNorm gains 1
                    p.fill_(1.0 if name.endswith("0.weight") else 0.0)

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = h + blk(h)
        return self.out(h)


class _Task:
    """Model factory, per-rank batches and a fixed held-out batch."""

    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        if args.model == "llama":
            g = torch.Generator().manual_seed(12345)
            v = args.vocab
            succ = torch.stack([torch.randperm(v, generator=g)[:4] for _ in range(v)])  # 4 likely successors
            self.succ = succ
            self.probs = torch.tensor([0.55, 0.25, 0.1, 0.05])  # +5 % uniform noise
        else:
            self.teacher = ResMLP(32, 64, 2, 8, seed=777)
            for p in self.teacher.parameters():
                p.requires_grad_(False)
        self.heldout = self.batch(torch.Generator().manual_seed(999_999), 4 * args.batch)

    def model(self) -> nn.Module:
        a = self.args
        if a.model == "llama":
            from ..models.llama import LlamaConfig, build_llama

            return build_llama(LlamaConfig(layers=a.layers, hidden=a.hidden, heads=4, vocab=a.vocab))
        return ResMLP(32, a.hidden, a.layers, 8)

    def batch(self, g: torch.Generator, b: int):
        a = self.args
        if a.model == "llama":
            toks = torch.empty(b, a.seq + 1, dtype=torch.long)
            toks[:, 0] = torch.randint(a.vocab, (b,), generator=g)
            for t in range(a.seq):
                choice = torch.multinomial(self.probs, b, replacement=True, generator=g)
                nxt = self.succ[toks[:, t], choice]
                noise = torch.rand(b, generator=g) < 0.05
                nxt[noise] = torch.randint(a.vocab, (int(noise.sum()),), generator=g)
                toks[:, t + 1] = nxt
            return toks[:, :-1], toks[:, 1:]
        x = torch.randn(b, 32, generator=g)
        return x, self.teacher(x)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        if self.args.model == "llama":
            return model.loss(x, y)
        return nn.functional.mse_loss(model(x), y)


def _train(args, task: _Task, spec: str, comm) -> dict:
    from ..parallel.data import GradReducer

    torch.manual_seed(0)
    model = task.model()
    policy = _policy(spec)
    hook = dp_hook(policy)
    params = [p for p in model.parameters() if p.requires_grad]
    reducer = GradReducer(params, comm, grad_hook=None, bucket_mb=args.bucket_mb)
    if hook.codec is not None and hook.codec.name == "powersgd":
        hook.layouts.update({i: [tuple(p.shape) for p in b] for i, b in enumerate(reducer.buckets)})
    hook_time = [0.0]

    def timed_hook(flat, c, i):
        t0 = time.perf_counter()
        out = hook(flat, c, i)
        hook_time[0] += time.perf_counter() - t0
        return out

    reducer.hook = timed_hook
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed * 1000 + comm.rank)  # same data per rank for every policy
    losses, times, hooks = [], [], []
    reset_stats()
    comm.barrier()
    for _step in range(args.steps):
        batch = task.batch(g, args.batch)
        t0 = time.perf_counter()
        hook_time[0] = 0.0
        opt.zero_grad(set_to_none=True)
        reducer.start(1)
        loss = task.loss(model, batch)
        loss.backward()
        reducer.finish()
        opt.step()
        times.append(time.perf_counter() - t0)
        hooks.append(hook_time[0])
        losses.append(float(loss.detach()))
    s = stats().get(comm.name, {"raw": 0, "wire": 0, "calls": 0})
    with torch.no_grad():
        held = float(task.loss(model, task.heldout))
    reducer.remove()
    # Rank-averaged losses; step time is the slowest rank's (a step ends when the last rank is done).
    tail = comm.allreduce_object(statistics.fmean(losses[-args.tail:]), "sum") / comm.size
    held = comm.allreduce_object(held, "sum") / comm.size
    warm = max(1, min(10, args.steps // 10))
    step_t = comm.allreduce_object(statistics.median(times[warm:] or times), "max")
    hook_t = comm.allreduce_object(statistics.median(hooks[warm:] or hooks), "max")
    raw = s["raw"] / args.steps
    wire = s["wire"] / args.steps
    wire_max = comm.allreduce_object(wire, "max")
    return {"policy": spec, "codecs": policy.describe(), "tail_loss": tail, "heldout_loss": held,
            "first_loss": comm.allreduce_object(losses[0], "sum") / comm.size,
            "step_s": step_t, "hook_s": hook_t, "raw_bytes_per_step": raw, "wire_bytes_per_step": wire,
            "modelled_link_step_s": step_t + wire_max * 8 / (args.link_gbps * 1e9)}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv or [])
    if args.steps < 1 or args.tail < 1:
        raise SystemExit("loom bench compress-train: --steps and --tail must be >= 1")
    torch.set_num_threads(1)
    specs = [s for s in args.policies.split(",") if s.strip()]
    for s in specs:
        _policy(s)  # validate before any training
    comm = Mesh(dp=world().size)["dp"]
    task = _Task(args, comm.rank)
    nparams = sum(p.numel() for p in task.model().parameters())
    table = omb.Table(
        "Compressed Data-Parallel Training",
        ["Policy", "dp codec", "final loss", "held-out", "gap %", "step (ms)", "hook (ms)", "raw KB/step",
         "wire KB/step", "bytes ratio", f"@{args.link_gbps:g}Gb/s (ms)"],
        rank=comm.rank,
        meta={"ranks": comm.size, "model": f"{args.model} ({nparams} params, {args.layers} layers, "
              f"hidden {args.hidden})", "steps": args.steps, "batch/rank": args.batch,
              "optimizer": f"AdamW lr {args.lr}", "final loss": f"mean of the last {args.tail} steps",
              "gap": "held-out loss vs policy none", "last column": "modelled: step + dp wire bytes / link"},
    )
    table.widths = [max(10, 2 + max(map(len, specs))), 17, 12, 10, 8, 11, 11, 13, 14, 13, 16]
    table.header()
    results = []
    base = None
    for spec in specs:
        r = _train(args, task, spec, comm)
        results.append(r)
        if base is None and spec.strip() == "none":
            base = r["heldout_loss"]
        gap = 100 * (r["heldout_loss"] - base) / base if base else float("nan")
        ratio = r["raw_bytes_per_step"] / r["wire_bytes_per_step"] if r["wire_bytes_per_step"] else 1.0
        table.add(spec, r["codecs"]["dp"], f"{r['tail_loss']:.4f}", f"{r['heldout_loss']:.4f}", f"{gap:+.2f}",
                  r["step_s"] * 1e3, r["hook_s"] * 1e3, r["raw_bytes_per_step"] / 1e3,
                  r["wire_bytes_per_step"] / 1e3, ratio, r["modelled_link_step_s"] * 1e3)
    table.write_json(args.json, results=results)
    return 0
