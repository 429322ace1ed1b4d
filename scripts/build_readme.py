"""Assemble README.md from docs/readme/*.md (one section per capability, in file-name order).

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


def assemble() -> str:
    parts = [p.read_text().rstrip("\n") + "\n" for p in sorted(SECTIONS.glob("*.md"))]
    text = "\n".join(parts)
    return re.sub(r"\]\(img/", "](docs/readme/img/", text)


def main(argv: list[str]) -> int:
    text = assemble()
    readme = ROOT / "README.md"
    if "--check" in argv:
        if readme.read_text() != text:
            print("README.md is stale: run `python scripts/build_readme.py`", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
