"""``loom demo``: placeholder tour of the communication layer (replaced by the training demo)."""

from __future__ import annotations

RELAUNCH = True


def main(argv: list[str]) -> int:
    from .bench.comm import tour

    return tour(argv)
