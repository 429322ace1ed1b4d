"""Every Python block and command line of the documentation runs, as written, at the rank count it states.

The examples are read from README.md (the front page) and every page of the site under docs/, where each is
explained (:func:`tests.docs.pages`; the command-line reference's generated ``--help`` text is not read). A
fenced block is:

- a **Python** block (```` ```python ````): saved to a file and run with ``python`` on the ranks its
  ``mpiexec -n N`` comment or its marker states (1 otherwise);
- a **command** block: every line whose first word is a program (``loom``, ``make``, ``mpiexec``,
  ``python``, ``.venv/bin/...``), or only its ``$ ``-prefixed lines when it shows a command with its
  output; each runs in a shell in a fresh scratch directory per block that holds the checkout's
  ``configs/`` and ``docs/``, with ``loom`` and ``.venv/bin/`` pointing at this interpreter;
- anything else, and every ```` ```text ```` block (a diagram, an output), is not an example.

A marker in an HTML comment on the line before a block changes how it runs:
``<!-- example: skip (reason) -->`` (deliberately partial, or for another machine), ``<!-- example: root -->``
(needs root: run only as root, like the testbed tests), ``<!-- example: ranks=N -->``, and
``<!-- example: file=NAME -->`` (not run itself: saved as NAME for the commands that run it).

Sizes shrink where a flag allows: :data:`SMALL` appends flags to each ``loom`` command (a later flag wins
in argparse and in ``--section.key`` overrides), so a benchmark or a training run checks that the command
works without measuring anything. ``make demo`` runs its recipe (``loom demo --ranks 4``); ``make test`` is
this suite. Each example has a timeout, so a hang fails instead of stalling the suite.

The getting-started page states how many blocks run, run only as root, are inputs or are not run, and how many
inline ``loom ...`` commands of the prose are only parsed (tests/unit/test_readme.py): :func:`census` counts
them and :func:`test_readme_states_what_its_tests_prove` holds the sentence to the count
(``python tests/integration/test_readme_examples.py`` prints it, with the count per page).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loom.cli import COMMANDS
from loom.comm import launch
from tests.docs import pages

ROOT = Path(__file__).resolve().parents[2]
CENSUS_PAGE = "docs/getting-started.md"  # the page whose sentence states the census
TIMEOUT = 300  # seconds per example: a hang fails the test (a loaded 2-core machine runs each in < 60 s)
PROGRAMS = ("loom", "make", "mpiexec", "python", "torchrun", ".venv/bin/loom", ".venv/bin/python", "sudo")
MAKE = {"make demo": "loom demo --ranks 4", "make test": None, "make test-fast": None, "make bench": None}

_TRAIN_SMALL = ["--train.steps=2", "--train.eval_every=0", "--train.eval_batches=1", "--data.max_bytes=60000",
                "--checkpoint.every=0", "--train.plots=false", "--train.progress=lines"]
_OMB_SMALL = ["-m", "1", "-M", "8K", "-i", "3", "-x", "1", "--iterations-large", "2", "--warmup-large", "1",
              "--rounds", "1", "--max-seconds", "2"]
SMALL: dict[str, list[str]] = {
    "train": _TRAIN_SMALL,
    "demo": _TRAIN_SMALL,
    "generate": ["--tokens", "8"],
    "plan": ["--nodes", "2", "--no-lp", "--sim-batch", "0.05"],
    **{f"bench {name}": _OMB_SMALL for name in ("latency", "bw", "bibw", "allreduce", "allgather", "alltoall",
                                                 "alltoallv")},
    "bench compress": [*_OMB_SMALL, "-m", "4K"],
    "bench multipath": ["-m", "1M", "-M", "1M", "--rounds", "1", "--iterations-large", "1", "--warmup-large", "1",
                        "--max-seconds", "2"],
    "bench seqlen": ["--max-seq", "512", "--repeats", "1", "--no-breakdown"],
    "bench hybrid": ["--width", "64", "--depth", "4", "--iterations", "1", "--warmup", "1", "--rounds", "1"],
    "bench compress-train": ["--steps", "3", "--tail", "2", "--policies", "none,hybrid"],
    "bench parallel": ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "32",
                       "--batch", "2", "-i", "1", "-x", "1"],
    "bench moe": ["--tokens", "64", "--dim", "64", "--rounds", "1", "--iterations", "1", "--warmup", "1"],
    "bench dask": [*_OMB_SMALL, "--array", "400", "--chunk", "100", "--rows", "4000", "--partitions", "2",
                   "--app-rounds", "1", "--tasks", "20", "--cycles", "1"],
    "testbed check": ["--seconds", "0.5", "--classes", "intra,rail", "--no-reference"],
    "bench torch": ["--size", "256K", "-w", "32", "-d", "2", "-i", "20", "--iterations-large", "2", "-x", "1",
                    "--rounds", "1"],
    "bench launchers": ["--size", "256K", "-i", "20", "--iterations-large", "2", "-x", "1", "--rounds", "1"],
}
"""Flags appended to a ``loom`` command (keyed by its command words) so it runs in seconds."""


@dataclass
class Example:
    section: str
    line: int
    kind: str  # "python" or "commands"
    text: str
    ranks: int = 1
    skip: str = ""
    root: bool = False
    file: str = ""
    commands: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.section}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!--\s*example:\s*(.*?)\s*-->", re.S)


def _commands(body: str) -> list[str]:
    """The command lines of a fenced block: its ``$`` lines if it has any, else lines starting with a program."""
    lines = body.replace("\\\n", " ").splitlines()
    if any(ln.startswith("$ ") for ln in lines):
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    out = []
    for ln in lines:
        words = shlex.split(ln, comments=True) if ln.strip() else []
        if words and words[0] in PROGRAMS and (not words[0].endswith("loom") or words[1:2] and words[1] in COMMANDS):
            out.append(ln)
    return out


def extract(texts: dict[str, str] | None = None) -> list[Example]:
    """Every example of the pages (path -> text; by default README.md and docs/), with its marker applied."""
    found = []
    for name, text in (pages() if texts is None else texts).items():
        for m in _FENCE.finditer(text):
            lang, body = m.group(1), m.group(2)
            if lang == "text":
                continue
            ex = Example(name, text[:m.start()].count("\n") + 1, "python" if lang == "python" else "commands",
                         body)
            if ex.kind == "commands":
                ex.commands = _commands(body)
            else:
                n = re.search(r"mpiexec -n (\d+) python", body)
                ex.ranks = int(n.group(1)) if n else 1
            before = text[:m.start()].rstrip()
            marker = _MARKER.fullmatch(before[before.rfind("<!--"):]) if before.endswith("-->") else None
            if marker:
                _apply(ex, marker.group(1))
            if ex.kind == "commands" and not ex.commands and not ex.file:
                continue  # output, not an example (a file=NAME block of any language is an input)
            found.append(ex)
    return found


def _apply(ex: Example, marker: str) -> None:
    if marker.startswith("skip"):
        ex.skip = marker[4:].strip(" ()") or "marked skip"
        return
    for word in marker.split():
        key, _, value = word.partition("=")
        if key == "ranks":
            ex.ranks = int(value)
        elif key == "root":
            ex.root = True
        elif key == "file":
            ex.file = value
        else:
            raise ValueError(f"{ex.id}: unknown example marker {word!r} (skip, root, ranks=N, file=NAME)")


def shrink(command: str) -> str | None:
    """The command as the test runs it: ``make`` targets by their recipe, ``loom`` commands with :data:`SMALL`."""
    command = command.split(" #", 1)[0].strip()
    for target, recipe in MAKE.items():
        if command == target:
            if recipe is None:
                return None
            command = recipe
    words = shlex.split(command)
    for i, w in enumerate(words):
        if (w.endswith("loom") or w == "loom.cli") and i + 1 < len(words):
            key = " ".join(words[i + 1:i + 3]) if words[i + 1] in ("bench", "testbed") else words[i + 1]
            if key in SMALL:
                # Before a `--` the command is loom's; after it, another program's (testbed run).
                tail = command.split(" -- ", 1)
                tail[-1] = tail[-1] + " " + shlex.join(SMALL[key])
                return " -- ".join(tail)
    return command


_SCRATCH: dict[str, tuple[Path, dict[str, str], list[int]]] = {}


def _scratch(ex: Example, tmp_path_factory) -> tuple[Path, dict[str, str], list[int]]:
    """A fresh directory per block that looks like a checkout with its venv: configs/, docs/,
    .venv/bin/{loom,python}, mpiexec on PATH, and the blocks marked ``file=NAME``; the commands of one block
    share it, in order, as a reader running them one after the other would (the list counts those run)."""
    if ex.id in _SCRATCH:
        return _SCRATCH[ex.id]
    d = tmp_path_factory.mktemp("readme")
    for name in ("configs", "docs"):
        (d / name).symlink_to(ROOT / name)
    bin_dir = d / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # Shims, not symlinks: a venv's python finds its packages through the pyvenv.cfg next to the path it was
    # started by, which a symlink here would lack.
    for name, tail in (("loom", " -m loom.cli"), ("python", "")):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)}{tail} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    # mpiexec by its real path: MPICH's finds its proxy next to itself, so a symlink to it would hang.
    mpiexec_dir = os.path.dirname(launch.mpiexec_argv(1, ["true"])[0])
    for other in EXAMPLES:
        if other.file:
            (d / other.file).write_text(other.text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": os.pathsep.join([str(bin_dir), mpiexec_dir, os.environ.get("PATH", "")]), "HOME": str(d)}
    for var in ("PMI_RANK", "PMI_SIZE", "LOOM_LAUNCHED", "OMPI_COMM_WORLD_SIZE"):
        env.pop(var, None)
    _SCRATCH[ex.id] = (d, env, [0])
    return _SCRATCH[ex.id]


def _exec(argv: list[str], cwd: Path, env: dict[str, str], what: str) -> None:
    """Run ``argv``; fail with its output on a non-zero exit, a traceback or a hang (the group is killed)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} did not finish within {TIMEOUT} s (hang?)\n--- stdout\n{out[-4000:]}\n"
                    f"--- stderr\n{err[-4000:]}")
    tail = f"\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
    assert proc.returncode == 0, f"{what} exited {proc.returncode}{tail}"
    assert "Traceback" not in err, f"{what} printed a traceback{tail}"


