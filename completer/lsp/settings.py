"""What `completer lsp` can be told by the editor: `initializationOptions`
at start and `workspace/didChangeConfiguration` later (its `settings`, or
their `completer` section), with the same names and defaults as the Neovim
plugin's setup() where the two share an option. Fields left out keep their
value; a field of the wrong type is refused whole, and the editor is told in
one line naming it (the settings before stay)."""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from completer.client import DEFAULT_URL
from completer.server.security import default_token_path


class ContextSettings(msgspec.Struct, forbid_unknown_fields=False):
    enabled: bool = True
    max_chunks: int = 8  # snippets sent with a request (the protocol allows 64)
    chunk_lines: int = 32  # lines per snippet
    max_chars: int = 4000  # characters of all snippets together
    buffers: int = 3  # other open documents of the same language that give a snippet each


class LspSettings(msgspec.Struct, forbid_unknown_fields=False):
    url: str = ""  # "": $COMPLETER_URL, else ws://127.0.0.1:8750/v1/ws
    token: str = ""  # "": $COMPLETER_TOKEN, then token_file
    token_file: str = ""  # "": $XDG_CONFIG_HOME/completer/token (where `completer serve` writes it)
    enabled: bool = True
    mode: Literal["auto", "line", "block", "free"] = "auto"  # auto: block on a blank line, else line
    debounce_ms: float = 0.0  # wait this long after a request before asking the server (editors debounce too)
    max_tokens: int | None = None  # None: the server's default
    deadline_ms: float | None = None  # None: the server's default
    candidates: int = 4  # texts an invoked request asks for (1: only one)
    max_lines: int = 2000  # at least this many lines sent before and after the cursor (0: the whole document)
    prime: bool = True  # warm the server's cache for a document when it is opened (max_tokens 0)
    exclude: list[str] = []  # path globs never sent, besides the secrets list
    exclude_sensitive_files: bool = True  # false: the secrets list no longer applies (only `exclude` does)
    include: list[str] | None = None  # only documents matching one of these globs are completed and sent
    context: ContextSettings = msgspec.field(default_factory=ContextSettings)

    def server_url(self) -> str:
        return self.url or os.environ.get("COMPLETER_URL") or DEFAULT_URL

    def server_token(self) -> tuple[str | None, str]:
        """The token and where it came from (None when there is none)."""
        if self.token:
            return self.token, "settings"
        if env := os.environ.get("COMPLETER_TOKEN"):
            return env, "$COMPLETER_TOKEN"
        path = os.path.expanduser(self.token_file) if self.token_file else str(default_token_path())
        try:
            token = open(path, encoding="utf-8").read().strip()
        except OSError:
            return None, f"{path} (missing)"
        return (token or None), path


def section(raw: object) -> dict:
    """The completer settings in what an editor sent: `{"completer": {...}}`
    (most clients nest them under the server's name) or the fields themselves."""
    if isinstance(raw, dict) and isinstance(raw.get("completer"), dict):
        return raw["completer"]
    return raw if isinstance(raw, dict) else {}


def updated(current: LspSettings, raw: object) -> LspSettings:
    """`current` with the fields of `raw` (see section) set; raises
    msgspec.ValidationError naming the field of a bad value."""
    fields = section(raw)
    merged = msgspec.to_builtins(current)
    for key, value in fields.items():
        if key == "context" and isinstance(value, dict):
            merged["context"] = {**merged["context"], **value}
        else:
            merged[key] = value
    return msgspec.convert(merged, LspSettings)
