"""AsyncEngine: the asyncio face of the engine (generate/abort/stats) over the EngineCore thread, in this process or
in an engine process of its own (EngineConfig.engine_process: engine.core_client).

The server's only engine entry point. Never blocks the event loop; talks to the core through its inbox (or the
engine process's pipe) and receives outputs via loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from engine.chat_template import ChatTemplate
from engine.config import EngineConfig
from engine.core_client import CoreClient, make_core_client
from engine.core_wire import AddRequest
from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import ModelFolder, read_model_folder
from engine.output_processor import OutputProcessor, RequestState, merge_by_choice
from engine.model_runner import ModelRunner
from engine.step_stats import PHASES
from engine.structured_output import GrammarConstraint
from engine.tokenizer import Tokenizer
from engine.types import (
    CoreOutput,
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
    Sink,
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

    def __init__(self, folder: ModelFolder, config: EngineConfig,
                 core_factory: Callable[[ModelFolder, EngineConfig, Sink], CoreClient] = make_core_client) -> None:
        self.config = config
        self.folder = folder
        self._processor = OutputProcessor()
        self._num_low = 0  # requests of priority > 0 in flight (not counted against max_queue)
        self._closed = False
        # NOTE(engine): with an engine process the session, KV cache, scheduler and samplers live there
        # (engine.core_process); this one keeps tokenizing, detokenizing, stop strings and HTTP. ``core_factory``:
        # make_core_client, or an attachment to an engine process shared with other API processes (core_attach).
        self._core: CoreClient = core_factory(folder, config, self._dispatch)
        # seq = client_index (mod num_clients): how a shared engine process routes outputs (CoreClient)
        self._seq, self._seq_step = self._core.client_index, self._core.num_clients
        self.engine_process = self._core.pid is not None
        facts = self._core.facts
        self._runner: ModelRunner | None = self._core.runner
        self.placement, self.max_model_len, self.vocab_size = facts.placement, facts.max_model_len, facts.vocab_size
        self.kv_cache_bytes, speculative_tokens = facts.kv_cache_bytes, facts.speculative_tokens
        self.structured = self._core.structured
        self._core.start()
        log.info("engine ready: %s, max_model_len %d, %d slots, KV %.1f MiB, prefix caching %s, "
                 "speculative tokens %d%s", folder.model_name, self.max_model_len, config.max_batch,
                 self.kv_cache_bytes / 2**20, "on" if config.prefix_caching else "off", speculative_tokens,
                 f", engine process {self._core.pid}" if self._core.pid is not None else "")

    @classmethod
    def from_model_dir(cls, path: str | Path, config: EngineConfig | None = None,
                       core_factory: Callable[[ModelFolder, EngineConfig, Sink], CoreClient] = make_core_client,
                       ) -> AsyncEngine:
        """Load a model folder (blocking: call it from a thread when a loop is running).

        Raises:
            ModelLoadError: the folder cannot be served.
        """
        config = config or EngineConfig()
        return cls(read_model_folder(path, config.chat_template), config, core_factory)

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
    def eog_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (``engine.end_of_generation``; ``ignore_eos`` requests pass them)."""
        return self.folder.eog_token_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """``eog_token_ids`` under its older name."""
        return self.folder.eog_token_ids

    @property
    def generation_config(self) -> dict[str, Any]:
        """generation_config.json (the model's default sampling settings)."""
        return self.folder.generation_config

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The sampling defaults its generation_config.json recommends (engine.model_loader.generation_defaults)."""
        return self.folder.sampling_defaults

    @property
    def runner(self) -> ModelRunner:
        """The model runner (in-process engines only: with ``engine_process`` it lives in the engine process)."""
        if self._runner is None:
            raise AttributeError("AsyncEngine.runner: the runner lives in the engine process (EngineConfig."
                                 "engine_process); only its placement is known here (AsyncEngine.placement)")
        return self._runner

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None in-process)."""
        return self._core.pid

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
                                      param="prompt", code="invalid_value")

    # -- requests --------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs: text deltas, exactly one with ``finished=True``.

        ``priority`` 0 is an interactive request; a higher number (a batch line) runs in the rows interactive requests
        leave, gives its row up to them, and is not counted against ``max_queue`` (its sender bounds it).

        With ``params.n > 1`` the outputs of the n choices interleave (``RequestOutput.index``); the prompt is
        computed once, and each choice has its own grammar state. Raises (at the first iteration):
        PromptTooLongError, InvalidRequestError (also for n > max_batch, and for a ``params.structured`` spec
        that does not compile, with its ``param``), EngineOverloadedError (the waiting queue is full),
        EngineDeadError. Cancelling the consumer aborts the request.
        """
        self._check_alive()
        prompt_ids = list(prompt_ids)
        self.check_prompt(prompt_ids, params)
        states = self._processor.states
        if request_id in states:
            raise InvalidRequestError(f"request_id {request_id!r} is already running", param="request_id")
        if params.draft_model is not None and not names_draft_model(params.draft_model, self.config.draft_model):
            loaded = Path(self.config.draft_model).name if self.config.draft_model else "none"
            raise InvalidRequestError(f"draft_model {params.draft_model!r} is not this server's draft model "
                                      f"(loaded: {loaded}; --draft-model sets it)", param="draft_model",
                                      code="invalid_value")
        if params.n > self.config.max_batch:
            raise InvalidRequestError(f"n must be at most {self.config.max_batch} (the sequences this server runs "
                                      f"at once, --max-batch), got {params.n}", param="n",
                                      code="invalid_value")
        # NOTE(engine): in flight = running + waiting; the waiting part is bounded by max_queue.
        if priority == 0 and len(states) - self._num_low >= self.config.max_batch + self.config.max_queue:
            raise EngineOverloadedError()
        if params.label_token_ids and max(params.label_token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"label_token_ids must be in [0, {self.vocab_size}), got "
                                      f"{max(params.label_token_ids)}", param="label_token_ids", code="invalid_value")
        constraints: list[GrammarConstraint | None] = [None] * params.n
        if params.structured is not None:
            self._core.prepare_grammar(params.structured)  # an engine process compiles it meanwhile
            # compiled (or taken from the cache) before the request reaches the core: a bad spec is an
            # InvalidRequestError here, before any output exists; the other choices copy the compiled one
            constraints = [await self.structured.constraint_for(params.structured) for _ in range(params.n)]
            self._check_alive()
            if request_id in states:
                raise InvalidRequestError(f"request_id {request_id!r} is already running", param="request_id")
        preserved = [i for i in map(self.tokenizer.token_to_id, params.preserved_tokens) if i is not None]
        detoks = [IncrementalDetokenizer(self.tokenizer.hf, prompt_ids, stop=params.stop,
                                         include_stop_str_in_output=params.include_stop_str_in_output,
                                         preserved_token_ids=preserved)
                  for _ in range(params.n)]
        self._seq += self._seq_step
        state = RequestState(request_id, len(prompt_ids), params, detoks[0], loop=asyncio.get_running_loop(),
                             seq=self._seq, more_detokenizers=detoks[1:])
        self._processor.add(state)
        try:
            self._core.add(AddRequest(request_id, prompt_ids, params, self._seq, time.monotonic(), priority),
                           constraints)
        except EngineDeadError:  # the core ended between the check above and now
            self._processor.remove(request_id)
            raise
        finished = False
        self._num_low += priority > 0
        try:
            while not finished:
                items = [await state.queue.get()]
                while not state.queue.empty():
                    items.append(state.queue.get_nowait())
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                for out in merge_by_choice(items):
                    finished = out.finished
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                self._abort_now([request_id])
            raise
        finally:
            self._num_low -= priority > 0
            if not finished and self._processor.states.get(request_id) is state:
                self._processor.remove(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its slot is free at the next step. Unknown ids are ignored.

        A consumer still iterating ``generate`` gets a final output with finish_reason ABORT.
        """
        self._abort_now([request_id], notify=True)

    def _abort_now(self, request_ids: list[str], notify: bool = False) -> None:
        for request_id in request_ids:
            state = self._processor.remove(request_id)
            if state is not None and notify:
                state.queue.put_nowait(RequestOutput(
                    request_id=request_id, text="", token_ids=(), num_prompt_tokens=state.num_prompt_tokens,
                    num_generated_tokens=state.num_generated_tokens, finished=True,
                    finish_reason=FinishReason.ABORT))
        self._core.abort(request_ids)

    def stats(self) -> EngineStats:
        snap = self._core.snapshot
        return EngineStats(
            num_running=snap.num_running, num_waiting=max(snap.num_waiting,
                                                          len(self._processor.states) - snap.num_running),
            num_slots_free=snap.num_slots_free, num_slots_total=self.config.max_batch,
            prompt_tokens_total=snap.prompt_tokens_total, generation_tokens_total=snap.generation_tokens_total,
            decode_tokens_per_s=snap.decode_tokens_per_s,
            extra={"kv_cache_bytes": float(self.kv_cache_bytes), "steps_total": float(snap.steps_total),
                   "prefix_cache_queries_total": float(snap.prefix_cache_queries_total),
                   "prefix_cache_hits_total": float(snap.prefix_cache_hits_total),
                   "spec_draft_tokens_total": float(snap.spec_draft_tokens_total),
                   "spec_accepted_tokens_total": float(snap.spec_accepted_tokens_total),
                   "spec_drafts_total": float(snap.spec_drafts_total),
                   "batch_runs_stopped_total": float(snap.runs_stopped_total),
                   "batch_runs_skipped_total": float(snap.runs_skipped_total),
                   **{f"spec_accepted_pos_{i}": float(n) for i, n in enumerate(snap.spec_accepted_per_pos)},
                   "engine_thread_cpu_s": snap.thread_cpu_s,
                   **({"engine_process_cpu_s": self._core.process_cpu_s}
                      if self._core.process_cpu_s is not None else {}),
                   **{f"engine_phase_{name}_s": value for name, value in zip(PHASES, snap.phase_s)}},
            num_kv_tokens_used=snap.num_kv_tokens_running, num_kv_tokens_cached=snap.num_kv_tokens_cached,
            num_kv_tokens_total=self.config.max_batch * self.max_model_len)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight and join the engine thread, or stop and reap the engine process (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._core.num_clients > 1:  # NOTE(engine): a shared engine goes on: free this process's rows there
                self._core.abort(list(self._processor.states))
            self._core.shutdown(timeout_s)
            self.structured.shutdown()

    @property
    def is_running(self) -> bool:
        return self._core.alive and not self._closed

    # -- plumbing --------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if not self._core.alive:
            raise EngineDeadError(f"the engine {'process' if self.engine_process else 'thread'} has stopped: "
                                  f"{self._core.dead!r}")

    def _dispatch(self, outputs: list[CoreOutput]) -> None:
        """The core's thread (or the process client's reader): hand a step's outputs to the loop(s) that own the
        requests, one wake-up per loop; the loop does the Python work per output while ORT runs the next step.
        """
        # NOTE(engine): dict reads here race only with whole-item writes on the loop thread (GIL-atomic);
        # a request removed meanwhile is skipped again on the loop side.
        states = self._processor.states
        by_loop: dict[asyncio.AbstractEventLoop, list[CoreOutput]] = {}
        for out in outputs:
            state = states.get(out.request_id)
            if state is not None and state.seq == out.seq and state.loop is not None:
                by_loop.setdefault(state.loop, []).append(out)
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._process, group)
            except RuntimeError:  # that loop is closed; its requests are gone
                log.debug("dropping outputs for a closed event loop")
        if self._core.dead is not None:
            for loop in {st.loop for st in list(states.values()) if st.loop is not None}:
                try:
                    loop.call_soon_threadsafe(self._processor.fail_all, EngineDeadError(repr(self._core.dead)))
                except RuntimeError:
                    pass

    def _process(self, outputs: list[CoreOutput]) -> None:
        """Event loop: detokenize and queue; a stop string found here aborts the request in the core."""
        for request_id, index in self._processor.process(outputs):
            self._core.abort([request_id], index)


def names_draft_model(name: str, draft_model: str | None) -> bool:
    """Whether a request's ``draft_model`` (LM Studio's field) names the loaded draft model folder ``draft_model``:
    its path, its folder name, or a converted GGUF's name without the checksum suffix (``<stem>-<sha12>``)."""
    if not draft_model:
        return False
    folder = Path(draft_model)
    stem = folder.name.rsplit("-", 1)[0] if len(folder.name.rsplit("-", 1)[-1]) == 12 else folder.name
    return name in (draft_model, folder.name, stem, f"{stem}.gguf") or Path(name).stem == stem
