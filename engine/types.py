"""Engine-side value types shared by the engine, the server and the bench.

Frozen dataclasses and enums only; no onnxruntime, no pydantic (the wire lives in server/openai/protocol.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple


class FinishReason(str, enum.Enum):
    """Why a request ended. ``str()`` is the OpenAI wire string."""

    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the server cancelled it
    ERROR = "error"  # the engine failed while running this request

    def __str__(self) -> str:
        return self.value


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily

# The kinds of output constraint a request can carry (see StructuredOutput).
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on one request's output, as plain data; the engine's grammar backend compiles it.

    Attributes:
        kind: one of STRUCTURED_KINDS.
            "json_schema": ``spec`` is a JSON Schema as JSON text; "json_object": any JSON object (``spec``
            unused); "regex": ``spec`` is a regular expression the whole output matches; "choice": ``spec``
            is a JSON list of strings, the output is exactly one of them; "lark": ``spec`` is a grammar in
            llguidance's Lark dialect (``%json {...}`` embeds a schema; tool calls are built this way);
            "gbnf": ``spec`` is a llama.cpp GBNF grammar.
        spec: the text described above.
        param: the request field the constraint came from ("response_format", "structured_outputs",
            "guided_json", "tools", ...); a spec the engine cannot compile is a 400 naming it.
    """

    kind: str
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {list(STRUCTURED_KINDS)}, "
                                      f"got {self.kind!r}", param=self.param)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Validation lives in ``__post_init__`` so every entry point (HTTP, bench, tests) gets the same
    messages; each names the parameter, the allowed range and the value received.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # [0.01, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias in [-100, 100])
    logprobs: bool = False
    top_logprobs: int = 0  # [0, 20]
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None  # constrained decoding; None = free text
    # Special tokens kept in the output text (tool-call markup such as "[TOOL_CALLS]" or "<|python_tag|>");
    # every other special token is still skipped. Names the tokenizer does not know are ignored.
    preserved_tokens: tuple[str, ...] = ()
    n: int = 1  # choices; they share one prefill (the engine's max_batch bounds it)
    # Reading logits instead of generating (decisions, rerank, score): the first output token's TokenLogprob also
    # carries, in ``top``, the log-probability of each of these ids (in this order) under the model's raw
    # next-token distribution at the prompt's end (no temperature, penalties, bias or mask). With max_tokens=1
    # the request is a run that stops after the prompt: the one sampled token is never run through the model.
    label_token_ids: tuple[int, ...] = ()
    # Speculative decoding for this request: the most draft tokens one check may hold (None: the engine's bounds,
    # 0: no drafts). Drafts never change what is sampled, only how fast.
    draft_max_tokens: int | None = None
    draft_model: str | None = None  # LM Studio's per-request field: accepted when it names the loaded draft model

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be >= 0 (0 disables)", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        # NOTE(lead): not just > 0: the sampler divides float32 logits by it, and a penalty below float32's
        # range (1e-46 passes "> 0") becomes 0 there, so the logits turn infinite and sampling NaN.
        _check(0.01 <= self.repetition_penalty <= 2.0, "repetition_penalty", "must be in [0.01, 2]",
               self.repetition_penalty)
        _check(0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]", self.top_logprobs)
        _check(self.seed is None or 0 <= self.seed < 2**64, "seed", "must be in [0, 2**64)", self.seed)
        _check(all(t >= 0 for t in self.label_token_ids), "label_token_ids", "must be token ids >= 0",
               self.label_token_ids)
        _check(self.draft_max_tokens is None or 0 <= self.draft_max_tokens <= 64, "speculative.n_max",
               "must be in [0, 64] (0: no drafts)", self.draft_max_tokens)
        for token_id, bias in self.logit_bias:
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"values must be in [-100, 100] (token {token_id})", bias)

    @property
    def greedy(self) -> bool:
        # NOTE(engine): temperatures below 1e-5 are greedy: dividing float32 logits by them overflows to inf
        # (NaN probabilities). Found by tests/reliability/test_fuzz_chat.py (temperature=5e-324).
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _check(ok: bool, param: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {rule}, got {value!r}", param=param, code="invalid_value")


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    # (token_id, logprob), most likely first; for a request with label_token_ids: each label's, in their order
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """What ``AsyncEngine.generate()`` yields: the delta since the previous output of one choice of a request.

    ``text`` is only ever whole UTF-8 characters and never contains a (partial) stop string.
    Exactly one output per request has ``finished=True`` (the last one); it may carry text too. Each choice
    (``index``; n > 1) ends with exactly one output that has ``finish_reason`` set; with n = 1 that is the
    finished one.
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_generated_tokens: int  # cumulative, all choices together
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None  # set with finish_reason=ERROR
    # time.monotonic() seconds when the core first scheduled the request (left the waiting queue); set
    # on its outputs once known, so the server can tell queue time from prefill time.
    first_scheduled_s: float | None = None
    index: int = 0  # the choice this delta belongs to (n > 1)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.cached_tokens)
    stop_string: str | None = None  # the stop string that ended this choice (Anthropic's stop_sequence)
    # the request's draft checks (all choices), set on its finished output only; None on the others
    spec_decode: SpecDecodeStats | None = None


@dataclass(frozen=True)
class SpecDecodeStats:
    """One request's speculative decoding: what each of its draft checks proposed and kept, in order (every choice's
    checks, n > 1). What vLLM's ``--per-request-spec-decode-metrics`` reports, derived here once.

    A check of d draft tokens that keeps the first a of them yields a + 1 tokens (the model's own token after them).
    """

    per_step_drafted: tuple[int, ...] = ()
    per_step_accepted: tuple[int, ...] = ()

    @property
    def num_spec_steps(self) -> int:
        return len(self.per_step_drafted)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.per_step_drafted)

    @property
    def num_accepted_draft_tokens(self) -> int:
        return sum(self.per_step_accepted)

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per check: 1 + accepted / checks (None: no check)."""
        steps = self.num_spec_steps
        return 1.0 + self.num_accepted_draft_tokens / steps if steps else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (None: nothing drafted)."""
        drafted = self.num_draft_tokens
        return self.num_accepted_draft_tokens / drafted if drafted else None

    def acceptance_histogram(self, num_spec_tokens: int = 0) -> list[int]:
        """Dense: ``[j]`` counts the checks that kept exactly j draft tokens, j in ``[0, max(num_spec_tokens,
        longest draft)]``."""
        histogram = [0] * (max(num_spec_tokens, *self.per_step_drafted, 0) + 1)
        for accepted in self.per_step_accepted:
            histogram[accepted] += 1
        return histogram


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and the bench."""

    num_running: int
    num_waiting: int
    num_slots_free: int
    num_slots_total: int
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_tokens_per_s: float = 0.0  # recent, all streams together
    extra: dict[str, float] = field(default_factory=dict)
    # KV cache in tokens: held by running requests, kept by free slots for prefix reuse, and the capacity
    # (slots x max_model_len). used / total is the gateway's KV-utilization fraction.
    num_kv_tokens_used: int = 0
    num_kv_tokens_cached: int = 0
    num_kv_tokens_total: int = 0


@dataclass(frozen=True)
class StepInfo:
    """What a model run is about to compute; passed to the test-only EngineConfig.fault_injector."""

    step: int  # steps_total before this step
    kind: str  # "decode" or "prefill"
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class DevicePlacement:
    """Where one engine's tensors live and how its decode step runs (startup log, tests, ``devices``)."""

    provider: str  # "cpu", "webgpu", "amdgpu", ...
    ep_name: str  # e.g. "WebGpuExecutionProvider"
    device_id: int  # the DEFAULT memory info's id (0 on the plain CPU path)
    kv_cache: str  # "host" (the CPU addresses it) | "device"
    decode_inputs: str  # "ep_host_accessible" | "hip_host_malloc" | "cpu" | "cpu->device" (uploaded per step)
    logits: str  # where a run writes them: "cpu" | "ep_host_accessible" | "hip_host_malloc" | "device->cpu"
    whole_buffer: bool  # every decode run covers a prefix of the KV rows (opaque buffers), not the running rows
    graph_capture: bool
    graph_capture_note: str = ""  # why capture is on or off
    kv_rows: str = "host"  # how one row is bound (ep.addressing): "host" | "pointer" | "opaque"
    runner: str = ""  # engine.placement's choice: "rows (host)", "rows (pointer)", "buckets", "whole buffer"
    switch_interval_ms: float | None = None  # the device profile's thread switch interval once loaded (None: Python's)


# --- what the engine core hands over ---------------------------------------------------------------


class CoreOutput(NamedTuple):
    """What one step produced for one request: new tokens and, at the end, why it finished.

    NOTE(engine): a NamedTuple, not a frozen dataclass: a 64-row step builds 64 of them on the core thread
    (~3 us each as a frozen dataclass, under 1 us as a tuple), and an engine process sends them as plain tuples,
    which pickle 5x faster and are rebuilt on the other side without calling ``__init__``
    (``engine.core_wire``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    seq: int = 0  # the Request's seq
    first_scheduled_s: float | None = None  # Request.first_scheduled_s (time.monotonic seconds)
    index: int = 0  # the choice (n > 1)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on choice 0's outputs)
    # NOTE(engine): set when the request was refused before it ran (EngineOverloadedError from the
    # scheduler, an invalid request); the async side raises it to the caller instead of an output.
    exception: BaseException | None = None
    # NOTE(engine): STOP normally means the last token is a stop token (eos, stop_token_ids), which is not text;
    # a request whose grammar completed (constrained decoding) stops on a token that is text.
    grammar_complete: bool = False
    # (draft tokens, of them accepted) of the draft check whose tokens this output carries; None: no check (a decode
    # step, a prompt). The async side adds them up per request (RequestOutput.spec_decode).
    spec_check: tuple[int, int] | None = None


@dataclass(frozen=True)
class CoreSnapshot:
    """Counters published after every step (read from other threads without locks)."""

    num_running: int = 0
    num_waiting: int = 0
    num_slots_free: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    decode_tokens_per_s: float = 0.0
    steps_total: int = 0
    last_step_s: float = 0.0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of them, tokens whose KV was reused
    spec_draft_tokens_total: int = 0  # tokens proposed by speculative drafts
    spec_accepted_tokens_total: int = 0  # of them, tokens the model kept
    spec_drafts_total: int = 0  # draft checks
    spec_accepted_per_pos: tuple[int, ...] = ()  # [i]: checks whose draft token i was kept
    # KV held, in tokens (issue 26: the gateway's KV-utilization gauge): running requests' computed tokens, and
    # what free slots keep for prefix reuse (evictable, so not counted as used, as vLLM counts cached blocks).
    num_kv_tokens_running: int = 0
    num_kv_tokens_cached: int = 0
    # batch runs an interactive request's arrival stopped midway / kept from starting (engine.run_interrupt)
    runs_stopped_total: int = 0
    runs_skipped_total: int = 0
    # Where the core thread's time went (wall seconds per phase, PHASES order) and its CPU seconds: a phase whose
    # wall time the CPU time does not cover waited (on the device, or on the interpreter held by the event loop).
    phase_s: tuple[float, ...] = ()
    thread_cpu_s: float = 0.0


Sink = Callable[[list[CoreOutput]], None]
# NOTE(engine): a test-only hook (EngineConfig.fault_injector): called on the core thread just before each
# session.run; whatever it raises fails exactly the requests of that run, as a real device error would.
FaultInjector = Callable[[StepInfo], None]


# --- errors, mapped by class (never by message) to HTTP statuses in server/errors.py --------------


class EngineError(Exception):
    """Base of everything the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (-> 400)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PromptTooLongError(InvalidRequestError):
    """Prompt plus at least one generated token exceeds the context (-> 400, names both numbers)."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, *, lower_bound: bool = False,
                 param: str = "messages") -> None:
        # lower_bound: num_prompt_tokens is a bound from the prompt's length, the prompt was not tokenized.
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{'at least ' if lower_bound else ''}{num_prompt_tokens} tokens (at least one token must be left "
            f"for the completion).",
            param=param,
            code="context_length_exceeded",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class EngineOverloadedError(EngineError):
    """The waiting queue is full (-> 429 with Retry-After)."""

    def __init__(self, message: str = "The server is overloaded; retry later.", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can be served (-> 503)."""


class ModelLoadError(EngineError):
    """A model folder cannot be served (missing files, unknown inputs, corrupt ONNX)."""
