"""The decisions and rerank wire formats without a model: labels, distributions, OpenAI's and System One's
questions, and 400s naming the field (a real app whose engine never loads; validation runs first)."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.decisions.questions import (
    LabelSet,
    Option,
    Question,
    Refusal,
    choose_labels,
    distribution,
    question_messages,
    question_text,
)
from server.decisions.protocol import systemone_answer
from server.settings import Settings

# A tokenizer stand-in: single letters, digits, "yes"/"Yes"/"no", and two-letter labels starting with "A".
_VOCAB = {w: i for i, w in enumerate(
    [*"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789", "yes", "Yes", "no", *(f"A{c}" for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ")])}


def single(label: str) -> int | None:
    return _VOCAB.get(label)


def test_predicate_labels_take_every_single_token_spelling() -> None:
    labels = choose_labels(Question("predicate", "It rains."), single)
    assert labels.labels == ("yes", "no")
    assert labels.token_ids == ((_VOCAB["yes"], _VOCAB["Yes"]), (_VOCAB["no"],))  # "No" is not one token here
    with pytest.raises(Refusal):
        choose_labels(Question("predicate", "x"), lambda w: None if w == "yes" else 1)


def test_choice_labels_go_past_z_as_the_tokenizer_allows() -> None:
    q = Question("choice", "Pick", tuple(Option(str(i)) for i in range(30)))
    labels = choose_labels(q, single)
    assert labels.labels[:26] == tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ") and labels.labels[26:] == ("AA", "AB", "AC", "AD")
    too_many = Question("choice", "Pick", tuple(Option(str(i)) for i in range(26 + 27)))
    with pytest.raises(Refusal):
        choose_labels(too_many, single)


def test_score_labels_are_digits_up_to_ten_levels() -> None:
    assert choose_labels(Question("score", "Rate", tuple(Option(str(i)) for i in range(10))), single).labels == tuple(
        "0123456789")
    assert choose_labels(Question("score", "Rate", tuple(Option(str(i)) for i in range(11))), single).labels[0] == "A"


def test_distribution_sums_spellings_and_normalizes() -> None:
    labels = LabelSet(("yes", "no"), ((1, 2), (3,)))
    d = distribution(labels, [math.log(0.2), math.log(0.1), math.log(0.1)])
    assert d.probabilities == pytest.approx((0.75, 0.25), abs=1e-12)
    assert abs(sum(d.probabilities) - 1) < 1e-12 and d.best == 0
    flat = distribution(LabelSet(("A", "B", "C"), ((1,), (2,), (3,))), [-1.0, -1.0, -1.0])
    assert flat.confidence == pytest.approx(0.0, abs=1e-12) and flat.expected_index == pytest.approx(1.0)
    sure = distribution(LabelSet(("A", "B"), ((1,), (2,))), [0.0, -1000.0])
    assert sure.confidence == pytest.approx(1.0) and sure.best == 0
    assert flat.margin_confidence == pytest.approx(0.0, abs=1e-12) and sure.margin_confidence == pytest.approx(1.0)


def test_system_ones_confidence_is_the_margin_over_a_uniform_guess() -> None:
    """(p_max - 1/k) / (1 - 1/k), as Jev and llama.cpp define it; not 1 - H / ln k."""
    d = distribution(LabelSet(("A", "B", "C", "D"), ((1,), (2,), (3,), (4,))),
                     [math.log(0.7), math.log(0.1), math.log(0.1), math.log(0.1)])
    assert d.margin_confidence == pytest.approx((0.7 - 0.25) / 0.75)
    assert d.confidence != pytest.approx(d.margin_confidence)
    answer = systemone_answer(Question("choice", "?", (Option("a"), Option("b"), Option("c"), Option("d"))),
                              (d, None))
    assert answer["confidence"] == pytest.approx(0.6)


def test_question_text_and_messages() -> None:
    q = Question("choice", "Which team?", (Option("billing", "money"), Option("access")))
    text = question_text(q, choose_labels(q, single))
    assert "A. billing: money" in text and "B. access" in text and text.endswith("Answer with the letter of one option only.")
    merged = question_messages([{"role": "user", "content": "input"}], "Q?")
    assert merged == [{"role": "user", "content": "input\n\nQ?"}]
    after_assistant = question_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "Q?")
    assert after_assistant[-1] == {"role": "user", "content": "Q?"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(Settings(model="unloaded"), loader=None))


def _predicate(n: int = 1) -> list[dict]:
    return [{"type": "predicate", "instructions": "It rains."}] * n


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": str(i)} for i in
                                                                                      range(256)]}]},
     "questions[0].choices"),
    ({"input": "x", "questions": [*_predicate(), {"type": "choice", "instructions": "?",
                                                  "choices": [{"value": "a"}, {"value": "b"}, {"value": "a"}]}]},
     "questions[1].choices"),
    ({"input": "x", "questions": [{"type": "score", "instructions": "?", "levels": [{"label": "only"}]}]},
     "questions[0].levels"),
    ({"input": "", "questions": _predicate()}, "input"),
    ({"input": [], "questions": _predicate()}, "input"),
    ({"input": "x", "questions": _predicate(401)}, "questions"),
    ({"input": "x", "questions": []}, "questions"),
    ({"input": "x", "questions": [{"type": "rank", "instructions": "?"}]}, "questions[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "4"}], "questions": _predicate()},
     "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}],
      "questions": _predicate()}, "input[0].content[0]"),
])
def test_decisions_400_names_the_field(client: TestClient, body: dict, param: str) -> None:
    r = client.post("/v1/decisions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_typed_choices_are_not_duplicates(client: TestClient) -> None:
    """"true" and true are two choices (the SDK's typed values); the request passes validation (503: no model)."""
    body = {"input": "x", "questions": [{"type": "choice", "instructions": "?",
                                         "choices": [{"value": "true"}, {"value": True}]}]}
    assert client.post("/v1/decisions", json=body).status_code == 503


@pytest.mark.parametrize("body, param", [
    ({"state": "", "questions": {"a": {"type": "noul", "instructions": "?"}}}, "state"),
    ({"state": "s", "questions": {}}, "questions"),
    ({"state": "s", "questions": {"u": {"type": "choice", "instructions": "?", "criteria": {"only": None}}}},
     "questions.u.criteria"),
    ({"state": "s", "questions": {"f": {"type": "score", "instructions": "?", "criteria": ["one"]}}},
     "questions.f.criteria"),
])
def test_systemone_422_names_the_field(client: TestClient, body: dict, param: str) -> None:
    r = client.post("/v1/systemone", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "unprocessable_entity_error"


@pytest.mark.parametrize("field", ["images", "videos"])
def test_systemone_refuses_images_and_videos_for_a_text_only_model(client: TestClient, field: str) -> None:
    body = {"state": "s", "questions": {"a": {"type": "noul", "instructions": "?"}}, field: ["https://x/y.png"]}
    r = client.post("/v1/systemone", json=body)
    assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["code"] == "unsupported_content"
