"""The stage-3 parameter between gathers: a placeholder that raises, naming the fix, when computed with."""

from __future__ import annotations

import torch
from torch import nn


# What a freed stage-3 parameter still answers: its metadata, hooks, identity, and ``detach()`` (a module's own
# ``state_dict()`` reads it; ShardedDataParallel.state_dict() gathers the values). Anything else computes.
_META_OPS = frozenset({
    "shape", "dtype", "device", "data", "grad", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "itemsize", "nbytes", "_base", "_version",
    "__hash__", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "detach",
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous", "is_floating_point",
    "is_complex", "element_size", "data_ptr", "untyped_storage", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "_is_view", "get_device", "type",
})


_COMPILE_REFUSED = (
    "ShardedDataParallel stage 3 does not run under torch.compile: its parameters are placeholders gathered by "
    "hooks and rebound between uses, which a traced graph cannot follow; use stage 0-2 with torch.compile, or "
    "stage 3 without it")


def _refuse_compile() -> None:
    if torch.compiler.is_compiling():
        raise ValueError(_COMPILE_REFUSED)


class _ShardedParameter(nn.Parameter):
    """A stage-3 parameter: between gathers its data is a placeholder, and computing with it raises instead of
    silently reading zeros (as FSDP2 refuses an unsharded read). ``_loom_freed`` holds the error message while
    the parameter is freed and is ``None`` while its bucket is gathered."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a property: its own name (``shape`` reads metadata, ``T`` computes)
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name not in _META_OPS:
            _refuse_compile()
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if type(t) is cls and t._loom_freed is not None:
                        raise RuntimeError(t._loom_freed)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _freed_message(name: str) -> str:
    module = name.rpartition(".")[0]
    where = f"module '{module}'" if module else "the root module"
    keep = f"keep=[model.{module}]" if module else "keep=[model]"
    return (f"ShardedDataParallel stage 3: parameter '{name}' was used outside the forward of its {where}, where "
            f"this rank holds only its shard (its bucket is not gathered, so the value would be a placeholder); "
            f"pass {keep} to ShardedDataParallel (its bucket then stays gathered from the start of forward "
            f"until its gradient is reduced), or read it inside that module's forward")
