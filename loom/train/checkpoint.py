"""Checkpoints: atomic, ``torch.load(weights_only=True)``-loadable, enough to resume bit-exactly.

Layout under the checkpoint directory: one file per completed step and pipeline stage,
``step_000050.stage0.pt`` (``stage0`` only when ``mesh.pp == 1``). A file is written to a temporary name in
the same directory, flushed and fsynced, then ``os.replace``d into place, so a reader (or a resumed job
after a crash) sees either the whole file or none. A step counts as complete when every stage's file
exists; :func:`latest` returns the newest complete step.

Contents (plain dict of tensors and Python scalars/containers only): ``format``, ``step`` (optimizer steps
completed), ``config`` (the run's nested config dict), ``stage``/``stages``/``layers``, ``model``
(state dict with global parameter names), ``optim`` (AdamW state dict), ``rng`` (torch CPU generator state
and Python ``random`` state). The data order needs no state: batches are a function of (seed, step).

A run directory belongs to one run (:func:`claim_run_dir`): a new run refuses a directory that holds another
run's checkpoints or metrics unless told to resume it or to overwrite it, a ``--resume`` needs a checkpoint to
continue, and a resumed run must have the checkpoint's config apart from :data:`RESUMABLE` keys
(:func:`config_changes`). Without these rules a shorter run into a used directory would prune its own checkpoint
and keep the stale, newer steps of the old run. While a run writes to its directory it holds ``<out>/.lock``
(:func:`lock_run_dir`, naming host, pid and the process's start time), so two runs started into one directory
cannot mix their files: the second is refused while the first lives, and a lock whose process is gone (same
host, no such process) is taken over.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import socket
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

from .config import ConfigError

__all__ = ["save", "load", "latest", "stage_path", "zero_path", "prune", "resolve", "capture_rng", "restore_rng",
           "FORMAT", "RESUMABLE", "config_changes", "run_files", "claim_run_dir", "clear_run_dir", "RunDirError",
           "LOCK", "lock_holder", "lock_run_dir", "unlock_run_dir", "occupied", "resume_refusal", "check_resume"]

FORMAT = 1
_NAME = re.compile(r"step_(\d{6,})\.stage(\d+)\.pt$")


def stage_path(directory: str | Path, step: int, stage: int = 0) -> Path:
    return Path(directory) / f"step_{step:06d}.stage{stage}.pt"


def zero_path(directory: str | Path, step: int) -> Path:
    """The sharded state of ``step`` under ZeRO stages 2-3: a directory of one file per rank plus a manifest
    (``ShardedDataParallel.save_sharded``), written before the step's stage file."""
    return Path(directory) / f"step_{step:06d}.zero"


def capture_rng(device: Any = None) -> dict[str, Any]:
    """RNG state that training could consume (torch CPU generator, Python ``random``) and, for a CUDA ``device``,
    that device's generator: the rank's own GPU, not whichever is current."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def restore_rng(state: dict[str, Any], device: Any = None) -> None:
    """Restore :func:`capture_rng`'s state; the CUDA generator only when resuming on a CUDA ``device`` (a state
    saved on a GPU resumes on the CPU without it, and a CPU state leaves the GPU's generator as seeded)."""
    import torch

    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], torch.device(device))


