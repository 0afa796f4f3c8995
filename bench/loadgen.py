"""Closed- and open-loop async load generators over the official openai streaming client.

Owns the HTTP backend and the run loops; engine-direct mode lives in bench/engine_driver.py (imported
only when asked for). No server or engine import here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import openai

from bench.metrics import RequestRecord
from bench.scenarios import RequestSpec, poisson_offsets_s


class RemoteUrlError(ValueError):
    """The target URL is not a loopback address and --allow-remote was not given."""


def check_loopback(url: str, allow_remote: bool = False) -> None:
    """Refuse a non-loopback target unless explicitly allowed (the bench is a load generator).

    Raises:
        RemoteUrlError: the host is neither "localhost" nor a loopback IP literal. Names are not resolved.
    """
    host = urlsplit(url).hostname or ""
    if allow_remote or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise RemoteUrlError(f"--url host {host!r} is not a loopback address; pass --allow-remote to load it anyway")


@dataclass(frozen=True)
class HttpSettings:
    """How each HTTP request is sent.

    Attributes:
        url: the OpenAI base URL, ending in /v1.
        model: model id; None asks GET /models and takes the first.
        api_key: bearer token (any string when the server has none).
        endpoint: "chat" (/chat/completions, messages=[user prompt]) or "completions" (/completions).
        temperature: sampling temperature sent with every request (0 = greedy).
        ignore_eos: send {"ignore_eos": true, "min_tokens": max_tokens} so every request runs to max_tokens
            on servers that honour either field.
        extra_body: more JSON fields merged into every request body.
        request_timeout_s: cap on one request, send to the end of its stream.
    """

    url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None
    api_key: str = "EMPTY"
    endpoint: str = "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)
    request_timeout_s: float = 600.0


class Backend(Protocol):
    """Something that serves one RequestSpec and fills its record (HTTP here, in-process engine elsewhere)."""

    model: str | None

    async def prepare(self) -> None: ...

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None: ...

    async def aclose(self) -> None: ...


class HttpBackend:
    """The official ``openai.AsyncOpenAI`` streaming path, as users take it.

    NOTE(bench): max_retries=0: a 429 or 5xx is a figure to record, never something to retry silently.
    """

    def __init__(self, settings: HttpSettings, max_connections: int = 256) -> None:
        if settings.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {settings.endpoint!r}")
        self.settings = settings
        self.model = settings.model
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(settings.request_timeout_s, connect=min(10.0, settings.request_timeout_s)),
        )
        self.client = openai.AsyncOpenAI(base_url=settings.url, api_key=settings.api_key, max_retries=0,
                                         http_client=self._http)

    async def prepare(self) -> None:
        """Resolve the model id from GET /models when none was given."""
        if self.model is None:
            models = await self.client.models.list()
            if not models.data:
                raise RuntimeError(f"{self.settings.url}/models lists no model; pass --model")
            self.model = models.data[0].id

    def _body(self, spec: RequestSpec) -> dict:
        extra = dict(self.settings.extra_body)
        if self.settings.ignore_eos:
            extra.setdefault("ignore_eos", True)
            extra.setdefault("min_tokens", spec.max_tokens)
        body = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": self.settings.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "extra_body": extra}
        if spec.json_schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "bench", "schema": spec.json_schema, "strict": True}}
        return body

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Stream one request and fill ``record``; errors are recorded (by class), never raised.

        CancelledError (the run's --duration cap) marks the record "deadline" and propagates.
        """
        t_send = time.perf_counter()
        chat = self.settings.endpoint == "chat"
        mid_stream = False  # True once the response headers arrived (create() returned)
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                if chat:
                    stream = await self.client.chat.completions.create(
                        messages=[{"role": "user", "content": spec.prompt}], **self._body(spec))
                else:
                    stream = await self.client.completions.create(prompt=spec.prompt, **self._body(spec))
                mid_stream = True
                try:
                    async for chunk in stream:
                        now = time.perf_counter()
                        if chunk.usage is not None:
                            record.usage_prompt_tokens = chunk.usage.prompt_tokens
                            record.usage_completion_tokens = chunk.usage.completion_tokens
                        for choice in chunk.choices:
                            text = choice.delta.content if chat else choice.text
                            # NOTE(bench): a chunk with token logprobs carries tokens even when they decode to no
                            # text yet (a random-weight model's bytes that form no character, skipped specials)
                            if text or choice.logprobs:
                                record.add_content_chunk(now - t_send)  # TTFT first, then one gap each
                            if choice.finish_reason is not None:
                                record.finish_reason = choice.finish_reason
                finally:
                    await stream.close()
            if record.finish_reason is None:
                record.error_kind, record.error = "dropped_stream", "stream ended without a finish_reason"
        except asyncio.CancelledError:
            record.error_kind, record.error = "deadline", "cut by the run's duration cap"
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a figure; classified by class
            record.error_kind = classify_error(exc, mid_stream=mid_stream)
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            record.e2e_s = time.perf_counter() - t_send

    async def aclose(self) -> None:
        await self.client.close()
        await self._http.aclose()


