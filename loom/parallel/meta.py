"""Give a model built on the meta device real storage for the tensors this rank keeps, one tensor at a time.

A model too large for one rank is built with ``with torch.device("meta"): model = Net()``: every parameter
and buffer has a shape and a dtype but no storage. :func:`materialize` then allocates and initialises only the
tensors this rank keeps (a pipeline stage, a ZeRO-3 shard's owners), so peak memory during construction is
what the rank keeps plus one tensor (or one module, below) in flight, not the whole model.

The weights equal those of the same model built on CPU from the same seed, because the initialisation is
replayed rather than invented. The initialiser is, in this order:

1. ``init=`` given to :func:`materialize`: ``init(name, tensor)`` fills ``tensor`` in place;
2. ``module.init_parameter(name, tensor)`` when the model defines it (:class:`loom.models.llama.Llama` does: each
   tensor's values depend only on its name, so tensors that are not kept are never generated);
3. otherwise every submodule's ``reset_parameters()``, in registration order, which is the order a plain
   construction ran them in, so torch's global random stream is consumed exactly as then: a module whose
   tensors are not kept is still initialised (one module in flight), then handed back to meta. The replay
   starts from the stream's current state, so seed (or draw nothing) between the meta build and this call
   as a plain build would have found it: ``torch.manual_seed(s)``, build on meta, materialise.

A tensor that must be kept and that none of these can initialise is a :class:`ValueError`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
from torch import nn

__all__ = ["materialize", "meta_names", "is_meta", "check_initialisable", "init_as_built"]

Init = Callable[[str, torch.Tensor], None]


def guard_device_constructors() -> None:
    """Make ``with torch.device("meta"):`` see torch's own factory functions.

    torch computes the set of factory functions a device context redirects once, on first use, from the
    attributes of ``torch`` at that moment. transformers' ``from_pretrained`` enters a meta device context and
    then swaps ``torch.linspace`` for a wrapper, so when it is the process's first device context the set holds
    the wrapper and, ever after, ``torch.linspace`` under ``torch.device("meta")`` allocates real CPU storage
    (a raw parameter built from it stays real and skips every meta check). Computing the set now, with torch's
    functions in place, or recomputing it when it was taken from a wrapper, keeps meta construction whole.
    """
    from torch.utils import _device

    make = getattr(_device, "_device_constructors", None)
    if make is None or not hasattr(make, "cache_clear"):
        return
    if torch.linspace not in make():
        make.cache_clear()
        make()


guard_device_constructors()


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def meta_names(module: nn.Module) -> list[str]:
    """Names (``named_parameters`` / ``named_buffers`` style, tied tensors once) of the tensors still on meta."""
    return [n for n, t in _named(module).items() if t.is_meta]


def _named(module: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out.update(dict(module.named_buffers()))
    return out


def _owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """``id(tensor) -> [(owning module, attribute, is_parameter)]`` (a tied tensor has several owners)."""
    out: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, k, True))
        for k, b in m._buffers.items():
            if b is not None:
                out.setdefault(id(b), []).append((m, k, False))
    return out


def _put(owners: list[tuple[nn.Module, str, bool]], old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Install ``new`` wherever ``old`` was (a Parameter stays a Parameter, with its ``requires_grad``)."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for m, k, is_param in owners:
        (m._parameters if is_param else m._buffers)[k] = new
    return new


def _keep_fn(keep: Callable[[str], bool] | Collection[str] | None) -> Callable[[str], bool]:
    if keep is None:
        return lambda name: True
    if callable(keep):
        return keep
    names = set(keep)
    return lambda name: name in names


def materialize(module: nn.Module, keep: Callable[[str], bool] | Collection[str] | None = None, *,
                init: Init | None = None, device: Any = "cpu", dtype: torch.dtype | None = None,
                redraw: bool = False) -> list[str]:
    """Allocate and initialise the meta tensors of ``module`` that ``keep`` selects; the others stay on meta.

    Args:
        module: a model built under ``torch.device("meta")`` (tensors already real are left alone).
        keep: names to keep (a collection, or a predicate on the name); ``None`` keeps every tensor. Names are
            those of ``module.named_parameters()`` and ``named_buffers()`` (a tied tensor under its first name).
        init: ``init(name, tensor)`` filling one tensor in place; default ``module.init_parameter`` when the
            model defines it, else the submodules' ``reset_parameters()`` replayed in registration order.
        device: where the kept tensors live.
        dtype: cast floating-point kept tensors to this dtype after initialisation (initialisation itself runs
            in the dtype the model was built with, so the values equal a plain build followed by ``.to(dtype)``).
        redraw: when replaying ``reset_parameters()``, also run it for modules whose tensors are real already
            (on scratch tensors; theirs are left as they are), so the stream is consumed as by a whole build:
            for materialising a model in several calls, each started from the same stream state.

    Returns:
        The names materialised, in model order.

    Raises:
        ValueError: a kept tensor that no initialiser covers (e.g. a buffer computed in ``__init__``, or a
            module without ``reset_parameters``): the message names it and the ways to provide one.
    """
    want = _keep_fn(keep)
    named = _named(module)
    todo = [n for n, t in named.items() if t.is_meta and want(n)]
    if not todo:
        return []
    fill = init if init is not None else getattr(module, "init_parameter", None)
    owners = _owners(module)
    if fill is not None:
        for name in todo:
            old = named[name]
            t = torch.empty(old.shape, dtype=old.dtype, device=device)
            with torch.no_grad():
                fill(name, t)
            _put(owners[id(old)], old, _cast(t, dtype))
        return todo
    return _replay(module, named, set(todo), owners, device, dtype, redraw)


def init_as_built(module: nn.Module, init: Init | None = None) -> Init:
    """An ``init(name, tensor)`` that fills each tensor in the dtype ``module`` was built with and casts it into
    ``tensor``: for a meta model cast with ``.to(dtype)`` before it is materialised by a wrapper that takes
    ``init=``, so the values equal a plain build followed by ``.to(dtype)``. Needs a name-based initialiser
    (``init``, else the model's ``init_parameter``); call it before the cast."""
    fill = init if init is not None else getattr(module, "init_parameter", None)
    if not callable(fill):
        raise ValueError(f"init_as_built: {type(module).__name__} has no init_parameter(name, tensor) and no init= "
                         f"was given; a reset_parameters() replay runs in the dtype the model has when replayed")
    built = {n: t.dtype for n, t in _named(module).items()}

    def init_fn(name: str, tensor: torch.Tensor) -> None:
        if built[name] == tensor.dtype:
            fill(name, tensor)
            return
        tmp = torch.empty(tensor.shape, dtype=built[name], device=tensor.device)
        fill(name, tmp)
        tensor.copy_(tmp)

    return init_fn


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def check_initialisable(module: nn.Module, init: Init | None = None) -> None:
    """Raise :class:`ValueError` if some meta tensor of ``module`` has no initialiser (see the module docstring).

    Depends only on the model, so every rank of a job reaches the same verdict before any of them materialises.
    """
    if init is not None or callable(getattr(module, "init_parameter", None)):
        return
    named = _named(module)
    owners = _owners(module)
    uncovered = [n for n, t in named.items() if t.is_meta and not _reset_owner(owners[id(t)])]
    if uncovered:
        raise ValueError(
            f"cannot initialise {uncovered[0]!r} ({len(uncovered)} tensor(s) in all) of a model on the meta device: "
            f"its module has no reset_parameters() and the model no init_parameter(name, tensor); pass "
            f"init=fn(name, tensor), give the model an init_parameter method, or build it on a real device")


def _replay(module: nn.Module, named: dict[str, torch.Tensor], todo: set[str], owners, device: Any,
            dtype: torch.dtype | None, redraw: bool = False) -> list[str]:
    """Run every submodule's ``reset_parameters`` in registration order on freshly allocated tensors (with
    ``redraw``, also those whose tensors are all real already, on scratch copies, to advance the stream)."""
    name_of = {id(t): n for n, t in named.items()}
    check_initialisable(module)
    done: list[str] = []
    for m in module.modules():
        slots = [(d, k) for d in (m._parameters, m._buffers) for k, t in d.items() if t is not None]
        if any(d[k].is_meta for d, k in slots) or redraw and slots:
            if callable(getattr(m, "reset_parameters", None)):
                done += _replay_one(m, slots, name_of, todo, owners, device, dtype)
    order = {n: i for i, n in enumerate(named)}
    return sorted(done, key=order.__getitem__)


def _replay_one(m: nn.Module, slots, name_of, todo: set[str], owners, device: Any,
                dtype: torch.dtype | None) -> list[str]:
    """``m.reset_parameters()`` on fresh tensors; returns the names kept. The tensors not kept are released
    when this returns, so one module is in flight at a time."""
    mine = [d[k] for d, k in slots if d[k].is_meta]
    kept = {(id(d), k): d[k] for d, k in slots if not d[k].is_meta}  # real already: scratch stands in
    for d, k in slots:
        if (id(d), k) in kept:
            d[k] = _like(d[k], torch.empty(d[k].shape, dtype=d[k].dtype, device=device))
    real = {id(t): _put(owners[id(t)], t, torch.empty(t.shape, dtype=t.dtype, device=device)) for t in mine}
    with torch.no_grad():
        m.reset_parameters()
    for d, k in slots:
        if (id(d), k) in kept:
            d[k] = kept[(id(d), k)]
    done = []
    for t in mine:
        name = name_of.get(id(t))
        new = real[id(t)]
        if name in todo:
            _put(owners[id(t)], new, _cast(new.detach(), dtype))
            done.append(name)
        else:  # initialised only to keep the random stream in step: back to meta
            _put(owners[id(t)], new, torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return done


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new


def _reset_owner(owners: list[tuple[nn.Module, str, bool]]) -> bool:
    return any(callable(getattr(m, "reset_parameters", None)) for m, _, _ in owners)
