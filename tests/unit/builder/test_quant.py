"""Exact ggml -> MatMulNBits repacking, checked against the gguf package's own dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.builder.ggml_quants import from_q4_0, from_q4_1, from_q8_0
from engine.builder.quant import concat_rows, pack, random_block_quant, split_rows, to_q4_0, unpack


@pytest.mark.parametrize("qtype,convert", [(Q.Q4_0, from_q4_0), (Q.Q4_1, from_q4_1), (Q.Q8_0, from_q8_0)])
def test_conversion_dequantizes_exactly_like_ggml(qtype, convert):
    x = np.random.default_rng(0).normal(size=(48, 160)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)  # [48, bytes per row]
    expected = gguf.quants.dequantize(raw, qtype).astype(np.float64)
    w = convert(raw, 48, 160)
    assert w.shape == (48, 160)
    np.testing.assert_array_equal(w.dequantize(), expected)  # bit-exact in float64


def test_q4_1_offsets_are_min_plus_8d():
    x = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, Q.Q4_1).reshape(2, 2, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    w = from_q4_1(raw, 2, 64)
    np.testing.assert_array_equal(w.offsets, m + 8 * d)
    np.testing.assert_array_equal(w.scales, d.astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_roundtrip_and_nibble_order(bits):
    q = np.random.default_rng(2).integers(0, 2**bits, size=(3, 5, 32), dtype=np.uint8)
    packed = pack(q, bits)
    assert packed.shape == (3, 5, 32 * bits // 8)
    np.testing.assert_array_equal(unpack(packed, bits), q)
    if bits == 4:  # element 2i in the low nibble, 2i+1 in the high nibble (MatMulNBits layout)
        assert packed[0, 0, 0] == q[0, 0, 0] | (q[0, 0, 1] << 4)


def test_concat_rows_fuses_compatible_weights_only():
    rng = np.random.default_rng(3)
    a = random_block_quant(rng, 8, 64, fmt="q4_1", std=0.1)
    b = random_block_quant(rng, 4, 64, fmt="q4_0", std=0.1)
    fused = concat_rows([a, b])
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    assert concat_rows([a, random_block_quant(rng, 4, 64, fmt="q8_0", std=0.1)]) is None
    assert concat_rows([a, np.zeros((4, 64), np.float32)]) is None


def test_split_rows_inverts_concat_rows():
    rng = np.random.default_rng(4)
    a = random_block_quant(rng, 96, 64, fmt="q4_1", std=0.1)
    parts = split_rows(a, [64, 16, 16])
    assert [p.shape for p in parts] == [(64, 64), (16, 64), (16, 64)]
    np.testing.assert_array_equal(concat_rows(parts).dequantize(), a.dequantize())
    dense = np.arange(12.0).reshape(6, 2)
    assert [p.tolist() for p in split_rows(dense, [2, 4])] == [dense[:2].tolist(), dense[2:].tolist()]
    with pytest.raises(ValueError, match="do not add up"):
        split_rows(a, [64, 16])


@pytest.mark.parametrize("source", [Q.Q8_0, None])
def test_to_q4_0_quantizes_as_ggml_does(source):
    """A draft model's requantization (convert_gguf's requant="q4_0") gives the codes and scales llama.cpp's own Q4_0
    quantizer gives (gguf-py's reference of quantize_row_q4_0_ref) for the same values: from an 8-bit weight (Q8_0
    here; Q5_0 and Q6_K arrive 8-bit too) and from a float one, a block at a time over fewer rows than the weight."""
    x = np.random.default_rng(3).normal(size=(40, 96)).astype(np.float32)
    x[5, :32] = 0.0  # an all-zero block: d = 0, every code 8
    w = x if source is None else from_q8_0(gguf.quants.quantize(x, source), 40, 96)
    values = x if source is None else w.dequantize().astype(np.float32)
    expected = gguf.quants.dequantize(gguf.quants.quantize(values, Q.Q4_0), Q.Q4_0).astype(np.float64)
    q = to_q4_0(w, rows=16)
    assert (q.bits, q.block_size, q.offsets) == (4, 32, None)
    np.testing.assert_array_equal(q.dequantize(), expected)
    assert np.abs(q.dequantize() - values).max() > 0  # lossy: 4 bits are not 8


def test_to_q4_0_leaves_4_bit_weights_alone():
    w = random_block_quant(np.random.default_rng(0), 8, 64, fmt="q4_0", std=0.02)
    assert to_q4_0(w) is w
