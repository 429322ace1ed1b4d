"""Turn an MPI job into a Dask cluster over ``mpi://``: rank 0 scheduler, rank 1 client, the rest workers.

Plan of :func:`initialize` (every rank calls it):

1. rank 0 starts a :class:`distributed.Scheduler` listening on ``mpi://`` and broadcasts its address with one
   ``bcast_object`` (the only collective; every rank is in it before any event loop serves anything);
2. ranks >= 2 start a :class:`distributed.Worker` (no nanny: the rank *is* the worker process) named
   ``rank-K``, connect to the scheduler over ``mpi://`` and serve until the scheduler closes them;
3. rank 1 points Dask's config at the scheduler, waits until every worker has registered and returns
   ``True``: the caller's code after ``initialize()`` is the client. When it ends (normally, by an
   exception, or by ``sys.exit``), an ``atexit`` hook (or :func:`shutdown`) closes the scheduler, which
   closes the workers, so every rank leaves its loop and exits 0.

Reliability: a worker rank that dies (killed, segfault) is survivable when the launcher keeps the other
ranks running (MPICH's hydra with ``-disable-auto-cleanup``, which ``loom dask run -n N`` adds; see
docs/guides/dask.md for which MPIs can). Every rank ignores hydra's ``SIGUSR1`` notice of the death
(:func:`loom.dask.liveness.ignore_launcher_signal`), and every rank's mpi:// engine watches every rank of
this host from the start (pids and host keys are exchanged in the one ``allgather`` below), so the comms to
the dead rank close at once as over TCP: the scheduler drops the worker (rank 0 prints a ``lost worker``
line) and recomputes its keys on the others, and the job ends normally when the client finishes. Under a
launcher that ends the whole job instead, the rank -> role -> pid map printed at start-up and the worker
names (``rank-K``) say which worker it was, and ``loom dask run -n N`` names it in its final line. The
scheduler's ``worker-ttl`` is shortened (:data:`WORKER_TTL`) so that a silent worker on another host (not
watched by pid) is dropped as well.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
from dataclasses import dataclass

from .. import settings

__all__ = ["initialize", "serve", "shutdown", "wait_for_outside_clients", "Roles", "WORKER_TTL"]

logger = logging.getLogger(__name__)

#: scheduler's ``distributed.scheduler.worker-ttl`` inside an MPI job (Dask's default is 5 minutes)
WORKER_TTL = "60s"

SCHEDULER_RANK = 0
CLIENT_RANK = 1

_STATE: dict = {"address": None, "shutdown": False}


@dataclass(kw_only=True, slots=True)
class Roles:
    """Which rank does what in an MPI Dask job of ``size`` ranks."""

    size: int
    """number of ranks (>= 3: scheduler, client and at least one worker)"""

    def __post_init__(self) -> None:
        if self.size < 3:
            raise ValueError(
                f"a Dask job over MPI needs >= 3 ranks (rank 0 scheduler, rank 1 client, ranks 2.. workers); "
                f"got {self.size}. Run with mpiexec -n 3 or more"
            )

    @property
    def workers(self) -> list[int]:
        return list(range(2, self.size))

    def role(self, rank: int) -> str:
        if rank == SCHEDULER_RANK:
            return "scheduler"
        if rank == CLIENT_RANK:
            return "client"
        return f"worker rank-{rank}"

    def describe(self) -> str:
        w = self.workers
        span = f"rank {w[0]}" if len(w) == 1 else f"ranks {w[0]}-{w[-1]}"
        return f"rank 0 scheduler, rank 1 client, {span} workers (named rank-K)"


def _dask_config() -> dict:
    return {
        "distributed.scheduler.worker-ttl": WORKER_TTL,
        # Workers are ranks: never let Dask spawn or kill processes of its own.
        "distributed.worker.daemon": False,
    }


def _host_kwargs(protocol: str) -> dict:
    # TCP (the benchmark's peer) on the loopback interface; mpi:// addresses carry their own host.
    return {"host": "127.0.0.1"} if protocol in ("tcp", "tls") else {}


class _LostWorkers:
    """Scheduler plugin: one line on stderr for each worker lost while the job runs (its comm closed without
    the worker saying goodbye, or its heartbeats stopped); workers that close normally are not reported."""

    name = "loom-lost-workers"
    _LOST = ("handle-worker-cleanup", "check-worker-ttl")  # Dask's stimulus ids for these two removals

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.closing = False

    async def before_close(self) -> None:
        self.closing = True  # the scheduler closes its workers now: not losses

    def add_worker(self, scheduler, worker: str) -> None:
        self.names[worker] = str(scheduler.workers[worker].name)

    def remove_worker(self, scheduler, worker: str, *, stimulus_id: str = "", **kwargs) -> None:
        name = self.names.pop(worker, worker)
        if stimulus_id.startswith(self._LOST) and not self.closing:
            print(f"loom dask: scheduler lost worker {name} ({worker}); its tasks go to the other workers",
                  file=sys.stderr, flush=True)


def _close_when_client_dies(scheduler) -> None:
    """Without its client rank the job has nothing left to do: close the scheduler (which closes the workers)
    when rank 1's process exits. Harmless at a normal end, where the client has closed it already. A dead
    scheduler needs no rule: each worker closes itself when its comm to the scheduler closes."""
    from .backend import engine

    loop = asyncio.get_running_loop()

    def died(rank: int) -> None:  # on the liveness thread
        if rank == CLIENT_RANK:
            try:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(scheduler.close(reason="client rank died")))
            except RuntimeError:  # the loop is closed: the scheduler is gone already
                pass

    engine().liveness.add_callback(died)


def _listen_kwargs(protocol: str, tcp: str | None) -> dict:
    """Scheduler arguments: ``protocol`` alone, or also ``tcp://HOST:PORT`` for clients outside the job."""
    if tcp is None:
        return {"protocol": protocol, **_host_kwargs(protocol)}
    host, _, port = tcp.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"tcp={tcp!r}: write HOST:PORT (e.g. 0.0.0.0:8786, or 127.0.0.1:0 for any free port)")
    return {"protocol": [protocol, "tcp"], "host": [None, host], "port": [None, int(port)]}


