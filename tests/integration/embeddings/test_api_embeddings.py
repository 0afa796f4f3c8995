"""POST /v1/embeddings on a real server (chat model + all-MiniLM-L6-v2) with the official openai SDK, LangChain's
OpenAIEmbeddings and LlamaIndex's OpenAIEmbedding; bad input gets OpenAI's error shape and the server keeps
serving; llama.cpp's /embedding form.
"""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from engine.embedding import EmbeddingConfig, EmbeddingEngine
from server.app import create_app
from tests.integration.embeddings.conftest import MINILM
from tests.integration.server.conftest import RunningServer, api_settings, serve_app

TEXTS = ["The cat sat on the mat.", "A dog is running in the park.", "Quantum computers use qubits.", ""]


def _reference(server: RunningServer, texts: list[str]) -> np.ndarray:
    """The same texts embedded by the server's own engine one at a time (batch 1, no HTTP)."""
    engine = server.app.state.ortserve.embedders[MINILM]
    return np.stack([engine.embed_sync(engine.check(engine.tokenize([t])))[0] for t in texts])


def _post(server: RunningServer, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{server.base}{path}", json=body, timeout=60)


def test_one_string_and_a_list_in_input_order(embedding_server: RunningServer) -> None:
    client = embedding_server.client()
    one = client.embeddings.create(model=MINILM, input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == MINILM and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0 and len(one.data[0].embedding) == 384
    many = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == list(range(len(TEXTS)))
    got = np.array([d.embedding for d in many.data])
    np.testing.assert_allclose(got, _reference(embedding_server, TEXTS), atol=1e-5)  # batched == one at a time
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.allclose(got[0], one.data[0].embedding, atol=1e-5)
    tokens = [len(ids) for ids in embedding_server.app.state.ortserve.embedders[MINILM].tokenize(TEXTS)]
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(tokens)


def test_token_ids_and_base64_equal_floats(embedding_server: RunningServer) -> None:
    client = embedding_server.client()
    engine = embedding_server.app.state.ortserve.embedders[MINILM]
    ids = engine.tokenize(TEXTS[:2])  # the model's own ids, [CLS] ... [SEP]
    floats = np.array([d.embedding for d in client.embeddings.create(model=MINILM, input=TEXTS[:2],
                                                                     encoding_format="float").data])
    from_ids = np.array([d.embedding for d in client.embeddings.create(model=MINILM, input=ids,
                                                                       encoding_format="float").data])
    one_list = client.embeddings.create(model=MINILM, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(from_ids, floats, atol=1e-6)
    np.testing.assert_allclose(one_list.data[0].embedding, floats[0], atol=1e-6)
    raw = client.embeddings.create(model=MINILM, input=TEXTS[:2], encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    np.testing.assert_array_equal(decoded, np.asarray(floats, np.float32))
    # the SDK's default: it asks for base64 itself and decodes it
    default = client.embeddings.create(model=MINILM, input=TEXTS[:2])
    np.testing.assert_array_equal(np.array([d.embedding for d in default.data], np.float32), decoded)


def test_truncate_prompt_tokens_and_the_window(embedding_server: RunningServer) -> None:
    long_text = "word " * 400  # 402 tokens with [CLS] and [SEP]
    r = _post(embedding_server, {"model": MINILM, "input": ["short", long_text]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input[1]" and err["code"] == "context_length_exceeded"
    assert "402" in err["message"] and "256" in err["message"] and "too large" in err["message"]
    cut = _post(embedding_server, {"model": MINILM, "input": long_text, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    at_window = _post(embedding_server, {"model": MINILM, "input": "word " * 254}).json()  # exactly 256
    assert at_window["usage"]["prompt_tokens"] == 256
    np.testing.assert_allclose(cut["data"][0]["embedding"], at_window["data"][0]["embedding"], atol=1e-6)
    ten = _post(embedding_server, {"model": MINILM, "input": long_text, "truncate_prompt_tokens": 10}).json()
    assert ten["usage"]["prompt_tokens"] == 10
    bad = _post(embedding_server, {"model": MINILM, "input": "x", "truncate_prompt_tokens": 1000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["a", 3]}, "input[1]"),
    ({"input": ["a", None]}, "input[1]"),
    ({"input": [1.5, 2.5]}, "input[0]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [[101, 99999, 102]]}, "input[0]"),  # outside the vocabulary
    ({"input": [[-1]]}, "input[0]"),
    ({"input": 5}, "input"),
    ({}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 100}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}}, "input.content[0]"),
])
def test_bad_input_is_a_400_naming_the_field(embedding_server: RunningServer, body: dict, param: str) -> None:
    r = _post(embedding_server, {"model": MINILM, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert _post(embedding_server, {"model": MINILM, "input": "still serving"}).status_code == 200


def test_sdk_raises_bad_request_and_models_route_by_name(embedding_server: RunningServer) -> None:
    client = embedding_server.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=MINILM, input=[])
    assert exc.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError) as nf:  # as OpenAI answers an unknown model
        client.embeddings.create(model="no-such-model", input="x")
    assert nf.value.body["param"] == "model" and MINILM in nf.value.body["message"]
    with pytest.raises(openai.BadRequestError) as chat:  # an encoder asked to chat
        client.chat.completions.create(model=MINILM, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.value.body["param"] == "model" and MINILM in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MINILM, prompt="hi", max_tokens=2)
    listed = {m.id for m in client.models.list().data}
    assert listed == {"tiny", MINILM}
    assert client.models.retrieve(MINILM).id == MINILM
    # the chat model still chats, and its own embeddings (--embeddings) answer too
    assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None
    own = client.embeddings.create(model="tiny", input=["hi", "there"], encoding_format="float")
    assert len(own.data) == 2 and len(own.data[0].embedding) == embedding_server.engine.folder.genai["model"][
        "decoder"]["hidden_size"]


def test_chat_model_without_pooling_is_a_400_naming_it(embedding_server: RunningServer) -> None:
    state = embedding_server.app.state.ortserve
    # a second app on the same engines, without --embeddings for the chat model
    app = create_app(api_settings(Path(state.settings.model)), engine=state.engine,
                     embedders={MINILM: state.embedders[MINILM]})
    with serve_app(app) as other:
        r = _post(other, {"model": "tiny", "input": "x"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "model" and "tiny" in r.json()["error"]["message"]
        default = _post(other, {"input": "x"})  # no model: the embedding model
        assert default.status_code == 200 and default.json()["model"] == MINILM


def test_langchain_openai_embeddings(embedding_server: RunningServer) -> None:
    from langchain_openai import OpenAIEmbeddings

    # NOTE: check_embedding_ctx_length=False: otherwise LangChain sends tiktoken (cl100k) ids, OpenAI's own
    embeddings = OpenAIEmbeddings(model=MINILM, base_url=embedding_server.url, api_key="unused",
                                  check_embedding_ctx_length=False, max_retries=0)
    docs = embeddings.embed_documents(TEXTS[:3])
    query = embeddings.embed_query(TEXTS[0])
    np.testing.assert_allclose(np.array(docs), _reference(embedding_server, TEXTS[:3]), atol=1e-5)
    np.testing.assert_allclose(query, docs[0], atol=1e-6)
    # retrieval works: the query's nearest document is itself, and related texts are nearer than unrelated ones
    sims = np.array(docs) @ np.array(query)
    assert int(np.argmax(sims)) == 0


def test_llamaindex_openai_embedding(embedding_server: RunningServer) -> None:
    from llama_index.embeddings.openai import OpenAIEmbedding

    state = embedding_server.app.state.ortserve
    # NOTE: LlamaIndex's OpenAIEmbedding only takes OpenAI's model names: serve the model under one of them
    # (--served-embedding-model-name text-embedding-3-small)
    app = create_app(api_settings(Path(state.settings.model)), engine=state.engine,
                     embedders={"text-embedding-3-small": state.embedders[MINILM]})
    with serve_app(app) as other:
        embed = OpenAIEmbedding(model_name="text-embedding-3-small", api_base=other.url, api_key="unused",
                                max_retries=0)
        docs = embed.get_text_embedding_batch(TEXTS[:3])
        query = embed.get_query_embedding(TEXTS[1])
    np.testing.assert_allclose(np.array(docs), _reference(embedding_server, TEXTS[:3]), atol=1e-5)
    np.testing.assert_allclose(query, docs[1], atol=1e-6)


def test_llamacpp_embedding_endpoint(embedding_server: RunningServer) -> None:
    r = _post(embedding_server, {"content": ["hello world", "x"]}, "/embedding")
    assert r.status_code == 200
    body = r.json()
    assert [d["index"] for d in body] == [0, 1] and len(body[0]["embedding"]) == 1
    want = _reference(embedding_server, ["hello world"])[0]
    np.testing.assert_allclose(body[0]["embedding"][0], want, atol=1e-5)
    assert _post(embedding_server, {"input": "hello world"}, "/embeddings").json()[0]["embedding"][0] == \
        pytest.approx(body[0]["embedding"][0], abs=1e-6)
    mixed = _post(embedding_server, {"model": MINILM, "input": [
        "hello world", {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
        {"prompt_string": "hello world"}]}).json()
    assert mixed["data"][0]["embedding"] == mixed["data"][1]["embedding"] == mixed["data"][2]["embedding"]


def test_full_queue_is_a_429_and_chat_runs_while_embeddings_are_held(embedding_server: RunningServer,
                                                                   minilm_model: Path) -> None:
    """A held embedding run (a gate, not the machine's speed) fills the queue: one more request is a 429 with
    Retry-After; a chat request on the same server still completes meanwhile (separate thread and session)."""
    gate, entered = threading.Event(), threading.Event()

    def hold(_num_texts: int) -> None:
        entered.set()
        gate.wait(60)

    state = embedding_server.app.state.ortserve
    gated = EmbeddingEngine.from_model_dir(minilm_model, EmbeddingConfig(max_queue=2, before_run=hold, nice=0))
    app = create_app(api_settings(Path(state.settings.model)), engine=state.engine, embedders={MINILM: gated})
    try:
        with serve_app(app) as other:
            results: list[int] = []
            workers = [threading.Thread(target=lambda: results.append(_post(other, {"input": "x"}).status_code))
                       for _ in range(2)]
            workers[0].start()
            assert entered.wait(30)  # the first request's run is held
            workers[1].start()
            for _ in range(3000):  # the second request is queued behind the held one (at most 30 s)
                if gated.stats().num_requests == 2:
                    break
                time.sleep(0.01)
            assert gated.stats().num_requests == 2
            full = _post(other, {"input": "one too many"})
            assert full.status_code == 429 and "Retry-After" in full.headers
            assert full.json()["error"]["type"] == "rate_limit_error"
            chat = other.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert chat.usage.completion_tokens >= 1
            assert gated.stats().num_requests == 2  # still held while the chat request ran
            gate.set()
            for w in workers:
                w.join(60)
            assert results == [200, 200]
            assert _post(other, {"input": "after"}).status_code == 200
    finally:
        gate.set()
        gated.shutdown()


def test_metrics_count_embeddings(embedding_server: RunningServer) -> None:
    before = embedding_server.metrics()
    _post(embedding_server, {"model": MINILM, "input": ["one", "two"]})
    _post(embedding_server, {"model": MINILM, "input": []})
    after = embedding_server.metrics()
    key = 'ortserve_embedding_requests_total{status="%s"}'
    assert after[key % "ok"] == before[key % "ok"] + 1
    assert after[key % "rejected"] == before[key % "rejected"] + 1
    assert after["ortserve_embedding_inputs_total"] == before["ortserve_embedding_inputs_total"] + 2
    assert after["ortserve_embedding_tokens_total"] == before["ortserve_embedding_tokens_total"] + 6
    assert after["ortserve_embedding_request_latency_seconds_count"] > before[
        "ortserve_embedding_request_latency_seconds_count"]
