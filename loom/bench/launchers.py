"""``loom bench launchers``: the ``"loom"`` torch backend under each launcher, against raw mpi4py in the same world.

A world that mpiexec made and one that processes torchrun or ``torch.multiprocessing.spawn`` started formed
through torch's store (:mod:`loom.comm.pmi`: MPICH joins them through loom's PMI server) may differ in transport:
the server tells MPICH which ranks share a host (``PMI_process_mapping``), which is what makes it use shared
memory between them. Per route, the same rows: a 1-byte ``dist.all_reduce`` (us) and one of ``--size`` bytes of
float32 (bus GB/s, ``2 (P-1)/P x bytes / time``), each beside raw mpi4py's in-place ``Allreduce`` on the same
buffers in the same world (:func:`loom.bench.comm.raw_collectives`), rounds interleaved, the best round's mean,
the slowest rank's time.

Plan: ``loom bench launchers --ranks N`` is itself the mpiexec route: its ranks measure, then rank 0 starts the
torchrun route and the mp.spawn route as child jobs (their processes outside any MPI job) while the other ranks
wait in a sleeping receive (they take no core from the timed processes), and prints one table. Time no more
ranks than the machine has cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

from .. import cli_args
from ..comm.measure import parse_size

__all__ = ["main"]

ROUTES = ("mpiexec", "torchrun", "mp.spawn")


def _parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench launchers", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes of the bandwidth row")
    p.add_argument("-i", "--iterations", type=int, default=1000, help="timed calls of the latency row")
    p.add_argument("--iterations-large", type=int, default=10, help="timed calls of the bandwidth row")
    p.add_argument("-x", "--warmup", type=int, default=3, help="untimed calls per row and round (x30 for latency)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (loom and raw interleaved, best kept)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per row, side and round")
    p.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES), help="launchers to measure")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--job", choices=("torchrun", "mp.spawn"), help=argparse.SUPPRESS)  # a child job's role
    p.add_argument("--nprocs", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def _measure(args) -> dict[str, Any]:
    """The rows in this process's torch world (``init_process_group("loom")`` done): seconds per call, max over
    ranks, best of the rounds; and how the MPI world was made."""
    import torch
    import torch.distributed as dist

    from ..comm import world
    from ..torchdist import rendezvous
    from . import omb
    from .comm import raw_collectives

    torch.set_num_threads(1)
    comm = world()
    one = torch.ones(1, dtype=torch.uint8)
    big = torch.ones(args.size // 4, dtype=torch.float32)
    raw = raw_collectives(one.numpy(), big.numpy(), big.numpy()[: big.numel() // comm.size])
    rows = {"latency": {"loom": (lambda: dist.all_reduce(one), 30 * args.warmup, args.iterations),
                        "raw": (raw["latency"], 30 * args.warmup, args.iterations)},
            "bandwidth": {"loom": (lambda: dist.all_reduce(big), args.warmup, args.iterations_large),
                          "raw": (raw["allreduce"], args.warmup, args.iterations_large)}}
    best: dict[str, dict[str, float]] = {}
    for row, sides in rows.items():
        for _ in range(args.rounds):
            for side, (fn, warm, iters) in sides.items():
                t = comm.allreduce_object(omb.time_op(fn, comm, warm, iters, max_seconds=args.max_seconds,
                                                      nbytes=args.size), "max")
                best.setdefault(row, {})[side] = min(best.get(row, {}).get(side, float("inf")), t)
    return {"ranks": comm.size, "seconds": best,
            "world": "formed through the store" if rendezvous.bootstrapped() else "from the MPI launcher"}


def _job(args) -> int:
    """One child job's process (torchrun's, or one of mp.spawn's through :func:`_spawned`)."""
    import torch.distributed as dist

    import loom  # noqa: F401 - registers the backend

    if not dist.is_initialized():
        dist.init_process_group("loom")
    res = _measure(args)
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    return 0


def _spawned(rank: int, argv: list[str], port: int) -> None:
    import torch.distributed as dist

    import loom  # noqa: F401

    args = _parser().parse_args(argv)
    dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.nprocs)
    _job(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(route: str, argv: list[str], nprocs: int) -> dict[str, Any]:
    """Run ``route`` as a job of ``nprocs`` processes outside MPI; its result."""
    from ..comm.pmi import LAUNCHER_VARS

    out = tempfile.mktemp(prefix="loom-bench-launchers-", suffix=".json")
    own = [*argv, "--nprocs", str(nprocs), "--out", out]
    if route == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-port",
               str(_free_port()), "-m", "loom.bench.launchers", "--job", "torchrun", *own]
    else:
        cmd = [sys.executable, "-c", "import sys; from loom.bench.launchers import spawn_main; "
               "sys.exit(spawn_main(sys.argv[1:]))", "--job", "mp.spawn", *own]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("MPI_", "HYDRA_"))}
    env.pop("LOOM_LAUNCHED", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"loom bench launchers: the {route} job failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def spawn_main(argv: list[str]) -> int:
    """The mp.spawn route's parent: ``--nprocs`` processes, each :func:`_spawned`."""
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(argv, _free_port()), nprocs=_parser().parse_args(argv).nprocs)
    return 0


def _table(results: dict[str, dict], size: int, rank: int, path: str | None) -> None:
    from . import omb

    table = omb.Table("torch backend under each launcher: dist.all_reduce vs raw mpi4py in the same world",
                      ["Route", "world", "1 B loom (us)", "1 B raw (us)", "loom/raw", "bw loom (GB/s)",
                       "bw raw (GB/s)", "loom/raw "], rank=rank)
    table.meta = {"size": size, "bandwidth": "bus GB/s of a float32 allreduce, 2 (P-1)/P x bytes / time",
                  "raw": "mpi4py in-place Allreduce on numpy views of the same buffers"}
    table.widths = [10, 26, 15, 14, 10, 16, 15, 10]
    table.header()
    for route, res in results.items():
        s, p = res["seconds"], res["ranks"]
        bw = {k: 2 * (p - 1) / p * size / v / 1e9 for k, v in s["bandwidth"].items()}
        table.add(route, res["world"], s["latency"]["loom"] * 1e6, s["latency"]["raw"] * 1e6,
                  s["latency"]["loom"] / s["latency"]["raw"], bw["loom"], bw["raw"], bw["loom"] / bw["raw"])
    table.write_json(path, results=results)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.job:
        return _job(args)
    import torch.distributed as dist

    from ..comm import world

    comm = world()
    if comm.size < 2:
        raise cli_args.UsageError("loom bench launchers times collectives of 2 ranks or more; run it with --ranks 2")
    results: dict[str, dict] = {}
    if "mpiexec" in args.routes:
        dist.init_process_group("loom")
        results["mpiexec"] = _measure(args)
        dist.destroy_process_group()
    import torch

    if comm.rank == 0:
        try:
            for route in (r for r in args.routes if r != "mpiexec"):
                results[route] = _child(route, _child_argv(args), comm.size)
        finally:  # release the waiting ranks whatever happened
            for r in range(1, comm.size):
                comm.send(torch.zeros(1), r, tag=11)
    else:  # a receive that sleeps between tests: no core taken from the timed child jobs
        comm.irecv(torch.zeros(1), 0, tag=11).wait()
    _table(results, args.size, comm.rank, args.json)
    return 0


def _child_argv(args) -> list[str]:
    """The measuring options, for a child job."""
    return ["--size", str(args.size), "-i", str(args.iterations), "--iterations-large", str(args.iterations_large),
            "-x", str(args.warmup), "--rounds", str(args.rounds), "--max-seconds", str(args.max_seconds)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