def _publish(scheduler, roles: Roles, scheduler_file: str | None) -> None:
    """Print the scheduler's addresses; write the scheduler file (dask-mpi's ``--scheduler-file`` format, its
    ``address`` the one an outside client can reach) for ``Client(scheduler_file=...)``."""
    addresses = [listener.contact_address for listener in scheduler.listeners]
    outside = next((a for a in addresses if not a.startswith("mpi://")), None)
    print(f"loom dask: scheduler at {', '.join(addresses)}; {roles.describe()}", file=sys.stderr, flush=True)
    if scheduler_file:
        import json

        info = {**scheduler.identity(), "address": outside or addresses[0], "mpi_address": addresses[0]}
        tmp = f"{scheduler_file}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f, indent=2, default=str)
        os.replace(tmp, scheduler_file)  # a reader never sees half a file


async def _run_scheduler(comm, roles: Roles, dashboard: bool, protocol: str = "mpi", tcp: str | None = None,
                         scheduler_file: str | None = None, announce: bool = False) -> None:
    from distributed import Scheduler
    from distributed.diagnostics.plugin import SchedulerPlugin

    plugin = type("LostWorkers", (_LostWorkers, SchedulerPlugin), {})()
    async with Scheduler(dashboard=dashboard, dashboard_address=":0" if dashboard else None,
                         **_listen_kwargs(protocol, tcp)) as scheduler:
        scheduler.add_plugin(plugin)
        _close_when_client_dies(scheduler)
        comm.bcast_object(scheduler.address, SCHEDULER_RANK)  # the first listener: mpi:// (or the peer's)
        if announce or scheduler_file:
            _publish(scheduler, roles, scheduler_file)
        await scheduler.finished()


async def _until_scheduler_closes(address: str) -> None:
    """The client rank of a job without a client script: hold one comm to the scheduler until it closes."""
    from distributed.comm import CommClosedError, connect

    comm = await connect(address)
    try:
        await comm.write({"op": "identity", "reply": False})
        while True:
            await comm.read()
    except (CommClosedError, OSError):
        pass


