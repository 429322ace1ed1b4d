"""Rank 0's view of a run: a rich progress bar (or plain lines), the metrics JSONL and the PNG plots.

The bar shows step, loss, tokens/s, peak memory per rank (the maximum over ranks: ``peak RSS``, the whole
process, on the CPU; ``peak CUDA`` the allocator's tensors on a GPU, what ``--dry-run``'s memory model predicts)
and the compression ratio (uncompressed / on-the-wire bytes of the gradient traffic). On a non-terminal (CI,
piped output) ``auto`` prints one line per log step instead, so logs stay readable.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from .. import settings

__all__ = ["Display", "MetricsLog", "write_plots", "fmt_bytes", "PEAK_LABEL"]

PEAK_LABEL = {"rss": "peak RSS", "cuda": "peak CUDA"}
"""The display's name for a record's ``peak_mem`` by its ``peak_mem_of`` (what was measured)."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _launcher_terminal_width() -> int | None:
    """Width of the terminal ``mpiexec`` writes to, when this rank's output is forwarded by it, else ``None``.

    Under mpiexec a rank's stdout is a pipe to the launcher, so ``isatty()`` is false even when the user
    watches a terminal; the launcher (an ancestor process) still holds that terminal as its stdout.
    """
    pid = os.getppid()
    for _ in range(4):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if name.startswith("mpiexec") or name.startswith("mpirun"):
            try:
                fd = os.open(f"/proc/{pid}/fd/1", os.O_WRONLY | os.O_NOCTTY)
            except OSError:
                return None
            try:
                return (os.get_terminal_size(fd).columns or 120) if os.isatty(fd) else None
            except OSError:
                return None
            finally:
                os.close(fd)
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return None


class Display:
    """Progress on rank 0: ``mode`` is ``bar``, ``lines``, ``none`` or ``auto``."""

    def __init__(self, mode: str, total: int, start: int, title: str = "train"):
        width = None
        if mode == "auto":
            env = settings.get("progress")
            if env != "auto":
                mode = env
            elif sys.stdout.isatty():
                mode = "bar"
            else:
                width = _launcher_terminal_width()
                mode = "bar" if width else "lines"
        self.mode = mode
        self.total = total
        self._bar = None
        if mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[peak]} {task.fields[mem]}/rank"), TextColumn("compress {task.fields[ratio]}"),
                TimeRemainingColumn(), console=Console(force_terminal=True, width=width), auto_refresh=False,
            )
            self._progress.start()
            self._bar = self._progress.add_task(title, total=total, completed=start, loss="-", tps="-",
                                                peak="peak", mem="-", ratio="-")

    def update(self, rec: dict[str, Any]) -> None:
        loss = f"{rec['loss']:.4f}"
        tps = f"{rec['tokens_per_s']:,.0f}"
        mem = fmt_bytes(rec["peak_mem"])
        peak = PEAK_LABEL.get(rec.get("peak_mem_of", ""), "peak")
        ratio = f"{rec['compress_ratio']:.2f}x"
        if self.mode == "bar":
            self._progress.update(self._bar, completed=rec["step"], loss=loss, tps=tps, peak=peak, mem=mem,
                                  ratio=ratio)
            self._progress.refresh()  # redraw per step only: every redraw travels through mpiexec's pipes
        elif self.mode == "lines":
            ev = f"  eval {rec['eval_loss']:.4f}" if rec.get("eval_loss") is not None else ""
            t = rec.get("time", {})
            hidden = f", {t['overlapped'] * 1e3:.0f} overlapped" if t.get("overlapped") else ""
            comm = f", comm {t['comm'] * 1e3:.0f} exposed{hidden}" if "comm" in t else ""
            print(f"step {rec['step']:>5}/{self.total}  loss {loss}{ev}  {tps} tok/s  {peak} {mem}/rank  "
                  f"compress {ratio}  ({rec['step_time'] * 1e3:.0f} ms/step{comm})", flush=True)

    def message(self, text: str) -> None:
        if self.mode == "bar":
            self._progress.console.print(text)
        elif self.mode == "lines":
            print(text, flush=True)

    def close(self) -> None:
        if self.mode == "bar":
            self._progress.stop()


class MetricsLog:
    """Append-only JSONL of per-step records; on resume, records after the resumed step are dropped."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        keep: list[str] = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn last line from a killed run
                if rec.get("step", 0) <= resume_step:
                    keep.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in keep))
        os.replace(tmp, path)
        self._f = open(path, "a")

    def write(self, rec: dict[str, Any]) -> None:
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        out = []
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out


def write_plots(records: Iterable[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Loss curves, bytes on the wire per mesh axis (with/without compression), step-time breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r.get("kind", "step") == "step"]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    if not recs:
        return paths

    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in recs], label="train", lw=1)
    ev = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", label="held-out", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title("loom train: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    axes: dict[str, list[float]] = {}
    for r in recs:
        for axis, b in r.get("bytes", {}).items():
            t = axes.setdefault(axis, [0.0, 0.0])
            t[0] += b["raw"]
            t[1] += b["wire"]
    offload = sum(r.get("offload_bytes", 0) for r in recs)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(8, 4), gridspec_kw={"width_ratios": [3, 1]})
    if axes:
        names = sorted(axes)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [axes[n][0] / 2**20 for n in names], 0.4, label="without compression")
        ax.bar([x + 0.2 for x in xs], [axes[n][1] / 2**20 for n in names], 0.4, label="on the wire")
        ax.set_xticks(list(xs), names)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no communication (1 rank)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("MiB sent by rank 0 (whole run)")
    ax.set_title("bytes per mesh axis")
    ax2.bar([0], [offload / 2**20], 0.5, color="tab:gray")
    ax2.set_xticks([0], ["FPDT offload"])
    ax2.set_title("host<->device MiB")
    fig.tight_layout()
    paths.append(out_dir / "bytes.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    comp = [r["time"]["compute"] * 1e3 for r in recs]
    comm = [r["time"]["comm"] * 1e3 for r in recs]
    off = [r["time"]["offload"] * 1e3 for r in recs]
    ax.stackplot(steps, comp, comm, off, labels=["compute", "communication (exposed)", "offload"], alpha=0.85)
    hidden = [r["time"].get("overlapped", 0.0) * 1e3 for r in recs]
    if any(hidden):  # in flight while backward computed: inside the compute band, not added on top
        ax.plot(steps, hidden, "k--", lw=1, label="communication overlapped with backward")
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step (rank 0)")
    ax.set_title("step-time breakdown")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out_dir / "step_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
