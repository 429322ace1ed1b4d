"""The benchmark commands' name for :mod:`loom.comm.measure` (parser, size sweep, timing loop, OMB table, JSON)."""

from ..comm.measure import Table, iterations, machine_info, parse_size, parser, pingpong, sizes, time_op

__all__ = ["parser", "parse_size", "sizes", "iterations", "time_op", "pingpong", "Table", "machine_info"]
