"""The GPU session: every figure loom's CUDA work exists for, in one ten-minute device command.

    bash scripts/gpu_session.sh                 # on the GPU machine: runs this file with its python3
    python scripts/gpu_session.py --dry-run     # the plan: steps, limits, commands; runs nothing
    python scripts/gpu_session.py --rehearse    # every step on this machine, CUDA replaced by the CPU, sizes shrunk
    python scripts/gpu_session.py --only seqlen-p2,zero-cuda    # or --skip a,b

Plan. The steps run in order of value, each under its own time limit, and the planned steps' limits add up to
at most ``TOTAL`` (540 s) by construction (``tests/unit/test_gpu_session.py`` checks it), so none of them is
ever skipped for lack of time: the 64 MiB allreduce of CUDA tensors against host tensors (fp32, then bf16),
FPDT's CUDA kernel tests, ``loom train`` on CUDA against its CPU run for every mesh (one summary line per
mesh; a failing mesh does not stop the others), ``loom bench seqlen`` at 2 ranks then 1 (its search capped at
17x Ulysses' length), ZeRO's capacity on the CUDA allocator and ``scripts/gpu_check.py``. Whatever time the
planned steps leave goes to the extra steps, in order, each capped: the rest of the GPU tier, the bf16
alltoall, ``scripts/seqlen_cuda.py`` (MFU, offload overlap) and the CPU timings of the peers.

Each step's output goes to ``OUT/<step>.log``; when it ends it appends one line to ``OUT/summary.tsv`` (step,
status, seconds, limit, its key figure): ``ok``, ``fail``, ``timeout`` (stopped at its limit: SIGINT first,
so the benchmarks and pytest still write what they have, then SIGKILL of every process it started) or
``skip`` (the reason: a module the step needs is missing, no CUDA device, no time left). The benchmarks
write ``OUT/<step>.json``; ``loom bench seqlen`` rewrites its JSON after every probe, so a step stopped at its
limit still leaves the longest lengths found; the pytest steps write ``OUT/<step>.xml`` (JUnit), and a failed
multi-rank test keeps its ranks' output in it and in the log.

Missing modules are skips: the ``prepare`` step (``scripts/prepare_gpu.sh``) installs the carried wheels and
imports every module a step needs (``NEEDS``; ``--imports`` runs that check alone), and a step whose modules
are missing is reported as a skip naming them, as is a step that fails on a ``ModuleNotFoundError``.
``--hide a,b`` makes modules unimportable for the whole session (the rehearsal's test of that path).

Environment: ``OUT`` (default ``./gpu-out``), ``TOTAL`` (540), ``PY`` (the python of the steps, default this
one), and ``<STEP>_S`` to change one step's limit (``SEQLEN_P2_S=150``; the step name upper-cased, ``-`` as
``_``). Needs only the standard library until ``prepare`` has run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from loom.comm import launch  # noqa: E402  (stdlib-only at import: the session starts before prepare)

TOTAL = 540
"""Seconds for the whole session: a 570 s device command less 30 s for the machine's own start."""
MIN_S = 10
"""An extra step starts only with at least this many seconds left."""
GRACE_S = 8
"""A step at its limit gets SIGINT this many seconds before it (a quarter of a shorter limit), SIGKILL at it: no
step outlives its limit."""
MESH_S = 40
"""The longest one mesh of the ``train`` step may go without reporting (the first includes the ranks' start)."""

NEEDS = {
    "core": ("torch", "numpy", "mpi4py"),
    "test": ("pytest",),
    "dask": ("distributed", "msgpack"),
    "multipath": ("numba",),
    "optional": ("pytest_timeout", "transformers", "scipy", "zstandard"),
}
"""Every module the session imports, by what needs it (``prepare`` and ``--imports`` report the missing ones)."""

LAUNCH = ("import sys\nfrom loom.comm import launch\ntry:\n"
          "    sys.exit(launch.run(int(sys.argv[1]), sys.argv[2:]).returncode)\n"
          "except launch.Interrupted:\n    sys.exit(130)\n")
