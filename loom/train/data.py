"""Byte-level text data with a data order that is a pure function of ``(seed, step)``.

Default corpus: the Python standard library's own ``.py`` sources, found through ``sysconfig`` — present on
every machine that runs loom, no download. Files are read in sorted order (up to ``data.max_bytes``), joined
with a separator, and the tail ``data.heldout`` fraction is held out for evaluation.

Batches: step ``s`` draws ``data.batch`` random windows of ``seq_len + 1`` bytes with a generator seeded by
``(seed, s)``; every rank draws the same windows and keeps its own slice (rows by ``dp`` coordinate, columns
by ``sp`` coordinate). Because nothing depends on what came before, a resumed run sees exactly the batches
the uninterrupted run would have, and any mesh sees the same global batch as one rank does. The bytes are the
token ids (:mod:`loom.models.tokenizer`).

Packed documents (``data.pack``): every file is a document and the stream is the files back to back (no
separator: the boundary is known, not learned). Each of the ``data.batch`` rows of step ``s`` starts at the
first byte of a document drawn by the same ``(seed, s)`` generator and runs on through the documents after it
(the last one cut at the row's end); :func:`packed_windows` gives every token its document id and its position
inside its document (RoPE restarts at each document), and ignores the target that would predict the next
document's first byte from the previous document's last one.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .config import ConfigError, DataConfig

__all__ = ["Corpus", "stdlib_files", "load_corpus", "batch_windows", "packed_windows", "IGNORE"]

_SEP = b"\n\n"
IGNORE = -100
"""The target id the loss skips (``torch.nn.functional.cross_entropy``'s default ``ignore_index``)."""


def stdlib_files(pattern: str = "*.py") -> Iterator[Path]:
    """The standard library's source files (no site-packages), in sorted path order, lazily."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for f in sorted(filenames):
            if fnmatch.fnmatch(f, pattern):
                yield Path(dirpath) / f


def _files(cfg: DataConfig) -> tuple[Iterable[Path], str]:
    if not cfg.path:
        files = stdlib_files(cfg.glob)
        return files, f"Python {sysconfig.get_python_version()} standard library ({cfg.glob})"
    p = Path(cfg.path).expanduser()
    if p.is_file():
        return [p], str(p)
    if p.is_dir():
        files = sorted(f for f in p.rglob(cfg.glob) if f.is_file())
        if not files:
            raise ConfigError(f"data.path = {cfg.path!r} has no files matching data.glob = {cfg.glob!r}; "
                              f"set --data.glob (e.g. '*') or point data.path at a text file")
        return files, f"{p} ({cfg.glob})"
    raise ConfigError(f"data.path = {cfg.path!r} is neither a file nor a directory; give a text file or directory "
                      f"(empty = the Python standard library)")


@dataclass(slots=True)
class Corpus:
    """Train and held-out byte streams (uint8 tensors)."""

    train: torch.Tensor
    heldout: torch.Tensor
    description: str
    files: int
    train_docs: torch.Tensor | None = None
    """``data.pack``: the offset of each document's first byte in ``train`` (int64, increasing, from 0)."""
    heldout_docs: torch.Tensor | None = None
    """``data.pack``: likewise in ``heldout`` (its first document is the tail of the last training one)."""

    def docs(self, stream: torch.Tensor) -> torch.Tensor | None:
        """The document starts of ``stream`` (``train`` or ``heldout``), or None without ``data.pack``."""
        return self.train_docs if stream is self.train else self.heldout_docs if stream is self.heldout else None


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured corpus and split it; raises :class:`ConfigError` when too small for ``seq_len``."""
    files, desc = _files(cfg)
    chunks: list[bytes] = []
    total = 0
    used = 0
    sep = b"" if cfg.pack else _SEP  # packed: documents back to back, their boundaries kept as offsets
    starts: list[int] = []
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        if cfg.max_bytes and total + len(b) > cfg.max_bytes:
            b = b[: cfg.max_bytes - total]
        if cfg.pack and not b:
            continue  # an empty document has no token to train on
        starts.append(total)
        chunks.append(b)
        total += len(b) + len(sep)
        used += 1
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
    if not used:  # the default corpus, or a pattern that matches only directories
        raise ConfigError(f"corpus {desc} has no readable files matching data.glob = {cfg.glob!r}; set "
                          f"--data.glob (e.g. '*.py'), or point --data.path at a text file or directory")
    joined = bytearray(sep.join(chunks))
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)
    n_held = int(len(data) * cfg.heldout)
    need = cfg.seq_len + 2
    if n_held < need or len(data) - n_held < need:
        raise ConfigError(
            f"corpus {desc} has {len(data)} bytes: too small for data.seq_len = {cfg.seq_len} with "
            f"data.heldout = {cfg.heldout}; use more text or a shorter seq_len")
    n_train = len(data) - n_held
    corpus = Corpus(train=data[:n_train].clone(), heldout=data[n_train:].clone(), description=desc, files=used)
    if cfg.pack:
        st = torch.tensor(starts, dtype=torch.int64)
        corpus.train_docs = st[st < n_train]
        corpus.heldout_docs = torch.cat([torch.zeros(1, dtype=torch.int64), st[st > n_train] - n_train])
    return corpus


def batch_windows(stream: torch.Tensor, *, seed: int, step: int, batch: int, seq_len: int,
                  stream_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: ``(inputs, targets)``, each ``[batch, seq_len]`` int64.

    Window starts come from a generator seeded by ``(seed, stream_id, step)`` only, which is what makes
    resume and every mesh see exactly the same data.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + stream_id * 7_919 + step) % (2**63 - 1))
    # On the host, with the corpus: the trainer moves each rank's slice to its device.
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=g, device="cpu")
    idx = starts[:, None] + torch.arange(seq_len + 1, device="cpu")[None, :]
    win = stream[idx].long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def packed_windows(stream: torch.Tensor, docs: torch.Tensor, *, seed: int, step: int, batch: int, seq_len: int,
                   stream_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed global batch of step ``step``: ``(inputs, targets, doc_ids, positions)``, each
    ``[batch, seq_len]`` int64.

    Row ``b`` starts at the first byte of a document drawn by the generator of :func:`batch_windows` (one whose
    row fits in ``stream``) and runs on through the documents after it. ``doc_ids`` numbers the documents of
    a row from 0; ``positions`` counts from 0 at each document's first byte; a target whose byte belongs to the
    next document is :data:`IGNORE`, so no target crosses a boundary.

    Args:
        stream: the byte stream (``Corpus.train`` or ``Corpus.heldout``).
        docs: the offsets of its documents' first bytes (``Corpus.docs(stream)``), increasing, from 0.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + stream_id * 7_919 + step) % (2**63 - 1))
    fit = int(torch.searchsorted(docs, len(stream) - seq_len - 1, right=True))  # docs[0] = 0 always fits
    first = docs[torch.randint(0, fit, (batch,), generator=g, device="cpu")]
    idx = first[:, None] + torch.arange(seq_len + 1, device="cpu")[None, :]
    win = stream[idx].long()
    doc = torch.searchsorted(docs, idx, right=True) - 1  # the document of each byte
    targets = win[:, 1:].masked_fill(doc[:, 1:] != doc[:, :-1], IGNORE)
    doc = doc[:, :-1]
    return (win[:, :-1].contiguous(), targets.contiguous(), (doc - doc[:, :1]).contiguous(),
            (idx[:, :-1] - docs[doc]).contiguous())