def classify_error(exc: BaseException, *, mid_stream: bool = False) -> str:
    """Map an exception to one of metrics.ERROR_KINDS, by its class and where it happened (never its text).

    Args:
        exc: what create() or the stream iteration raised.
        mid_stream: the response had started (status 200 received) when it was raised.
    """
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code == 429:
            return "http_429"
        return "http_5xx" if exc.status_code >= 500 else "http_4xx"
    if isinstance(exc, (TimeoutError, openai.APITimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(exc, (openai.APIConnectionError, httpx.TransportError)):
        # NOTE(bench): a transport failure after the headers means the server broke the stream off (openai
        # wraps httpx's RemoteProtocolError/ReadError into APIConnectionError there); before, no connection.
        return "dropped_stream" if mid_stream else "connection"
    if isinstance(exc, openai.APIError):
        return "stream_error"  # an {"error": ...} event inside a 200 stream
    return "other"


# --- server memory ------------------------------------------------------------------------------------


def read_rss_bytes(pid: int) -> int | None:
    """Resident set size of a process in bytes (psutil when installed, else /proc/PID/status), None if gone."""
    try:
        import psutil  # optional

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends: the process is gone
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


class RssSampler:
    """Samples a process's RSS every ``interval_s`` and at chosen completion counts.

    Samples are (t_s from run start, num_done, rss_bytes); ``summary()`` reports RSS after the first
    ``baseline_after`` completions beside the RSS at the end (the soak's leak check).
    """

    def __init__(self, pid: int, *, interval_s: float = 1.0, baseline_after: int = 1000) -> None:
        self.pid, self.interval_s, self.baseline_after = pid, interval_s, baseline_after
        self.samples: list[tuple[float, int, int]] = []
        self.baseline: tuple[float, int, int] | None = None
        self._t0 = time.perf_counter()
        self._num_done = 0

    def sample(self) -> None:
        rss = read_rss_bytes(self.pid)
        if rss is not None:
            self.samples.append((time.perf_counter() - self._t0, self._num_done, rss))

    def on_done(self, num_done: int) -> None:
        self._num_done = num_done
        if num_done == self.baseline_after:
            self.sample()
            self.baseline = self.samples[-1] if self.samples else None

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict:
        self.sample()
        if not self.samples:
            return {"pid": self.pid, "error": "could not read the process RSS"}
        end, peak = self.samples[-1], max(s[2] for s in self.samples)
        base = self.baseline
        return {
            "pid": self.pid,
            "baseline_after_requests": self.baseline_after,
            "rss_start_bytes": self.samples[0][2],
            "rss_baseline_bytes": base[2] if base else None,
            "rss_end_bytes": end[2],
            "rss_peak_bytes": peak,
            "growth_after_baseline_bytes": (end[2] - base[2]) if base else None,
            "growth_after_baseline_fraction": ((end[2] - base[2]) / base[2]) if base else None,
            "samples": [{"t_s": round(t, 3), "num_done": n, "rss_bytes": r} for t, n, r in self.samples],
        }


# --- run loops -----------------------------------------------------------------------------------------


class Progress:
    """A live progress line on stderr (tqdm; silent when stderr is not a terminal unless forced)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True,
                         disable=(None if enabled is None else not enabled), mininterval=0.5)
        self._t0 = time.perf_counter()
        self.num_done = self.num_errors = self.num_tokens = 0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_errors += 0 if record.ok else 1
        self.num_tokens += record.num_output_tokens
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self._bar.set_postfix(err=self.num_errors, tok_s=f"{self.num_tokens / elapsed:.1f}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


@dataclass
class RunResult:
    """Everything one run produced: the records (sent requests only) and its wall time."""

    records: list[RequestRecord]
    duration_s: float
    num_not_sent: int  # requests never started because the duration cap came first
    rss: dict | None = None
    started_at_s: float | None = None  # the wall clock (time.time) at the records' zero: their start_s count from it


async def run_load(backend: Backend, specs: Iterable[RequestSpec], num_requests: int, *,
                   concurrency: int | None = None, rate_per_s: float | None = None, duration_s: float | None = None,
                   seed: int = 0, label: str = "", progress: bool | None = None,
                   rss_sampler: RssSampler | None = None) -> RunResult:
    """Run one level: closed loop (``concurrency`` workers back to back) or open loop (Poisson ``rate_per_s``).

    Args:
        backend: HttpBackend or the engine-direct backend, already prepared.
        specs: the requests, consumed in order (at most num_requests of them).
        num_requests: count bound.
        concurrency: closed-loop users (exactly one of concurrency / rate_per_s).
        rate_per_s: open-loop mean arrival rate; arrivals do not wait for earlier requests.
        duration_s: hard time cap; requests in flight at the cap are cancelled and recorded as "deadline".
        seed: arrival-time seed for the open loop.
        label: progress line label.
        progress: force the progress line on/off (None: on when stderr is a terminal).
        rss_sampler: optional server memory sampler, run alongside.

    Returns:
        RunResult; duration_s runs from the first send to the last completion.
    """
    if (concurrency is None) == (rate_per_s is None):
        raise ValueError("give exactly one of concurrency (closed loop) and rate_per_s (open loop)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    spec_iter: Iterator[RequestSpec] = iter(specs)
    records: list[RequestRecord] = []
    bar = Progress(num_requests, label, progress)
    t0, started_at = time.perf_counter(), time.time()
    sampler_task = asyncio.create_task(rss_sampler.run()) if rss_sampler else None

    async def one(spec: RequestSpec) -> None:
        record = RequestRecord(index=spec.index, start_s=time.perf_counter() - t0,
                               num_prompt_tokens_target=spec.num_prompt_tokens_target, max_tokens=spec.max_tokens)
        records.append(record)
        try:
            await backend.send(spec, record)
        finally:
            bar.update(record)
            if rss_sampler:
                rss_sampler.on_done(bar.num_done)

    def take() -> RequestSpec | None:
        if len(records) >= num_requests:
            return None
        return next(spec_iter, None)

    async def worker() -> None:
        while (spec := take()) is not None:
            await one(spec)

    async def open_loop() -> None:
        tasks: list[asyncio.Task] = []
        try:
            for offset in poisson_offsets_s(rate_per_s, num_requests, seed=seed):
                delay = t0 + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if (spec := take()) is None:
                    break
                tasks.append(asyncio.create_task(one(spec)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        async with asyncio.timeout(duration_s):
            if concurrency is not None:
                await asyncio.gather(*(worker() for _ in range(concurrency)))
            else:
                await open_loop()
    except TimeoutError:
        pass  # the duration cap: in-flight records are marked "deadline" by the backend
    finally:
        duration = time.perf_counter() - t0
        bar.close()
        if sampler_task:
            sampler_task.cancel()
            await asyncio.gather(sampler_task, return_exceptions=True)
    # NOTE(bench): a request that never got its record started counts as not sent, not as an error.
    return RunResult(records=sorted(records, key=lambda r: r.index), duration_s=duration,
                     num_not_sent=num_requests - len(records),
                     rss=rss_sampler.summary() if rss_sampler else None, started_at_s=started_at)



# NOTE(bench): one client process streams about 4,000 chunks/s through the openai SDK before its own CPU is the
# limit (measured on an H200's host: 64 streams took 9.7 s of client CPU in 8.5 s of wall time, and two processes of
# 32 streams together got 2x the tokens/s of one: perf/gpu/c64_client.sh). Past that the bench measures
# itself, so a closed-loop level can be split over client processes, as real users are.
def run_load_processes(settings: HttpSettings, scenario: str, num_requests: int, prompt_tokens: int,
                       output_tokens: int, *, processes: int, concurrency: int, seed: int = 0,
                       duration_s: float | None = None, max_connections: int = 256) -> RunResult:
    """``run_load`` over ``processes`` client processes started together: process i sends the requests whose index
    is i modulo ``processes``, with its share of the ``concurrency`` users; the records come back merged on one
    clock (each process's start, by the wall clock), and the duration runs from the first send to the last end."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        ready = manager.Barrier(processes)  # every child has its client and the model id before any sends
        futures = [pool.submit(_process_share, settings, scenario, num_requests, prompt_tokens, output_tokens, i,
                               processes, concurrency, seed, duration_s, max_connections, ready)
                   for i in range(processes)]
        shares = [f.result() for f in futures]
    # NOTE(bench): each share's records count from its own run_load start (its started_at_s, by the wall clock)
    starts = [result.started_at_s or t0 for t0, result in shares]
    first = min(starts)
    records = []
    for start, (_, result) in zip(starts, shares):
        for record in result.records:
            record.start_s += start - first
            records.append(record)
    end = max(start - first + result.duration_s for start, (_, result) in zip(starts, shares))
    return RunResult(records=sorted(records, key=lambda r: r.index), duration_s=end,
                     num_not_sent=sum(result.num_not_sent for _, result in shares), started_at_s=first)


def _process_share(settings: HttpSettings, scenario: str, num_requests: int, prompt_tokens: int, output_tokens: int,
                   share: int, processes: int, concurrency: int, seed: int, duration_s: float | None,
                   max_connections: int, ready: Any) -> tuple[float, RunResult]:
    """One client process of ``run_load_processes``: (its start by the wall clock, its RunResult)."""
    from bench.scenarios import iter_requests

    async def main() -> tuple[float, RunResult]:
        backend = HttpBackend(settings, max_connections=max_connections)
        try:
            await backend.prepare()
            specs = [s for s in iter_requests(scenario, num_requests, prompt_tokens, output_tokens, seed=seed)
                     if s.index % processes == share]
            users = concurrency // processes + (1 if share < concurrency % processes else 0)
            await asyncio.to_thread(ready.wait, 120)
            t0 = time.time()
            result = await run_load(backend, specs, len(specs), concurrency=max(1, users), duration_s=duration_s,
                                    progress=False)
            return t0, result
        finally:
            await backend.aclose()
    return asyncio.run(main())
