"""Fill the generated blocks of the documentation (README.md and docs/**/*.md) from the code.

A page may hold a generated block, ``<!-- begin generated: NAME ... -->`` up to ``<!-- end generated -->``;
this script fills it, so the documentation cannot drift from the declarations:

- ``settings``: the table of every ``LOOM_*`` variable (``loom.settings.markdown_table()``);
- ``cli``: ``loom --help`` and the ``--help`` of every command and sub-command, as their argparse parsers
  print it (the registry of ``loom/cli.py``, ``loom bench``'s and ``loom testbed``'s sub-commands);
- ``rooms``: every module of ``loom/`` by layer, with the opening of its docstring (read with ``ast``, so
  nothing is imported), for the architecture page.

The site (``make docs``: mkdocs over docs/, README.md as its home page) is built from the filled pages, so
mkdocs needs neither torch nor MPI; ``tests/unit/test_readme.py`` runs ``--check`` in ``make test``.

    python scripts/build_docs.py          # rewrite the blocks that are stale
    python scripts/build_docs.py --check  # exit 1 if a page is stale
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"(<!-- begin generated: (\w+)[^\n]*-->\n).*?(<!-- end generated -->)", re.S)
HELP_COLUMNS = "100"  # argparse wraps --help at $COLUMNS: fixed, so the text is the same on every terminal


def pages() -> list[Path]:
    """README.md and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _help(argv: list[str]) -> str:
    """``loom ARGV --help`` as the command prints it."""
    from loom import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main([*argv, "--help"])
    if rc != 0:
        raise SystemExit(f"build_docs: `loom {' '.join(argv)} --help` exited {rc}")
    return out.getvalue().rstrip() + "\n"


def cli_reference() -> str:
    """A section per command and sub-command: its one-line description and its ``--help``."""
    from loom import cli
    from loom.bench import BENCHMARKS

    subcommands = {"bench": [(name, desc) for name, (_, _, desc) in BENCHMARKS.items()],
                   "testbed": [(name, "") for name in ("run", "check", "show", "clean")],
                   "dask": [("run", "")]}
    parts = ["| Command | What it does |", "|---|---|"]
    parts += [f"| [`loom {name}`](#loom-{name}) | {desc} |" for name, (_, desc) in cli.COMMANDS.items()]
    parts += ["", "```text", "$ loom --help", _help([]) + "```", ""]
    for name, (_, desc) in cli.COMMANDS.items():
        parts += [f"## `loom {name}`", "", desc[:1].upper() + desc[1:] + ".", "", "```text", _help([name]) + "```", ""]
        for sub, sub_desc in subcommands.get(name, []):
            parts += [f"### `loom {name} {sub}`", ""]
            parts += [sub_desc[:1].upper() + sub_desc[1:] + ".", ""] if sub_desc else []
            parts += ["```text", _help([name, sub]) + "```", ""]
    return "\n".join(parts)


# The layers of the architecture page, top to bottom, and the rooms (files and packages of loom/) each holds. A
# room on disk that no layer names is listed under "elsewhere", so a new one shows up until it is placed.
LAYERS: list[tuple[str, list[str]]] = [
    ("Commands: `loom CMD`", ["loom/cli.py", "loom/tour.py", "loom/bench"]),
    ("Training", ["loom/train", "loom/fit.py"]),
    ("Integrations", ["loom/integrations"]),
    ("Capabilities", ["loom/models", "loom/parallel", "loom/compress", "loom/multipath", "loom/dask",
                      "loom/torchdist", "loom/testbed", "loom/testing.py"]),
    ("Communication", ["loom/comm"]),
    ("Foundation", ["loom/__init__.py", "loom/settings.py", "loom/stats.py", "loom/cli_args.py"]),
]


def _opening(path: Path) -> str:
    """The first paragraph of a module's docstring (its first sentence when the paragraph is long), as
    Markdown for a table cell."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    if len(text) > 180:
        cut = re.search(r"(?<=[a-z0-9)`])[.:;] ", text[40:])
        text = text[:40 + cut.start() + 1] if cut else text
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def rooms() -> str:
    """A table per layer: each module of loom/ and what it holds."""
    placed = {name for _, names in LAYERS for name in names}
    top = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "loom").iterdir()
                 if (p.suffix == ".py" or (p / "__init__.py").exists()))
    layers = LAYERS + [("Elsewhere", [t for t in top if t not in placed])]
    parts = []
    for title, names in layers:
        if not names:
            continue
        parts += [f"**{title}**", "", "| Room | What it holds |", "|---|---|"]
        for name in names:
            path = ROOT / name
            files = sorted(path.rglob("*.py"), key=lambda p: (p.name != "__init__.py", p.as_posix())) \
                if path.is_dir() else [path]
            for f in files:
                shown = f.parent if f.name == "__init__.py" and f != ROOT / "loom" / "__init__.py" else f
                label = shown.relative_to(ROOT).as_posix() + ("/" if shown.is_dir() else "")
                parts.append(f"| `{label}` | {_opening(f)} |")
        parts.append("")
    return "\n".join(parts)


def _generators() -> dict:
    sys.path.insert(0, str(ROOT))
    os.environ["COLUMNS"] = HELP_COLUMNS
    from loom import settings

    return {"settings": settings.markdown_table, "cli": cli_reference, "rooms": rooms}


def fill(text: str, gens: dict | None = None) -> str:
    """``text`` with every generated block filled from the code."""
    gens = _generators() if gens is None else gens
    done: dict[str, str] = {}

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in gens:
            raise SystemExit(f"build_docs: unknown generated block {name!r}; valid: {', '.join(gens)}")
        if name not in done:
            done[name] = gens[name]()
        return m.group(1) + done[name] + m.group(3)

    return _BLOCK.sub(one, text)


def main(argv: list[str]) -> int:
    gens = _generators()
    stale = []
    for page in pages():
        text = page.read_text()
        filled = fill(text, gens) if _BLOCK.search(text) else text
        if filled != text:
            stale.append(str(page.relative_to(ROOT)))
            if "--check" not in argv:
                page.write_text(filled)
    if stale and "--check" in argv:
        print(f"stale: {', '.join(stale)}: run `python scripts/build_docs.py`", file=sys.stderr)
        return 1
    for name in stale:
        print(f"build_docs: filled {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
