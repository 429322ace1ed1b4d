"""One CLI vocabulary: the flags that several ``loom`` commands share, each with one meaning everywhere.

A command builds its argparse parser and adds the shared flags from here, so ``--json`` always takes a
path and ``-N`` always means nodes::

    p = argparse.ArgumentParser(prog="loom plan", formatter_class=cli_args.Formatter)
    cli_args.add_topology(p, nodes=None)
    cli_args.add_json(p)

Short flags are scarce; :data:`SHORT` lists every one a ``loom`` command may use and the long flag it stands
for (a test walks every parser and checks them against it). Ranks are asked for in one way only:
``--ranks N`` (short ``-n``, as with ``mpiexec -n``); ``loom`` itself reads it before the command runs
(:func:`pop_ranks`) and relaunches the command on that many local ranks.

A usage error is printed once per job: every rank of a job finds it (they parse the same command line), rank
0 prints it and the other ranks exit with the same code in silence (:func:`follower_wait`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from . import settings

__all__ = ["SHORT", "ArgumentParser", "Formatter", "parse_size", "parse_device", "parse_ranks", "pop_ranks",
           "add_json", "add_dry_run", "add_topology", "add_verbose", "UsageError", "follower_wait", "FOLLOWER_WAIT_S",
           "offer_ranks", "leave_now"]

SHORT: dict[str, str] = {
    "-n": "--ranks",
    "-N": "--nodes",
    "-R": "--ranks-per-node",
    "-K": "--rails",
    "-t": "--topology",
    "-c": "--config",
    "-r": "--resume",
    "-p": "--prompt",
    "-k": "--top-k",
    "-m": "--min-size",
    "-M": "--max-size",
    "-i": "--iterations",
    "-x": "--warmup",
    "-b": "--batch",
    "-w": "--width",
    "-d": "--depth",
    "-v": "--verbose",
    "-h": "--help",
}
"""Every short flag in use and its one long form."""


class UsageError(argparse.ArgumentTypeError, ValueError):
    """A command line the user must fix: printed as one line, exit code 2 (argparse reports it as is when a
    ``type=`` function raises it)."""


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; descriptions and epilogs kept as written."""


_RANKS_OFFERED = [False]


def offer_ranks(on: bool) -> None:
    """Said by the ``loom`` dispatcher for the command it is about to run: whether it launches that command on
    ``--ranks N`` local ranks. While on, every :class:`ArgumentParser` the command builds lists ``-n/--ranks``
    in its ``--help`` (the dispatcher reads the flag itself, :func:`pop_ranks`, before the command parses)."""
    _RANKS_OFFERED[0] = bool(on)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with loom's conventions: defaults shown in ``--help``, and a usage error is one line
    (``loom plan: error: argument --nodes: invalid int value: 'x' (see loom plan --help)``), exit code 2.
    Help texts written for docstrings read as plain text: reST literals and roles show as `name`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self.checks: list = []
        """``check(namespace) -> message or None``: rules across arguments, reported like any usage error."""
        if _RANKS_OFFERED[0] and self.add_help:
            self.add_argument("-n", "--ranks", type=parse_ranks, metavar="N", default=argparse.SUPPRESS,
                              help="run on N local ranks: loom launches itself under mpiexec -n N (without it: one "
                                   "process; inside an MPI job, e.g. under mpiexec, it is ignored: the job's ranks "
                                   "run)")

    def format_help(self) -> str:
        return _plain(super().format_help())

    def format_usage(self) -> str:
        return _plain(super().format_usage())

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            msg = check(ns)
            if msg:
                self.error(msg)
        return ns, rest

    def error(self, message: str):
        if settings.launch_rank() != 0:
            follower_wait()
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _plain(text: str) -> str:
    """Docstring markup in help texts (reST literals in double backquotes, roles such as ``:mod:``) as `x`."""
    return re.sub(r"(?::\w+:)?``?([^`]+?)``?", r"`\1`", text)


FOLLOWER_WAIT_S = 5.0
"""How long a rank other than 0 waits before it leaves after an error that rank 0 reports."""


