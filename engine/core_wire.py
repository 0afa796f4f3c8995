"""What crosses the engine-process boundary: the messages, the facts a loaded model reports, and their encoding.

Both sides import this module (engine.core_client in the server's process, engine.core_process in the engine's);
it imports no onnxruntime. Every message is one of the records below (a NamedTuple), pickled with protocol 5:

parent -> child: ``AddRequest``, ``AbortRequests``, ``PrepareGrammar`` (start compiling: the parent compiles the
same spec meanwhile), ``Shutdown``.
child -> parent: ``Ready`` or ``LoadFailed`` once, then ``StepOutputs`` (one per sink call: a step's decode run, a
prompt's first tokens), ``SnapshotUpdate``, ``CoreDied`` (the core thread died), then EOF.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.scheduler import Request
from engine.types import (
    CoreOutput, CoreSnapshot, DevicePlacement, EngineError, FinishReason, SamplingParams, StructuredOutput,
    TokenLogprob,
)

PICKLE_PROTOCOL = 5


@dataclass(frozen=True)
class CoreFacts:
    """What the engine process knows once the model is loaded and the parent needs (the ``Ready`` message)."""

    max_model_len: int
    vocab_size: int
    kv_cache_bytes: int
    placement: DevicePlacement
    speculative_tokens: int  # after the runner's say (0 where drafts cannot be checked)
    can_verify: bool
    buckets: tuple[int, ...]
    pid: int
    # the backend flags (ep.flags.REGISTRY names and companions) as the engine process sees them
    backend_flags: dict[str, str | None] = field(default_factory=dict)


# -- parent -> child -----------------------------------------------------------------------------------------------


class AddRequest(NamedTuple):
    """A request to run: what the engine's caller gives (its grammar compiles on the core's side)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seq: int  # unique per engine: tells a reused request_id's outputs apart
    arrival_s: float  # time.monotonic() seconds when the engine took it
    priority: int = 0  # 0: interactive; higher runs later and gives its row up to lower (Request.priority)

    def to_request(self, eos_token_ids: frozenset[int], max_model_len: int,
                   constraints: Sequence[Any] = ()) -> Request:
        """The scheduler's Request, with its n > 1 choices forked; ``constraints[i]`` (a compiled grammar, one per
        choice, or none at all) goes to choice i. The one place a Request is built from a caller's request."""
        request = Request(self.request_id, self.prompt_ids, self.params, eos_token_ids=eos_token_ids,
                          max_model_len=max_model_len, seq=self.seq, arrival_s=self.arrival_s,
                          constraint=constraints[0] if constraints else None, priority=self.priority)
        if self.params.n > 1:
            for fork, constraint in zip(request.fork(self.params.n), constraints[1:]):
                fork.constraint = constraint
        return request


class AbortRequests(NamedTuple):
    """Stop requests: every choice, or only choice ``index`` of an n > 1 request."""

    request_ids: list[str]
    index: int | None = None


class PrepareGrammar(NamedTuple):
    """Start compiling ``spec`` (an add that needs it follows)."""

    spec: StructuredOutput


class Shutdown(NamedTuple):
    """Stop: everything in flight ends with ABORT, then the engine process exits."""


# -- child -> parent -----------------------------------------------------------------------------------------------


class Ready(NamedTuple):
    """The model is loaded; the core runs from now on."""

    facts: CoreFacts


class LoadFailed(NamedTuple):
    """Loading failed: the error as ``encode_exception`` encodes it, and where it was raised."""

    exception: tuple
    traceback: str


class StepOutputs(NamedTuple):
    """One sink call's outputs (``encode_outputs`` rows), with the core's snapshot when one was due."""

    rows: list[tuple]
    snapshot: CoreSnapshot | None
    process_cpu_s: float | None  # the engine process's CPU seconds, with the snapshot


class SnapshotUpdate(NamedTuple):
    """The core's counters between steps (idle, or none went with an output for a while)."""

    snapshot: CoreSnapshot
    process_cpu_s: float


class CoreDied(NamedTuple):
    """The core thread died (``encode_exception``'s tuple); EOF follows."""

    exception: tuple


ToCore = AddRequest | AbortRequests | PrepareGrammar | Shutdown
FromCore = Ready | LoadFailed | StepOutputs | SnapshotUpdate | CoreDied


def dumps(message: ToCore | FromCore) -> bytes:
    return pickle.dumps(message, PICKLE_PROTOCOL)


def loads(data: bytes) -> ToCore | FromCore:
    return pickle.loads(data)


