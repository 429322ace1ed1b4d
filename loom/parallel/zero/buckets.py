"""The layout: trainable parameters in buckets, flat blocks of them, and a meta model built bucket by bucket.

Layout. The trainable parameters are grouped, module by module in registration order, into *buckets* of at
most ``bucket_mb`` MiB (a module's direct parameters never straddle two buckets). Bucket ``b`` is one flat
vector of ``N_b`` elements padded to ``P * S_b`` (``P`` ranks in the group, ``S_b = ceil(N_b / P)``); rank
``r`` owns elements ``[r S_b, (r+1) S_b)``: this rank's block of each bucket is one flat *master* parameter
(``shards[b]``, in the parameters' dtype). The optimizer, any ``torch.optim`` class, steps on these alone,
so its state is sharded at every stage >= 1; a block's gradient is allocated when its first reduction
arrives (as a parameter's ``.grad`` in one process), so gradients grow during backward instead of sitting
allocated all step. Frozen parameters and buffers stay replicated: broadcast from group rank 0 at
construction, as DDP does (so are the trainable parameters, at every stage), and buffers again around every
forward that changed one (:meth:`loom.parallel.ShardedDataParallel.sync_buffers`).

Construction from the meta device: a model built under ``torch.device("meta")`` (same seed on every rank) is
materialised by :mod:`loom.parallel.meta`, its values those of a plain build from that seed. At stage 3 this
runs bucket by bucket (:class:`_MetaSource`): the bucket's tensors are initialised (a ``reset_parameters``
replay restarts from the stream's state at construction for each bucket, drawing for the rest of the model on
one scratch module at a time), this rank's block is copied into its master shard and the full tensors are
dropped, so the storage live during construction is the shards, the replicated state and about one bucket. No
broadcast is needed: every rank computes the same values. Stages 0-2 keep every parameter whole and
materialise it whole.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...comm import Request
from ..meta import Init, check_initialisable, is_meta, materialize


class _Bucket:
    """One flat group of parameters and its per-step state."""

    __slots__ = ("index", "params", "names", "offsets", "numel", "padded", "shard", "start", "owners",
                 "full", "req", "grad", "ready", "posted", "group", "had", "fresh", "host", "ev", "bound")

    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]], size: int):
        self.index = index
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shard = -(-off // size)
        self.padded = self.shard * size
        self.start = 0  # offset of this bucket's block in this rank's blocks laid end to end (checkpoints)
        self.owners = 0  # modules with direct parameters here (stage 3 frees after the last one ran)
        self.full: torch.Tensor | None = None  # gathered parameters (compute dtype), or None
        self.req: Request | None = None  # pending gather into ``full``
        self.grad: torch.Tensor | None = None  # this backward's flat gradient (master dtype)
        self.ready = 0  # parameters whose gradient arrived in this backward
        self.posted = False  # reduce-scatter of this backward posted
        self.group = 0  # parameter group (optim_groups)
        self.had = [False] * len(self.params)  # each parameter's gradient arrived here since ``fresh`` was set
        self.fresh = True  # the shard's gradient was None when this accumulation began (missing_grad="skip")
        self.host: torch.Tensor | None = None  # staged gather: the host buffer MPI gathers into
        self.ev: Any = None  # staged gather: the event of its host -> device copy into ``full``
        self.bound = False  # the parameters are views of ``full``

    def layout(self) -> dict[str, Any]:
        lay = {"names": self.names, "shapes": [list(p.shape) for p in self.params], "numel": self.numel}
        if self.group:
            lay["group"] = self.group
        return lay

    def flat(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``tensors`` (one per parameter, shaped like it; ``None``: zeros) as the bucket's padded flat vector."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for p, off, t in zip(self.params, self.offsets, tensors):
            if t is not None:
                flat[off:off + p.numel()].copy_(t.reshape(-1))
        return flat


def _make_buckets(module: nn.Module, size: int, cap: int, group_of: dict[str, int] | None = None,
                  per_module: bool = False) -> tuple[list[_Bucket], dict[nn.Module, list[int]]]:
    """Buckets of the trainable parameters, module by module; and the buckets each module's direct params use.
    ``per_module``: a bucket holds one module's direct parameters at most (``missing_grad="skip"``).

    With parameter groups (``group_of``: parameter name -> group) every bucket holds one group's parameters:
    each group fills its own open bucket, numbered when it opens, so buckets stay in first-use order."""
    group_of = group_of or {}
    lists: list[list[tuple[str, nn.Parameter]]] = []
    groups: list[int] = []
    sizes: list[int] = []
    open_: dict[int, int] = {}  # group -> index of its open bucket
    where: dict[int, int] = {}
    owners: dict[nn.Module, list[int]] = {}
    dtype = None
    for mname, m in module.named_modules():
        own: set[int] = set()
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if id(p) in where:
                own.add(where[id(p)])
                continue
            if dtype is not None and p.dtype != dtype:
                raise ValueError(f"ShardedDataParallel: trainable parameters have mixed dtypes ({dtype} and "
                                 f"{p.dtype} at {mname + '.' if mname else ''}{pname}); cast the module to one")
            dtype = p.dtype
            k = group_of.get(f"{mname}.{pname}" if mname else pname, 0)
            if k not in open_:
                open_[k] = len(lists)
                lists.append([])
                groups.append(k)
                sizes.append(0)
            i = open_[k]
            lists[i].append((f"{mname}.{pname}" if mname else pname, p))
            sizes[i] += p.numel() * p.element_size()
            where[id(p)] = i
            own.add(i)
        if own:
            owners[m] = sorted(own)
        for k, i in list(open_.items()):  # a module's direct parameters never straddle two buckets of a group
            if sizes[i] >= cap or per_module and own:
                del open_[k]
    buckets = [_Bucket(i, named, size) for i, named in enumerate(lists)]
    for bk, k in zip(buckets, groups):
        bk.group = k
    for bs in owners.values():
        for i in bs:
            buckets[i].owners += 1
    return buckets, owners


def _parse_groups(module: nn.Module, groups: Sequence[dict[str, Any]] | None
                  ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Each group's options (without ``params``) and parameter name -> group; trainable parameters no group
    lists form one more group with no options (the optimizer's defaults)."""
    if groups is None:
        return [{}], {}
    if isinstance(groups, dict) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("ShardedDataParallel: groups must be a list of dicts with a 'params' entry each, as for "
                        "a torch optimizer: [{'params': decay, 'weight_decay': 0.1}, {'params': rest, ...}]")
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names.setdefault(id(p), []).append(n)
    opts, group_of, seen = [], {}, set()
    for k, g in enumerate(groups):
        opts.append({key: v for key, v in g.items() if key != "params"})
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in ps:
            if id(p) not in names:
                raise ValueError(f"ShardedDataParallel: groups[{k}] lists a tensor of shape {tuple(p.shape)} that "
                                 f"is not a trainable parameter of the module; list the module's own parameters")
            if id(p) in seen:
                raise ValueError(f"ShardedDataParallel: parameter '{names[id(p)][0]}' is in more than one group "
                                 f"(groups[{k}] again); give each parameter one group")
            seen.add(id(p))
            for n in names[id(p)]:
                group_of[n] = k
    if len(seen) < len(names):
        k = len(opts)
        opts.append({})
        for i, ns in names.items():
            if i not in seen:
                for n in ns:
                    group_of[n] = k
    return opts, group_of


