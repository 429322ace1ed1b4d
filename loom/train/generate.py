"""``loom generate --checkpoint PATH --prompt TEXT``: sample bytes from a trained ``loom train`` checkpoint.

Loads every pipeline stage's file of the checkpoint (``torch.load(weights_only=True)``), merges their
parameters into the whole model on one process, and samples autoregressively with temperature and top-k
from a seeded generator (the same command prints the same text).
"""

from __future__ import annotations

import sys

import torch

from .. import cli_args
from ..comm.devices import resolve_device
from ..models.tokenizer import decode, encode
from . import checkpoint as ckpt
from .config import ConfigError, config_from_dict
from .model import build_model

__all__ = ["main", "load_model", "sample"]

RELAUNCH = False  # one process is enough; --ranks is accepted and ignored


def load_model(path: str, device: str | torch.device = "cpu"):
    """``(model, config, step)`` from a checkpoint file or directory (newest complete step), the model on
    ``device`` (``auto``: this rank's GPU when there is one)."""
    files = ckpt.resolve(path)
    parts = [ckpt.load(f) for f in files]
    cfg = config_from_dict(parts[0]["config"])
    stages = parts[0].get("stages", 1)
    if len(parts) != stages:
        raise ValueError(f"checkpoint {path} has {len(parts)} of its {stages} pipeline stage files; "
                         f"copy all step_*.stage*.pt files of that step")
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part["model"])
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}[cfg.train.dtype]
    model = build_model(cfg, dtype=dtype, device=resolve_device(device)).module
    missing, unexpected = model.load_state_dict(state, strict=False)
    held = model.state_dict(keep_vars=True)
    loaded = {id(held[k]) for k in state if k in held}
    missing = [k for k in missing if id(held[k]) not in loaded]  # a tied alias of a loaded tensor is loaded
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    model.eval()
    return model, cfg, int(parts[0]["step"])


@torch.no_grad()
def sample(model, prompt: str, *, tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
           context: int = 256, seed: int = 0) -> str:
    """Continue ``prompt`` by ``tokens`` bytes; ``temperature`` 0 is greedy."""
    g = torch.Generator().manual_seed(seed)  # sampling runs on the host: the same text on any device
    device = next(model.parameters()).device
    ids = encode(prompt) if prompt else torch.tensor([10], device="cpu")
    out = ids.tolist()
    for _ in range(tokens):
        x = torch.tensor(out[-context:], device=device)[None, :]
        logits = model(x)[0, -1].double().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        out.append(nxt)
    return decode(out)


def _check_counts(a) -> str | None:
    """The counts must be counts: ``--tokens`` >= 1, ``--top-k``, ``--context`` >= 0, ``--temperature`` >= 0."""
    if a.tokens < 1:
        return f"--tokens {a.tokens} must be >= 1 (the bytes to generate), e.g. --tokens 200"
    for flag, v, zero in (("--top-k", a.top_k, "all bytes"), ("--context", a.context, "the training seq_len"),
                          ("--temperature", a.temperature, "greedy")):
        if v < 0:
            return f"{flag} {v} must be >= 0 (0 = {zero})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = cli_args.ArgumentParser(prog="loom generate", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint .pt file, checkpoint directory or run directory (newest complete step)")
    p.add_argument("-p", "--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)")
    p.add_argument("-k", "--top-k", type=int, default=40, help="sample among the k most likely bytes (0 = all)")
    p.add_argument("--context", type=int, default=0, help="context window in bytes (0 = the training seq_len)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default="auto", help="cpu, cuda[:N], or auto (the GPU when torch sees one)")
    p.checks.append(_check_counts)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    try:
        model, cfg, step = load_model(args.checkpoint, args.device)
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        print(f"loom generate: error: {exc}", file=sys.stderr)
        return 2
    if cfg.model.hf or cfg.model.hf_config:  # a transformers model samples with its own generate
        from ..integrations.transformers import generate_text

        text = generate_text(model, cfg.model, args.prompt, tokens=args.tokens, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed)
    else:
        text = sample(model, args.prompt, tokens=args.tokens, temperature=args.temperature, top_k=args.top_k,
                      context=args.context or cfg.data.seq_len, seed=args.seed)
    print(f"# checkpoint {args.checkpoint} (step {step}); prompt {args.prompt!r}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
