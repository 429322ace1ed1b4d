"""Every ``LOOM_*`` runtime setting, declared once: name, type, default and one-line meaning.

Like mpi4py's ``rc``, an option is read through one accessor that rejects unknown names; like ``dask.config``,
the Dask backend's options are also keys under ``distributed.comm.mpi.*``. A value comes from, in order:

1. an explicit argument (``get("timeout", 30)``, or :func:`override` for a block of code);
2. the environment (``LOOM_TIMEOUT=30``);
3. Dask's config, for options that name a ``dask_key`` and only once ``dask.config`` has been imported
   (``dask.config.set({"distributed.comm.mpi.spin-us": 0})`` or ``DASK_DISTRIBUTED__COMM__MPI__SPIN_US=0``);
4. the declared default.

Booleans accept ``1/0``, ``true/false``, ``yes/no``, ``on/off`` in any case; anything else is a ``ValueError``
naming the variable. The environment is read at each call, so a test's ``monkeypatch.setenv`` takes effect.

:func:`launch_info` reads the rank and size that a launcher (MPICH/Hydra, Open MPI, PMIx, Slurm) gives each
process, for the code that must know them before MPI is initialized.

This module imports only the standard library: ``loom --help`` and the launcher read it without torch or MPI.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple

__all__ = ["Setting", "SETTINGS", "get", "launch_rank", "override", "parse_bool", "rc", "launch_info", "LaunchInfo",
           "markdown_table", "dask_defaults"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str | bool, name: str = "value") -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case, surrounding blanks ignored) -> bool."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{name}={text!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def _parse_float(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None


def _parse_int(text: str, name: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def _parse_list(text: str, name: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in str(text).split(",") if s.strip())


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "bool": parse_bool,
    "int": _parse_int,
    "float": _parse_float,
    "str": lambda text, name: str(text),
    "list": _parse_list,
}


@dataclass(frozen=True, slots=True)
class Setting:
    """One option: ``env`` is its variable, ``kind`` one of bool/int/float/str/list."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    #: lowest accepted value (numbers); ``positive`` excludes it
    minimum: float | None = None
    positive: bool = False
    #: key in Dask's config (``distributed.comm.mpi.*``), for the Dask backend's options
    dask_key: str | None = None
    #: set by loom for the processes it starts (read there, not meant to be set by hand)
    internal: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _PARSERS:
            raise ValueError(f"setting {self.name!r}: kind {self.kind!r}; valid: {', '.join(_PARSERS)}")
        if self.choices and self.default not in self.choices:
            raise ValueError(f"setting {self.name!r}: default {self.default!r} is not one of {self.choices}")

    @property
    def env(self) -> str:
        return "LOOM_" + self.name.upper()

    def parse(self, raw: Any, source: str | None = None) -> Any:
        """Parse and validate ``raw`` (a string from the environment, or an already typed value)."""
        label = source or self.env
        value = _PARSERS[self.kind](raw, label) if isinstance(raw, str) or self.kind == "bool" else raw
        if self.choices and value not in self.choices:
            raise ValueError(f"{label}={raw!r} is not a valid choice; valid: {', '.join(self.choices)}")
        if self.minimum is not None and value is not None:
            if value < self.minimum or (self.positive and value == self.minimum):
                rule = ">" if self.positive else ">="
                raise ValueError(f"{label}={raw!r} must be {rule} {self.minimum:g}")
        return value


