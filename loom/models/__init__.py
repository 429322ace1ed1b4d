"""Reference models used by demos, training and benchmarks."""

from typing import Any

# Lazy: loom.models.config (what loom train's [model] section is built from) must load without torch.
_EXPORTS = {"Llama": "llama", "LlamaConfig": "config", "LlamaShape": "config", "build_llama": "llama",
            "chunked_lm_loss": "llama", "TensorParallelLlama": "parallelize", "parallelize_llama": "parallelize"}

__all__ = ["Llama", "LlamaConfig", "LlamaShape", "build_llama", "chunked_lm_loss", "TensorParallelLlama",
           "parallelize_llama"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loom.models' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
