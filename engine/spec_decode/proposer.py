"""The interface every draft source implements (prompt lookup, a draft model): rows in, one ``Draft`` per row out.
The target's check (``engine.core.EngineCore._run_verify`` and ``RequestSampler.verify``) takes a ``Draft`` whatever
proposed it. Pure Python, no numpy, no onnxruntime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

NGRAM, DRAFT_MODEL = "ngram", "draft_model"  # Draft.source


@dataclass(frozen=True)
class DraftRow:
    """A request in decode that drafts this step, and the most tokens it may draft."""

    request: Any  # engine.scheduler.Request
    num_tokens: int


@dataclass(frozen=True)
class Draft:
    """What a source proposes for one row: the tokens to follow the request's last token, and the distribution each
    was drawn from (float ``[len(token_ids), vocab]``; None: point masses, or drawn greedily)."""

    request: Any
    token_ids: tuple[int, ...]
    probs: Any = None
    source: str = NGRAM


class Proposer(Protocol):
    """A draft source. ``propose`` returns one Draft per row, in row order (a draft may be shorter than asked, or
    empty: the row then decodes one token in its check)."""

    name: str

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]: ...


class NgramProposer:
    """Prompt lookup (``engine.speculative.NgramDrafter``, each request's own): the draft is what followed the last
    n-gram's latest earlier occurrence, as long as its acceptance rate pays for. Lookups only, so the scheduler asks it
    as it decides (an empty draft means no match). A constrained request's draft stops before the first token its
    grammar forbids (``constraint.allows``; the check masks each row besides: ``engine.constraint_masks``)."""

    name = NGRAM

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = []
        for row in rows:
            request = row.request
            draft = request.drafter.propose(request.prompt_ids, request.output_ids, row.num_tokens) \
                if row.num_tokens > 0 else ()
            if draft and request.constraint is not None:
                draft = draft[:request.constraint.allows(draft)]
            drafts.append(Draft(request, draft, source=NGRAM))
        return drafts
