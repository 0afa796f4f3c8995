"""Fixed chunk shapes (engine.row_chunks.chunk_pieces): every chunk length is a sum of warmed run lengths."""

from __future__ import annotations

import pytest

from engine.row_chunks import chunk_pieces, chunk_shapes


def test_shapes_up_to_256_are_the_base_16_digits() -> None:
    shapes = chunk_shapes(256)
    assert shapes == list(range(1, 16)) + list(range(16, 256, 16)) + [256]
    assert chunk_shapes(1000)[-3:] == [256, 512, 768] and chunk_shapes(1) == [1]


@pytest.mark.parametrize("limit", [16, 17, 64, 256, 300, 1024, 2048])
def test_every_chunk_splits_into_warmed_shapes_largest_first(limit: int) -> None:
    shapes = set(chunk_shapes(limit))
    for num in range(1, limit + 1):
        pieces = chunk_pieces(num)
        assert sum(pieces) == num and set(pieces) <= shapes, (num, pieces)
        assert pieces == sorted(pieces, reverse=True)
        assert len(pieces) <= 3 if limit <= 4096 else True


def test_known_splits() -> None:
    assert chunk_pieces(141) == [128, 13] and chunk_pieces(256) == [256] and chunk_pieces(255) == [240, 15]
    assert chunk_pieces(900) == [768, 128, 4] and chunk_pieces(7) == [7]
