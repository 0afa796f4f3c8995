"""Every ggml type engine.builder converts, against gguf-py's own dequantization: bit for bit in float32
(our exact float64 values rounded once; zeros compared by value, as ggml's arithmetic can give -0.0), on random
blocks, on blocks gguf-py quantizes itself, and on edge codes. The real Gemma 3 file's tensors are checked in
tests/integration/builder/test_gemma3.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.builder.ggml_quants import BLOCK_BYTES, CONVERTERS
from engine.builder.quant import unpack

# byte offsets of each type's float16 fields (d, dmin): random bytes there would be NaN/inf or subnormal
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q2_K: [80, 82],
              Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0], Q.IQ4_XS: [0]}
EXPECTED = {Q.Q4_0: (4, 32), Q.Q4_1: (4, 32), Q.Q5_0: (8, 32), Q.Q5_1: (8, 32), Q.Q8_0: (8, 32),
            Q.Q2_K: (4, 16), Q.Q3_K: (4, 16), Q.Q4_K: (4, 32), Q.Q5_K: (8, 32), Q.Q6_K: (8, 16),
            Q.IQ4_NL: (8, 32), Q.IQ4_XS: (8, 32)}


def random_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Random raw bytes of an [n, k] tensor, float16 fields set to finite normal values of either sign."""
    rng = np.random.default_rng(seed)
    block, nbytes = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        value = rng.uniform(0.5, 1.0, size=raw.shape[:2]) * 2.0 ** rng.integers(-14, 2, size=raw.shape[:2])
        raw[..., start : start + 2] = (value * rng.choice([-1, 1], size=value.shape)).astype(np.float16)[
            ..., None].view(np.uint8)
    return raw.reshape(n, -1)


def gguf_dequantized(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype)  # float32 [n, k]


def assert_bit_exact(raw: np.ndarray, qtype: Q, n: int, k: int):
    w = CONVERTERS[qtype](raw, n, k)
    assert w.shape == (n, k)
    assert (w.bits, w.block_size) == EXPECTED[qtype]
    assert w.scales.dtype == np.float32 and w.scales.shape == (n, k // w.block_size)
    ours = w.dequantize()  # float64, the exact values
    expected = gguf_dequantized(raw, qtype)
    ours32 = ours.astype(np.float32)
    nonzero = expected != 0  # ggml's float32 arithmetic may give -0.0 where the exact value is +0
    np.testing.assert_array_equal(ours32[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))
    np.testing.assert_array_equal(ours32[~nonzero], 0.0)
    return w


def test_every_converter_is_covered():
    assert set(CONVERTERS) == set(F16_FIELDS) == set(EXPECTED)


@pytest.mark.parametrize("qtype", list(CONVERTERS), ids=lambda q: q.name)
def test_random_blocks_dequantize_bit_for_bit(qtype):
    n, k = 24, 512
    assert_bit_exact(random_blocks(qtype, n, k, seed=int(qtype)), qtype, n, k)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_gguf_quantized_weights_dequantize_bit_for_bit(qtype):
    """Blocks gguf-py quantizes itself (the types it can write), from normal weights."""
    x = np.random.default_rng(7).normal(0, 0.05, size=(40, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    assert_bit_exact(raw, qtype, 40, 256)


@pytest.mark.parametrize("qtype", list(CONVERTERS), ids=lambda q: q.name)
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x55, 0xAA])
def test_constant_code_bytes(qtype, fill):
    """All-zero/all-one bit patterns reach the extreme codes (and Q3_K's high-bit edge cases)."""
    raw = random_blocks(qtype, 4, 256, seed=1).reshape(4, -1, BLOCK_BYTES[qtype][1])
    keep = np.zeros(raw.shape[-1], bool)
    for start in F16_FIELDS[qtype]:
        keep[start : start + 2] = True
    raw[..., ~keep] = fill
    assert_bit_exact(raw.reshape(4, -1), qtype, 4, 256)


@pytest.mark.parametrize("qtype", [Q.Q5_1, Q.Q5_K], ids=lambda q: q.name)
def test_8bit_offset_codes_are_centred(qtype):
    """5-bit offset codes stored in 8 bits are shifted so each block's mean code is 128 (see ggml_quants)."""
    w = CONVERTERS[qtype](random_blocks(qtype, 8, 512, seed=3), 8, 512)
    u = unpack(w.packed, 8).astype(np.float64)  # [N, nb, 32]
    assert np.abs(u.mean(axis=-1) - 128).max() <= 0.5
    assert w.offsets is not None


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS], ids=lambda q: q.name)
def test_row_length_must_be_a_whole_number_of_blocks(qtype):
    block, nbytes = BLOCK_BYTES[qtype]
    with pytest.raises(ValueError, match=f"multiple of {block}"):
        CONVERTERS[qtype](np.zeros(nbytes * 2, np.uint8), 1, block * 2 + 16)
