"""``loom bench zero``: sharded data parallelism (ZeRO stages 0-3) against plain data parallelism, torch FSDP2
and torch DDP.

Three tables, one run:

* **Capacity** (all ranks of the job, memory only): for plain data parallelism (stage 0) and stages 1, 2 and
  3, the deepest residual MLP (``--width`` features per block, Adam) whose training step fits in ``--budget``
  bytes per rank. Peak memory is :class:`loom.parallel.offload.MemoryTracker`'s live-storage peak (max over
  ranks) over one whole step after a warm-up step, counting the parameters, gradients, optimizer state and
  communication buffers alive before it. Search: two probes give the slope, the secant predicts the
  crossing, bisection brackets it to one block; every reported depth was run and fit, the next did not.
  ``--device cuda``: the model, its shards and Adam live on this rank's GPU (``cuda:local_rank``; ranks may
  share one) and the peak is the CUDA allocator's (``torch.cuda.max_memory_allocated``) over the measured
  step, less what was allocated before the probe's model was built; each probe's engine is removed and its
  memory returned before the next. Pinned host staging buffers are host memory and not counted.
* **Peer, FSDP2** (``--peer-ranks``, 2 by default): loom stage 3, once per progress mode (``hooks`` and
  ``thread``, the row of the mode ``auto`` picks marked; the JSON keeps each mode's last-step accounting), and
  torch ``fully_shard`` (one ``fully_shard`` per block and one on the root) on the same model, batch and Adam,
  over gloo and over the ``"loom"`` backend (the fair peer: the same transport as loom's own rows, so the rows
  compare the sharding engines, not the transports; the speed-up column is against it): step time and peak
  memory per rank. Every Adam here runs ``foreach=False`` (its temporaries are one
  tensor's, not the whole model's), the same for all. The tracker also counts storages that
  ``UntypedStorage.resize_`` grows, since FSDP2 allocates its unsharded parameters that way.
* **Plain data parallel vs DDP** (``--peer-ranks``): loom plain data parallel
  (:class:`loom.parallel.data.GradReducer`, 25 MiB buckets reduced during backward, once per progress mode:
  ``hooks`` and ``thread``, the row of the mode ``auto`` picks on this machine marked) and torch
  ``DistributedDataParallel`` (its defaults: 25 MiB buckets, ``gradient_as_bucket_view``), over gloo and over
  the ``"loom"`` backend (the speed-up column's peer), on the model of ``loom bench hybrid`` (width 1024, depth
  16, global batch 16, SGD, one micro-batch). The JSON keeps each loom mode's exposed and overlapped seconds of
  its last step.

The peer tables run on the CPU whatever ``--device`` says: torch's GPU peers need NCCL, which refuses two
ranks on one GPU.

Timing: :func:`loom.bench.omb.time_op` per mode, modes interleaved over ``--rounds`` rounds, the best round's
mean kept, the slowest rank's time reported. Ranks beyond the first ``--peer-ranks`` wait for the timed part in
a sleeping receive, so they take no core from the timed ranks: time no more ranks than the machine has cores.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any, Callable

import torch
from torch import nn

from .. import cli_args
from ..comm import Communicator, resolve_device, world
from ..parallel.data import GradReducer, default_progress
from ..parallel.offload import MemoryTracker
from ..parallel.zero import ShardedDataParallel, reset_zero_stats, zero_stats
from . import omb
from .hybrid import WideResMLP
from .omb import parse_size

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench zero", description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=parse_size, default=parse_size("48M"), help="capacity: memory per rank")
    p.add_argument("--width", type=int, default=256, help="capacity: features per residual block")
    p.add_argument("--device", type=cli_args.parse_device, default="cpu",
                   help="capacity: cpu, cuda (this rank's GPU, cuda:local_rank) or auto; peers stay on the CPU")
    p.add_argument("--batch", type=int, default=16, help="capacity and FSDP2: global batch (rows)")
    p.add_argument("--peer-width", type=int, default=1024, help="FSDP2 and DDP tables: block width")
    p.add_argument("--peer-depth", type=int, default=16, help="FSDP2 and DDP tables: residual blocks")
    p.add_argument("--peer-ranks", type=int, default=2,
                   help="FSDP2 and DDP tables: the job's first N ranks are timed (a core each keeps it fair)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="loom bucket size in MiB (default: one block of the model, per-layer gathers)")
    p.add_argument("-i", "--iterations", type=int, default=10, help="timed steps per round")
    p.add_argument("-x", "--warmup", type=int, default=2, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (modes interleaved, best kept)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time bound per mode and round")
    p.add_argument("--skip", choices=("capacity", "peers"), action="append", default=[], help="leave a part out")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _persistent(model: nn.Module, opt: torch.optim.Optimizer, wrapper: Any = None) -> list[torch.Tensor]:
    """Every tensor alive between steps: parameters, gradients, optimizer state, the wrapper's buffers."""
    out = []
    for p in model.parameters():
        out += [p, p.grad] if p.grad is not None else [p]
    for st in opt.state.values():
        out += [v for v in st.values() if isinstance(v, torch.Tensor)]
    if isinstance(wrapper, ShardedDataParallel):
        out += [t for p in wrapper.parameters() for t in (p, p.grad) if t is not None]
        if wrapper.stage == 0:
            out += wrapper.reducer.buffers
        else:
            out += [b.full for b in wrapper.buckets if b.full is not None]  # shards and grads are parameters
    return out


