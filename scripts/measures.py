"""Print the code-quality measures of the tree: duplicated-code pairs, ``LOOM_*`` environment reads outside
``loom/settings.py``, functions over 80 lines, and the lint status.

    python scripts/measures.py            # all four, one line each, then the long functions
    python scripts/measures.py --json     # the same as JSON

``duplicates`` (pairs of places sharing six or more lines) is counted only where that tool is installed;
the lint runs ``ruff check loom tests scripts`` with the configuration in pyproject.toml.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
SETTINGS_MODULE = ROOT / "loom" / "settings.py"


def loom_env_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read a ``LOOM_*`` variable from the environment: ``os.environ.get(...)``,
    ``os.environ[...]``, ``os.getenv(...)``, ``... in os.environ``. Setting one (for a child) is not a read."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr in ("get", "pop", "setdefault")) or \
                    (owner == "os" and node.func.attr == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and ast.unparse(node.value) == "os.environ":
            key = node.slice
        elif isinstance(node, ast.Compare) and any(ast.unparse(c) == "os.environ" for c in node.comparators):
            key = node.left
        if key is not None and "LOOM_" in ast.unparse(key):
            lines.append(node.lineno)
    return sorted(lines)


def env_reads_outside_settings(root: Path = ROOT) -> list[str]:
    """``file:line`` of every ``LOOM_*`` read in loom/ outside the settings module."""
    return [f"{p.relative_to(root)}:{n}" for p in sorted((root / "loom").rglob("*.py"))
            if p != root / "loom" / "settings.py" for n in loom_env_reads(p)]


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, str, int]]:
    """``(file:line, qualified name, lines)`` of every function or method longer than ``limit`` lines
    (from its ``def`` line to its last line, decorators excluded), longest first, in loom/, tests/, scripts/."""
    out = []
    for top in ("loom", "tests", "scripts"):
        for p in sorted((root / top).rglob("*.py")):
            out.extend(_long_in(p, p.relative_to(root).as_posix(), limit))
    return sorted(out, key=lambda r: -r[2])


def _long_in(path: Path, name: str, limit: int) -> list[tuple[str, str, int]]:
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = child.end_lineno - child.lineno + 1
                    if n > limit:
                        found.append((f"{name}:{child.lineno}", qual, n))
                walk(child, qual + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), str(path)), "")
    return found


def duplicate_pairs(root: Path = ROOT) -> int | None:
    """The pair count of the ``duplicates`` tool over the tree, or ``None`` where it is not installed."""
    tool = shutil.which("duplicates")
    if tool is None:
        return None
    out = subprocess.run([tool, "--repo", str(root), "--seconds", "120"], capture_output=True, text=True).stdout
    if out.startswith("no duplicates"):
        return 0
    m = re.match(r"(\d+) pairs?", out)
    return int(m.group(1)) if m else None


def lint(root: Path = ROOT) -> tuple[bool | None, int]:
    """``(passed, findings)`` of ``ruff check loom tests scripts``; ``(None, 0)`` where ruff is missing."""
    exe = Path(sys.executable).parent / "ruff"
    tool = str(exe) if exe.exists() else shutil.which("ruff")
    if tool is None:
        return None, 0
    proc = subprocess.run([tool, "check", "--output-format", "concise", "loom", "tests", "scripts"], cwd=root,
                          capture_output=True, text=True)
    findings = sum(1 for line in proc.stdout.splitlines() if re.match(r"\S+:\d+:\d+: ", line))
    return proc.returncode == 0, findings


def measure(root: Path = ROOT) -> dict:
    passed, findings = lint(root)
    return {
        "duplicate_pairs": duplicate_pairs(root),
        "loom_env_reads_outside_settings": env_reads_outside_settings(root),
        "functions_over_80_lines": [{"where": w, "name": n, "lines": k} for w, n, k in long_functions(root)],
        "lint": {"passed": passed, "findings": findings},
    }


def main(argv: list[str]) -> int:
    m = measure()
    if "--json" in argv:
        print(json.dumps(m, indent=2))
        return 0
    dup = m["duplicate_pairs"]
    lint_ = m["lint"]
    print(f"duplicates pairs:                    {'n/a (no duplicates tool)' if dup is None else dup}")
    print(f"LOOM_ reads outside loom/settings.py: {len(m['loom_env_reads_outside_settings'])}")
    for where in m["loom_env_reads_outside_settings"]:
        print(f"    {where}")
    print(f"functions over {MAX_FUNCTION_LINES} lines:              {len(m['functions_over_80_lines'])}")
    for f in m["functions_over_80_lines"]:
        print(f"    {f['where']:<45} {f['name']:<40} {f['lines']:>4}")
    state = "n/a (no ruff)" if lint_["passed"] is None else "passes" if lint_["passed"] else "fails"
    print(f"lint (ruff check loom tests scripts): {state} ({lint_['findings']} findings)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
