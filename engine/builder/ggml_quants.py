"""Exact conversion of ggml block formats into ``BlockQuantMatrix`` (MatMulNBits/GatherBlockQuantized layout).

One decoder per ggml type, written from the format's definition (ggml-common.h), never re-quantizing: every
converted element dequantizes to exactly the value ggml's dequantize_row_* gives it. Pure numpy: no onnx,
no onnxruntime.

How each type maps (``s`` the float32 scale, ``u`` the stored code, ``zp`` = 2**(bits-1)):

| ggml type | storage            | element value                   | offset per block          |
|-----------|--------------------|---------------------------------|---------------------------|
| Q4_0      | 4-bit, block 32    | d*(q-8)                         | none                      |
| Q4_1      | 4-bit, block 32    | d*(q-8) + (m + 8d)              | m + 8d                    |
| Q5_0      | 8-bit, block 32    | d*(q-16)                        | none                      |
| Q5_1      | 8-bit, block 32    | d*(q-c) + (m + c*d)             | m + c*d, c = centre       |
| Q8_0      | 8-bit, block 32    | d*q                             | none                      |
| Q2_K      | 4-bit, block 16    | d*sc*(q-2) + (2*d*sc - dmin*m)  | yes                       |
| Q3_K      | 4-bit, block 16    | d*(sc-32)*q, q in [-4, 3]       | none                      |
| Q4_K      | 4-bit, block 32    | d*sc*(q-8) + (8*d*sc - dmin*m)  | yes                       |
| Q5_K      | 8-bit, block 32    | d*sc*(q-c) + (c*d*sc - dmin*m)  | yes, c = centre           |
| Q6_K      | 8-bit, block 16    | d*sc*(q-32), sc signed          | none                      |
| IQ4_NL    | 8-bit, block 32    | d*kvalues[q] (integer codebook) | none                      |
| IQ4_XS    | 8-bit, block 32    | d*(ls-32)*kvalues[q]            | none                      |

NOTE(builder): the offset form. ONNX Runtime's MatMulNBits quantizes activations to int8 per block at
accuracy_level 4, and only the ``s*(u - zp)`` part sees them; the per-block offset is added exactly in float32
as ``blocksum(x) @ offsets.T`` (engine.builder.graph). The activation rounding error of a block grows with
``sum((u - zp)**2)``, so codes are centred on zp: 4-bit codes in [0, 16) against zp 8 (the default: no
zero-point tensor, the fast kernel path), and 8-bit storage of 5-bit offset codes (Q5_1, Q5_K) shifted per
block so that the block's mean code lands on 128, which is free in 8 bits. Offsets are float64 here and
float32 in the graph; scales are exact in float32 (f16 times a small integer), not always in float16.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.builder.quant import QK, BlockQuantMatrix, pack

QK_K = 256  # elements per K-quant super-block
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)

# bytes per block of each type (and the block's element count)
BLOCK_BYTES = {
    T.Q4_0: (QK, 18), T.Q4_1: (QK, 20), T.Q5_0: (QK, 22), T.Q5_1: (QK, 24), T.Q8_0: (QK, 34),
    T.Q2_K: (QK_K, 84), T.Q3_K: (QK_K, 110), T.Q4_K: (QK_K, 144), T.Q5_K: (QK_K, 176), T.Q6_K: (QK_K, 210),
    T.IQ4_NL: (QK, 18), T.IQ4_XS: (QK_K, 136),
}


def _blocks(raw: np.ndarray, n: int, k: int, qtype: T) -> np.ndarray:
    """ggml raw bytes of an [N, K] tensor as uint8 [N, K/block, block_bytes]."""
    block, nbytes = BLOCK_BYTES[qtype]
    if k % block:
        raise ValueError(f"row length {k} is not a multiple of {block} ({qtype.name} blocks)")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // block, nbytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 [N, nb]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2B] codes: the low nibbles of all bytes, then the high nibbles (ggml order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(data: np.ndarray, num: int, width: int) -> np.ndarray:
    """[..., B] bytes -> [..., num, B]: field j is ``(byte >> (width*j)) & mask`` (ggml's shifted planes)."""
    shifts = (np.arange(num, dtype=np.uint8) * width)[:, None]
    return (data[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _matrix(bits: int, block_size: int, codes: np.ndarray, scales: np.ndarray,
            offsets: np.ndarray | None = None) -> BlockQuantMatrix:
    """codes: integer [N, nb, block_size] already shifted into [0, 2**bits); scales float32 [N, nb]."""
    n = codes.shape[0]
    codes = codes.reshape(n, -1, block_size)
    return BlockQuantMatrix(bits, block_size, pack(codes.astype(np.uint8), bits),
                            np.ascontiguousarray(scales.reshape(n, -1), dtype=np.float32),
                            None if offsets is None else np.ascontiguousarray(offsets.reshape(n, -1), np.float64))


def _centred_8bit(q: np.ndarray, s: np.ndarray, o: np.ndarray) -> BlockQuantMatrix:
    """Unsigned codes ``q`` [N, nb, bs] of ``s*q + o`` as 8-bit codes centred on 128 (see module NOTE)."""
    c = np.rint(q.mean(axis=-1))  # [N, nb]: the block's centre code
    u = q.astype(np.int16) - c[..., None].astype(np.int16) + 128
    return _matrix(8, q.shape[-1], u, s, o.astype(np.float64) + c * s.astype(np.float64))


# --- 32-element formats -------------------------------------------------------------------------------


def from_q4_0(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q4_0: ``x = d*(q-8)``; q in the MatMulNBits nibble order, default zero point 8."""
    b = _blocks(raw, n, k, T.Q4_0)
    return _matrix(4, QK, _nibbles(b[..., 2:]), _f16(b, 0))


def from_q4_1(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q4_1: ``x = d*q + m`` = ``d*(q-8) + (m + 8d)``."""
    b = _blocks(raw, n, k, T.Q4_1)
    d, m = _f16(b, 0), _f16(b, 2)
    return _matrix(4, QK, _nibbles(b[..., 4:]), d, m.astype(np.float64) + 8.0 * d.astype(np.float64))


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 codes [N, nb, 32] in [0, 32): 4 low bits from the nibbles, bit 4 from the 32-bit mask."""
    high = _bits(qh, 8, 1).transpose(0, 1, 3, 2).reshape(qh.shape[:-1] + (32,))  # element 8*byte + bit
    return _nibbles(qs) | (high << 4)


def from_q5_0(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q5_0: ``x = d*(q-16)``, stored 8-bit as ``q + 112`` (so ``u - 128 = q - 16``)."""
    b = _blocks(raw, n, k, T.Q5_0)
    q = _q5_codes(b[..., 2:6], b[..., 6:22])
    return _matrix(8, QK, q.astype(np.int16) + 112, _f16(b, 0))


def from_q5_1(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q5_1: ``x = d*q + m``, 8-bit codes centred per block, offset ``m + c*d``."""
    b = _blocks(raw, n, k, T.Q5_1)
    q = _q5_codes(b[..., 4:8], b[..., 8:24])
    return _centred_8bit(q, _f16(b, 0), _f16(b, 2))


def from_q8_0(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q8_0: ``x = d*q`` (int8 q), stored as ``q + 128`` against the default zero point 128."""
    b = _blocks(raw, n, k, T.Q8_0)
    return _matrix(8, QK, b[..., 2:].view(np.int8).astype(np.int16) + 128, _f16(b, 0))


def from_iq4_nl(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """IQ4_NL: ``x = d*kvalues[q]``; the codebook values are integers in [-127, 113]: 8-bit, exact."""
    b = _blocks(raw, n, k, T.IQ4_NL)
    return _matrix(8, QK, KVALUES_IQ4NL[_nibbles(b[..., 2:])] + 128, _f16(b, 0))


# --- K-quants (256-element super-blocks) ----------------------------------------------------------------


def _k_scale_min(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit (scale, min) pairs -> two uint8 [..., 8]."""
    a, b, c = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    minimum = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scale, minimum


def _k_sub_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: scale ``d*sc`` and offset ``-dmin*m`` of each 32-element sub-block, float32 [N, nb, 8]."""
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, m = _k_scale_min(b[..., 4:16])
    # NOTE(builder): exact in float32: an f16 (11-bit significand) times a 6-bit integer.
    return d[..., None] * sc.astype(np.float32), -(dmin[..., None] * m.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> [N, nb, 8, 32]: chunk i of 32 bytes gives sub-block 2i (low) and 2i+1 (high)."""
    chunks = qs.reshape(qs.shape[:-1] + (4, 32))
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(qs.shape[:-1] + (8, 32))


def from_q4_k(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q4_K: per 32-element sub-block ``x = d*sc*q - dmin*m``: 4-bit, block 32, offset ``8*d*sc - dmin*m``."""
    b = _blocks(raw, n, k, T.Q4_K)
    s, o = _k_sub_scales(b)
    q = _k_low_nibbles(b[..., 16:144])  # [N, nb, 8, 32]
    return _matrix(4, QK, q, s, o.astype(np.float64) + 8.0 * s.astype(np.float64))


def from_q5_k(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q5_K: as Q4_K with a fifth bit per element from the 32-byte mask (bit j of byte l: sub-block j)."""
    b = _blocks(raw, n, k, T.Q5_K)
    s, o = _k_sub_scales(b)
    q = _k_low_nibbles(b[..., 48:176]) | (_bits(b[..., 16:48], 8, 1) << 4)  # [N, nb, 8, 32]
    return _centred_8bit(q.reshape(n, -1, QK), s.reshape(n, -1), o.reshape(n, -1))


def from_q6_k(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q6_K: ``x = d*sc*(q-32)``, signed 8-bit sc per 16 elements: 8-bit, block 16, ``u = q + 96``."""
    b = _blocks(raw, n, k, T.Q6_K)
    ql = b[..., 0:128].reshape(n, -1, 2, 64)  # two halves of 128 elements
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [N, nb, 2, 128]
    high = _bits(qh, 4, 2).reshape(n, -1, 2, 128)  # element 32*j + l of a half: bits 2j of qh[l]
    q = (low | (high << 4)).astype(np.int16) + 96  # u - 128 = q - 32
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [N, nb, 16]
    return _matrix(8, 16, q, _f16(b, 208)[..., None] * sc)


def from_q2_k(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q2_K: per 16 elements ``x = d*sc*q - dmin*m``, q in [0, 4): 4-bit, block 16, ``u = q + 6``."""
    b = _blocks(raw, n, k, T.Q2_K)
    sc, d, dmin = b[..., 0:16], _f16(b, 80), _f16(b, 82)
    q = _bits(b[..., 16:80].reshape(n, -1, 2, 32), 4, 2).reshape(n, -1, 16, 16)  # 128*h + 32*j + l
    s = d[..., None] * (sc & 0x0F).astype(np.float32)
    o = -(dmin[..., None] * (sc >> 4).astype(np.float32))
    return _matrix(4, 16, q + 6, s, o.astype(np.float64) + 2.0 * s.astype(np.float64))


def from_q3_k(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """Q3_K: per 16 elements ``x = d*(sc-32)*q``, q in [-4, 4): 4-bit, block 16, ``u = q + 8``."""
    b = _blocks(raw, n, k, T.Q3_K)
    hmask, qs, packed, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b, 108)
    low = _bits(qs.reshape(n, -1, 2, 32), 4, 2).reshape(n, -1, 256)  # element 128*h + 32*j + l
    high = _bits(hmask, 8, 1).reshape(n, -1, 256)  # element 32*j + l: bit j of hmask[l]
    q = low.astype(np.int16) - np.where(high == 1, 0, 4)  # the bit set means no -4
    lo4 = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # [N, nb, 16]
    hi2 = _bits(packed[..., 8:12], 4, 2).reshape(n, -1, 16)  # scale 4*j + t: bits 2j of byte 8 + t
    sc = (lo4 | (hi2 << 4)).astype(np.float32) - 32.0
    return _matrix(4, 16, q + 8, d[..., None] * sc)


def from_iq4_xs(raw: np.ndarray, n: int, k: int) -> BlockQuantMatrix:
    """IQ4_XS: per 32 elements ``x = d*(ls-32)*kvalues[q]``, 6-bit ls: 8-bit, block 32."""
    b = _blocks(raw, n, k, T.IQ4_XS)
    d = _f16(b, 0)
    scales_h = np.ascontiguousarray(b[..., 2:4]).view(np.uint16)[..., 0]  # [N, nb]
    lo = np.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], axis=-1).reshape(n, -1, 8)  # nibble t of byte i: 2i+t
    hi = (scales_h[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    ls = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    codes = _nibbles(b[..., 8:136].reshape(n, -1, 8, 16))  # [N, nb, 8, 32]
    return _matrix(8, QK, KVALUES_IQ4NL[codes] + 128, d[..., None] * ls.astype(np.float32))


CONVERTERS: dict[T, Callable[[np.ndarray, int, int], BlockQuantMatrix]] = {
    T.Q4_0: from_q4_0, T.Q4_1: from_q4_1, T.Q5_0: from_q5_0, T.Q5_1: from_q5_1, T.Q8_0: from_q8_0,
    T.Q2_K: from_q2_k, T.Q3_K: from_q3_k, T.Q4_K: from_q4_k, T.Q5_K: from_q5_k, T.Q6_K: from_q6_k,
    T.IQ4_NL: from_iq4_nl, T.IQ4_XS: from_iq4_xs,
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
SUPPORTED_TYPES = tuple(t.name for t in FLOAT_TYPES + tuple(CONVERTERS))
