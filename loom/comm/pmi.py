"""One MPICH world from processes no MPI launcher started: a PMI-1 server, and how a process joins it.

torchrun, ``torch.multiprocessing.spawn`` (and the launchers built on it: torch's own test runner, Lightning's,
accelerate's) and a Slurm step without ``--mpi`` start plain processes; MPICH in each would start alone, as an
MPI singleton of size 1. What makes a job of them under ``mpiexec`` is its process manager: MPICH's PMI-1 client
connects to the address in ``PMI_PORT`` as process ``PMI_ID``, learns its rank and size there, and publishes
and reads the business cards of its peers in the manager's key-value space (KVS). This module is such a manager
(the "simple PMI" wire protocol of MPICH's hydra), so processes that meet through some other store (torch's)
become one MPI world of exactly them.

Plan of :func:`form_world` (every process, before MPI starts):

1. each process puts its host name into the caller's key-value store (``set``/``get``: torch's ``Store``);
2. process 0 reads them all, starts the server (:func:`serve`) and puts its address (every address of its
   host when the processes span hosts; the loopback when they share one) into the store;
3. each process reads it, takes the first address it reaches, and sets ``PMI_PORT`` and ``PMI_ID`` (its rank);
   MPI then starts with the next ``from mpi4py import MPI``, as process ``PMI_ID`` of the server's world.

The server is a child Python running this file (stdlib only), not a thread: mpi4py holds the GIL inside
``MPI_Init``, which waits on the server's barrier, so a thread of process 0 could never answer it. It serves:

=====================  ===============================================================================
``initack pmiid=R``    ``initack``, ``set size=N``, ``set rank=R``, ``set debug=0``
``init``               ``response_to_init pmi_version=1 pmi_subversion=1`` (PMI 1.1: plain barriers)
``get_maxes``          ``maxes`` (name 256, key 256, value 1024 bytes: hydra's limits)
``get_appnum`` ...     ``appnum appnum=0``; ``my_kvsname``; ``universe_size size=N``
``put`` / ``get``      the KVS; a missing key answers ``rc=1``. ``PMI_process_mapping`` is preset: which
                       ranks share a node (MPICH uses shared memory between them), from the host names
``barrier_in``         ``barrier_out`` to every process once all N are in
``finalize``           ``finalize_ack``; ``abort``: the process reports and exits itself
=====================  ===============================================================================

Lifetime: the server exits once every process that connected has disconnected (the job ended), when its
parent exits, or when not all N processes connected within the timeout. A process that disconnects before its
``finalize`` ends the job's formation: the server closes every connection, so the others' ``MPI_Init`` fails
instead of waiting for ever (after ``MPI_Init`` MPICH no longer reads from the server; the launcher that started
the processes ends the rest, as torchrun and ``mp.spawn`` do).

Open MPI takes its world from PMIx and ignores ``PMI_PORT``: its processes stay singletons, which the caller
sees as an MPI size of 1 and refuses by name (:func:`check_formed`).
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time

__all__ = ["form_world", "serve", "process_mapping", "host_addresses", "reachable", "mpi_started",
           "check_formed", "LAUNCHER_VARS"]

#: Variables an MPI launcher sets in the processes it starts: with any of them MPI has a world already.
LAUNCHER_VARS = ("PMI_RANK", "PMI_FD", "PMI_PORT", "PMI_SIZE", "PMIX_RANK", "PMIX_NAMESPACE", "OMPI_COMM_WORLD_RANK",
                 "MPI_LOCALRANKID")
_MAXES = "kvsname_max=256 keylen_max=256 vallen_max=1024"


# ---------------------------------------------------------------------------------------------- addresses
def host_addresses() -> list[str]:
    """How other hosts may reach this one: every non-loopback IPv4 address of its interfaces, then its name (a
    name need not resolve elsewhere, its lookup may wait on an unreachable DNS server, or resolve to 127.0.1.1 as
    /etc/hosts often says; so it comes last)."""
    out: list[str] = []
    try:
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:  # no IPv4 address on it
                    continue
            addr = socket.inet_ntoa(packed[20:24])
            if not addr.startswith("127.") and addr not in out:
                out.append(addr)
    except (ImportError, OSError):  # not Linux: the name only
        pass
    return [*out, socket.gethostname()]


def reachable(candidates: list[str], port: int, what: str, fix: str, timeout: float = 5.0) -> str:
    """The first of ``candidates`` that accepts a TCP connection on ``port``; ``RuntimeError`` naming ``what``
    and ``fix`` when none does."""
    for host in candidates:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return host
        except OSError:
            continue
    raise RuntimeError(f"{what}: no address of rank 0 ({', '.join(candidates)}) accepts a connection on port {port} "
                       f"from this host; {fix}")


# ---------------------------------------------------------------------------------------------- the mapping
def process_mapping(hosts: list[str]) -> str:
    """MPICH's ``PMI_process_mapping`` for ranks on ``hosts`` (one entry per rank): ``(vector,(node,nodes,
    ranks_per_node),...)``, one triple per run of consecutive ranks on one node, runs of equal length on
    consecutive nodes merged (block placement: ``(vector,(0,2,4))`` for two nodes of four ranks)."""
    ids: dict[str, int] = {}
    node = [ids.setdefault(h, len(ids)) for h in hosts]
    runs: list[list[int]] = []  # [node, count]
    for n in node:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    triples: list[list[int]] = []  # [first node, nodes, ranks per node]
    for n, count in runs:
        last = triples[-1] if triples else None
        if last is not None and last[2] == count and last[0] + last[1] == n:
            last[1] += 1
        else:
            triples.append([n, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in triples) + ")"


# ---------------------------------------------------------------------------------------------- the server
class _Server:
    """The PMI-1 server loop (runs in the child process started by :func:`serve`)."""

    def __init__(self, listener: socket.socket, size: int, mapping: str, parent: int, timeout: float):
        self.listener, self.size, self.parent = listener, size, parent
        self.deadline = time.monotonic() + timeout
        self.kvs = {"PMI_process_mapping": mapping}
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ)
        self.bufs: dict[socket.socket, bytes] = {}
        self.finalized: set[socket.socket] = set()
        self.barrier: list[socket.socket] = []
        self.joined = 0

    def run(self) -> int:
        while True:
            for key, _ in self.sel.select(timeout=1.0):
                if key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.sel.register(conn, selectors.EVENT_READ)
                    self.bufs[conn] = b""
                    self.joined += 1
                elif not self._read(key.fileobj) and not self._left(key.fileobj):
                    return self._close_all(1)
            if self.joined and not self.bufs:
                return 0  # every process connected, finished and left
            if os.getppid() != self.parent:
                return 0  # process 0 is gone: so is the job
            if self.joined < self.size and time.monotonic() > self.deadline:
                sys.stderr.write(f"loom PMI server: {self.joined} of {self.size} processes connected before the "
                                 f"timeout; giving up on forming the MPI world\n")
                return self._close_all(1)

    def _read(self, conn: socket.socket) -> bool:
        try:
            data = conn.recv(65536)
        except OSError:
            data = b""
        if not data:
            return False
        self.bufs[conn] += data
        while b"\n" in self.bufs[conn]:
            line, self.bufs[conn] = self.bufs[conn].split(b"\n", 1)
            self._handle(conn, line.decode(errors="replace"))
        return True

    def _left(self, conn: socket.socket) -> bool:
        """A process closed its connection: the normal end after ``finalize`` (True), else the job cannot form."""
        self.sel.unregister(conn)
        self.bufs.pop(conn, None)
        conn.close()
        return conn in self.finalized

    def _close_all(self, code: int) -> int:
        for conn in list(self.bufs):
            conn.close()
        return code

    def _handle(self, conn: socket.socket, line: str) -> None:
        kv = dict(tok.split("=", 1) for tok in line.split(" ") if "=" in tok)
        cmd = kv.get("cmd", "")
        reply = {
            "initack": lambda: (f"cmd=initack\ncmd=set size={self.size}\ncmd=set rank={kv.get('pmiid', '0')}\n"
                                f"cmd=set debug=0"),
            "init": lambda: "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0",
            "get_maxes": lambda: f"cmd=maxes {_MAXES} rc=0",
            "get_appnum": lambda: "cmd=appnum appnum=0 rc=0",
            "get_my_kvsname": lambda: "cmd=my_kvsname kvsname=loom rc=0",
            "get_universe_size": lambda: f"cmd=universe_size size={self.size} rc=0",
            "put": lambda: self._put(kv),
            "get": lambda: (f"cmd=get_result rc=0 msg=success value={self.kvs[kv.get('key', '')]}"
                            if kv.get("key", "") in self.kvs else "cmd=get_result rc=1 msg=key_not_found"),
            "finalize": lambda: self._finalize(conn),
        }.get(cmd)
        if cmd == "barrier_in":
            self.barrier.append(conn)
            if len(self.barrier) == self.size:
                for c in self.barrier:
                    c.sendall(b"cmd=barrier_out rc=0\n")
                self.barrier = []
        elif cmd == "abort":  # the process prints its own message and exits; the launcher ends the rest
            pass
        elif reply is not None:
            conn.sendall((reply() + "\n").encode())
        else:
            conn.sendall(f"cmd={cmd or 'unknown'}_result rc=1 msg=unsupported_by_loom\n".encode())

    def _put(self, kv: dict[str, str]) -> str:
        self.kvs[kv.get("key", "")] = kv.get("value", "")
        return "cmd=put_result rc=0 msg=success"

    def _finalize(self, conn: socket.socket) -> str:
        self.finalized.add(conn)
        return "cmd=finalize_ack rc=0"


def serve(size: int, mapping: str, *, public: bool, timeout: float) -> tuple[subprocess.Popen, int]:
    """Start the PMI server for ``size`` processes in a child Python; ``(process, port)``. ``public``: listen on
    every interface (the processes span hosts), else on the loopback only."""
    cmd = [sys.executable, "-I", "-S", os.path.abspath(__file__), str(size), mapping, "1" if public else "0",
           str(os.getpid()), repr(float(timeout))]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=False)
    line = proc.stdout.readline() if proc.stdout is not None else b""
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"the PMI server ({' '.join(cmd[:4])} ...) did not start: it printed {line!r}")
    return proc, int(line)


def _main(argv: list[str]) -> int:
    size, mapping, public, parent, timeout = int(argv[0]), argv[1], argv[2] == "1", int(argv[3]), float(argv[4])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0" if public else "127.0.0.1", 0))
    listener.listen(max(16, size))
    print(listener.getsockname()[1], flush=True)
    sys.stdout.close()  # the parent stops reading here; nothing else goes to the pipe
    return _Server(listener, size, mapping, parent, timeout).run()


# ---------------------------------------------------------------------------------------------- joining
def mpi_started() -> bool:
    """Whether MPI is already initialized in this process (``mpi4py.MPI`` loaded and initialized)."""
    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and bool(mod.Is_initialized())


def form_world(store, rank: int, size: int, *, timeout: float, prefix: str = "loom/pmi/") -> None:
    """Make this process rank ``rank`` of an MPI world of ``size`` processes that all call this (module plan):
    after it returns, the first ``from mpi4py import MPI`` starts MPI in that world. ``store`` is any key-value
    store with ``set(key, bytes)`` and a blocking ``get(key)`` shared by the processes (torch's ``Store``).

    Raises ``RuntimeError`` when MPI has already started in this process (it can no longer join a world)."""
    if mpi_started():
        raise RuntimeError(f"MPI already started in this process (rank {rank} of {size}) before the processes could "
                           f"form one MPI world; call init_process_group before anything that starts MPI "
                           f"(loom.comm.world(), mpi4py), or launch with loom run --ranks N / mpiexec")
    host = socket.gethostname()
    store.set(f"{prefix}host/{rank}", host.encode())
    if rank == 0:
        hosts = [_text(store.get(f"{prefix}host/{r}")) for r in range(size)]
        public = len(set(hosts)) > 1
        proc, port = serve(size, process_mapping(hosts), public=public, timeout=timeout)
        _SERVERS.append(proc)  # reaped at exit; it ends by itself when the job does
        store.set(f"{prefix}addr", json.dumps({"host": host, "candidates": host_addresses() if public else
                                               ["127.0.0.1"], "port": port}).encode())
    addr = json.loads(_text(store.get(f"{prefix}addr")))
    if addr["host"] == host:
        target = "127.0.0.1"
    else:
        target = reachable(addr["candidates"], addr["port"], "forming the MPI world of the loom backend",
                           "launch with mpiexec (its hosts reach each other) or give rank 0 a reachable address")
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    os.environ["PMI_PORT"] = f"{target}:{addr['port']}"
    os.environ["PMI_ID"] = str(rank)


def check_formed(rank: int, size: int, mpi_rank: int, mpi_size: int, library: str) -> None:
    """After MPI started in a world :func:`form_world` prepared: drop its variables (a child process must not
    join again) and refuse an MPI that did not join it (``ValueError`` naming what works)."""
    os.environ.pop("PMI_PORT", None)
    os.environ.pop("PMI_ID", None)
    if (mpi_rank, mpi_size) != (rank, size):
        raise ValueError(
            f"the loom backend could not form one MPI world of the {size} processes this launcher started: MPI "
            f"started this one as rank {mpi_rank} of {mpi_size} ({library.splitlines()[0].strip()[:60]}). Only "
            f"MPICH joins processes it did not launch (the mpich wheel: pip install mpich); with this MPI, launch "
            f"with loom run --ranks {size} script.py or mpiexec -n {size} python script.py")


def _text(value) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


_SERVERS: list[subprocess.Popen] = []


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
