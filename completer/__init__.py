"""completer: self-hosted, low-latency code completion."""

__version__ = "0.1.0"