def _rows(comm: Communicator, batch: int, width_in: int = 64, width_out: int = 16,
          device: torch.device | None = None):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width_in, generator=g), torch.randn(batch, width_out, generator=g)
    n = batch // comm.size
    return (x[comm.rank * n:(comm.rank + 1) * n].to(device or "cpu"),
            y[comm.rank * n:(comm.rank + 1) * n].to(device or "cpu"))


def _loom(comm, stage: int, width: int, depth: int, batch: int, bucket_mb: float, optim: str = "adam",
          progress: str = "auto", device: torch.device | None = None):
    """A loom training step on ``comm``: ``(step, model, optimizer, wrapper)``."""
    torch.manual_seed(0)
    with torch.device(device or "cpu"):  # built where it trains: a GPU probe never holds the model on the host
        model = WideResMLP(width, depth)
    sdp = ShardedDataParallel(model, comm, stage=stage, bucket_mb=bucket_mb, progress=progress)
    opt = (torch.optim.Adam(sdp.parameters(), lr=1e-4, foreach=False) if optim == "adam"
           else torch.optim.SGD(sdp.parameters(), lr=1e-4))
    x, y = _rows(comm, batch, device=device)

    def step():
        nn.functional.mse_loss(sdp(x), y).backward()
        sdp.step(opt)

    return step, model, opt, sdp


def _peak(comm, make: Callable[[], tuple]) -> tuple[int, Callable[[], None]]:
    """Peak live bytes (max over ``comm``) of one training step after a warm-up step, and the step."""
    step, model, opt, wrapper = make()
    step()
    with MemoryTracker() as mem:
        mem.track(*_persistent(model, opt, wrapper))
        step()
    return (comm.allreduce_object(int(mem.peak), "max") if comm.size > 1 else int(mem.peak)), step


def _cuda_peak(comm, make: Callable[[], tuple], device: torch.device) -> int:
    """The CUDA allocator's peak (max over ``comm``) over one training step after a warm-up step, counted from
    what this rank had allocated before ``make`` built the model; the engine is removed and its memory freed
    before returning, so the next probe starts from the same floor."""
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    floor = torch.cuda.memory_allocated(device)
    step, model, opt, wrapper = make()
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - floor
    if hasattr(wrapper, "remove"):
        wrapper.remove()  # its hooks and progress thread hold the model
    del step, model, opt, wrapper
    gc.collect()
    torch.cuda.empty_cache()
    return comm.allreduce_object(int(peak), "max") if comm.size > 1 else int(peak)


def _deepest(comm, stage: int, args) -> tuple[int, int, int]:
    """The deepest model that fits ``args.budget`` at ``stage``: ``(depth, its peak, probes run)``."""
    bucket = args.bucket_mb or (args.width * (args.width + 1) * 4) / 2**20
    seen: dict[int, int] = {}

    def peak(d: int) -> int:
        if d not in seen:
            make = lambda: _loom(comm, stage, args.width, d, args.batch, bucket, device=args.device)  # noqa: E731
            seen[d] = (_cuda_peak(comm, make, args.device) if args.device.type == "cuda"
                       else _peak(comm, make)[0])
        return seen[d]

    lo, hi = 1, None
    if peak(lo) > args.budget:
        raise SystemExit(f"loom bench zero: stage {stage} does not fit even one block of width {args.width} in "
                         f"{args.budget} bytes per rank; raise --budget or lower --width")
    nxt = 8
    while hi is None:
        if peak(nxt) > args.budget:
            hi = nxt
            break
        a, b = lo, nxt
        lo = nxt
        slope = (peak(b) - peak(a)) / max(b - a, 1)
        nxt = min(4 * lo, max(lo + 1, int(lo + (args.budget - peak(lo)) / slope))) if slope > 0 else 4 * lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= args.budget:
            lo = mid
        else:
            hi = mid
    return lo, seen[lo], len(seen)


