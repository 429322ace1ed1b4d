"""How the ranks of a ``"loom"`` process group find each other, under every launcher a torch user has.

Two questions, answered before MPI starts (importing this module imports neither loom.comm nor MPI):

* **Rank, size and store** (torch's rendezvous, ``init_process_group``'s ``init_method``). ``tcp://``,
  ``file://`` and an explicit ``store=`` are torch's own. ``env://`` (the default) is wrapped by
  :func:`env_handler`: inside an MPI job (``mpiexec``, ``loom run``, ``srun --mpi=...``) rank and size come from
  the launcher unless ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set, and the store
  is ``MASTER_ADDR:MASTER_PORT`` when both are exported (a SLURM batch script's habit) or else hosted by rank 0
  with its address sent over MPI (:func:`mpi_rendezvous`). Outside one, torch's own (torchrun sets it all),
  and a lone process without ``MASTER_ADDR`` is rank 0 of 1.
* **The MPI world** (:func:`start_mpi`, called by torch's creator of the default group, before anything
  imports MPI). A process an MPI launcher started has its world already. Processes that torchrun,
  ``mp.spawn`` or a plain ``srun`` started are MPI singletons; they form one world of exactly the torch ranks
  through the store torch hands the backend (:func:`loom.comm.pmi.form_world`: rank 0 serves MPICH's PMI-1
  protocol, every rank joins as its torch rank). The creator then checks that MPI's world is the torch
  group's (:func:`check_world`): one clear line, on every rank, where it is not.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from urllib.parse import parse_qs, urlparse

import loom.settings as settings
from loom.comm import pmi

__all__ = ["env_handler", "checked_handler", "mpi_rendezvous", "start_mpi", "check_world", "launched_by_mpi",
           "bootstrapped"]

_FORMED: dict = {}  # {"rank": r, "size": n} once this process joined a world through form_world


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (its world exists before MPI starts)."""
    return any(v in os.environ for v in pmi.LAUNCHER_VARS) and "PMI_ID" not in os.environ


def bootstrapped() -> bool:
    """Whether this process's MPI world was formed through a torch store (not by an MPI launcher)."""
    return bool(_FORMED)


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}


def env_handler(torch_env):
    """torch's ``env://`` handler, extended to MPI jobs (module plan); ``torch_env`` is torch's own."""
    def env_or_mpi(url, **kwargs):
        env, query = os.environ, _query(url)
        master = "MASTER_ADDR" in env and "MASTER_PORT" in env
        ranks = ("rank" in query or "RANK" in env) and ("world_size" in query or "WORLD_SIZE" in env)
        if launched_by_mpi():
            _check_against_launcher(query, env=True)
            if not (master and ranks):
                return mpi_rendezvous(url, **kwargs)
        elif not master and not ranks:
            return mpi_rendezvous(url, **kwargs)  # a lone process: rank 0 of 1
        return torch_env(url, **kwargs)

    env_or_mpi._loom = True  # type: ignore[attr-defined]
    return env_or_mpi


def checked_handler(torch_handler):
    """torch's ``tcp://`` or ``file://`` handler, refusing (``ValueError``) inside an MPI job a rank or world size
    that is not the launcher's: the store would wait for ranks that never come."""
    def checked(url, **kwargs):
        if launched_by_mpi():
            _check_against_launcher(_query(url), env=False)
        return torch_handler(url, **kwargs)

    checked._loom = True  # type: ignore[attr-defined]
    return checked


def _check_against_launcher(query: dict[str, str], env: bool) -> None:
    """``ValueError`` (on every rank: each compares its own) when the rank or world size given to
    ``init_process_group`` (or, for ``env://``, in RANK / WORLD_SIZE) is not what the MPI launcher made."""
    rank, size = _launcher_rank_size()
    for key, env_key, mine in (("world_size", "WORLD_SIZE", size), ("rank", "RANK", rank)):
        given = query.get(key, os.environ.get(env_key) if env else None)
        if given is not None and given.strip().isdigit() and int(given) != mine:
            where = f"init_process_group({key}={given})" if key in query else f"{env_key}={given}"
            raise ValueError(f"{where}, but the MPI launcher made this rank {rank} of {size}: inside an MPI job the "
                             f"loom backend takes rank and size from MPI; pass neither (or unset {env_key}), or "
                             f"launch the job with as many ranks")


