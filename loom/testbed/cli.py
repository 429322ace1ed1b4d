"""``loom testbed``: build the emulated cluster, run a command on it, measure it, clean up after crashes.

::

    loom testbed run   [topology] [--timeout S] -- COMMAND...   # COMMAND on every rank, then tear down
    loom testbed check [topology] [--seconds S] [--json PATH]    # configured vs achieved per link class
    loom testbed show  [topology] [--json PATH]                  # addresses, routes, planner topology (no root)
    loom testbed clean [--all]                                   # namespaces left by killed testbeds

Topology flags: ``--nodes/-N``, ``--ranks-per-node/-R``, ``--rails/-K``, ``--rail-gbit``, ``--intra-gbit``
(0 = unlimited). ``run`` and ``check`` need root; they tear everything down on success, failure, Ctrl-C and
SIGTERM. ``--ranks`` is not used here: the rank count is nodes x ranks-per-node (``RELAUNCH = False``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .. import cli_args
from .netns import Testbed, TestbedError, TestbedUnavailable, clean, leftovers
from .topology import TestbedSpec, ranks, topology_dict

__all__ = ["main", "parser", "RELAUNCH"]

#: loom/cli.py: do not re-launch this command under ``mpiexec --ranks N``; the testbed launches its own ranks.
RELAUNCH = False


def _topology_flags(p: argparse.ArgumentParser, *, nodes: int = 2, per: int = 1, rails: int = 1,
                    rail: float = 1.0, intra: float = 10.0) -> None:
    g = cli_args.add_topology(p, nodes=nodes, per=per, rails=rails)
    g.add_argument("--rail-gbit", type=float, default=rail, help="rate of each rail NIC, Gbit/s (0: unlimited)")
    g.add_argument("--intra-gbit", type=float, default=intra, help="rate of each intra-node link (0: unlimited)")
    g.add_argument("--settle", type=float, default=1.5, help="seconds between building and launching")


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom testbed", description="emulated multi-node, multi-rail cluster "
                                "(network namespaces + tc; needs root)")
    sub = p.add_subparsers(dest="cmd", metavar="{run,check,show,clean}", required=True)
    fmt = cli_args.Formatter
    run = sub.add_parser("run", help="run COMMAND as the testbed's MPI ranks", formatter_class=fmt)
    _topology_flags(run)
    run.add_argument("--timeout", type=float, default=600.0, help="kill the job after this many seconds")
    run.add_argument("--dry-run", action="store_true", help="print the launch command; build nothing")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...] to run on every rank")
    chk = sub.add_parser("check", help="measure every link class: configured vs achieved", formatter_class=fmt)
    _topology_flags(chk, per=2, rails=2)
    chk.add_argument("--size", default="1M", help="bytes per message of the bandwidth windows")
    chk.add_argument("--window", type=int, default=8, help="messages in flight per window")
    chk.add_argument("--seconds", type=float, default=2.0, help="time bound of each bandwidth loop")
    chk.add_argument("--classes", default="intra,rail,cross,rails", help="link classes to measure")
    chk.add_argument("--no-reference", action="store_true",
                     help="skip the unlimited reference link (the CPU's ceiling on this machine)")
    chk.add_argument("--timeout", type=float, default=300.0, help="kill a probe job after this many seconds")
    cli_args.add_json(chk, "the table")
    show = sub.add_parser("show", help="print ranks, addresses, routes (no root needed)", formatter_class=fmt)
    _topology_flags(show)
    cli_args.add_json(show, "the planner topology (topology_dict)")
    cl = sub.add_parser("clean", help="delete namespaces left by killed testbeds", formatter_class=fmt)
    cl.add_argument("--all", action="store_true", help="also those of live testbeds (other processes')")
    return p


def _spec(args: argparse.Namespace) -> TestbedSpec:
    return TestbedSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rails=args.rails,
                       rail_gbit=args.rail_gbit, intra_gbit=args.intra_gbit)


class _Terminated(BaseException):
    """SIGTERM/SIGHUP turned into an exception so that ``with Testbed`` tears down."""


def _on_signal(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def _cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("loom testbed run: no command; usage: loom testbed run [topology] -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    spec = _spec(args)
    tb = Testbed(spec, settle=args.settle)
    if args.dry_run:
        print(" ".join(tb.mpiexec_argv(command)))
        return 0
    print(f"loom testbed: {spec.describe()}", file=sys.stderr, flush=True)
    with tb:
        try:
            proc = tb.run(command, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"loom testbed run: the job did not finish within {args.timeout:g} s; killed it",
                  file=sys.stderr)
            return 124
    return proc.returncode


def _probe(tb: Testbed, args: argparse.Namespace, classes: str) -> list[dict]:
    fd, path = tempfile.mkstemp(prefix="loomtb-check-", suffix=".json")
    os.close(fd)
    try:
        argv = [sys.executable, "-m", "loom.testbed.probe", "--classes", classes, "--size", str(args.size),
                "--window", str(args.window), "--seconds", str(args.seconds), "--json", path]
        proc = tb.run(argv, timeout=args.timeout, capture=True)
        if proc.returncode != 0:
            raise TestbedError(f"the probe job exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                               f"--- stderr\n{proc.stderr}")
        with open(path) as f:
            return json.load(f)["rows"]
    finally:
        Path(path).unlink(missing_ok=True)


def _fmt_rate(g: float) -> str:
    return "unlimited" if g == 0 else f"{g:.3f}"


def check_rows(spec: TestbedSpec, args: argparse.Namespace) -> list[dict]:
    """Measure the classes on ``spec`` (and the unlimited reference link unless ``--no-reference``)."""
    rows = []
    with Testbed(spec, settle=args.settle) as tb:
        rows += _probe(tb, args, args.classes)
    if not args.no_reference:
        ref = TestbedSpec(nodes=2, ranks_per_node=1, rails=1, rail_gbit=0, intra_gbit=0)
        with Testbed(ref, settle=args.settle) as tb:
            for row in _probe(tb, args, "rail"):
                rows.append({**row, "class": "no-limit"})
    return rows


def verdict(row: dict, ceiling_gbit: float | None) -> str:
    """What limits a measured class: ``link`` (>= 80 % of the configured rate), ``cpu`` (below that but each
    flow reaches >= 70 % of the unlimited single-flow ``ceiling_gbit``: this machine, not the link), ``low``
    (neither: look into it), ``-`` for the unlimited reference itself."""
    conf, got = row["configured_gbit"], row["achieved_gbit"]
    if conf > 0 and got >= 0.8 * conf:
        return "link"
    if ceiling_gbit and got / max(1, len(row.get("pairs", [0]))) >= 0.7 * ceiling_gbit:
        return "cpu" if conf > 0 else "-"
    return "low" if conf > 0 else "-"


def print_table(rows: list[dict], spec: TestbedSpec, json_path: str | None = None) -> None:
    """Print the OMB-style check table on stdout (and ``json_path``); the ``no-limit`` row, when present, is
    the ceiling the verdicts compare against."""
    from loom.comm import measure as omb

    cols = ["Link", "Route", "Configured (Gbit/s)", "Achieved (Gbit/s)", "Achieved/Configured", "Latency (us)",
            "Limit"]
    table = omb.Table(title="Testbed Link Check", columns=cols)
    table.meta = {"topology": spec.describe(),
                  "method": "windowed isend stream (osu_bw) + 8-byte ping-pong, loom.comm over OFI/TCP",
                  "limit": "link: >= 80% of configured; cpu: below, but near the no-limit (CPU) ceiling"}
    table.widths = [10, max(8, *(len(r["path"]) + 2 for r in rows)) if rows else 8] + [len(c) + 2 for c in cols[2:]]
    ceiling = next((r["achieved_gbit"] for r in rows if r["class"] == "no-limit"), None)
    table.header()
    for r in rows:
        conf = r["configured_gbit"]
        ratio = f"{r['achieved_gbit'] / conf:.2f}" if conf else "-"
        r["limit"] = verdict(r, ceiling)
        table.add(r["class"], r["path"], _fmt_rate(conf), f"{r['achieved_gbit']:.3f}", ratio,
                  round(r["latency_us"], 1), r["limit"])
    table.write_json(json_path, rows=rows)


def _cmd_check(args: argparse.Namespace) -> int:
    from .probe import CLASSES

    unknown = [c for c in args.classes.split(",") if c.strip() not in CLASSES]
    if unknown:
        raise ValueError(f"--classes: unknown link class(es) {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(CLASSES)}")
    spec = _spec(args)
    print(f"loom testbed check: {spec.describe()}", file=sys.stderr, flush=True)
    rows = check_rows(spec, args)
    print_table(rows, spec, args.json)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    spec = _spec(args)
    if args.json == "-":
        print(json.dumps(topology_dict(spec), indent=1))
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(topology_dict(spec), f, indent=1)
    print(f"# {spec.describe()}")
    for info in ranks(spec):
        print(f"rank {info.rank}: node {info.node} local {info.local_rank} rail {info.rail}  "
              f"rail {info.rail_ip}  intra {info.intra_ip or '-'}")
        for r in info.routes:
            print(f"    ip {' '.join(r.ip_args())}")
    return 0


def _cmd_clean(args: argparse.Namespace) -> int:
    removed = clean(all_owners=args.all)
    print(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else ""))
    rest = leftovers()
    if rest:
        print(f"still present (owned by live testbeds; --all removes them): {', '.join(rest)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in handlers:
        signal.signal(s, _on_signal)
    try:
        if args.cmd == "run":
            return _cmd_run(args)
        if args.cmd == "check":
            return _cmd_check(args)
        if args.cmd == "show":
            return _cmd_show(args)
        return _cmd_clean(args)
    except (ValueError, TypeError) as exc:
        print(f"loom testbed: {exc}", file=sys.stderr)
        return 2
    except TestbedUnavailable as exc:
        print(f"loom testbed: {exc}", file=sys.stderr)
        return 77
    except TestbedError as exc:
        print(f"loom testbed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("loom testbed: interrupted; torn down", file=sys.stderr)
        return 130
    except _Terminated as exc:
        print(f"loom testbed: terminated by signal {exc.args[0]}; torn down", file=sys.stderr)
        return 128 + int(exc.args[0])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
