"""torch's own distributed test suite, on every rank: ``DistributedTest._DistTestBase`` on gloo, then on loom.

torch ships its suite in the wheel (``torch/testing/_internal/distributed/distributed_test.py``). Its runner,
``TestDistBackend``, spawns fresh processes for every test (3 s a test here: ~30 minutes per backend); this runs
the same tests in long-lived ranks instead, each test as torch's ``TestDistBackend._run`` runs it in a spawned
process: ``init_process_group(init_method=file://<new file>, world_size, rank, timeout=<the test's>)``, its
file barrier, the test method, the barrier, ``destroy_process_group``. Every test runs on gloo first, then on
loom, in the same processes, so gloo is the reference of the same run.

The suite is gated for gloo (``BACKEND=gloo``: every ``if BACKEND == "gloo"`` treats the run as gloo); for the
loom half, ``init_process_group`` and ``new_group`` map ``"gloo"`` to ``"loom"``. ``get_backend()`` answers
``"loom"`` there, as it does for a user: the tests that compare it with ``BACKEND`` fail for that reason alone,
and torch checks profiler events only for the backends it lists (gloo, nccl, mpi, ucc).

Driven by ``tests/integration/test_torch_suite.py`` (which relaunches after a crash or a hang): results go to the
``--results`` JSON-lines file, one ``started`` line before each (test, backend) and one result line after, with
each rank's status (``pass``, ``fail``, ``skip``) and the first failing rank's message. A (test, backend) that
runs past ``--timeout`` seconds writes ``hang`` and ends the job.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
import unittest

STATUS = ("pass", "fail", "skip")


def _parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--results", required=True, help="JSON-lines file to append to (rank 0)")
    p.add_argument("--temp-dir", required=True, help="TEMP_DIR of torch's suite (its barrier and lock files)")
    p.add_argument("--only", default="", help="regular expression: run the tests whose names match")
    p.add_argument("--skip", default="", help="comma-separated (test/backend) pairs already recorded")
    p.add_argument("--timeout", type=float, default=240, help="seconds one (test, backend) may take")
    p.add_argument("--backends", default="gloo,loom")
    p.add_argument("--small-world", action="store_true",
                   help="run only the tests torch gates to 8 ranks and more (skip_if_small_worldsize: the group "
                        "tests, over ranks [1, 2]), with the gate open, at this world size")
    return p.parse_args(argv)


def _environment(temp_dir: str, world_size: int) -> None:
    """What torch's suite reads at import: its backend, world size and temp dir."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["TEMP_DIR"] = temp_dir
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("INIT_METHOD", "env://")


_UNDER_TEST = {"backend": "gloo"}


