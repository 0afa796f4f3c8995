"""EngineRun.start(accept_s): a response may start before the engine's first output (a long prefill), and
everything still arrives in order; a refusal still comes before the response, and a client that leaves while
the prompt is being computed aborts the request. An engine stand-in scripts the timing (no model needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request

from engine.types import EngineOverloadedError, FinishReason, RequestOutput
from server.http.run import EngineRun
from server.metrics import ServerMetrics


class _ScriptedEngine:
    """Yields one finished output after ``prefill_s`` (or raises ``refuse`` at once)."""

    def __init__(self, prefill_s: float, refuse: Exception | None = None) -> None:
        self.prefill_s, self.refuse = prefill_s, refuse
        self.aborted: list[str] = []

    async def generate(self, prompt_ids: list[int], params: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        if self.refuse is not None:
            raise self.refuse
        try:
            await asyncio.sleep(self.prefill_s)
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # as AsyncEngine.generate aborts a cancelled request
            raise
        yield RequestOutput(request_id, "hi", (1,), len(prompt_ids), 1, finished=True,
                            finish_reason=FinishReason.STOP)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _request(disconnect: asyncio.Event) -> Request:
    async def receive() -> dict[str, Any]:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _run(engine: _ScriptedEngine) -> EngineRun:
    return EngineRun(engine, "r1", [1, 2, 3], None, ServerMetrics("m").tracker())  # type: ignore[arg-type]


async def _outputs(run: EngineRun) -> list[RequestOutput]:
    return [out async for out in run.outputs()]


def test_a_long_prefill_starts_the_response_before_the_first_output() -> None:
    async def main() -> None:
        run = _run(_ScriptedEngine(prefill_s=0.3))
        await run.start(_request(asyncio.Event()), accept_s=0.01)
        assert run.pending  # started: the first output is still on its way
        [out] = await _outputs(run)
        assert out.text == "hi" and out.finished and run.finished and not run.pending
        await run.close()

    asyncio.run(main())


def test_a_quick_first_output_is_peeked_as_before() -> None:
    async def main() -> None:
        run = _run(_ScriptedEngine(prefill_s=0.0))
        await run.start(_request(asyncio.Event()), accept_s=5.0)
        assert not run.pending and run.finished
        assert [o.text for o in await _outputs(run)] == ["hi"]
        await run.close()

    asyncio.run(main())


def test_a_refusal_still_comes_before_the_response() -> None:
    async def main() -> None:
        run = _run(_ScriptedEngine(prefill_s=0.0, refuse=EngineOverloadedError()))
        with pytest.raises(EngineOverloadedError):
            await run.start(_request(asyncio.Event()), accept_s=5.0)

    asyncio.run(main())


def test_closing_during_the_prefill_aborts_the_request() -> None:
    async def main() -> None:
        engine = _ScriptedEngine(prefill_s=30.0)
        run = _run(engine)
        await run.start(_request(asyncio.Event()), accept_s=0.01)
        assert run.pending
        await run.close()  # the stream ended (client gone) before the first output
        assert "r1" in engine.aborted and not run.pending

    asyncio.run(main())
