"""One CLI vocabulary: every ``loom ... --help`` is argparse and renders, a short flag means one thing in every
command (:data:`loom.cli_args.SHORT`), every usage error exits 2 with one line and no traceback, ``--ranks``
is read one way, and the mesh fills ``dp``."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from loom import cli, cli_args
from loom.bench import BENCHMARKS

HELP = [[], ["demo"], ["bench"], *(["bench", name] for name in BENCHMARKS), ["train"], ["generate"], ["plan"],
        ["testbed"], *(["testbed", sub] for sub in ("run", "check", "show", "clean")), ["dask"], ["dask", "run"]]


LAUNCHES = ("demo", "bench", "train", "dask")
"""The commands loom runs on --ranks N local ranks (plan, generate and testbed run one process; ``loom dask``
lists its subcommand, whose help has the flag)."""


@pytest.fixture(autouse=True)
def _outside_mpi(monkeypatch):
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "LOOM_LAUNCHED"):
        monkeypatch.delenv(var, raising=False)


def _loom(argv: list[str]) -> tuple[int, str, str]:
    """``loom argv`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(argv))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "loom")
def test_every_help_renders_and_short_flags_mean_one_thing(argv, monkeypatch):
    seen: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_known_args

    def spy(self, *args, **kwargs):
        seen.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", spy)
    rc, out, err = _loom([*argv, "--help"])
    assert rc == 0, err
    assert out.startswith("usage: loom"), out[:200]
    assert "``" not in out, out  # docstring markup reads as plain `name`
    if argv and argv[0] in LAUNCHES and argv != ["dask"]:  # a command that runs on ranks says how to ask for them
        assert "--ranks" in out, out
    if argv:  # the root dispatcher has its own listing; every command below it is argparse
        assert seen and all(isinstance(p, cli_args.ArgumentParser) for p in seen), [p.prog for p in seen]
    for p in seen:
        for action in p._actions:
            for opt in action.option_strings:
                if len(opt) == 2 and opt[1] != "-":
                    assert opt in cli_args.SHORT, f"{p.prog}: short flag {opt} is not in loom.cli_args.SHORT"
                    assert cli_args.SHORT[opt] in action.option_strings, \
                        f"{p.prog}: {opt} means {action.option_strings}, elsewhere {cli_args.SHORT[opt]}"
            if "--json" in action.option_strings:
                assert action.nargs is None and action.metavar == "PATH", f"{p.prog}: --json takes a PATH"


@pytest.mark.parametrize("argv, words", [
    (["train", "--ranks", "0"], "--ranks 0 must be >= 1"),
    (["bench", "latency", "-n", "two"], "--ranks 'two' is not an integer"),
    (["train", "--dry-run", "--compress.policy=foo"], "compress.policy = 'foo'"),
    (["train", "--dry-run", "--model.hiden=3"], "unknown key model.hiden"),
    (["plan", "--nodes", "x"], "argument -N/--nodes: invalid int value"),
    (["plan", "--skew", "lopsided"], "lopsided"),
    (["bench", "latency", "-M", "lots"], "size 'lots' is not a byte count"),
    (["bench", "compress", "--codec", "int8", "-m", "64K", "-M", "8K"], "--max-size 8192 is below --min-size 65536"),
    (["bench", "allreduce", "--codec", "int8"], "unrecognized arguments: --codec int8"),
    (["bench", "nope"], "invalid choice: 'nope'"),
    (["generate"], "the following arguments are required: --checkpoint"),
    (["generate", "--checkpoint", "x", "--tokens", "-5"], "--tokens -5 must be >= 1"),
    (["generate", "--checkpoint", "x", "--top-k", "-1"], "--top-k -1 must be >= 0 (0 = all bytes)"),
    (["testbed", "show", "-N", "x"], "invalid int value"),
    (["dask", "run"], "without a client script the cluster serves outside clients: give --tcp HOST:PORT"),
    (["dask", "run", "--ranks", "0", "x.py"], "--ranks 0 must be >= 1"),
    (["demo", "--ranks"], "--ranks needs a value"),
    (["nosuch"], "unknown command 'nosuch'"),
])
def test_usage_errors_exit_2_with_one_line(argv, words):
    rc, out, err = _loom(argv)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    assert err.count("\n") == 1 and words in err, err


def test_pop_ranks_reads_one_spelling_and_leaves_a_job_command_alone():
    assert cli_args.pop_ranks(["-n", "3", "-M", "1M"]) == (3, ["-M", "1M"])
    assert cli_args.pop_ranks(["--ranks=2", "--", "cmd", "-n", "5"]) == (2, ["--", "cmd", "-n", "5"])
    with pytest.raises(cli_args.UsageError, match="--ranks 0 must be >= 1"):
        cli_args.pop_ranks(["--ranks", "0"])


@pytest.mark.parametrize("size, extra, mesh", [
    (2, [], "dp=2 pp=1 sp=1 ep=1 = 2 ranks"),
    (4, ["--mesh.sp=2"], "dp=2 pp=1 sp=2 ep=1 = 4 ranks"),
])
def test_the_mesh_fills_dp(monkeypatch, tmp_path, size, extra, mesh):
    monkeypatch.setenv("PMI_SIZE", str(size))
    monkeypatch.setenv("PMI_RANK", "0")
    rc, out, err = _loom(["train", "--dry-run", f"--train.out={tmp_path}", "--data.max_bytes=20000", *extra])
    assert rc == 0, err
    assert mesh in out, out


def test_an_explicit_mesh_is_not_filled(monkeypatch, tmp_path):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setenv("PMI_RANK", "0")  # a launcher sets both; loom.settings.launch_info reads them together
    rc, _, err = _loom(["train", "--dry-run", f"--train.out={tmp_path}", "--mesh.dp=1"])
    assert rc == 2 and "= 1 ranks but the job has 2" in err, err
    rc, _, err = _loom(["train", "--dry-run", f"--train.out={tmp_path}", "--mesh.sp=4"])
    assert rc == 2 and "which mesh.pp=1 x mesh.sp=4 x mesh.ep=1 = 4 does not divide" in err, err
    # A mesh of the wrong size is named as such, before the batch it also fails to divide.
    rc, _, err = _loom(["train", "--dry-run", f"--train.out={tmp_path}", "--mesh.dp=3"])
    assert rc == 2 and "mesh dp=3 x pp=1 x sp=1 x ep=1 = 3 ranks but the job has 2; launch with --ranks 3" in err, err


# A rank's command stopped by a signal: whatever the signal's KeyboardInterrupt meets on its way, the rank ends with
# 128 + signal and no traceback. Each case is a command module run by cli._run in a process of its own (a rank of
# a loom launch: LOOM_LAUNCHED=1, so the launcher's line is not printed here), and a Ctrl-C lost in a finalizer
# is also raised again for a command outside a job.
_STOP_CASES = '''
import signal, threading, time


class _Late:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # the signal lands in a finalizer, where Python only reports it


def main(rest):
    case = rest[0]
    if case == "finalizer":
        _Late()
        end = time.monotonic() + 30  # never reached with the interrupt raised again; the test then fails
        while time.monotonic() < end:
            pass
        return 0
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        if case == "converted":  # a collective whose peer left raises MPI's error while the rank unwinds
            raise RuntimeError("a peer left mid-collective") from None
        from loom.comm import safety

        safety._install_abort_hooks()  # what a multi-rank job has: an error in a thread aborts the job
        t = threading.Thread(target=lambda: 1 / 0, name="worker")
        t.start()
        t.join()
        raise
    return 0
'''


@pytest.mark.parametrize("case, rank", [("finalizer", True), ("converted", True), ("thread", True),
                                        ("finalizer", False)])
def test_a_stopped_rank_ends_with_the_signal_and_no_traceback(tmp_path, case, rank):
    import os
    import subprocess
    import sys

    from loom.testing import ROOT

    (tmp_path / "stopcase.py").write_text(_STOP_CASES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    if rank:
        env["LOOM_LAUNCHED"] = "1"  # else a command outside a job, with Python's own SIGINT handler
    code = "import sys; from loom import cli; sys.exit(cli._run('train', 'stopcase', sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, case], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
