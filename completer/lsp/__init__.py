"""`completer lsp`: inline completion over the Language Server Protocol for
any editor with a language client (server.py), forwarded to `completer serve`."""
