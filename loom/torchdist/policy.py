"""Per-group policies of the ``"loom"`` backend: a codec per group (compression), a topology per group
(multi-path all-to-all), and :class:`exact`, under which a thread's reductions are never compressed.

Groups are keyed by DeviceMesh dim name (a group described ``mesh_dp`` is ``dp``) or ``world`` (the default
group). The process group (:mod:`loom.torchdist.backend`) reads its group's entry when torch names the group.
"""

from __future__ import annotations

import threading

__all__ = ["exact", "set_compression", "set_multipath", "compression_for", "route_for", "exact_depth"]

_POLICY: dict[str, str] | None = None  # group key -> codec spec (None: read LOOM_TORCH_COMPRESS when first needed)
_EXACT = threading.local()
_ROUTES: dict[str, tuple[str, int]] | None = None  # group key -> (topology spec, min_bytes) (set_multipath)


def set_compression(policy: "dict[str, str] | str | None") -> None:
    """Codecs for the allreduces and reduce-scatters of groups made from now on: ``{"dp": "int8", "tp": "bf16"}``
    or the text form of ``LOOM_TORCH_COMPRESS`` (``"dp=int8;tp=bf16"``); ``None``/``{}`` for none. Keys are
    DeviceMesh dim names (a group described ``mesh_dp`` is ``dp``) or ``world`` (the default group: also a 1-D
    mesh over every rank, which torch serves with the default group).

    A compressed allreduce is :func:`loom.compress.allreduce` (its plan and error bound) of a floating tensor
    of at least the codec's minimum size under SUM, AVG or PREMUL_SUM; a compressed reduce-scatter
    (``reduce_scatter_tensor``, ``reduce_scatter``: FSDP2's gradients) is :func:`loom.compress.reduce_scatter`
    (one quantization of each rank's input). Inside a backward pass both keep error feedback per call (DDP's
    buckets and FSDP2's groups are reduced in the same order every step); outside one, none (each call within
    its codec's bound). PowerSGD compresses allreduces only: a reduce-scatter on a powersgd group raises
    ``ValueError``. MIN, MAX, PRODUCT, integers, and everything inside :func:`exact` run uncompressed. Bytes
    raw and on the wire per group: ``loom.compress.stats()`` (the ``compress`` kind of ``loom.stats``), under
    the group's communicator name (``torch.mesh_dp``, ``torch`` for the world).
    """
    global _POLICY
    _POLICY = _parse_policy(policy, "set_compression") if isinstance(policy, str) else dict(policy or {})
    from loom.compress import get_codec

    for spec in _POLICY.values():
        get_codec(spec)  # a bad codec name fails here, on every rank, not at the first step


def _parse_policy(text: str, where: str, value: str = "CODEC", example: str = "dp=int8;tp=bf16") -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        key, eq, spec = item.partition("=")
        if not eq or not key.strip() or not spec.strip():
            raise ValueError(f"{where}: {item!r} is not GROUP={value}; write e.g. {example}")
        if "," in spec.partition(":")[0]:
            raise ValueError(f"{where}: {item!r}: separate groups with ';' (options use ','), e.g. {example}")
        out[key.strip()] = spec.strip()
    return out


def _policy() -> dict[str, str]:
    if _POLICY is None:
        import loom.settings as settings

        set_compression(_parse_policy(settings.get("torch_compress") or "", "LOOM_TORCH_COMPRESS"))
    return _POLICY or {}


def set_multipath(policy: "dict[str, str] | str | None") -> None:
    """Topologies for the ``all_to_all_single`` of groups made from now on: ``{"ep": "auto"}`` or the text form
    of ``LOOM_TORCH_MULTIPATH`` (``"ep=auto"``, ``"world=topo.toml:min_bytes=262144"``); ``None``/``{}`` for none.
    Keys as :func:`set_compression`'s (DeviceMesh dim names, ``world``).

    A topology is what loom's own MoE layers take (``[multipath] topology`` of ``loom train``,
    :func:`loom.parallel.moe.use_multipath`): ``auto`` (found from the machine), a preset fitted to the group
    (``testbed``, ``h100``, ...) or a TOML file, resolved for the group's ranks by
    :func:`loom.multipath.detect.resolve` at the group's first ``all_to_all_single`` (collective, as every
    collective of the group). ``min_bytes`` is the relay's per-pair threshold (default 1 MiB, as
    ``[multipath] min_bytes``). Under a topology of several nodes and several rails the group's
    ``all_to_all_single`` runs :func:`loom.multipath.alltoallv` (planned per call from the counts; pairs below
    ``min_bytes`` and balanced traffic stay on their direct routes); otherwise, and for every group not listed,
    MPI's alltoallv. The relay's bytes count in ``loom.stats`` (``comm`` kind) under the group's communicator
    name (``torch.mesh_ep``), as ``send`` (every hop's point-to-point leg) and ``allgather`` (the agreement on
    the counts) instead of ``alltoallv``.
    """
    _set_routes(policy, "set_multipath")


def _set_routes(policy: "dict[str, str] | str | None", where: str) -> None:
    global _ROUTES
    raw = _parse_policy(policy, where, "TOPOLOGY", "ep=auto") if isinstance(policy, str) else dict(policy or {})
    _ROUTES = {key: _route(spec, f"{where}: {key}={spec}") for key, spec in raw.items()}


def _route(spec: str, where: str) -> tuple[str, int]:
    """``(topology spec, min_bytes)`` of ``TOPOLOGY[:min_bytes=N]``, the topology checked without communicating
    (``auto`` is found at the first all-to-all)."""
    from loom.multipath.detect import resolve_fixed

    topo, _, opts = spec.partition(":")
    min_bytes = 1 << 20
    for item in filter(None, (x.strip() for x in opts.split(","))):
        key, eq, val = item.partition("=")
        if key.strip() != "min_bytes" or not eq or not val.strip().isdigit():
            raise ValueError(f"{where}: option {item!r} is not min_bytes=N (N >= 0 bytes); write e.g. "
                             f"ep=auto:min_bytes=262144")
        min_bytes = int(val)
    topo = topo.strip()
    if topo != "auto":
        try:
            resolve_fixed(topo)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return topo, min_bytes


def _routes() -> dict[str, tuple[str, int]]:
    if _ROUTES is None:
        import loom.settings as settings

        _set_routes(settings.get("torch_multipath") or "", "LOOM_TORCH_MULTIPATH")
    return _ROUTES or {}


class exact:
    """A context in which this thread's reductions on the loom backend are never compressed (a loss, a norm,
    a count: anything that must stay exact)::

        with loom.torchdist.exact():
            dist.all_reduce(total_tokens)
    """

    def __enter__(self) -> "exact":
        _EXACT.depth = getattr(_EXACT, "depth", 0) + 1
        return self

    def __exit__(self, *exc) -> None:
        _EXACT.depth -= 1


def compression_for(key: str) -> str | None:
    """The codec spec of the group keyed ``key`` under the compression policy, or ``None``."""
    return _policy().get(key)


def route_for(key: str) -> tuple[str, int] | None:
    """``(topology spec, min_bytes)`` of the group keyed ``key`` under the multi-path policy, or ``None``."""
    return _routes().get(key)


def exact_depth() -> int:
    """How many :class:`exact` contexts this thread is in (0: reductions may be compressed)."""
    return getattr(_EXACT, "depth", 0)
