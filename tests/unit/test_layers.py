"""The layers, checked on the import statements: settings/stats at the bottom, loom.comm above them, the
capabilities above loom.comm, the benchmark commands on top (nothing below them imports loom.bench)."""

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
