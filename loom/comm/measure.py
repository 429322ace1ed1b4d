"""How loom measures communication: argument parser, size sweep, timing loop, OMB table, JSON.

It lives in the communication layer, not in ``loom.bench``, because capability packages (``loom.compress``,
``loom.multipath``, ``loom.testbed``) measure too and must not depend on the benchmark commands;
``loom.bench.omb`` re-exports it for those commands.

The table follows the OSU Micro-Benchmarks layout (``# Size`` then one row per power-of-two size); extra
statistics (the peer's number, the ratio) come after the OMB columns. Rank 0 prints; every rank times.

Timing plan (:func:`time_op`): barrier, ``warmup`` untimed calls, then ``iters`` timed calls; repeated for
``rounds`` rounds, interleaved with the peer by the caller, keeping the best round's mean (the least-disturbed
round on a shared machine). Each round stops early after ``max_seconds`` so every run is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from ..cli_args import ArgumentParser, parse_size

__all__ = [
    "parser",
    "parse_size",
    "sizes",
    "iterations",
    "time_op",
    "pingpong",
    "Table",
    "machine_info",
]

def parser(prog: str, description: str, *, min_size: int = 1, max_size: int = 1 << 22,
           vs: Sequence[str] = ("none", "raw"), default_vs: str = "raw") -> argparse.ArgumentParser:
    """The common options of a comm benchmark; callers add their own."""
    p = ArgumentParser(prog=f"loom bench {prog}", description=description)
    p.add_argument("-m", "--min-size", type=parse_size, default=min_size, help="smallest message (bytes, 1K, 1M)")
    p.add_argument("-M", "--max-size", type=parse_size, default=max_size, help="largest message")
    p.add_argument("-i", "--iterations", type=int, default=1000, help="timed iterations at sizes <= 8 KiB")
    p.add_argument("--iterations-large", type=int, default=100, help="timed iterations above 8 KiB")
    p.add_argument("-x", "--warmup", type=int, default=100, help="untimed iterations at sizes <= 8 KiB")
    p.add_argument("--warmup-large", type=int, default=10, help="untimed iterations above 8 KiB")
    p.add_argument("--rounds", type=int, default=3, help="rounds per size (best round kept), peer interleaved")
    p.add_argument("--max-seconds", type=float, default=10.0, help="time bound per size and round")
    p.add_argument("--buffer", choices=("numpy", "torch"), default="numpy", help="buffer type")
    p.add_argument("--vs", choices=tuple(vs), default=default_vs, help="peer measured in the same run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.checks.append(lambda a: f"--max-size {a.max_size} is below --min-size {a.min_size}; raise --max-size or "
                              f"lower --min-size" if a.max_size < a.min_size else None)
    return p


def sizes(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` inclusive (``lo`` rounded up to a power of two; 0 allowed)."""
    if hi < lo:
        raise ValueError(f"--max-size {hi} is below --min-size {lo}")
    out = [0] if lo == 0 else []
    s = 1
    while s < max(lo, 1):
        s <<= 1
    while s <= hi:
        out.append(s)
        s <<= 1
    return out


def iterations(size: int, args: argparse.Namespace) -> tuple[int, int]:
    """``(warmup, iters)``: fewer above 8 KiB, as OMB does."""
    if size > 8192:
        return args.warmup_large, args.iterations_large
    return args.warmup, args.iterations


def time_op(fn: Callable[[], Any], comm, warmup: int, iters: int, *, max_seconds: float = 10.0,
            nbytes: int = 0) -> float:
    """Mean seconds per call of ``fn`` on this rank (after a barrier and ``warmup`` calls).

    All ranks run the same number of iterations: the count is cut short only by agreement (rank 0 decides
    from its clock and broadcasts), so a collective loop never desynchronises. The warm-up and the timed
    loop are each bounded by ``max_seconds``, checked every 64 calls for small messages and after every
    call above 1 MiB (``nbytes``) or once a call takes over ``max_seconds / 64``, so a loop overshoots its
    bound by at most one call even when one call moves a window of large messages.
    """
    every = 1 if nbytes > _PER_CALL_CHECK else 64
    _bounded(fn, comm, warmup, max_seconds, every)
    comm.barrier()
    t0 = time.perf_counter()
    done = _bounded(fn, comm, iters, max_seconds, every)
    return (time.perf_counter() - t0) / max(done, 1)