def _launcher_rank_size() -> tuple[int, int]:
    info = settings.launch_info() if launched_by_mpi() else None
    return (0, 1) if info is None else (info.rank, info.size)


def mpi_rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs):
    """``env://`` inside an MPI job: rank and size from the launcher; the store at ``MASTER_ADDR:MASTER_PORT``
    when both are set, else a ``TCPStore`` rank 0 hosts on a free port, its address sent to the others over MPI.
    torch keeps small metadata there, and other backends of the same job (``new_group(backend="gloo")``)
    rendezvous through it; loom's own traffic never touches it.

    Yields ``(store, rank, world_size)`` once, as torch's rendezvous handlers do.
    """
    import torch.distributed as dist

    rank, size = _launcher_rank_size()
    _check_against_launcher(_query(url), env=True)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package re-exports a function)
        store = rdzv._create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, size,
                                        timeout)
    else:
        store = _store_over_mpi(timeout, dist)
    yield store, rank, size
    raise RuntimeError("the loom backend's rendezvous cannot run again in one process")


def _store_over_mpi(timeout: datetime.timedelta, dist):
    """A ``TCPStore`` hosted by rank 0, its address sent over MPI; a failure raises on every rank."""
    from loom.comm import world

    comm = world()
    if comm.rank == 0:
        hosts = comm.allgather_object(socket.gethostname())
        # the server listens on every interface; the others are sent every address it may be reached by
        store = dist.TCPStore("127.0.0.1", 0, comm.size, is_master=True, timeout=timeout, wait_for_workers=False)
        comm.bcast_object((["127.0.0.1"] if len(set(hosts)) == 1 else pmi.host_addresses(), store.port), root=0)
    else:
        comm.allgather_object(socket.gethostname())
        candidates, port = comm.bcast_object(None, root=0)
    try:
        host, err = (None, None) if comm.rank == 0 else (_reachable(candidates, port), None)
    except RuntimeError as exc:
        host, err = None, f"rank {comm.rank}: {exc}"
    failed = [e for e in comm.allgather_object(err) if e]
    if failed:  # on every rank: rank 0 and the ranks that connected would otherwise wait out the store's timeout
        raise RuntimeError(failed[0])
    if comm.rank != 0:
        store = dist.TCPStore(host, port, comm.size, is_master=False, timeout=timeout)
    return store


def _reachable(candidates: list[str], port: int) -> str:
    return pmi.reachable(candidates, port, "the loom backend's rendezvous",
                         "set MASTER_ADDR and MASTER_PORT (with RANK and WORLD_SIZE) to an address of rank 0 that the "
                         "other hosts reach")


def start_mpi(store, rank: int, size: int, timeout: datetime.timedelta) -> None:
    """Make MPI's world the torch group's before MPI starts (module plan): nothing where MPI has started or an MPI
    launcher made the world, or for a group of one; else form it through ``store``."""
    if pmi.mpi_started() or launched_by_mpi() or size == 1 or _FORMED:
        return
    pmi.form_world(store, rank, size, timeout=timeout.total_seconds())
    _FORMED.update(rank=rank, size=size)


def check_world(rank: int, size: int, mpi_rank: int, mpi_size: int) -> None:
    """Refuse (``ValueError``, the same line on every rank) an MPI world that is not the torch group's."""
    if _FORMED:
        from mpi4py import MPI

        if _FORMED != {"rank": rank, "size": size}:
            raise ValueError(f"init_process_group as rank {rank} of {size}, but this process joined an MPI world as "
                             f"rank {_FORMED['rank']} of {_FORMED['size']} at its first init_process_group; a "
                             f"process can join one MPI world only (keep the ranks, or start new processes)")
        pmi.check_formed(rank, size, mpi_rank, mpi_size, MPI.Get_library_version())
        return
    if mpi_size != size:
        how = "the MPI launcher" if launched_by_mpi() else "MPI, started before init_process_group,"
        raise ValueError(
            f"init_process_group: the store's world has {size} ranks (this is rank {rank}), but {how} made a world "
            f"of {mpi_size}; launch as many MPI ranks as torch ranks (loom run --ranks {size} / mpiexec -n {size}), "
            f"or, outside mpiexec, call init_process_group before anything that starts MPI")
