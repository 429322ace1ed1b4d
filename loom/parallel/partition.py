"""Capture a model as a graph of layers and split it into pipeline stages.

Vocabulary: a *node* is one call in the model's forward (a module, a function, a method, a parameter read);
a *unit* (a "layer" in error messages) is the smallest piece a stage boundary may not cut -- one node, or a
parameter read glued to the node that consumes it; a *stage* is a contiguous run of units; the *live set* of
the boundary after stage ``s`` is every value made at or before ``s`` that a later stage (or the output) reads.
Graph inputs are never live: every stage rank of a replica holds the same batch (HyPar-Flow's layout), so a
skip connection from the input costs nothing, and one from stage 0 to stage 3 crosses 1 and 2 hop by hop.

Three front ends build the same :class:`Graph`, after the graph sources that integrations register:

* a registered graph source (:func:`register_graph_source`) -- a library integration that knows how to split
  the models of its library (``loom.integrations.transformers`` registers Hugging Face decoders when imported),
  so this module never imports an integration;
* ``nn.Sequential`` -- one unit per child;
* any ``nn.Module`` that ``torch.fx.symbolic_trace`` can trace -- one node per graph node; failing that, and
  given a sample micro-batch, ``torch.export`` (aten-level nodes, specialised to the sample's shapes);
* Keras 3 models on the torch backend (``KERAS_BACKEND=torch``): ``keras.Sequential`` by its layer list and
  Functional models by walking Keras's own node graph (``_nodes_by_depth``), since Keras layers are not
  registered as torch child modules.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["Ref", "Node", "Graph", "capture", "balance", "split_units", "TraceError", "register_graph_source",
           "graph_sources"]


class TraceError(TypeError):
    """The model cannot be captured as a graph; the message names the construct and the fix."""


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to the value named ``name`` (a graph input or a node's result)."""

    name: str


@dataclass(slots=True)
class Node:
    """One call of the forward pass.

    Attributes:
        name: unique value name of the result.
        fn: called as ``fn(*args, **kwargs)`` once the :class:`Ref` s in ``args``/``kwargs`` are resolved.
        args: positional arguments (may nest tuples/lists/dicts holding ``Ref`` s).
        kwargs: keyword arguments (same).
        params: tensors (parameters and buffers) this call reads from the model; its stage owns them.
        label: human-readable description for errors and tables.
        training_arg: pass ``training=`` (train/eval mode) to the call (Keras layers whose ``call`` takes it:
            Dropout, BatchNormalization; torch modules use ``module.train()`` instead).
    """

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    params: tuple[torch.Tensor, ...] = ()
    label: str = ""
    training_arg: bool = False


def _map(obj: Any, f: Callable[[Ref], Any]) -> Any:
    if isinstance(obj, Ref):
        return f(obj)
    if isinstance(obj, tuple):
        return tuple(_map(o, f) for o in obj)
    if isinstance(obj, list):
        return [_map(o, f) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, f) for k, v in obj.items()}
    return obj


def _refs(obj: Any) -> list[str]:
    out: list[str] = []
    _map(obj, lambda r: out.append(r.name))
    return out


