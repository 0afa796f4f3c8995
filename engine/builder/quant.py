"""Block-quantized weights in ONNX Runtime's MatMulNBits/GatherBlockQuantized layout, and exact
conversion from ggml blocks (Q4_0, Q4_1, Q8_0). Pure numpy: no onnx, no onnxruntime.

NOTE(builder): nothing here re-quantizes. Every converted block dequantizes to exactly the value ggml
dequantizes it to; Q4_1's min term is kept as a per-block additive offset, see ``BlockQuantMatrix``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # elements per ggml block for Q4_0, Q4_1 and Q8_0

# bytes per 32-element block
Q4_0_BYTES = 2 + QK // 2
Q4_1_BYTES = 2 + 2 + QK // 2
Q8_0_BYTES = 2 + QK


@dataclass(frozen=True)
class BlockQuantMatrix:
    """A weight ``W`` of shape [N, K] quantized along K in blocks of ``block_size``.

    ``W[n, k] = (q[n, k] - 2**(bits-1)) * scales[n, b] + offsets[n, b]`` with ``b = k // block_size``.
    The zero point is always the MatMulNBits/GatherBlockQuantized default ``2**(bits-1)`` (8 or 128), so
    no zero-point tensor is stored. ``offsets`` is None for symmetric formats (Q4_0, Q8_0); for Q4_1
    (``x = d*q + m``) it is ``m + 8*d`` and the graph adds ``blocksum(A) @ offsets.T``.

    Attributes:
        bits: 4 or 8.
        block_size: elements per block along K (32 for ggml formats).
        packed: uint8 [N, K/block_size, block_size*bits/8]; 4-bit: element 2i in the low nibble of
            byte i, element 2i+1 in the high nibble (MatMulNBits layout).
        scales: float32 [N, K/block_size] (ggml's float16 scales, exactly).
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


def _blocks(raw: np.ndarray, n: int, k: int, block_bytes: int) -> np.ndarray:
    """Views ggml raw bytes as uint8 [N, K/32, block_bytes]."""
    if k % QK:
        raise ValueError(f"row length {k} is not a multiple of {QK}")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QK, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 [N, nb]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _ggml_q4_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml 4-bit order (byte j holds elements j and j+16) -> uint8 [..., 32] in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def from_q4_0(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """ggml Q4_0 (``x = d*(q-8)``) -> MatMulNBits bits=4, default zero point 8, after nibble repacking."""
    blocks = _blocks(raw, n, k, Q4_0_BYTES)
    q = _ggml_q4_nibbles(blocks[..., 2:])
    return BlockQuantMatrix(4, QK, pack(q, 4), _f16(blocks, 0))


def from_q4_1(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """ggml Q4_1 (``x = d*q + m``) -> bits=4 with ``d*(q-8)`` plus offset ``m + 8d`` per block."""
    blocks = _blocks(raw, n, k, Q4_1_BYTES)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _ggml_q4_nibbles(blocks[..., 4:])
    offsets = m.astype(np.float64) + 8.0 * d.astype(np.float64)
    return BlockQuantMatrix(4, QK, pack(q, 4), d, offsets)


def from_q8_0(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """ggml Q8_0 (``x = d*q``, int8 q) -> bits=8 with uint8 ``q + 128`` and default zero point 128."""
    blocks = _blocks(raw, n, k, Q8_0_BYTES)
    q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
    return BlockQuantMatrix(8, QK, q.astype(np.uint8), _f16(blocks, 0))


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


def dequantize(w: LinearWeight) -> np.ndarray:
    """Any linear weight -> float64 [N, K]."""
    return w.dequantize() if isinstance(w, BlockQuantMatrix) else np.asarray(w, np.float64)


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
