"""loom's byte-level tokenizer: UTF-8 bytes are the token ids (vocab 256).

It belongs to the models, not to a training job: the training data, ``loom generate`` and the transformers
integration (a model trained without a tokenizer of its own) all speak it.
"""

from __future__ import annotations

import torch

__all__ = ["encode", "decode"]


def encode(text: str) -> torch.Tensor:
    """Byte-level tokenization: UTF-8 bytes as int64 token ids (vocab 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long, device="cpu")


def decode(tokens) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 sequences are replaced."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