def _run_commands(ex: Example, upto: int, cwd: Path, env: dict[str, str], done: list[int]) -> None:
    """Run the block's commands up to index ``upto`` that have not run yet in its directory."""
    while done[0] <= upto:
        command = ex.commands[done[0]]
        done[0] += 1
        run = shrink(command)
        if run is not None:
            _exec(["bash", "-c", run], cwd, env, f"{ex.id}: `{run}` (README: `{command}`)")


def _run_python(ex: Example, cwd: Path, env: dict[str, str]) -> None:
    page = re.sub(r"\W", "_", Path(ex.section).stem)
    script = cwd / f"example_{page}_{ex.line}.py"
    script.write_text(ex.text)
    _exec(launch.mpiexec_argv(ex.ranks, [sys.executable, str(script)]), cwd, env,
          f"{ex.id}: the Python example on {ex.ranks} ranks")


EXAMPLES = extract()
# One test per Python block and per command line (a command runs after the earlier ones of its block).
CASES = [(ex, i) for ex in EXAMPLES for i in range(len(ex.commands) if ex.kind == "commands" else 1)]


@pytest.mark.mpi
@pytest.mark.parametrize("ex, i", CASES, ids=[f"{ex.id}" + (f"#{i + 1}" if ex.kind == "commands" else "")
                                              for ex, i in CASES])