"""``python -c LAUNCH N argv...``: a script on N ranks through loom's launcher (which stops the ranks on SIGINT)."""

VERSIONS = '''
import os, platform, subprocess, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
import mpi4py
from mpi4py import MPI
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0].strip())
print("CUDA-aware MPI:", getattr(MPI, "Query_cuda_support", lambda: "unknown")())
print("cpus", os.cpu_count(), "| LOOM_MPIEXEC", os.environ.get("LOOM_MPIEXEC"))
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=5).stdout)
except (OSError, subprocess.SubprocessError) as e:
    print("nvidia-smi:", e)
'''


@dataclass
class Step:
    """One step of the session: ``argv`` runs under ``limit`` seconds; ``figure(ctx, log)`` is its key figure."""

    name: str
    limit: int
    argv: list[str]
    figure: Callable[["Ctx", str], str]
    needs: tuple[str, ...] = ("core",)
    extra: bool = False
    """Runs only with time left over from the planned steps (not in their sum)."""
    meshes: list[str] = field(default_factory=list)
    """The ``train`` step: one summary line per mesh, a job restarted without the meshes already reported."""


@dataclass
class Ctx:
    py: str
    out: Path
    rehearse: bool
    env: dict[str, str]
    missing: dict[str, str] = field(default_factory=dict)
    summary: Path | None = None

    def json(self, step: str) -> Path:
        return self.out / f"{step}.json"


# ---------------------------------------------------------------------------------------------------- figures
class Skip(str):
    """A key figure that makes a step which exited 0 a skip (a pytest step whose tests were all skipped)."""


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _from_json(read: Callable[[dict], str]) -> Callable[[str], Callable[[Ctx, str], str]]:
    """``read(doc)`` as the figure of the step whose JSON is ``OUT/<name>.json``."""
    def make(name: str) -> Callable[[Ctx, str], str]:
        def figure(ctx: Ctx, log: str) -> str:
            doc = _load(ctx.json(name))
            return read(doc) if doc else "no JSON written"
        return figure
    return make


@_from_json
def _allreduce_figure(doc: dict) -> str:
    if not doc.get("rows"):
        return "no rows"
    row = doc["rows"][-1]
    dev, host, ratio = (row[c] for c in doc["columns"][1:4])
    return (f"{row['Size'] / 2**20:g} MiB {doc['meta'].get('dtype')}: {doc['meta'].get('device')} "
            f"{dev / 1e3:.2f} ms, host {host / 1e3:.2f} ms, ratio {ratio:.2f}")


