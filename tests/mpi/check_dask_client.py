"""Client script for ``loom dask run`` (tests/integration/test_dask.py): MODE = apps | idle | raise | kill | survive.

apps:  (x + x.T).sum() of a numpy-backed dask array and a pandas merge, against single-process references
       (fp64, relative tolerance 1e-12; the merge compared exactly after sorting); every worker is mpi://;
       then the idle check.
idle:  the idle scheduler's and workers' pollers over 3 s: they sleep, and wake at most ~2 times per timer
       period plus Dask's own messages (counts, not a CPU share; the share is printed).
raise: the script raises, so the job must exit non-zero with the traceback.
kill:  a task SIGKILLs the worker running it mid-computation; the job must end promptly, naming the worker
       (run with --fail-fast: the launcher's default of ending the job).
survive: the client SIGKILLs the last worker while both applications run (slowed so the kill lands mid-graph,
       once that worker holds results); both must finish equal to the same graphs on a tcp:// cluster (two
       thread workers in this process) and to the single-process references; the scheduler must drop the
       worker. Prints the time from the kill to the completed graphs.
"""

from __future__ import annotations

import os
import signal
import sys

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client


def apps(client: Client) -> None:
    workers = client.scheduler_info()["workers"]
    assert len(workers) >= 1 and all(a.startswith("mpi://") for a in workers), list(workers)
    assert client.scheduler.address.startswith("mpi://")
    rng = np.random.default_rng(7)
    x_np = rng.standard_normal((600, 600))
    x = da.from_array(x_np, chunks=(150, 150))
    got = float((x + x.T).sum().compute())
    want = float((x_np + x_np.T).sum())
    assert abs(got - want) <= 1e-12 * np.abs(x_np).sum() * 2, (got, want)

    left = pd.DataFrame({"k": rng.integers(0, 300, 2000), "a": rng.standard_normal(2000)})
    right = pd.DataFrame({"k": np.arange(300), "b": rng.standard_normal(300)})
    merged = dd.from_pandas(left, npartitions=4).merge(dd.from_pandas(right, npartitions=3), on="k").compute()
    ref = left.merge(right, on="k")
    key = ["k", "a"]
    pd.testing.assert_frame_equal(merged.sort_values(key).reset_index(drop=True)[ref.columns],
                                  ref.sort_values(key).reset_index(drop=True))
    print("APPS OK", got, len(merged), flush=True)


def _slow(block):
    import time

    time.sleep(0.15)
    return block


def _graphs(x_np: np.ndarray, left: pd.DataFrame, right: pd.DataFrame):
    """The two applications, each task slowed so that the graphs run for seconds on three workers."""
    x = da.from_array(x_np, chunks=(150, 150)).map_blocks(_slow, dtype=x_np.dtype)
    total = (x + x.T).sum()
    merged = dd.from_pandas(left, npartitions=6).map_partitions(_slow).merge(
        dd.from_pandas(right, npartitions=3), on="k")
    return total, merged


def _sorted(df: pd.DataFrame, columns) -> pd.DataFrame:
    return df.sort_values(["k", "a"]).reset_index(drop=True)[columns]