_DECLARED = (
    # loom.comm
    Setting("check", "bool", False, "before every collective, ranks compare operation, dtype, shape and counts, "
            "and raise the same error on every rank when they differ"),
    Setting("timeout", "float", None, "seconds a rank may wait in one MPI call before a watchdog reports where "
            "every rank is stuck and aborts the job (unset: no watchdog)", minimum=0, positive=True),
    Setting("pairwise_bytes", "int", 16 << 20, "host allreduces and reduce-scatters of at least this many bytes "
            "(contiguous, of a dtype MPI reduces) exchange blocks with MPI and reduce them with torch, the "
            "rank-order fold, instead of MPI's own reduction (faster above it on one host; see `loom bench "
            "allreduce`)", minimum=0),
    Setting("cuda_aware", "bool", None, "hand CUDA tensors to MPI directly (unset: ask MPI whether it is "
            "CUDA-aware; else they are staged through host memory)"),
    Setting("doorbell", "bool", True, "pollers on one host ring each other awake through a Unix socket instead of "
            "backing off on timers (Linux with /dev/shm)", dask_key="distributed.comm.mpi.doorbell"),
    Setting("fine_timer", "bool", True, "poller back-off sleeps use a Linux timerfd instead of asyncio's timers, "
            "which round every sleep up to a millisecond"),
    Setting("mpiexec", "str", None, "the launcher `loom --ranks N` and the tests use (unset: the venv's "
            "mpiexec, then the first on PATH)"),
    Setting("launched", "bool", False, "this process is a rank that loom's launcher started: `--ranks N` "
            "does not launch again", internal=True),
    # loom.parallel, loom.train
    Setting("attn_kernel", "str", "auto", "FPDT's attention block kernel: flash (SDPA kernels with log-sum-exp: "
            "CPU flash; CUDA flash or memory-efficient), torch (tiled pure-torch blocks), auto (flash where "
            "available)",
            choices=("auto", "flash", "torch")),
    Setting("threads", "int", 1, "torch intra-op threads per rank in `loom train` (ranks already share the "
            "cores)", minimum=1),
    Setting("progress", "str", "auto", "`loom train` progress display: bar, lines, none, or auto (a bar on a "
            "terminal, lines otherwise)", choices=("auto", "bar", "lines", "none")),
    # loom.torchdist
    Setting("torch_compress", "str", None, "codecs for the \"loom\" torch.distributed backend's allreduces, per "
            "group: GROUP=CODEC;GROUP=CODEC, GROUP a DeviceMesh dim name or world (e.g. dp=int8;tp=bf16)"),
    Setting("torch_multipath", "str", None, "topologies under which the \"loom\" torch.distributed backend's "
            "all_to_all_single goes through loom.multipath's planned relay paths, per group: GROUP=TOPOLOGY;..., "
            "TOPOLOGY auto, a preset or a TOML file as in [multipath] topology, optionally :min_bytes=N (e.g. "
            "ep=auto or ep=topo.toml:min_bytes=262144); groups of one node or one rail stay on MPI's alltoallv"),
    # loom.dask
    Setting("dask_spin_us", "float", None, "microseconds the Dask backend's poller tests at full speed after "
            "activity before backing off (unset: 1000 with a core per rank; when oversubscribed 0 with "
            "doorbells, 200 without)", minimum=0, dask_key="distributed.comm.mpi.spin-us"),
    Setting("dask_inline_us", "float", None, "microseconds a read right after a write on the same Dask comm "
            "waits inline for the reply (unset: 50 with a core per rank, 0 when oversubscribed)", minimum=0,
            dask_key="distributed.comm.mpi.inline-us"),
    Setting("dask_verbose", "bool", False, "`loom dask` prints the scheduler address and the rank roles",
            dask_key="distributed.comm.mpi.verbose"),
    Setting("dask_roles", "str", None, "file where `loom dask` ranks write the pid -> rank -> role map",
            internal=True),
    # loom.testbed: set for every rank a testbed starts
    Setting("testbed_topology", "str", None, "JSON file with the running testbed's topology", internal=True),
    Setting("testbed_node", "int", None, "this rank's emulated node", internal=True),
    Setting("testbed_local_rank", "int", None, "this rank's index on its node", internal=True),
    Setting("testbed_rail", "int", None, "this rank's rail (NIC)", internal=True),
    Setting("testbed_ranks_per_node", "int", None, "ranks per emulated node", internal=True),
    # loom.testing
    Setting("tag_ub", "int", None, "a lower MPI tag ceiling than the MPI's own MPI_TAG_UB, to run the checks as "
            "under a smaller MPI (e.g. 32767, the standard's minimum)", minimum=1),
    Setting("only", "list", (), "comma-separated check_* names that a tests/mpi script runs (debugging)"),
    Setting("test_seed", "int", None, "the seed a tests/mpi check draws its random data from (unset: a fresh one "
            "per check; a failing check prints its seed, so this replays it)", minimum=0),
)

#: every option by name (the lower-case ``LOOM_`` suffix)
SETTINGS: Mapping[str, Setting] = {s.name: s for s in _DECLARED}

_OVERRIDES: dict[str, Any] = {}
_UNSET = object()


