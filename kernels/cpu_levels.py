"""The fused CPU layer's builds by feature level, and the one this machine runs.

cpu_decode.cpp is compiled once per level with explicit flags (not
-march=native), so each SIMD path in cpu_gemm.h and cpu_attention.h is a build
that a machine with the instructions can run and test. Every level is tuned
for this CPU (-mtune=native: instruction choice and scheduling, never the
instruction set; BENCHMARKS.md "2026-12-06, 16:52-17:51": batch-4 decode
3-15% faster than x86-64's generic tuning in 3 of 3 pairs on an EPYC):
- `scalar`: no SIMD flags (x86-64's baseline): the plain C paths;
- `avx2`: AVX2, FMA and F16C: the maddubs and 256-bit paths;
- `avx512`: AVX512 F/BW/DQ/VL and VNNI on top: the dpbusd paths, and the
  weights in tiles of 16 rows (`tiles`).
The highest level this CPU's flags (/proc/cpuinfo) allow runs, unless
$COMPLETER_CPU_LEVEL names one; a level this CPU cannot run (or no level)
is refused in one line naming it.

`CpuLevel.tiles` is what the level's build reports (`tiles_available()`,
COMPLETER_TILES in cpu_gemm.h); cpu_decode.py checks the two agree at each
load, so the packing decided here without a build (`int8_fused_here`) is the
build's.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import msgspec

ENV = "COMPLETER_CPU_LEVEL"
AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni")


class CpuLevel(msgspec.Struct, frozen=True):
    name: str
    simd_flags: tuple[str, ...]  # the compiler's, on top of the architecture's baseline
    cpu_flags: frozenset[str]  # /proc/cpuinfo's flags the build's instructions need
    simd: str  # what the build's simd() says
    tiles: bool  # the build multiplies the VNNI tile layout (its tiles_available())

    def cflags(self) -> list[str]:
        """The compiler's flags for this level (the baseline named on x86-64: a
        compiler's own default may be higher), tuned for this CPU."""
        base = ["-march=x86-64", "-mtune=native"] if platform.machine().lower() in ("x86_64", "amd64") else []
        return [*base, *self.simd_flags]


SCALAR = CpuLevel("scalar", (), frozenset(), "scalar", False)
AVX2 = CpuLevel("avx2", AVX2_FLAGS, frozenset({"avx2", "fma", "f16c"}), "avx2", False)
AVX512 = CpuLevel("avx512", AVX2_FLAGS + AVX512_FLAGS,
                  AVX2.cpu_flags | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}, "avx512-vnni", True)
LEVELS = (SCALAR, AVX2, AVX512)  # lowest first
BY_NAME = {level.name: level for level in LEVELS}


class CpuLevelError(RuntimeError):
    """$COMPLETER_CPU_LEVEL names no level, or one this CPU cannot run (one line)."""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (none elsewhere: the scalar build)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def runnable_levels() -> tuple[CpuLevel, ...]:
    """The levels whose builds this CPU runs, lowest first (scalar always,
    x86-64 SIMD levels only on x86-64)."""
    flags = cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return tuple(level for level in LEVELS if not level.simd_flags or (x86 and level.cpu_flags <= flags))


def selected_level() -> CpuLevel:
    """$COMPLETER_CPU_LEVEL's level, else the highest this CPU runs.
    CpuLevelError: an unknown name, or a level this CPU lacks the flags for."""
    here = runnable_levels()
    forced = os.environ.get(ENV, "").strip().lower()
    if not forced:
        return here[-1]
    level = BY_NAME.get(forced)
    if level is None:
        raise CpuLevelError(f"${ENV}={forced!r} is not a level of the fused CPU layer ({', '.join(BY_NAME)})")
    if level not in here:
        lacking = " ".join(sorted(level.cpu_flags - cpu_flags())) or platform.machine()
        raise CpuLevelError(f"${ENV}={forced}: this CPU cannot run the {forced} build of the fused CPU layer "
                            f"(it lacks {lacking}; it runs {', '.join(x.name for x in here)})")
    return level


def tiles_here() -> bool:
    """Whether the level this machine runs multiplies the tile layout (no build
    needed; False where the level is refused: then no fused layer runs)."""
    try:
        return selected_level().tiles
    except CpuLevelError:
        return False