_PER_CALL_CHECK = 1 << 20  # bytes per call above which time_op checks its time bound after every call


def pingpong(send: Callable, recv: Callable, buf: Any, peer: int, *, first: bool, tag: int = 0,
             into: Any = None) -> Callable[[], None]:
    """One round trip with ``peer``, as a call to time: half its time is the one-way latency.

    The ``first`` side sends ``buf`` and receives the reply into ``into`` (default: ``buf`` itself); the other
    side receives into ``buf`` and sends it back. ``send(buffer, peer, tag)`` and ``recv(buffer, peer, tag)``
    are blocking calls of one communicator: loom's, or raw mpi4py's ``Send``/``Recv`` when measuring the peer,
    so every ping-pong loom times (``loom bench latency``, ``loom bench dask``, the testbed probe) is one pattern.
    """
    back = buf if into is None else into
    if first:
        def trip() -> None:
            send(buf, peer, tag)
            recv(back, peer, tag)
    else:
        def trip() -> None:
            recv(buf, peer, tag)
            send(buf, peer, tag)
    return trip


def _bounded(fn: Callable[[], Any], comm, n: int, max_seconds: float, every: int) -> int:
    """Call ``fn`` up to ``n`` times, stopping (by rank 0's agreement) once ``max_seconds`` have passed."""
    done = 0
    t0 = time.perf_counter()
    while done < n:
        block = 1 if done == 0 else min(every, n - done)  # the first call alone: it tells a slow call early
        for _ in range(block):
            fn()
        done += block
        if done < n:
            elapsed = time.perf_counter() - t0
            stop = elapsed > max_seconds
            if every > 1 and elapsed / done > max_seconds / 64:
                every = 1  # slow calls: check after each one from now on
            if comm.size > 1:
                stop, every = comm.bcast_object((stop, every), 0)
            if stop:
                break
    return done


@dataclass
class Table:
    """An OMB-style table printed row by row on rank 0 and collected for ``--json``."""

    title: str
    columns: list[str]
    rank: int = 0
    widths: list[int] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def header(self) -> None:
        if not self.widths:
            self.widths = [max(12, len(c) + 2) for c in self.columns]
            self.widths[0] = max(self.widths[0], 10)
        if self.rank == 0:
            print(f"# OSU-style loom {self.title}", flush=True)
            for k, v in self.meta.items():
                print(f"# {k}: {v}")
            first = f"# {self.columns[0]}".ljust(self.widths[0])
            rest = "".join(c.rjust(w) for c, w in zip(self.columns[1:], self.widths[1:]))
            print(first + rest, flush=True)

    def add(self, *values: Any) -> None:
        row = dict(zip(self.columns, values))
        self.rows.append(row)
        if self.rank == 0:
            cells = [str(values[0]).ljust(self.widths[0])]
            for v, w in zip(values[1:], self.widths[1:]):
                cells.append((f"{v:.2f}" if isinstance(v, float) else str(v)).rjust(w))
            print("".join(cells), flush=True)

    def write_json(self, path: str | None, **extra: Any) -> None:
        if not path or self.rank != 0:
            return
        doc = {"title": self.title, "columns": self.columns, "rows": self.rows, "meta": {**self.meta, **extra},
               "machine": machine_info(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join(sys.argv)}
        # Written whole, then renamed over the old file: a benchmark that writes after every probe and is killed
        # mid-write still leaves its last complete document.
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2)
        os.replace(tmp, path)


def machine_info() -> dict[str, Any]:
    import torch
    from mpi4py import MPI  # version strings only

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info