def _patch_dist() -> None:
    """Map the suite's "gloo" to the backend under test (loom's half) and report it back as "gloo"."""
    import torch.distributed as dist

    import loom  # noqa: F401 - registers the backend

    init, new = dist.init_process_group, dist.new_group

    def mapped(backend):
        if _UNDER_TEST["backend"] == "loom" and (backend is None or str(backend).lower() == "gloo"):
            return "loom"
        return backend

    def init_process_group(*args, backend=None, **kwargs):
        return init(*args, backend=mapped(backend), **kwargs)

    def new_group(*args, backend=None, **kwargs):
        return new(*args, backend=mapped(backend), **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outcome(exc: BaseException | None, skip_codes: set[int]) -> tuple[str, str]:
    if exc is None:
        return "pass", ""
    if isinstance(exc, unittest.SkipTest):
        return "skip", str(exc)[:200]
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else 1
        if code in skip_codes:
            return "skip", f"exit code {code}"
        return ("pass", "") if code == 0 else ("fail", f"sys.exit({exc.code!r})")
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "fail", "".join(lines)[-1500:]


def _gated_small(fn) -> bool:
    """Whether test function ``fn`` carries torch's ``skip_if_small_worldsize`` (it reads the environment's
    BACKEND and WORLD_SIZE when called: below 8 ranks it exits with the skip code, unless BACKEND is mpi)."""
    from torch.testing._internal.common_distributed import skip_if_small_worldsize

    gate = skip_if_small_worldsize(lambda: None).__code__
    while fn is not None:
        if getattr(fn, "__code__", None) is gate:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _run_one(cls, name: str, rank: int, world_size: int, file_name: str, skip_codes: set[int],
             open_gate: bool = False) -> tuple[str, str]:
    """One test as ``TestDistBackend._run`` runs it in a spawned process (module plan)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_utils
    from torch.testing._internal.distributed import distributed_test as dt

    self = cls(name)
    self.rank = rank
    self.file_name = file_name
    # what a spawned process starts with, and an earlier test of this process may have changed (with_dist_debug_
    # levels leaves TORCH_DISTRIBUTED_DEBUG at its last level)
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    dist.set_debug_level_from_env()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    common_utils.set_rng_seed()
    exc = None
    try:
        timeout = timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout))
        dist.init_process_group(init_method=f"file://{file_name}", backend=dt.BACKEND, world_size=world_size,
                                rank=rank, timeout=timeout)
        self._barrier()
        if open_gate:  # the group tests need 3 ranks; torch runs them from 8 (or under its MPI backend)
            os.environ["BACKEND"] = "mpi"
        try:
            getattr(self, name)()
        finally:
            os.environ["BACKEND"] = "gloo"
        self._barrier()
    except BaseException as e:  # noqa: BLE001 - recorded as the test's outcome
        exc = e
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001
            exc = exc or e
    return _outcome(exc, skip_codes)


def _fresh_directories(rank: int, harness) -> None:
    """What torch's ``TestDistBackend.setUp`` makes before spawning a test's processes, made by rank 0 and shared:
    a new TEMP_DIR (its file barrier, lock and ``INIT_METHOD`` file), the test's init file, a free
    ``MASTER_PORT``; every rank starts its file barrier's count at 0, as a spawned process does."""
    from torch.testing._internal.distributed import distributed_test as dt

    env = None
    if rank == 0:
        dt.initialize_temp_directories()  # sets TEMP_DIR and INIT_METHOD (file://.../shared_init_file)
        fd, file_name = tempfile.mkstemp(dir=os.environ["TEMP_DIR"])
        os.close(fd)
        env = {"TEMP_DIR": os.environ["TEMP_DIR"], "INIT_METHOD": os.environ["INIT_METHOD"],
               "MASTER_PORT": str(_free_port()), "SUITE_INIT_FILE": file_name}
    env = harness.bcast_object(env, root=0)
    os.environ.update(env)
    dt.INIT_METHOD = env["INIT_METHOD"]  # read by the suite at import; a spawned process imports it anew
    dt.Barrier.barrier_id = 0


class _Watchdog:
    """Ends the job when a (test, backend) runs past its time: records ``hang`` (rank 0), then exits."""

    def __init__(self, seconds: float, record):
        self.seconds, self.record = seconds, record
        self.current: tuple[str, str] | None = None
        self.since = 0.0
        threading.Thread(target=self._loop, daemon=True).start()

    def start(self, test: str, backend: str) -> None:
        self.current, self.since = (test, backend), time.monotonic()

    def stop(self) -> None:
        self.current = None

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            cur = self.current
            if cur is not None and time.monotonic() - self.since > self.seconds:
                self.record({"test": cur[0], "backend": cur[1], "status": "hang",
                             "msg": f"no result within {self.seconds:g} s"})
                sys.stderr.write(f"torch_suite: {cur[0]} on {cur[1]} hangs; ending the job\n")
                sys.stderr.flush()
                os._exit(3)


def main(argv: list[str]) -> int:
    from loom.comm import world

    ns = _parse(argv)
    harness = world().dup(name="suite")
    rank, size = harness.rank, harness.size
    _environment(ns.temp_dir, size)
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_distributed import cleanup_temp_dir
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    _patch_dist()

    class TestSuite(TestDistBackend, DistributedTest._DistTestBase):
        pass

    skip_codes = {s.exit_code for s in TEST_SKIPS.values()}
    only = re.compile(ns.only) if ns.only else None
    done = set(filter(None, ns.skip.split(",")))
    names = sorted(n for n in dir(DistributedTest._DistTestBase) if n.startswith("test_")
                   and (only is None or only.search(n))
                   and (not ns.small_world or _gated_small(getattr(DistributedTest._DistTestBase, n))))

    def record(entry: dict) -> None:
        if rank == 0:
            with open(ns.results, "a") as f:
                f.write(json.dumps(entry) + "\n")

    dog = _Watchdog(ns.timeout, record)
    for name in names:
        for backend in ns.backends.split(","):
            if f"{name}/{backend}" in done:
                continue
            _UNDER_TEST["backend"] = backend
            record({"test": name, "backend": backend, "status": "started"})
            _fresh_directories(rank, harness)
            harness.barrier()
            dog.start(name, backend)
            status, msg = _run_one(TestSuite, name, rank, size, os.environ["SUITE_INIT_FILE"], skip_codes,
                                   ns.small_world)
            every = harness.allgather_object((status, msg))
            dog.stop()
            statuses = [s for s, _ in every]
            overall = "fail" if "fail" in statuses else ("skip" if "skip" in statuses else "pass")
            first = next((f"rank {r}: {m}" for r, (s, m) in enumerate(every) if s == overall and m), "")
            record({"test": name, "backend": backend, "status": overall, "ranks": statuses, "msg": first})
            if rank == 0:
                cleanup_temp_dir()
    harness.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
