"""Bring-your-own-model integrations: loom's parallelism on models defined by other libraries.

* :mod:`loom.integrations.transformers`: Ulysses/FPDT sequence parallelism, pipeline splitting and
  ``loom train`` for Hugging Face ``transformers`` decoders (Llama, Qwen2, Mistral), unmodified.

Submodules import their library lazily (``pip install loom[hf]``), so importing this package costs nothing.
"""

__all__: list[str] = []
