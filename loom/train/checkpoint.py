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
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["save", "load", "latest", "stage_path", "prune", "capture_rng", "restore_rng", "FORMAT"]

FORMAT = 1
_NAME = re.compile(r"step_(\d{6,})\.stage(\d+)\.pt$")


def stage_path(directory: str | Path, step: int, stage: int = 0) -> Path:
    return Path(directory) / f"step_{step:06d}.stage{stage}.pt"


def capture_rng() -> dict[str, Any]:
    """RNG state that training could consume (torch CPU generator, Python ``random``)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` atomically to ``path`` (temporary file in the same directory, fsync, rename)."""
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
    """Load a checkpoint with ``weights_only=True`` (no arbitrary unpickling)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise ValueError(f"{path} is not a loom train checkpoint (format {FORMAT})")
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


def prune(directory: str | Path, keep: int, stages: int = 1) -> None:
    """Keep the newest ``keep`` complete steps; delete every file of older steps (complete or not).

    Steps newer than the newest complete one (being written right now) are never touched.
    """
    found = _complete(Path(directory))
    done = sorted(s for s, files in found.items() if all(i in files for i in range(stages)))
    if len(done) <= keep:
        return
    oldest_kept = done[-keep]
    for step, files in found.items():
        if step < oldest_kept:
            for p in files.values():
                p.unlink(missing_ok=True)


def resolve(path: str | Path) -> list[Path]:
    """The stage files of a checkpoint given as a file, a step file of any stage, or a directory (latest)."""
    p = Path(path)
    if p.is_dir():
        found = _complete(p)
        if not found:
            raise FileNotFoundError(f"no checkpoints (step_*.stage*.pt) in {str(p)!r}")
        step = max(found)
        return [found[step][i] for i in sorted(found[step])]
    m = _NAME.search(p.name)
    if m and p.is_file():
        stages = _complete(p.parent).get(int(m.group(1)), {})
        return [stages[i] for i in sorted(stages)]
    if p.is_file():
        return [p]
    raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist (give a .pt file or a checkpoint directory)")
