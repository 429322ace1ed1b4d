"""``loom train``: long-context, data/sequence-parallel, compressed training of a Llama-style byte model.

Modules: :mod:`~loom.train.config` (TOML + overrides), :mod:`~loom.train.data` (byte-level corpus, data
order as a function of the step), :mod:`~loom.train.model` (the pipeline-stage view of :mod:`loom.models.llama`),
:mod:`~loom.train.trainer` (the loop), :mod:`~loom.train.checkpoint` (atomic, weights-only checkpoints),
:mod:`~loom.train.progress` (progress bar, metrics JSONL, plots), :mod:`~loom.train.cli` and
:mod:`~loom.train.generate` (the ``loom train`` / ``loom generate`` commands).
"""

from .config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
