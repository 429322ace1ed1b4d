"""The table of multi-rank check scripts: one line per script, with the rank counts it runs at.

``tests/integration/test_checks.py`` launches every (script, rank count > 1) once under ``mpiexec`` and asserts
that every ``check_*`` of the script reported ``PASS``; ``tests/unit/test_checks_one_rank.py`` runs the
one-rank count in-process, each check a test of its own. To add a script, write ``tests/mpi/check_NAME.py``
(``check_*(comm)`` functions ending in ``mpi_checks(globals())``) and add one line here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Checks:
    script: str
    ranks: tuple[int, ...]
    timeout: float = 180
    needs: str = ""  # a module the checks import (skipped when it is missing)
    only: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``((ranks, (check names)), ...)``: further rank counts that run only the named checks (a mesh that needs
    more ranks than the rest of the script: oversubscribed, for correctness only)."""


CHECKS = [
    Checks("tests/mpi/check_comm.py", (1, 2, 3, 4), timeout=240),
    Checks("tests/mpi/check_compress.py", (1, 2, 3, 4)),
    Checks("tests/mpi/check_multipath.py", (1, 2, 3, 4), timeout=150),
    Checks("tests/mpi/check_sequence.py", (1, 2, 3, 4), timeout=240),
    Checks("tests/mpi/check_hybrid.py", (1, 2, 4), timeout=400),
    Checks("tests/mpi/check_train.py", (2, 4), timeout=300),
    Checks("tests/mpi/check_devices.py", (1, 2), timeout=300),
    Checks("tests/mpi/check_dask.py", (2, 3), timeout=120, needs="distributed"),
    Checks("tests/mpi/check_data.py", (1, 2, 3, 4), timeout=240),
    Checks("tests/mpi/check_zero.py", (2, 3, 4), timeout=600,  # one rank: tests/unit/test_zero.py
           only=((8, ("check_train_zero_stages_2_3_match_one_rank",)),)),  # dp x pp x sp = 2 x 2 x 2
    Checks("tests/mpi/check_tensor.py", (1, 2, 3), timeout=400,  # dp/sp/pp x tp = 2 x 2, oversubscribed:
           only=((4, ("check_train_tp_matches_one_rank", "check_train_tp_resume_is_bit_exact",
                      "check_train_tp_packed_matches_one_rank")),)),
    Checks("tests/mpi/check_zero_deep.py", (2, 3, 4), timeout=400),  # one rank: tests/unit/test_zero.py
    Checks("tests/mpi/check_zero_habits.py", (1, 2, 3), timeout=300),  # BatchNorm needs 2 rows a micro-batch
    Checks("tests/mpi/check_hf.py", (1, 2, 4), timeout=400, needs="transformers"),
    Checks("tests/mpi/check_torchdist.py", (2, 4), timeout=240),  # the "loom" torch.distributed backend vs gloo
]

ELSEWHERE = {
    "tests/mpi/check_testbed.py": "runs on the emulated cluster (root): tests/integration/test_testbed_cluster.py",
    "tests/mpi/check_safety.py": "job-level failure scenarios, one launch each: tests/integration/test_comm_mpi.py",
    "tests/mpi/check_tags.py": "under forced tag ceilings (LOOM_TAG_UB): tests/integration/test_tag_ub.py",
    "tests/mpi/check_dask_client.py": "a Dask client script for loom dask run: tests/integration/test_dask.py",
}
"""Scripts under tests/mpi that are not check tables, and where they run."""
