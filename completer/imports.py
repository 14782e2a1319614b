"""The files a Python file imports, among files we know (a package's sources,
the files a client sent): the definitions a completion most often needs.

Resolved by name only, never by reading the file system: `from .models import
Item` in `app/views.py` names `app/models.py` (or `app/models/__init__.py`),
`import app.utils` names `app/utils.py`; names that resolve to no known file
(the standard library, third-party packages) are skipped.
"""

from __future__ import annotations

import ast
from pathlib import PurePosixPath


def module_candidates(module: str) -> list[str]:
    path = module.replace(".", "/")
    return [f"{path}.py", f"{path}/__init__.py"]


def imported_modules(text: str, path: str) -> list[str]:
    """Dotted module names `text` (the file at `path`, relative to its root)
    imports, relative imports made absolute, in order of first appearance."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    package = list(PurePosixPath(path).parent.parts)  # a module's package, or an __init__'s own
    seen: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                seen.setdefault(alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            if stem:
                seen.setdefault(stem, None)
            for alias in node.names:  # `from pkg import module` names a module too
                if stem and alias.name != "*":
                    seen.setdefault(f"{stem}.{alias.name}", None)
    return list(seen)


def imported_files(text: str, path: str, known: set[str], prefixes: tuple[str, ...] = ("",)) -> list[str]:
    """The known paths (relative, '/'-separated) that `text` imports. `prefixes`:
    roots the dotted names may be relative to (a package installed as `pip/`
    is imported as `pip.x` from files whose paths start inside it)."""
    out: dict[str, None] = {}
    for module in imported_modules(text, path):
        for prefix in prefixes:
            for candidate in module_candidates(module):
                name = candidate[len(prefix):] if prefix and candidate.startswith(prefix) else candidate
                if name in known and name != path:
                    out.setdefault(name, None)
    return list(out)
