"""A Dask client outside the MPI job (an ordinary process, no mpiexec): tests/integration/test_dask.py.

    python outside_dask_client.py SCHEDULER_FILE MODE      # MODE = graph | hang | shutdown

graph:    connect by the scheduler file (a tcp:// address), compute (x + x.T).sum() against numpy (fp64,
          relative tolerance 1e-12), disconnect, connect again by the address itself and compute again.
hang:     connect, start a long graph, print SUBMITTED and wait to be killed.
shutdown: connect, compute once more, then shut the cluster down (the job then ends).
"""

from __future__ import annotations

import json
import sys
import time

import dask.array as da
import numpy as np
from distributed import Client


def _sum(client: Client, seed: int) -> None:
    x_np = np.random.default_rng(seed).standard_normal((400, 400))
    got = float(client.compute((da.from_array(x_np, chunks=(100, 100)) + da.from_array(x_np, chunks=(100, 100)).T)
                               .sum()).result(timeout=120))
    want = float((x_np + x_np.T).sum())
    assert abs(got - want) <= 1e-12 * np.abs(x_np).sum() * 2, (got, want)


def _slow(block):
    time.sleep(5)
    return block


def main(path: str, mode: str) -> None:
    with open(path) as f:
        address = json.load(f)["address"]
    assert address.startswith("tcp://"), address
    if mode == "graph":
        with Client(scheduler_file=path, timeout=60) as client:
            assert all(w.startswith("mpi://") for w in client.scheduler_info()["workers"])
            _sum(client, 1)
        with Client(address, timeout=60) as client:
            _sum(client, 2)
        print("OUTSIDE OK", flush=True)
    elif mode == "hang":
        client = Client(address, timeout=60)
        fut = client.compute(da.ones((400, 400), chunks=(100, 100)).map_blocks(_slow).sum())
        print("SUBMITTED", flush=True)
        fut.result()
    elif mode == "shutdown":
        client = Client(address, timeout=60)
        _sum(client, 3)
        print("SHUTTING DOWN", flush=True)
        client.shutdown()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
