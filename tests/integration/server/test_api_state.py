"""The state that outlives a request, through the official openai SDK on the default model, against SQLite and a real
PostgreSQL (tests/postgres.py): Files, Batches, Conversations, background responses, input_tokens, compact, the
Responses routes' order and WebSocket mode. Greedy text is compared with the suite's near-tie rule
(tests/greedy_close.py); the model's text is never asserted otherwise."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server.app import create_app
from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close
from tests.integration.server.conftest import RunningServer, api_settings, serve_app, summed_usage, wait_for

MODEL = "smol"
EMBEDDER = "all-minilm-l6-v2"
FILE_MAX_BYTES = 256 * 1024
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def smol(request: pytest.FixtureRequest, default_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    state_url = (str(tmp_path_factory.mktemp("state") / "state.db") if request.param == "sqlite"
                 else request.getfixturevalue("postgres_url"))
    from engine.builder import pull_model

    minilm = pull_model(EMBEDDER, progress=False)
    settings = api_settings(default_model, served_model_name=MODEL, state_url=state_url,
                            file_max_bytes=FILE_MAX_BYTES, max_batch=4, embedding_model=str(minilm),
                            served_embedding_model_name=EMBEDDER)
    with serve_app(create_app(settings)) as running:
        yield running


# --- files ----------------------------------------------------------------------------------------------------


def test_files_round_trip_and_unknown_ids_are_404(smol: RunningServer) -> None:
    client = smol.client()
    data = "".join(f'{{"n": {i}, "text": "é{i}"}}\n' for i in range(2000)).encode()
    uploaded = client.files.create(file=("data.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data) and uploaded.purpose == "batch"
    assert uploaded.filename == "data.jsonl" and uploaded.status == "processed"
    assert client.files.retrieve(uploaded.id).bytes == len(data)
    assert client.files.content(uploaded.id).content == data
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(uploaded.id).deleted
    for call in (lambda: client.files.retrieve(uploaded.id), lambda: client.files.content(uploaded.id),
                 lambda: client.files.delete(uploaded.id)):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "not_found"


def test_an_oversized_upload_is_413_and_keeps_nothing(smol: RunningServer) -> None:
    client = smol.client()
    before = {f.id for f in client.files.list()}
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (FILE_MAX_BYTES + 1))), purpose="batch")
    assert info.value.status_code == 413 and info.value.body["type"] == "invalid_request_error"
    assert {f.id for f in client.files.list()} == before
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="not-a-purpose")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "purpose"


# --- batches --------------------------------------------------------------------------------------------------


def chat_body(i: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Name {i + 2} colors, one per line."}],
            "max_tokens": 12, "logprobs": True, "top_logprobs": TOP_K, **GREEDY}


def test_a_batch_answers_as_each_request_alone_and_bad_lines_go_to_the_error_file(smol: RunningServer) -> None:
    client = smol.client()
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": chat_body(i)}) for i in range(6)]
    lines.insert(2, "{this is not JSON")
    lines.insert(4, json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/chat/completions",
                                "body": {**chat_body(0), "model": "no-such-model"}}))
    lines.insert(5, json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}))
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "test"})
    assert batch.status == "validating" and batch.metadata == {"run": "test"}
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 6, 3)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == MODEL
    outputs = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    errors = {json.loads(line)["custom_id"]: json.loads(line)
              for line in client.files.content(done.error_file_id).text.splitlines()}
    assert [o["custom_id"] for o in outputs] == [f"c{i}" for i in range(6)]  # in input order, each once
    # the answered lines' usage, each once (the refused bad-model line adds nothing)
    assert done.usage is not None and done.usage.model_dump() == summed_usage(outputs)
    assert done.usage.output_tokens > 0 and done.usage.input_tokens > 0
    assert errors[None]["error"]["code"] == "invalid_json_line" and errors[None]["response"] is None
    assert errors["bad-url"]["error"]["code"] == "invalid_url"
    missing = errors["bad-model"]["response"]
    assert missing["status_code"] == 404 and missing["body"]["error"]["code"] == "model_not_found"
    for i, out in enumerate(outputs):
        assert out["id"].startswith("batch_req_") and out["error"] is None and out["response"]["status_code"] == 200
        choice = out["response"]["body"]["choices"][0]
        alone = client.chat.completions.create(**chat_body(i)).choices[0]
        assert_greedy_close(GreedyRun.from_openai(alone.logprobs, alone.finish_reason),
                            GreedyRun.from_openai(choice["logprobs"], choice["finish_reason"]), what=f"line c{i}")
    assert batch.id in [b.id for b in client.batches.list(limit=100)]


def test_a_batch_of_every_endpoint_kind(smol: RunningServer) -> None:
    client = smol.client()
    for endpoint, body in (("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, **GREEDY}),
                           ("/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **GREEDY}),
                           ("/v1/embeddings", {"model": EMBEDDER, "input": ["a cat", "a dog"]})):
        line = json.dumps({"custom_id": "one", "method": "POST", "url": endpoint, "body": body})
        upload = client.files.create(file=("in.jsonl", io.BytesIO(line.encode())), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint,  # type: ignore[arg-type]
                                      completion_window="24h")
        done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b)
        [out] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert out["response"]["status_code"] == 200 and done.error_file_id is None
        kind = {"/v1/completions": "text_completion", "/v1/responses": "response", "/v1/embeddings": "list"}
        assert out["response"]["body"]["object"] == kind[endpoint]
        assert done.model == body["model"] and done.usage is not None
        assert done.usage.model_dump() == summed_usage([out]) and done.usage.input_tokens > 0
        assert (done.usage.output_tokens > 0) == (endpoint != "/v1/embeddings")
    direct = client.embeddings.create(model=EMBEDDER, input=["a cat", "a dog"])
    assert [len(e["embedding"]) for e in out["response"]["body"]["data"]] == [len(e.embedding) for e in direct.data]


def test_batch_errors_are_openai_shaped(smol: RunningServer) -> None:
    client = smol.client()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError) as info:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.body["param"] == "input_file_id"
    upload = client.files.create(file=("u.txt", io.BytesIO(b"x")), purpose="user_data")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    empty = client.files.create(file=("e.jsonl", io.BytesIO(b"\n\n")), purpose="batch")
    batch = client.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "failed" and b)
    assert failed.errors.data[0].code == "empty_file"


def test_a_cancelled_batch_ends_cancelled_with_what_was_done(smol: RunningServer) -> None:
    client = smol.client()
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {**chat_body(i), "max_tokens": 200, "ignore_eos": True}}) for i in range(40)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b)
    assert done.cancelled_at and done.request_counts.completed < 40
    outputs = ([json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
               if done.output_file_id else [])
    assert len(outputs) == done.request_counts.completed
    assert done.usage is not None and done.usage.model_dump() == summed_usage(outputs)  # the lines that ran
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        _cancel_finished(client)


def _cancel_finished(client: openai.OpenAI) -> None:
    line = json.dumps({"custom_id": "one", "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": "x", "max_tokens": 1}})
    upload = client.files.create(file=("in.jsonl", io.BytesIO(line.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed")
    client.batches.cancel(batch.id)


# --- conversations --------------------------------------------------------------------------------------------


def test_conversations_round_trip_through_the_sdk(smol: RunningServer) -> None:
    client = smol.client()
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "names"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"topic": "ada"}).metadata == {"topic": "ada"}
    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]}])
    assert len(added.data) == 1
    r = client.responses.create(model=MODEL, input="What is my name?", conversation=conv.id, max_output_tokens=6,
                                **GREEDY)
    assert r.conversation.id == conv.id
    # the conversation's items came before the input
    expected = client.responses.input_tokens.count(model=MODEL, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"}])
    assert r.usage.input_tokens == expected.input_tokens
    items = client.conversations.items.list(conv.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [("message", "user"), ("message", "assistant"),
                                                       ("message", "user"), ("message", "assistant")]
    assert items.data[-1].content[0].text == r.output_text
    one = client.conversations.items.retrieve(items.data[1].id, conversation_id=conv.id)
    assert one.id == items.data[1].id
    assert client.conversations.items.delete(items.data[1].id, conversation_id=conv.id).id == conv.id
    assert len(client.conversations.items.list(conv.id).data) == 3
    page = client.conversations.items.list(conv.id, order="asc", limit=1)
    assert page.has_more and len(page.data) == 1
    assert client.conversations.delete(conv.id).deleted
    for call in (lambda: client.conversations.retrieve(conv.id),
                 lambda: client.conversations.items.list(conv.id),
                 lambda: client.responses.create(model=MODEL, input="x", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()


# --- background responses ------------------------------------------------------------------------------------


def test_a_background_response_completes_and_its_stream_resumes_where_it_left_off(smol: RunningServer) -> None:
    client = smol.client()
    r = client.responses.create(model=MODEL, input="Tell me a story.", background=True, max_output_tokens=24,
                                **GREEDY, extra_body={"ignore_eos": True})
    assert r.status == "queued" and r.background is True
    done = wait_for(lambda: (x := client.responses.retrieve(r.id)).status not in ("queued", "in_progress") and x)
    assert done.status == "incomplete" and done.usage.output_tokens == 24 and done.completed_at is None
    events = list(client.responses.retrieve(r.id, stream=True))
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers))) and events[0].type == "response.created"
    assert events[-1].type == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text
    resumed = list(client.responses.retrieve(r.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in resumed] == numbers[6:]


def test_a_background_stream_started_by_create_is_the_same_run(smol: RunningServer) -> None:
    client = smol.client()
    with client.responses.create(model=MODEL, input="Hi", background=True, stream=True, max_output_tokens=6,
                                 **GREEDY) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    final = events[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_background_response_can_be_cancelled(smol: RunningServer) -> None:
    client = smol.client()
    r = client.responses.create(model=MODEL, input="Count to a million.", background=True, max_output_tokens=1500,
                                **GREEDY, extra_body={"ignore_eos": True})
    wait_for(lambda: client.responses.retrieve(r.id).status == "in_progress")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert info.value.body["param"] == "background"


# --- input_tokens, compact, the routes' order -----------------------------------------------------------------


def test_input_tokens_counts_what_a_response_would_read(smol: RunningServer) -> None:
    client = smol.client()
    body = {"model": MODEL, "input": "Name three rivers.", "instructions": "Be brief."}
    counted = client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == client.responses.create(**body, max_output_tokens=2, **GREEDY).usage.input_tokens


def test_compact_keeps_the_user_messages_and_a_summary_this_server_reads_back(smol: RunningServer) -> None:
    client = smol.client()
    history = [{"role": "user", "content": "We use Rust for the parser."},
               {"role": "assistant", "content": "Rust it is."}]
    compacted = client.responses.compact(model=MODEL, input=history)
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "compaction"] and compacted.output[0].role == "user"
    summary = compacted.output[1].encrypted_content
    # sent back as input, the summary is read: the prompt grows by it (a dropped item would add nothing)
    follow = [*[item.model_dump(exclude_none=True) for item in compacted.output], {"role": "user", "content": "Go on."}]
    with_summary = client.responses.input_tokens.count(model=MODEL, input=follow).input_tokens
    without = client.responses.input_tokens.count(model=MODEL, input=[follow[0], follow[2]]).input_tokens
    assert with_summary > without and summary.startswith("ortserve-summary:v1:")


def test_fixed_paths_are_not_taken_for_ids(smol: RunningServer) -> None:
    for path in ("compact", "input_tokens"):
        r = httpx.post(f"{smol.url}/responses/{path}", json={"model": MODEL, "input": "hi"}, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert httpx.get(f"{smol.url}/responses/{path}", timeout=10).status_code in (404, 405)


# --- WebSocket mode -------------------------------------------------------------------------------------------


def test_websocket_mode_streams_turns_and_continues_an_unstored_response(smol: RunningServer) -> None:
    client = smol.client()
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="My name is Ada.", max_output_tokens=6, store=False, **GREEDY)
        first = [e for e in _until_done(connection)]
        assert first[0].type == "response.created" and first[-1].type in ("response.completed", "response.incomplete")
        response = first[-1].response
        connection.response.create(model=MODEL, input="What is my name?", previous_response_id=response.id,
                                   max_output_tokens=4, store=False, **GREEDY)
        second = [e for e in _until_done(connection)][-1].response
        expected = client.responses.input_tokens.count(model=MODEL, input=[
            {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": response.output_text},
            {"role": "user", "content": "What is my name?"}]).input_tokens
        assert second.usage.input_tokens == expected
        connection.send({"type": "response.create", "model": "no-such-model", "input": "x"})
        error = next(iter(connection))
        assert error.type == "error" and "no-such-model" in error.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)  # store=false kept nothing


def _until_done(connection: Any) -> Iterator[Any]:
    for event in connection:
        yield event
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return


def test_a_batch_past_its_window_ends_expired_with_the_rest_in_the_error_file(smol: RunningServer) -> None:
    state_url = smol.app.state.ortserve.settings.state_url
    if state_url.startswith("postgresql"):
        pytest.skip("the window is moved in the SQLite file directly")
    client = smol.client()
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {**chat_body(i), "max_tokens": 100, "ignore_eos": True}}) for i in range(40)]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress")
    with contextlib.closing(sqlite3.connect(state_url)) as db, db:  # 24 hours later
        db.execute("UPDATE batches SET body = json_set(body, '$.expires_at', 0) WHERE id = ?", (batch.id,))
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "expired" and b)
    assert done.expired_at and done.request_counts.failed > 0 and done.request_counts.total == 40
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