def _junit_figure(name: str):
    def figure(ctx: Ctx, log: str) -> str:
        try:
            root = ET.parse(ctx.out / f"{name}.xml").getroot()
        except (OSError, ET.ParseError):
            tail = [ln for ln in log.splitlines() if ln.strip()]
            return f"no JUnit; last line: {tail[-1][:150] if tail else '-'}"
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        failed = [c.get("name") for c in suite.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        if not n["tests"]:
            return "no test finished"
        passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
        text = (f"{passed} passed, {n['failures'] + n['errors']} failed, {n['skipped']} skipped"
                + (f": {', '.join(failed)[:200]}" if failed else ""))
        if not passed and not failed:
            reasons = {sk.get("message", "") for sk in suite.iter("skipped")}
            return Skip(f"{text} ({'; '.join(sorted(reasons))[:150]})")
        return text
    return figure


@_from_json
def _seqlen_figure(doc: dict) -> str:
    meta = doc["meta"]
    if meta.get("partial", True):
        found = "; ".join(f"{st}: fits {p['longest_fit']} ({len(p['peaks'])} probes)"
                          for st, p in meta.get("probes", {}).items())
        return f"partial: {found or 'no probe finished'}"
    res, times = meta["results"], meta.get("times", {})
    (uly, u), (fp, f) = list(res.items())[0], list(res.items())[-1]
    thr = f", throughput {times[uly] / times[fp]:.2f}x Ulysses" if uly in times and fp in times else ""
    return f"Ulysses {u['max_seq']}, FPDT {f['max_seq']}: {meta['ratio']:.1f}x{thr} (cap {meta.get('search_cap')})"


@_from_json
def _zero_figure(doc: dict) -> str:
    if "capacity" in doc:
        res = doc["capacity"]["results"]
        dp, s3 = res["dp (stage 0)"]["params"], res["stage 3"]["params"]
        return f"stage 3 fits {s3 / dp:.2f}x dp's parameters ({s3 / 1e6:.1f}M vs {dp / 1e6:.1f}M)"
    rows = [t[0] for t in (doc.get("fsdp2"), doc.get("ddp")) if t]  # loom's first row, its ratio to the peer
    return "; ".join(f"{r['Mode']} {list(r.values())[-1]:.2f}x {list(r)[-1]}" for r in rows) or "no tables"


def _table_figure(name: str):
    """A benchmark table's first two columns, row by row (``bench parallel``: ms per step of each mesh)."""
    def figure(ctx: Ctx, log: str) -> str:
        rows = [ln.split()[:2] for ln in log.splitlines() if ln.strip() and not ln.startswith(("#", "=="))]
        return "; ".join(" ".join(r) for r in rows)[:250] or "no table"
    return figure


def _lines_figure(prefix: str | tuple[str, ...], what: str):
    def figure(ctx: Ctx, log: str) -> str:
        found = [ln for ln in log.splitlines() if ln.startswith(prefix)]
        return "; ".join(found)[:300] if found else what
    return figure


def _versions_figure(ctx: Ctx, log: str) -> str:
    keep = [ln for ln in log.splitlines() if ln.startswith(("torch ", "cuda:", "mpi4py ", "CUDA-aware"))]
    return "; ".join(keep)[:300] or "no versions"


def _check_figure(ctx: Ctx, log: str) -> str:
    passed = [ln for ln in log.splitlines() if ln.startswith("PASS ")]
    skipped = [ln[5:] for ln in log.splitlines() if ln.startswith("SKIP ")]
    return f"{len(passed)} pass, {len(skipped)} skip" + (f" ({'; '.join(skipped)[:200]})" if skipped else "")


# ------------------------------------------------------------------------------------------------------- plan
def plan(ctx: Ctx) -> list[Step]:
    """The session's steps in order; ``ctx.rehearse`` swaps CUDA for the CPU and shrinks every size."""
    py, out, r = ctx.py, ctx.out, ctx.rehearse
    dev = "cpu" if r else "cuda"
    loom = [py, "-m", "loom.cli"]

    def ranks(n: int, *argv: str) -> list[str]:
        return [py, "-c", LAUNCH, str(n), py, *argv]

    def pytest(name: str, *argv: str) -> list[str]:
        return [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=0",
                f"--junitxml={out / (name + '.xml')}", "-o", "junit_logging=all", *argv]

    def allreduce(name: str, dtype: str) -> list[str]:
        size = ["-m", "1M", "-M", "1M", "--rounds", "1", "--iterations-large", "5", "--warmup-large", "1"] if r else \
               ["-m", "64M", "-M", "64M", "--rounds", "2", "--iterations-large", "10", "--warmup-large", "2"]
        return [*loom, "bench", "allreduce", "--ranks", "2", "--device", dev, "--dtype", dtype, *size,
                "--max-seconds", "5", "--json", str(ctx.json(name))]

    # FPDT against Ulysses, bf16, 6 GiB per rank: the search stops at 17x Ulysses' length (the goal is 16x),
    # where a search to the budget would climb 4x per probe toward a million tokens.
    seqlen = (["--budget", "2560K", "--max-ratio", "17", "--repeats", "1", "-v"] if r else
              ["--layers", "4", "--hidden", "1024", "--heads", "16", "--kv-heads", "8", "--vocab", "32000",
               "--budget", "6G", "--dtype", "bfloat16", "--chunk", "1024", "--attn-chunk", "2048", "--max-ratio", "17",
               "--repeats", "2", "-v"])
    # The rehearsal's 1-rank search runs every row to the budget and gets a limit far below what that takes:
    # it is stopped at its limit, and its JSON must still hold the lengths found (the rehearsal's test).
    p1 = ["--budget", "8M", "--max-seq", str(1 << 20), "--repeats", "1", "-v"] if r else [*seqlen, "--no-breakdown"]
    zero = (["--ranks", "2", "--device", dev, "--skip", "peers", "--budget", "16M", "--width", "128"] if r else
            ["--ranks", "4", "--device", dev, "--skip", "peers", "--budget", "1G", "--width", "1024"])
    peers = ["-i", "2", "-x", "1", "--rounds", "1", "--peer-width", "128", "--peer-depth", "4"] if r else \
            ["--rounds", "2"]
    return [
        Step("prepare", 60, ["bash", "scripts/prepare_gpu.sh", *(["--check"] if r else [])],
             _lines_figure("imports:", "no import check"), needs=()),
        Step("versions", 15, [py, "-c", VERSIONS], _versions_figure),
        Step("allreduce-fp32", 30, allreduce("allreduce-fp32", "float32"), _allreduce_figure("allreduce-fp32")),
        Step("allreduce-bf16", 30, allreduce("allreduce-bf16", "bfloat16"), _allreduce_figure("allreduce-bf16")),
        Step("test-fpdt", 45, pytest("test-fpdt", "tests/gpu/test_fpdt_cuda.py"), _junit_figure("test-fpdt"),
             needs=("core", "test")),
        Step("train", 120, ranks(2, "tests/gpu/check_train_cuda.py", "--device", dev), lambda c, log: "",
             needs=("core", "test"), meshes=list(_train_meshes())),
        Step("seqlen-p2", 100, [*loom, "bench", "seqlen", "--ranks", "2", *seqlen, "--no-breakdown", "--json",
                                str(ctx.json("seqlen-p2"))], _seqlen_figure("seqlen-p2")),
        Step("seqlen-p1", 15 if r else 70, [*loom, "bench", "seqlen", *p1, "--json", str(ctx.json("seqlen-p1"))],
             _seqlen_figure("seqlen-p1")),
        Step("zero-cuda", 50, [*loom, "bench", "zero", *zero, "--json", str(ctx.json("zero-cuda"))],
             _zero_figure("zero-cuda")),
        Step("gpu-check", 20, [py, "scripts/gpu_check.py"], _check_figure),
        # Extras, with the time the planned steps left.
        Step("test-gpu", 180, pytest("test-gpu", "tests/gpu", "--ignore=tests/gpu/test_fpdt_cuda.py", "-k",
                                     "not meshes and not capacity and not gpu_check"),
             _junit_figure("test-gpu"), needs=("core", "test"), extra=True),
        Step("alltoall-bf16", 30, [*loom, "bench", "alltoall", "--ranks", "2", "--device", dev, "--dtype", "bfloat16",
                                   *(["-m", "1M", "-M", "1M", "--rounds", "1"] if r else ["-m", "32M", "-M", "32M"]),
                                   "--iterations-large", "5" if r else "20", "--max-seconds", "5", "--json",
                                   str(ctx.json("alltoall-bf16"))], _allreduce_figure("alltoall-bf16"), extra=True),
        Step("seqlen-cuda", 150, [py, "scripts/seqlen_cuda.py", "--layers", "20", "--hidden", "2048", "--heads", "16",
                                  "--kv-heads", "4", "--vocab", "64000", "--budget", "100G", "--chunk", "8192",
                                  "--attn-chunk", "32768", "--no-breakdown", "--repeats", "1", "--peak-tflops", "989",
                                  "--max-seq", "131072", "--json", str(ctx.json("seqlen-cuda"))],
             _lines_figure(("# FPDT at", "# offload overlap"), "no figure"), extra=True),
        Step("zero-r2", 60, [*loom, "bench", "zero", "--ranks", "2", "--skip", "capacity", *peers, "--json",
                             str(ctx.json("zero-r2"))], _zero_figure("zero-r2"), extra=True),
        Step("zero-r4", 60, [*loom, "bench", "zero", "--ranks", "2" if r else "4", "--peer-ranks", "2" if r else "4",
                             "--skip", "capacity", *peers, "--json", str(ctx.json("zero-r4"))],
             _zero_figure("zero-r4"), extra=True),
        Step("parallel-r4", 60, [*loom, "bench", "parallel", "--ranks", "2" if r else "4",
                                 *(["--layers", "2", "--hidden", "64", "--seq-len", "64", "-i", "1", "-x", "1"]
                                   if r else []), "--json", str(ctx.json("parallel-r4"))],
             _table_figure("parallel-r4"), extra=True),
    ]


def _train_meshes() -> tuple[str, ...]:
    """``tests/gpu/check_train_cuda.py``'s MESHES, read from its source (it imports torch and loom)."""
    text = (ROOT / "tests" / "gpu" / "check_train_cuda.py").read_text()
    body = re.search(r"^MESHES = \(([^)]*)\)", text, flags=re.M)
    return tuple(re.findall(r'"([\w-]+)"', body.group(1)))


# ----------------------------------------------------------------------------------------------- running steps
def check_imports(py: str, env: dict[str, str]) -> dict[str, str]:
    """Import every module of ``NEEDS`` in ``py``: the missing ones with their error."""
    mods = sorted({m for group in NEEDS.values() for m in group})
    code = ("import importlib, json, sys\nbad = {}\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n    except Exception as e:\n"
            "        bad[m] = f'{type(e).__name__}: {e}'\nprint(json.dumps(bad))\n")
    proc = subprocess.run([py, "-c", code, *mods], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {m: f"the import check failed: {proc.stderr.strip()[-200:]}" for m in mods}


def _signal(proc: subprocess.Popen, sig: int, family: list[tuple[int, int]]) -> None:
    """``sig`` to ``proc``'s process group and to each process of ``family`` (pid, start time) that is still the
    one found (a launcher may start its ranks under setsid, in a new process session; a rank outlives a killed
    launcher)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid, started in family:
        launch.signal_verified(pid, sig, lambda p, t=started: launch.start_time(p) == t)


def run_command(argv: list[str], limit: float, log: Path, env: dict[str, str],
                on_line: Callable[[str], None] | None = None, stall: float | None = None) -> tuple[int, str]:
    """Run ``argv`` with its output in ``log``; ``(exit code, how)``: how is ``""``, ``"timeout"`` (at ``limit``)
    or ``"stall"`` (no line passed to ``on_line`` returned for ``stall`` seconds). SIGINT ``GRACE_S`` seconds
    before the end, SIGKILL of all it started at the end."""
    t0 = time.monotonic()
    last = [t0]
    with open(log, "a") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=ROOT, start_new_session=True, bufsize=1, errors="replace")

        def pump():
            for line in proc.stdout:
                f.write(line)
                f.flush()
                if on_line is not None and on_line(line.rstrip("\n")):
                    last[0] = time.monotonic()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        how, family, end = "", [], None
        while proc.poll() is None:
            now = time.monotonic()
            if stall is not None and now - last[0] > stall:
                how = "stall"
            elif now - t0 > limit - min(GRACE_S, limit / 4):
                how = "timeout"
            if how and end is None:  # the step's own process is told (pytest and loom's launcher stop the ranks)
                family = launch.descendants(proc.pid)
                _signal(proc, signal.SIGINT, [])
                end = min(t0 + limit, now + min(GRACE_S, limit / 4))
            if end is not None and now >= end:
                _signal(proc, signal.SIGKILL, family + launch.descendants(proc.pid))
                break
            time.sleep(0.2)
        rc = proc.wait()
        reader.join(timeout=5)
    return rc, how


def _missing_module(log: str) -> str | None:
    found = re.findall(r"ModuleNotFoundError: No module named '([\w.]+)'", log)
    return found[-1] if found else None


class Session:
    def __init__(self, ctx: Ctx, total: int, only: set[str], skip: set[str]):
        self.ctx, self.total, self.only, self.skip = ctx, total, only, skip
        self.start = time.monotonic()

    def left(self) -> float:
        return self.total - (time.monotonic() - self.start)

    def record(self, name: str, status: str, secs: float, limit: float, figure: str) -> None:
        line = "\t".join([name, status, f"{secs:.0f}", f"{limit:.0f}", figure.replace("\t", " ").replace("\n", " ")])
        with open(self.ctx.summary, "a") as f:
            f.write(line + "\n")
        print(f"== {name}: {status} after {secs:.0f}s (limit {limit:.0f}s): {figure}", flush=True)

    def run(self, step: Step) -> None:
        if (self.only and step.name not in self.only) or step.name in self.skip:
            return
        limit = min(int(os.environ.get(step.name.upper().replace("-", "_") + "_S", step.limit)), int(self.left()))
        need = [m for g in step.needs for m in NEEDS[g] if m in self.ctx.missing]
        if need:
            return self.record(step.name, "skip", 0, limit, f"missing module {', '.join(need)}")
        if limit < MIN_S:
            return self.record(step.name, "skip", 0, limit, f"no time left ({self.left():.0f}s)")
        print(f"== {step.name} (limit {limit}s): {_shown(step.argv)}", flush=True)
        for old in (f"{step.name}.log", f"{step.name}.json", f"{step.name}.xml"):  # an earlier session's
            (self.ctx.out / old).unlink(missing_ok=True)
        if step.meshes:
            return self._train(step, limit)
        log = self.ctx.out / f"{step.name}.log"
        t0 = time.monotonic()
        rc, how = run_command(step.argv, limit, log, self.ctx.env)
        secs = time.monotonic() - t0
        text = log.read_text(errors="replace")
        print("\n".join(text.splitlines()[-15:]), flush=True)
        try:
            figure = step.figure(self.ctx, text)
        except Exception as e:  # a figure that cannot be read is reported, the session goes on
            figure = f"figure unreadable: {type(e).__name__}: {e}"
        if how:
            status = "timeout"
        elif rc == 0:
            said = re.search(r"^SKIP: (.*)$", text, flags=re.M)
            status = "skip" if said or isinstance(figure, Skip) else "ok"
            figure = said.group(1) if said else figure
        elif _missing_module(text) and not (self.ctx.out / f"{step.name}.xml").exists():  # pytest's say failed
            status, figure = "skip", f"missing module {_missing_module(text)} ({figure})"
        else:
            status = f"fail ({rc})"
        if step.name == "prepare":
            self._after_prepare(text)
        self.record(step.name, status, secs, limit, figure)

    def _after_prepare(self, text: str) -> None:
        """The modules prepare found missing (its import check, else one now); the launcher it found
        (``.gpu-env``) for the later steps."""
        if re.search(r"^imports: ", text, flags=re.M):
            self.ctx.missing = dict(re.findall(r"^missing (\S+) \(needed by [^)]*\): (.*)$", text, flags=re.M))
        else:
            self.ctx.missing = check_imports(self.ctx.py, self.ctx.env)
        env_file = ROOT / ".gpu-env"
        if not self.ctx.rehearse and env_file.exists():
            for m in re.finditer(r"^export (LOOM_MPIEXEC)=(\S+)$", env_file.read_text(), flags=re.M):
                self.ctx.env[m.group(1)] = m.group(2)

    def _train(self, step: Step, limit: int) -> None:
        """The meshes in one job, each reported when it ends; a job that stops (a crash, a mesh past
        ``MESH_S``) leaves that mesh failed or timed out and a new job runs the rest."""
        todo, deadline, log = list(step.meshes), time.monotonic() + limit, self.ctx.out / "train.log"
        while todo and deadline - time.monotonic() >= MIN_S:
            done, since = [], [time.monotonic()]

            def on_line(line: str, done: list[str] = done, since: list[float] = since) -> bool:
                m = re.match(r"MESH (\S+) (ok|fail|skip) ([\d.]+) ?(.*)$", line)
                if not m:
                    return False
                done.append(m.group(1))
                since[0] = time.monotonic()
                self.record(f"train:{m.group(1)}", m.group(2), float(m.group(3)), MESH_S, m.group(4))
                return True

            rc, how = run_command([*step.argv, "--meshes", ",".join(todo)], deadline - time.monotonic(), log,
                                  self.ctx.env, on_line, stall=MESH_S)
            todo = [n for n in todo if n not in done]
            if todo and (how or rc != 0):
                text = log.read_text(errors="replace")
                last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
                why = f"no report within {MESH_S}s" if how == "stall" else how or f"job exited {rc}: {last[0][:200]}"
                missing = _missing_module(text[-4000:])
                status = "timeout" if how else ("skip" if missing else f"fail ({rc})")
                detail = f"missing module {missing}" if missing and not how else why
                self.record(f"train:{todo[0]}", status, time.monotonic() - since[0], MESH_S, detail)
                todo = todo[1:]
            elif todo:  # exited 0 without reporting them: not expected
                break
        for name in todo:
            self.record(f"train:{name}", "skip", 0, MESH_S, "no time left in the train step")


def _shown(argv: list[str]) -> str:
    """A step's command for the plan: the python by name, a launch as ``N ranks:``, other code as ``<code>``."""
    words = [Path(a).name if i == 0 or a == argv[0] else a for i, a in enumerate(argv)]
    if argv[1:2] == ["-c"]:
        words = [f"{argv[3]} ranks:", *words[4:]] if argv[2] == LAUNCH else [words[0], "-c", "<code>", *words[3:]]
    return " ".join(w.replace(str(ROOT) + "/", "") for w in words)[:200]


def _hide(modules: list[str], out: Path) -> str:
    """A folder that, first on PYTHONPATH, makes ``modules`` fail to import as if they were not installed."""
    folder = out / "hidden-modules"
    for m in modules:
        (folder / m).mkdir(parents=True, exist_ok=True)
        (folder / m / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{m}'\", name={m!r})  # gpu_session --hide\n")
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_session", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the steps, their limits and commands")
    p.add_argument("--rehearse", action="store_true", help="every step on the CPU, sizes shrunk")
    p.add_argument("--only", default="", help="comma-separated steps to run")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out")
    p.add_argument("--hide", default="", help="comma-separated modules to make unimportable (tests the skips)")
    p.add_argument("--imports", action="store_true", help="check every module the session imports, and exit")
    args = p.parse_args(argv)
    out = Path(os.environ.get("OUT", "gpu-out")).resolve()
    total = int(os.environ.get("TOTAL", TOTAL))
    py = os.environ.get("PY", sys.executable)
    env = dict(os.environ)
    hidden = [_hide(args.hide.split(","), out)] if args.hide else []
    env["PYTHONPATH"] = os.pathsep.join([*hidden, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["PY"] = py  # prepare_gpu.sh's python
    env.setdefault("OMP_NUM_THREADS", "1")
    ctx = Ctx(py=py, out=out, rehearse=args.rehearse, env=env)
    if args.imports:
        missing = check_imports(py, env)
        for m, err in missing.items():
            need = [g for g, mods in NEEDS.items() if m in mods]
            print(f"missing {m} (needed by: {', '.join(need)}): {err}")
        n = len({m for g in NEEDS.values() for m in g})
        print(f"imports: {n - len(missing)} of {n} present" + (f"; missing: {', '.join(missing)}" if missing else ""))
        return 0
    steps = plan(ctx)
    if args.dry_run:
        for s in steps:
            print(f"{s.name:<16}{s.limit:>5}s  {'extra ' if s.extra else 'planned'}  {_shown(s.argv)}")
            for mesh in s.meshes:
                print(f"  train:{mesh}")
        planned = sum(s.limit for s in steps if not s.extra)
        print(f"planned {planned}s of TOTAL={total}s; the extras share what the planned steps leave")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    ctx.summary = out / "summary.tsv"
    ctx.summary.write_text("step\tstatus\tseconds\tlimit\tfigure\n")
    session = Session(ctx, total, set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(","))))
    for step in steps:
        session.run(step)
    print(f"== summary ({time.monotonic() - session.start:.0f}s of {total}s) in {ctx.summary}")
    print(ctx.summary.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
