"""AsyncEngine: the asyncio face of the engine (generate/abort/stats) over the EngineCore thread.

The server's only engine entry point. Never blocks the event loop; talks to the core through its inbox
and receives outputs via loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from engine.chat_template import ChatTemplate
from engine.config import EngineConfig
from engine.core import CoreOutput, EngineCore
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import DeviceKVAllocator, HostKVAllocator, KVCache, KVShape
from engine.model_loader import ModelFolder, check_graph, create_session, read_model_folder, resolve_max_model_len
from engine.output_processor import OutputProcessor, RequestState, merge_outputs
from engine.runner import Runner
from engine.scheduler import Request, Scheduler
from engine.tokenizer import Tokenizer
from engine.types import (
    EngineDeadError, EngineOverloadedError, EngineStats, InvalidRequestError, PromptTooLongError, RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


class AsyncEngine:
    """Continuous-batching generation for one model on one device.

    Usage::

        engine = AsyncEngine.from_model_dir("path/to/model", EngineConfig(max_batch=8))
        prompt = engine.tokenizer.encode(engine.chat_template.render([{"role": "user", "content": "Hi"}]))
        async for out in engine.generate(prompt, SamplingParams(max_tokens=32), "req-1"):
            print(out.text, end="")
        engine.shutdown()
    """

    def __init__(self, folder: ModelFolder, config: EngineConfig) -> None:
        self.config = config
        self.folder = folder
        session, selected = create_session(folder, config)
        io = check_graph(folder, session)
        self.max_model_len = resolve_max_model_len(folder, config, io.kv_length)
        self.vocab_size = io.vocab_size
        kv_length = io.kv_length or self.max_model_len
        allocator = HostKVAllocator() if selected is None else DeviceKVAllocator(selected)
        kv = KVCache(KVShape(folder.num_layers, config.max_batch, folder.num_kv_heads, kv_length,
                             folder.head_size, io.kv_dtype), allocator)
        runner = Runner(session, io, kv, prefill_chunk=config.prefill_chunk, max_position=self.max_model_len,
                        whole_buffer=bool(config.whole_buffer))
        scheduler = Scheduler(config.max_batch, config.max_queue + config.max_batch, config.prefill_chunk)
        self.kv_cache_bytes = kv.shape.nbytes
        self._processor = OutputProcessor()
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
        self._core = EngineCore(runner, scheduler, self._on_core_outputs, seed=config.seed)
        self._core.start()
        self._closed = False
        log.info("engine ready: %s, max_model_len %d, %d slots, KV %.1f MiB", folder.model_name,
                 self.max_model_len, config.max_batch, self.kv_cache_bytes / 2**20)

    @classmethod
    def from_model_dir(cls, path: str | Path, config: EngineConfig | None = None) -> AsyncEngine:
        """Load a model folder (blocking: call it from a thread when a loop is running).

        Raises:
            ModelLoadError: the folder cannot be served.
        """
        return cls(read_model_folder(path), config or EngineConfig())

    # -- model facts -----------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self.folder.tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        return self.folder.chat_template

    @property
    def model_name(self) -> str:
        return self.folder.model_name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.folder.eos_token_ids

    @property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json (the model's default sampling settings)."""
        return self.folder.generation_config

    def check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> None:
        """Raises PromptTooLongError when no token fits after the prompt; InvalidRequestError for an
        empty prompt or ids outside the vocabulary. Never truncates."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_ids), self.max_model_len)
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad}",
                                      param="prompt")

    # -- requests --------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs: text deltas, exactly one with ``finished=True``.

        Raises (at the first iteration): PromptTooLongError, InvalidRequestError, EngineOverloadedError
        (the waiting queue is full), EngineDeadError. Cancelling the consumer aborts the request.
        """
        self._check_alive()
        prompt_ids = list(prompt_ids)
        self.check_prompt(prompt_ids, params)
        states = self._processor.states
        if request_id in states:
            raise InvalidRequestError(f"request_id {request_id!r} is already running", param="request_id")
        # NOTE(engine): in flight = running + waiting; the waiting part is bounded by max_queue.
        if len(states) >= self.config.max_batch + self.config.max_queue:
            raise EngineOverloadedError()
        detok = IncrementalDetokenizer(self.tokenizer.hf, prompt_ids, stop=params.stop,
                                       include_stop_str_in_output=params.include_stop_str_in_output)
        state = RequestState(request_id, len(prompt_ids), params, detok)
        self._processor.add(state)
        self._loops[request_id] = asyncio.get_running_loop()
        self._core.add(Request(request_id, prompt_ids, params, eos_token_ids=self.eos_token_ids,
                               max_model_len=self.max_model_len))
        finished = False
        try:
            while not finished:
                items = [await state.queue.get()]
                while not state.queue.empty():
                    items.append(state.queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                out = merge_outputs(items)
                finished = out.finished
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._abort_now([request_id])
            raise
        finally:
            self._loops.pop(request_id, None)
            if not finished:
                self._processor.remove(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its slot is free at the next step. Unknown ids are ignored."""
        self._abort_now([request_id])

    def _abort_now(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._processor.remove(request_id)
            if state is not None:
                self._loops.pop(request_id, None)
        self._core.abort(request_ids)

    def stats(self) -> EngineStats:
        snap = self._core.snapshot
        return EngineStats(
            num_running=snap.num_running, num_waiting=max(snap.num_waiting,
                                                          len(self._processor.states) - snap.num_running),
            num_slots_free=snap.num_slots_free, num_slots_total=self.config.max_batch,
            prompt_tokens_total=snap.prompt_tokens_total, generation_tokens_total=snap.generation_tokens_total,
            decode_tokens_per_s=snap.decode_tokens_per_s,
            extra={"kv_cache_bytes": float(self.kv_cache_bytes), "steps_total": float(snap.steps_total)})

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight and join the engine thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._core.shutdown(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._core.alive and not self._closed

    # -- plumbing --------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if not self._core.alive:
            raise EngineDeadError(f"the engine thread has stopped: {self._core.dead!r}")

    def _on_core_outputs(self, outputs: list[CoreOutput]) -> None:
        """Core thread: hand a step's outputs to the loop(s) that own the requests."""
        by_loop: dict[asyncio.AbstractEventLoop, list[CoreOutput]] = {}
        for out in outputs:
            loop = self._loops.get(out.request_id)
            if loop is not None:
                by_loop.setdefault(loop, []).append(out)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._process, group)
            except RuntimeError:  # that loop is closed; its requests are gone
                log.debug("dropping outputs for a closed event loop")
        if self._core.dead is not None:
            for loop in set(self._loops.values()):
                try:
                    loop.call_soon_threadsafe(self._processor.fail_all, EngineDeadError(repr(self._core.dead)))
                except RuntimeError:
                    pass

    def _process(self, outputs: list[CoreOutput]) -> None:
        """Event loop: detokenize and queue; a stop string found here aborts the request in the core."""
        to_abort = self._processor.process(outputs)
        if to_abort:
            self._core.abort(to_abort)
