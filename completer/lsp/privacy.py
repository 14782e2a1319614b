"""Which documents `completer lsp` may send to the server, as the document of
a request or as context for another: not one whose path matches a secrets
glob (unless `exclude_sensitive_files` is false) or an `exclude` glob, only
those matching `include` when it is set, only `file:` and `untitled:` URIs.
A glob with a `/` is matched against the whole path, one without against the
file's name; case-insensitively, as both editor plugins match."""

from __future__ import annotations

import fnmatch
from urllib.parse import unquote, urlsplit

from completer.lsp.settings import LspSettings

SECRETS = (
    # The same list, in the same order, as the VS Code extension's (src/privacy.ts's SENSITIVE_GLOBS)
    # and the Neovim plugin's (lua/completer/config.lua's SECRETS); tests/clients/test_secret_patterns.py holds
    # the three to it.
    '.env', '.env.*', '*.env', '.envrc',
    '*.pem', '*.key', '*.p12', '*.pfx', '*.jks', '*.keystore', '*.gpg', '*.asc', '*.kdbx',
    'id_rsa*', 'id_dsa*', 'id_ecdsa*', 'id_ed25519*', '*.ppk',
    '.netrc', '_netrc', '.pgpass', '.npmrc', '.pypirc', '.git-credentials', '.htpasswd',
    'credentials', 'credentials.*', '*credentials*.json', 'secrets', 'secrets.*', '*.secret', '*.secrets',
    '*secret*.json', '*secret*.y*ml', 'client_secret*',
    '*.tfvars', '*.tfstate', '*.tfstate.*',
    '**/.ssh/**', '**/.aws/**', '**/.gnupg/**', '**/.docker/config.json', '**/.kube/config',
)

SCHEMES = ("file", "untitled")  # a document of another scheme (git:, output:, a diff view) is not the user's code


def path_of(uri: str) -> str:
    parts = urlsplit(uri)
    return unquote(parts.path)


def match(glob: str, path: str) -> bool:
    subject = path if "/" in glob else path.rsplit("/", 1)[-1]
    return fnmatch.fnmatchcase(subject.lower(), glob.lower())


def blocked(uri: str, settings: LspSettings) -> str | None:
    """Why the document at `uri` must not be sent (a short reason), or None."""
    if urlsplit(uri).scheme not in SCHEMES:
        return f"scheme {urlsplit(uri).scheme or '(none)'}"
    path = path_of(uri)
    globs = (SECRETS if settings.exclude_sensitive_files else ()) + tuple(settings.exclude)
    for glob in globs:
        if glob.strip() and match(glob.strip(), path):
            return f"excluded by {glob}"
    if settings.include and not any(match(g, path) for g in settings.include):
        return "not in include"
    return None
