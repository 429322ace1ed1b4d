"""A griffe extension that reads loom's docstrings as Markdown for the API reference (mkdocstrings).

loom's docstrings are written for the terminal and for ``help()``, in the reStructuredText habits of the
Python documentation; rendered as Markdown they would show ``:func:`` markers, turn ``>>>`` sessions into
nested quotes and lose their ``Usage::`` blocks. Once griffe has loaded the ``loom`` package this rewrites
each docstring, leaving the source untouched:

- ``:func:`name```, ``:class:`~loom.comm.Mesh``` (any role): a link to the object's entry in the API
  reference where the name resolves (relative names from the docstring's own scope outwards, as Sphinx does;
  names that loom exports lazily by searching the package's modules), else the name as code. The links are
  *optional* autorefs: a target the reference leaves out (a private helper) renders as code, not as an error;
- a ``>>>`` session (with its output lines): a ``pycon`` code block;
- a paragraph ending in ``::`` and the indented block after it: the paragraph with one colon and a code block;
- an ``Args:`` item that names several parameters (``in_features, out_features: the sizes``): one item per
  name, as mkdocstrings' Google parser reads one; a line of prose among the items continues the item above.

``mkdocs.yml`` loads it for the Python handler (``extensions: [scripts/site/griffe_loom.py]``).
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

from griffe import Alias, Extension, Object

_ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`<]+?)`")
# Google-style section titles that mkdocstrings would parse as a section when followed by a colon.
_SECTION_WORDS = {"example", "examples", "usage", "note", "notes", "returns", "raises", "yields", "args",
                  "arguments", "parameters", "attributes", "warning", "warnings"}


def _walk(obj: Object):
    yield obj
    for member in obj.members.values():
        if not isinstance(member, Alias):
            yield from _walk(member)


class _Resolver:
    """Finds the canonical path of a name used in a docstring of ``obj``."""

    def __init__(self, root: Object):
        self.root = root

    def lookup(self, path: str) -> Object | None:
        parts = path.split(".")
        if parts[0] != self.root.name:
            return None
        node: Any = self.root
        for part in parts[1:]:
            try:
                node = node.members[part]
            except (KeyError, AttributeError):
                return None
            if isinstance(node, Alias):
                try:
                    node = node.final_target
                except Exception:  # noqa: BLE001 - an alias to outside the package (torch, Dask): no link
                    return None
        return node

    def lazy(self, path: str) -> Object | None:
        """``loom.comm.Mesh`` where ``loom.comm`` exports ``Mesh`` lazily: the one module of the package that
        defines it."""
        head, _, name = path.rpartition(".")
        package = self.lookup(head)
        if package is None or not getattr(package, "is_package", False):
            return None
        found = [m.members[name] for m in package.modules.values() if name in m.members
                 and not isinstance(m.members[name], Alias)]
        return found[0] if len(found) == 1 else None

    def resolve(self, scope: Object, name: str) -> Object | None:
        name = name.rstrip("()")
        if name.startswith(self.root.name + "."):
            return self.lookup(name) or self.lazy(name)
        node: Object | None = scope
        while node is not None:
            target = self.lookup(f"{node.path}.{name}") or self.lazy(f"{node.path}.{name}")
            if target is not None:
                return target
            node = node.parent
        return None


def _link(target: Object | None, text: str) -> str:
    code = f"<code>{html.escape(text)}</code>"
    if target is None or any(part.startswith("_") and part != "__init__" for part in target.path.split(".")):
        return f"`{text}`"
    return f'<autoref identifier="{target.path}" optional>{code}</autoref>'


def _roles(text: str, scope: Object, resolver: _Resolver) -> str:
    def one(m: re.Match) -> str:
        short, name = m.group(2), m.group(3).strip()
        shown = name.rsplit(".", 1)[-1] if short else name
        return _link(resolver.resolve(scope, name), shown)

    return _ROLE.sub(one, text)


def _blocks(text: str) -> str:
    """``>>>`` sessions and ``::`` literal blocks as fenced code blocks."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith(">>>"):
            indent = len(line) - len(stripped)
            block = []
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) >= indent:
                block.append(lines[i][indent:])
                i += 1
            out += ([""] if out and out[-1].strip() else []) + ["```pycon", *block, "```", ""]
            continue
        if stripped.endswith("::") and not stripped.startswith((">>>", "...")):
            indent = len(line) - len(stripped)
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > indent:
                head = stripped[:-2].rstrip()
                if head.lower() in _SECTION_WORDS:
                    head = f"**{head}**"
                out.append(" " * indent + (head + ":" if head else "").rstrip())
                block_lines = []
                k = j
                while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
                    block_lines.append(lines[k])
                    k += 1
                while block_lines and not block_lines[-1].strip():
                    block_lines.pop()
                out += ["", "```python" if _looks_python(block_lines) else "```text",
                        *textwrap.dedent("\n".join(block_lines)).splitlines(), "```", ""]
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


_ARGS = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Other Parameters):\s*$")
_ITEM = re.compile(r"^\*{0,2}[A-Za-z_][\w.]*(\s*\([^)]*\))?\s*:")
_GROUP = re.compile(r"^(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)\s*:(.*)$")


def _args(text: str) -> str:
    """Args sections with one parameter per item (see the module's docstring)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = _ARGS.match(lines[i])
        i += 1
        if not m:
            continue
        items: list[list[str]] = []
        indent = None
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            here = len(line) - len(line.lstrip())
            if here <= len(m.group(1)):
                break
            indent = here if indent is None else indent
            body = line[indent:] if here == indent else None
            if body is not None and (_ITEM.match(body) or _GROUP.match(body) or not items):
                items.append([line])
            else:  # a continuation line, or prose at the items' indent: part of the item above
                items[-1].append(line if here > indent else " " * (indent + 4) + line.lstrip())
            i += 1
        for item in items:
            g = _GROUP.match(item[0][indent:])
            if not g:
                out += item
                continue
            for name in (n.strip() for n in g.group(1).split(",")):
                out += [" " * indent + f"{name}:{g.group(2)}", *item[1:]]
    return "\n".join(out)


def _looks_python(block: list[str]) -> bool:
    body = "\n".join(block)
    return bool(re.search(r"^\s*(import |from \w|\w+(\[.*?\])? = |with |for |def |class |\w+\()", body, re.M))


class LoomDocstrings(Extension):
    """Rewrites every docstring of the ``loom`` package once the package is loaded."""

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        if pkg.name != "loom":
            return
        resolver = _Resolver(pkg)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _roles(_args(_blocks(obj.docstring.value)), obj, resolver)