def test_readme_example_runs(ex: Example, i: int, tmp_path_factory):
    if ex.skip:
        pytest.skip(ex.skip)
    if ex.file:
        pytest.skip(f"saved as {ex.file} for the commands that run it")
    if ex.root and (not hasattr(os, "geteuid") or os.geteuid() != 0):
        pytest.skip("needs root for network namespaces and tc (CI runs as root)")
    cwd, env, done = _scratch(ex, tmp_path_factory)
    if ex.kind == "python":
        _run_python(ex, cwd, env)
    else:
        _run_commands(ex, i, cwd, env, done)


def test_extractor_honours_markers_and_tells_output_from_commands():
    text = (
        "```\nloom bench bw --ranks 2   # comment\n# Size  Bandwidth\n1  2.0\n```\n\n"
        "```\n$ loom plan --nodes 4\n# loom plan: table\n```\n\n"
        "```\n# Size  Latency\n0  1.0\n```\n\n"
        "```text\nloom train --ranks 4    a diagram's line, not a command\n```\n\n"
        "<!-- example: skip (a site cluster) -->\n```\nmodule load openmpi\nmpiexec -n 16 loom train\n```\n\n"
        "```python\nimport loom  # mpiexec -n 2 python this.py\n```\n\n"
        "<!-- example: ranks=3 -->\n```python\nx = 1\n```\n\n"
        "<!-- example: file=job.py -->\n```python\nprint(1)\n```\n")
    got = extract({"docs/x.md": text})
    assert [(e.kind, e.commands, e.ranks, e.skip, e.file) for e in got] == [
        ("commands", ["loom bench bw --ranks 2   # comment"], 1, "", ""),
        ("commands", ["loom plan --nodes 4"], 1, "", ""),
        ("commands", ["mpiexec -n 16 loom train"], 1, "a site cluster", ""),
        ("python", [], 2, "", ""),
        ("python", [], 3, "", ""),
        ("python", [], 1, "", "job.py"),
    ]
    assert shrink("make test") is None
    assert shrink("make demo").startswith("loom demo --ranks 4 --train.steps=2")
    assert shrink("loom testbed run -N 2 -- loom bench bw -M 4M").endswith("-M 4M -m 1 -M 8K -i 3 -x 1 "
                                                                          "--iterations-large 2 --warmup-large 1 "
                                                                          "--rounds 1 --max-seconds 2")
    assert shrink("loom generate --checkpoint runs/demo/checkpoints") == \
        "loom generate --checkpoint runs/demo/checkpoints --tokens 8"


