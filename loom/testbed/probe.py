"""The MPI side of ``loom testbed check``: ping-pong latency and windowed bandwidth per link class.

Runs on the testbed's ranks (``python -m loom.testbed.probe``), reads the topology from
``$LOOM_TESTBED_TOPOLOGY`` and measures one *class* at a time while the other ranks wait:

=========  ===========================================  ==============================================
class      pairs (ranks)                                configured rate
=========  ===========================================  ==============================================
intra      node 0 local 0 <-> node 0 local 1            intra_gbit
rail       node 0 local 0 <-> node 1 local 0            rail_gbit
cross      node 0 local 0 -> node 1 local 1             min(rail, intra): PXN route via a forwarding hop
rails      node 0 local k <-> node 1 local k, all k     rails x rail_gbit (all rails at once)
=========  ===========================================  ==============================================

Plan per class: split COMM_WORLD into the class's ranks (key = world rank) and the rest; on the class
communicator, (1) ping-pong 8-byte messages (``send``/``recv``) to get the one-way latency, (2) stream
windows of ``--window`` non-blocking sends of ``--size`` bytes from the first rank of every pair to the second
(``isend``/``irecv`` + ``wait_all``, then a 1-byte ack), as osu_bw does. All pairs of a class stream at the
same time. Both loops are timed by :func:`loom.comm.measure.time_op` (warm-up excluded, bounded by
``--seconds``); the window count is chosen from the warm-up window so that a slow link still ends in time.
Buffers are allocated once per class. Rank 0 gathers the results and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

__all__ = ["CLASSES", "class_pairs", "configured_gbit", "measure", "main"]

CLASSES = ("intra", "rail", "cross", "rails")


def class_pairs(topo: dict, name: str) -> list[tuple[int, int]]:
    """The (sender, receiver) world-rank pairs a class measures on this topology; ``[]`` if it has none."""
    per = len(topo["nodes"][0]["ranks"])
    nodes = len(topo["nodes"])
    rails = int(topo["rails"])
    if name == "intra":
        return [(0, 1)] if per >= 2 else []
    if name == "rail":
        return [(0, per)] if nodes >= 2 else []
    if name == "cross":
        return [(0, per + 1)] if nodes >= 2 and rails >= 2 else []
    if name == "rails":
        return [(k, per + k) for k in range(rails)] if nodes >= 2 and rails >= 2 else []
    raise ValueError(f"unknown link class {name!r}; valid: {', '.join(CLASSES)}")


def configured_gbit(topo: dict, name: str) -> float:
    """The rate a class should reach by construction (0.0 = unlimited)."""
    rail, intra = float(topo["rail_gbit"]), float(topo["intra_gbit"])
    if name == "intra":
        return intra
    if name == "rail":
        return rail
    if name == "cross":
        limited = [g for g in (rail, intra) if g > 0]
        return min(limited) if limited else 0.0
    if name == "rails":
        return rail * int(topo["rails"])
    raise ValueError(f"unknown link class {name!r}; valid: {', '.join(CLASSES)}")


def _path(topo: dict, pairs: list[tuple[int, int]]) -> str:
    a, b = pairs[0]
    path = " ".join(topo["routes"][f"{a}->{b}"])
    return path + (f" (+{len(pairs) - 1} more)" if len(pairs) > 1 else "")


def measure(comm, topo: dict, name: str, *, size: int = 1 << 20, window: int = 8, seconds: float = 2.0,
            pingpongs: int = 200) -> dict[str, Any] | None:
    """Measure one link class (collective over ``comm``, every rank calls it); the class's ranks return the
    result row (class, pairs, path, configured_gbit, achieved_gbit, latency_us), the others ``None``.

    Args:
        comm: COMM_WORLD of the testbed job (a :class:`loom.comm.Communicator`).
        topo: the testbed's :func:`~loom.testbed.topology.topology_dict`.
        name: one of :data:`CLASSES`.
        size: bytes per message of a bandwidth window; window: messages per window.
        seconds: time bound of each bandwidth loop; pingpongs: timed ping-pongs for the latency.
    """
    from loom.comm import measure as omb
    from loom.comm import wait_all

    if size < 1 or window < 1 or pingpongs < 1 or not seconds > 0:
        raise ValueError(f"size={size}, window={window}, pingpongs={pingpongs} must be >= 1 and "
                         f"seconds={seconds} > 0")
    pairs = class_pairs(topo, name)
    if not pairs:
        return None
    # Keep one window within a quarter of the time bound at the configured rate (a 1 Mbit/s link would
    # otherwise need a minute for the default 8 MiB window): fewer messages first, then smaller ones.
    rate = configured_gbit(topo, name) * 1e9 / 8 / len(pairs)
    if rate > 0 and size * window > rate * seconds / 4:
        budget = int(rate * seconds / 4)
        window = max(1, min(window, budget // size))
        size = max(1024, min(size, budget // window))
    members = sorted({r for p in pairs for r in p})
    inside = comm.rank in members
    sub = comm.split(0 if inside else 1, comm.rank, name=f"testbed-{name}")
    result = None
    if inside:
        idx = {w: i for i, w in enumerate(members)}
        mine = next(p for p in pairs if comm.rank in p)
        peer = idx[mine[1] if comm.rank == mine[0] else mine[0]]
        sender = comm.rank == mine[0]
        small = np.zeros(8, np.uint8)
        ack = np.zeros(1, np.uint8)
        bufs = [np.ones(size, np.uint8) for _ in range(window)]

        pingpong = omb.pingpong(sub.send, sub.recv, small, peer, first=sender, tag=1)

        def stream() -> None:
            if sender:
                wait_all([sub.isend(b, peer, tag=2) for b in bufs])
                sub.recv(ack, peer, tag=3)
            else:
                wait_all([sub.irecv(b, peer, tag=2) for b in bufs])
                sub.send(ack, peer, tag=3)

        lat = omb.time_op(pingpong, sub, 10, pingpongs, max_seconds=seconds / 4) / 2
        one = omb.time_op(stream, sub, 1, 1, max_seconds=seconds)  # warm-up + one timed window
        # Every member runs the same number of windows: the slowest pair's estimate decides.
        one = sub.allreduce_object(one, op="max")
        n = int(max(2, min(64, seconds / max(one, 1e-6))))
        per_window = omb.time_op(stream, sub, 0, n, max_seconds=seconds)
        t = sub.allreduce_object(per_window, op="max")
        moved = size * window * len(pairs)
        result = {
            "class": name,
            "pairs": [list(p) for p in pairs],
            "path": _path(topo, pairs),
            "configured_gbit": configured_gbit(topo, name),
            "achieved_gbit": moved * 8 / t / 1e9,
            "latency_us": sub.allreduce_object(lat, op="max") * 1e6,
            "windows": n,
            "bytes_per_window": moved,
        }
    sub.free()
    comm.barrier()
    return result


def parser() -> argparse.ArgumentParser:
    from loom.comm import measure as omb

    p = argparse.ArgumentParser(prog="python -m loom.testbed.probe", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated subset of {', '.join(CLASSES)}")
    p.add_argument("-s", "--size", type=omb.parse_size, default=1 << 20, help="bytes per message")
    p.add_argument("-w", "--window", type=int, default=8, help="messages in flight per window")
    p.add_argument("--seconds", type=float, default=2.0, help="time bound per class (bandwidth loop)")
    p.add_argument("--pingpongs", type=int, default=200, help="timed ping-pongs for the latency")
    p.add_argument("--json", metavar="PATH", help="write the results (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from loom.comm import world

    from .topology import current_topology

    args = parser().parse_args(argv)
    names = [c.strip() for c in args.classes.split(",") if c.strip()]
    for c in names:
        if c not in CLASSES:
            raise SystemExit(f"probe: unknown link class {c!r}; valid: {', '.join(CLASSES)}")
    if args.size < 1 or args.window < 1 or args.seconds <= 0 or args.pingpongs < 1:
        raise SystemExit("probe: --size, --window, --pingpongs must be >= 1 and --seconds > 0")
    topo = current_topology()
    if topo is None:
        raise SystemExit("probe: LOOM_TESTBED_TOPOLOGY is not set; run it through `loom testbed check`")
    torch.set_num_threads(1)
    comm = world()
    if comm.size != len(topo["ranks"]):
        raise SystemExit(f"probe: {comm.size} ranks but the topology has {len(topo['ranks'])}")
    results = [measure(comm, topo, c, size=args.size, window=args.window, seconds=args.seconds,
                       pingpongs=args.pingpongs) for c in names]
    everything = comm.gather_object([r for r in results if r is not None], root=0)
    if comm.rank == 0:
        seen: dict[str, dict] = {}
        for rows in everything or []:
            for row in rows:
                seen.setdefault(row["class"], row)
        rows = [seen[c] for c in names if c in seen]
        for row in rows:
            print(f"{row['class']:<6} {row['achieved_gbit']:.3f} Gbit/s (configured {row['configured_gbit']:g})"
                  f"  latency {row['latency_us']:.1f} us  {row['path']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "topology": {k: topo[k] for k in ("rails", "rail_gbit", "intra_gbit")}},
                          f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
