"""The ``loom`` command: ``loom <command> [args]``.

Each command lives in its own module exposing ``main(argv: list[str]) -> int`` (and usually an argparse
parser); this file only dispatches, so ``loom --help`` stays fast and capabilities stay decoupled.

``--ranks N`` / ``-n N`` (any command that communicates): when not already inside an MPI job, loom re-launches
itself under the bundled ``mpiexec -n N``; inside a job (``mpiexec -n N loom ...``) the flag is ignored. A
command module with ``OWN_RANKS = True`` parses ``--ranks`` in its own parser and launches its ranks itself
(``loom dask run``: the arguments of its script are not loom's). Shared flags and their one
meaning each come from :mod:`loom.cli_args`.
"""

from __future__ import annotations

import importlib
import sys

from .cli_args import UsageError, pop_ranks

__all__ = ["main", "COMMANDS", "pop_ranks"]

# name -> (module, one-line description). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("loom.tour", "the demo job on local ranks (what `make demo` runs)"),
    "bench": ("loom.bench.cli", "benchmarks: OMB-style comm tables and application benchmarks"),
    "train": ("loom.train.cli", "train a Llama-style model: long-context, hybrid-parallel, compressed"),
    "generate": ("loom.train.generate", "sample text from a trained checkpoint"),
    "plan": ("loom.multipath.cli", "plan multi-path routes for an all-to-all demand and compare baselines"),
    "testbed": ("loom.testbed.cli", "emulated multi-node, multi-rail cluster (needs root)"),
    "dask": ("loom.dask.cli", "run a Dask script over MPI (scheduler, client and workers as ranks)"),
}

def _inside_mpi() -> bool:
    """Whether this process is already a rank of an MPI job (a launcher's variables, or loom's own mark)."""
    from .comm import launch

    return launch.inside_job()


def relaunch(ranks: int, argv: list[str]) -> int:
    """Run ``loom argv`` on ``ranks`` local ranks with the bundled mpiexec; returns its exit code."""
    from .comm import launch

    env = {"LOOM_LAUNCHED": "1"}
    proc = launch.run(ranks, [sys.executable, "-m", "loom.cli", *argv], env=env)
    return proc.returncode


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: loom <command> [--ranks N] [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`loom <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"loom {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"loom: unknown command {name!r}; valid: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, _ = COMMANDS[name]
    if "--help" not in rest and "-h" not in rest:
        try:
            rest = _dispatch_ranks(name, _module(module_name), rest)
        except UsageError as exc:
            print(f"loom {name}: error: {exc}", file=sys.stderr)
            return 2
        if isinstance(rest, int):
            return rest
    try:
        return int(_module(module_name).main(rest) or 0)
    except SystemExit as exc:  # argparse's --help and usage errors: main() returns the exit code like the shell sees
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


def _dispatch_ranks(name: str, module, rest: list[str]) -> list[str] | int:
    """Handle ``--ranks``: relaunch on N ranks (an exit code), or the arguments left for the command."""
    if getattr(module, "OWN_RANKS", False):
        return rest  # the command's own parser reads --ranks
    ranks, rest_wo = pop_ranks(rest)
    if ranks is not None and not _inside_mpi() and getattr(module, "RELAUNCH", True):
        return relaunch(ranks, [name, *rest_wo])
    return rest_wo


def _module(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SystemExit(f"loom: command module {module_name} is not available in this build ({exc})") from exc
        raise


if __name__ == "__main__":
    sys.exit(main())
