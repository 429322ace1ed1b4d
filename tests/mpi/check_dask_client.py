"""Client script for ``loom dask run`` (tests/integration/test_dask.py): MODE = apps | idle | raise | kill.

apps:  (x + x.T).sum() of a numpy-backed dask array and a pandas merge, against single-process references
       (fp64, relative tolerance 1e-12; the merge compared exactly after sorting); every worker is mpi://;
       then the idle check.
idle:  CPU of the idle scheduler and workers over 3 s (bound 25 % of a core, Dask's own timers included;
       measured here: about 4 %).
raise: the script raises, so the job must exit non-zero with the traceback.
kill:  a task SIGKILLs the worker running it mid-computation; the job must end promptly, naming the worker.
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


def _cpu() -> float:
    import time

    return time.process_time()


def idle(client: Client, seconds: float = 3.0) -> None:
    """CPU used by the scheduler and each worker rank while the cluster sits idle for ``seconds``."""
    import time

    time.sleep(1.0)  # let start-up work settle
    s0, w0, t0 = client.run_on_scheduler(_cpu), client.run(_cpu), time.monotonic()
    time.sleep(seconds)
    s1, w1, dt = client.run_on_scheduler(_cpu), client.run(_cpu), time.monotonic() - t0
    shares = {"scheduler": (s1 - s0) / dt, **{w: (w1[w] - w0[w]) / dt for w in w0}}
    print("IDLE CPU " + " ".join(f"{k}={v:.1%}" for k, v in shares.items()), flush=True)
    worst = max(shares.values())
    assert worst < 0.25, f"an idle rank used {worst:.0%} of a core: {shares}"


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
        else:
            raise SystemExit(f"unknown mode {mode!r}")
