"""The ``loom`` command: ``loom <command> [args]``.

Each command lives in its own module exposing ``main(argv: list[str]) -> int`` (and usually an argparse
parser); this file only dispatches, so ``loom --help`` stays fast and capabilities stay decoupled.

``--ranks N`` (any command that communicates): when not already inside an MPI job, loom re-launches itself
under the bundled ``mpiexec -n N``; inside a job (``mpiexec -n N loom ...``) the flag is ignored.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "COMMANDS"]

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
    """Already a rank of an MPI job (either MPI's launcher environment, or a loom launch)?"""
    from .comm import launch

    return launch.inside_job()


def pop_ranks(argv: list[str]) -> tuple[int | None, list[str]]:
    """Remove ``--ranks N`` / ``--ranks=N`` from argv; return (N or None, rest)."""
    out: list[str] = []
    ranks = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--ranks" and i + 1 < len(argv):
            ranks = argv[i + 1]
            i += 2
            continue
        if a.startswith("--ranks="):
            ranks = a.split("=", 1)[1]
            i += 1
            continue
        out.append(a)
        i += 1
    if ranks is None:
        return None, out
    try:
        n = int(ranks)
    except ValueError:
        raise SystemExit(f"loom: --ranks {ranks!r} is not an integer") from None
    if n < 1:
        raise SystemExit(f"loom: --ranks {n} must be >= 1")
    return n, out


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
        ranks, rest_wo = pop_ranks(rest)
        if ranks is not None and not _inside_mpi() and getattr(_module(module_name), "RELAUNCH", True):
            return relaunch(ranks, [name, *rest_wo])
        if ranks is not None:
            rest = rest_wo
    return int(_module(module_name).main(rest) or 0)


def _module(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise SystemExit(f"loom: command module {module_name} is not available in this build ({exc})") from exc
        raise


if __name__ == "__main__":
    sys.exit(main())
