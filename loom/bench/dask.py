"""``loom bench dask``: Dask's comm layer over ``mpi://`` against ``tcp://``, then two applications.

Plan (one invocation on ``--ranks N`` ranks; started outside MPI without ``--ranks`` it launches 4):

1. **Comm ping-pong**: rank 1 listens on ``mpi://`` and ``tcp://127.0.0.1`` with an echo handler, rank 0
   connects to both and, per power-of-two size from ``-m`` to ``-M``, times ``write`` + ``read`` round trips.
   Each round also times two references, raw loom.comm's blocking ``send``/``recv`` ping-pong of the same
   size (rank 0 asks rank 1 for them over the mpi:// comm): into one reused buffer per rank (the MPI floor:
   from 4 MiB up, the copy runs from cache), and with a comm's buffers (rank 0 sends from its message and
   receives into a second buffer, as the mpi:// client must; rank 1 sends back from the buffer it received
   into). All four are interleaved round by round and each keeps its best round. Messages up to 8 KiB are a ``bytes``
   object (inside Dask's msgpack frame); larger ones a numpy buffer behind ``to_serialize`` (its own frame,
   zero-copy), as Dask sends task data. Latency is half the round trip; bandwidth is size / latency.
2. **Applications** on 1 scheduler (rank 0) + 1 client (rank 1) + workers (ranks 2..), ``--cycles`` clusters
   per transport, started in ``--order`` cycle after cycle, each application's best cluster kept:
   ``(x + x.T).sum()`` of a persisted random numpy-backed dask array (``--array``
   square in ``--chunk`` blocks), a dataframe merge of two persisted pandas-backed frames (``--rows`` rows
   each, ``--partitions`` partitions, ~``rows/4`` distinct keys) and ``--tasks`` tiny tasks (the scheduler's
   per-task cost); best of ``--app-rounds`` wall times, each round from a scheduler that forgot the last.

Rank 0 prints the comm tables, rank 1 the application table; ``--json PATH`` writes all three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime, timezone

import numpy as np

from . import omb

__all__ = ["main"]

SMALL = 8192
_TINY = "tiny tasks"


def _order(text: str) -> list[str]:
    order = [t.strip() for t in text.split(",")]
    if sorted(order) != ["mpi", "tcp"]:
        raise argparse.ArgumentTypeError(f"--order {text!r}: name both transports once, e.g. mpi,tcp or tcp,mpi")
    return order


def _parser():
    p = omb.parser("dask", "Dask comm ping-pong and applications: mpi:// vs tcp://", min_size=1,
                   max_size=64 << 20, vs=("tcp",), default_vs="tcp")
    p.set_defaults(iterations=500, iterations_large=30, warmup=50, warmup_large=3, rounds=2, max_seconds=2.0)
    p.add_argument("--array", type=int, default=8000, help="side of the square array for (x + x.T).sum()")
    p.add_argument("--chunk", type=int, default=1000, help="chunk side of that array")
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of each dataframe in the merge")
    p.add_argument("--partitions", type=int, default=8, help="partitions of each dataframe")
    p.add_argument("--tasks", type=int, default=1000,
                   help="tiny tasks (client.map of i + 1) in the third application: the scheduler's per-task cost")
    p.add_argument("--app-rounds", type=int, default=2, help="timed runs per application and transport")
    p.add_argument("--order", type=_order, default=["mpi", "tcp"],
                   help="which transport's cluster runs the applications first (the second runs in processes "
                        "the first already warmed up): mpi,tcp (default) or tcp,mpi")
    p.add_argument("--cycles", type=int, default=2,
                   help="clusters per transport, run in --order cycle after cycle; each application's best over "
                        "them is kept (the first cluster in a process runs cold, whichever transport it uses)")
    p.add_argument("--skip-comm", action="store_true", help="only the applications")
    p.add_argument("--skip-apps", action="store_true", help="only the comm ping-pong")
    return p


def _msg(size: int):
    from distributed.protocol import to_serialize

    if size <= SMALL:
        return b"x" * size
    return {"x": to_serialize(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))}  # incompressible


def _raw_pingpong(comm, peer: int, buf: np.ndarray, n: int, serve: bool, into: np.ndarray | None = None) -> None:
    """``n`` round trips of ``buf`` over loom.comm's blocking send/recv (the raw reference); the client
    receives into ``into`` when given (a comm's buffers: its message stays, the reply lands elsewhere)."""
    trip = omb.pingpong(comm.send, comm.recv, buf, peer, first=not serve, tag=11, into=into)
    for _ in range(n):
        trip()


async def _echo_server(comm, transports: list[str]) -> None:
    from distributed.comm import CommClosedError, listen
    from distributed.protocol import to_serialize

    finished = asyncio.Event()
    ended: list[str] = []

    async def echo(c):
        try:
            while True:
                m = await c.read()
                if isinstance(m, dict) and "raw" in m:  # the client times raw loom.comm in this round
                    _raw_pingpong(comm, 0, np.ones(m["size"], np.uint8), m["raw"], serve=True)
                    await c.write("done")
                    continue
                await c.write({"x": to_serialize(m["x"])} if isinstance(m, dict) else m)
                # Not held while the next message arrives: its block then returns to the pool and receives that
                # message (one block per size, as raw loom.comm reuses one buffer), not a second one.
                m = None
        except CommClosedError:
            pass
        finally:
            ended.append(c.local_address)
            if len(ended) == len(transports):
                finished.set()

    listeners = [await listen("mpi://" if t == "mpi" else "tcp://127.0.0.1", echo) for t in transports]
    comm.send_object([lst.contact_address for lst in listeners], 0, tag=13)
    await finished.wait()
    for lst in listeners:
        lst.stop()


async def _time_raw(comm, ctl, size: int, warm: int, iters: int, apart: bool = False) -> float:
    """Seconds per one-way message of raw loom.comm send/recv, rank 1 serving (asked over the ``ctl`` comm);
    ``apart``: the reply lands in a second buffer, not the one sent from."""
    buf = np.ones(size, np.uint8)
    into = np.ones(size, np.uint8) if apart else None
    await ctl.write({"raw": warm + iters, "size": size})
    _raw_pingpong(comm, 1, buf, warm, serve=False, into=into)
    t0 = time.perf_counter()
    _raw_pingpong(comm, 1, buf, iters, serve=False, into=into)
    dt = (time.perf_counter() - t0) / iters / 2
    await ctl.read()
    return dt


async def _time_comm(c, msg, warm: int, iters: int, max_seconds: float) -> float:
    """Seconds per one-way message of Dask ``write`` + ``read`` round trips on comm ``c``."""
    for _ in range(warm):
        await c.write(msg)
        await c.read()
    t0 = time.perf_counter()
    done = 0
    while done < iters:
        await c.write(msg)
        await c.read()
        done += 1
        if time.perf_counter() - t0 > max_seconds:
            break
    return (time.perf_counter() - t0) / done / 2


async def _ping_client(comm, args, transports: list[str], sizes: list[int]) -> dict[str, dict[int, float]]:
    """Per size, rounds of raw loom.comm, then each transport, interleaved; the best round of each is kept."""
    from distributed.comm import connect

    addresses = comm.recv_object(1, tag=13)
    comms = {t: await connect(a, timeout=60) for t, a in zip(transports, addresses)}
    best: dict[str, dict[int, float]] = {t: {} for t in ["raw", "raw2", *transports]}
    for size in sizes:
        msg = _msg(size)
        warm, iters = omb.iterations(size, args)
        for _ in range(max(1, args.rounds)):
            for key, apart in (("raw", False), ("raw2", True)):
                raw = await _time_raw(comm, comms["mpi"], size, warm, iters, apart)
                best[key][size] = min(best[key].get(size, float("inf")), raw)
            for t in transports:
                lat = await _time_comm(comms[t], msg, warm, iters, args.max_seconds)
                best[t][size] = min(best[t].get(size, float("inf")), lat)
    for c in comms.values():
        await c.close()
    return best


def _quiet_barrier(comm, poll_s: float = 0.02) -> None:
    """A barrier that sleeps while it waits, unlike MPI_Barrier's busy spin: on a machine with more ranks than
    cores, bystanders would slow the ranks being measured. It tests every ``poll_s`` (not on loom's 2 ms
    back-off: bystanders waking 500 times a second added ~0.5 us to the 1-byte mpi:// latency on 2 cores)."""
    req = comm.iallreduce(np.zeros(1))
    while not req.test():
        time.sleep(poll_s)


def _comm_tables(comm, args, doc: dict) -> None:
    sizes = omb.sizes(args.min_size, args.max_size)
    transports = ["mpi", "tcp"]
    from loom.dask.backend import start

    start()  # every rank: mpi:// on its own duplicate communicator
    _quiet_barrier(comm)
    best = None
    # Only ranks 0 and 1 work here (the others sleep in _quiet_barrier), so they spin as ranks with a core each
    # do, even where the job as a whole has more ranks than cores (then the defaults are more frugal).
    dedicated = (os.cpu_count() or 1) >= 2
    if dedicated and comm.rank < 2:
        from loom.dask.backend import set_spin

        before = set_spin(poll_us=1000, inline_us=50)
    if comm.rank == 1:
        asyncio.run(_echo_server(comm, transports))
    elif comm.rank == 0:
        best = asyncio.run(_ping_client(comm, args, transports, sizes))
    if dedicated and comm.rank < 2:
        set_spin(poll_us=before[0], inline_us=before[1])
    _quiet_barrier(comm)
    if comm.rank == 0:
        _print_comm_tables(comm, best, sizes, doc, dedicated)


def _print_comm_tables(comm, best: dict, sizes: list[int], doc: dict, dedicated: bool) -> None:
    meta = {"ranks": "0 <-> 1" + (" (a core each: mpi:// spins 1 ms, inline 50 us)" if dedicated else ""),
            "peer": "tcp://127.0.0.1 (Dask's TCP comm)",
            "reference": "raw loom.comm send/recv of the same sizes, rounds interleaved: loom.comm into one reused "
                         "buffer per rank; 2 bufs with the reply into a second buffer on rank 0 (a comm's buffers)"}
    lat = omb.Table("Dask comm Latency Test (mpi:// vs tcp:// vs raw loom.comm)",
                    ["Size", "mpi (us)", "tcp (us)", "tcp/mpi", "loom.comm (us)", "mpi/loom.comm",
                     "2 bufs (us)", "mpi/2 bufs"], rank=comm.rank, meta=meta)
    bw = omb.Table("Dask comm Bandwidth Test (ping-pong, mpi:// vs tcp:// vs raw loom.comm)",
                   ["Size", "mpi (MB/s)", "tcp (MB/s)", "mpi/tcp", "loom.comm (MB/s)", "mpi/loom.comm",
                    "2 bufs (MB/s)", "mpi/2 bufs"], rank=comm.rank, meta=meta)
    lat.header()
    for s in sizes:
        m, t, r, r2 = best["mpi"][s], best["tcp"][s], best["raw"][s], best["raw2"][s]
        lat.add(s, m * 1e6, t * 1e6, t / m, r * 1e6, m / r, r2 * 1e6, m / r2)
    print(flush=True)
    bw.header()
    for s in sizes:
        m, t, r, r2 = best["mpi"][s], best["tcp"][s], best["raw"][s], best["raw2"][s]
        bw.add(s, s / m / 1e6, s / t / 1e6, t / m, s / r / 1e6, r / m, s / r2 / 1e6, r2 / m)
    print(flush=True)
    doc["latency"] = lat.rows
    doc["bandwidth"] = bw.rows


def _inc(i: int) -> int:
    return i + 1


def _process_cpu() -> float:
    return time.process_time()


def _cluster_cpu(client) -> float:
    """CPU seconds used so far by the scheduler, every worker and this client process."""
    return client.run_on_scheduler(_process_cpu) + sum(client.run(_process_cpu).values()) + time.process_time()


def _scheduler_tasks(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _apps_client(address: str, args) -> dict[str, float]:
    import dask.array as da
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client, wait

    def frame(i: int, seed: int, rows: int, keys: int) -> pd.DataFrame:
        rng = np.random.default_rng(seed * 1000 + i)
        return pd.DataFrame({"k": rng.integers(0, keys, rows), f"v{seed}": rng.standard_normal(rows)})

    def settle(client, baseline: int) -> None:
        """Wait until the scheduler forgot the last round's tasks: a round that asks for keys still held from
        the round before (their release is asynchronous) would be a cache hit, not a computation."""
        deadline = time.monotonic() + 30
        while client.run_on_scheduler(_scheduler_tasks) > baseline and time.monotonic() < deadline:
            time.sleep(0.01)

    def rounds(client, fn) -> tuple[float, float, object]:
        """Best wall time of ``--app-rounds`` runs of ``fn(round)``, the CPU seconds every process of the
        cluster (scheduler, workers, this client) used in that round, and its result."""
        baseline = client.run_on_scheduler(_scheduler_tasks)
        best, cpu, out = float("inf"), 0.0, None
        for r in range(max(1, args.app_rounds)):
            settle(client, baseline)
            c0 = _cluster_cpu(client)
            t0 = time.perf_counter()
            out = fn(r)
            dt = time.perf_counter() - t0
            if dt < best:
                best, cpu = dt, _cluster_cpu(client) - c0
        return best, cpu, out

    times: dict[str, float] = {}
    with Client(address) as client:
        x = da.random.default_rng(0).random((args.array, args.array), chunks=(args.chunk, args.chunk))
        x = client.persist(x)
        wait(x)
        t, cpu, total = rounds(client, lambda r, x=x: float((x + x.T).sum().compute()))
        times["(x + x.T).sum()"], times["(x + x.T).sum() cpu"] = t, cpu
        del x
        rows = args.rows // args.partitions
        keys = max(1, args.rows // 4)
        left = dd.from_map(frame, range(args.partitions), seed=1, rows=rows, keys=keys)
        right = dd.from_map(frame, range(args.partitions), seed=2, rows=rows, keys=keys)
        left, right = client.persist([left, right])
        wait([left, right])
        t, cpu, n = rounds(client,
                           lambda r, a=left, b=right: int(a.merge(b, on="k").map_partitions(len).sum().compute()))
        times["dataframe merge"], times["dataframe merge cpu"] = t, cpu
        del left, right

        def tiny(r: int) -> int:
            futures = client.map(_inc, range(r * args.tasks, (r + 1) * args.tasks))
            return sum(client.gather(futures)) - r * args.tasks * args.tasks

        t, cpu, k = rounds(client, tiny)
        times[_TINY], times[_TINY + " cpu"] = t, cpu
        times["_check"] = (round(total, 3), n, k)  # the same on both transports (compared by the caller)
    return times


def _app_table(comm, args, doc: dict) -> None:
    from loom.dask.launcher import serve, shutdown

    results: dict[str, dict[str, float]] = {}
    for _ in range(max(1, args.cycles)):
        for protocol in args.order:
            address = serve(protocol=protocol, memory_limit=None)
            if address is not None:
                try:
                    times = _apps_client(address, args)
                finally:
                    shutdown(address)
                best = results.setdefault(protocol, times)
                for app in ("(x + x.T).sum()", "dataframe merge", _TINY):
                    if times[app] < best[app]:
                        best[app], best[app + " cpu"] = times[app], times[app + " cpu"]
            _quiet_barrier(comm)
    if comm.rank == 1:
        w = comm.size - 2
        table = omb.Table(f"Dask applications (1 scheduler + 1 client + {w} workers)",
                          ["Application", "mpi (s)", "tcp (s)", "tcp/mpi", "mpi cpu (s)", "tcp cpu (s)"],
                          rank=0,
                          meta={"order": f"{args.order[0]} cluster first, then {args.order[1]} (same processes), "
                                         f"{max(1, args.cycles)} cycle(s); best cluster of each transport",
                                "array": f"{args.array}^2 fp64 in {args.chunk}^2 chunks",
                                "merge": f"2 x {args.rows} rows, {args.partitions} partitions",
                                "tiny tasks": f"{args.tasks} x client.map(i + 1), gathered",
                                "cpu": "CPU seconds of scheduler + workers + client in the best round"})
        if results["mpi"]["_check"] != results["tcp"]["_check"]:
            raise RuntimeError(f"the applications' results differ between mpi:// and tcp://: "
                               f"{results['mpi']['_check']!r} vs {results['tcp']['_check']!r}")
        table.header()
        for app in ("(x + x.T).sum()", "dataframe merge", _TINY):
            m, t = results["mpi"][app], results["tcp"][app]
            table.add(app, m, t, t / m, results["mpi"][app + " cpu"], results["tcp"][app + " cpu"])
        doc["apps"] = table.rows


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from loom.comm import launch

    if not launch.inside_job():
        env = {"LOOM_LAUNCHED": "1", "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "error"}
        return launch.run(4, [sys.executable, "-m", "loom.cli", "bench", "dask", *argv], env=env).returncode
    import logging

    logging.getLogger("distributed").setLevel(logging.ERROR)
    from loom.comm import world

    comm = world()
    if comm.size < 2:
        print("loom bench dask needs >= 2 ranks (4 for the applications): loom bench dask --ranks 4", file=sys.stderr)
        return 2
    doc: dict = {}
    if not args.skip_comm:
        _comm_tables(comm, args, doc)
    if not args.skip_apps:
        if comm.size < 4:
            if comm.rank == 0:
                print("# applications skipped: they need >= 4 ranks (scheduler, client, 2 workers)", flush=True)
        else:
            _app_table(comm, args, doc)
    docs = comm.gather_object(doc, 0)
    if args.json and comm.rank == 0:
        merged = {k: v for d in docs for k, v in d.items()}
        merged.update(machine=omb.machine_info(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      command="loom bench dask " + " ".join(argv), ranks=comm.size,
                      note=f"{os.cpu_count()}-core machine shared with other jobs; timings are noisy")
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=2)
    return 0
