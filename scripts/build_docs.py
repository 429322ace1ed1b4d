"""Assemble README.md from docs/readme/*.md (one section per capability, in file-name order).

A section may hold a generated block, ``<!-- begin generated: NAME ... -->`` up to ``<!-- end generated -->``;
the script fills it from the code (``settings``: the table of ``loom/settings.py``), in the section file and
in README.md, so the documentation cannot drift from the declarations.

Sections refer to their pictures as ``img/NAME.png`` relative to ``docs/readme``; the assembled README
lives at the repository root, so those links are rewritten to ``docs/readme/img/NAME.png``.

    python scripts/build_readme.py          # write README.md
    python scripts/build_readme.py --check  # exit 1 if README.md is stale
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ROOT / "docs" / "readme"
_BLOCK = re.compile(r"(<!-- begin generated: (\w+)[^\n]*-->\n).*?(<!-- end generated -->)", re.S)


def _generators() -> dict:
    sys.path.insert(0, str(ROOT))
    from loom import settings

    return {"settings": settings.markdown_table}


def fill(text: str) -> str:
    """``text`` with every generated block filled from the code."""
    gens = _generators()

    def one(m: re.Match) -> str:
        if m.group(2) not in gens:
            raise SystemExit(f"build_readme: unknown generated block {m.group(2)!r}; valid: {', '.join(gens)}")
        return m.group(1) + gens[m.group(2)]() + m.group(3)

    return _BLOCK.sub(one, text)


def sections() -> dict[Path, str]:
    """Each section file -> its text with generated blocks filled."""
    return {p: fill(p.read_text()) for p in sorted(SECTIONS.glob("*.md"))}


def assemble(filled: dict[Path, str] | None = None) -> str:
    parts = [t.rstrip("\n") + "\n" for t in (sections() if filled is None else filled).values()]
    text = "\n".join(parts)
    return re.sub(r"\]\(img/", "](docs/readme/img/", text)


def main(argv: list[str]) -> int:
    filled = sections()
    text = assemble(filled)
    readme = ROOT / "README.md"
    if "--check" in argv:
        stale = [str(p.relative_to(ROOT)) for p, t in filled.items() if p.read_text() != t]
        if readme.read_text() != text:
            stale.append("README.md")
        if stale:
            print(f"stale: {', '.join(stale)}: run `python scripts/build_readme.py`", file=sys.stderr)
            return 1
        return 0
    for p, t in filled.items():
        if p.read_text() != t:
            p.write_text(t)
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
