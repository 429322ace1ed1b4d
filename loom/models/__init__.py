"""Reference models used by demos, training and benchmarks."""

from .llama import Llama, LlamaConfig, build_llama, chunked_lm_loss

__all__ = ["Llama", "LlamaConfig", "build_llama", "chunked_lm_loss"]
