"""Questions to engine reads and back: render each question after the input with the chat template, pick its
labels, tokenize (in a worker thread), read the label log-probabilities (server.http.readout) and turn them into
distributions. Both wire formats of this package, and the chat-model reranker, call ``ask``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from engine.types import InvalidRequestError, PromptTooLongError
from server.decisions.questions import (
    Distribution,
    LabelSet,
    Question,
    Refusal,
    choose_labels,
    distribution,
    question_messages,
    question_text,
)
from server.engine_client import EngineClient
from server.http.readout import LabelRead, read_labels
from server.prompt import TemplateOptions, render_prompt

# NOTE(server): how much of the rendered prompt's end a label is tokenized after, to tell whether it is one token
# at the answer position (the generation prompt, e.g. "<|im_start|>assistant\n", and some text before it).
_TAIL_CHARS = 32


@dataclass(frozen=True)
class Asked:
    """One question made ready: its prompt and labels, or why it is refused."""

    prompt_ids: list[int] = field(default_factory=list)
    labels: LabelSet | None = None
    refusal: str | None = None


@dataclass(frozen=True)
class Outcome:
    """The answers of one request: a distribution per question (None: refused), and token counts."""

    answers: list[tuple[Distribution, LabelSet] | None]
    num_input_tokens: int
    num_cached_tokens: int


def _template_options(template_kwargs: Mapping[str, Any] | None) -> TemplateOptions:
    # NOTE(server): thinking is off unless the request turns it on: the answer is the first token of the turn.
    kwargs = {"enable_thinking": False, **(template_kwargs or {})}
    return TemplateOptions(kwargs=kwargs)


def _single_token_at(engine: EngineClient, prompt_text: str):
    tail = prompt_text[-_TAIL_CHARS:]
    head = engine.tokenizer.encode(tail)
    cache: dict[str, int | None] = {}

    def single_token(label: str) -> int | None:
        if label not in cache:
            ids = engine.tokenizer.encode(tail + label)
            cache[label] = ids[-1] if len(ids) == len(head) + 1 and ids[:len(head)] == head else None
        return cache[label]

    return single_token


def prepare(engine: EngineClient, pairs: Sequence[tuple[Sequence[dict[str, Any]], Question]],
            template_kwargs: Mapping[str, Any] | None = None, input_param: str = "input") -> list[Asked]:
    """Every (input messages, question) pair's prompt ids and labels (blocking: tokenizes; run it in a worker thread).

    Raises:
        InvalidRequestError: the template fails on the input, or it opens a thinking block the answer would start in
            (naming ``chat_template_kwargs``); PromptTooLongError: a question's prompt does not fit the context.
    """
    options = _template_options(template_kwargs)
    asked: list[Asked] = []
    if not pairs:
        return asked
    probe = render_prompt(engine.chat_template, question_messages(pairs[0][0], "?"), None, options)
    if probe.generation is not None and probe.generation.starts_open:
        raise InvalidRequestError("the chat template opens a thinking block where the answer starts; a decision reads "
                                  "the answer's first token, so thinking must be off (chat_template_kwargs "
                                  "enable_thinking: false)", param="chat_template_kwargs", code="invalid_value")
    # NOTE(server): the answer position follows the generation prompt, which is the same for every pair
    single_token = _single_token_at(engine, probe.text)
    for input_messages, question in pairs:
        try:
            labels = choose_labels(question, single_token)
        except Refusal as why:
            asked.append(Asked(refusal=str(why)))
            continue
        messages = question_messages(input_messages, question_text(question, labels))
        text = render_prompt(engine.chat_template, messages, None, options).text
        at_least = engine.tokenizer.min_num_tokens(text)
        if at_least >= engine.max_model_len:
            raise PromptTooLongError(at_least, engine.max_model_len, lower_bound=True, param=input_param)
        ids = list(engine.tokenizer.encode(text))
        if len(ids) >= engine.max_model_len:
            raise PromptTooLongError(len(ids), engine.max_model_len, param=input_param)
        asked.append(Asked(ids, labels))
    return asked


async def ask(engine: EngineClient, input_messages: Sequence[dict[str, Any]], questions: Sequence[Question],
              request_id: str, template_kwargs: Mapping[str, Any] | None = None,
              input_param: str = "input") -> Outcome:
    """Answer ``questions`` about ``input_messages`` (chat messages): one engine read per answerable question."""
    return await ask_pairs(engine, [(input_messages, q) for q in questions], request_id, template_kwargs, input_param)


async def ask_pairs(engine: EngineClient, pairs: Sequence[tuple[Sequence[dict[str, Any]], Question]],
                    request_id: str, template_kwargs: Mapping[str, Any] | None = None,
                    input_param: str = "input") -> Outcome:
    """Answer each question about its own input (the chat-model reranker: one query, many documents)."""
    asked = await anyio.to_thread.run_sync(prepare, engine, pairs, template_kwargs, input_param)
    todo = [a for a in asked if a.labels is not None]
    readings = await read_labels(engine, [LabelRead(a.prompt_ids, a.labels.flat_ids) for a in todo], request_id)
    by_asked = {id(a): r for a, r in zip(todo, readings)}
    answers: list[tuple[Distribution, LabelSet] | None] = []
    for a in asked:
        reading = by_asked.get(id(a))
        answers.append(None if reading is None or a.labels is None else
                       (distribution(a.labels, reading.logprobs), a.labels))
    return Outcome(answers, sum(r.num_prompt_tokens for r in readings), sum(r.num_cached_tokens for r in readings))