def _capacity(comm, args) -> dict[str, Any]:
    table = omb.Table("ZeRO Capacity (largest model within a per-rank budget)",
                      ["Mode", "Blocks", "Params(M)", "Peak(MiB)", "x-dp", "Probes"], rank=comm.rank)
    table.meta = {"model": f"residual MLP blocks of width {args.width} (fp32, Adam foreach=False), "
                           f"global batch {args.batch}",
                  "budget": f"{args.budget / 2**20:.1f} MiB per rank ("
                            + (f"CUDA allocator peak on {args.device}, max over ranks" if args.device.type == "cuda"
                               else "CPU live-storage tracker, max over ranks") + ")",
                  "ranks": f"{comm.size}; one forward + backward + optimizer step after a warm-up step"}
    table.header()
    out, base = {}, None
    for stage in (0, 1, 2, 3):
        depth, peak, probes = _deepest(comm, stage, args)
        params = sum(t.numel() for t in WideResMLP(args.width, depth).parameters())
        base = base or params
        name = "dp (stage 0)" if stage == 0 else f"stage {stage}"
        table.add(name, depth, params / 1e6, peak / 2**20, params / base, probes)
        out[name] = {"blocks": depth, "params": params, "peak": peak}
    return {"table": table.rows, "meta": table.meta, "results": out}


def _loom_dp(comm, width: int, depth: int, batch: int, progress: str):
    """A loom plain data-parallel SGD step (the DDP peer's loop): ``(step, reducer)``."""
    torch.manual_seed(0)
    model = WideResMLP(width, depth)
    params = list(model.parameters())
    red = GradReducer(params, comm, bucket_mb=25.0, progress=progress)
    opt = torch.optim.SGD(params, lr=1e-4)
    x, y = _rows(comm, batch)

    def step():
        opt.zero_grad(set_to_none=False)  # zeroes the bucket views in place, as DDP's loop below
        red.start(1)
        nn.functional.mse_loss(model(x), y).backward()
        red.finish()
        opt.step()

    return step, red


def _fsdp2(group, mesh, width: int, depth: int, batch: int, comm):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = WideResMLP(width, depth)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    x, y = _rows(comm, batch)

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step, model, opt, None


