"""The layers, checked on the import statements: settings/stats at the bottom, loom.comm above them, the
capabilities above loom.comm, the benchmark commands on top (nothing below them imports loom.bench); no
capability imports an integration, the training job or the `loom` command; no two modules import each other,
directly or round a circle."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The `loom` and `loom demo` commands sit above loom.bench: they may run a benchmark (`loom demo --tour`).
COMMAND_LAYER = {"loom/cli.py", "loom/tour.py"}


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; for __init__ the package itself
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


def _modules():
    for p in sorted((ROOT / "loom").rglob("*.py")):
        yield p.relative_to(ROOT).as_posix(), p


def test_nothing_below_the_commands_imports_loom_bench():
    bad = [name for name, p in _modules()
           if not name.startswith("loom/bench/") and name not in COMMAND_LAYER
           and any(m == "loom.bench" or m.startswith("loom.bench.") for m in _imports(p))]
    assert bad == [], f"these import loom.bench; use loom.comm.measure for timing and tables: {bad}"


def test_settings_and_stats_import_only_the_standard_library():
    for name in ("loom/settings.py", "loom/stats.py"):
        tops = {m.split(".")[0] for m in _imports(ROOT / name)} - {"__future__"}
        assert tops <= set(sys.stdlib_module_names), f"{name} imports {sorted(tops - set(sys.stdlib_module_names))}"


def test_the_import_finder_sees_relative_imports():
    found = _imports(ROOT / "loom/tour.py")
    assert "loom.bench.comm" in found and "loom.settings" in found


# The boundaries of the house: a capability never knows the integration or the training job that uses it
# (integrations register with it instead: loom.parallel.partition.register_graph_source), and only the command
# layer knows the `loom` command itself.
CAPABILITIES = ("loom/parallel/", "loom/models/", "loom/comm/")
ABOVE_CAPABILITIES = ("loom.integrations", "loom.train", "loom.cli")


def _is_in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_capabilities_import_no_integration_training_job_or_command():
    bad = {name: sorted(m for m in _imports(p) if any(_is_in(m, top) for top in ABOVE_CAPABILITIES))
           for name, p in _modules() if name.startswith(CAPABILITIES)}
    bad = {k: v for k, v in bad.items() if v}
    assert bad == {}, (f"a capability ({', '.join(CAPABILITIES)}) imports {', '.join(ABOVE_CAPABILITIES)}: {bad}; "
                       f"invert the dependency (the upper module registers with the capability) or move the shared "
                       f"piece down")


def test_nothing_below_the_command_layer_imports_loom_cli():
    bad = [name for name, p in _modules()
           if name not in COMMAND_LAYER and any(_is_in(m, "loom.cli") for m in _imports(p))]
    assert bad == [], f"these import loom/cli.py, the top of the house (ask loom.comm.launch.inside_job): {bad}"


def _module_of(name: str) -> str | None:
    """The file (``loom/comm/safety.py``) of the module ``name`` or of the package holding the name ``name``."""
    while name.startswith("loom"):
        path = name.replace(".", "/")
        for candidate in (f"{path}.py", f"{path}/__init__.py"):
            if (ROOT / candidate).is_file():
                return candidate
        name = name.rpartition(".")[0]
    return None


def _graph(prefix: str) -> dict[str, set[str]]:
    """Import edges between the modules under ``prefix``, lazy (in-function) imports included; an edge to a
    package's own ``__init__`` from inside it is left out (the package's export list, not a dependency)."""
    edges: dict[str, set[str]] = {}
    for name, p in _modules():
        if not name.startswith(prefix):
            continue
        targets = {_module_of(m) for m in _imports(p)}
        edges[name] = {t for t in targets if t and t != name and t.startswith(prefix)
                       and not (t.endswith("/__init__.py") and name.startswith(t[: -len("__init__.py")]))}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_loom_comm_modules():
    circles = _circles(_graph("loom/comm/"))
    assert circles == [], (f"modules of loom.comm import each other: {circles}; hand the object over instead "
                           f"(as the communicator hands its class to safety.attach)")


def test_no_import_circles_in_loom():
    circles = _circles(_graph("loom/"))
    assert circles == [], f"import circles: {circles}; one side must register with the other or move down"


def test_the_circle_finder_finds_a_planted_circle():
    planted = {"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}
    assert _circles(planted) == [["a.py", "b.py", "c.py"]]
    assert _module_of("loom.comm.safety.install") == "loom/comm/safety.py"
    assert _module_of("loom.comm") == "loom/comm/__init__.py"