async def _run_worker(comm, address: str, nthreads: int, memory_limit, local_directory,
                      protocol: str = "mpi") -> None:
    from distributed import Worker

    kwargs = {} if local_directory is None else {"local_directory": local_directory}
    kwargs.update(_host_kwargs(protocol))
    async with Worker(address, protocol=protocol, name=f"rank-{comm.rank}", nthreads=nthreads,
                      memory_limit=memory_limit, dashboard=False, dashboard_address=None, **kwargs) as worker:
        await worker.finished()


def initialize(*, nthreads: int = 1, memory_limit: str | int | None = "auto", local_directory: str | None = None,
               dashboard: bool = False, exit: bool = True, wait_timeout: float = 120.0, tcp: str | None = None,
               scheduler_file: str | None = None) -> bool:
    """Make this MPI job a Dask cluster over ``mpi://``; ``True`` on the client rank (rank 1).

    Args:
        nthreads: threads per worker rank.
        memory_limit: per worker (Dask's syntax: ``"auto"``, ``"4GiB"``, bytes, or ``None`` for no limit).
        local_directory: workers' spill directory (Dask's default when ``None``).
        dashboard: start the scheduler's dashboard (needs bokeh).
        exit: on the scheduler and worker ranks, ``sys.exit(0)`` once the cluster is shut down (the code
            after ``initialize()`` then runs only on the client rank); with ``False`` they return ``False``.
        wait_timeout: seconds the client rank waits for every worker to register.
        tcp: ``HOST:PORT`` on which the scheduler also listens over ``tcp://`` (port 0: any free one), so that
            a client outside the MPI job can connect; workers keep using ``mpi://``.
        scheduler_file: path where rank 0 writes the scheduler's address as JSON (the outside address when
            ``tcp`` is given), for ``Client(scheduler_file=...)``, as dask-mpi's ``--scheduler-file``.

    Returns:
        ``True`` on rank 1 (run the client code), ``False`` on the other ranks after shutdown (``exit=False``).
    """
    import dask

    from loom.comm import world

    if nthreads < 1:
        raise ValueError(f"nthreads={nthreads} must be >= 1")
    comm = world()
    roles = Roles(size=comm.size)
    pids = _watch_all(comm)
    if comm.rank == SCHEDULER_RANK:
        _announce(roles, pids)
    dask.config.set(_dask_config())

    if comm.rank == SCHEDULER_RANK:
        asyncio.run(_run_scheduler(comm, roles, dashboard, tcp=tcp, scheduler_file=scheduler_file, announce=True))
    else:
        address = comm.bcast_object(None, SCHEDULER_RANK)
        _STATE["address"] = address
        if comm.rank == CLIENT_RANK:
            dask.config.set({"scheduler-address": address})
            _wait_for_workers(address, len(roles.workers), wait_timeout)
            atexit.register(shutdown)
            return True
        asyncio.run(_run_worker(comm, address, nthreads, memory_limit, local_directory))
    if exit:
        sys.exit(0)
    return False


def wait_for_outside_clients() -> None:
    """On the client rank of a job without a client script: serve outside clients until the cluster is told to
    stop (an outside ``client.shutdown()``, or a signal to the job), then return."""
    address = _STATE["address"]
    _STATE["shutdown"] = True  # the scheduler is closed from outside; nothing to shut down at exit
    print("loom dask: no client script; serving outside clients until the cluster is shut down",
          file=sys.stderr, flush=True)
    asyncio.run(_until_scheduler_closes(address))


