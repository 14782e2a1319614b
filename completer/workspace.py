"""The files a Python document imports, read from its workspace on the
server's disk: only where the operator allowed it (`server.workspace_roots`,
empty by default: then nothing is ever read), and never a file that the
exclusion rules below keep out.

A request names its workspace (`Complete.workspace`, a `file://` URI). When
that folder, symlinks and `..` resolved, lies inside an allowed root, the
document's imports (completer/imports.py) are looked for under it, and each
file found becomes a context item of kind "definition".

What is never read, checked on the path as named and again on the path its
symlinks resolve to (so `env.py -> .env` is as closed as `.env`):
- anything outside the workspace (a symlink out of it, `..`);
- any path with a part that starts with a dot (`.env`, `.env.local`, `.git/`,
  `.venv/`, `.ssh/`): dotfiles hold configuration and secrets, not code;
- names that usually hold secrets (the editor clients' list, privacy.ts);
- whatever the workspace's .gitignore files ignore (git's own rules, by the
  `pathspec` library): generated or private files the user keeps out of the
  repository, settings with credentials among them;
- anything not a regular file, or over `server.workspace_file_bytes`, or not
  UTF-8 text.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import stat
import time
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

import pathspec

from completer.imports import imported_modules, module_candidates
from completer.protocol import ContextItem, Document

# Names that usually hold secrets, matched case-insensitively against a file's
# name (the editor clients exclude the same: editor_clients/vscode/src/privacy.ts).
SENSITIVE_NAMES = (
    ".env", ".env.*", "*.env", ".envrc", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.gpg",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.ppk", ".netrc", "_netrc", ".pgpass", ".npmrc",
    ".pypirc", ".git-credentials", ".htpasswd", "credentials", "credentials.*", "*credentials*",
    "secrets.*", "*.secret", "*.secrets", "client_secret*", "*.tfvars", "*.tfstate", "*.tfstate.*",
)
SOURCE_ROOTS = ("", "src/")  # where a workspace's top-level packages may live
MAX_FILES = 16  # imported files read per request: the retriever's candidates, not the whole repository
MAX_GITIGNORE_BYTES = 64 * 1024
RESOLVE_TTL_S = 2.0  # a keystroke that leaves the imports alone reuses the last answer this long
IMPORT_LINE = re.compile(r"^[ \t]*(?:import|from)[ \t]")

_open = os.open  # a test spies on every file this module opens


def file_path(uri: str) -> Path | None:
    """The local path of a `file://` URI (None for any other)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path:
        return None
    return Path(unquote(parts.path))


def sensitive(name: str) -> bool:
    lower = name.lower()
    return any(fnmatch.fnmatchcase(lower, pattern) for pattern in SENSITIVE_NAMES)


def excluded_name(relative: PurePosixPath) -> bool:
    """A dot part anywhere, or a secret's name: never read."""
    return any(part.startswith(".") for part in relative.parts) or sensitive(relative.name)


