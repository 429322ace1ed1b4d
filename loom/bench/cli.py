"""Dispatch ``loom bench NAME [args]`` to the registered benchmark."""

from __future__ import annotations

import importlib
import sys

from . import BENCHMARKS

RELAUNCH = True


def _usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: loom bench <name> [--ranks N] [options]", "", "benchmarks:"]
    lines += [f"  {k:<{width}}  {d}" for k, (_, _, d) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"loom bench: unknown benchmark {name!r}; valid: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module, attr, _ = BENCHMARKS[name]
    return int(getattr(importlib.import_module(module), attr)(argv[1:]) or 0)
