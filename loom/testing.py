"""The multi-rank test harness: launch real ranks under ``mpiexec`` with a timeout, run checks written once.

Test side (pytest): one table, ``tests/checks.py``, lists every check script with its rank counts; the
integration test launches each (script, rank count) once and asserts that every check reported ``PASS``,
and the one-rank count runs in-process, each check a test of its own::

    from loom.testing import assert_all_checks_passed, run_ranks
    proc = run_ranks(2, "tests/mpi/check_comm.py")      # fails with every rank's output on error or hang
    assert_all_checks_passed(proc, "tests/mpi/check_comm.py")

Script paths are relative to the repository root (whatever the current directory).

Rank side (``tests/mpi/check_comm.py``)::

    from loom.testing import mpi_checks
    def check_allreduce(comm): ...                       # assert like any test; every rank asserts
    if __name__ == "__main__":
        mpi_checks(globals())                            # runs every check_* in file order

A failing check raises on its rank; loom's abort hook then prints the traceback and takes the job down, so
the launcher returns non-zero and the test prints it. A hang hits the timeout and the process group is killed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

from . import settings
from .comm import launch

__all__ = ["run_ranks", "mpi_checks", "seeded", "assert_all_checks_passed", "load_checks", "run_bench", "ROOT",
           "device_check", "DeviceCheckError", "race", "staged_on_host"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: relative script paths are resolved against it."""


def _script(script: str | os.PathLike) -> str:
    p = Path(script)
    return str(p if p.is_absolute() else ROOT / p)