def serve(*, protocol: str = "mpi", nthreads: int = 1, memory_limit: str | int | None = "auto",
          local_directory: str | None = None, wait_timeout: float = 120.0) -> str | None:
    """One cluster lifetime without exiting: the building block of :func:`initialize` and ``loom bench dask``.

    Every rank calls it. The scheduler and worker ranks serve until the cluster is shut down and return
    ``None``; the client rank returns the scheduler's address once every worker registered, and must call
    :func:`shutdown` with it when done. ``protocol="tcp"`` runs the same cluster over Dask's TCP (loopback).
    """
    import dask

    from loom.comm import world

    comm = world()
    roles = Roles(size=comm.size)
    _watch_all(comm)
    with dask.config.set(_dask_config()):
        if comm.rank == SCHEDULER_RANK:
            asyncio.run(_run_scheduler(comm, roles, False, protocol))
            return None
        address = comm.bcast_object(None, SCHEDULER_RANK)
        if comm.rank == CLIENT_RANK:
            _wait_for_workers(address, len(roles.workers), wait_timeout)
            return address
        asyncio.run(_run_worker(comm, address, nthreads, memory_limit, local_directory, protocol))
        return None


def _watch_all(comm) -> list[int]:
    """Every rank: survive the launcher's notice of a dead rank, start the mpi:// engine and let it watch
    every rank of this host from now on (one ``allgather`` of pid and host key). Returns the ranks' pids."""
    from . import liveness
    from .backend import start

    liveness.ignore_launcher_signal()
    atexit.register(_exit_after_loss)  # before the engine exists: runs after its exit flush (atexit is LIFO)
    eng = start()  # collective: mpi:// runs on its own duplicate of COMM_WORLD
    peers = comm.allgather_object((eng.pid, eng.host_key))
    for rank, (pid, key) in enumerate(peers):
        eng.learn_peer(rank, pid, key)
    return [pid for pid, _ in peers]


def _exit_after_loss() -> None:
    """Last at exit: when a peer rank died, leave without ``MPI_Finalize``. MPICH's finalize waits in a
    launcher barrier for every rank, the dead one included, so a survivor would hang there; the engine's
    flush has already completed or dropped every message, and the exit code is the one :func:`set_exit_code`
    recorded (0 unless told)."""
    from .process import running

    eng = running()
    if eng is None or not eng.liveness.dead:
        return
    eng._flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_STATE.get("exit_code", 0))


def set_exit_code(code: int) -> None:
    """The exit code this rank leaves with when a peer died (see :func:`_exit_after_loss`)."""
    _STATE["exit_code"] = int(code)


def _announce(roles: Roles, pids: list[int]) -> None:
    """Print the rank -> role -> pid map (MPICH names a dead process by pid) and save it for ``loom dask run``."""
    entries = {str(pid): {"rank": r, "role": roles.role(r)} for r, pid in enumerate(pids)}
    line = ", ".join(f"rank {r} {roles.role(r)} (pid {pid})" for r, pid in enumerate(pids))
    print(f"loom dask: {line}", file=sys.stderr, flush=True)
    path = settings.get("dask_roles")
    if path:
        import json

        with open(path, "w") as f:
            json.dump(entries, f)


def _wait_for_workers(address: str, n: int, timeout: float) -> None:
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        client.wait_for_workers(n, timeout=timeout)


def shutdown(address: str | None = None) -> None:
    """From the client rank: close the scheduler and every worker (idempotent; registered ``atexit``).

    Args:
        address: the scheduler to close (default: the one :func:`initialize` started).
    """
    if address is None:
        if _STATE["shutdown"] or _STATE["address"] is None:
            return
        _STATE["shutdown"] = True
        address = _STATE["address"]

    # The script's own clients first, so they do not try to reconnect to a scheduler that is going away.
    from distributed import Client

    for client in list(Client._instances):
        if client.status not in ("closed", "closing"):
            try:
                client.close(timeout=10)
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.debug("closing %r failed", client, exc_info=True)

    async def close() -> None:
        from distributed.core import rpc

        async with rpc(address) as scheduler:
            try:
                await scheduler.terminate()
            except Exception:  # noqa: BLE001 - the scheduler closing its end may race with the reply
                logger.debug("scheduler terminate reply lost", exc_info=True)

    try:
        asyncio.run(close())
    except Exception as exc:  # noqa: BLE001 - best effort at exit; say why
        print(f"loom dask: could not shut the cluster down cleanly: {exc!r}", file=sys.stderr, flush=True)
