"""Engine-direct backend: drives engine.async_engine.AsyncEngine in-process, no HTTP, same records.

Imports the engine lazily (only `--engine MODEL_DIR` pays for onnxruntime); no server import.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from bench.metrics import RequestRecord
from bench.scenarios import RequestSpec


class EngineBackend:
    """Serve RequestSpecs straight from an ``AsyncEngine`` so HTTP/SSE overhead is a measured ratio.

    NOTE(bench): timing mirrors the HTTP client: TTFT and inter-token gaps are taken at outputs that carry
    text (the ones the server would send as SSE chunks); token counts come from the engine's cumulative
    ``num_generated_tokens`` (what the server reports as usage). For "chat" the prompt goes through the
    model's chat template first, exactly as /v1/chat/completions does.
    """

    def __init__(self, model_dir: str | Path, *, endpoint: str = "chat", temperature: float = 0.0,
                 ignore_eos: bool = True, engine_config: object | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.endpoint = endpoint
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.engine_config = engine_config
        self.engine = None
        self.model: str | None = None

    async def prepare(self) -> None:
        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig

        config = self.engine_config if self.engine_config is not None else EngineConfig()
        # NOTE(bench): loading blocks (session creation), so it runs in a thread, off the event loop.
        self.engine = await asyncio.to_thread(AsyncEngine.from_model_dir, self.model_dir, config)
        self.model = self.engine.model_name

    def _prompt_ids(self, prompt: str) -> list[int]:
        if self.endpoint == "chat":
            prompt = self.engine.chat_template.render([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
        return list(self.engine.tokenizer.encode(prompt))

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Run one request through the engine and fill ``record``; engine errors are recorded by class."""
        from engine.types import (EngineDeadError, EngineOverloadedError, FinishReason, InvalidRequestError,
                                  SamplingParams, StructuredOutput)

        request_id = f"bench-{spec.index}-{id(record)}"
        t_send = time.perf_counter()
        started = False
        try:
            prompt_ids = await asyncio.to_thread(self._prompt_ids, spec.prompt)
            structured = (None if spec.json_schema is None
                          else StructuredOutput("json_schema", json.dumps(spec.json_schema)))
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=self.temperature,
                                    ignore_eos=self.ignore_eos, structured=structured)
            started = True
            async for out in self.engine.generate(prompt_ids, params, request_id):
                now = time.perf_counter()
                record.usage_prompt_tokens = out.num_prompt_tokens
                record.usage_completion_tokens = out.num_generated_tokens
                if out.text:
                    record.add_content_chunk(now - t_send)
                if out.finished:
                    record.finish_reason = str(out.finish_reason) if out.finish_reason else None
                    if out.finish_reason is FinishReason.ERROR:
                        record.error_kind, record.error = "http_5xx", f"engine error: {out.error}"
            if record.finish_reason is None and record.error_kind is None:
                record.error_kind, record.error = "dropped_stream", "generate() ended without a finished output"
        except asyncio.CancelledError:
            record.error_kind, record.error = "deadline", "cut by the run's duration cap"
            if started:
                await self.engine.abort(request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, classified by class as the server would map it
            if isinstance(exc, EngineOverloadedError):
                record.error_kind = "http_429"
            elif isinstance(exc, InvalidRequestError):
                record.error_kind = "http_4xx"
            elif isinstance(exc, EngineDeadError):
                record.error_kind = "http_5xx"
            else:
                record.error_kind = "other"
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            record.e2e_s = time.perf_counter() - t_send

    async def aclose(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            self.engine = None