def _flat_block(ps: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor | None], lo: int, n: int,
                dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[lo, lo + n)`` of the zero-padded concatenation of ``tensors`` (shaped like ``ps``), without
    building the concatenation; written into ``out`` (zeros of ``n`` elements) when given."""
    device = next((p.device for p in ps if not p.is_meta), torch.device("cpu"))
    out = torch.zeros(n, dtype=dtype, device=device) if out is None else out
    off = 0
    for p, t in zip(ps, tensors):
        a, b = max(off, lo), min(off + p.numel(), lo + n)
        if t is not None and a < b:
            out[a - lo:b - lo] = t.detach().reshape(-1)[a - off:b - off]
        off += p.numel()
    return out


class _MetaSource:
    """A model on the meta device, materialised group of tensors by group (:mod:`loom.parallel.meta`).

    With a name-based initialiser (``init=`` or the model's ``init_parameter``) a group's values never depend on
    the others. Replaying ``reset_parameters()`` draws from torch's global stream, so every group's replay
    starts from the stream's state at construction: each equals the same tensors of one whole build, and after
    the last the stream stands where a whole build leaves it. The price is one replay of the whole model's
    initialisation per group (on scratch storage, so memory stays one group): a large model without a
    name-based initialiser takes buckets x one initialisation to build.
    """

    def __init__(self, module: nn.Module, init: Init | None, device: torch.device):
        self.module, self.init, self.device = module, init, device
        replay = init is None and not callable(getattr(module, "init_parameter", None))
        self.start = torch.get_rng_state() if replay else None
        self.end: torch.Tensor | None = None

    @classmethod
    def open(cls, module: nn.Module, init: Init | None, stage: int, device: torch.device
             ) -> "_MetaSource | None":
        """``None`` unless ``module`` is on meta and ``stage`` is 3: stages 0-2 keep every parameter whole, so
        they are materialised whole here. At stage 3 the replicated state (buffers, frozen parameters) is."""
        if not is_meta(module):
            return None
        check_initialisable(module, init)  # depends on the model only: every rank refuses alike, before allocating
        if stage < 3:
            materialize(module, init=init, device=device)
            return None
        src = cls(module, init, device)
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        src.take([n for n in (*dict(module.named_parameters()), *dict(module.named_buffers())) if n not in trainable])
        return src

    def take(self, names: Sequence[str]) -> None:
        """Materialise the tensors ``names``; the others stay on meta."""
        if self.start is not None:
            torch.set_rng_state(self.start)
        if materialize(self.module, names, init=self.init, redraw=True, device=self.device) and self.start is not None:
            self.end = torch.get_rng_state()

    def finish(self) -> None:
        if self.end is not None:
            torch.set_rng_state(self.end)
