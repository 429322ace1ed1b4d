"""``loom.fit``: HyPar-Flow's one-call training API over :class:`~loom.parallel.HybridParallel`.

>>> history = loom.fit(model, (X, Y), nn.MSELoss(), lambda ps: torch.optim.Adam(ps, lr=1e-3),
...                    epochs=3, batch_size=64, partitions=2, micro_batches=4)   # on every rank

Every rank calls ``fit`` with the same model and the same data; replica ``r`` trains on rows
``[r * b, (r + 1) * b)`` of each global batch (``b = batch_size / replicas``), so the result equals
single-process training on the global batches. Rank 0 draws a progress bar on a terminal, else prints a
line per epoch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from .parallel.hybrid import HybridParallel

__all__ = ["fit", "History"]


@dataclass(kw_only=True, slots=True)
class History:
    """What :func:`fit` measured, one entry per epoch (the same on every rank)."""

    loss: list[float] = field(default_factory=list)
    """Mean training loss over the epoch's global batches."""
    val_loss: list[float] = field(default_factory=list)
    """Mean validation loss (when ``validation`` was given)."""
    seconds: list[float] = field(default_factory=list)
    """Wall time of each epoch on this rank."""
    model: HybridParallel | None = None
    """The trained :class:`HybridParallel` (``model.state_dict()`` gives the full model)."""


def _batches(data: Any, batch_size: int | None) -> Callable[[], Iterable[tuple[Any, Any]]]:
    """A re-iterable source of global ``(inputs, targets)`` batches."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], torch.Tensor) and \
            isinstance(data[0], (torch.Tensor, tuple, list)):
        x, y = data
        n = y.shape[0]
        if batch_size is None:
            raise ValueError("fit(data=(inputs, targets)) needs batch_size= (the global batch size)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")

        def gen():
            for lo in range(0, n - batch_size + 1, batch_size):  # a ragged tail batch is dropped
                sl = slice(lo, lo + batch_size)
                xs = tuple(t[sl] for t in x) if isinstance(x, (tuple, list)) else x[sl]
                yield xs, y[sl]

        if n < batch_size:
            raise ValueError(f"batch_size={batch_size} exceeds the {n} samples; use batch_size <= {n}")
        gen.steps = n // batch_size  # type: ignore[attr-defined]
        return gen
    if batch_size is not None:
        raise ValueError("batch_size= applies to data=(inputs, targets); an iterable of batches brings its own")
    if iter(data) is data:
        raise TypeError("data is a one-shot iterator; pass (inputs, targets) tensors, a list of batches or a "
                        "DataLoader so every epoch can iterate it again")
    return lambda: data


def _shard(batch: Any, r: int, reps: int) -> Any:
    if isinstance(batch, (tuple, list)):
        return tuple(_shard(t, r, reps) for t in batch)
    n = batch.shape[0]
    if n % reps:
        raise ValueError(f"global batch of {n} rows does not divide by replicas={reps}; use a batch size that is "
                         f"a multiple of {reps}")
    b = n // reps
    return batch[r * b:(r + 1) * b]


def _progress_mode(progress: bool | str) -> str:
    """``bar``, ``lines`` or ``none``: a bar only on a terminal, where it redraws in place; elsewhere (a log
    file, a pipe, mpiexec without a terminal) a bar would print its frames, so one line per epoch instead."""
    if progress is True:
        return "bar" if sys.stderr.isatty() else "lines"
    if progress is False:
        return "none"
    if progress not in ("bar", "lines", "none"):
        raise ValueError(f"progress={progress!r}; valid: True, False, 'bar', 'lines', 'none'")
    return progress


def _optimizer(optimizer: Any, hp: HybridParallel) -> torch.optim.Optimizer:
    """``optimizer`` itself, or the one its factory builds on this rank's parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(list(hp.parameters()))
    raise TypeError(f"optimizer must be a torch optimizer or a factory params -> optimizer, got "
                    f"{type(optimizer).__name__}")


def _steps_per_epoch(source: Callable) -> int | None:
    """Batches per epoch when the source knows it (the bar's total), else ``None``."""
    try:
        return getattr(source, "steps", None) or len(source())  # type: ignore[arg-type]
    except TypeError:
        return None


