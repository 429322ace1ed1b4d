"""Build the emulated cluster from network namespaces, veth pairs, bridges and ``tc``; launch MPI jobs on it.

Build plan (:meth:`Testbed.build`), all with ``ip``/``tc`` batch calls, nothing outside the testbed's own
namespaces is touched:

1. one namespace per rank (``{prefix}r{g}``) and one "switch" namespace (``{prefix}sw``) that holds the
   bridges ``rail{k}`` and ``node{n}``;
2. per rank, a veth pair ``rail`` (in the rank) <-> ``k{g}`` (in the switch, a port of bridge ``rail{k}``)
   and, when a node has several ranks, ``intra`` <-> ``i{g}`` (a port of bridge ``node{n}``);
3. addresses and static routes from :func:`loom.testbed.topology.ranks` (IPv4 forwarding on, reverse-path
   filtering off, so a rank can be the hop of a cross-rail route; IPv6 off);
4. ``tc tbf`` on *both* ends of every veth (each direction of a full-duplex NIC is limited separately);
5. a settle pause (MPICH's OFI/TCP endpoint set-up fails with "ep_enable failed ... Bad file descriptor" when
   ranks start within ~0.5 s of the namespaces being created).

Launch (:meth:`Testbed.run`): one ``mpiexec`` (hydra) in the host namespace with an MPMD command line, one
segment per rank: ``-n 1 ip netns exec {prefix}r{g} env MPIR_CVAR_NOLOCAL=1 ... COMMAND : -n 1 ...``.
Hydra's own control traffic never needs the emulated network: the proxy runs in the host namespace and hands
each rank its PMI connection as an inherited socketpair (``PMI_FD``), which crosses namespaces unharmed.
``MPIR_CVAR_NOLOCAL=1`` turns off MPICH's shared-memory path (otherwise ranks on "different nodes" would
still talk through /dev/shm), and ``FI_TCP_IFACE=rail`` pins the OFI TCP provider to the rail NIC
(``GLOO_SOCKET_IFNAME=rail`` does the same for torch's gloo groups).

Teardown (:meth:`Testbed.teardown`, run by ``with``, on exceptions, Ctrl-C and at interpreter exit): kill the
launcher's process group, kill whatever still runs inside the testbed's namespaces, delete the namespaces
(their veths and bridges go with them) and the topology file. Namespaces left by a killed process
(``loomtb-{pid}-...`` with a dead pid) are removed by the next build or by ``loom testbed clean``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..comm import launch as _launch
from .topology import INTRA_IFACE, RAIL_IFACE, TestbedSpec, current_topology, ranks, topology_dict

__all__ = [
    "Testbed",
    "TestbedError",
    "TestbedUnavailable",
    "preflight",
    "rank_env",
    "leftovers",
    "clean",
    "set_rail_rate",
    "NAME_PREFIX",
]

#: Every namespace the testbed creates starts with this (then the owner's pid and a counter).
NAME_PREFIX = "loomtb-"
_CMD_TIMEOUT = 60.0
_COUNTER = itertools.count()


class TestbedError(RuntimeError):
    """Building, running or tearing down the testbed failed (the failing command and its stderr are named)."""

    __test__ = False


class TestbedUnavailable(TestbedError):
    """This machine cannot host the testbed (not root, ``ip``/``tc`` missing, namespaces not permitted)."""

    __test__ = False


def preflight(*, probe: bool = False) -> None:
    """Raise :class:`TestbedUnavailable` with the reason and the fix unless the testbed can be built here.

    Args:
        probe: also create and delete one empty namespace (catches containers without CAP_NET_ADMIN).
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise TestbedUnavailable(
            "loom testbed needs root: it creates network namespaces, veth pairs, bridges and tc limits. "
            "Run it as root (e.g. `sudo .venv/bin/loom testbed ...`) or in a container with CAP_NET_ADMIN"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise TestbedUnavailable(
            f"loom testbed needs {' and '.join(missing)} from iproute2 on PATH; install it "
            f"(e.g. `apt-get install iproute2`)"
        )
    if probe:
        name = f"{NAME_PREFIX}{os.getpid()}-probe"
        proc = _run(["ip", "netns", "add", name], check=False)
        _run(["ip", "netns", "delete", name], check=False)
        if proc.returncode != 0:
            raise TestbedUnavailable(f"cannot create a network namespace here ({proc.stderr.strip()}); the testbed "
                                     f"needs CAP_NET_ADMIN and CAP_SYS_ADMIN (a privileged container or a VM)")


def node_hostname(node: int) -> str:
    """The host name the ranks of emulated node ``node`` see."""
    return f"{NAME_PREFIX}node{node}"


def rank_env(spec: TestbedSpec, rank: int, topology_file: str | None = None) -> dict[str, str]:
    """The environment one rank runs with: MPICH over OFI/TCP on its rail NIC, plus where it sits."""
    info = ranks(spec)[rank]
    env = {
        "MPIR_CVAR_NOLOCAL": "1",  # no shared memory between ranks: every byte crosses the emulated links
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": RAIL_IFACE,  # the address peers connect to is the rail NIC's
        "GLOO_SOCKET_IFNAME": RAIL_IFACE,  # torch's gloo too (it would look its host name up, which resolves nowhere)
        "LOOM_TESTBED_NODE": str(info.node),
        "LOOM_TESTBED_LOCAL_RANK": str(info.local_rank),
        "LOOM_TESTBED_RAIL": str(info.rail),
        "LOOM_TESTBED_RANKS_PER_NODE": str(spec.ranks_per_node),
    }
    if topology_file:
        env["LOOM_TESTBED_TOPOLOGY"] = topology_file
    return env


def _run(args: Sequence[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"`{' '.join(args)}` did not finish within {_CMD_TIMEOUT:.0f} s") from exc
    except OSError as exc:
        raise TestbedError(f"`{' '.join(args)}` could not start: {exc}") from exc
    if check and proc.returncode != 0:
        what = f"\n--- input\n{input}" if input else ""
        raise TestbedError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}{what}")
    return proc


def _netns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _owner(name: str) -> int | None:
    try:
        return int(name[len(NAME_PREFIX):].split("-", 1)[0])
    except ValueError:
        return None


def leftovers(prefix: str = NAME_PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (default: every testbed's)."""
    return [n for n in _netns_list() if n.startswith(prefix)]


def _mpiexec() -> str:
    """The launcher loom uses everywhere (:func:`loom.comm.launch.mpiexec`), as a testbed error when missing."""
    try:
        return _launch.mpiexec()
    except FileNotFoundError as exc:
        raise TestbedUnavailable(str(exc)) from exc


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _in_netns(pid: int, inode: int | None) -> bool:
    try:
        return inode is not None and os.stat(f"/proc/{pid}/ns/net").st_ino == inode
    except OSError:
        return False


def _kill_netns_pids(names: Sequence[str]) -> list[int]:
    """SIGKILL every process inside the given namespaces; returns the pids killed. Each is signalled through a
    pidfd after checking it is still inside that namespace (its pid may have been reused since the listing)."""
    killed = []
    for name in names:
        inode = _netns_inode(name)
        proc = _run(["ip", "netns", "pids", name], check=False)
        for pid in (int(t) for t in proc.stdout.split() if t.isdigit()):
            if _launch.signal_verified(pid, signal.SIGKILL, lambda p, i=inode: _in_netns(p, i)):
                killed.append(pid)
    return killed


def _delete_netns(names: Sequence[str]) -> list[str]:
    errors = []
    for name in names:
        proc = _run(["ip", "netns", "delete", name], check=False)
        if proc.returncode != 0 and name in _netns_list():
            errors.append(f"{name}: {proc.stderr.strip()}")
    return errors


def clean(*, all_owners: bool = False) -> list[str]:
    """Remove namespaces left behind by testbeds whose owner process is gone (or every testbed's with
    ``all_owners``); kills the processes still inside them. Returns the names removed."""
    names = [n for n in leftovers() if all_owners or not _launch.pid_alive(_owner(n) or -1)]
    _kill_netns_pids(names)
    errors = _delete_netns(names)
    if errors:
        raise TestbedError("could not delete namespaces: " + "; ".join(errors))
    return names


def _rate(gbit: float) -> str:
    return f"{int(round(gbit * 1e9))}bit"


def _burst(gbit: float) -> int:
    # tbf needs a bucket of at least one timer tick of traffic; 2 ms of line rate, never below 128 KiB
    # (a GSO super-packet is up to 64 KiB; tbf splits larger ones).
    return max(128 * 1024, int(gbit * 1e9 / 8 * 0.002))


def _tbf(gbit: float) -> str:
    return f"root tbf rate {_rate(gbit)} burst {_burst(gbit)} latency 50ms"


def set_rail_rate(rail: int, gbit: float, *, topology: Mapping[str, Any] | None = None) -> None:
    """Change the rate of rail ``rail`` on a running testbed: both veth ends of every rank's NIC on that rail
    (a degraded or congested rail, while a job runs). Needs root, like the testbed.

    Args:
        rail: the rail switch (0 .. rails - 1).
        gbit: the new rate, Gbit/s each way (> 0; the testbed's ``rail_gbit`` restores it).
        topology: the testbed's topology dict with its ``prefix``; inside a testbed rank, the running
            testbed's (:func:`~loom.testbed.topology.current_topology`).
    """
    topo = topology if topology is not None else current_topology()
    if topo is None or "prefix" not in topo:
        raise TestbedError("set_rail_rate: no running testbed here; call Testbed.set_rail_rate, or run inside "
                           "`loom testbed run`")
    if isinstance(gbit, bool) or not isinstance(gbit, (int, float)) or not gbit > 0:
        raise ValueError(f"gbit={gbit!r} must be a rate > 0 Gbit/s (the testbed's rail_gbit restores it)")
    on = [int(r["rank"]) for r in topo["ranks"] if int(r["rail"]) == rail]
    if not on:
        raise ValueError(f"rail={rail!r}: the testbed has rails 0..{int(topo['rails']) - 1}")
    prefix = topo["prefix"]
    for g in on:
        _run(["tc", "-n", f"{prefix}r{g}", "qdisc", "replace", "dev", RAIL_IFACE, *_tbf(gbit).split()])
    _run(["tc", "-n", f"{prefix}sw", "-batch", "-"],
         input="".join(f"qdisc replace dev k{g} {_tbf(gbit)}\n" for g in on))


class Testbed:
    """An emulated multi-node, multi-rail cluster on this machine (needs root).

    >>> with Testbed(nodes=2, ranks_per_node=2, rails=2, rail_gbit=1, intra_gbit=10) as tb:
    ...     tb.run([sys.executable, "bench.py"], timeout=120)

    Args:
        spec: the topology; or pass its fields as keyword arguments.
        settle: seconds to wait after building before the first launch (MPICH's OFI/TCP set-up races
            freshly created namespaces).
        **fields: :class:`~loom.testbed.topology.TestbedSpec` fields when ``spec`` is not given.
    """

    __test__ = False

    def __init__(self, spec: TestbedSpec | None = None, *, settle: float = 1.5, **fields: Any):
        if spec is not None and fields:
            raise TypeError(f"pass either spec or its fields ({', '.join(fields)}), not both")
        self.spec = spec if spec is not None else TestbedSpec(**fields)
        if settle < 0:
            raise ValueError(f"settle={settle} must be >= 0 seconds")
        self.settle = settle
        self.prefix = f"{NAME_PREFIX}{os.getpid()}-{next(_COUNTER)}-"
        self.ranks = ranks(self.spec)
        self.topology = topology_dict(self.spec)
        self.topology_file: str | None = None
        self._namespaces: list[str] = []
        self._built_at = 0.0
        self._proc: subprocess.Popen | None = None

    # --- names -------------------------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    def rank_ns(self, rank: int) -> str:
        """The namespace rank ``rank`` runs in."""
        return f"{self.prefix}r{rank}"

    @property
    def namespaces(self) -> list[str]:
        """Namespaces this testbed created and has not deleted yet."""
        return list(self._namespaces)

    # --- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self.build()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def build(self) -> "Testbed":
        """Create namespaces, links, addresses, routes and rate limits (see the module docstring's plan)."""
        if self._namespaces:
            raise TestbedError(f"testbed {self.prefix} is already built; tear it down first")
        preflight()
        try:
            clean()  # namespaces of testbeds whose owner died (never a live process's)
        except TestbedError:
            pass
        atexit.register(self.teardown)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        self._built_at = time.monotonic()
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    def _build(self) -> None:
        spec = self.spec
        sw = self.switch_ns
        self._add_ns(sw)
        for info in self.ranks:
            self._add_ns(self.rank_ns(info.rank))
        multi = spec.ranks_per_node > 1
        # Switch namespace: bridges and the switch-side veth ends.
        lines = ["link set lo up"]
        for k in range(spec.rails):
            lines += [f"link add rail{k} type bridge", f"link set rail{k} up"]
        if multi:
            for n in range(spec.nodes):
                lines += [f"link add node{n} type bridge", f"link set node{n} up"]
        for info in self.ranks:
            ns = self.rank_ns(info.rank)
            lines += [f"link add k{info.rank} type veth peer name {RAIL_IFACE} netns {ns}",
                      f"link set k{info.rank} master rail{info.rail} up"]
            if multi:
                lines += [f"link add i{info.rank} type veth peer name {INTRA_IFACE} netns {ns}",
                          f"link set i{info.rank} master node{info.node} up"]
        _run(["ip", "-n", sw, "-batch", "-"], input="\n".join(lines) + "\n")
        # Rank namespaces: kernel settings first (forwarding for hops; no rp_filter: replies of cross-rail
        # pairs arrive on the rail NIC while the route back leaves by the intra NIC), then addresses, routes.
        sysctls = {
            "net/ipv4/ip_forward": 1,
            "net/ipv4/conf/all/rp_filter": 0,
            "net/ipv4/conf/default/rp_filter": 0,
            f"net/ipv4/conf/{RAIL_IFACE}/rp_filter": 0,
            "net/ipv4/conf/all/send_redirects": 0,
            "net/ipv4/tcp_slow_start_after_idle": 0,
            "net/ipv6/conf/all/disable_ipv6": 1,
        }
        if multi:
            sysctls[f"net/ipv4/conf/{INTRA_IFACE}/rp_filter"] = 0
        script = "; ".join(f"echo {v} > /proc/sys/{k}" for k, v in sysctls.items())
        for info in self.ranks:
            ns = self.rank_ns(info.rank)
            _run(["ip", "netns", "exec", ns, "sh", "-ec", script])
            lines = ["link set lo up", f"addr add {info.rail_ip}/24 dev {RAIL_IFACE}", f"link set {RAIL_IFACE} up"]
            if multi:
                lines += [f"addr add {info.intra_ip}/24 dev {INTRA_IFACE}", f"link set {INTRA_IFACE} up"]
            lines += [" ".join(r.ip_args()) for r in info.routes]
            _run(["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n")
        # Rate limits on both ends of every veth.
        sw_tc = []
        for info in self.ranks:
            ns = self.rank_ns(info.rank)
            rank_tc = []
            for iface, peer, gbit, on in ((RAIL_IFACE, f"k{info.rank}", spec.rail_gbit, True),
                                          (INTRA_IFACE, f"i{info.rank}", spec.intra_gbit, multi)):
                if on and gbit > 0:
                    qd = _tbf(gbit)
                    rank_tc.append(f"qdisc replace dev {iface} {qd}")
                    sw_tc.append(f"qdisc replace dev {peer} {qd}")
            if rank_tc:
                _run(["tc", "-n", ns, "-batch", "-"], input="\n".join(rank_tc) + "\n")
        if sw_tc:
            _run(["tc", "-n", sw, "-batch", "-"], input="\n".join(sw_tc) + "\n")
        fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".topology.json")
        with os.fdopen(fd, "w") as f:
            json.dump({**self.topology, "prefix": self.prefix}, f, indent=1)
        self.topology_file = path

    def teardown(self) -> None:
        """Kill every process of the testbed and delete its namespaces; safe to call twice."""
        errors = []
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
        names, self._namespaces = self._namespaces, []
        if names:
            _kill_netns_pids(names)
            errors = _delete_netns(names)
        if self.topology_file:
            Path(self.topology_file).unlink(missing_ok=True)
            self.topology_file = None
        atexit.unregister(self.teardown)
        if errors:
            raise TestbedError("teardown could not delete namespaces: " + "; ".join(errors))

    # --- running -------------------------------------------------------------------------------------------
    def env(self, rank: int) -> dict[str, str]:
        """Rank ``rank``'s environment (:func:`rank_env` plus the topology file)."""
        return rank_env(self.spec, rank, self.topology_file)

    def mpiexec_argv(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> list[str]:
        """The MPMD ``mpiexec`` command line that starts ``argv`` on every rank, each in its namespace."""
        if not argv:
            raise ValueError("empty command: give the program to run on the ranks, e.g. [sys.executable, 'x.py']")
        launcher = _mpiexec()
        cmd = [launcher]
        if _launch.is_openmpi(launcher) and os.geteuid() == 0:
            cmd += ["--allow-run-as-root", "--oversubscribe"]
        for info in self.ranks:
            if info.rank:
                cmd.append(":")
            rank_vars = {**self.env(info.rank), **(env or {})}
            # Each emulated node gets its own host name (a UTS namespace), so a rank learns its node the way
            # it would on a cluster: from gethostname() (loom.multipath.detect).
            cmd += ["-n", "1", "ip", "netns", "exec", self.rank_ns(info.rank), "unshare", "--uts", "sh", "-c",
                    'hostname "$0" && exec "$@"', node_hostname(info.node), "env"]
            cmd += [f"{k}={v}" for k, v in rank_vars.items()]
            cmd += list(argv)
        return cmd

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        capture: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` as the testbed's MPI ranks and wait; the job is killed after ``timeout`` s.

        Args:
            argv: the program, e.g. ``[sys.executable, "-m", "loom.bench.cli", "bw"]``.
            timeout: wall-clock limit in seconds (``None``: none); on expiry the whole job is killed and
                ``subprocess.TimeoutExpired`` raised (the testbed stays up; the ``with`` block tears it down).
            env: extra environment for every rank.
            capture: capture stdout/stderr as text instead of inheriting them.

        Returns:
            the completed launcher process (``returncode``, ``stdout``, ``stderr``).
        """
        if not self._namespaces:
            raise TestbedError("the testbed is not built: use `with Testbed(...) as tb:` or call build() first")
        if self._proc is not None and self._proc.poll() is None:
            raise TestbedError("a job is already running on this testbed; wait for it before starting another")
        wait = self.settle - (time.monotonic() - self._built_at)
        if wait > 0:
            time.sleep(wait)
        cmd = self.mpiexec_argv(argv, env=env)
        # A caller that is itself an MPI rank must not hand its own PMI connection to the nested launcher.
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))}
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        # The ranks must import this checkout of loom whatever their working directory.
        root = str(Path(__file__).resolve().parents[2])
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, full_env.get("PYTHONPATH", "")) if p)
        pipe = subprocess.PIPE if capture else None
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, stdout=pipe, stderr=pipe, text=True)
        self._proc = proc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            _kill_netns_pids(self._namespaces)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout or 0, output=out, stderr=err) from None
        except BaseException:  # Ctrl-C and friends: leave nothing running
            _kill_group(proc)
            _kill_netns_pids(self._namespaces)
            raise
        finally:
            if proc.poll() is not None:
                self._proc = None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def set_rail_rate(self, rail: int, gbit: float) -> None:
        """Change rail ``rail``'s rate while jobs run (:func:`set_rail_rate`)."""
        if not self._namespaces:
            raise TestbedError("the testbed is not built: use `with Testbed(...) as tb:` or call build() first")
        set_rail_rate(rail, gbit, topology={**self.topology, "prefix": self.prefix})

    # --- observing -----------------------------------------------------------------------------------------
    def counters(self) -> dict[int, dict[str, dict[str, int]]]:
        """Byte counters of every rank's NICs: ``{rank: {"rail": {"tx": n, "rx": n}, "intra": {...}}}``."""
        out: dict[int, dict[str, dict[str, int]]] = {}
        for info in self.ranks:
            proc = _run(["ip", "-n", self.rank_ns(info.rank), "-s", "-j", "link", "show"])
            links = {}
            for link in json.loads(proc.stdout):
                if link.get("ifname") in (RAIL_IFACE, INTRA_IFACE):
                    st = link.get("stats64", link.get("stats", {}))
                    links[link["ifname"]] = {"tx": int(st["tx"]["bytes"]), "rx": int(st["rx"]["bytes"])}
            out[info.rank] = links
        return out

    def processes(self) -> list[int]:
        """Pids running inside this testbed's namespaces."""
        pids = []
        for name in self._namespaces:
            pids += [int(t) for t in _run(["ip", "netns", "pids", name], check=False).stdout.split() if t.isdigit()]
        return pids


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (hydra then cleans up its ranks), SIGKILL after a grace period,
    and SIGKILL any descendant that lives in another session."""
    family = _launch.descendants(proc.pid)
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid, started in family:  # gone by now unless they escaped the group; their pids may be reused
        _launch.signal_verified(pid, signal.SIGKILL, lambda p, t=started: _launch.start_time(p) == t)
    if proc.poll() is None:
        print(f"loom testbed: launcher pid {proc.pid} survived SIGKILL", file=sys.stderr)
