"""ortserve against llama.cpp itself on the real Gemma 3 270M file: the same token ids for a mixed corpus, the
same text back, and teacher-forced top-1 agreement over four 32-token prompts.

llama.cpp is the dev-only llama-cpp-python build in `.bench-venv/` (`INSTALL_ONLY=1 perf/compare_cpu.sh`), so
these tests are skipped where it is absent or built for another CPU (CI); tests/reference/gguf_parity.py prints the
same figures.
"""

from __future__ import annotations

import pytest

from tests.reference.gguf_parity import CORPUS, peer_works, run_parity

WHY = peer_works()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"llama.cpp peer unavailable: {WHY}")


@pytest.fixture(scope="module")
def parity(gemma3_gguf, gemma3_model):
    return run_parity(gemma3_gguf, [gemma3_model])


def test_tokenization_and_detokenization_equal_llamacpp(parity):
    assert parity.mismatches == [] and parity.tokenization_equal == len(CORPUS)


def test_top1_agreement_with_llamacpp(parity):
    """Accuracy level 4 (int8 activations in MatMulNBits) against llama.cpp (q8 activations in its dot
    products): the two round differently, so near-ties may flip; expect at least 90% of the positions."""
    assert parity.positions == 4 * 32
    (agreement,) = parity.top1.values()
    assert agreement >= 0.9, f"top-1 agreement {agreement:.1%}"