def import_statements(text: str) -> str:
    """The document's import statements alone, each checked to parse: the
    document is mid-edit and often not valid Python, its imports usually are."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        if not IMPORT_LINE.match(lines[i]):
            i += 1
            continue
        statement = [lines[i].strip()]
        # A parenthesized or backslash-continued import spans lines.
        while i + 1 < len(lines) and len(statement) < 50 and (
                statement[-1].endswith("\\") or "(" in statement[0] and ")" not in "".join(statement)):
            i += 1
            statement.append(lines[i].strip())
        i += 1
        candidate = "\n".join(statement)
        try:
            ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
        out.append(candidate)
    return "\n".join(out)


class WorkspaceFiles:
    """One connection's reader of its workspaces' imported files."""

    def __init__(self, roots: list[str], max_file_bytes: int):
        self.roots = [Path(r).resolve() for r in roots]
        self.max_file_bytes = max_file_bytes
        self._answers: dict[tuple, tuple[float, list[ContextItem]]] = {}
        self._ignores: dict[Path, tuple[tuple, pathspec.PathSpec | None]] = {}

    def workspace_root(self, workspace: str) -> Path | None:
        """The workspace's folder, resolved, if it lies inside an allowed root."""
        if not self.roots or (path := file_path(workspace)) is None:
            return None
        try:
            root = path.resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        if not root.is_dir() or not any(root.is_relative_to(allowed) for allowed in self.roots):
            return None
        return root

    def imported(self, workspace: str, document: Document) -> list[ContextItem]:
        """The files under the workspace that the document imports, as context items."""
        if (root := self.workspace_root(workspace)) is None:
            return []
        doc = file_path(document.uri)
        try:
            relative = PurePosixPath(doc.resolve().relative_to(root).as_posix()) if doc else None
        except (ValueError, OSError, RuntimeError):
            relative = None
        name = str(relative) if relative else (doc.name if doc else "document.py")
        imports = import_statements(document.prefix + document.suffix)
        key = (root, name, imports)
        now = time.monotonic()
        if (answer := self._answers.get(key)) is not None and now - answer[0] < RESOLVE_TTL_S:
            return answer[1]
        items = []
        seen = {name}
        for module in imported_modules(imports, name):
            for source in SOURCE_ROOTS:
                for candidate in module_candidates(module):
                    path = source + candidate
                    if path in seen or len(items) >= MAX_FILES:
                        continue
                    seen.add(path)
                    if (text := self.read(root, PurePosixPath(path))) and text.strip():  # not an empty __init__
                        items.append(ContextItem((root / path).as_uri(), text, "definition"))
        if len(self._answers) > 64:
            self._answers.clear()
        self._answers[key] = (now, items)
        return items

    def allowed(self, root: Path, relative: PurePosixPath) -> bool:
        return not excluded_name(relative) and not self.ignored(root, relative)

    def read(self, root: Path, relative: PurePosixPath) -> str | None:
        """The text of root/relative, or None when any rule keeps it out."""
        if not self.allowed(root, relative):
            return None
        try:
            real = (root / relative).resolve(strict=True)
            real_relative = PurePosixPath(real.relative_to(root).as_posix())
        except (OSError, RuntimeError, ValueError):  # missing, a loop, or outside the workspace
            return None
        if real_relative != relative and not self.allowed(root, real_relative):
            return None
        return self._read_regular(real)

    def _read_regular(self, path: Path, limit: int | None = None) -> str | None:
        limit = self.max_file_bytes if limit is None else limit
        try:
            # O_NOFOLLOW: the path was resolved; a symlink put there since is refused.
            # O_NONBLOCK: a FIFO must not hang the server (it is refused below).
            fd = _open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
                return None
            data = os.read(fd, limit + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) > limit or b"\0" in data:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def ignored(self, root: Path, relative: PurePosixPath) -> bool:
        """Whether a .gitignore from the workspace down to the file's folder ignores it."""
        folder = root
        for depth, part in enumerate(relative.parts):
            spec = self._gitignore(folder)
            if spec is not None and spec.match_file("/".join(relative.parts[depth:])):
                return True
            folder = folder / part
        return False

    def _gitignore(self, folder: Path) -> pathspec.PathSpec | None:
        path = folder / ".gitignore"
        try:
            info = path.lstat()
            version = (info.st_ino, info.st_mtime_ns, info.st_size)
        except OSError:
            return None
        cached = self._ignores.get(folder)
        if cached is not None and cached[0] == version:
            return cached[1]
        text = self._read_regular(path, MAX_GITIGNORE_BYTES) if stat.S_ISREG(info.st_mode) else None
        spec = pathspec.GitIgnoreSpec.from_lines(text.splitlines()) if text is not None else None
        if text is None:
            # A .gitignore we cannot read (too big, not text, a symlink): nothing under it is read.
            spec = pathspec.GitIgnoreSpec.from_lines(["*"])
        self._ignores[folder] = (version, spec)
        return spec
