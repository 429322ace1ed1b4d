"""The emulated cluster end to end: real MPI ranks over rate-limited veth links (needs root, ip and tc).

One launch per topology runs every check of tests/mpi/check_testbed.py (placement, exact collectives, which
links carry the bytes, and the issue's rate criteria: 200 Mbit/s within +-20 %, two rails ~2x one rail; at
200 Mbit/s the links, not the 2-core CPU, are the bottleneck). Then teardown on timeout, exception and signals.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from loom.comm import launch
from loom.testbed import Testbed, TestbedUnavailable, leftovers, preflight

try:
    if launch.flavor() != launch.MPICH:  # the testbed steers MPICH's netmod (FI_TCP_IFACE, MPIR_CVAR_*)
        raise TestbedUnavailable(f"the testbed runs MPICH only; this launcher is {launch.flavor()}'s")
    preflight(probe=True)
    _SKIP = ""
except TestbedUnavailable as exc:
    _SKIP = str(exc)

pytestmark = [pytest.mark.root, pytest.mark.mpi,
              pytest.mark.skipif(bool(_SKIP), reason=f"testbed unavailable here: {_SKIP}")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKS = os.path.join(ROOT, "tests", "mpi", "check_testbed.py")


def _no_trace(prefix):
    """No namespace and no process of the testbed with this prefix is left."""
    assert not leftovers(prefix), leftovers(prefix)
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert prefix not in ps, [line for line in ps.splitlines() if prefix in line]


@pytest.mark.parametrize("nodes,per,rails", [(2, 1, 1), (2, 2, 2)], ids=["2x1-1rail", "2x2-2rails"])
def test_checks_on_testbed(nodes, per, rails):
    with Testbed(nodes=nodes, ranks_per_node=per, rails=rails, rail_gbit=0.2, intra_gbit=1) as tb:
        proc = tb.run([sys.executable, CHECKS], timeout=150, capture=True)
        prefix = tb.prefix
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.stdout.count("PASS ") == 9, proc.stdout
    _no_trace(prefix)


def test_teardown_after_timeout_and_exception():
    tb = Testbed(nodes=2, ranks_per_node=1, rails=1, rail_gbit=0.2, settle=0.5)
    with pytest.raises(RuntimeError, match="boom"):
        with tb:
            assert len(leftovers(tb.prefix)) == 3  # switch + 2 ranks
            with pytest.raises(subprocess.TimeoutExpired):
                tb.run(["sleep", "60"], timeout=2)
            assert tb.processes() == []  # the timed-out job is gone before teardown
            raise RuntimeError("boom")
    _no_trace(tb.prefix)
    tb.teardown()  # idempotent


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_tears_down_on_signal(sig):
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", "testbed", "run", "--settle", "0.2", "--", "sleep",
                             "60"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    prefix = f"loomtb-{proc.pid}-"
    running = False
    deadline = time.monotonic() + 30
    while not running and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        names = leftovers(prefix)
        running = any(subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.strip()
                      for n in names if n.endswith("-r1"))
    assert running and proc.poll() is None, proc.communicate(timeout=30) if proc.poll() is not None else "no ranks"
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, (out, err)  # 130 / 143: interrupted, then torn down
    _no_trace(prefix)


# The halved rail loses traffic within this many steps (measured calls) of the change, and regains it within
# this many of the restore (each sample moves the estimate past the re-plan threshold; the plan follows one call
# later, and the estimate needs a few samples to settle).
DEGRADE_WITHIN = 3


def test_halved_rail_sheds_traffic_and_regains_it(tmp_path):
    """`loom bench multipath --degrade 0:0.5` on the 2 x 2 testbed: rail 0's tc rate is halved for the middle
    phase; the monitored plan's share of the rail bytes on rail 0 drops from the even split toward the
    optimum 1/3, and returns when the rate does (asserted on the plans, never on times)."""
    out = tmp_path / "degrade.json"
    n = 6
    with Testbed(nodes=2, ranks_per_node=2, rails=2, rail_gbit=0.2, intra_gbit=1) as tb:
        proc = tb.run([sys.executable, "-m", "loom.cli", "bench", "multipath", "--degrade", "0:0.5", "--steps",
                       str(n), "-m", "1M", "--skew", "hot-pair", "--json", str(out)], timeout=300, capture=True)
        prefix = tb.prefix
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    share = [r["share"] for r in json.loads(out.read_text())["meta"]["trace"]]
    before, during, after = share[:n], share[n:2 * n], share[2 * n:]
    assert all(0.45 <= s <= 0.55 for s in before), before
    assert all(s <= 0.42 for s in during[DEGRADE_WITHIN:]), during
    assert all(s >= 0.44 for s in after[DEGRADE_WITHIN + 1:]), after
    _no_trace(prefix)