def run_ranks(
    n: int,
    script: str,
    *args: str,
    timeout: float = 180,
    env: Mapping[str, str] | None = None,
    expect_fail: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``n`` ranks; raise ``AssertionError`` with the output unless it exits 0.

    With ``expect_fail=True`` the job must exit non-zero instead (for abort/safety tests); the completed
    process is returned either way so the caller can inspect ``stdout``/``stderr``.
    """
    full_env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if env:
        full_env.update(env)
    try:
        proc = launch.run(n, [sys.executable, _script(script), *args], timeout=timeout, env=full_env, capture=True)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{script} on {n} ranks did not finish within {timeout} s (hang?)\n"
            f"--- stdout\n{exc.output}\n--- stderr\n{exc.stderr}"
        ) from None
    failed = proc.returncode != 0
    if failed != expect_fail:
        what = "succeeded but was expected to fail" if expect_fail else f"exited with {proc.returncode}"
        raise AssertionError(f"{script} on {n} ranks {what}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


_check_seed: list[int] = []  # [seed, calls so far] of the check mpi_checks is running; empty outside one


def _fresh_seed(comm) -> int:
    seed = settings.get("test_seed")
    return seed if seed is not None else comm.bcast_object(int.from_bytes(os.urandom(4), "little"))


def seeded(comm, base: int = 0):
    """A ``torch.Generator`` seeded identically on every rank (for a shared reference), fresh for every call.

    Inside :func:`mpi_checks` the seed derives from the running check's seed, ``base`` and how many calls the
    check made before, so the check's seed alone replays its data (``LOOM_TEST_SEED``, which a failing check
    prints); outside, from ``LOOM_TEST_SEED`` or a fresh draw broadcast from rank 0."""
    import torch

    if _check_seed:
        seed, calls = _check_seed
        _check_seed[1] += 1
        # torch's CPU generator keeps a seed's low 32 bits only: a later call moves them (golden-ratio step)
        return torch.Generator().manual_seed((seed + base + calls * 0x9E3779B9) % 2**32)
    return torch.Generator().manual_seed(_fresh_seed(comm) + base)


def mpi_checks(namespace: Mapping[str, Any], *, prefix: str = "check_") -> None:
    """Run every ``check_*`` function in ``namespace`` on ``loom.comm.world()``; rank 0 reports each one.

    ``LOOM_ONLY=name1,name2`` restricts to some checks (handy while debugging). Each check draws its random
    data from a seed of its own (:func:`seeded`); a failing check prints it on the failing rank, and
    ``LOOM_TEST_SEED=<seed> LOOM_ONLY=<check>`` replays that data.
    """
    import torch

    from .comm import world

    torch.set_num_threads(1)
    comm = world()
    only = set(settings.get("only"))
    checks: list[tuple[str, Callable]] = [
        (k, v) for k, v in namespace.items() if k.startswith(prefix) and callable(v) and (not only or k in only)
    ]
    if not checks:
        raise RuntimeError(f"no {prefix}* functions found to run")
    for name, fn in checks:
        t0 = time.perf_counter()
        seed = _fresh_seed(comm)
        _check_seed[:] = [seed, 0]
        try:
            fn(comm)
        except Exception:
            print(f"FAIL {name} on rank {comm.rank} of {comm.size}: replay its data with LOOM_TEST_SEED={seed} "
                  f"LOOM_ONLY={name}", file=sys.stderr, flush=True)
            raise
        finally:
            _check_seed.clear()
        comm.barrier()
        if comm.rank == 0:
            print(f"PASS {name} ({time.perf_counter() - t0:.2f} s, {comm.size} ranks)", flush=True)


def assert_all_checks_passed(proc: subprocess.CompletedProcess, script: str) -> None:
    """Every ``def check_*`` in ``script`` reported ``PASS`` (a check silently skipped is a failure too)."""
    import re

    with open(_script(script)) as f:
        names = re.findall(r"^def (check_\w+)\(", f.read(), flags=re.M)
    missing = [n for n in names if f"PASS {n} " not in proc.stdout]
    assert names and not missing, f"{script}: checks that did not report PASS: {missing}\n{proc.stdout}"


def load_checks(script: str | os.PathLike) -> tuple[ModuleType, list[tuple[str, Callable]]]:
    """Import a check script as a module (its ``__main__`` block does not run) and list its ``check_*``
    functions in file order, for running them in this process on a one-rank world."""
    import importlib.util

    path = _script(script)
    name = "loom_checks_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module, [(k, v) for k, v in vars(module).items() if k.startswith("check_") and callable(v)]


def run_bench(tmp_path: Path, *argv: str, ranks: int = 2, timeout: float = 180) -> tuple[dict, str]:
    """Run ``loom bench ARGV --json`` on ``ranks`` ranks; return the JSON document and the printed table.

    Raises ``AssertionError`` with the output unless the job exits 0."""
    import json

    out = Path(tmp_path) / "bench.json"
    proc = launch.run(ranks, [sys.executable, "-m", "loom.cli", "bench", *argv, "--json", str(out)], timeout=timeout,
                      env={"LOOM_LAUNCHED": "1", "OMP_NUM_THREADS": "1"}, capture=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


# ---------------------------------------------------------------------------------------------------- devices
_FACTORY_NAMES = ("zeros", "ones", "empty", "full", "arange", "range", "tensor", "randn", "rand", "randint",
                  "randperm", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "tril_indices",
                  "triu_indices")


class DeviceCheckError(AssertionError):
    """A tensor factory without ``device=`` ran in library code inside :func:`device_check`."""


def race(target: Callable[[int], None], threads: int = 4) -> None:
    """Run ``target(k)`` for ``k`` in ``range(threads)`` on as many threads at once, switching between them as
    often as the interpreter allows, so that state shared without a lock is caught in the act."""
    import threading

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=target, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(was)


def device_check(roots: "tuple[str | os.PathLike, ...] | None" = None):
    """A context in which library code may not make a tensor without saying where: CPU-only CI's net for the bug
    class that only a GPU shows, a tensor made on the host that meets a tensor of the model's device.

    Why a factory call and not the meeting itself: on a CPU-only machine the host *is* the model's device, so the
    meeting is legal and invisible; what differs on a GPU is only what a factory call without ``device=`` makes
    (a host tensor). Inside the context every ``torch.zeros/ones/empty/full/arange/tensor/rand*/...`` called
    directly from a file under ``roots`` (default: the ``loom`` package) without a ``device=`` raises
    :class:`DeviceCheckError` naming the file and line; a host-side tensor says ``device="cpu"``, one that
    meets the model says ``device=like.device`` (or uses ``like.new_zeros``, ``torch.zeros_like``). Calls made
    by torch itself and by other libraries are not checked. Run a training step inside it
    (``tests/mpi/check_devices.py``); a plain ``torch.zeros(())`` in ``Trainer.clip`` fails it as it failed on
    the GPU. What it cannot see: an explicit ``device="cpu"`` that meets the model, and a host read
    (``.numpy()``) of a device tensor; the GPU tier (``make test-gpu``) covers those.
    """
    import sys

    import torch
    from torch.overrides import TorchFunctionMode

    prefixes = tuple(str(Path(r).resolve()) + os.sep for r in (roots or (ROOT / "loom",)))
    factories = {getattr(torch, n) for n in _FACTORY_NAMES if hasattr(torch, n)}

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None:
                caller = sys._getframe(1)
                where = caller.f_code.co_filename
                if where.startswith(prefixes):
                    raise DeviceCheckError(
                        f"{where}:{caller.f_lineno}: torch.{func.__name__}() without device= inside a "
                        f"device-checked step; on a GPU it makes a host tensor that meets the model's CUDA "
                        f"tensors. Pass device=<the tensor it meets>.device, or device='cpu' for a host-side one")
            return func(*args, **kwargs)

    return _Mode()


_MISSING = object()


class _FakeStream:
    """A CUDA stream for :func:`staged_on_host`: logs what it is asked to wait for."""

    def __init__(self, name: str, log: list):
        self.name, self._log = name, log

    def wait_stream(self, other):
        self._log.append(("wait", self.name, other.name))

    def wait_event(self, ev):
        self._log.append(("wait_event", self.name, ev.n))


def _fake_events(log: list) -> type:
    """A CUDA event class for :func:`staged_on_host`: events numbered in order of creation, their records and
    host waits logged, every one complete."""
    made = [0]

    class Event:
        def __init__(self, *args, **kwargs):
            self.n = made[0]
            made[0] += 1

        def record(self, stream=None):
            log.append(("record", stream.name, self.n))

        def synchronize(self):
            log.append(("host waits", self.n))

        def query(self):
            return True

    return Event


class _LoggedMPI:
    """A communicator's mpi4py communicator, each upper-case call logged as ``("mpi", name)``."""

    def __init__(self, mpi, log: list):
        self._mpi, self._log = mpi, log

    def __getattr__(self, name):
        got = getattr(self._mpi, name)
        if not name[:1].isupper() or not callable(got) or name.startswith("Get_"):
            return got

        def call(*args, **kwargs):
            self._log.append(("mpi", name))
            return got(*args, **kwargs)
        return call