def follower_wait(seconds: float = FOLLOWER_WAIT_S) -> None:
    """On a rank other than 0 of a job that stops for a reason every rank knows (a usage error, Ctrl-C): wait a
    moment before leaving in silence. A launcher ends the whole job when the first rank exits with an error;
    were it this rank, rank 0 could be killed before its one line is written. Rank 0's exit ends the wait."""
    if settings.launch_rank() != 0:
        time.sleep(seconds)


def leave_now(code: int) -> None:
    """End this rank at once with ``code``, its output flushed, without finalizing MPI: finalizing would wait for
    peers that may be inside a collective with this rank (and wait for it); a rank that leaves unfinalized
    makes the launcher stop the others."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864; plain integers are bytes (K, M, G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?[iI]?[bB]?)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r} is not a byte count like 1024, 64K or 64M")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_device(text: str) -> str:
    """``--device`` value: ``cpu``, ``cuda`` (this rank's GPU, ``cuda:local_rank``), ``cuda:N`` or ``auto``; raises
    :class:`UsageError` naming the value and the choices. Only the spelling is checked here (a command line that
    names a GPU still parses on a machine without one); the command binds it with
    :func:`loom.comm.devices.resolve_device` when it runs."""
    if re.fullmatch(r"cpu|auto|cuda(:\d+)?", str(text).strip()):
        return str(text).strip()
    raise UsageError(f"device {text!r} is not one loom runs on; give cpu, cuda, cuda:N or auto")


def parse_ranks(text: str) -> int:
    """``--ranks`` value: an integer >= 1 (raises :class:`UsageError` naming the value)."""
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--ranks {text!r} is not an integer; give the number of ranks, e.g. --ranks 2") from None
    if n < 1:
        raise UsageError(f"--ranks {n} must be >= 1, e.g. --ranks 2")
    return n


def pop_ranks(argv: list[str]) -> tuple[int | None, list[str]]:
    """Remove ``--ranks N`` / ``--ranks=N`` / ``-n N`` from ``argv``; return ``(N or None, rest)``.

    Arguments after ``--`` (a command run by the job, e.g. ``loom testbed run -- CMD``) are left alone.
    Raises :class:`UsageError` for a value that is not an integer >= 1, or a flag without a value.
    """
    out: list[str] = []
    ranks = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a in ("--ranks", "-n"):
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value: {a} N")
            ranks = parse_ranks(argv[i + 1])
            i += 2
            continue
        if a.startswith("--ranks="):
            ranks = parse_ranks(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return ranks, out


def add_json(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str = "the results") -> None:
    """``--json PATH``: also write ``what`` as JSON to PATH (``-`` for standard output)."""
    p.add_argument("--json", metavar="PATH", default=None, help=f"also write {what} as JSON to PATH ('-': stdout)")


def add_dry_run(p: argparse.ArgumentParser, what: str = "validate the arguments and exit without communicating"):
    """``--dry-run`` (no short flag): validate everything the real run validates, then stop."""
    p.add_argument("--dry-run", action="store_true", help=what)


def add_verbose(p: argparse.ArgumentParser, what: str = "more output") -> None:
    p.add_argument("-v", "--verbose", action="store_true", help=what)


def add_topology(p: argparse.ArgumentParser, *, nodes: int | None = 2, per: int | None = 1, rails: int | None = 1,
                 topology: str | None = None, presets: str = "") -> argparse._ArgumentGroup:
    """The cluster shape: ``--nodes/-N``, ``--ranks-per-node/-R``, ``--rails/-K`` (and ``--topology/-t`` when
    ``topology`` is given); ``None`` defaults mean "the preset's value". Returns the group to add more to."""
    g = p.add_argument_group("topology")
    if topology is not None:
        g.add_argument("-t", "--topology", default=topology,
                       help="topology preset" + (f" ({presets})" if presets else ""))
    tail = " (preset default when omitted)" if nodes is None else ""
    g.add_argument("-N", "--nodes", type=int, default=nodes, help="nodes" + tail)
    g.add_argument("-R", "--ranks-per-node", type=int, default=per, help="ranks per node (one NIC each)" + tail)
    g.add_argument("-K", "--rails", type=int, default=rails, help="rail switches (<= ranks per node)" + tail)
    return g
