"""Questions read from logits: how one is put to the model, which label tokens answer it, and the distribution
its label log-probabilities give. Shared by OpenAI's Decisions API and System One's format (both only convert
their wire types to ``Question`` and ``Answer`` back); pure Python and numpy, no engine import but engine.types.

A question is rendered after the input as the last user turn: its instructions, its options under labels (A-Z and
beyond, yes/no, 0-9), and a line asking for the label only. The answer position is the assistant turn's first
token; a softmax over the label tokens' log-probabilities there is the answer (vLLM's and SGLang's design).
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

QuestionKind = Literal["predicate", "choice", "score"]

# The label alphabets, first choice first. Choices and levels beyond them take the two-letter labels the tokenizer
# has as single tokens (AA, AB, ...), so how many options a question may have depends on the tokenizer.
LETTERS = tuple(string.ascii_uppercase)
DIGITS = tuple(string.digits)
MAX_OPTIONS = 255  # OpenAI's and System One's bound on choices and levels


@dataclass(frozen=True)
class Option:
    """One choice or level as the prompt shows it."""

    text: str
    description: str | None = None


@dataclass(frozen=True)
class Question:
    """A question in the protocols' common form.

    Attributes:
        kind: "predicate" (yes or no; System One's noul), "choice" or "score" (ordered levels, lowest first).
        instructions: the question text.
        options: choices or levels (a predicate has none; ``yes_means``/``no_means`` describe its answers).
    """

    kind: QuestionKind
    instructions: str
    options: tuple[Option, ...] = ()
    yes_means: str | None = None
    no_means: str | None = None
    asked_as: str | None = None  # a predicate put as this yes/no question instead of "Is the statement true?"


@dataclass(frozen=True)
class LabelSet:
    """The label of each outcome (yes/no for a predicate, else one per option) and its token ids: ``token_ids[i]``
    are the single-token spellings of outcome i at the answer position ("yes" and "Yes" for a predicate's yes)."""

    labels: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]

    @property
    def flat_ids(self) -> tuple[int, ...]:
        """Every token id to read, outcome by outcome (the engine request's label_token_ids)."""
        return tuple(t for ids in self.token_ids for t in ids)


class Refusal(Exception):
    """A question the model cannot answer with single-token labels (answered with a refusal, not a failure)."""


def _label_alphabet(question: Question) -> tuple[tuple[str, ...], Callable[[str], tuple[str, ...]]]:
    """(labels to try, in order; the spellings of one label that count for it)."""
    if question.kind == "predicate":
        return ("yes", "no"), lambda label: (label, label.capitalize())
    if question.kind == "score" and len(question.options) <= len(DIGITS):
        return DIGITS, lambda label: (label,)
    pairs = tuple(a + b for a in LETTERS for b in LETTERS)
    return LETTERS + pairs, lambda label: (label,)


def choose_labels(question: Question, single_token: Callable[[str], int | None]) -> LabelSet:
    """The labels of ``question``'s outcomes.

    Args:
        single_token: the token id a label is at the answer position when it is one token there, else None.
    Raises:
        Refusal: a predicate's yes or no, or a score's digit, is not one token; or the tokenizer has fewer single-token
            letter labels than the question has options.
    """
    alphabet, spellings = _label_alphabet(question)
    wanted = 2 if question.kind == "predicate" else len(question.options)
    labels: list[str] = []
    token_ids: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for label in alphabet:
        if len(labels) == wanted:
            break
        first = single_token(label)
        if first is None or first in seen:
            if question.kind == "choice" or (question.kind == "score" and alphabet is not DIGITS):
                continue  # NOTE(server): letter labels: skip one the tokenizer splits, take the next
            raise Refusal(f"the label {label!r} is not a single token at the answer position")
        ids = [first]
        for other in spellings(label)[1:]:
            t = single_token(other)
            if t is not None and t not in seen and t not in ids:
                ids.append(t)
        seen.update(ids)
        labels.append(label)
        token_ids.append(tuple(ids))
    if len(labels) < wanted:
        raise Refusal(f"the tokenizer has {len(labels)} single-token labels for {wanted} options")
    return LabelSet(tuple(labels), tuple(token_ids))


def question_text(question: Question, labels: LabelSet) -> str:
    """The question as the last user turn shows it: instructions, options under their labels, the answer form."""
    if question.kind == "predicate":
        lines = [question.asked_as or f"Is the following statement true? {question.instructions}"]
        if question.yes_means:
            lines.append(f"(yes means: {question.yes_means})")
        if question.no_means:
            lines.append(f"(no means: {question.no_means})")
        lines.append("Answer with yes or no only.")
        return "\n".join(lines)
    head = "Options:" if question.kind == "choice" else "Levels, from lowest to highest:"
    lines = [question.instructions, "", head]
    for label, option in zip(labels.labels, question.options):
        lines.append(f"{label}. {option.text}" + (f": {option.description}" if option.description else ""))
    what = "letter of one option" if question.kind == "choice" else (
        "number of one level" if labels.labels[0] in DIGITS else "letter of one level")
    lines += ["", f"Answer with the {what} only."]
    return "\n".join(lines)


def question_messages(input_messages: Sequence[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The chat messages of one question: the input, then the question as the last user turn (appended to a last
    user message, so templates that insist on alternating roles take it).

    NOTE(server): every question of a request renders the same messages up to the question, so their prompts share
    the input's tokens and the engine's prefix reuse computes them once.
    """
    messages = [dict(m) for m in input_messages]
    if messages and messages[-1].get("role") == "user" and isinstance(messages[-1].get("content"), str):
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{text}"
    else:
        messages.append({"role": "user", "content": text})
    return messages


@dataclass(frozen=True)
class Distribution:
    """The answer to one question: ``probabilities[i]`` of outcome i (they sum to 1), and a confidence."""

    probabilities: tuple[float, ...]

    @property
    def best(self) -> int:
        return int(np.argmax(self.probabilities))

    @property
    def confidence(self) -> float:
        """1 when one outcome holds all the probability, 0 when all are equally likely (1 - normalized entropy)."""
        p = np.asarray(self.probabilities, dtype=np.float64)
        if len(p) < 2:
            return 1.0
        nz = p[p > 0]
        entropy = float(-(nz * np.log(nz)).sum())
        return float(min(1.0, max(0.0, 1.0 - entropy / math.log(len(p)))))

    @property
    def margin_confidence(self) -> float:
        """System One's confidence (as Jev and llama.cpp define it): how far the likeliest outcome is above a uniform
        guess, (p_max - 1/k) / (1 - 1/k); 1 when it holds all the probability, 0 when all k are equally likely."""
        k = len(self.probabilities)
        if k < 2:
            return 1.0
        return float(min(1.0, max(0.0, (max(self.probabilities) - 1 / k) / (1 - 1 / k))))

    @property
    def expected_index(self) -> float:
        """The expected outcome index (a score's expected level, counting from 0)."""
        return float(np.dot(np.arange(len(self.probabilities)), self.probabilities))


def distribution(labels: LabelSet, logprobs: Sequence[float]) -> Distribution:
    """A softmax over the labels: each outcome's probability is the sum over its spellings, renormalized over all
    outcomes, in float64.

    Args:
        logprobs: the engine's log-probabilities of ``labels.flat_ids``, in that order.
    """
    values = np.asarray(logprobs, dtype=np.float64)
    top = values.max()
    mass = np.exp(values - top)  # relative; the common factor cancels
    per_outcome, at = [], 0
    for ids in labels.token_ids:
        per_outcome.append(mass[at:at + len(ids)].sum())
        at += len(ids)
    p = np.asarray(per_outcome)
    p = p / p.sum()
    return Distribution(tuple(float(x) for x in p))