@contextlib.contextmanager
def _swapped(swaps: list[tuple[Any, str, Any]]):
    """``setattr(obj, name, value)`` for each swap, undone on exit: a class gets its own attribute back, or loses
    the one set here where it had none (so the inherited one shows again); anything else its old value."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name))
             for obj, name, _ in swaps]
    try:
        for obj, name, value in swaps:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def staged_on_host(comm=None):
    """A context in which loom.comm takes its path for CUDA tensors without a CUDA-aware MPI (staging through
    pinned memory on side streams) on host tensors, with the CUDA streams and events faked: CPU-only CI's check
    of the staged collectives' layout and of their order of copies, waits and MPI calls.

    Every torch tensor counts as staged; pinned buffers come from a pool of plain host memory; the copies run
    at once. Yields a log of what the device would have been asked to do, in order:
    ``("wait", stream, other)`` (``stream.wait_stream(other)``), ``("record", stream, event)``,
    ``("wait_event", stream, event)``, ``("host waits", event)``, and, when ``comm`` (a ``Communicator``) is
    given, ``("mpi", name)`` for each MPI call made through it. Streams are ``"cur"`` (the caller's), ``"d2h"``
    and ``"h2d"`` (side streams 0 and 1); events are numbered in order of creation.
    """
    import torch

    from .comm import buffers

    log: list[tuple] = []
    cur, side = _FakeStream("cur", log), {0: _FakeStream("d2h", log), 1: _FakeStream("h2d", log)}
    swaps = [(buffers, "staging", lambda x: isinstance(x, torch.Tensor)),
             (buffers, "_side_stream", lambda dev, which=0: side[which]),
             (buffers, "_PINNED", buffers._Pinned(lambda n: torch.empty(n, dtype=torch.uint8, device="cpu"))),
             (torch.cuda, "Event", _fake_events(log)),
             (torch.cuda, "current_stream", lambda device=None: cur),
             (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
             (torch.Tensor, "record_stream", lambda self, s: None)]
    if comm is not None:
        swaps.append((comm, "mpi", _LoggedMPI(comm.mpi, log)))
    with _swapped(swaps):
        yield log