class FrameReader:
    """The messages a ``multiprocessing.Connection``'s ``send_bytes`` framed (a 4-byte big-endian length, or -1 and
    an 8-byte one), read from its file descriptor: every whole message one ``os.read`` brings.

    NOTE(engine): ``Connection.recv_bytes`` reads a message in two reads (its length, then its body), and each read
    drops and retakes the interpreter lock, which the server's event loop may hold for up to the switch interval. One
    read per wake-up, and all the messages it brought handed on together. Measured on 2 shared cores with the loop
    busy 0.2 ms per message and a 0.5 ms switch interval (the device setting): send -> loop callback p50 91-93 us
    against 104-135, p99 157-165 us against 176-2280.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()

    def read(self) -> list[bytes]:
        """The next messages (at least one); raises EOFError once the other end has closed."""
        messages: list[bytes] = []
        while not messages:
            data = os.read(self.fd, 1 << 20)
            if not data:
                raise EOFError
            buffer = self._buffer
            buffer += data
            pos, end = 0, len(buffer)
            while end - pos >= 4:
                (size,) = struct.unpack_from("!i", buffer, pos)
                head = 4
                if size == -1:
                    if end - pos < 12:
                        break
                    (size,) = struct.unpack_from("!Q", buffer, pos + 4)
                    head = 12
                if end - pos - head < size:
                    break
                messages.append(bytes(buffer[pos + head:pos + head + size]))
                pos += head + size
            del buffer[:pos]
        return messages


# -- step outputs --------------------------------------------------------------------------------------------------

_REASONS = {reason.value: reason for reason in FinishReason}


def encode_outputs(outputs: Sequence[CoreOutput]) -> list[tuple]:
    """CoreOutputs as plain tuples (the fields in order): pickled by C code, no per-object reduce.

    A finish reason goes as its string, log-probabilities as (token_id, logprob, top) tuples, an exception as
    ``encode_exception``'s tuple.
    """
    rows: list[tuple] = []
    append = rows.append
    for out in outputs:
        reason, logprobs, exc = out[2], out[3], out[9]
        if reason is None and logprobs is None and exc is None:
            append(tuple(out))
            continue
        if logprobs is not None:
            logprobs = tuple([(lp.token_id, lp.logprob, lp.top) for lp in logprobs])
        append((out[0], out[1], None if reason is None else reason.value, logprobs, *out[4:9],
                None if exc is None else encode_exception(exc), *out[10:]))
    return rows


def decode_outputs(rows: Sequence[tuple]) -> list[CoreOutput]:
    """``encode_outputs``' tuples back as CoreOutputs (built without calling ``__init__``: see CoreOutput)."""
    make, new, token_logprob = tuple.__new__, object.__new__, TokenLogprob
    outputs: list[CoreOutput] = []
    append = outputs.append
    for row in rows:
        reason, logprobs, exc = row[2], row[3], row[9]
        if reason is None and logprobs is None and exc is None:
            append(make(CoreOutput, row))
            continue
        if logprobs is not None:
            entries = []
            for token_id, logprob, top in logprobs:
                # NOTE(engine): a frozen dataclass's __init__ sets each field through object.__setattr__; filling
                # its __dict__ at once costs a third of that, which counts at 64 rows a step with logprobs
                entry = new(token_logprob)
                entry.__dict__.update(token_id=token_id, logprob=logprob, top=top)
                entries.append(entry)
            logprobs = tuple(entries)
        append(make(CoreOutput, (row[0], row[1], None if reason is None else _REASONS[reason], logprobs, *row[4:9],
                                 None if exc is None else decode_exception(exc), *row[10:])))
    return outputs


# -- exceptions ------------------------------------------------------------------------------------------------------


def encode_exception(exc: BaseException) -> tuple:
    """(class, args, attributes) of ``exc``, rebuilt by ``decode_exception`` without calling its ``__init__``.

    NOTE(engine): plain pickling calls ``cls(*args)``, which fails for classes whose ``__init__`` takes other
    arguments than their message (PromptTooLongError, many library errors). A class the other side cannot import
    (a local class) goes as an EngineError naming it.
    """
    cls = type(exc)
    module = sys.modules.get(cls.__module__)
    if module is None or getattr(module, cls.__qualname__, None) is not cls:
        return EngineError, (f"{cls.__name__}: {exc}",), {}
    state = {k: v for k, v in vars(exc).items() if _picklable(v)}
    args = exc.args if _picklable(exc.args) else (str(exc),)
    return cls, args, state


def decode_exception(encoded: tuple) -> BaseException:
    cls, args, state = encoded
    try:
        exc = cls.__new__(cls, *args)
        BaseException.__init__(exc, *args)
        exc.__dict__.update(state)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt this way: keep its name and message
        return EngineError(f"{cls.__name__}: {args[0] if args else ''}")
    return exc


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value, PICKLE_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything pickle refuses
        return False
    return True