@dataclass(slots=True)
class Graph:
    """A model as inputs, nodes in execution order, units, and an output structure of :class:`Ref` s.

    Attributes:
        inputs: names of the graph inputs, in call order.
        nodes: every call, topologically ordered (the order the model runs them).
        units: ``units[i]`` is the index range (start, stop) into ``nodes`` of unit ``i``.
        output: the model's return value with ``Ref`` s in place of values.
        kind: ``"sequential"``, ``"fx"``, ``"keras"`` or ``"keras-sequential"``.
    """

    inputs: list[str]
    nodes: list[Node]
    units: list[tuple[int, int]]
    output: Any
    kind: str

    # ------------------------------------------------------------------ costs
    def param_costs(self) -> list[float]:
        """Parameter count per unit (+1 per node so parameter-free units still weigh something)."""
        out = []
        for a, b in self.units:
            seen: dict[int, int] = {}
            for n in self.nodes[a:b]:
                for p in n.params:
                    if isinstance(p, nn.Parameter) or p.requires_grad:
                        seen[id(p)] = p.numel()
            out.append(float(sum(seen.values()) + (b - a)))
        return out

    def time_costs(self, inputs: Sequence[torch.Tensor], repeats: int = 3) -> list[float]:
        """Measured forward seconds per unit on ``inputs`` (best of ``repeats``; backward not separated)."""
        best = [float("inf")] * len(self.units)
        for _ in range(repeats):
            env = dict(zip(self.inputs, inputs))
            with torch.no_grad():
                for u, (a, b) in enumerate(self.units):
                    t0 = time.perf_counter()
                    for n in self.nodes[a:b]:
                        env[n.name] = run_node(n, env)
                    best[u] = min(best[u], time.perf_counter() - t0)
        return best

    # ------------------------------------------------------------------ stages
    def stage_of_nodes(self, counts: Sequence[int]) -> list[int]:
        """Stage index of every node, given units per stage."""
        stage = []
        for s, (lo, hi) in enumerate(_bounds(counts)):
            for u in range(lo, hi):
                a, b = self.units[u]
                stage += [s] * (b - a)
        return stage

    def live_sets(self, counts: Sequence[int]) -> list[list[str]]:
        """``live[s]``: names made at or before stage ``s`` that stage ``s+1`` or later (or the output) read.

        Graph inputs are excluded (every stage holds them). Names keep their definition order.
        """
        stage = self.stage_of_nodes(counts)
        p = len(counts)
        where = {n.name: s for n, s in zip(self.nodes, stage)}
        last_use: dict[str, int] = {}
        for n, s in zip(self.nodes, stage):
            for r in _refs((n.args, n.kwargs)):
                if r in where:
                    last_use[r] = max(last_use.get(r, -1), s)
        for r in _refs(self.output):
            if r in where:
                last_use[r] = p - 1
        return [[n.name for n in self.nodes if where[n.name] <= s < last_use.get(n.name, -1)]
                for s in range(p - 1)]

    def stage_nodes(self, counts: Sequence[int], s: int) -> list[Node]:
        lo, hi = _bounds(counts)[s]
        if lo == hi:
            return []
        return self.nodes[self.units[lo][0]:self.units[hi - 1][1]]


def run_node(n: Node, env: dict[str, Any], training: bool | None = None) -> Any:
    """Evaluate ``n`` with its references looked up in ``env`` (``training`` for Keras layers that take it)."""
    look = env.__getitem__
    args = _map(n.args, lambda r: look(r.name))
    kwargs = _map(n.kwargs, lambda r: look(r.name)) if n.kwargs else {}
    if n.training_arg and training is not None:
        kwargs["training"] = training
    return n.fn(*args, **kwargs)


def resolve(obj: Any, env: dict[str, Any]) -> Any:
    """``obj`` with every :class:`Ref` replaced by its value in ``env``."""
    return _map(obj, lambda r: env[r.name])


def _bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    acc = list(itertools.accumulate(counts))
    return [(a - c, a) for a, c in zip(acc, counts)]


