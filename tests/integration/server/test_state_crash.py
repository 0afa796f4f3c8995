"""State that survives the process: a real `ortserve serve` killed with SIGKILL mid-batch and mid-background-response,
then started again on the same state file, finishes what it was doing: the batch has every line's answer once (those
answered before the kill unchanged), the background response completes with one consistent run of events. And
previous_response_id works across --api-server-count 4 (the processes share the store) and after a restart."""

from __future__ import annotations

import io
import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.integration.server.conftest import serve_process, summed_usage, wait_for

CRASH_WAIT_S = 300.0  # a bound, not a timing: a batch or a response finishing after a restart on 2 cores

MODEL = "smollm2-135m-instruct"


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def kill(served: Any) -> None:
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait(30)


def test_a_batch_killed_midway_completes_after_a_restart_with_every_line_once(default_model: Path,
                                                                               tmp_path: Path) -> None:
    state = ["--state-url", str(tmp_path / "state.db"), "--max-batch", "4"]
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
                                  "max_tokens": 24, "temperature": 0, "ignore_eos": True}}) for i in range(40)]
    with serve_process(default_model, *state) as served:
        c = client(served.base)
        upload = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
        batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 8, CRASH_WAIT_S, 0.05)
        kill(served)
    with serve_process(default_model, *state) as served:
        c = client(served.base)
        before = c.batches.retrieve(batch.id)
        assert before.status == "in_progress" and 8 <= before.request_counts.completed < 40
        # the running usage written before the kill: at most the lines answered by then (24 tokens each)
        assert before.usage is not None and before.usage.output_tokens <= 24 * before.request_counts.completed
        done = wait_for(lambda: (b := c.batches.retrieve(batch.id)).status == "completed" and b, CRASH_WAIT_S, 0.2)
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
        outputs = [json.loads(line) for line in c.files.content(done.output_file_id).text.splitlines()]
    ids = Counter(o["custom_id"] for o in outputs)
    assert sorted(ids) == sorted(f"c{i}" for i in range(40)) and set(ids.values()) == {1}
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 24 for o in outputs)
    assert len({o["id"] for o in outputs}) == 40  # each line's result was written once
    # usage counts every line once: those answered before the kill and those after the restart
    assert done.usage is not None and done.usage.model_dump() == summed_usage(outputs)
    assert done.usage.output_tokens == 40 * 24 and done.model == MODEL


def test_a_background_response_killed_midway_completes_after_a_restart(default_model: Path, tmp_path: Path) -> None:
    state = ["--state-url", str(tmp_path / "state.db")]
    with serve_process(default_model, *state) as served:
        c = client(served.base)
        r = c.responses.create(model=MODEL, input="Tell me a long story.", background=True, max_output_tokens=300,
                               temperature=0, extra_body={"ignore_eos": True})
        # killed once some of its events are kept (the output so far is in the stored response)
        wait_for(lambda: (x := c.responses.retrieve(r.id)).status == "in_progress" and x.output, CRASH_WAIT_S,
                 0.05)
        kill(served)
    with serve_process(default_model, *state) as served:
        c = client(served.base)
        done = wait_for(lambda: (x := c.responses.retrieve(r.id)).status not in ("queued", "in_progress") and x,
                        CRASH_WAIT_S, 0.2)
        assert done.status == "incomplete" and done.usage.output_tokens == 300
        events = list(c.responses.retrieve(r.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text
    assert [e.type for e in events].count("response.created") == 1


def test_previous_response_id_across_api_processes_and_a_restart(default_model: Path, tmp_path: Path) -> None:
    state = ["--state-url", str(tmp_path / "state.db")]
    answered_by: set[str] = set()
    with serve_process(default_model, "--api-server-count", "4", *state, ready_timeout_s=240) as served:
        previous = None
        for turn in range(8):
            # a new connection each turn: the kernel spreads them over the 4 processes' sockets
            with httpx.Client(timeout=120) as http:
                body = {"model": MODEL, "input": f"Turn {turn}.", "max_output_tokens": 3, "temperature": 0}
                if previous:
                    body["previous_response_id"] = previous
                r = http.post(f"{served.base}/v1/responses", json=body)
                assert r.status_code == 200, r.text
                answered_by.add(r.headers["ortserve-api-server"])
                previous = r.json()["id"]
                got = http.get(f"{served.base}/v1/responses/{previous}")
                assert got.status_code == 200 and got.json()["id"] == previous
        items = client(served.base).responses.input_items.list(previous)
        assert [i.content[0].text for i in items.data] == ["Turn 7."]
    assert len(answered_by) >= 2, answered_by
    with serve_process(default_model, *state) as served:
        c = client(served.base)
        follow = c.responses.create(model=MODEL, input="Turn 8.", previous_response_id=previous, max_output_tokens=2,
                                    temperature=0)
        # eight earlier turns (input and output) came before this one
        first = c.responses.create(model=MODEL, input="Turn 8.", max_output_tokens=2, temperature=0)
        assert follow.usage.input_tokens > first.usage.input_tokens + 8 * 4