def save(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically to ``path`` (temporary file in the same directory, fsync, rename)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` (no arbitrary unpickling).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a loom checkpoint (another file, a truncated one, another format).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    not_ours = f"{path} is not a loom train checkpoint (format {FORMAT}, written by `loom train`)"
    try:
        with warnings.catch_warnings():  # a foreign pickle's protocol warning would precede the one-line error
            warnings.simplefilter("ignore", UserWarning)
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, ValueError, UnicodeDecodeError,
            AttributeError, KeyError, IndexError) as exc:
        # torch.load reports a foreign file as any of these, with a long unpickling message; say what it is.
        raise ValueError(f"{not_ours}: torch.load failed with {type(exc).__name__}") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(not_ours)
    return ck


def _complete(directory: Path) -> dict[int, dict[int, Path]]:
    found: dict[int, dict[int, Path]] = {}
    if not directory.is_dir():
        return found
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return found


def latest(directory: str | Path, stages: int = 1) -> int | None:
    """The newest step whose ``stages`` stage files all exist, or ``None``."""
    found = _complete(Path(directory))
    done = [s for s, files in found.items() if all(i in files for i in range(stages))]
    return max(done) if done else None


def prune(directory: str | Path, keep: int, stages: int = 1, current: int | None = None) -> None:
    """Keep the newest ``keep`` complete steps up to ``current``; delete every file of older steps.

    ``current`` (the step this run just wrote) is always kept, whatever other steps the directory holds.
    Steps newer than ``current``, or newer than the newest complete one (being written right now), are never
    touched.
    """
    found = _complete(Path(directory))
    done = sorted(s for s, files in found.items() if all(i in files for i in range(stages)))
    if current is not None:
        done = [s for s in done if s <= current]
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step, files in found.items():
        if step < oldest_kept:
            for p in files.values():
                p.unlink(missing_ok=True)
            shutil.rmtree(zero_path(directory, step), ignore_errors=True)


def _stages_of(path: Path) -> int:
    """The pipeline stage count recorded in a stage file (memory-mapped: the tensors are not read)."""
    import torch

    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a foreign or torn file: load() reports it properly when the caller reads it
        return 1
    return int(ck.get("stages", 1)) if isinstance(ck, dict) else 1


def resolve(path: str | Path) -> list[Path]:
    """The stage files of a checkpoint given as a file, a step file of any stage, or a directory.

    A directory resolves to its newest *complete* step (every stage file present); a step of which some
    stage files are missing is skipped. A run directory (``train.out``, holding ``checkpoints/``) resolves as
    its ``checkpoints/``.
    """
    p = Path(path)
    if p.is_dir() and not _complete(p) and (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if p.is_dir():
        found = _complete(p)
        if not found:
            raise FileNotFoundError(f"no checkpoints (step_*.stage*.pt) in {str(p)!r}")
        for step in sorted(found, reverse=True):
            files = found[step]
            if 0 in files and all(i in files for i in range(_stages_of(files[0]))):
                return [files[i] for i in sorted(files)]
        raise FileNotFoundError(f"no complete checkpoint in {str(p)!r}: every step lacks some stage files "
                                f"(steps {sorted(found)})")
    m = _NAME.search(p.name)
    if m and p.is_file():
        stages = _complete(p.parent).get(int(m.group(1)), {})
        return [stages[i] for i in sorted(stages)]
    if p.is_file():
        return [p]
    raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist (give a .pt file or a checkpoint directory)")


# ---------------------------------------------------------------------------------------------- run directory
RESUMABLE: dict[str, frozenset[str]] = {
    "train": frozenset({"steps", "eval_every", "eval_batches", "log_every", "out", "progress", "plots", "device"}),
    "checkpoint": frozenset({"every", "keep", "dir"}),
    # The checkpoint holds whole stages (tp slices and ep experts gathered), so the replicas and shards can be
    # laid out again; pp must match.
    "mesh": frozenset({"dp", "sp", "sp_ring", "ep", "tp", "schedule"}),
    # How attention is laid out, chunked, recomputed and offloaded: the same math (a padded length differs only
    # in pads, which no loss or real token sees), so a run out of memory under Ulysses can go on under FPDT.
    "sequence": frozenset({"algorithm", "chunks", "offload", "recompute", "offload_checkpoints"}),
    "data": frozenset({"micro_batches"}),
    # Stage 1 saves the optimizer state unsharded and stages 2-3 reshard theirs, so the split can change on
    # resume (within 0-1 or within 2-3: the trainer checks); multi-path routing moves the same bytes by other
    # paths.
    "zero": frozenset({"stage", "axes"}),
    "multipath": frozenset({"enabled", "topology", "min_bytes", "learn"}),
    # The schedule's horizon: a resumed run keeps the checkpoint's unless this sets another (the trainer says so).
    "optim": frozenset({"decay_steps"}),
}
"""Config keys a ``--resume`` may change: how long, how often, where, on how many replicas, and how the sequence
is split and kept. Every other key (the model, optimizer, data, compression, precision) must equal the
checkpoint's."""


def config_changes(saved: dict[str, dict[str, Any]], current: dict[str, dict[str, Any]]) -> list[str]:
    """``section.key: checkpoint X vs config Y`` for every key outside :data:`RESUMABLE` that differs.

    A key the checkpoint lacks (written before the key existed) is taken to be at its current value.
    """
    diffs = []
    for section, values in current.items():
        theirs = saved.get(section, {})
        for key, value in values.items():
            if key in RESUMABLE.get(section, ()) or key not in theirs or theirs[key] == value:
                continue
            diffs.append(f"{section}.{key}: checkpoint {theirs[key]!r} vs config {value!r}")
    return diffs


class RunDirError(ConfigError):
    """The run directory holds another run (the CLI prints it and exits with code 2)."""


def resume_refusal(state: dict[str, Any], current: dict[str, dict[str, Any]], where: str) -> str | None:
    """Why a run of config ``current`` may not continue the checkpoint whose stage file holds ``state`` (only
    its ``config`` and ``zero`` entries are read), or ``None``. ``where`` names the checkpoint in the message.

    Refused: a key outside :data:`RESUMABLE` that differs; a ZeRO stage of the other layout (0-1 keep one
    file, 2-3 one file per rank); and under ZeRO 2-3 another ``mesh.tp``: each tp rank shards its own slices
    (``tp0/``, ``tp1/``, ...), and the shards are laid out again across dp only."""
    saved = state.get("config", {})
    diff = config_changes(saved, current)
    if diff:
        return (f"--resume: {where} is of another run ({', '.join(diff)}); resume with the checkpoint's values, "
                f"or start a new run with another --train.out")
    sharded, stage = state.get("zero") is not None, current["zero"]["stage"]
    if sharded != (stage >= 2):
        was = "2-3 (sharded files)" if sharded else "0-1 (one file)"
        return (f"--resume: {where} was written at zero.stage {was} and this run has zero.stage = {stage}; "
                f"stages 0-1 and 2-3 keep the optimizer state in different layouts: resume with a zero.stage in "
                f"the checkpoint's range")
    then, now = saved.get("mesh", {}).get("tp", 1), current["mesh"]["tp"]
    if sharded and then != now:
        return (f"--resume: {where} was written at zero.stage {saved.get('zero', {}).get('stage', '2-3')} with "
                f"mesh.tp = {then} and this run has mesh.tp = {now}; ZeRO 2-3 shards each tp rank's slices on "
                f"their own (tp0/, tp1/, ...) and reshards them across dp only: resume with --mesh.tp={then} "
                f"(mesh.dp may change)")
    return None


def check_resume(ckpt_dir: str | Path, current: dict[str, dict[str, Any]], stages: int = 1) -> None:
    """Raise :class:`RunDirError` when the newest complete checkpoint in ``ckpt_dir`` cannot be continued with
    config ``current`` (:func:`resume_refusal`); reads one stage file's metadata, memory-mapped (no tensor is
    read), so a run can refuse before its ranks start. No checkpoint: nothing to check."""
    import torch

    step = latest(ckpt_dir, stages=stages)
    if step is None:
        return
    path = stage_path(ckpt_dir, step, 0)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a foreign or torn file: the trainer's load() reports it properly
        return
    why = resume_refusal(state if isinstance(state, dict) else {}, current,
                         f"the newest checkpoint in {ckpt_dir} (step {step})")
    if why:
        raise RunDirError(why)


def run_files(out: str | Path, ckpt_dir: str | Path) -> list[Path]:
    """What a previous run left in ``out``: checkpoint files, a non-empty ``metrics.jsonl``, plots."""
    out, ckpt_dir = Path(out), Path(ckpt_dir)
    files = sorted(p for files in _complete(ckpt_dir).values() for p in files.values())
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        files.append(metrics)
    if (out / "plots").is_dir():
        files += sorted((out / "plots").glob("*.png"))
    return files


def claim_run_dir(out: str | Path, ckpt_dir: str | Path, *, resume: bool, overwrite: bool, stages: int = 1) -> None:
    """Check that a run may write to ``out``; raise :class:`RunDirError` naming the ways out if not.

    Reads only (every rank may call it before any communication): a directory locked by a live run is refused
    whatever the flags; a new run needs an empty directory (or ``overwrite``; the lock holder then calls
    :func:`clear_run_dir`); ``resume`` continues what is there and needs a complete checkpoint of ``stages``
    stage files.
    """
    if resume and overwrite:
        raise ConfigError("--resume continues the run in the directory and --overwrite deletes it; choose one")
    busy = _live_holder(out)
    if busy:
        raise RunDirError(busy)
    found = run_files(out, ckpt_dir)
    if resume:
        if latest(ckpt_dir, stages=stages) is None:
            left = " (with --overwrite: it holds the metrics of a run that saved no checkpoint)" if found else ""
            raise RunDirError(f"--resume: no checkpoint in {ckpt_dir} to continue; drop --resume to start a new "
                              f"run{left}, or give the --train.out of the run to continue")
        return
    if overwrite or not found:
        return
    steps = sorted({int(m.group(1)) for p in found if (m := _NAME.match(p.name))})
    what = [f"checkpoints of step {', '.join(map(str, steps))} in {ckpt_dir}"] if steps else []
    what += [str(p.relative_to(out)) for p in found if p.parent == Path(out)]
    raise RunDirError(
        f"{out} already holds another run ({'; '.join(what) or found[0]}); continue it with --resume, "
        f"choose a new directory with --train.out=DIR, or delete it with --overwrite")


def occupied(out: str | Path, ckpt_dir: str | Path, *, resume: bool, overwrite: bool, stages: int = 1) -> str | None:
    """What :func:`claim_run_dir` would refuse, as text (``None`` when the run may start): a dry run writes
    nothing, so it reports an occupied directory in its plan instead of refusing to plan."""
    try:
        claim_run_dir(out, ckpt_dir, resume=resume, overwrite=overwrite, stages=stages)
    except RunDirError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------- run lock
LOCK = ".lock"
"""The lock file's name in a run directory: JSON ``{"host", "pid", "started", "argv"}`` of the holder."""


def _me() -> dict[str, Any]:
    from ..comm.launch import start_time

    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_time(os.getpid()),
            "argv": " ".join(sys.argv)[:300]}


def lock_holder(out: str | Path) -> dict[str, Any] | None:
    """The holder recorded in ``out``'s lock (``{}`` for an unreadable lock file), or ``None`` without a lock."""
    try:
        text = (Path(out) / LOCK).read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}  # being written this instant, or damaged: treated as held (never silently taken)
    return holder if isinstance(holder, dict) else {}


def _gone(holder: dict[str, Any]) -> bool:
    """Whether the process that wrote ``holder`` has ended: only decidable on its own host (pid absent, or the
    pid now belongs to a process started at another time)."""
    from ..comm.launch import pid_alive, start_time

    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    pid = holder["pid"]
    if not pid_alive(pid):
        return True
    return holder.get("started") is not None and start_time(pid) not in (None, holder["started"])


def _live_holder(out: str | Path) -> str | None:
    """Why ``out`` is busy (the message of the refusal), or ``None`` when it is free or its lock is stale."""
    holder = lock_holder(out)
    if holder is None or _gone(holder):
        return None
    lock = Path(out) / LOCK
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return None  # this process holds it
    who = f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
    if holder.get("host") == socket.gethostname():
        fix = "wait for that run to end or stop it, or choose another directory with --train.out=DIR"
    else:
        fix = (f"wait for that run to end, or choose another directory with --train.out=DIR; this host cannot see "
               f"whether it still runs: if it has ended, delete {lock}")
    return f"{out} is in use by another run ({who}, lock {lock}); {fix}"


def lock_run_dir(out: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """Take ``out``'s lock for this process (``O_EXCL``: of two runs started at once, one gets it).

    Returns ``(lock path, the stale holder taken over or None)``. Raises :class:`RunDirError` naming the holder
    when a live run holds it.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK
    me = json.dumps(_me()).encode()
    taken_over = None
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            busy = _live_holder(out)
            if busy:
                raise RunDirError(busy) from None
            taken_over = lock_holder(out)
            # Replace only the stale lock read above: a rename of our own file over it would also replace a
            # lock that another run took in between, so remove it and race for O_EXCL again.
            lock.unlink(missing_ok=True)
            continue
        try:
            os.write(fd, me)
            os.fsync(fd)
        finally:
            os.close(fd)
        return lock, taken_over
    raise RunDirError(f"{out}: could not take the lock {lock} (another run keeps taking it); retry, or choose "
                      f"another directory with --train.out=DIR")


def unlock_run_dir(lock: str | Path) -> None:
    """Release a lock this process holds (a lock of another process is left alone)."""
    lock = Path(lock)
    holder = lock_holder(lock.parent)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def clear_run_dir(out: str | Path, ckpt_dir: str | Path) -> None:
    """Delete what a previous run left (checkpoints, metrics, plots) so a new run starts clean."""
    for p in run_files(out, ckpt_dir):
        p.unlink(missing_ok=True)
    for tmp in Path(ckpt_dir).glob(".step_*.tmp.*") if Path(ckpt_dir).is_dir() else ():
        tmp.unlink(missing_ok=True)
    for shards in Path(ckpt_dir).glob("step_*.zero") if Path(ckpt_dir).is_dir() else ():
        shutil.rmtree(shards, ignore_errors=True)
    plots = Path(out) / "plots"
    if plots.is_dir() and not any(plots.iterdir()):
        shutil.rmtree(plots, ignore_errors=True)