def census(examples: list[Example] | None = None) -> dict[str, int]:
    """How the documentation's examples are checked: blocks run as written, run only as root, saved as inputs for
    other blocks, not run (marked skip); and inline ``loom ...`` commands of the prose, parsed only."""
    from tests.unit.test_readme import _inline_commands

    examples = EXAMPLES if examples is None else examples
    return {
        "blocks": len(examples),
        "run": sum(1 for e in examples if not (e.skip or e.file or e.root)),
        "root": sum(1 for e in examples if e.root and not (e.skip or e.file)),
        "inputs": sum(1 for e in examples if e.file and not e.skip),
        "not run": sum(1 for e in examples if e.skip),
        "parsed only": len(_inline_commands()),
    }


# The getting-started page's sentence, with any line break between its words (the counts are the groups).
_CLAIM = re.compile(r"\s+".join(
    r"Of the (\d+) example blocks of the README and this site's pages, `make test` runs (\d+) as written.*?, "
    r"(\d+) more only as root.*?, and (\d+) hold files that other blocks run; (\d+) are not run.*?"
    r"The (\d+) inline `loom` commands".split(" ")), re.S)


def per_page(examples: list[Example] | None = None) -> dict[str, int]:
    """Example blocks per page."""
    counts: dict[str, int] = {}
    for ex in EXAMPLES if examples is None else examples:
        counts[ex.section] = counts.get(ex.section, 0) + 1
    return counts


def test_readme_states_what_its_tests_prove():
    """The getting-started page's sentence about the examples carries the counts of :func:`census`, so it
    cannot drift."""
    counts = census()
    print("documentation examples:", ", ".join(f"{v} {k}" for k, v in counts.items()))
    print("per page:", ", ".join(f"{page} {n}" for page, n in per_page().items()))
    m = _CLAIM.search((ROOT / CENSUS_PAGE).read_text())
    assert m, f"{CENSUS_PAGE} lost its sentence on what `make test` runs"
    stated = dict(zip(("blocks", "run", "root", "inputs", "not run", "parsed only"), map(int, m.groups())))
    assert stated == counts, f"{CENSUS_PAGE} states {stated}, the examples are {counts}: fix its sentence"
    assert counts["blocks"] == counts["run"] + counts["root"] + counts["inputs"] + counts["not run"]


if __name__ == "__main__":
    print("documentation examples:", ", ".join(f"{v} {k}" for k, v in census().items()),
          f"({len(CASES)} test cases)")
    print("per page:", ", ".join(f"{page} {n}" for page, n in per_page().items()))
