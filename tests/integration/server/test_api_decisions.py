"""Decisions through the official openai SDK (``client.decisions.create``) and System One's format, against a real
server: on the tiny synthetic model (its byte-level tokenizer has no single-token "yes", so predicates are refused
there while choices and scores are answered) and on the real default model (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.app import create_app
from server.decisions.questions import Option, Question, choose_labels, question_messages, question_text
from server.decisions.reading import _single_token_at, _template_options
from server.prompt import render_prompt
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

TICKET = "The customer wrote: I was charged twice for order 4411 and I want one of the charges refunded today!"
CHOICE = {"type": "choice", "name": "urgency", "instructions": "How urgent is this?",
          "choices": [{"value": "low", "description": "can wait a week"}, {"value": "high"}, {"value": True}]}
SCORE = {"type": "score", "name": "anger", "instructions": "How angry is the customer?",
         "levels": [{"label": "calm"}, {"label": "annoyed", "description": "mildly"}, {"label": "angry"}]}
PREDICATE = {"type": "predicate", "name": "refund", "instructions": "The customer asks for a refund."}

# System One's documented example body (LiteLLM's /v1/systemone page, the TypeSafe Jev format).
SYSTEMONE_EXAMPLE = {
    "model": "jev",
    "state": "Customer wrote: I was charged twice for my order #4411 and want one of the charges refunded today.",
    "questions": {
        "is_refund_request": {"type": "noul", "instructions": "Is the customer asking for a refund?"},
        "urgency": {"type": "choice", "instructions": "How urgent is this?",
                    "criteria": {"low": "can wait a week", "high": "needs action today"}},
        "frustration": {"type": "score", "instructions": "How frustrated is the customer?",
                        "criteria": ["calm", "mildly annoyed", "angry"]},
    },
}


def _probabilities(answer: object) -> list[float]:
    return [p.probability for p in answer.probabilities]  # type: ignore[attr-defined]


# --- the tiny model -------------------------------------------------------------------------------------------------


def test_sdk_decisions_in_order_with_typed_refusals(api_server: RunningServer) -> None:
    client = api_server.client()
    decision = client.decisions.create(model=api_server.model, input=TICKET, questions=[PREDICATE, CHOICE, SCORE])
    kinds = [a.type for a in decision.answers]
    # NOTE(tests): the tiny tokenizer spells "yes" in two tokens: that question is refused, the others answered
    assert kinds == ["refusal", "choice", "score"]
    assert [a.name for a in decision.answers] == ["refund", "urgency", "anger"]
    choice, score = decision.answers[1], decision.answers[2]
    assert [p.value for p in choice.probabilities] == ["low", "high", True]  # typed: True stays a boolean
    assert choice.choice in ("low", "high", True)
    assert [(p.label, p.value) for p in score.probabilities] == [("calm", 0), ("annoyed", 1), ("angry", 2)]
    for answer in (choice, score):
        assert abs(sum(_probabilities(answer)) - 1.0) < 1e-6
        assert 0.0 <= answer.confidence <= 1.0
    expected = sum(p.value * p.probability for p in score.probabilities)
    assert abs(score.score - expected) < 1e-9
    best = max(choice.probabilities, key=lambda p: p.probability)
    assert choice.choice == best.value
    usage = decision.usage
    assert usage.output_tokens == 0 and usage.input_tokens == usage.total_tokens > 0


def test_choices_beyond_the_tokenizers_labels_are_refused(api_server: RunningServer) -> None:
    """27 choices need a 27th single-token label; the tiny tokenizer has only A-Z: a refusal, the rest answered."""
    many = {"type": "choice", "instructions": "Pick one.", "choices": [{"value": f"option {i}"} for i in range(27)]}
    decision = api_server.client().decisions.create(model=api_server.model, input=TICKET, questions=[many, CHOICE])
    assert [a.type for a in decision.answers] == ["refusal", "choice"]


def test_shared_input_is_cached_across_questions(api_server: RunningServer) -> None:
    """Five questions over a long input: the input is prefilled once; the others reuse it (cached_tokens)."""
    long_input = " ".join(f"Line {i}: the order shipped late and the box was damaged." for i in range(25))
    questions = [dict(CHOICE, name=f"q{i}", instructions=f"Question {i}: how urgent is this?") for i in range(5)]
    decision = api_server.client().decisions.create(model=api_server.model, input=long_input, questions=questions)
    num_input = len(api_server.engine.tokenizer.encode(long_input))
    details = decision.usage.input_tokens_details
    assert details.cached_tokens >= 4 * (num_input - 16), (details, num_input)
    assert details.cached_tokens + details.cache_write_tokens == decision.usage.input_tokens


def test_same_probabilities_alone_and_batched(api_server: RunningServer) -> None:
    """The same request gives the same probabilities within 1e-4, alone and among concurrent requests (CPU)."""
    body = {"model": api_server.model, "input": TICKET, "questions": [CHOICE, SCORE]}

    async def run() -> tuple[dict, list[dict]]:
        async with httpx.AsyncClient(base_url=api_server.url, timeout=120) as http:
            alone = (await http.post("/decisions", json=body)).json()
            others = [dict(body, input=f"Ticket {i}: my parcel {i} never arrived, please resend it.") for i in range(3)]
            chat = {"model": api_server.model, "messages": [{"role": "user", "content": "Tell me a story."}],
                    "max_tokens": 24}
            results = await asyncio.gather(*(http.post("/decisions", json=b) for b in [body, *others, body]),
                                           *(http.post("/chat/completions", json=chat) for _ in range(2)))
            return alone, [r.json() for r in results[:5:4]]

    alone, batched = asyncio.run(run())
    for other in batched:
        for a, b in zip(alone["answers"], other["answers"]):
            for pa, pb in zip(a["probabilities"], b["probabilities"]):
                # NOTE(tests): on every CPU: the tiny model's rows part by float rounding only, alone or batched
                # (at most 3e-5 nats on AVX-512 and AVX2: docs/perf/kernel-rows.md)
                assert abs(pa["probability"] - pb["probability"]) < 1e-4


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": str(i)} for i in
                                                                                      range(256)]}]},
     "questions[0].choices"),
    ({"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}, {"value": "a"}]}]},
     "questions[0].choices"),
    ({"input": "x", "questions": [{"type": "score", "instructions": "?", "levels": [{"label": "one"}]}]},
     "questions[0].levels"),
    ({"input": "", "questions": [PREDICATE]}, "input"),
    ({"input": "x", "questions": [PREDICATE] * 401}, "questions"),
])
def test_bad_decisions_are_400_naming_the_field(api_server: RunningServer, body: dict, param: str) -> None:
    r = httpx.post(api_server.url + "/decisions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(api_server.base + "/health", timeout=10).status_code == 200  # still serving


def test_a_model_that_cannot_rerank_is_a_400_naming_it(api_server: RunningServer) -> None:
    """The tiny chat model (no embedding model beside it) spells "yes" in two tokens: it cannot rerank."""
    r = httpx.post(api_server.url + "/rerank", json={"query": "q", "documents": ["a", "b"]}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "tiny" in r.json()["error"]["message"]


# --- the default model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(default_model: Path) -> Iterator[RunningServer]:
    with serve_app(create_app(api_settings(default_model, served_model_name="smollm2"))) as running:
        yield running


def test_sdk_all_three_types_on_the_default_model(default_server: RunningServer) -> None:
    decision = default_server.client().decisions.create(model=default_server.model, input=TICKET,
                                                        questions=[PREDICATE, CHOICE, SCORE])
    assert [a.type for a in decision.answers] == ["predicate", "choice", "score"]
    assert 0.0 <= decision.answers[0].probability <= 1.0
    for answer in decision.answers[1:]:
        assert abs(sum(_probabilities(answer)) - 1.0) < 1e-6
    metrics = default_server.metrics()
    assert metrics['ortserve_readout_requests_total{endpoint="decisions",status="ok"}'] >= 1


def test_systemone_documented_example_with_curl(default_server: RunningServer) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    out = subprocess.run([curl, "-sS", "-X", "POST", default_server.base + "/v1/systemone", "-H",
                          "Content-Type: application/json", "-d", json.dumps(SYSTEMONE_EXAMPLE)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    body = json.loads(out)
    answers = body["answers"]
    assert set(answers) == {"is_refund_request", "urgency", "frustration"}
    assert answers["is_refund_request"]["type"] == "noul" and 0 <= answers["is_refund_request"]["noul"] <= 1
    urgency = answers["urgency"]
    assert set(urgency["probabilities"]) == {"low", "high"} and urgency["choice"] in ("low", "high")
    assert abs(sum(urgency["probabilities"].values()) - 1) < 1e-6
    frustration = answers["frustration"]
    assert frustration["legend"] == {"0": "calm", "1": "mildly annoyed", "2": "angry"}
    assert abs(sum(frustration["probabilities"].values()) - 1) < 1e-6 and 0 <= frustration["score"] <= 2
    assert body["model"] == "smollm2" and body["usage"]["input_tokens"] > 0


# 20 yes/no and 20 multiple-choice questions of our own.
YES_NO = [
    ("The sky is blue on a clear day.", "Is the sky blue on a clear day?"),
    ("Water boils at 100 degrees Celsius at sea level.", "Does water boil at 100 degrees Celsius at sea level?"),
    ("Cats are mammals.", "Are cats mammals?"),
    ("The sun rises in the west.", "Does the sun rise in the west?"),
    ("Fish can breathe underwater.", "Can fish breathe underwater?"),
    ("Paris is the capital of Germany.", "Is Paris the capital of Germany?"),
    ("Two plus two equals four.", "Does two plus two equal four?"),
    ("Ice is colder than steam.", "Is ice colder than steam?"),
    ("Birds have feathers.", "Do birds have feathers?"),
    ("The moon is made of cheese.", "Is the moon made of cheese?"),
    ("Humans need oxygen to live.", "Do humans need oxygen to live?"),
    ("A square has five sides.", "Does a square have five sides?"),
    ("Snow is usually white.", "Is snow usually white?"),
    ("Elephants are smaller than mice.", "Are elephants smaller than mice?"),
    ("The order arrived damaged and the customer is upset.", "Is the customer happy?"),
    ("Please cancel my subscription immediately.", "Does the user want to cancel?"),
    ("I love this product, it works great!", "Is this review positive?"),
    ("The meeting is on Monday at 10am.", "Is the meeting on Friday?"),
    ("The password reset email never arrived.", "Is this about account access?"),
    ("Lemons taste sweet like candy.", "Do lemons taste sour?"),
]
CHOICES = [
    ("What color is grass?", ["red", "green", "blue"]),
    ("What is 3 + 4?", ["5", "7", "9"]),
    ("Which animal barks?", ["cat", "dog", "fish"]),
    ("What is the capital of France?", ["Paris", "Rome", "Berlin"]),
    ("Which is a fruit?", ["carrot", "apple", "potato"]),
    ("What do bees make?", ["milk", "honey", "silk"]),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth"]),
    ("What is frozen water called?", ["ice", "steam", "sand"]),
    ("How many days are in a week?", ["five", "seven", "ten"]),
    ("Which season is the coldest?", ["summer", "winter", "spring"]),
    ("Which team handles a double charge?", ["billing", "shipping", "sales"]),
    ("Which team handles a lost parcel?", ["billing", "shipping", "legal"]),
    ("What is the opposite of hot?", ["warm", "cold", "loud"]),
    ("Which one can fly?", ["eagle", "whale", "snake"]),
    ("What do you use to write?", ["pen", "spoon", "shoe"]),
    ("Which language is spoken in Spain?", ["Spanish", "Japanese", "Swedish"]),
    ("What is the largest ocean?", ["Atlantic", "Pacific", "Indian"]),
    ("Which is a vehicle?", ["car", "tree", "cloud"]),
    ("What do cows drink?", ["water", "oil", "ink"]),
    ("Sentiment of: 'This is the worst service ever.'", ["positive", "negative", "neutral"]),
]


def _greedy_label(server: RunningServer, messages: list[dict]) -> str:
    r = server.client().chat.completions.create(model=server.model, messages=messages, temperature=0, max_tokens=2,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return r.choices[0].message.content or ""


def test_top_decision_matches_greedy_chat_answer(default_server: RunningServer) -> None:
    """On 40 questions of our own, the top decision equals the model's greedy chat answer on the same prompt (when that
    answer is one of the labels) in at least 95% of cases."""
    engine = default_server.engine
    probe = render_prompt(engine.chat_template, question_messages([{"role": "user", "content": "x"}], "?"), None,
                          _template_options(None)).text
    single = _single_token_at(engine, probe)
    cases = [(text, Question("predicate", statement.rstrip("?") + "."), {"type": "predicate",
                                                                         "instructions": statement.rstrip("?") + "."})
             for text, statement in YES_NO]
    cases += [(q, Question("choice", q, tuple(Option(c) for c in opts)),
               {"type": "choice", "instructions": q, "choices": [{"value": c} for c in opts]}) for q, opts in CHOICES]
    client = default_server.client()
    compared = agreed = 0
    skipped: list[str] = []
    for text, question, wire_question in cases:
        labels = choose_labels(question, single)
        messages = question_messages([{"role": "user", "content": text}], question_text(question, labels))
        greedy = _greedy_label(default_server, messages).strip()
        answer = client.decisions.create(model=default_server.model, input=text, questions=[wire_question]).answers[0]
        if question.kind == "predicate":
            first = greedy.split()[0].strip(".,!").lower() if greedy else ""
            if first not in ("yes", "no"):
                skipped.append(greedy)
                continue
            top = "yes" if answer.probability >= 0.5 else "no"
        else:
            first = greedy[:1]
            if first not in labels.labels:
                skipped.append(greedy)
                continue
            top = labels.labels[[p.probability for p in answer.probabilities].index(
                max(p.probability for p in answer.probabilities))]
        compared += 1
        agreed += first == top
    assert compared >= 20, f"only {compared} of 40 greedy answers were a label: {skipped}"
    assert agreed >= 0.95 * compared, f"{agreed} of {compared} agree (not a label: {skipped})"


def test_chat_model_rerank_is_probability_of_yes(default_server: RunningServer) -> None:
    docs = ["Paris is the capital and largest city of France.", "Bananas are yellow fruits rich in potassium."]
    r = httpx.post(default_server.base + "/v1/rerank", json={"query": "What is the capital of France?",
                                                              "documents": docs}, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert r.json()["model"] == "smollm2" and len(results) == 2
    assert all(0.0 <= x["relevance_score"] <= 1.0 for x in results)
    score = httpx.post(default_server.base + "/v1/score", json={"text_1": "What is the capital of France?",
                                                                 "text_2": docs}, timeout=120).json()
    by_index = {x["index"]: x["relevance_score"] for x in results}
    for item in score["data"]:
        assert abs(item["score"] - by_index[item["index"]]) < 1e-4  # the same read, rerank or score