def _start_bar():
    """A started rich progress bar on stderr with a task per epoch (loss and val_loss fields)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]:.4g}{task.fields[val]}"), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=False)
    bar.start()
    return bar


def _report_epoch(hist: History, epoch: str, mode: str, bar: Any, task: Any) -> None:
    """Show the epoch just finished: a line on stderr (``lines``) or its val_loss on the bar."""
    if mode == "lines":
        val = f"  val_loss {hist.val_loss[-1]:.6g}" if hist.val_loss else ""
        print(f"epoch {epoch}: loss {hist.loss[-1]:.6g}{val}  ({hist.seconds[-1]:.2f} s)",
              file=sys.stderr, flush=True)
    elif bar is not None and hist.val_loss:
        bar.update(task, val=f"  val_loss {hist.val_loss[-1]:.4g}")


def fit(model: Any, data: Any, loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: Any, *, epochs: int = 1,
        partitions: int = 1, replicas: int | None = None, micro_batches: int = 1, schedule: str = "1f1b",
        balance: str | list[int] = "params", batch_size: int | None = None, validation: Any = None,
        progress: bool | str = True, **hybrid: Any) -> History:
    """Train ``model`` data-, pipeline- or hybrid-parallel; call it on every rank.

    Args:
        model: anything :class:`HybridParallel` accepts (``nn.Sequential``, fx-traceable module, Keras 3).
        data: ``(inputs, targets)`` tensors with ``batch_size``, or a re-iterable of global batches.
        loss_fn: ``loss_fn(output, target)`` -> mean loss over the batch.
        optimizer: a factory ``f(params) -> torch.optim.Optimizer`` (an optimizer class works, e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1)``) or an optimizer built on the full model's
            parameters (tensors of other stages never get a gradient there, so torch skips them).
        epochs: passes over ``data``.
        partitions, replicas, micro_batches, schedule, balance: as in :class:`HybridParallel`.
        batch_size: global batch size when ``data`` is a pair of tensors.
        validation: optional ``(inputs, targets)`` evaluated (forward only) after every epoch.
        progress: what rank 0 shows: ``"bar"`` (a rich progress bar), ``"lines"`` (one line per epoch),
            ``"none"``; ``True`` is a bar on a terminal and lines otherwise, ``False`` is ``"none"``.
        **hybrid: other :class:`HybridParallel` arguments (``comm``, ``grad_hook``, ``compression``, ...).

    Returns:
        The per-epoch :class:`History`, with the trained ``HybridParallel`` as ``history.model``.
    """
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be an integer >= 1")
    mode = _progress_mode(progress)
    hp = HybridParallel(model, partitions=partitions, replicas=replicas, micro_batches=micro_batches,
                        schedule=schedule, balance=balance, **hybrid)
    opt = _optimizer(optimizer, hp)
    source = _batches(data, batch_size)
    r, reps = hp.replica_index, hp.replicas
    rank0 = hp.pp.rank == 0 and hp.dp.rank == 0
    hist = History(model=hp)
    steps = _steps_per_epoch(source)
    mode = mode if rank0 else "none"
    bar = _start_bar() if mode == "bar" else None
    try:
        for ep in range(epochs):
            t0 = time.perf_counter()
            task = (bar.add_task("train", total=steps, epoch=f"{ep + 1}/{epochs}", loss=float("nan"), val="")
                    if bar else None)
            total, count = 0.0, 0
            for x, y in source():
                opt.zero_grad()
                loss = hp.train_step(_shard(x, r, reps), _shard(y, r, reps), loss_fn)
                opt.step()
                total = total + loss  # on the device: read once per epoch, or per step where a bar shows it
                count += 1
                if bar is not None:
                    bar.update(task, advance=1, loss=float(loss))
            if count == 0:
                raise ValueError("data yielded no batch; check batch_size against the number of samples")
            hist.loss.append(float(total) / count)
            if validation is not None:
                vx, vy = validation
                hist.val_loss.append(hp.eval_step(_shard(vx, r, reps), _shard(vy, r, reps), loss_fn))
            hist.seconds.append(time.perf_counter() - t0)
            _report_epoch(hist, f"{ep + 1}/{epochs}", mode, bar, task)
    finally:
        if bar is not None:
            bar.stop()
    return hist