def survive(client: Client) -> None:
    import time

    from distributed import LocalCluster

    rng = np.random.default_rng(11)
    x_np = rng.standard_normal((600, 600))
    left = pd.DataFrame({"k": rng.integers(0, 300, 3000), "a": rng.standard_normal(3000)})
    right = pd.DataFrame({"k": np.arange(300), "b": rng.standard_normal(300)})
    names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
    pids = client.run(os.getpid)
    victim = max(names, key=names.get)
    futures = client.compute(list(_graphs(x_np, left, right)))
    deadline = time.monotonic() + 120
    while not client.has_what().get(victim) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.has_what().get(victim), "the victim never held a result"
    assert not all(f.done() for f in futures), "the graphs finished before the kill"
    t0 = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    print("KILLED", names[victim], flush=True)
    total, merged = client.gather(futures)
    dt = time.monotonic() - t0
    print(f"KILL-TO-RESULT {dt:.2f} s", flush=True)
    while victim in client.scheduler_info()["workers"]:
        time.sleep(0.05)
    assert len(client.scheduler_info()["workers"]) == len(names) - 1

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://",
                      host="127.0.0.1", dashboard_address=":0") as cluster, Client(cluster) as tcp:
        assert cluster.scheduler_address.startswith("tcp://")
        tcp_total, tcp_merged = tcp.compute(list(_graphs(x_np, left, right)), sync=True)
    assert float(total) == float(tcp_total), (total, tcp_total)  # the same graph: the same sums, bit for bit
    want = float((x_np + x_np.T).sum())
    assert abs(float(total) - want) <= 1e-12 * np.abs(x_np).sum() * 2, (total, want)
    ref = left.merge(right, on="k")
    pd.testing.assert_frame_equal(_sorted(merged, ref.columns), _sorted(tcp_merged, ref.columns))
    pd.testing.assert_frame_equal(_sorted(merged, ref.columns), _sorted(ref, ref.columns))
    print("SURVIVE OK", float(total), len(merged), flush=True)


def _cpu() -> float:
    import time

    return time.process_time()


def _poll_counts() -> tuple[int, int, float]:
    """This rank's event-loop poller: passes, sleeps, and its timer period (the back-off cap)."""
    from loom.comm import poller

    p = poller()
    return p.passes, p.sleeps, p.backoff.max_sleep_s


def idle(client: Client, seconds: float = 3.0) -> None:
    """The idle scheduler and workers over ``seconds``: each rank's poller must sleep (a spinning wait takes
    no sleeps) and take no more wake-ups than ~2 per timer period plus Dask's own few messages a second.
    Counts of the mechanism, which a busy machine only lowers; the CPU share is printed, not checked."""
    import time

    time.sleep(1.0)  # let start-up work settle
    c0, p0, t0 = _run_everywhere(client, _cpu), _run_everywhere(client, _poll_counts), time.monotonic()
    time.sleep(seconds)
    c1, p1, dt = _run_everywhere(client, _cpu), _run_everywhere(client, _poll_counts), time.monotonic() - t0
    cpu = {k: (c1[k] - c0[k]) / dt for k in c0}
    rates = {k: ((p1[k][0] - p0[k][0]) / dt, (p1[k][1] - p0[k][1]) / dt, p1[k][2]) for k in p0}
    print("IDLE CPU " + " ".join(f"{k}={v:.1%}" for k, v in cpu.items()), flush=True)
    print("IDLE POLL " + " ".join(f"{k}={p:.0f}passes/s,{s:.0f}sleeps/s" for k, (p, s, _) in rates.items()),
          flush=True)
    for k, (_, sleeps, cap) in rates.items():
        assert sleeps > 0, f"{k}: its poller never slept in {dt:.1f} s: {rates}"
        assert sleeps <= 2 / cap + 50, f"{k}: {sleeps:.0f} wake-ups/s with a {cap * 1e3:.1f} ms timer: {rates}"


def _run_everywhere(client: Client, fn) -> dict:
    return {"scheduler": client.run_on_scheduler(fn), **client.run(fn)}


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill(client: Client) -> None:
    victim = max(w["name"] for w in client.scheduler_info()["workers"].values())
    print("KILLING", victim, flush=True)
    fut = client.submit(_die, workers=[victim], pure=False)
    fut.result(timeout=120)  # never returns: the job is torn down


if __name__ == "__main__":
    mode = sys.argv[1]
    with Client() as client:
        if mode == "apps":
            apps(client)
            idle(client)
        elif mode == "idle":
            idle(client)
        elif mode == "raise":
            raise ValueError("requested failure from the client script")
        elif mode == "kill":
            kill(client)
        elif mode == "survive":
            survive(client)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