# ---------------------------------------------------------------------------- balance
def balance(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into ``parts`` contiguous non-empty runs minimising the largest run's sum.

    Dynamic programme over (prefix, parts), O(parts * n^2): exact, and n (units) is small. Among optimal
    splits the one with the earliest boundaries is returned, so every rank computes the same answer.

    Returns:
        The number of units in each run.

    Raises:
        ValueError: more parts than units, no parts, or a negative cost.
    """
    n = len(costs)
    if parts < 1:
        raise ValueError(f"partitions={parts}; need at least one stage")
    if parts > n:
        raise ValueError(f"partitions={parts} exceeds the model's {n} layers; every stage needs at least one "
                         f"layer: use partitions <= {n} or a model with more layers")
    if any(c < 0 for c in costs):
        raise ValueError(f"balance costs must be >= 0, got {list(costs)}")
    pre = [0.0, *itertools.accumulate(float(c) for c in costs)]
    inf = float("inf")
    # best[k][i]: min-max cost of the first i units in k runs; cut[k][i]: start of the last run.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            b, c = inf, k - 1
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < b:
                    b, c = v, j
            best[k][i], cut[k][i] = b, c
    counts, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def split_units(graph: Graph, parts: int, how: str | Sequence[int], sample: Sequence[torch.Tensor] | None = None,
                costs: Sequence[float] | None = None) -> list[int]:
    """Units per stage for ``balance=how`` (``"params"``, ``"time"`` or explicit counts)."""
    n = len(graph.units)
    if not isinstance(how, str):
        counts = [int(c) for c in how]
        if len(counts) != parts or sum(counts) != n or min(counts) < 1:
            raise ValueError(f"balance={list(how)} must give {parts} positive layer counts summing to the model's "
                             f"{n} layers (one count per stage, no empty stage)")
        return counts
    if parts > n:
        raise ValueError(f"partitions={parts} exceeds the model's {n} layers ({graph.kind} graph); every stage "
                         f"needs at least one layer: use partitions <= {n}")
    if costs is None:
        if how == "params":
            costs = graph.param_costs()
        elif how == "time":
            if sample is None:
                raise ValueError("balance='time' profiles the layers on a sample micro-batch: pass sample_inputs=")
            costs = graph.time_costs(sample)
        else:
            raise ValueError(f"balance={how!r} is not one of 'params', 'time' or a list of layer counts")
    return balance(costs, parts)


# ---------------------------------------------------------------------------- front ends
_GRAPH_SOURCES: dict[str, tuple[Callable[[Any], bool], Callable[[Any], "Graph"]]] = {}


def register_graph_source(name: str, claims: Callable[[Any], bool], build: Callable[[Any], "Graph"]) -> None:
    """Let :func:`capture` ask ``build(model)`` for the graph of every model that ``claims(model)`` accepts.

    An integration registers when it is imported, so a capability never names the library a model came from.
    Sources are asked in registration order, before the built-in front ends; registering ``name`` again
    replaces it (a reloaded integration stays one source).
    """
    if not (callable(claims) and callable(build)):
        raise TypeError(f"graph source {name!r}: claims and build must be callables, got "
                        f"{type(claims).__name__} and {type(build).__name__}")
    _GRAPH_SOURCES[name] = (claims, build)


def graph_sources() -> list[str]:
    """The names of the registered graph sources, in the order :func:`capture` asks them."""
    return list(_GRAPH_SOURCES)


def capture(model: Any, *, leaf_modules: Sequence[type] = (), sample: Sequence[Any] | None = None) -> Graph:
    """Build the :class:`Graph` of ``model`` (``nn.Sequential``, a Keras 3 model, or an fx-traceable module).

    Args:
        model: the model.
        leaf_modules: ``nn.Module`` classes that ``torch.fx`` must call as one node instead of tracing into
            (e.g. a transformer block whose body has shape-dependent Python control flow); each call of such
            a module is then one layer.
        sample: one micro-batch of inputs; when ``torch.fx`` fails, the model is captured with
            ``torch.export`` on it instead (the graph is then specialised to that micro-batch shape).

    Raises:
        TraceError: ``torch.fx`` cannot trace the model (the message says which construct and what to do).
        TypeError: ``model`` is not a torch module or Keras model.
    """
    if _is_keras(model):
        return _from_keras(model)
    for claims, build in _GRAPH_SOURCES.values():  # e.g. a decoder-aware split fx could not trace
        if claims(model):
            return build(model)
    if isinstance(model, nn.Sequential):
        return _from_sequential(model)
    if isinstance(model, nn.Module):
        return _from_fx(model, tuple(leaf_modules), sample)
    raise TypeError(f"HybridParallel needs a torch.nn.Module or a Keras 3 model (torch backend), got "
                    f"{type(model).__name__}")


def _own(module: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(module.parameters()) + tuple(module.buffers())


def _from_sequential(model: nn.Sequential) -> Graph:
    nodes, prev = [], "input"
    for i, (name, child) in enumerate(model.named_children()):
        nodes.append(Node(name=f"l{i}", fn=child, args=(Ref(prev),), params=_own(child),
                          label=f"{name}: {type(child).__name__}"))
        prev = f"l{i}"
    if not nodes:
        raise ValueError("the nn.Sequential is empty; give it at least one layer")
    return Graph(inputs=["input"], nodes=nodes, units=[(i, i + 1) for i in range(len(nodes))],
                 output=Ref(prev), kind="sequential")


def _method(name: str) -> Callable[..., Any]:
    def call(obj, *args, **kwargs):
        return getattr(obj, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _getter(value: Any) -> Callable[[], Any]:
    return lambda: value


def _from_fx(model: nn.Module, leaves: tuple[type, ...] = (), sample: Sequence[Any] | None = None) -> Graph:
    import torch.fx as fx

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)

    try:
        gm = fx.GraphModule(model, Tracer().trace(model), type(model).__name__)
    except Exception as exc:  # fx raises TraceError, TypeError, RuntimeError... for untraceable Python
        if sample is not None:
            return _from_export(model, sample, exc)
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}{_where(exc)}: {type(exc).__name__}: {exc}. Usually this is "
            f"data-dependent control flow (an `if`/`for` on a tensor's value) or a non-torch call on a tensor. "
            f"Fix: move that code into a submodule and pass its class in leaf_modules=(...) so it runs as one "
            f"layer, pass sample_inputs= (one micro-batch) to capture it with torch.export instead, wrap the "
            f"function with torch.fx.wrap, or express the model as nn.Sequential. A model of a library loom "
            f"integrates is split by that integration once imported (e.g. import loom.integrations.transformers; "
            f"registered now: {', '.join(_GRAPH_SOURCES) or 'none'})"
        ) from exc
    return _walk_fx(gm, type(model).__name__, "fx")


def _where(exc: BaseException) -> str:
    """`` at file:line `code` `` of the innermost user frame (not torch's) in ``exc``'s traceback."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/loom/parallel/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} `{(f.line or '').strip()}`"


def _from_export(model: nn.Module, sample: Sequence[Any], fx_error: Exception) -> Graph:
    """Capture with ``torch.export`` (aten-level graph, specialised to the sample micro-batch's shapes)."""
    try:
        ep = torch.export.export(model, tuple(sample), strict=False)
        gm = ep.module()
    except Exception as exc:
        raise TraceError(
            f"neither torch.fx ({type(fx_error).__name__}: {fx_error}) nor torch.export ({type(exc).__name__}: "
            f"{exc}) can capture {type(model).__name__}. Data-dependent control flow (a branch on a tensor's "
            f"value) cannot be split into stages: move it into a submodule and pass its class in "
            f"leaf_modules=(...), or express the model as nn.Sequential"
        ) from exc
    return _walk_fx(gm, type(model).__name__, "export")


def _walk_fx(gm: nn.Module, what: str, kind: str) -> Graph:
    import torch.fx as fx
    from torch.utils import _pytree

    nodes: list[Node] = []
    inputs: list[str] = []
    output: Any = None
    conv = lambda a: fx.node.map_arg(a, lambda n: Ref(n.name))  # noqa: E731
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.args:  # default value: the model has an optional argument
                raise TraceError(f"{what}.forward argument {n.target!r} has a default; pass every "
                                 f"input explicitly (HybridParallel splits each input into micro-batches)")
            inputs.append(n.name)
        elif n.op == "output":
            output = conv(n.args[0])
            info = getattr(gm.graph._codegen, "pytree_info", None)  # torch.export: flat outputs + a spec
            if info is not None and info.out_spec is not None:
                output = _pytree.tree_unflatten(list(output), info.out_spec)
        elif n.op == "call_module":
            mod = gm.get_submodule(n.target)
            nodes.append(Node(n.name, mod, conv(n.args), conv(n.kwargs), _own(mod),
                              f"{n.target}: {type(mod).__name__}"))
        elif n.op == "get_attr":
            val = gm
            for part in n.target.split("."):
                val = getattr(val, part)
            params = (val,) if isinstance(val, torch.Tensor) else ()
            nodes.append(Node(n.name, _getter(val), (), {}, params, f"{n.target} (attribute)"))
        elif n.op == "call_function":
            nodes.append(Node(n.name, n.target, conv(n.args), conv(n.kwargs), (),
                              getattr(n.target, "__name__", str(n.target))))
        elif n.op == "call_method":
            nodes.append(Node(n.name, _method(n.target), conv(n.args), conv(n.kwargs), (), f".{n.target}()"))
        else:  # pragma: no cover - fx has no other opcodes today
            raise TraceError(f"unsupported torch.fx node {n.op!r} ({n.name}) in {what}")
    if not nodes:
        raise ValueError(f"{what} has no operations to partition")
    # Parameter reads move to just before their first reader and are glued to it, so a stage boundary does
    # not ship a weight as an activation (torch.export lists every get_attr at the top of the graph).
    attrs = {n.name: n for n in nodes if n.label.endswith("(attribute)")}
    ordered: list[Node] = []
    for n in nodes:
        if n.name in attrs:
            continue
        for r in _refs((n.args, n.kwargs)):
            if r in attrs:
                ordered.append(attrs.pop(r))
        ordered.append(n)
    ordered += list(attrs.values())  # read only by the output
    units, start = [], 0
    for i, n in enumerate(ordered):
        glue = n.label.endswith("(attribute)") and i + 1 < len(ordered)
        if not glue:
            units.append((start, i + 1))
            start = i + 1
    return Graph(inputs=inputs, nodes=ordered, units=units, output=output, kind=kind)


def _is_keras(model: Any) -> bool:
    mod = type(model).__module__ or ""
    return mod.startswith("keras") or any((c.__module__ or "").startswith("keras.") for c in type(model).__mro__)


def _keras_params(layer: Any) -> tuple[torch.Tensor, ...]:
    return tuple(v.value for v in getattr(layer, "weights", ()))


def _keras_training(layer: Any) -> bool:
    return bool(getattr(layer, "_call_has_training_arg", False))


def _keras_check_backend() -> None:
    import keras

    if keras.backend.backend() != "torch":
        raise ValueError(f"Keras backend is {keras.backend.backend()!r}; HybridParallel runs Keras models on the "
                         f"torch backend: set KERAS_BACKEND=torch before importing keras")


def _from_keras(model: Any) -> Graph:
    _keras_check_backend()
    if not getattr(model, "built", False):
        raise ValueError(f"Keras model {model.name!r} is not built; give it an Input (keras.Input / "
                         f"layers.Input) or call model.build(shape) first")
    by_depth = getattr(model, "_nodes_by_depth", None)
    if type(model).__name__ == "Sequential" or by_depth is None:
        layers = list(model.layers)
        if by_depth is None and type(model).__name__ != "Sequential":
            raise TraceError(f"Keras model {type(model).__name__} is a subclassed Model whose call() Keras cannot "
                             f"describe as a layer graph; rebuild it as keras.Sequential or a Functional "
                             f"keras.Model(inputs, outputs)")
        nodes, prev = [], "input"
        for i, layer in enumerate(layers):
            nodes.append(Node(f"k{i}", layer, (Ref(prev),), {}, _keras_params(layer),
                              f"{layer.name}: {type(layer).__name__}", _keras_training(layer)))
            prev = f"k{i}"
        return Graph(inputs=["input"], nodes=nodes, units=[(i, i + 1) for i in range(len(nodes))],
                     output=Ref(prev), kind="keras-sequential")
    names: dict[int, str] = {}
    inputs = []
    for i, t in enumerate(model.inputs):
        names[id(t)] = f"input{i}"
        inputs.append(f"input{i}")
    nodes: list[Node] = []

    def conv(obj: Any) -> Any:
        if type(obj).__name__ == "KerasTensor":
            try:
                return Ref(names[id(obj)])
            except KeyError:
                raise TraceError(f"Keras tensor {obj.name} is read before it is made; the Functional graph "
                                 f"of {model.name!r} is not in depth order") from None
        if isinstance(obj, (list, tuple)):
            return type(obj)(conv(o) for o in obj)
        if isinstance(obj, dict):
            return {k: conv(v) for k, v in obj.items()}
        return obj

    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            op = node.operation
            if type(op).__name__ == "InputLayer":
                continue
            j = len(nodes)
            name = f"k{j}"
            outs = list(node.outputs)
            args = conv(tuple(node.arguments.args))
            kwargs = conv(dict(node.arguments.kwargs))
            if "training" in kwargs:  # recorded at graph build time; the step decides
                del kwargs["training"]
            nodes.append(Node(name, op, args, kwargs, _keras_params(op), f"{op.name}: {type(op).__name__}",
                              _keras_training(op)))
            if len(outs) == 1:
                names[id(outs[0])] = name
            else:  # multi-output layer: one picking node per output, glued to the call
                for k, t in enumerate(outs):
                    pick = f"{name}_{k}"
                    nodes.append(Node(pick, _itemgetter(k), (Ref(name),), {}, (), f"{op.name}[{k}]"))
                    names[id(t)] = pick
    units, i = [], 0
    while i < len(nodes):  # a multi-output call and its picks form one unit
        j = i + 1
        while j < len(nodes) and nodes[j].name.startswith(nodes[i].name + "_"):
            j += 1
        units.append((i, j))
        i = j
    outs = model.outputs
    output = conv(outs[0]) if len(outs) == 1 else conv(list(outs))
    return Graph(inputs=inputs, nodes=nodes, units=units, output=output, kind="keras")


def _itemgetter(k: int) -> Callable[[Any], Any]:
    return lambda seq: seq[k]
