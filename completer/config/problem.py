"""What a check of the config finds: a `ConfigProblem` per value that cannot
work, and the `ConfigError` that stops the start with the first one's line.

The section structs take any value of the right type (tests and benchmarks
build them directly); `load_config` runs each section's checks on what a
user wrote, so a value that cannot run stops the start with one line."""

from __future__ import annotations

import math
from typing import NamedTuple


class ConfigProblem(NamedTuple):
    keys: tuple[str, ...]  # the keys it is about, e.g. ("engine.block_size",), to say where they were set
    message: str  # one line naming them and the bound


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and where it was
    set (the file, or the `--set` or flag)."""


def below(key: str, value: int, least: int) -> list[ConfigProblem]:
    """`key` under `least`, as a problem."""
    if value < least:
        return [ConfigProblem((key,), f"{key} = {value}: must be at least {least}")]
    return []


def not_positive(key: str, value: float) -> list[ConfigProblem]:
    """`key` not a finite number above 0, as a problem."""
    # Written so that NaN fails too (TOML has `nan` and `inf`).
    if not (value > 0 and math.isfinite(value)):
        return [ConfigProblem((key,), f"{key} = {value}: must be a positive number")]
    return []
