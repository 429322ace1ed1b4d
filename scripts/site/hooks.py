"""mkdocs hooks of loom's site (``mkdocs.yml``: ``hooks: [scripts/site/hooks.py]``).

The site's home page is the repository's README.md, so the front page exists once: the README links into the
site with paths relative to the repository root (``docs/guides/zero.md``, which GitHub follows), and here
they become paths relative to docs/ (``guides/zero.md``), which mkdocs checks like any other link in
``--strict`` mode. A README link outside docs/ could not be checked or served, so it fails the build.

The pages are written for GitHub too, whose Markdown lets a list start right under a paragraph line; Python's
Markdown needs a blank line there and would run the items into the paragraph, so one is added (outside code
blocks) before a list that follows a paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def readme_as_home(text: str) -> str:
    """README.md's text with its links made relative to docs/."""

    def one(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        if not target.startswith("docs/"):
            raise ValueError(f"README.md links to {target!r}, outside docs/: the site cannot serve it; link a page "
                             f"under docs/ or an absolute URL")
        return m.group(1) + target[len("docs/"):] + m.group(3)

    return _LINK.sub(one, text)


_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s+\S")


def gfm_lists(markdown: str) -> str:
    """A blank line before each list that starts right under a paragraph line (see the module docstring)."""
    out: list[str] = []
    fence = False
    in_list = False  # the block since the last blank line holds a list item
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence:
            if not line.strip():
                in_list = False
            elif _ITEM.match(line):
                if not in_list and out and out[-1].strip() and not out[-1].lstrip().startswith(("<!--", "#", "|")):
                    out.append("")
                in_list = True
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return gfm_lists(markdown)


def on_files(files: Files, config) -> Files:
    if files.get_file_from_path("index.md") is not None:
        raise ValueError("docs/index.md exists: the site's home page is README.md (scripts/site/hooks.py)")
    files.append(File.generated(config, "index.md", content=readme_as_home((ROOT / "README.md").read_text())))
    _add_api_pages(files, config)
    return files


# The API reference: one page per package, a section per module. The modules are found on disk when the site
# is built, so a module that is added, split or moved needs no edit here; mkdocstrings reads them statically
# (griffe), without importing torch or MPI.
API_PAGES: dict[str, tuple[str, list[str]]] = {
    "comm": ("loom.comm: the communication layer", ["loom.comm"]),
    "parallel": ("loom.parallel: data, ZeRO, pipeline, sequence, tensor, hybrid", ["loom.parallel"]),
    "compress": ("loom.compress: codecs and compressed collectives", ["loom.compress"]),
    "multipath": ("loom.multipath: multi-path all-to-all", ["loom.multipath"]),
    "dask": ("loom.dask: Dask over MPI", ["loom.dask"]),
    "torchdist": ("loom.torchdist: the torch.distributed backend", ["loom.torchdist"]),
    "train": ("loom.train: loom train and loom generate", ["loom.train"]),
    "models": ("loom.models and loom.integrations: models", ["loom.models", "loom.integrations"]),
    "testbed": ("loom.testbed: the emulated cluster", ["loom.testbed"]),
    "foundation": ("loom, loom.fit, settings, stats, the CLI and the test harness",
                   ["loom", "loom.fit", "loom.settings", "loom.stats", "loom.cli", "loom.cli_args", "loom.testing"]),
}


def modules(name: str) -> list[str]:
    """``name`` and, for a package, its public modules and sub-packages on disk, the package first (``loom``
    itself is only its own docstring: its sub-packages have their pages)."""
    path = ROOT.joinpath(*name.split("."))
    if not path.is_dir() or name == "loom":
        return [name]
    found = set()
    for p in path.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if p.name == "__init__.py" else parts
        if not any(part.startswith("_") for part in parts):
            found.add(".".join(parts))
    return sorted(found, key=lambda m: (m != name, m))


def api_page(title: str, names: list[str]) -> str:
    """A page of ``::: module`` directives: a package by its docstring alone (what it exports is documented
    in the module that defines it), a module with its public members."""
    lines = [f"# {title}", ""]
    for name in names:
        for module in modules(name):
            lines.append(f"::: {module}")
            if ROOT.joinpath(*module.split(".")).is_dir():
                lines += ["    options:", "      members: false"]
            lines.append("")
    return "\n".join(lines)


def _add_api_pages(files: Files, config) -> None:
    for slug, (title, names) in API_PAGES.items():
        files.append(File.generated(config, f"reference/api/{slug}.md", content=api_page(title, names)))
