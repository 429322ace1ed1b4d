"""``loom demo``: the training demo — ``loom train`` with ``configs/demo.toml`` on the ranks of this job.

``make demo`` runs ``loom demo --ranks 4``: a Llama-style byte-level model on the Python standard library's
sources, mesh dp 2 x sp 2 with FPDT attention (2 chunks per rank, host offload) and the hybrid compression
policy (int4 + error feedback on the dp gradients). Rank 0 shows the progress bar, writes
``runs/demo/metrics.jsonl`` and the plots under ``runs/demo/plots/``, then samples a few bytes from the
final checkpoint. On another rank count the mesh adapts (2: sp 2; 1: no parallelism; n: dp n).

Options: ``--tour`` runs the communication tour instead (latency, bandwidth, allreduce, alltoallv tables);
any other argument is passed to ``loom train`` (e.g. ``--train.steps=100``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import cli_args, settings

__all__ = ["main", "parser", "demo_config", "mesh_for"]

RELAUNCH = True


def demo_config() -> Path:
    """``configs/demo.toml`` of this checkout."""
    path = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `loom demo` runs from a loom checkout (make demo)")
    return path


def mesh_for(n: int) -> list[str]:
    """Mesh overrides for ``n`` ranks: 4 -> the config's dp 2 x sp 2; otherwise sp 2 / dp n / one rank."""
    if n == 4:
        return []
    if n == 2:
        return ["--mesh.dp=1", "--mesh.sp=2"]
    return [f"--mesh.dp={n}", "--mesh.sp=1", f"--data.batch={16 if 16 % n == 0 else 4 * n}"]


def _size() -> int:
    info = settings.launch_info()
    return 1 if info is None else info.size


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(
        prog="loom demo", description=__doc__.split("\n\n")[1].replace("``", "`"),
        epilog="Any other argument is passed to `loom train` (e.g. --train.steps=100); `loom train --help` lists "
               "them. A new demo replaces the previous demo run in its train.out; --resume continues it.")
    p.add_argument("--tour", action="store_true",
                   help="run the communication tour instead (latency, bandwidth, allreduce, alltoallv tables)")
    return p


def main(argv: list[str] | None = None) -> int:
    opts, args = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if opts.tour:
        from .bench.comm import tour

        return tour(args)
    from .train import cli

    extra = mesh_for(_size())
    if "--resume" not in args and "-r" not in args:
        # The demo is a fixed recipe: a new `make demo` replaces the previous demo run (say so, and keep
        # another run's directory safe: --train.out=DIR still refuses a directory holding another run).
        if not any(a.startswith("--train.out") for a in args):
            extra.append("--overwrite")
    rc = cli.main(["--config", str(demo_config()), *extra, *args])
    if rc == 0 and settings.launch_rank() == 0:
        _sample(args)
    return rc


def sample_argv(ckdir: str | Path) -> list[str]:
    """``loom generate`` arguments of the demo's sample: the demo prints them and runs exactly them."""
    return ["--checkpoint", str(ckdir), "--prompt", "def ", "--tokens", "120", "--temperature", "0.6",
            "--top-k", "20", "--seed", "0"]


def _sample(args: list[str]) -> None:
    """Show what the model learned: a short sample from the final checkpoint (rank 0), through the same
    ``loom generate`` command it prints, so that command reproduces the sample exactly."""
    import shlex

    from .train import generate
    from .train.config import ConfigError, load_config

    try:
        cfg = load_config(demo_config(), [a for a in args if a.startswith("--") and "." in a.split("=")[0]])
    except ConfigError:
        return  # loom train has reported it
    argv = sample_argv(cfg.checkpoint.dir or Path(cfg.train.out) / "checkpoints")
    print(f"\nsample (reproduce it with: loom generate {shlex.join(argv)}):", flush=True)
    generate.main(argv)
