"""The fused CPU layer (cpu_decode.cpp): built once per machine, and the 4-bit
weights packed for it.

A pass of a few new tokens on a CPU (decode, verify, a keystroke's short
prefill) runs each decoder layer as one C++ call instead of ~15 torch ops.
Weights are GGUF Q4_1 blocks, in pairs of blocks per row (`pack_q4`) or, for
the AVX512-VNNI kernel, in tiles of 16 rows (`pack_q4_tiles`); activations are
fp32 or quantized to 8 bits per block of 32 for the integer dot products, as
llama.cpp's CPU backend does. `q4_linear_reference` is the 8-bit math in plain
torch.

The extension is compiled with -march=native into the completer cache
(keyed by the source, torch, Python and this CPU's flags), so the first start
on a machine spends some seconds in the C++ compiler; without one,
`extension()` raises FusedUnavailable and the engine runs torch's ops.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("cpu_gemm.h", "cpu_attention.h", "cpu_workers.h"))
QK = 32  # weights per Q4_1 block
PAIR_BYTES = 40  # two blocks: fp16 scales, fp16 minimums, 32 bytes of nibbles

_lock = threading.Lock()
_built: dict[str, object] = {}


class FusedUnavailable(RuntimeError):
    """The fused layer cannot be built or used here (one line: why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_directory() -> Path:
    from completer.model_store import cache_dir

    key = hashlib.sha256(b"\0".join(x.encode() for x in (
        SOURCE.read_text(), *(h.read_text() for h in HEADERS), torch.__version__, sys.version, platform.machine(), _cpu_flags()))).hexdigest()[:16]
    return cache_dir() / "kernels" / f"cpu_decode-{key}"


def built() -> bool:
    """Whether this machine already has the compiled module (a start then loads it in a moment)."""
    return "module" in _built or (build_directory() / "completer_cpu_decode.so").is_file()


def extension():
    """The compiled module (cached in-process and on disk)."""
    with _lock:
        if "module" in _built:
            return _built["module"]
        if "error" in _built:
            raise FusedUnavailable(_built["error"])
        try:
            from torch.utils import cpp_extension

            out = build_directory()
            out.mkdir(parents=True, exist_ok=True)
            module = cpp_extension.load(
                name="completer_cpu_decode", sources=[str(SOURCE)], build_directory=str(out),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=bool(os.environ.get("COMPLETER_VERBOSE_BUILD")))
        except Exception as e:  # no compiler, no ninja, a compile error: the torch path serves
            text = f"{e}\n{e.__cause__ or ''}".strip().splitlines() or [type(e).__name__]
            first = next((line for line in text if "error:" in line), text[-1])
            _built["error"] = f"the fused CPU layer could not be built ({type(e).__name__}: {first[:200]})"
            raise FusedUnavailable(_built["error"]) from e
        _built["module"] = module
        return module


def pack_q4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The kernel's layout [N, K / 64, 40] from q (0..15) [N, K], scale and minimum
    [N, K / 32] (w = q * scale + low): per pair of blocks, fp16 scales d0 d1, fp16
    minimums m0 m1, then 32 bytes whose byte j holds q[j] (low nibble) and q[j + 32]."""
    N, K = q.shape
    if K % 64:
        raise ValueError(f"q4 pairs: input width {K} is not a multiple of 64")
    q = q.to(torch.uint8).view(N, K // 64, 64)
    nibbles = q[..., :32] | (q[..., 32:] << 4)
    header = torch.cat((scale.half().view(N, -1, 2), low.half().view(N, -1, 2)), -1).contiguous()
    return torch.cat((header.view(torch.uint8), nibbles), -1).contiguous()


TILE_ROWS = 16
TILE_BYTES = 64 + 256  # per block of a 4-bit tile: fp16 scales, fp16 minimums, 256 bytes of nibbles


def pack_q4_tiles(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The layout of the 8-bit-activation VNNI kernel, [N / 16, K / 32, 320]:
    per tile of 16 rows and block of 32 weights, the rows' fp16 scales, their
    fp16 minimums, then 4 vectors of 64 bytes; vector h's 32-bit lane i holds
    q[i, 4h..4h+3] (low nibbles) and q[i, 4h+16..4h+19] (high nibbles)."""
    N, K = q.shape
    if N % TILE_ROWS or K % QK:
        raise ValueError(f"q4 tiles: {N} x {K} is not a multiple of 16 x 32")
    T, B = N // TILE_ROWS, K // QK
    q = q.to(torch.uint8).view(T, TILE_ROWS, B, 2, 4, 4)  # tile, row, block, half, h, c
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(T, B, 256)

    def per_tile(v: torch.Tensor) -> torch.Tensor:  # [N, B] -> [T, B, 32] bytes of fp16
        return v.half().view(T, TILE_ROWS, B).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((per_tile(scale), per_tile(low), nibbles), -1).contiguous()


def pack_i8_tiles(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """8-bit weights (int8 [N, K]; a scale per row [N]) in the VNNI kernel's
    tiles [N / 16, 64 + K / 32 * 512]: per tile the rows' fp32 scales, then per
    block of 32 8 vectors of 64 bytes; vector h's 32-bit lane i holds
    q[i, 4h..4h+3] + 128 (unsigned: the activations are the signed side)."""
    N, K = q.shape
    if N % TILE_ROWS or K % QK:
        raise ValueError(f"int8 tiles: {N} x {K} is not a multiple of 16 x 32")
    T, B = N // TILE_ROWS, K // QK
    blocks = q.to(torch.int8).view(T, TILE_ROWS, B, 8, 4)  # tile, row, block, h, c
    weights = (blocks.permute(0, 2, 3, 1, 4).reshape(T, B * 512).view(torch.uint8) ^ 0x80)
    scales = scale.float().reshape(T, TILE_ROWS).contiguous().view(torch.uint8)
    return torch.cat((scales, weights), -1).contiguous()


def unpack_q4_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4_tiles' inverse: (q [N, K], scale, minimum [N, K / 32]) as fp32."""
    T, B, _ = tiles.shape
    d = tiles[..., :32].contiguous().view(torch.float16).float().transpose(1, 2).reshape(T * TILE_ROWS, B)
    m = tiles[..., 32:64].contiguous().view(torch.float16).float().transpose(1, 2).reshape(T * TILE_ROWS, B)
    nib = tiles[..., 64:].reshape(T, B, 4, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)  # tile, row, block, h, c
    q = torch.stack((nib & 15, nib >> 4), 3).reshape(T * TILE_ROWS, B * QK).float()
    return q, d, m


def unpack_q4(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: (q [N, K], scale, minimum [N, K / 32]) as fp32."""
    N, P, _ = pairs.shape
    header = pairs[..., :8].contiguous().view(torch.float16).float()  # [N, P, 4]
    nib = pairs[..., 8:]
    q = torch.cat((nib & 15, nib >> 4), -1).reshape(N, P * 64).float()
    return q, header[..., :2].reshape(N, -1), header[..., 2:].reshape(N, -1)


def q4_linear_reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the extension's 4-bit GEMM with 8-bit activations computes, in plain
    torch (tests), for pairs or tiles."""
    from completer.cpu_quant import q8_product

    y = q8_product(x, *(unpack_q4_tiles(packed) if packed.shape[-1] == TILE_BYTES else unpack_q4(packed)))
    return y if bias is None else y + bias
