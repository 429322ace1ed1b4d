"""The documentation as its tests read it: README.md (the front page) and the site's pages under docs/.

The list of pages is `scripts/build_docs.py`'s (the one that fills their generated blocks). A generated block
(the settings table, each command's ``--help``, the rooms of the architecture page) is the code's own text,
not prose or examples: :func:`pages` leaves it out.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_GENERATED = re.compile(r"<!-- begin generated: .*?<!-- end generated -->", re.S)


def build_docs():
    """scripts/build_docs.py as a module."""
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pages() -> dict[str, str]:
    """Each page's path relative to the repository -> its text, README.md first, generated blocks blanked
    (line numbers are kept)."""
    return {str(p.relative_to(ROOT)): _GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), p.read_text())
            for p in build_docs().pages()}
