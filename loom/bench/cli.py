"""Dispatch ``loom bench NAME [args]`` to the registered benchmark."""

from __future__ import annotations

import importlib

from .. import cli_args
from . import BENCHMARKS

RELAUNCH = True


def parser() -> cli_args.ArgumentParser:
    width = max(map(len, BENCHMARKS))
    p = cli_args.ArgumentParser(
        prog="loom bench", usage="loom bench NAME [--ranks N] [options]",
        description="OMB-style communication benchmarks and application benchmarks; the peer runs in the same "
                    "invocation and the table shows the ratio.",
        epilog="benchmarks:\n" + "\n".join(f"  {k:<{width}}  {d}" for k, (_, _, d) in BENCHMARKS.items())
               + "\n\n`loom bench NAME --help` shows a benchmark's options.")
    p.add_argument("name", metavar="NAME", choices=list(BENCHMARKS), help="the benchmark (listed below)")
    return p


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        parser().parse_args(argv[:1])  # --help, or a one-line error naming the valid benchmarks (exit 2)
    module, attr, _ = BENCHMARKS[argv[0]]
    return int(getattr(importlib.import_module(module), attr)(argv[1:]) or 0)