def _setting(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown loom setting {name!r}; valid: {', '.join(SETTINGS)}") from None


def _dask_value(key: str) -> Any:
    config = sys.modules.get("dask.config")
    if config is None:  # only a process that uses Dask has Dask settings; importing dask here would cost ~0.3 s
        return None
    return config.get(key, None)


def get(name: str, explicit: Any = None, *, fallback: Any = None,
        environ: Mapping[str, str] | None = None) -> Any:
    """The value of option ``name``: ``explicit`` if not None, else an :func:`override`, else ``$LOOM_NAME``,
    else Dask's config key (Dask options), else the default. ``fallback`` replaces a ``None`` result (for an
    option whose default the caller computes). Raises ``ValueError`` for an unknown name or a value that does
    not parse."""
    value = _get(name, explicit, os.environ if environ is None else environ)
    return fallback if value is None else value


def _get(name: str, explicit: Any, environ: Mapping[str, str]) -> Any:
    s = _setting(name)
    if explicit is not None:
        return s.parse(explicit, source=s.name)
    value = _OVERRIDES.get(name, _UNSET)
    if value is not _UNSET:
        return value
    raw = environ.get(s.env)
    if raw is not None and raw.strip() != "":
        return s.parse(raw)
    if s.dask_key is not None:
        value = _dask_value(s.dask_key)
        if value is not None:
            return s.parse(value, source=s.dask_key)
    return s.default


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Within the block, ``get(name)`` returns ``values[name]`` whatever the environment says."""
    parsed = {name: _setting(name).parse(v, source=name) if v is not None else None for name, v in values.items()}
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(parsed)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


class _RC:
    """``rc.doorbell`` reads an option, ``rc.doorbell = False`` overrides it for this process (mpi4py style);
    a misspelt name is an ``AttributeError`` listing the valid ones."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if name not in SETTINGS:
            raise AttributeError(f"unknown loom setting {name!r}; valid: {', '.join(SETTINGS)}")
        return get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in SETTINGS:
            raise AttributeError(f"unknown loom setting {name!r}; valid: {', '.join(SETTINGS)}")
        if value is None:
            _OVERRIDES.pop(name, None)
        else:
            _OVERRIDES[name] = SETTINGS[name].parse(value, source=name)

    def __dir__(self) -> list[str]:
        return list(SETTINGS)


rc = _RC()


def dask_defaults() -> dict:
    """The ``distributed.comm.mpi`` defaults as a nested dict for ``dask.config.update_defaults``."""
    mpi: dict[str, Any] = {}
    for s in _DECLARED:
        if s.dask_key is not None:
            mpi[s.dask_key.rsplit(".", 1)[1]] = s.default
    return {"distributed": {"comm": {"mpi": mpi}}}


class LaunchInfo(NamedTuple):
    """Where a launcher put this process; ``local_*`` are ``None`` where the launcher does not say."""

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    launcher: str


# (launcher, rank, size, local rank, local size): the first whose rank and size are both set wins.
_LAUNCHERS = (
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    # SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: only srun's tasks have it, a batch script's shell does not.
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)


def _int_env(env: Mapping[str, str], var: str | None) -> int | None:
    raw = env.get(var, "").strip() if var else ""
    return int(raw) if raw.isdigit() else None


def launch_info(environ: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """Rank and size from the launcher's environment (MPICH/Hydra, Open MPI, PMIx, Slurm), or ``None`` when
    no launcher started this process. Readable before MPI is initialized (and without importing it)."""
    env = os.environ if environ is None else environ
    for launcher, rank_var, size_var, lrank_var, lsize_var in _LAUNCHERS:
        rank, size = _int_env(env, rank_var), _int_env(env, size_var)
        if launcher == "pmix" and rank is not None and size is None:
            size = _int_env(env, "OMPI_COMM_WORLD_SIZE")
        if rank is not None and size is not None:
            return LaunchInfo(rank, size, _int_env(env, lrank_var), _int_env(env, lsize_var), launcher)
    return None


def launch_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank from its launcher, 0 outside one."""
    info = launch_info(environ)
    return 0 if info is None else info.rank


def _default_text(s: Setting) -> str:
    if s.default is None:
        return "unset"
    if s.kind == "bool":
        return "1" if s.default else "0"
    if s.kind == "list":
        return ",".join(s.default) or "unset"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


def markdown_table() -> str:
    """The table of settings on the site's settings page (``scripts/build_docs.py`` puts it in
    docs/reference/settings.md)."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for s in _DECLARED:
        kind = "/".join(s.choices) if s.choices else s.kind
        doc = s.doc + (f"; Dask config `{s.dask_key}`" if s.dask_key else "")
        doc += " (set by loom for the processes it starts)" if s.internal else ""
        rows.append(f"| `{s.env}` | {kind} | {_default_text(s)} | {doc} |")
    return "\n".join(rows) + "\n"
