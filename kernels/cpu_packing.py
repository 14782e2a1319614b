"""The fused CPU layer's weight layouts (cpu_decode.cpp reads them), packed
in torch: GGUF Q4_1 blocks in pairs of blocks per row (`pack_q4`) or, for the
AVX512-VNNI kernel, in tiles of 16 rows (`pack_q4_tiles`); 8-bit weights in
tiles (`pack_i8_tiles`). Activations are fp32 or quantized to 8 bits per
block of 32 for the integer dot products, as llama.cpp's CPU backend does;
`q4_linear_reference` is that 8-bit math in plain torch (tests)."""

from __future__ import annotations

import torch

QK = 32  # weights per Q4_1 block
PAIR_BYTES = 40  # two blocks: fp16 scales, fp16 minimums, 32 bytes of nibbles


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
