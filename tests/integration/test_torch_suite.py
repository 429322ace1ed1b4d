"""torch's own distributed suite (``DistributedTest._DistTestBase``) on loom, gloo the reference of the same run.

``tests/mpi/torch_suite.py`` runs each test on gloo, then on loom, in long-lived ranks (its docstring says how
that mirrors torch's spawn runner). :func:`run_suite` launches it, and launches it again after the test that
crashed or hung (recorded as ``crash``/``hang``), until every test has a result on both backends.

The claim checked here: **wherever gloo passes, loom passes** (a test gloo fails or skips asks nothing of
loom), except the tests listed in :data:`KNOWN` with the reason. ``make test`` runs a representative subset at 2
ranks (:data:`SUBSET`); the whole class at 2 ranks and the group tests at 3 run in CI (``make test-torch-suite``,
``python tests/integration/test_torch_suite.py --world-size 2`` prints the README's table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from loom.comm import launch
from loom.testing import ROOT

RANK_SIDE = ROOT / "tests" / "mpi" / "torch_suite.py"

#: Tests gloo passes and loom does not, and why (the README lists them).
KNOWN = {
    "test_get_backend": "the suite runs gated as gloo (BACKEND=gloo) and compares get_backend() with it; loom's "
                        "groups say 'loom'",
    "test_monitored_barrier_allreduce_hang": "monitored_barrier: torch refuses it for every backend but gloo",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "monitored_barrier (as above)",
    "test_monitored_barrier_failure_order": "monitored_barrier (as above)",
    "test_monitored_barrier_gloo": "monitored_barrier (as above)",
    "test_monitored_barrier_gloo_rank_0_timeout": "monitored_barrier (as above)",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier (as above)",
    "test_monitored_barrier_wait_all_ranks": "monitored_barrier (as above)",
    "test_ddp_model_diff_shape_across_ranks": "monitored_barrier (DDP's debug check calls it)",
    "test_ddp_model_diff_num_params_across_ranks": "monitored_barrier (DDP's debug check calls it)",
}

#: The representative subset ``make test`` runs: collectives of every kind, groups, timeouts, sparse, DDP.
SUBSET = ("^test_(all_reduce_sum|all_reduce_max|all_reduce_coalesced_sum|all_gather$|all_gather_coalesced_simple"
          "|all_gather_into_tensor_basic|all_to_all_single_equal_split|all_to_all_single_unequal_split"
          "|reduce_scatter_tensor|broadcast$|gather$|scatter$|send_recv$|isend$|irecv$|barrier$"
          "|barrier_timeout_global|barrier_timeout_full_group|sparse_all_reduce_sum$|new_subgroups$"
          "|batch_isend_irecv_gloo$|all_gather_object_default_pg|broadcast_object_list"
          "|DistributedDataParallel$|ddp_sync_bn_training_vs_input_dim_not_match|ddp_uneven_inputs$"
          "|ddp_grad_div_uneven_inputs|post_localSGD_optimizer_parity$|ddp_comm_hook_logging"
          "|ddp_control_flow_same_across_ranks|sparse_all_reduce_sum$)")


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_suite(world_size: int, only: str = "", timeout: float = 240, launches: int = 40,
              small_world: bool = False) -> dict:
    """``{(test, backend): (status, message)}`` for every selected test on gloo and loom (module plan)."""
    with tempfile.TemporaryDirectory(prefix="loom-torch-suite-") as tmp:
        results = Path(tmp) / "results.jsonl"
        for _ in range(launches):
            rows = _read(results)
            done = {(r["test"], r["backend"]) for r in rows if r["status"] != "started"}
            started = [(r["test"], r["backend"]) for r in rows if r["status"] == "started"]
            if started and started[-1] not in done:  # the job ended inside this one: it crashed
                with results.open("a") as f:
                    f.write(json.dumps({"test": started[-1][0], "backend": started[-1][1], "status": "crash",
                                        "msg": "the ranks exited inside this test"}) + "\n")
                continue
            argv = [sys.executable, str(RANK_SIDE), "--results", str(results), "--temp-dir", tmp,
                    "--timeout", str(timeout), "--skip", ",".join(f"{t}/{b}" for t, b in done)]
            if only:
                argv += ["--only", only]
            if small_world:
                argv += ["--small-world"]
            env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            proc = launch.run(world_size, argv, timeout=None, env=env, capture=True)
            if proc.returncode == 0:
                break
        rows = _read(results)
    return {(r["test"], r["backend"]): (r["status"], r.get("msg", "")) for r in rows if r["status"] != "started"}


def compare(results: dict) -> tuple[Counter, list[tuple[str, str, str]]]:
    """Counts of each status per backend, and every test gloo passes that loom does not: (test, status, why)."""
    counts: Counter = Counter()
    missing = []
    for (test, backend), (status, _msg) in sorted(results.items()):
        counts[backend, status] += 1
        if backend == "gloo" and status == "pass":
            got, why = results.get((test, "loom"), ("missing", ""))
            if got != "pass":
                last = why.strip().splitlines()[-1] if why.strip() else got
                missing.append((test, got, KNOWN.get(test, last)))
    return counts, missing


def _unexpected(missing: list[tuple[str, str, str]]) -> list[str]:
    return [f"{t}: {status}: {why}" for t, status, why in missing if t not in KNOWN]


@pytest.mark.mpi
def test_torch_suite_subset_passes_on_loom_wherever_it_passes_on_gloo():
    results = run_suite(2, SUBSET)
    counts, missing = compare(results)
    assert counts["gloo", "pass"] >= 25, counts  # the subset ran: a selection that matched nothing proves nothing
    assert not _unexpected(missing), "\n".join(_unexpected(missing))


#: tests run through torch's own spawn runner on loom (fresh processes per test: a world formed through the store)
SPAWNED = ("test_all_reduce_sum", "test_broadcast", "test_all_gather_coalesced_simple", "test_sparse_all_reduce_sum",
           "test_barrier")


def test_torch_own_spawn_runner_passes_on_loom():
    """torch's ``TestDistBackend`` runner, as torch's CI runs it (a subprocess of pytest per test pair)."""
    env = {**os.environ, "SUITE_BACKEND": "loom", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("BACKEND", "WORLD_SIZE", "TEMP_DIR", "LOOM_LAUNCHED"):
        env.pop(key, None)
    module = ROOT / "tests" / "mpi" / "torch_suite_spawn.py"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
            *(f"{module}::TestSpawned::{t}" for t in SPAWNED)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"{len(SPAWNED)} passed" in out, out[-4000:]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="torch's distributed suite on gloo and loom, one run; the README table")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--only", default="", help="regular expression over test names")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--small-world", action="store_true",
                   help="only the tests torch runs from 8 ranks (the group tests), gate opened: use at 3 ranks")
    ns = p.parse_args(argv)
    results = run_suite(ns.world_size, ns.only, small_world=ns.small_world)
    counts, missing = compare(results)
    if ns.json:
        Path(ns.json).write_text(json.dumps({f"{t}/{b}": v for (t, b), v in results.items()}, indent=1))
    what = "the group tests, " if ns.small_world else ""
    print(f"| {what}world size {ns.world_size} | pass | fail | skip | hang | crash |")
    print("|---|---|---|---|---|---|")
    for backend in ("gloo", "loom"):
        print(f"| {backend} | " + " | ".join(str(counts[backend, s]) for s in ("pass", "fail", "skip", "hang", "crash"))
              + " |")
    for test, status, why in missing:
        print(f"- `{test}` ({status}): {' '.join(why.split())[:200]}")
    return 1 if _unexpected(missing) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
