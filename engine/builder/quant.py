"""Block-quantized weights in ONNX Runtime's MatMulNBits/GatherBlockQuantized layout (the ggml decoders
that fill them live in engine.builder.ggml_quants). Pure numpy: no onnx, no onnxruntime.

NOTE(builder): nothing here re-quantizes. Offset formats (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) keep their min term
as a per-block additive offset, see ``BlockQuantMatrix``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # elements per ggml block for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL


@dataclass(frozen=True)
class BlockQuantMatrix:
    """A weight ``W`` of shape [N, K] quantized along K in blocks of ``block_size``.

    ``W[n, k] = (q[n, k] - 2**(bits-1)) * scales[n, b] + offsets[n, b]`` with ``b = k // block_size``.
    The zero point is always the MatMulNBits/GatherBlockQuantized default ``2**(bits-1)`` (8 or 128), so
    no zero-point tensor is stored. ``offsets`` is None for symmetric formats (Q4_0, Q8_0, Q6_K, ...); for
    Q4_1 (``x = d*q + m``) it is ``m + 8*d`` and the graph adds ``blocksum(A) @ offsets.T``.

    Attributes:
        bits: 4 or 8.
        block_size: elements per block along K (32, or 16 for Q2_K/Q3_K/Q6_K).
        packed: uint8 [N, K/block_size, block_size*bits/8]; 4-bit: element 2i in the low nibble of
            byte i, element 2i+1 in the high nibble (MatMulNBits layout).
        scales: float32 [N, K/block_size] (exact: ggml's float16 scales, times K-quant sub-block scales).
        offsets: float64 [N, K/block_size] or None.
    """

    bits: int
    block_size: int
    packed: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, num_blocks, _ = self.packed.shape
        return n, num_blocks * self.block_size

    def dequantize(self) -> np.ndarray:
        """Returns float64 [N, K], the exact values the weight stands for."""
        q = unpack(self.packed, self.bits).astype(np.float64)  # [N, nb, bs]
        w = (q - 2 ** (self.bits - 1)) * self.scales.astype(np.float64)[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.shape)


# A linear weight is either block-quantized or a float array [N, K] (out_features, in_features).
LinearWeight = BlockQuantMatrix | np.ndarray


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Packs unsigned quantized values.

    Args:
        q: uint8 [..., block_size] values in [0, 2**bits).
        bits: 4 or 8.
    Returns:
        uint8 [..., block_size*bits/8].
    """
    q = q.astype(np.uint8)
    if bits == 8:
        return q
    if bits == 4:
        return q[..., 0::2] | (q[..., 1::2] << 4)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of ``pack``: uint8 [..., n] -> uint8 [..., n*8/bits]."""
    if bits == 8:
        return packed
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def concat_rows(mats: list[LinearWeight]) -> LinearWeight | None:
    """Stacks weights along N (fused QKV, fused gate/up).

    Returns:
        The fused weight, or None when the parts cannot share one MatMulNBits (different bits, block
        sizes, or float mixed with quantized); the graph then runs them separately.
    """
    if all(isinstance(m, np.ndarray) for m in mats):
        return np.concatenate(mats, axis=0)
    if not all(isinstance(m, BlockQuantMatrix) for m in mats):
        return None
    if len({(m.bits, m.block_size, m.shape[1]) for m in mats}) != 1:
        return None
    offsets = None
    if any(m.offsets is not None for m in mats):
        offsets = np.concatenate(
            [m.offsets if m.offsets is not None else np.zeros(m.scales.shape) for m in mats], axis=0
        )
    return BlockQuantMatrix(
        mats[0].bits,
        mats[0].block_size,
        np.concatenate([m.packed for m in mats], axis=0),
        np.concatenate([m.scales for m in mats], axis=0),
        offsets,
    )


def split_rows(w: LinearWeight, sizes: list[int]) -> list[LinearWeight]:
    """Splits a weight [N, K] into consecutive row groups of ``sizes`` (fused QKV or gate/up tensors)."""
    if sum(sizes) != w.shape[0]:
        raise ValueError(f"row sizes {sizes} do not add up to the weight's {w.shape[0]} rows")
    bounds = np.cumsum([0, *sizes])
    if isinstance(w, np.ndarray):
        return [w[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [BlockQuantMatrix(w.bits, w.block_size, w.packed[a:b], w.scales[a:b],
                             None if w.offsets is None else w.offsets[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])]


def dequantize(w: LinearWeight) -> np.ndarray:
    """Any linear weight -> float64 [N, K]."""
    return w.dequantize() if isinstance(w, BlockQuantMatrix) else np.asarray(w, np.float64)


REQUANT_FORMATS = ("q4_0",)


def to_q4_0(w: LinearWeight, rows: int = 4096) -> LinearWeight:
    """A weight stored in more than 4 bits (8-bit blocks: Q5_0/Q5_1/Q8_0/Q5_K/Q6_K; float) requantized as llama.cpp's
    Q4_0 quantizes (its quantize_row_q4_0_ref: per block of 32, d = the signed value of largest magnitude / -8, codes
    trunc(x / d + 8.5) clipped to 15); 4-bit weights are returned as they are. Lossy: for a draft model, whose tokens
    the target checks, where a 4-bit weight reads half the bytes of an 8-bit one. ``rows`` bounds the work at a time.

    Returns:
        A 4-bit BlockQuantMatrix with blocks of 32 (no offsets), or ``w`` itself.
    """
    if isinstance(w, BlockQuantMatrix) and w.bits == 4:
        return w
    n, k = w.shape
    if k % 32:
        return w
    packed = np.empty((n, k // 32, 16), np.uint8)
    scales = np.empty((n, k // 32), np.float32)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        # float32 arithmetic, as ggml's: every source value (a float16 scale times a small integer) is exact in it
        blocks = dequantize(split_rows(w, [a, b - a, n - b])[1]).astype(np.float32).reshape(b - a, k // 32, 32)
        pick = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)[..., 0]  # signed, largest |x|
        d = pick / np.float32(-8)
        inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.trunc(blocks * inv[..., None] + np.float32(8.5)), 0, 15).astype(np.uint8)
        packed[a:b] = pack(q, 4)
        scales[a:b] = d.astype(np.float16)  # stored as ggml stores it
    return BlockQuantMatrix(4, 32, packed, scales)


def random_block_quant(
    rng: np.random.Generator, n: int, k: int, *, fmt: str, std: float
) -> BlockQuantMatrix:
    """Random weights in a ggml-like block format, for synthetic models.

    Args:
        fmt: "q4_0", "q4_1" or "q8_0".
        std: rough standard deviation of the dequantized weights.
    Returns:
        A BlockQuantMatrix of shape [n, k] whose scales are exactly representable in float16.
    """
    nb = k // QK
    if fmt == "q8_0":
        q = rng.integers(0, 256, size=(n, nb, QK), dtype=np.uint8)
        d = (std / 74.0) * rng.uniform(0.5, 1.5, size=(n, nb))
        return BlockQuantMatrix(8, QK, q, d.astype(np.float16).astype(np.float32))
    packed = rng.integers(0, 256, size=(n, nb, QK // 2), dtype=np.uint8)  # both nibbles uniform in [0, 16)
    d = ((std / 4.6) * rng.uniform(0.5, 1.5, size=(n, nb))).astype(np.float16).astype(np.float32)
    if fmt == "q4_0":
        return BlockQuantMatrix(4, QK, packed, d)
    if fmt == "q4_1":
        m = (-8.0 * d * rng.uniform(0.8, 1.2, size=(n, nb))).astype(np.float16).astype(np.float64)
        return BlockQuantMatrix(4, QK, packed, d, m + 8.0 * d.astype(np.float64))
    raise ValueError(f"fmt must be q4_0, q4_1 or q8_0, got {fmt!r}")