def _ddp(group, width: int, depth: int, batch: int, comm):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(WideResMLP(width, depth), process_group=group, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = _rows(comm, batch)

    def step():
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step, model, opt, None


def _timed(comm, runs: list[list], args) -> None:
    """Interleave the modes over rounds; ``run[3]`` becomes the best mean seconds per step (max over ranks)."""
    for _ in range(args.rounds):
        for run in runs:
            run[3] = min(run[3], omb.time_op(run[2], comm, args.warmup, args.iterations,
                                             max_seconds=args.max_seconds))
    for run in runs:
        run[3] = comm.allreduce_object(run[3], op="max")


def _peers(sub: Communicator, group, mesh, args) -> dict[str, Any]:
    w, d, b = args.peer_width, args.peer_depth, args.batch
    bucket = args.bucket_mb or (w * (w + 1) * 4) / 2**20
    params = sum(t.numel() for t in WideResMLP(w, d).parameters())
    auto = sub.bcast_object(default_progress(), 0)  # every rank names the same row
    engines: dict[str, ShardedDataParallel] = {}

    def stage3(mode):  # keeps the engine, for its last step's accounting
        made = _loom(sub, 3, w, d, b, bucket, progress=mode)
        engines[mode] = made[3]
        return made

    makers = [(f"loom stage 3 ({mode}{', auto' if mode == auto else ''})", lambda mode=mode: stage3(mode))
              for mode in ("hooks", "thread")]
    makers += [(f"torch FSDP2 ({backend})", lambda backend=backend: _fsdp2(group[backend], mesh[backend], w, d, b, sub))
               for backend in ("gloo", "loom")]
    runs = []
    for name, make in makers:
        peak, step = _peak(sub, make)
        runs.append([name, peak, step, float("inf")])
    reset_zero_stats()
    _timed(sub, runs, args)
    exposed = zero_stats()["exposed_comm_s"]
    # Speedup columns hold the peer's step time over this row's (> 1: faster than the peer), named as speedups.
    t1 = omb.Table("ZeRO-3 vs torch FSDP2 (fully_shard, over gloo and over loom)",
                   ["Mode", "Step(ms)", "Peak(MiB)", "speedup-vs-FSDP2"], rank=sub.rank)
    t1.meta = {"model": f"residual MLP width {w} depth {d} ({params / 1e6:.1f} M params, fp32, Adam foreach=False)",
               "batch": f"global {b}", "ranks": f"{sub.size}, 1 thread each; loom buckets of {bucket:.2f} MiB",
               "progress": f"loom reduce-scatters progress from the hooks or a progress thread; auto picks {auto} "
                           f"here",
               "speedup": "torch FSDP2 over the loom backend's step time over the row's (> 1: faster)"}
    t1.header()
    for name, peak, _, t in runs:
        t1.add(name, t * 1e3, peak / 2**20, runs[-1][3] / t)
    zero_last = {mode: {**sdp.last, "progress": sdp.progress} for mode, sdp in engines.items()}
    for sdp in engines.values():
        sdp.remove()
    reducers, ddp_runs = {}, []
    for mode in ("hooks", "thread"):
        step, reducers[mode] = _loom_dp(sub, w, d, 16, mode)
        ddp_runs.append([f"loom dp ({mode}{', auto' if mode == auto else ''})", 0, step, float("inf")])
    ddp_runs += [[f"torch DDP ({backend})", 0, _ddp(group[backend], w, d, 16, sub)[0], float("inf")]
                 for backend in ("gloo", "loom")]
    _timed(sub, ddp_runs, args)
    for red in reducers.values():
        red.remove()
    t2 = omb.Table("Plain data parallel vs torch DDP (over gloo and over loom)", ["Mode", "Step(ms)", "speedup-vs-DDP"],
                   rank=sub.rank)
    t2.meta = {"model": f"residual MLP width {w} depth {d} ({params / 1e6:.1f} M params, fp32, SGD)",
               "batch": "global 16, one micro-batch", "ranks": f"{sub.size}, 1 thread each, 25 MiB buckets",
               "progress": f"loom reductions progress from the hooks or a progress thread; auto picks {auto} here",
               "speedup": "torch DDP over the loom backend's step time over the row's (> 1: faster)"}
    t2.header()
    for name, _, _, t in ddp_runs:
        t2.add(name, t * 1e3, ddp_runs[-1][3] / t)
    return {"fsdp2": t1.rows, "ddp": t2.rows, "exposed_comm_s": exposed, "zero_last_step": zero_last,
            "dp_last_step": {mode: red.last for mode, red in reducers.items()}}


def _torch_group(comm: Communicator, n: int):
    """torch.distributed over the job (the ``"loom"`` backend), groups of its first ``n`` ranks on gloo and on loom,
    and a CPU device mesh on each: ``(dist, {backend: group}, {backend: mesh})``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    path = comm.bcast_object(tempfile.mktemp(prefix="loom-bench-zero-") if comm.rank == 0 else None)
    dist.init_process_group("loom", init_method=f"file://{path}", rank=comm.rank, world_size=comm.size)
    groups = {backend: dist.new_group(list(range(n)), backend=backend) for backend in ("gloo", "loom")}
    meshes = {b: DeviceMesh.from_group(g, "cpu") if comm.rank < n else None for b, g in groups.items()}
    return dist, groups, meshes


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        parser.error(f"--device {str(args.device)!r}: {e}")
    comm = world()
    peers = "peers" not in args.skip and comm.size >= 2
    if peers and not 2 <= args.peer_ranks <= comm.size:
        parser.error(f"--peer-ranks {args.peer_ranks} must be between 2 and the job's {comm.size} ranks; "
                     f"run with --ranks {max(args.peer_ranks, 2)} or lower --peer-ranks")
    for n, what in ((comm.size, "the job's ranks"), (args.peer_ranks if peers else 1, "--peer-ranks")):
        if args.batch % n:
            parser.error(f"--batch {args.batch} must divide by {what} ({n}); e.g. --batch {16 * n}")
    if peers and 16 % args.peer_ranks:
        parser.error(f"--peer-ranks {args.peer_ranks} must divide the DDP table's global batch of 16")
    report: dict[str, Any] = {}
    if "capacity" not in args.skip:
        report["capacity"] = _capacity(comm, args)
    if peers:
        n = args.peer_ranks
        dist, group, mesh = _torch_group(comm, n)
        sub = comm.split(0 if comm.rank < n else 1, name="dp")
        if comm.rank < n:
            report.update(_peers(sub, group, mesh, args))
            for r in range(n, comm.size) if comm.rank == 0 else ():
                comm.send(torch.zeros(1), r, tag=7)
        else:
            comm.irecv(torch.zeros(1), 0, tag=7).wait()  # sleeps between tests: leaves the cores to the timed ranks
        dist.destroy_process_group()
    if comm.rank == 0 and args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"argv": argv, "machine": omb.machine_info(), **report}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
